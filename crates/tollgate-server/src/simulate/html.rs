//! `report.html`: one self-contained page (inline CSS and SVG, no scripts) with the
//! summary table and the charts of a [`Report`].

use std::fmt::Write as _;

use tollgate::clock::NANOS_PER_SEC;

use super::report::{Outcome, Report};

/// The colours of the algorithms, in the report's order.
const COLORS: [&str; 8] = [
    "#d62728", "#ff7f0e", "#2ca02c", "#1f77b4", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];
const OFFERED: &str = "#9a9a9a";
const LIMIT: &str = "#111";

/// Escapes text for HTML and SVG.
fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A round step for about `ticks` ticks up to `max`.
fn nice_step(max: f64, ticks: f64) -> f64 {
    let raw = (max / ticks).max(f64::MIN_POSITIVE);
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let nice = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

/// A number for an axis label.
fn label(v: f64) -> String {
    if v == v.trunc() && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v:.2}")
    }
}

/// One line of a chart.
struct Series<'a> {
    name: &'a str,
    color: &'a str,
    values: Vec<f64>,
    dashed: bool,
}

const W: f64 = 1000.0;
const PAD_L: f64 = 60.0;
const PAD_R: f64 = 20.0;
const PAD_T: f64 = 30.0;
const PAD_B: f64 = 40.0;

