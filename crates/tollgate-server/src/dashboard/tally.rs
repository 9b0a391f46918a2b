//! [`Tally`]: what the dashboard counts beside the Prometheus metrics (decisions, their
//! time, store failures and fallbacks), and the per-second history a ticker
//! ([`tick`]) samples from them and from each rule's counters.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use tokio::sync::watch;

use crate::service::Service;

use super::SKETCHED_RULES;

/// Seconds of history kept.
pub(crate) const HISTORY_SECONDS: usize = 60;

/// How often the history is sampled.
pub(crate) const TICK: Duration = Duration::from_secs(1);

/// One rule's counts so far, as [`Metrics::rule_counts`](crate::metrics::Metrics)
/// reads them.
#[derive(Debug, Clone)]
pub(crate) struct RuleCount {
    pub domain: String,
    pub descriptor: String,
    /// Hits: total, over limit, near limit, within limit, shadow.
    pub counts: [u64; 5],
    /// Its hottest keys, if the rule is sketched.
    pub hot: Option<Vec<tollgate::sketch::HeavyHitter>>,
}

/// One second of the whole service: rates per second over the last tick.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Point {
    /// When (Unix seconds).
    pub at_unix: u64,
    /// Requests decided.
    pub decisions: f64,
    /// Hits over every limited rule, then of them: within limit, over limit, near
    /// limit, shadow (would have been refused).
    pub hits: f64,
    pub ok: f64,
    pub over_limit: f64,
    pub near_limit: f64,
    pub shadow: f64,
    /// Mean time to decide a request (store round trip included), in microseconds.
    pub decision_micros: f64,
    /// Requests the store failed to decide.
    pub store_failures: f64,
    /// Mean round trip of the Redis calls answered in the second, in microseconds (0:
    /// none, or no Redis).
    pub redis_micros: f64,
}

/// One rule's rates per second over the last [`HISTORY_SECONDS`]: total, over limit,
/// near limit, within limit, shadow.
pub(crate) type RuleRates = VecDeque<[f64; 5]>;

/// A rule's (domain, path).
pub(crate) type RuleName = (String, String);

/// [`Tally::history`]: the points, each rule's history, each rule's latest rates.
pub(crate) type History3 = (
    Vec<Point>,
    HashMap<RuleName, Vec<[f64; 5]>>,
    HashMap<RuleName, [f64; 5]>,
);

/// A sample: when, the service's [`Tally::totals`], each rule's counts, and Redis's
/// answered calls and their summed round trips (ns).
type Sample = (Instant, [u64; 4], HashMap<RuleName, [u64; 5]>, [u64; 2]);

#[derive(Default)]
struct History {
    /// The previous sample: when, the service's counters, each rule's counts.
    last: Option<Sample>,
    points: VecDeque<Point>,
    rules: HashMap<RuleName, RuleRates>,
    /// Every rule's rates over the last tick, those without a history of their own too.
    latest: HashMap<RuleName, [f64; 5]>,
}

/// The dashboard's counters and history (one per [`Metrics`](crate::metrics::Metrics)).
#[derive(Default)]
pub(crate) struct Tally {
    decisions: AtomicU64,
    nanos: AtomicU64,
    store_failures: AtomicU64,
    fallback_hits: AtomicU64,
    history: Mutex<History>,
}

