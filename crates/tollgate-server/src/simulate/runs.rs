//! One algorithm's run: a [`Limiter`] on its own [`MemoryStore`] and manual clock,
//! fed the traffic request by request, measuring what it admitted.

use std::sync::Arc;

use tollgate::algorithm::Algorithm;
use tollgate::clock::{ManualClock, Nanos};
use tollgate::decision::NEVER;
use tollgate::limiter::{Code, Limiter, RateLimitRequest};
use tollgate::rules::{from_str, RuleLimit, RuleSet, Rules, Unit};
use tollgate::store::MemoryStore;

use super::pattern::Traffic;
use super::progress::Progress;
use super::report::{Bucket, Outcome, RetryAfter};
use super::window::WindowMax;
use super::SimulateError;

/// The algorithms `--algorithms all` compares, in the report's order.
pub const ALGORITHMS: [&str; 6] = tollgate::algorithm::NAMES;

/// The exact reference every run is compared with.
pub const EXACT: &str = "sliding_log";

/// A limiter ready to be fed: its name, its clock and one request, whose last value
/// each arrival sets to its key's (no copy of the keys per run).
pub struct Run {
    /// The algorithm's name.
    pub name: String,
    /// The bucket size, for the bucket algorithms.
    pub burst: Option<u64>,
    limiter: Limiter<MemoryStore>,
    clock: ManualClock,
    request: RateLimitRequest,
    /// Whether each arrival sets the request's last value to its key's.
    vary: bool,
    /// All keys share one counter (`share_threshold`): one window for them all.
    shared: bool,
}

/// The rule-file name of a limit's algorithm, and its bucket size if it has one.
pub fn algorithm_of(limit: &RuleLimit) -> (&'static str, Option<u64>) {
    match limit.limit.algorithm() {
        Algorithm::FixedWindow(_) => ("fixed_window", None),
        Algorithm::SlidingWindow(_) => ("sliding_window", None),
        Algorithm::SlidingLog(_) => ("sliding_log", None),
        Algorithm::TokenBucket(t) => ("token_bucket", Some(t.burst)),
        Algorithm::Gcra(g) => ("gcra", Some(g.burst)),
        Algorithm::LeakyBucket(l) => ("leaky_bucket", Some(l.burst)),
    }
}

impl Run {
    /// `requests_per_unit` per `unit` under `algorithm` (buckets as big as the limit),
    /// on a one-rule domain whose key takes each traffic key's value (`default` for the
    /// synthetic patterns' one key).
    pub fn generated(
        algorithm: &str,
        requests_per_unit: u64,
        unit: Unit,
        default: &str,
        shared: bool,
        start: Nanos,
    ) -> Result<Self, SimulateError> {
        let bucket = matches!(algorithm, "token_bucket" | "gcra" | "leaky_bucket");
        let burst = if bucket {
            format!(", burst: {requests_per_unit}")
        } else {
            String::new()
        };
        let yaml = format!(
            "domain: simulate\ndescriptors:\n  - key: key\n    rate_limit: {{unit: {}, \
             requests_per_unit: {requests_per_unit}, algorithm: {algorithm}{burst}}}\n",
            unit.name().to_ascii_lowercase()
        );
        let set = from_str("simulate", &yaml).map_err(|e| SimulateError::Algorithm {
            algorithm: algorithm.to_string(),
            requests_per_unit,
            unit: unit.name().to_ascii_lowercase(),
            reason: e
                .iter()
                .next()
                .map_or_else(|| e.to_string(), |e| e.message.clone()),
        })?;
        // On a shared counter every key is one: the request keeps `default`.
        let request = RateLimitRequest::new("simulate", [[("key", default)]]);
        let mut run = Self::new(
            algorithm.to_string(),
            bucket.then_some(requests_per_unit),
            set,
            request,
            start,
        )
        .shared(shared);
        run.vary = !shared;
        Ok(run)
    }

