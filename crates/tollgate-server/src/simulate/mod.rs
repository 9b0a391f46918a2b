//! `tollgate simulate`: runs a rule's limit (or the same numbers under every
//! algorithm) on a manual clock through the real [`Limiter`](tollgate::limiter::Limiter)
//! against a traffic pattern, and writes `report.html`, `report.json` and
//! `timeline.csv`: what each algorithm admitted, the most it let through in any window
//! of one unit, its Retry-After values, and where it decided otherwise than the exact
//! sliding log.

mod error;
mod html;
mod pattern;
mod progress;
mod report;
mod runs;
mod window;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, ValueEnum};
use tollgate::clock::{Nanos, NANOS_PER_SEC};
use tollgate::rules::{load, Domain, LoadOptions, Rule};

pub use error::SimulateError;
use pattern::{parse_duration, Pattern};
use progress::Progress;
use report::Report;
use runs::{algorithm_of, Run, ALGORITHMS, EXACT};

/// Settings of `tollgate simulate`.
#[derive(Debug, Clone, Args)]
pub struct SimulateArgs {
    /// The rule file (or a directory of rule files).
    #[arg(long)]
    pub config: PathBuf,
    /// The domain of the rule to simulate.
    #[arg(long)]
    pub domain: String,
    /// The descriptor whose rule is simulated: `key=value[,key=value]`. A replay
    /// file's values replace its last value.
    #[arg(long)]
    pub descriptor: String,
    /// The traffic: `steady:RATE`, `poisson:RATE`, `bursts:RATE:EVERY:SIZE`,
    /// `boundary:LIMIT`, `ramp:FROM:TO` (rates a second) or `replay:FILE.csv` (lines
    /// `seconds,value[,cost]`).
    #[arg(long)]
    pub pattern: String,
    /// Simulated time (`500ms`, `60s`, `5m`, `2h`, `1d`). Required but for `replay`,
    /// which otherwise runs to its last request.
    #[arg(long)]
    pub duration: Option<String>,
    /// `rule`: the matched rule as the file has it; `all`: its numbers under every
    /// algorithm (buckets as big as the limit).
    #[arg(long, value_enum, default_value = "rule")]
    pub algorithms: Algorithms,
    /// The directory to write report.html, report.json and timeline.csv to (created
    /// if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of the `poisson` pattern's random arrivals.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Log filter for stderr (tracing's `RUST_LOG` syntax): `info` tells what each step
    /// does (the traffic made, replay lines past --duration left out).
    #[arg(long, env = "TOLLGATE_LOG", default_value = "warn")]
    pub log: String,
}

/// Which algorithms `tollgate simulate` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Algorithms {
    /// The matched rule as configured.
    Rule,
    /// The rule's numbers under every algorithm.
    All,
}

/// The longest simulated time: ten years.
const MAX_DURATION: Nanos = 3_650 * 86_400 * NANOS_PER_SEC;

/// The most timeline buckets a report holds; longer runs widen them past a second.
const MAX_BUCKETS: u64 = 10_000;

/// The simulated clock's start: the first epoch-aligned window start after
/// 2001-09-09, so that fixed windows turn at the pattern's whole units.
fn start_of(unit_secs: u64) -> Nanos {
    (1_000_000_000 / unit_secs + 1) * unit_secs * NANOS_PER_SEC
}

/// Parses `key=value[,key=value]`.
fn parse_descriptor(text: &str) -> Result<Vec<(String, String)>, SimulateError> {
    let bad = |reason: &str| SimulateError::Descriptor {
        descriptor: text.to_string(),
        reason: reason.to_string(),
    };
    if text.trim().is_empty() {
        return Err(bad("empty; expected key=value[,key=value]"));
    }
    text.split(',')
        .map(|entry| match entry.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => {
                Ok((k.trim().to_string(), v.trim().to_string()))
            }
            _ => Err(bad("expected key=value[,key=value]")),
        })
        .collect()
}

