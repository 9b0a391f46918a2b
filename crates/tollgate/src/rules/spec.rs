//! [`LimitSpec`]: what a rate limit in a rule file says beyond its numbers (algorithm,
//! burst, lockout, queue mode, overage, overdraft, warm-up), how it becomes the store's [`Limit`], and the
//! ranges its numbers must keep.

use std::time::Duration;

use super::Unit;
use crate::algorithm::{
    Algorithm, Consistency, FixedWindow, Gcra, InvalidLimit, LeakyBucket, LeakyMode, Limit, Scope,
    SlidingLog, SlidingWindow, TokenBucket,
};

/// The algorithm-related settings of one limit, kept so that a request's override of
/// the numbers can be built with the same algorithm and extensions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub(crate) struct LimitSpec {
    pub(super) algorithm: AlgorithmName,
    pub(super) burst: Option<u64>,
    pub(super) block: Duration,
    pub(super) queue: bool,
    pub(super) overage_percent: u64,
    /// How many units a token bucket or GCRA may go into debt (0: none).
    pub(super) overdraft: u64,
    /// How long a token bucket or GCRA takes to warm up from cold (zero: no warm-up).
    pub(super) warmup: Duration,
    /// How instances sharing a store count it (inherited from the descriptors above).
    pub(super) consistency: Consistency,
    /// Where it is counted when regions share a global store (inherited too).
    pub(super) scope: Scope,
}

/// The algorithms a rule file names.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub(super) enum AlgorithmName {
    #[default]
    FixedWindow,
    SlidingWindow,
    SlidingLog,
    TokenBucket,
    Gcra,
    LeakyBucket,
}

/// Every algorithm name, for messages.
pub(super) const ALGORITHMS: &str =
    "fixed_window, sliding_window, sliding_log, token_bucket, gcra, leaky_bucket";

impl AlgorithmName {
    /// The algorithm a rule file names `s`.
    pub(super) fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "fixed_window" => Self::FixedWindow,
            "sliding_window" => Self::SlidingWindow,
            "sliding_log" => Self::SlidingLog,
            "token_bucket" => Self::TokenBucket,
            "gcra" => Self::Gcra,
            "leaky_bucket" => Self::LeakyBucket,
            _ => return None,
        })
    }

    /// Token bucket, GCRA or leaky bucket: the algorithms with a `burst`.
    pub(super) fn is_bucket(self) -> bool {
        matches!(self, Self::TokenBucket | Self::Gcra | Self::LeakyBucket)
    }
}

impl LimitSpec {
    /// The store's [`Limit`] for `requests_per_unit` per `unit`, with the overage added.
    pub(crate) fn build(
        &self,
        requests_per_unit: u64,
        unit: Unit,
        id: u64,
    ) -> Result<Limit, InvalidLimit> {
        self.build_divided(requests_per_unit, unit, id, 1)
    }

    /// [`build`](Self::build) with the numbers (limit, burst and overdraft) divided by
    /// `divisor`, keeping at least 1 of a non-zero number: one instance's share of the
    /// limit. The overage grows the limit and the burst, not the overdraft. The warm-up
    /// (a duration) stays.
    pub(crate) fn build_divided(
        &self,
        requests_per_unit: u64,
        unit: Unit,
        id: u64,
        divisor: u64,
    ) -> Result<Limit, InvalidLimit> {
        let divisor = divisor.max(1);
        let grow = |n: u64| {
            let n = n.saturating_add(n.saturating_mul(self.overage_percent) / 100);
            if n == 0 {
                0
            } else {
                (n / divisor).max(1)
            }
        };
        let n = grow(requests_per_unit);
        let burst = grow(self.burst.unwrap_or(requests_per_unit));
        let overdraft = if self.overdraft == 0 {
            0
        } else {
            (self.overdraft / divisor).max(1)
        };
        let w = Duration::from_secs(unit.seconds());
        let algorithm = match self.algorithm {
            AlgorithmName::FixedWindow => Algorithm::FixedWindow(FixedWindow::new(n, w)),
            AlgorithmName::SlidingWindow => Algorithm::SlidingWindow(SlidingWindow::new(n, w)),
            AlgorithmName::SlidingLog => Algorithm::SlidingLog(SlidingLog::new(n, w)),
            AlgorithmName::TokenBucket => Algorithm::TokenBucket(
                TokenBucket::new(n, w)
                    .with_burst(burst)
                    .with_overdraft(overdraft)
                    .with_warmup(self.warmup),
            ),
            AlgorithmName::Gcra => Algorithm::Gcra(
                Gcra::new(n, w)
                    .with_burst(burst)
                    .with_overdraft(overdraft)
                    .with_warmup(self.warmup),
            ),
            AlgorithmName::LeakyBucket => {
                let mode = if self.queue {
                    LeakyMode::Queue
                } else {
                    LeakyMode::Meter
                };
                Algorithm::LeakyBucket(LeakyBucket::new(n, w, mode).with_burst(burst))
            }
        };
        Ok(Limit::new(algorithm)?
            .with_lockout(self.block)
            .with_id(id)
            .with_consistency(self.consistency)
            .with_scope(self.scope))
    }
}

/// The longest a full bucket may take to drain (`burst × unit / requests_per_unit`): a
/// bucket's state is an instant in nanoseconds, and instants this far ahead keep their
/// exact arithmetic for centuries to come.
const MAX_BUCKET_DRAIN_SECS: u128 = 100 * 365 * 86_400;

/// The longest a request may wait in a `mode: queue` leaky bucket
/// (`(burst − 1) × unit / requests_per_unit`): a queued request waits in memory.
const MAX_QUEUE_WAIT_SECS: u128 = 86_400;

/// Why a bucket's numbers cannot work, if they cannot.
pub(super) fn bucket_out_of_range(spec: &LimitSpec, unit: Unit, rpu: u64) -> Option<String> {
    if !spec.algorithm.is_bucket() || rpu == 0 {
        return None;
    }
    let burst = spec.burst.unwrap_or(rpu);
    let per = |n: u64| n as u128 * u128::from(unit.seconds());
    let unit_name = unit.name().to_ascii_lowercase();
    if spec.overdraft > 0
        && per(burst.saturating_add(spec.overdraft)) > MAX_BUCKET_DRAIN_SECS * u128::from(rpu)
    {
        return Some(format!(
            "a bucket of {burst} with an overdraft of {} refilling {rpu} per {unit_name} takes \
             more than 100 years to repay and refill: make `burst` + `overdraft` at most {} \
             (its state is an instant, kept exact within a century)",
            spec.overdraft,
            MAX_BUCKET_DRAIN_SECS * u128::from(rpu) / u128::from(unit.seconds())
        ));
    }
    if per(burst) > MAX_BUCKET_DRAIN_SECS * u128::from(rpu) {
        return Some(format!(
            "a bucket of {burst} draining {rpu} per {unit_name} takes more than 100 years to \
             drain: make `burst` at most {} (its state is an instant, kept exact within a \
             century)",
            MAX_BUCKET_DRAIN_SECS * u128::from(rpu) / u128::from(unit.seconds())
        ));
    }
    if spec.queue && per(burst.saturating_sub(1)) > MAX_QUEUE_WAIT_SECS * u128::from(rpu) {
        return Some(format!(
            "a queue of {burst} leaving {rpu} per {unit_name} holds its last request more than \
             a day: make `burst` at most {} (a queued request waits in memory, and no client \
             waits that long)",
            MAX_QUEUE_WAIT_SECS * u128::from(rpu) / u128::from(unit.seconds()) + 1
        ));
    }
    None
}
