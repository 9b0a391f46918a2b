//! GCRA, the generic cell rate algorithm: one timestamp per key, token-bucket behaviour.
//!
//! **Guarantee.** Over any interval of length `T`, never more than
//! `burst + limit × T / window` cost units admitted; it admits exactly what a
//! [`TokenBucket`](super::TokenBucket) with the same `limit`, `window` and `burst`
//! admits (a property test holds the two to that on random traces).
//!
//! **State.** 16 bytes ([`KeyState`]): the theoretical arrival time `tat`, exact (a
//! rational number of nanoseconds with denominator `limit`).
//!
//! **Maths.** Each unit of cost advances `tat` by the emission interval
//! `window / limit`; the key may run ahead of `now` by at most `burst` intervals.
//! Everything is multiplied by `limit` so it stays an integer:
//! `t = now × limit`, `increment = cost × window`, `tolerance = burst × window`.
//! A request passes iff `max(tat, t) + increment - t <= tolerance`; then
//! `tat = max(tat, t) + increment`. `remaining = floor((t + tolerance - tat) / window)`,
//! `reset_after = ceil((tat - t) / limit)`; a rejection may retry after
//! `ceil((tat + increment - tolerance) / limit) - now`.
//!
//! **Overdraft.** With `overdraft = D` the tolerance grows by `D` emission intervals:
//! `tolerance = (burst + D) × window`, and a request passes iff
//! `max(tat, t) + increment - t <= tolerance`, exactly as a
//! [`TokenBucket`](super::TokenBucket) with the same overdraft. An admission that leaves
//! `tat - t > burst × window` (past the burst: a debt) is flagged
//! ([`Decision::overdraft`]) and reports `remaining = 0`;
//! `remaining = floor(max(0, t + burst × window - tat) / window)` stays 0 until `now` has
//! caught up with the debt. A cost above `burst + D` can never pass.
//!
//! **Warm-up.** With `warmup = P` (a rule file's `warmup`; never with an overdraft), a
//! key that has been idle is cold: it admits at a third of its rate at first and reaches
//! the full rate after `P` of use (Guava's `SmoothWarmingUp`, cold factor 3; the
//! formula and its exact integer form are in `bucket.rs` and docs/algorithms.md,
//! "Warm-up"). A request fits exactly as without the warm-up; an admission moves the
//! instant further by the warm-up's extra time. The state is then a [`WarmState`]
//! ([`with_warmup`](Gcra::with_warmup), [`check_warm`](Gcra::check_warm)).
//!
//! **Example** (`tests/cases/tollgate/02-gcra.yaml`). 10 per second, burst 5: five pass
//! at once, then one every 100 ms.
//! ```
//! use std::time::Duration;
//! use tollgate::algorithm::{Gcra, KeyState};
//! const MS: u64 = 1_000_000;
//! let gcra = Gcra::new(10, Duration::from_secs(1)).with_burst(5);
//! let mut state = KeyState::default();
//! let t0 = 1_699_920_000_000 * MS;
//! assert_eq!(gcra.check(&mut state, t0, 1).remaining, 4);
//! for _ in 0..4 { assert!(gcra.check(&mut state, t0, 1).allowed); }
//! let sixth = gcra.check(&mut state, t0, 1);
//! assert_eq!((sixth.allowed, sixth.retry_after), (false, 100 * MS));
//! assert!(gcra.check(&mut state, t0 + 100 * MS, 1).allowed);
//! ```

use std::time::Duration;

use super::bucket::{Bucket, Debt};
use super::{KeyState, WarmState};
use crate::clock::{nanos, Nanos};
use crate::decision::Decision;

/// GCRA parameters: `limit` per `window`, bursts of up to `burst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gcra {
    /// Sustained rate: cost units per window.
    pub limit: u64,
    /// Window length in nanoseconds.
    pub window: Nanos,
    /// Largest cost admitted at once from a rested key (default `limit`).
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
impl std::hash::Hash for Gcra {
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

impl Gcra {
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

    /// Sets the burst.
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
        let mut d = self.bucket().check_warm(state, now, cost, Debt::Rejects);
        if !d.allowed && self.limit > 0 && d.retry_after != crate::decision::NEVER {
            // As in `check`: an instant stops at u64::MAX ns.
            d.retry_after = d.retry_after.min(Nanos::MAX - now);
        }
        d
    }

    /// [`charge`](Self::charge) on a [`WarmState`]: the bucket's instant moves as without
    /// a warm-up, and the key gets no warmer.
    pub fn charge_warm(&self, state: &mut WarmState, now: Nanos, cost: u64) {
        self.bucket().charge_warm(state, now, cost);
    }

    /// Charges `cost` at `now` whether it conforms or not (`charge_rejected`): the
    /// theoretical arrival time moves past the tolerance (at most one tolerance past), and
    /// nothing conforms until now has caught up with it.
    pub fn charge(&self, state: &mut KeyState, now: Nanos, cost: u64) {
        self.bucket().charge(state, now, cost);
    }

