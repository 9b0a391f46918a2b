//! [`Decision`]: what a limiter answers for one request on one key.

use crate::clock::{Nanos, NANOS_PER_SEC};

/// The answer to "may this request proceed?", with what a client needs to behave.
///
/// All durations are nanoseconds from the moment of the decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Decision {
    /// Whether the request may proceed (after [`delay`](Self::delay), in queue mode).
    pub allowed: bool,
    /// The configured limit: requests (or cost units) per window.
    pub limit: u64,
    /// Units still available after this decision (for buckets: whole units against the burst).
    pub remaining: u64,
    /// Time until the key is fully replenished (window algorithms: until the window ends).
    pub reset_after: Nanos,
    /// For a rejection, the time until a request of the same cost would first pass;
    /// [`NEVER`] when it can never pass (its cost exceeds the capacity). 0 when allowed.
    pub retry_after: Nanos,
    /// Queue mode of the leaky bucket: how long to hold the request before sending it on.
    pub delay: Nanos,
    /// True when a store answered this rejection from its local cache of keys known to
    /// be over their limit (see the Redis store), without asking its backend.
    pub from_cache: bool,
    /// An admission that left the bucket in debt: a token bucket or GCRA with an
    /// `overdraft` admitted a request its tokens did not cover (`remaining` is 0).
    pub overdraft: bool,
}

/// [`Decision::retry_after`] of a request that can never pass: its cost exceeds what the
/// limit can ever hold (or the limit is 0).
pub const NEVER: Nanos = Nanos::MAX;

impl Decision {
    /// An admission.
    pub fn allow(limit: u64, remaining: u64, reset_after: Nanos) -> Self {
        Self {
            allowed: true,
            limit,
            remaining,
            reset_after,
            retry_after: 0,
            delay: 0,
            from_cache: false,
            overdraft: false,
        }
    }

    /// A rejection that a retry after `retry_after` could pass (or never, with [`NEVER`]).
    pub fn reject(limit: u64, remaining: u64, reset_after: Nanos, retry_after: Nanos) -> Self {
        Self {
            allowed: false,
            limit,
            remaining,
            reset_after,
            retry_after,
            delay: 0,
            from_cache: false,
            overdraft: false,
        }
    }

    /// True for a rejection that no amount of waiting will turn into an admission.
    pub fn can_never_pass(&self) -> bool {
        !self.allowed && self.retry_after == NEVER
    }

    /// `retry_after` in whole seconds, rounded up, as the `Retry-After` header wants it;
    /// `None` when allowed or when the request can never pass.
    pub fn retry_after_secs(&self) -> Option<u64> {
        (!self.allowed && self.retry_after != NEVER).then(|| ceil_secs(self.retry_after))
    }

    /// `reset_after` in whole seconds, rounded up.
    pub fn reset_after_secs(&self) -> u64 {
        ceil_secs(self.reset_after)
    }
}

fn ceil_secs(n: Nanos) -> u64 {
    n.div_ceil(NANOS_PER_SEC)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        let d = Decision::reject(10, 0, 1, 1_000_000_001);
        assert_eq!(d.retry_after_secs(), Some(2));
        assert!(!d.can_never_pass());
    }

    #[test]
    fn a_request_that_can_never_pass_has_no_retry_after() {
        let d = Decision::reject(10, 10, 0, NEVER);
        assert!(d.can_never_pass());
        assert_eq!(d.retry_after_secs(), None);
        assert_eq!(Decision::allow(10, 9, 5).retry_after_secs(), None);
    }
}