/// A line chart: x in seconds (`step` a point, titled `x_title`), y from 0 to
/// the largest value (at least 1); horizontal lines at `marks`.
fn line_chart(
    title: &str,
    x_title: &str,
    y_title: &str,
    series: &[Series<'_>],
    step: f64,
    height: f64,
    marks: &[(f64, String)],
) -> String {
    let n = series
        .iter()
        .map(|s| s.values.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let y_max = series
        .iter()
        .flat_map(|s| s.values.iter().copied())
        .chain(marks.iter().map(|m| m.0))
        .fold(1.0, f64::max)
        * 1.08;
    let x_max = n as f64 * step;
    let (pw, ph) = (W - PAD_L - PAD_R, height - PAD_T - PAD_B);
    let x = |v: f64| PAD_L + v / x_max * pw;
    let y = |v: f64| PAD_T + ph - v / y_max * ph;
    let mut svg = format!(
        "<svg class=\"chart\" viewBox=\"0 0 {W} {height}\" width=\"{W}\" height=\"{height}\" \
         xmlns=\"http://www.w3.org/2000/svg\" role=\"img\" aria-label=\"{t}\">\
         <title>{t}</title>",
        t = esc(title)
    );
    let ystep = nice_step(y_max, 5.0);
    let mut v = 0.0;
    while v <= y_max {
        let _ = write!(
            svg,
            "<line x1=\"{PAD_L}\" x2=\"{}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" stroke=\"#e4e4e4\"/>\
             <text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\" class=\"tick\">{}</text>",
            W - PAD_R,
            PAD_L - 6.0,
            y(v) + 4.0,
            label(v),
            yy = y(v)
        );
        v += ystep;
    }
    let xstep = nice_step(x_max, 10.0);
    let mut v = 0.0;
    while v <= x_max + 1e-9 {
        let _ = write!(
            svg,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" class=\"tick\">{}s</text>",
            x(v),
            PAD_T + ph + 16.0,
            label(v)
        );
        v += xstep;
    }
    let _ = write!(
        svg,
        "<text x=\"14\" y=\"{:.1}\" transform=\"rotate(-90 14 {:.1})\" text-anchor=\"middle\" \
         class=\"tick\">{}</text>",
        PAD_T + ph / 2.0,
        PAD_T + ph / 2.0,
        esc(y_title)
    );
    for s in series {
        let mut points = String::new();
        for (i, &v) in s.values.iter().enumerate() {
            let _ = write!(points, "{:.1},{:.1} ", x(i as f64 * step), y(v));
            let _ = write!(points, "{:.1},{:.1} ", x((i + 1) as f64 * step), y(v));
        }
        let _ = write!(
            svg,
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\"{} points=\"{}\"/>",
            s.color,
            if s.dashed {
                " stroke-dasharray=\"4 3\""
            } else {
                ""
            },
            points.trim_end()
        );
    }
    for (v, text) in marks {
        let _ = write!(
            svg,
            "<line x1=\"{PAD_L}\" x2=\"{}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" stroke=\"{LIMIT}\" \
             stroke-dasharray=\"6 4\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\" \
             class=\"mark\">{}</text>",
            W - PAD_R,
            W - PAD_R - 4.0,
            y(*v) - 4.0,
            esc(text),
            yy = y(*v)
        );
    }
    let mut lx = PAD_L + 4.0;
    for s in series {
        let _ = write!(
            svg,
            "<rect x=\"{lx:.1}\" y=\"8\" width=\"12\" height=\"12\" fill=\"{}\"/>\
             <text x=\"{:.1}\" y=\"18\" class=\"legend\">{}</text>",
            s.color,
            lx + 16.0,
            esc(s.name)
        );
        lx += 30.0 + 7.5 * s.name.len() as f64;
    }
    svg.push_str(&format!(
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" class=\"tick\">{}</text></svg>",
        PAD_L + pw / 2.0,
        height - 4.0,
        esc(x_title)
    ));
    svg
}

/// Horizontal bars, one per row, with a vertical line at `mark`.
fn bar_chart(title: &str, rows: &[(&str, &str, f64)], mark: Option<(f64, String)>) -> String {
    let row_h = 28.0;
    let height = PAD_T + rows.len() as f64 * row_h + PAD_B;
    let left = 140.0;
    let pw = W - left - 80.0;
    let max = rows
        .iter()
        .map(|r| r.2)
        .chain(mark.iter().map(|m| m.0))
        .fold(1.0, f64::max)
        * 1.05;
    let x = |v: f64| left + v / max * pw;
    let mut svg = format!(
        "<svg class=\"chart\" viewBox=\"0 0 {W} {height}\" width=\"{W}\" height=\"{height}\" \
         xmlns=\"http://www.w3.org/2000/svg\" role=\"img\" aria-label=\"{t}\"><title>{t}</title>",
        t = esc(title)
    );
    for (i, (name, color, v)) in rows.iter().enumerate() {
        let top = PAD_T + i as f64 * row_h;
        let _ = write!(
            svg,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" class=\"legend\">{}</text>\
             <rect x=\"{left}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{color}\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" class=\"tick\">{}</text>",
            left - 8.0,
            top + row_h * 0.65,
            esc(name),
            top + 4.0,
            (x(*v) - left).max(0.5),
            row_h - 8.0,
            x(*v) + 6.0,
            top + row_h * 0.65,
            label(*v)
        );
    }
    if let Some((v, text)) = mark {
        let bottom = PAD_T + rows.len() as f64 * row_h;
        let _ = write!(
            svg,
            "<line x1=\"{xx:.1}\" x2=\"{xx:.1}\" y1=\"{}\" y2=\"{:.1}\" stroke=\"{LIMIT}\" \
             stroke-width=\"2\" stroke-dasharray=\"6 4\"/><text x=\"{xx:.1}\" y=\"{:.1}\" \
             text-anchor=\"middle\" class=\"mark\">{}</text>",
            PAD_T - 6.0,
            bottom + 6.0,
            bottom + 22.0,
            esc(&text),
            xx = x(v)
        );
    }
    svg.push_str("</svg>");
    svg
}

fn color(i: usize) -> &'static str {
    COLORS[i % COLORS.len()]
}

fn summary(report: &Report) -> String {
    let mut t = String::from(
        "<table><thead><tr><th>algorithm</th><th>offered</th><th>admitted</th>\
         <th>most in any window (limit)</th><th>wrong vs exact</th><th>admitted, exact rejects</th>\
         <th>rejected, exact admits</th><th>Retry-After min / mean / max</th></tr></thead><tbody>",
    );
    for (i, o) in report.outcomes.iter().enumerate() {
        let over = o.max_in_any_window > report.requests_per_unit;
        let ra = &o.retry_after;
        let _ = write!(
            t,
            "<tr><td><span class=\"swatch\" style=\"background:{}\"></span>{}{}</td><td>{}</td>\
             <td>{}</td><td class=\"{}\">{} ({:.2}× the limit)</td><td>{:.4} %</td><td>{}</td>\
             <td>{}</td><td>{}</td></tr>",
            color(i),
            esc(&o.name),
            o.burst.map_or(String::new(), |b| format!(" (burst {b})")),
            o.offered,
            o.admitted,
            if over { "over" } else { "within" },
            o.max_in_any_window,
            o.max_in_any_window as f64 / report.requests_per_unit.max(1) as f64,
            o.wrong_percent(),
            o.more,
            o.fewer,
            if ra.count == 0 {
                "none".to_string()
            } else {
                let shown = |n: u64| {
                    if n < 1_000 {
                        format!("{n}ns")
                    } else {
                        crate::HumanDuration(std::time::Duration::from_nanos(n)).to_string()
                    }
                };
                let mean = (ra.sum / u128::from(ra.count)).min(u128::from(u64::MAX)) as u64;
                format!("{} / {} / {}", shown(ra.min), shown(mean), shown(ra.max))
            }
        );
    }
    t.push_str("</tbody></table>");
    t
}

fn retry_after(report: &Report) -> String {
    // The header values: per algorithm its five most frequent, and the rest together.
    let mut labels: Vec<(String, usize, f64)> = Vec::new();
    for (i, o) in report.outcomes.iter().enumerate() {
        let mut by_count: Vec<(u64, u64)> =
            o.retry_after.header.iter().map(|(s, n)| (*s, *n)).collect();
        by_count.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let rest: u64 = by_count.iter().skip(5).map(|e| e.1).sum();
        by_count.truncate(5);
        by_count.sort();
        for (secs, n) in by_count {
            labels.push((format!("{}: {secs} s", o.name), i, n as f64));
        }
        if rest > 0 {
            labels.push((format!("{}: other", o.name), i, rest as f64));
        }
        if o.retry_after.never > 0 {
            labels.push((format!("{}: never", o.name), i, o.retry_after.never as f64));
        }
    }
    let mut out = String::new();
    if labels.is_empty() {
        out.push_str("<p>No rejections.</p>");
        return out;
    }
    let rows: Vec<(&str, &str, f64)> = labels
        .iter()
        .map(|(l, i, n)| (l.as_str(), color(*i), *n))
        .collect();
    out.push_str("<h3>The Retry-After header (whole seconds, rounded up)</h3>");
    out.push_str(&bar_chart(
        "Retry-After header values given, per algorithm",
        &rows,
        None,
    ));
    let unit = report.unit.name().to_ascii_lowercase();
    let _ = write!(
        out,
        "<h3>The exact retry times, by tenth of a {unit}</h3><p class=\"note\">How many \
         rejections were told to retry within each tenth of the limit's unit; the last point: \
         a {unit} or more.</p>"
    );
    let series = per_algorithm(report, |o| {
        o.retry_after.tenths.iter().map(|&n| n as f64).collect()
    });
    out.push_str(&line_chart(
        &format!("Retry times given, by tenth of a {unit}"),
        "retry after",
        "rejections",
        &series,
        report.unit.seconds() as f64 / 10.0,
        260.0,
        &[],
    ));
    out
}

/// One line per algorithm, in its colour, of the values `of` its outcome.
fn per_algorithm<'a>(report: &'a Report, of: impl Fn(&Outcome) -> Vec<f64>) -> Vec<Series<'a>> {
    report
        .outcomes
        .iter()
        .enumerate()
        .map(|(i, o)| Series {
            name: &o.name,
            color: color(i),
            values: of(o),
            dashed: false,
        })
        .collect()
}