/// Runs a simulation and writes its three files; returns the report.
pub fn simulate(args: &SimulateArgs) -> Result<Report, SimulateError> {
    let pattern: Pattern = args.pattern.parse()?;
    let duration = args
        .duration
        .as_deref()
        .map(parse_duration)
        .transpose()
        .map_err(SimulateError::Duration)?;
    match duration {
        Some(0) => return Err(SimulateError::Duration("must be above zero".into())),
        Some(d) if d > MAX_DURATION => {
            return Err(SimulateError::Duration(format!(
                "`{}` is longer than {}d",
                args.duration.as_deref().unwrap_or_default(),
                MAX_DURATION / 86_400 / NANOS_PER_SEC
            )))
        }
        _ => {}
    }
    let entries = parse_descriptor(&args.descriptor)?;
    let set = load(&[&args.config], LoadOptions::default()).map_err(|e| {
        let more = e.iter().count().saturating_sub(1);
        let first = e
            .iter()
            .next()
            .map_or_else(|| e.to_string(), ToString::to_string);
        SimulateError::Config(if more > 0 {
            format!("{first} (and {more} more)")
        } else {
            first
        })
    })?;
    let domain = set
        .domain(&args.domain)
        .ok_or_else(|| SimulateError::UnknownDomain {
            domain: args.domain.clone(),
            file: args.config.clone(),
        })?;
    let no_rule = |reason: &str| SimulateError::NoRule {
        descriptor: args.descriptor.clone(),
        domain: args.domain.clone(),
        reason: reason.to_string(),
    };
    let limit_of = |rule: &Rule| match rule.limits.first() {
        Some(limit) if !rule.unlimited => Ok(limit.clone()),
        _ => Err(no_rule(
            "its rule has no limit (unlimited or an allow-list entry)",
        )),
    };
    let matched = domain
        .find(&entries)
        .ok_or_else(|| no_rule("no rule matches it"))?;
    let limit = limit_of(matched.rule)?;
    let traffic = pattern.traffic(duration, limit.unit.nanos(), args.seed)?;
    if traffic.duration > MAX_DURATION {
        return Err(SimulateError::Duration(format!(
            "the replay runs {}s, longer than {}d: shorten it or give a shorter --duration",
            traffic.duration / NANOS_PER_SEC,
            MAX_DURATION / 86_400 / NANOS_PER_SEC
        )));
    }
    // A replay's values may match another rule than the descriptor's: the rule run is
    // the one they all match.
    let (rule, shared) = resolve(domain, &entries, &traffic)?;
    let limit = limit_of(rule)?;
    let (rpu, unit) = (limit.requests_per_unit, limit.unit);
    let unit_nanos = unit.nanos();
    let start = start_of(unit.seconds());
    let bucket = traffic
        .duration
        .div_ceil(MAX_BUCKETS)
        .div_ceil(NANOS_PER_SEC)
        .max(1)
        * NANOS_PER_SEC;
    let default = entries.last().map_or("", |e| e.1.as_str());
    tracing::info!(
        requests = traffic.arrivals.len(),
        keys = traffic.keys.len(),
        shared,
        requests_per_unit = rpu,
        unit = unit.name(),
        "simulating"
    );

    // The runs, the exact reference first.
    let mut runs = Vec::new();
    let exact = Run::generated(EXACT, rpu, unit, default, shared, start)?;
    match args.algorithms {
        Algorithms::All => {
            for name in ALGORITHMS.iter().filter(|&&n| n != EXACT) {
                runs.push(Run::generated(name, rpu, unit, default, shared, start)?);
            }
        }
        Algorithms::Rule => {
            let (name, burst) = algorithm_of(&limit);
            let set = load(&[&args.config], LoadOptions::default())
                .map_err(|e| SimulateError::Config(e.to_string()))?;
            runs.push(Run::rule(name, burst, set, &args.domain, &entries, start).shared(shared));
        }
    }
    let total = traffic.arrivals.len() as u64 * (runs.len() as u64 + 1);
    let mut progress = Progress::new(total);
    let played = (|| {
        let (exact_outcome, decisions) =
            exact.play(&traffic, start, unit_nanos, bucket, None, &mut progress)?;
        let mut outcomes = Vec::new();
        for run in runs {
            outcomes.push(
                run.play(
                    &traffic,
                    start,
                    unit_nanos,
                    bucket,
                    Some(&decisions),
                    &mut progress,
                )?
                .0,
            );
        }
        Ok::<_, SimulateError>((exact_outcome, outcomes))
    })();
    progress.finish();
    let (exact_outcome, mut outcomes) = played?;
    if args.algorithms == Algorithms::All {
        let at = ALGORITHMS.iter().position(|&n| n == EXACT).unwrap_or(0);
        outcomes.insert(at.min(outcomes.len()), exact_outcome);
    }
    let report = Report {
        pattern: args.pattern.clone(),
        requests_per_unit: rpu,
        unit,
        mode: match args.algorithms {
            Algorithms::Rule => "rule",
            Algorithms::All => "all",
        },
        descriptor: format!("{} {}", args.domain, args.descriptor),
        duration: traffic.duration,
        bucket,
        keys: traffic.keys.len(),
        seed: args.seed,
        outcomes,
    };
    write(&args.out, &report)?;
    Ok(report)
}