impl Tally {
    /// Counts a decided request that took `seconds`, and whether the store failed it.
    pub(crate) fn decided(&self, seconds: f64, store_failed: bool) {
        self.decisions.fetch_add(1, Ordering::Relaxed);
        self.nanos
            .fetch_add((seconds * 1e9) as u64, Ordering::Relaxed);
        if store_failed {
            self.store_failures.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts `hits` decided by a rule's `failure_mode` because the store failed.
    pub(crate) fn fell_back(&self, hits: u64) {
        self.fallback_hits.fetch_add(hits, Ordering::Relaxed);
    }

    /// Requests decided, their total time in nanoseconds, requests the store failed,
    /// hits decided by a `failure_mode`.
    pub(crate) fn totals(&self) -> [u64; 4] {
        [
            self.decisions.load(Ordering::Relaxed),
            self.nanos.load(Ordering::Relaxed),
            self.store_failures.load(Ordering::Relaxed),
            self.fallback_hits.load(Ordering::Relaxed),
        ]
    }

    /// Adds a point to the history: the rates since the previous sample, from these
    /// `rules`' counts (at most [`SKETCHED_RULES`] of them keep a history of their own)
    /// and `redis`'s answered calls and their summed round trips in ns (zeros without
    /// Redis).
    pub(crate) fn sample(&self, now: Instant, rules: &[RuleCount], redis: [u64; 2]) {
        let totals = self.totals();
        let counts: HashMap<RuleName, [u64; 5]> = rules
            .iter()
            .map(|r| ((r.domain.clone(), r.descriptor.clone()), r.counts))
            .collect();
        let mut h = self.history.lock();
        let Some((then, before, before_rules, redis_before)) = h.last.take() else {
            h.last = Some((now, totals, counts, redis));
            return;
        };
        let answered = redis[0].saturating_sub(redis_before[0]);
        let seconds = now.saturating_duration_since(then).as_secs_f64().max(1e-3);
        let rate = |now: u64, then: u64| now.saturating_sub(then) as f64 / seconds;
        let decided = totals[0].saturating_sub(before[0]);
        let mut point = Point {
            at_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            decisions: rate(totals[0], before[0]),
            decision_micros: if decided == 0 {
                0.0
            } else {
                totals[1].saturating_sub(before[1]) as f64 / decided as f64 / 1e3
            },
            store_failures: rate(totals[2], before[2]),
            redis_micros: if answered == 0 {
                0.0
            } else {
                redis[1].saturating_sub(redis_before[1]) as f64 / answered as f64 / 1e3
            },
            ..Point::default()
        };
        h.latest.clear();
        for (rule, now_counts) in &counts {
            let then_counts = before_rules.get(rule).copied().unwrap_or_default();
            let r: [f64; 5] = std::array::from_fn(|i| rate(now_counts[i], then_counts[i]));
            h.latest.insert(rule.clone(), r);
            point.hits += r[0];
            point.over_limit += r[1];
            point.near_limit += r[2];
            point.ok += r[3];
            point.shadow += r[4];
            if h.rules.len() < SKETCHED_RULES || h.rules.contains_key(rule) {
                let ring = h.rules.entry(rule.clone()).or_default();
                if ring.len() == HISTORY_SECONDS {
                    ring.pop_front();
                }
                ring.push_back(r);
            }
        }
        if h.points.len() == HISTORY_SECONDS {
            h.points.pop_front();
        }
        h.points.push_back(point);
        h.last = Some((now, totals, counts, redis));
    }

    /// The service's points, oldest first, each rule's rates (for the rules that keep a
    /// history), and every rule's rates over the last tick.
    pub(crate) fn history(&self) -> History3 {
        let h = self.history.lock();
        (
            h.points.iter().copied().collect(),
            h.rules
                .iter()
                .map(|(k, v)| (k.clone(), v.iter().copied().collect()))
                .collect(),
            h.latest.clone(),
        )
    }
}

/// Samples the history every [`TICK`] until `stop`.
pub(crate) async fn tick(service: Arc<Service>, mut stop: watch::Receiver<bool>) {
    let mut every = tokio::time::interval(TICK);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
        let metrics = &service.metrics;
        let redis = service.limiter.store().redis().map_or([0, 0], |r| {
            let s = r.stats();
            [s.answered, s.answered_nanos]
        });
        metrics
            .dashboard
            .sample(Instant::now(), &metrics.rule_counts(0), redis);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(total: u64, over: u64) -> RuleCount {
        RuleCount {
            domain: "d".into(),
            descriptor: "k".into(),
            counts: [total, over, 0, total - over, 0],
            hot: None,
        }
    }

    #[test]
    fn rates_are_the_differences_per_second() {
        let tally = Tally::default();
        let t0 = Instant::now();
        tally.sample(t0, &[rule(0, 0)], [100, 0]);
        for _ in 0..10 {
            tally.decided(0.000_2, false);
        }
        // 8 Redis calls answered in 1.2 ms in all: 150 µs each.
        tally.sample(
            t0 + Duration::from_secs(2),
            &[rule(20, 4)],
            [108, 1_200_000],
        );
        let (points, rules, latest) = tally.history();
        assert_eq!(
            latest[&("d".into(), "k".into())],
            [10.0, 2.0, 0.0, 8.0, 0.0]
        );
        assert_eq!(points.len(), 1);
        let p = points[0];
        assert_eq!(
            (p.decisions, p.hits, p.over_limit, p.ok),
            (5.0, 10.0, 2.0, 8.0)
        );
        assert!((p.decision_micros - 200.0).abs() < 1.0);
        assert!((p.redis_micros - 150.0).abs() < 1e-9, "{}", p.redis_micros);
        assert_eq!(
            rules[&("d".into(), "k".into())],
            vec![[10.0, 2.0, 0.0, 8.0, 0.0]]
        );
        for s in 3..100 {
            tally.sample(
                t0 + Duration::from_secs(s),
                &[rule(20, 4)],
                [108, 1_200_000],
            );
        }
        assert_eq!(tally.history().0.len(), HISTORY_SECONDS);
    }
}
