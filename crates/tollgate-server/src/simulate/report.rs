//! What a simulation measured ([`Report`], one [`Outcome`] per algorithm) and its
//! machine-readable forms: `report.json` and `timeline.csv`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{json, Map, Value};
use tollgate::clock::{Nanos, NANOS_PER_SEC};
use tollgate::rules::Unit;

/// One timeline bucket of an algorithm's run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bucket {
    /// Requests offered.
    pub offered: u64,
    /// Requests admitted.
    pub admitted: u64,
    /// Admitted where the exact sliding log rejected.
    pub more: u64,
    /// Rejected where the exact sliding log admitted.
    pub fewer: u64,
    /// The most a key had admitted in one unit, at an admission in this bucket.
    pub window_max: u64,
}

/// The Retry-After values an algorithm gave its rejections.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RetryAfter {
    /// Rejections with a retry time.
    pub count: u64,
    /// Rejections that may never pass (a cost above the limit).
    pub never: u64,
    /// The shortest, in nanoseconds.
    pub min: Nanos,
    /// The longest, in nanoseconds.
    pub max: Nanos,
    /// The sum, for the mean.
    pub sum: u128,
    /// How many rejections gave each `Retry-After` header value (whole seconds,
    /// rounded up).
    pub header: BTreeMap<u64, u64>,
    /// How many retry times fell in each tenth of the limit's unit (the last: a unit or
    /// more).
    pub tenths: [u64; 11],
    /// The limit's unit, for `tenths`.
    pub unit: Nanos,
}

impl RetryAfter {
    /// Records a rejection's retry time (`None`: never).
    pub fn record(&mut self, retry: Option<Nanos>) {
        let Some(r) = retry else {
            self.never += 1;
            return;
        };
        self.min = if self.count == 0 { r } else { self.min.min(r) };
        self.max = self.max.max(r);
        self.count += 1;
        self.sum += u128::from(r);
        *self.header.entry(r.div_ceil(NANOS_PER_SEC)).or_default() += 1;
        let tenth = (u128::from(r) * 10 / u128::from(self.unit.max(1))).min(10) as usize;
        self.tenths[tenth] += 1;
    }

    /// The mean, in seconds.
    pub fn mean_secs(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum as f64 / self.count as f64 / NANOS_PER_SEC as f64
        }
    }
}

/// One algorithm's run over the traffic.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// The algorithm's name, as in rule files.
    pub name: String,
    /// The bucket size, for the bucket algorithms.
    pub burst: Option<u64>,
    /// Requests offered.
    pub offered: u64,
    /// Requests admitted.
    pub admitted: u64,
    /// Cost offered.
    pub offered_cost: u64,
    /// Cost admitted.
    pub admitted_cost: u64,
    /// The most admitted cost in any window of one unit, per key, over the keys.
    pub max_in_any_window: u64,
    /// Where that window ends, from the start.
    pub max_window_at: Nanos,
    /// Admitted where the exact sliding log rejected.
    pub more: u64,
    /// Rejected where the exact sliding log admitted.
    pub fewer: u64,
    /// The timeline.
    pub buckets: Vec<Bucket>,
    /// Its rejections' retry times.
    pub retry_after: RetryAfter,
}

impl Outcome {
    /// The share of requests decided otherwise than by the exact sliding log, in percent.
    pub fn wrong_percent(&self) -> f64 {
        if self.offered == 0 {
            0.0
        } else {
            (self.more + self.fewer) as f64 * 100.0 / self.offered as f64
        }
    }
}

/// A whole simulation.
#[derive(Debug, Clone)]
pub struct Report {
    /// `--pattern`, as given.
    pub pattern: String,
    /// The matched rule's `requests_per_unit`.
    pub requests_per_unit: u64,
    /// Its unit.
    pub unit: Unit,
    /// `rule` or `all`.
    pub mode: &'static str,
    /// The domain and descriptor simulated.
    pub descriptor: String,
    /// Simulated time.
    pub duration: Nanos,
    /// The width of a timeline bucket.
    pub bucket: Nanos,
    /// Distinct keys in the traffic.
    pub keys: usize,
    /// `--seed`.
    pub seed: u64,
    /// One per algorithm run.
    pub outcomes: Vec<Outcome>,
}

fn secs(n: Nanos) -> f64 {
    n as f64 / NANOS_PER_SEC as f64
}

/// `report.json`.
pub fn json(report: &Report) -> Value {
    let mut algorithms = Map::new();
    for o in &report.outcomes {
        let header: Map<String, Value> = o
            .retry_after
            .header
            .iter()
            .map(|(s, n)| (s.to_string(), json!(n)))
            .collect();
        let mut entry = json!({
            "offered": o.offered,
            "admitted": o.admitted,
            "max_in_any_window": o.max_in_any_window,
            "wrong_vs_exact_percent": o.wrong_percent(),
            "rejected": o.offered - o.admitted,
            "offered_cost": o.offered_cost,
            "admitted_cost": o.admitted_cost,
            "max_window_ends_at_seconds": secs(o.max_window_at),
            "admitted_not_exact": o.more,
            "rejected_not_exact": o.fewer,
            "retry_after": {
                "count": o.retry_after.count,
                "never": o.retry_after.never,
                "min_seconds": secs(o.retry_after.min),
                "mean_seconds": o.retry_after.mean_secs(),
                "max_seconds": secs(o.retry_after.max),
                "header_seconds": header,
                "by_tenth_of_unit": o.retry_after.tenths,
            },
        });
        if let (Some(burst), Some(map)) = (o.burst, entry.as_object_mut()) {
            map.insert("burst".into(), json!(burst));
        }
        algorithms.insert(o.name.clone(), entry);
    }
    json!({
        "pattern": report.pattern,
        "limit": {
            "requests_per_unit": report.requests_per_unit,
            "unit": report.unit.name().to_ascii_lowercase(),
        },
        "algorithms": algorithms,
        "mode": report.mode,
        "descriptor": report.descriptor,
        "duration_seconds": secs(report.duration),
        "keys": report.keys,
        "seed": report.seed,
    })
}

/// `timeline.csv`: one row per bucket (a second, or more on long runs): its start,
/// the requests offered, and per algorithm those admitted and those decided otherwise
/// than by the exact sliding log.
pub fn csv(report: &Report) -> String {
    let mut out = String::from("second,offered");
    for o in &report.outcomes {
        let _ = write!(out, ",admitted_{0},differ_{0}", o.name);
    }
    out.push('\n');
    let rows = report.outcomes.first().map_or(0, |o| o.buckets.len());
    for i in 0..rows {
        let offered = report.outcomes[0].buckets[i].offered;
        let _ = write!(
            out,
            "{},{offered}",
            i as u64 * report.bucket / NANOS_PER_SEC
        );
        for o in &report.outcomes {
            let b = o.buckets[i];
            let _ = write!(out, ",{},{}", b.admitted, b.more + b.fewer);
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_headers_up_and_counts_never() {
        let mut r = RetryAfter {
            unit: NANOS_PER_SEC,
            ..RetryAfter::default()
        };
        r.record(Some(NANOS_PER_SEC / 2));
        r.record(Some(NANOS_PER_SEC));
        r.record(Some(NANOS_PER_SEC + 1));
        r.record(None);
        assert_eq!(
            (r.count, r.never, r.min, r.max),
            (3, 1, NANOS_PER_SEC / 2, NANOS_PER_SEC + 1)
        );
        assert_eq!(r.header, BTreeMap::from([(1, 2), (2, 1)]));
        assert_eq!(r.tenths, [0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 2]);
    }
}