    /// Decides a request of `cost` at `now`, charging `state` if it passes.
    pub fn check(&self, state: &mut KeyState, now: Nanos, cost: u64) -> Decision {
        let (mut d, _) = self.bucket().check(state, now, cost, Debt::Rejects);
        if !d.allowed
            && self.limit > 0
            && u128::from(cost) <= u128::from(self.burst) + u128::from(self.overdraft)
        {
            // The retry is the instant `tat + increment - tolerance` less now, and an
            // instant stops at u64::MAX ns.
            d.retry_after = d.retry_after.min(Nanos::MAX - now);
        }
        d
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

    /// The shared bucket: `tat` is its instant, the tolerance its capacity.
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
    const S: u64 = 1_000_000_000;

    #[test]
    fn a_rate_that_does_not_divide_the_window_loses_nothing() {
        // 3 per second: the emission interval is 333,333,333.3 ns.
        let g = Gcra::new(3, Duration::from_secs(1)).with_burst(1);
        let mut st = KeyState::default();
        let mut admitted = 0;
        let mut now = 1_000 * S;
        for _ in 0..3_000_000 {
            if g.check(&mut st, now, 1).allowed {
                admitted += 1;
            }
            now += 1_000; // every microsecond, for 3 seconds
        }
        assert_eq!(admitted, 9);
    }

    #[test]
    fn a_cost_above_the_burst_can_never_pass() {
        let g = Gcra::new(10, Duration::from_secs(1)).with_burst(5);
        let mut st = KeyState::default();
        assert!(g.check(&mut st, S, 6).can_never_pass());
        assert!(g.check(&mut st, S, 5).allowed);
    }

    #[test]
    fn a_cost_above_the_burst_still_reports_what_is_left() {
        let g = Gcra::new(10, Duration::from_secs(1)).with_burst(5);
        let mut st = KeyState::default();
        assert!(g.check(&mut st, S, 1).allowed);
        let before = st;
        let d = g.check(&mut st, S, 6);
        assert!(d.can_never_pass());
        assert_eq!((d.remaining, d.reset_after), (4, 100_000_000));
        assert_eq!(st, before, "nothing charged");
    }

    #[test]
    fn an_overdraft_grows_the_tolerance_and_flags_the_debt() {
        let g = Gcra::new(10, Duration::from_secs(1))
            .with_burst(2)
            .with_overdraft(1);
        let mut st = KeyState::default();
        assert!(!g.check(&mut st, S, 2).overdraft);
        let d = g.check(&mut st, S, 1);
        assert!(d.allowed && d.overdraft);
        assert_eq!((d.remaining, d.reset_after), (0, 300_000_000));
        let d = g.check(&mut st, S, 1);
        assert_eq!((d.allowed, d.retry_after), (false, 100_000_000));
        assert!(g.check(&mut st, S, 4).can_never_pass());
        // Repaid at exactly 100 ms: then 1 is left again after 200 ms.
        assert_eq!(g.check(&mut st, S + 100_000_000, 0).remaining, 0);
        assert_eq!(g.check(&mut st, S + 199_999_999, 0).remaining, 0);
        assert_eq!(g.check(&mut st, S + 200_000_000, 0).remaining, 1);
        // Within the debt's repayment, a request of 1 is admitted and flagged again.
        let d = g.check(&mut st, S + 100_000_000, 1);
        assert!(d.allowed && d.overdraft);
    }

    #[test]
    fn reset_after_is_the_time_to_a_full_bucket() {
        let g = Gcra::new(10, Duration::from_secs(1));
        let mut st = KeyState::default();
        let d = g.check(&mut st, S, 4);
        assert_eq!(d.reset_after, 400_000_000);
        assert_eq!(st.expires_at, S + 400_000_000);
    }

    #[test]
    fn a_cold_key_admits_one_then_the_next_after_nearly_three_intervals() {
        // 10 per second (I = 100 ms), burst 1, warm-up 3 s: M = 3e10, the first request
        // takes σ from M to M − 1e9, which costs I plus an extra of
        // (A − B)(A + B) / 2M = 2e9 × 5.8e10 / 6e10 = 1,933,333,333.3 scaled (rounded up
        // to the grid of 10): the next fits 293,333,334 ns later.
        let g = Gcra::new(10, Duration::from_secs(1))
            .with_burst(1)
            .with_warmup(Duration::from_secs(3));
        let mut st = WarmState::default();
        assert!(g.check_warm(&mut st, S, 1).allowed);
        let d = g.check_warm(&mut st.clone(), S + 293_333_333, 1);
        assert_eq!((d.allowed, d.retry_after), (false, 1));
        assert!(g.check_warm(&mut st, S + 293_333_334, 1).allowed);
    }

    #[test]
    fn a_warm_key_admits_as_the_plain_gcra() {
        let plain = Gcra::new(10, Duration::from_secs(1)).with_burst(2);
        let warm = plain.with_warmup(Duration::from_secs(2));
        let (mut a, mut b) = (KeyState::default(), WarmState::default());
        // Warmed up by 5 s of use at 20 per second (more than it admits).
        let mut now = S;
        for _ in 0..100 {
            warm.check_warm(&mut b, now, 1);
            now += 50_000_000;
        }
        // Now warm: every request is decided as by the plain GCRA in step with it.
        for i in 0..400u64 {
            let t = now + i * 30_000_000;
            let (x, y) = (plain.check(&mut a, t, 1), warm.check_warm(&mut b, t, 1));
            if i > 10 {
                assert_eq!(x, y, "request {i}");
            }
        }
    }
}