/// `key` or `key=value`, and where the rule file has it.
fn rule_name(rule: &Rule) -> String {
    match &rule.value {
        Some(v) => format!("`{}={v}` ({})", rule.key, rule.origin),
        None => format!("`{}` ({})", rule.key, rule.origin),
    }
}

/// Resolves each distinct descriptor of the traffic (`entries` with its last value
/// replaced by each replay value) with the domain's matching: the rule they all match,
/// and whether its values share one counter (`share_threshold` on the rule; one on an
/// ancestor shares that level, whose value the replay does not vary). Refuses traffic
/// whose values match different rules (or none), naming two of them.
fn resolve<'a>(
    domain: &'a Domain,
    entries: &[(String, String)],
    traffic: &pattern::Traffic,
) -> Result<(&'a Rule, bool), SimulateError> {
    let mut first: Option<(String, &Rule)> = None;
    let mut descriptor = entries.to_vec();
    for key in &traffic.keys {
        if let (Some(value), Some(last)) = (key, descriptor.last_mut()) {
            last.1.clone_from(value);
        }
        let value = descriptor.last().map_or("", |e| e.1.as_str());
        let rule = domain.find(&descriptor).map(|m| m.rule);
        match (&first, rule) {
            (None, Some(rule)) => first = Some((value.to_string(), rule)),
            (Some((_, a)), Some(b)) if std::ptr::eq(*a, b) => {}
            (first, rule) => {
                let (first, first_rule) = first.as_ref().map_or_else(
                    || (value.to_string(), "no rule".to_string()),
                    |(v, r)| (v.clone(), rule_name(r)),
                );
                return Err(SimulateError::MixedRules {
                    first,
                    first_rule,
                    other: value.to_string(),
                    other_rule: rule.map_or_else(|| "no rule".to_string(), rule_name),
                });
            }
        }
    }
    let rule = first.map(|f| f.1).ok_or_else(|| SimulateError::NoRule {
        descriptor: format!("{entries:?}"),
        domain: domain.name.to_string(),
        reason: "no traffic".into(),
    })?;
    Ok((rule, rule.share_threshold))
}

fn write(dir: &Path, report: &Report) -> Result<(), SimulateError> {
    let err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| SimulateError::Write { path, source }
    };
    std::fs::create_dir_all(dir).map_err(err(dir))?;
    let json = serde_json::to_string_pretty(&report::json(report)).unwrap_or_default();
    for (name, text) in [
        ("report.json", json + "\n"),
        ("timeline.csv", report::csv(report)),
        ("report.html", html::page(report)),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(err(&path))?;
    }
    Ok(())
}

/// `tollgate simulate`: runs and prints a summary line per algorithm, or the error.
pub fn main(args: &SimulateArgs) -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
    match simulate(args) {
        Ok(report) => {
            println!(
                "{} against {} per {}: {} requests on {} key(s)",
                report.pattern,
                report.requests_per_unit,
                report.unit.name().to_ascii_lowercase(),
                report.outcomes.first().map_or(0, |o| o.offered),
                report.keys
            );
            for o in &report.outcomes {
                println!(
                    "  {:<15} admitted {:>9}  max in a window {:>7}  wrong vs exact {:.4} %",
                    o.name,
                    o.admitted,
                    o.max_in_any_window,
                    o.wrong_percent()
                );
            }
            println!("wrote {}", args.out.join("report.html").display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tollgate simulate: {e}");
            ExitCode::FAILURE
        }
    }
}
