//! The arithmetic the three bucket algorithms share: [`TokenBucket`](super::TokenBucket),
//! [`Gcra`](super::Gcra) and [`LeakyBucket`](super::LeakyBucket) keep the same state (one
//! exact instant in a [`KeyState`], scaled by `limit`) and decide a request the same way
//! from it. Each algorithm's file keeps its documentation and maps its parameters onto a
//! [`Bucket`]; `store/redis/lua/bucket.lua` is the same arithmetic in the scripts.
//!
//! **Maths**, scaled by `limit` (so that every instant and every increment is an
//! integer: `window` per unit of cost): `ahead = max(0, instant × limit − now × limit)`
//! (the token bucket's missing tokens, GCRA's `tat − now`, the leaky bucket's level),
//! `capacity = burst × window`, `need = cost × window`. A request fits iff
//! `ahead + need ≤ capacity`; then the instant becomes `max(instant, now) + need / limit`,
//! `remaining = floor((capacity − ahead − need) / window)` and
//! `reset_after = ceil((ahead + need) / limit)`. A rejection charges nothing and reports
//! `remaining = floor(max(0, capacity − ahead) / window)`, `reset_after = ceil(ahead / limit)`
//! and `retry_after = ceil((ahead + need − capacity) / limit)` (never when `cost > burst`).
//! A charge the bucket could not hold (`charge_rejected`) moves the instant past the
//! capacity, a debt of at most one bucket ([`KeyState::charged`]).
//!
//! **Overdraft** (token bucket and GCRA; 0 for the leaky bucket): with an overdraft of
//! `D` units the bucket may go `D` units into debt. The fit test uses the *tolerance*
//! `tolerance = (burst + D) × window` instead of the capacity: a request fits iff
//! `filled + need ≤ tolerance`. What is reported stays against the capacity:
//! `remaining = floor(max(0, capacity − after) / window)` (0 while in debt) and
//! `reset_after = ceil(after / limit)` (until full again, the debt included). An
//! admission of a cost above 0 that leaves `after > capacity` is an *overdraft admission*
//! ([`Decision::overdraft`]). A rejection reports as above, `retry_after =
//! ceil((ahead + need − tolerance) / limit)`, [`NEVER`] when `cost > burst + D`. A charge
//! the bucket could not hold stops at two tolerances past now.

use super::KeyState;
use crate::clock::Nanos;
use crate::decision::{Decision, NEVER};

/// A bucket's numbers: `limit` per `window` refilled (or drained), `burst` held.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bucket {
    limit: u64,
    /// At least 1 ns.
    window: Nanos,
    burst: u64,
    /// The debt the bucket may run into, in units (0: none).
    overdraft: u64,
}

/// What a bucket holding a debt (past its capacity, after a charge it could not hold)
/// does with a request of cost 0: the one place where the algorithms differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Debt {
    /// Rejects it: a request fits only where `ahead + need ≤ capacity` (GCRA, the leaky
    /// bucket).
    Rejects,
    /// Admits it: the bucket holds no fewer than 0 tokens, so a debt leaves it empty and
    /// a request asking for none still fits (the token bucket).
    Empties,
}

impl Bucket {
    /// `limit` per `window` ns, holding `burst`.
    pub(crate) fn new(limit: u64, window: Nanos, burst: u64) -> Self {
        Self {
            limit,
            window: window.max(1),
            burst,
            overdraft: 0,
        }
    }

    /// Lets the bucket go `overdraft` units into debt (see the module documentation).
    pub(crate) fn with_overdraft(mut self, overdraft: u64) -> Self {
        self.overdraft = overdraft;
        self
    }

    /// `(burst + overdraft) × window`: how far ahead of now an admission may leave the
    /// instant.
    fn tolerance(&self) -> u128 {
        (self.burst as u128 + self.overdraft as u128) * self.window as u128
    }

    /// Charges `cost` at `now` whether it fits or not (`charge_rejected`): the instant
    /// moves later by `cost × window / limit` from `max(instant, now)`, to at most two
    /// capacities past now.
    pub(crate) fn charge(&self, state: &mut KeyState, now: Nanos, cost: u64) {
        if cost == 0 || self.limit == 0 {
            return;
        }
        let w = self.window as u128;
        *state = state.charged(now, self.limit, cost as u128 * w, self.tolerance());
    }