/// A count per bucket as a rate a second, each bucket divided by its real length (the
/// last one may be cut short by the run's end).
fn per_second(report: &Report, counts: impl Iterator<Item = u64>) -> Vec<f64> {
    counts
        .enumerate()
        .map(|(i, n)| {
            let from = i as u64 * report.bucket;
            let len = report.bucket.min(report.duration.saturating_sub(from));
            if len == 0 {
                0.0
            } else {
                n as f64 * NANOS_PER_SEC as f64 / len as f64
            }
        })
        .collect()
}

/// The page.
pub fn page(report: &Report) -> String {
    let step = report.bucket as f64 / NANOS_PER_SEC as f64;
    let per = if report.bucket == NANOS_PER_SEC {
        "second".to_string()
    } else {
        format!("{} seconds", report.bucket / NANOS_PER_SEC)
    };
    let limit = report.requests_per_unit as f64;
    let unit = report.unit.name().to_ascii_lowercase();
    let limit_text = format!("limit: {} per {unit}", report.requests_per_unit);
    let mut body = String::new();
    let _ = write!(
        body,
        "<h1>tollgate simulate</h1><p class=\"lede\">Pattern <code>{}</code> against \
         <code>{}</code>: {} per {unit}; {} requests on {} key{} over {} s; \
         algorithms: {} (seed {}).</p>",
        esc(&report.pattern),
        esc(&report.descriptor),
        report.requests_per_unit,
        report.outcomes.first().map_or(0, |o| o.offered),
        report.keys,
        if report.keys == 1 { "" } else { "s" },
        label(report.duration as f64 / NANOS_PER_SEC as f64),
        if report.mode == "all" {
            "the rule's numbers under every algorithm, buckets as big as the limit"
        } else {
            "the rule as configured"
        },
        report.seed
    );
    body.push_str("<h2>Summary</h2>");
    body.push_str(&summary(report));
    body.push_str(
        "<p class=\"note\">Wrong vs exact: the share of requests an algorithm decided \
         otherwise than the exact sliding log of the same numbers on the same traffic.</p>",
    );

    let _ = write!(
        body,
        "<h2>The most admitted in any window of one {unit}, against the limit</h2>"
    );
    let rows: Vec<(&str, &str, f64)> = report
        .outcomes
        .iter()
        .enumerate()
        .map(|(i, o)| (o.name.as_str(), color(i), o.max_in_any_window as f64))
        .collect();
    body.push_str(&bar_chart(
        &format!("Most admitted in any one-{unit} window, per algorithm"),
        &rows,
        Some((limit, limit_text.clone())),
    ));
    let series = per_algorithm(report, |o| {
        o.buckets.iter().map(|b| b.window_max as f64).collect()
    });
    body.push_str(&line_chart(
        &format!("Admitted in the {unit} before each admission (highest per {per})"),
        "time",
        &format!("admitted in one {unit}"),
        &series,
        step,
        320.0,
        &[(limit, limit_text)],
    ));

    let _ = write!(body, "<h2>Offered and admitted, per {per}</h2>");
    for (i, o) in report.outcomes.iter().enumerate() {
        let offered = Series {
            name: "offered",
            color: OFFERED,
            values: per_second(report, o.buckets.iter().map(|b| b.offered)),
            dashed: false,
        };
        let admitted = Series {
            name: &o.name,
            color: color(i),
            values: per_second(report, o.buckets.iter().map(|b| b.admitted)),
            dashed: false,
        };
        body.push_str(&line_chart(
            &format!("{}: offered and admitted requests a second", o.name),
            "time",
            "requests / s",
            &[offered, admitted],
            step,
            220.0,
            &[],
        ));
    }

    body.push_str("<h2>Retry-After values given</h2>");
    body.push_str(&retry_after(report));

    let _ = write!(
        body,
        "<h2>Where decisions differ from the exact sliding log, per {per}</h2>\
         <p class=\"note\">Solid: admitted where the sliding log rejected; dashed: rejected \
         where it admitted.</p>"
    );
    for (i, o) in report.outcomes.iter().enumerate() {
        let more = Series {
            name: "admitted, exact rejects",
            color: color(i),
            values: o.buckets.iter().map(|b| b.more as f64).collect(),
            dashed: false,
        };
        let fewer = Series {
            name: "rejected, exact admits",
            color: color(i),
            values: o.buckets.iter().map(|b| b.fewer as f64).collect(),
            dashed: true,
        };
        let _ = write!(
            body,
            "<h3>{} — {:.4} % wrong</h3>",
            esc(&o.name),
            o.wrong_percent()
        );
        body.push_str(&line_chart(
            &format!(
                "{}: decisions that differ from the exact sliding log",
                o.name
            ),
            "time",
            "requests",
            &[more, fewer],
            step,
            200.0,
            &[],
        ));
    }

    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>tollgate simulate: {}</title><style>{STYLE}</style></head><body>{body}\
         </body></html>\n",
        esc(&report.pattern)
    )
}

