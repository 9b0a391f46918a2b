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
//! **Overdraft.** With `overdraft = D` (a rule file's `overdraft`), an empty bucket
//! still admits until it owes `D` tokens: a request passes iff `tokens − cost ≥ −D`,
//! in the units above `need ≤ tokens + D × window` where
//! `tokens = capacity − min(tolerance, full_at × limit − now × limit)` may now be
//! negative and `tolerance = (burst + D) × window`; then
//! `full_at = max(full_at, now) + need / limit`, as without overdraft. An admission that
//! leaves `tokens < 0` (a debt) is flagged ([`Decision::overdraft`]) and reports
//! `remaining = 0`; `remaining = floor(max(0, tokens) / window)` stays 0 until refills
//! have repaid the whole debt, and `reset_after` (until full) counts the debt too.
//! Over any interval of length `T`, never more than `burst + D + limit × T / window`
//! admitted; a cost above `burst + D` can never pass. Under `charge_rejected` the debt
//! stops at `burst + D` tokens (the instant at most two tolerances ahead).
//! ```
//! use std::time::Duration;
//! use tollgate::algorithm::{KeyState, TokenBucket};
//! const MS: u64 = 1_000_000;
//! // 10 per second, burst 5, overdraft 3: 5 + 3 pass at once.
//! let tb = TokenBucket::new(10, Duration::from_secs(1)).with_burst(5).with_overdraft(3);
//! let mut state = KeyState::default();
//! for _ in 0..5 { assert!(!tb.check(&mut state, 0, 1).overdraft); }
//! for _ in 0..3 {
//!     let d = tb.check(&mut state, 0, 1);
//!     assert!(d.allowed && d.overdraft && d.remaining == 0);
//! }
//! assert_eq!(tb.check(&mut state, 0, 1).retry_after, 100 * MS);
//! // The debt of 3 is repaid after 300 ms: only then does `remaining` rise.
//! assert_eq!(tb.check(&mut state, 399 * MS, 0).remaining, 0);
//! assert_eq!(tb.check(&mut state, 400 * MS, 0).remaining, 1);
//! ```
//!
//! **Warm-up.** With `warmup = P` (a rule file's `warmup`; never with an overdraft), a
//! key that has been idle is cold: it admits at a third of its rate at first and reaches
//! the full rate after `P` of use (Guava's `SmoothWarmingUp`, cold factor 3; the
//! formula and its exact integer form are in `bucket.rs` and docs/algorithms.md,
//! "Warm-up"). A request fits exactly as without the warm-up; an admission moves the
//! instant further by the warm-up's extra time. The state is then a [`WarmState`]
//! ([`with_warmup`](TokenBucket::with_warmup), [`check_warm`](TokenBucket::check_warm)).
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
use super::{KeyState, WarmState};
use crate::clock::{nanos, Nanos};
use crate::decision::Decision;

/// Token bucket parameters: refill `limit` per `window`, capacity `burst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucket {
    /// Refill rate: tokens per window.
    pub limit: u64,
    /// Window length in nanoseconds.
    pub window: Nanos,
    /// Capacity in tokens (default `limit`).
    pub burst: u64,
    /// How many units the bucket may go into debt (default 0: none); see the module
    /// documentation's "Overdraft".
    pub overdraft: u64,
    /// The warm-up period in nanoseconds (default 0: none); see the module
    /// documentation's "Warm-up".
    pub warmup: Nanos,
}

/// Hashed as its fields, `overdraft` and `warmup` only when set: a limit without them
/// keeps the default id ([`Limit::new`](super::Limit::new)) it had before the field existed.
impl std::hash::Hash for TokenBucket {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.limit.hash(state);
        self.window.hash(state);
        self.burst.hash(state);
        if self.overdraft > 0 {
            self.overdraft.hash(state);
        }
        if self.warmup > 0 {
            self.warmup.hash(state);
        }
    }
}

impl TokenBucket {
    /// `limit` per `window`, with `burst = limit`.
    pub fn new(limit: u64, window: Duration) -> Self {
        Self {
            limit,
            window: nanos(window),
            burst: limit,
            overdraft: 0,
            warmup: 0,
        }
    }

    /// Sets the capacity.
    pub fn with_burst(mut self, burst: u64) -> Self {
        self.burst = burst;
        self
    }