    /// Gives back `units` of a lease whose charge left the bucket at `charged` (leased
    /// counting, `store/lease.rs`), at `now`: only while nothing else has changed the
    /// state since (`state == charged`: a charge made on top of it holds the slice above,
    /// which must not shrink), by moving the instant back `units × window / limit`, but
    /// never before `now` (what the charge no longer holds has refilled already).
    /// `None`: nothing to change.
    pub(crate) fn give_back(
        &self,
        state: &KeyState,
        charged: &KeyState,
        now: Nanos,
        units: u64,
    ) -> Option<KeyState> {
        if state != charged || units == 0 || self.limit == 0 {
            return None;
        }
        let at = state.scaled_instant(self.limit);
        let ahead = at.checked_sub(now as u128 * self.limit as u128)?;
        let back = (units as u128 * self.window as u128).min(ahead);
        if back == 0 {
            return None;
        }
        Some(KeyState::from_scaled_instant(at - back, self.limit))
    }

    /// Decides a request of `cost` at `now`, charging `state` if it fits. Also returns
    /// `ahead` as the request found it (scaled by `limit`): the leaky bucket's queue
    /// waits for it to drain.
    pub(crate) fn check(
        &self,
        state: &mut KeyState,
        now: Nanos,
        cost: u64,
        debt: Debt,
    ) -> (Decision, u128) {
        let (limit, w) = (self.limit, self.window);
        if limit == 0 {
            return (Decision::reject(limit, 0, 0, NEVER), 0);
        }
        let ahead = state
            .scaled_instant(limit)
            .saturating_sub(now as u128 * limit as u128);
        let capacity = self.burst as u128 * w as u128;
        let tolerance = self.tolerance();
        let need = cost as u128 * w as u128;
        let filled = match debt {
            Debt::Rejects => ahead,
            Debt::Empties => ahead.min(tolerance),
        };
        // `filled + need ≤ tolerance`, without a sum that could pass u128::MAX.
        if filled <= tolerance && need <= tolerance - filled {
            let after = filled + need;
            if cost > 0 {
                // A cost fits only a bucket within its tolerance: `filled` is `ahead`.
                *state = state.at_least(now, limit).advanced(need, limit);
            }
            let mut decision = Decision::allow(
                limit,
                floor_div(capacity.saturating_sub(after), w),
                ceil_div_nanos(after, limit),
            );
            decision.overdraft = cost > 0 && after > capacity;
            return (decision, ahead);
        }
        // A cost above the burst (and overdraft) never fits; the answer still says what
        // is left.
        let retry = if cost as u128 > self.burst as u128 + self.overdraft as u128 {
            NEVER
        } else {
            ceil_div_nanos(ahead + need - tolerance, limit)
        };
        let decision = Decision::reject(
            limit,
            floor_div(capacity.saturating_sub(ahead), w),
            ceil_div_nanos(ahead, limit),
            retry,
        );
        (decision, ahead)
    }
}

/// The exact instant of the bucket algorithms: `expires_at − word / rate` ns (see
/// [`KeyState`]).
impl KeyState {
    /// The exact instant stored by the bucket algorithms, multiplied by `rate`.
    pub(crate) fn scaled_instant(&self, rate: u64) -> u128 {
        (self.expires_at as u128 * rate as u128).saturating_sub(self.word as u128)
    }

    /// Stores the exact instant `scaled / rate` (the algorithms use [`advanced`](Self::advanced),
    /// which avoids the u128 division; this is its reference in tests, and a lease's
    /// give-back, which is rare, uses it).
    /// An instant beyond `u64::MAX` nanoseconds is clamped there.
    pub(crate) fn from_scaled_instant(scaled: u128, rate: u64) -> Self {
        let rate = rate.max(1) as u128;
        let ceil = scaled.div_ceil(rate);
        match u64::try_from(ceil) {
            Ok(expires_at) => Self {
                expires_at,
                // (ceil × rate − scaled) < rate ≤ u64::MAX
                word: (ceil * rate - scaled) as u64,
            },
            Err(_) => Self {
                expires_at: u64::MAX,
                word: 0,
            },
        }
    }

    /// The exact instant `max(stored, now)`, as a `KeyState`.
    pub(crate) fn at_least(&self, now: Nanos, rate: u64) -> KeyState {
        if self.scaled_instant(rate) >= now as u128 * rate as u128 {
            *self
        } else {
            KeyState {
                expires_at: now,
                word: 0,
            }
        }
    }

    /// The instant after a charge the bucket could not hold (`charge_rejected`):
    /// `max(stored, now) + delta / rate`, but at most `now + 2 × capacity / rate` (a bucket
    /// owes at most one bucket, and the scripts' arithmetic stays exact), and never
    /// earlier than `max(stored, now)`: a charge with a smaller capacity than the one
    /// that left the bucket where it is (a priority class's, or a limit reloaded with a
    /// smaller burst) must not hand its tokens back.
    pub(crate) fn charged(&self, now: Nanos, rate: u64, delta: u128, capacity: u128) -> KeyState {
        let base = self.at_least(now, rate);
        let charged = base.advanced(delta, rate);
        let most = KeyState {
            expires_at: now,
            word: 0,
        }
        .advanced(2 * capacity, rate);
        if charged.scaled_instant(rate) <= most.scaled_instant(rate) {
            charged
        } else if most.scaled_instant(rate) >= base.scaled_instant(rate) {
            most
        } else {
            base
        }
    }