const STYLE: &str = "body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1040px;\
color:#222}h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}\
h3{font-size:15px;margin:16px 0 4px}table{border-collapse:collapse;width:100%}\
th,td{border:1px solid #ddd;padding:4px 8px;text-align:right}th:first-child,td:first-child\
{text-align:left}td.over{color:#b00;font-weight:600}.swatch{display:inline-block;width:10px;\
height:10px;margin-right:6px}svg.chart{display:block;max-width:100%;height:auto;margin:6px 0}\
.tick{font-size:11px;fill:#555}.legend{font-size:12px;fill:#222}.mark{font-size:12px;fill:#111;\
font-weight:600}.note{color:#555}code{background:#f3f3f3;padding:1px 4px}";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::report::{Bucket, Outcome};

    #[test]
    fn the_page_escapes_input_and_draws_its_charts() {
        let report = Report {
            pattern: "replay:<x>.csv".into(),
            requests_per_unit: 10,
            unit: tollgate::rules::Unit::Second,
            mode: "all",
            descriptor: "api user=a&b".into(),
            duration: 3 * NANOS_PER_SEC,
            bucket: NANOS_PER_SEC,
            keys: 2,
            seed: 1,
            outcomes: vec![Outcome {
                name: "fixed_window".into(),
                offered: 30,
                admitted: 20,
                max_in_any_window: 20,
                buckets: vec![
                    Bucket {
                        offered: 10,
                        admitted: 10,
                        ..Bucket::default()
                    };
                    3
                ],
                ..Outcome::default()
            }],
        };
        let page = page(&report);
        assert!(page.contains("replay:&lt;x&gt;.csv") && page.contains("user=a&amp;b"));
        assert!(!page.contains("<x>") && !page.contains("<script"));
        assert!(page.matches("<svg").count() >= 4, "{page}");
        assert!(page.contains("2.00× the limit"));
    }

    #[test]
    fn a_partial_last_second_is_divided_by_its_real_length() {
        let report = Report {
            pattern: "steady:10".into(),
            requests_per_unit: 10,
            unit: tollgate::rules::Unit::Second,
            mode: "rule",
            descriptor: "api user=a".into(),
            duration: 3 * NANOS_PER_SEC / 2,
            bucket: NANOS_PER_SEC,
            keys: 1,
            seed: 1,
            outcomes: Vec::new(),
        };
        // 10 in the first second, 5 in the half second after it: 10 a second in both.
        assert_eq!(per_second(&report, [10, 5].into_iter()), vec![10.0, 10.0]);
        let report = Report {
            duration: 5 * NANOS_PER_SEC,
            bucket: 2 * NANOS_PER_SEC,
            ..report
        };
        assert_eq!(
            per_second(&report, [20, 20, 10].into_iter()),
            vec![10.0, 10.0, 10.0]
        );
    }
}