    /// The rule file itself: each request is the descriptor `entries` with its last
    /// value replaced by the traffic key's.
    pub fn rule(
        name: &str,
        burst: Option<u64>,
        set: RuleSet,
        domain: &str,
        entries: &[(String, String)],
        start: Nanos,
    ) -> Self {
        let request = RateLimitRequest::new(domain, [entries.to_vec()]);
        Self::new(name.to_string(), burst, set, request, start)
    }

    fn new(
        name: String,
        burst: Option<u64>,
        set: RuleSet,
        request: RateLimitRequest,
        start: Nanos,
    ) -> Self {
        let clock = ManualClock::new(start);
        let limiter = Limiter::new(Arc::new(Rules::fixed(set)), MemoryStore::new())
            .with_clock(Arc::new(clock.clone()));
        Self {
            name,
            burst,
            limiter,
            clock,
            request,
            vary: true,
            shared: false,
        }
    }

    /// Whether every key shares one counter, so that the window maximum counts them
    /// together.
    pub fn shared(mut self, shared: bool) -> Self {
        self.shared = shared;
        self
    }

    /// Feeds the traffic, the clock at `start` plus each request's time; measures
    /// windows `unit` long and a timeline of `bucket`-wide buckets, and compares with
    /// the `exact` decisions when given. Returns the outcome and this run's decisions.
    pub fn play(
        mut self,
        traffic: &Traffic,
        start: Nanos,
        unit: Nanos,
        bucket: Nanos,
        exact: Option<&[bool]>,
        progress: &mut Progress,
    ) -> Result<(Outcome, Vec<bool>), SimulateError> {
        let buckets = traffic.duration.div_ceil(bucket).max(1) as usize;
        let mut o = Outcome {
            name: self.name.clone(),
            burst: self.burst,
            buckets: vec![Bucket::default(); buckets],
            retry_after: RetryAfter {
                unit,
                ..RetryAfter::default()
            },
            ..Outcome::default()
        };
        let mut window = WindowMax::new(traffic.keys.len(), unit);
        let mut decisions = Vec::with_capacity(if exact.is_none() {
            traffic.arrivals.len()
        } else {
            0
        });
        tracing::info!(algorithm = %self.name, requests = traffic.arrivals.len(), "running");
        for (i, a) in traffic.arrivals.iter().enumerate() {
            self.clock.set(start + a.at);
            let Some(key) = traffic.keys.get(a.key as usize) else {
                continue;
            };
            let request = &mut self.request;
            if let (true, Some(value)) = (self.vary, key) {
                if let Some(last) = request
                    .descriptors
                    .first_mut()
                    .and_then(|d| d.entries.last_mut())
                {
                    last.1.clone_from(value);
                }
            }
            request.hits_addend = u64::from(a.cost);
            let response = self
                .limiter
                .check_now(request)
                .map_err(|e| SimulateError::Limiter(e.to_string()))?;
            let ok = response.overall == Code::Ok;
            let b = &mut o.buckets[((a.at / bucket) as usize).min(buckets - 1)];
            o.offered += 1;
            o.offered_cost += u64::from(a.cost);
            b.offered += 1;
            if ok {
                o.admitted += 1;
                o.admitted_cost += u64::from(a.cost);
                b.admitted += 1;
                let key = if self.shared { 0 } else { a.key as usize };
                let held = window.admit(key, a.at, u64::from(a.cost));
                b.window_max = b.window_max.max(held);
            } else if let Some(s) = response.statuses.iter().find(|s| s.code == Code::OverLimit) {
                o.retry_after
                    .record((s.retry_after != NEVER).then_some(s.retry_after));
            }
            match exact.and_then(|e| e.get(i)) {
                Some(&e) if e != ok => {
                    if ok {
                        o.more += 1;
                        b.more += 1;
                    } else {
                        o.fewer += 1;
                        b.fewer += 1;
                    }
                }
                Some(_) => {}
                None => decisions.push(ok),
            }
            progress.tick(&self.name);
        }
        o.max_in_any_window = window.max();
        o.max_window_at = window.max_at();
        Ok((o, decisions))
    }
}
