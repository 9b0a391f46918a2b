//! Token bucket: a bucket of `burst` tokens, refilled continuously at `limit` per window.
//!
//! **Guarantee.** Over any interval of length `T`, never more than
//! `burst + limit × T / window` cost units admitted. The bucket starts full.
//!
//! **State.** 16 bytes ([`KeyState`]): the exact instant at which the bucket will be
//! full again. The token count is derived from it:
//! `tokens(now) = burst - (full_at - now) × limit / window` (never below 0). Keeping
//! "full at" instead of (tokens, last refill) makes the state self-expiring (a store
//! can drop a full bucket) and exact: fractions of a token are never rounded away.
//!
//! **Maths**, in units of `1 / window` token (so refill is `limit` units per ns):
//! `capacity = burst × window`, `tokens = capacity - min(capacity, full_at × limit - now × limit)`,
//! `need = cost × window`. Pass iff `need <= tokens`; then
//! `full_at = now + (capacity - (tokens - need)) / limit`. `remaining = floor(tokens / window)`
//! after the charge; a rejection may retry after `ceil((need - tokens) / limit)`.
//!
//! **Example** (`tests/cases/tollgate/01-token-bucket.yaml`). 10 per second, burst 20:
//! 20 pass at once, then 100 ms later exactly one more.
//! ```
//! use std::time::Duration;
//! use tollgate::algorithm::{KeyState, TokenBucket};
//! const MS: u64 = 1_000_000;
//! let tb = TokenBucket::new(10, Duration::from_secs(1)).with_burst(20);
//! let mut state = KeyState::default();
//! let t0 = 1_699_920_000_000 * MS;
//! assert_eq!(tb.check(&mut state, t0, 1).remaining, 19);
//! for _ in 0..19 { assert!(tb.check(&mut state, t0, 1).allowed); }
//! assert_eq!(tb.check(&mut state, t0, 1).retry_after, 100 * MS);
//! let next = tb.check(&mut state, t0 + 100 * MS, 1);
//! assert_eq!((next.allowed, next.remaining), (true, 0));
//! ```

use std::time::Duration;

use super::bucket::{Bucket, Debt};
use super::KeyState;
use crate::clock::{nanos, Nanos};
use crate::decision::Decision;

/// Token bucket parameters: refill `limit` per `window`, capacity `burst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenBucket {
    /// Refill rate: tokens per window.
    pub limit: u64,
    /// Window length in nanoseconds.
    pub window: Nanos,
    /// Capacity in tokens (default `limit`).
    pub burst: u64,
}

impl TokenBucket {
    /// `limit` per `window`, with `burst = limit`.
    pub fn new(limit: u64, window: Duration) -> Self {
        Self {
            limit,
            window: nanos(window),
            burst: limit,
        }
    }

    /// Sets the capacity.
    pub fn with_burst(mut self, burst: u64) -> Self {
        self.burst = burst;
        self
    }

    /// Takes `cost` tokens at `now` whether the bucket holds them or not
    /// (`charge_rejected`): what it lacks is a debt, and the bucket stays empty until it
    /// has refilled past it. It owes at most one bucket: an empty bucket refills in full
    /// at most two `burst`'s refill times later.
    pub fn charge(&self, state: &mut KeyState, now: Nanos, cost: u64) {
        self.bucket().charge(state, now, cost);
    }

    /// Decides a request of `cost` at `now`, taking tokens from `state` if it passes.
    /// A debt leaves the bucket empty: a request of cost 0 still passes.
    pub fn check(&self, state: &mut KeyState, now: Nanos, cost: u64) -> Decision {
        self.bucket().check(state, now, cost, Debt::Empties).0
    }

    /// Gives back `units` of a lease whose charge left the state at `charged`, at `now`
    /// (leased counting): see the shared bucket's `give_back`. `None`: nothing to change.
    pub fn give_back(
        &self,
        state: &KeyState,
        charged: &KeyState,
        now: Nanos,
        units: u64,
    ) -> Option<KeyState> {
        self.bucket().give_back(state, charged, now, units)
    }

    /// The shared bucket: `full_at` is its instant, the tokens missing its `ahead`.
    fn bucket(&self) -> Bucket {
        Bucket::new(self.limit, self.window, self.burst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const MS: u64 = 1_000_000;

    #[test]
    fn called_every_5ms_at_100_per_second_it_admits_100_per_second() {
        let tb = TokenBucket::new(100, Duration::from_secs(1)).with_burst(1);
        let mut st = KeyState::default();
        let start = 1_700_000_000_000 * MS;
        let admitted = (0..2_000)
            .filter(|i| tb.check(&mut st, start + i * 5 * MS, 1).allowed)
            .count();
        // 10 s of calls: the full first token plus 100 per second.
        assert_eq!(admitted, 1_000);
    }

    #[test]
    fn a_cost_above_the_burst_still_reports_what_is_left() {
        let tb = TokenBucket::new(10, Duration::from_secs(1)).with_burst(5);
        let mut st = KeyState::default();
        assert!(tb.check(&mut st, 0, 2).allowed);
        let before = st;
        let d = tb.check(&mut st, 0, 6);
        assert!(d.can_never_pass());
        assert_eq!((d.remaining, d.reset_after), (3, 200 * MS));
        assert_eq!(st, before, "nothing charged");
    }

    #[test]
    fn a_rejected_request_takes_no_tokens() {
        let tb = TokenBucket::new(10, Duration::from_secs(1));
        let mut st = KeyState::default();
        assert!(tb.check(&mut st, 0, 8).allowed);
        let before = st;
        assert!(!tb.check(&mut st, 0, 3).allowed);
        assert_eq!(st, before);
        assert_eq!(tb.check(&mut st, 0, 2).remaining, 0);
    }
}