    /// This exact instant moved later by `delta / rate` ns, without dividing the whole
    /// (u128) instant: only `delta`, which is small, is divided.
    pub(crate) fn advanced(&self, delta: u128, rate: u64) -> KeyState {
        let rate = rate.max(1);
        let word = self.word as u128;
        if delta < word {
            // Still before the same whole nanosecond.
            return KeyState {
                expires_at: self.expires_at,
                word: (word - delta) as u64,
            };
        }
        let x = delta - word;
        let whole = div_ceil(x, rate);
        KeyState {
            expires_at: self.expires_at.saturating_add(whole),
            word: (whole as u128 * rate as u128 - x) as u64,
        }
    }
}

/// `ceil(n / d)` as nanoseconds, saturating at `u64::MAX`.
pub(crate) fn ceil_div_nanos(n: u128, d: u64) -> Nanos {
    div_ceil(n, d)
}

/// `n / d` rounded down, saturating at `u64::MAX`; u64 division when `n` fits.
fn floor_div(n: u128, d: u64) -> u64 {
    let d = d.max(1);
    match u64::try_from(n) {
        Ok(n) => n / d,
        Err(_) => u64::try_from(n / d as u128).unwrap_or(u64::MAX),
    }
}

/// `ceil(n / d)`, saturating at `u64::MAX`; u64 division when `n` fits.
fn div_ceil(n: u128, d: u64) -> u64 {
    let d = d.max(1);
    match u64::try_from(n) {
        Ok(n) => n.div_ceil(d),
        Err(_) => u64::try_from(n.div_ceil(d as u128)).unwrap_or(u64::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_charge_with_a_smaller_capacity_never_moves_the_instant_earlier() {
        // 1 unit per ns (rate 1, window 1): a bucket 100 ahead of now, charged 5 with a
        // capacity of 30 (cap 60 past now), stays 100 ahead; with a capacity of 100 it
        // moves to 105; from now, capped at 60.
        let now = 1_000;
        let st = KeyState {
            expires_at: now + 100,
            word: 0,
        };
        assert_eq!(st.charged(now, 1, 5, 30).expires_at, now + 100);
        assert_eq!(st.charged(now, 1, 5, 100).expires_at, now + 105);
        let fresh = KeyState::default();
        assert_eq!(fresh.charged(now, 1, 500, 30).expires_at, now + 60);
    }

    #[test]
    fn scaled_instants_round_trip_exactly() {
        for (scaled, rate) in [
            (0u128, 3u64),
            (10, 3),
            (11, 3),
            (12, 3),
            (7, 1),
            (1 << 70, 1_000_003),
        ] {
            let s = KeyState::from_scaled_instant(scaled, rate);
            assert_eq!(s.scaled_instant(rate), scaled, "{scaled}/{rate}");
            assert!(s.word < rate);
        }
    }

    #[test]
    fn advancing_matches_dividing_the_whole_instant() {
        for (start, delta, rate) in [
            (1_000u128 * 7 + 3, 5u128, 7u64),
            (70, 0, 7),
            (70, 1, 7),
            (71, 6, 7),
            (0, 1 << 40, 3),
            (99, 1, 1_000_000_007),
        ] {
            let s = KeyState::from_scaled_instant(start, rate);
            assert_eq!(
                s.advanced(delta, rate),
                KeyState::from_scaled_instant(start + delta, rate),
                "{start}+{delta} /{rate}"
            );
        }
    }

    #[test]
    fn an_instant_past_u64_saturates() {
        let s = KeyState::from_scaled_instant(u128::MAX, 2);
        assert_eq!(s.expires_at, u64::MAX);
    }

    #[test]
    fn a_debt_rejects_a_cost_of_0_unless_it_empties_the_bucket() {
        // 1 per second, burst 1; charged 2 past what it holds: owes one bucket.
        let bucket = Bucket::new(1, 1_000_000_000, 1);
        let mut st = KeyState::default();
        bucket.charge(&mut st, 0, 3);
        let mut copy = st;
        let (held, ahead) = bucket.check(&mut copy, 0, 0, Debt::Rejects);
        assert_eq!(ahead, 2_000_000_000, "capped at two capacities");
        assert!(!held.allowed);
        assert_eq!(held.retry_after, 1_000_000_000);
        let (empty, _) = bucket.check(&mut st, 0, 0, Debt::Empties);
        assert!(empty.allowed);
        assert_eq!((empty.remaining, empty.reset_after), (0, 1_000_000_000));
    }
}