    /// Lets a key go `overdraft` units into debt once its bucket is empty (see the
    /// module documentation's "Overdraft").
    pub fn with_overdraft(mut self, overdraft: u64) -> Self {
        self.overdraft = overdraft;
        self
    }

    /// Warms a key that has been idle up over `warmup` (see the module documentation's
    /// "Warm-up"): its state is then a [`WarmState`], decided by
    /// [`check_warm`](Self::check_warm). A zero duration means no warm-up.
    pub fn with_warmup(mut self, warmup: Duration) -> Self {
        self.warmup = nanos(warmup);
        self
    }

    /// Decides a request of `cost` at `now` with the warm-up, charging `state` if it
    /// passes (see the module documentation's "Warm-up").
    pub fn check_warm(&self, state: &mut WarmState, now: Nanos, cost: u64) -> Decision {
        self.bucket().check_warm(state, now, cost, Debt::Empties)
    }

    /// [`charge`](Self::charge) on a [`WarmState`]: the bucket's instant moves as without
    /// a warm-up, and the key gets no warmer.
    pub fn charge_warm(&self, state: &mut WarmState, now: Nanos, cost: u64) {
        self.bucket().charge_warm(state, now, cost);
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
            .with_overdraft(self.overdraft)
            .with_warmup(self.warmup)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::WarmState;
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
    fn an_overdraft_admits_until_the_debt_and_is_repaid_exactly() {
        // 3 per second (a refill every 333,333,333.3 ns), burst 2, overdraft 2.
        let tb = TokenBucket::new(3, Duration::from_secs(1))
            .with_burst(2)
            .with_overdraft(2);
        let mut st = KeyState::default();
        let t0 = 1_000_000 * MS;
        let d = tb.check(&mut st, t0, 2);
        assert!(d.allowed && !d.overdraft && d.remaining == 0);
        let d = tb.check(&mut st, t0, 2);
        assert!(d.allowed && d.overdraft);
        assert_eq!(d.remaining, 0);
        // Owes 2: full again after 4 refills, 4/3 s.
        assert_eq!(d.reset_after, 1_333_333_334);
        let d = tb.check(&mut st, t0, 1);
        assert!(!d.allowed && !d.overdraft);
        assert_eq!(d.retry_after, 333_333_334);
        // A cost above burst + overdraft never passes.
        assert!(tb.check(&mut st, t0, 5).can_never_pass());
        assert!(!tb.check(&mut st, t0, 4).can_never_pass());
        // The debt of 2 is repaid at exactly 2/3 s (666,666,666.7 ns): until then
        // nothing is left, and a request taken then is still an overdraft.
        let repaid = t0 + 666_666_667;
        assert_eq!(tb.check(&mut st, repaid - 1, 0).remaining, 0);
        let d = tb.check(&mut st.clone(), repaid - 1, 1);
        assert!(d.allowed && d.overdraft);
        assert_eq!(tb.check(&mut st, t0 + 999_999_999, 0).remaining, 0);
        let d = tb.check(&mut st, t0 + 1_000_000_000, 0);
        assert_eq!(d.remaining, 1);
        // A request of 1 after the debt of 2 and one more token have refilled (at
        // exactly 1 s) leaves 0 tokens: no debt, no overdraft; 1 ns earlier it leaves
        // a debt of a fraction of a token, and is flagged.
        let mut again = KeyState::default();
        assert!(tb.check(&mut again, t0, 4).overdraft);
        let d = tb.check(&mut again.clone(), t0 + 999_999_999, 1);
        assert!(d.allowed && d.overdraft && d.remaining == 0);
        let d = tb.check(&mut again, t0 + 1_000_000_000, 1);
        assert!(d.allowed && !d.overdraft && d.remaining == 0);
    }

    #[test]
    fn without_overdraft_nothing_is_flagged() {
        let tb = TokenBucket::new(10, Duration::from_secs(1)).with_burst(2);
        let mut st = KeyState::default();
        for _ in 0..2 {
            assert!(!tb.check(&mut st, 0, 1).overdraft);
        }
        tb.charge(&mut st, 0, 5);
        let d = tb.check(&mut st, 0, 0);
        assert!(
            d.allowed && !d.overdraft,
            "a cost of 0 in debt is no overdraft"
        );
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

    /// Admissions per whole second from cold at `start`, calling every `every` ns for
    /// `secs` seconds.
    fn per_second(
        tb: &TokenBucket,
        st: &mut WarmState,
        start: u64,
        every: u64,
        secs: u64,
    ) -> Vec<u64> {
        let mut counts = vec![0; secs as usize];
        let mut t = start;
        while t < start + secs * 1_000 * MS {
            if tb.check_warm(st, t, 1).allowed {
                counts[((t - start) / (1_000 * MS)) as usize] += 1;
            }
            t += every;
        }
        counts
    }

    #[test]
    fn from_cold_admissions_rise_from_a_third_to_the_full_rate_over_the_warm_up() {
        // 25 per second, burst 1, warm-up 4 s, called every millisecond.
        let tb = TokenBucket::new(25, Duration::from_secs(1))
            .with_burst(1)
            .with_warmup(Duration::from_secs(4));
        let mut st = WarmState::default();
        let counts = per_second(&tb, &mut st, 1_000_000 * MS, MS, 8);
        // The first second runs near a third of the rate, and each is faster than the
        // one before until the full rate.
        assert_eq!(counts, [9, 11, 12, 18, 25, 25, 25, 25]);
        assert!(counts.windows(2).take(4).all(|w| w[0] < w[1]), "{counts:?}");
        // The warm-up's area: the stored permits above the threshold (50) are spent in
        // 4 s of use at the rate allowed (give or take the calls' millisecond grid).
        assert!(
            (48..=50).contains(&counts[..4].iter().sum::<u64>()),
            "{counts:?}"
        );
    }

    #[test]
    fn a_key_asked_at_its_own_rate_warms_up() {
        // 10 per second, burst 1, warm-up 2 s, asked every 100 ms (its stable interval):
        // each admission's gap before the next ask stays within the grace, so the key
        // warms and reaches 10 a second, rather than resting off each permit it takes
        // and staying at a third of the rate.
        let tb = TokenBucket::new(10, Duration::from_secs(1))
            .with_burst(1)
            .with_warmup(Duration::from_secs(2));
        let mut st = WarmState::default();
        let counts = per_second(&tb, &mut st, 1_000_000 * MS, 100 * MS, 6);
        assert_eq!(counts[0], 4, "{counts:?}");
        assert_eq!(counts[4..], [10, 10], "{counts:?}");
    }

    #[test]
    fn warm_it_loses_no_refill_and_idle_for_the_warm_up_it_is_cold_again() {
        // 100 per second, warmed up by 3 s of calls every millisecond; then called every
        // 10 ms: exactly 100 per second.
        let tb = TokenBucket::new(100, Duration::from_secs(1))
            .with_burst(1)
            .with_warmup(Duration::from_secs(1));
        let mut st = WarmState::default();
        let start = 1_000_000 * MS;
        let warming = per_second(&tb, &mut st, start, MS, 3);
        assert_eq!(warming, [49, 99, 100]);
        let counts = per_second(&tb, &mut st, start + 3_000 * MS, 10 * MS, 4);
        assert_eq!(counts, [100, 100, 100, 100]);
        // Idle: fresh (full and fully cold) one warm-up after the bucket was full and
        // the grace of two intervals (20 ms) had passed.
        let end = start + 7_000 * MS;
        assert!(!st.is_fresh(end + 1_020 * MS - 1));
        assert!(st.is_fresh(end + 1_020 * MS));
        let mut cold = WarmState::default();
        let later = end + 1_020 * MS;
        assert_eq!(
            per_second(&tb, &mut st, later, 10 * MS, 2),
            per_second(&tb, &mut cold, later, 10 * MS, 2)
        );
    }

    #[test]
    fn a_warm_up_never_admits_more_than_the_bucket_and_reports_the_extra_time() {
        let plain = TokenBucket::new(10, Duration::from_secs(1)).with_burst(5);
        let warm = plain.with_warmup(Duration::from_secs(10));
        let (mut a, mut b) = (KeyState::default(), WarmState::default());
        let t0 = 1_000_000 * MS;
        // Cold: the burst is there, but each admission pushes the instant three
        // intervals (less a little) instead of one.
        for _ in 0..5 {
            assert!(plain.check(&mut a, t0, 1).allowed);
        }
        let first = warm.check_warm(&mut b, t0, 1);
        assert!(first.allowed);
        assert_eq!(first.remaining, 2, "nearly three intervals are taken");
        assert!(first.reset_after > 290 * MS);
        let mut admitted = 1;
        while warm.check_warm(&mut b, t0, 1).allowed {
            admitted += 1;
        }
        assert_eq!(admitted, 2);
    }
}
