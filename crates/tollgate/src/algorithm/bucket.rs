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
//!
//! **Warm-up** (token bucket and GCRA, `warmup = P` ns; never with an overdraft):
//! Guava's `SmoothWarmingUp` with a cold factor of 3, deciding rather than waiting. The
//! key keeps `σ`, its stored permits scaled by `window` (what [`WarmState`] keeps is
//! `u = M − σ`): `σ` grows by `limit` per ns while the bucket is full (now past its
//! instant) and has been for two stable intervals (`2 × window` scaled: the grace), up
//! to `M = P × limit`; a fresh key is fully cold (`σ = M`). The grace is where this
//! differs from Guava, whose blocking caller asks again exactly when it may: a caller
//! that is refused and asks again later leaves a gap after the bucket's instant, and
//! counting that gap as rest would keep a key asked at its own rate cold for ever; with
//! the grace, a key asked at least at its cold rate warms as Guava's does. A request fits
//! exactly as in the bucket without warm-up (`ahead + need ≤ capacity`). Once admitted,
//! the instant moves by `need + extra` instead of `need`, where, with `A = max(0, 2σ − M)`
//! and `B = max(0, A − 2 × need)` (twice the stored permits above the threshold
//! `T = M / 2`, before and after the request takes `need` of them),
//! `extra = (A − B)(A + B) / (2M)` (Guava's trapezoid: each permit above the threshold
//! costs from one interval at `T` to three at `M`), rounded up to a multiple of the grid
//! `G = tick × gcd(limit, window / tick)` (`warm_tick`: the unit of the Redis scripts'
//! arithmetic for this limit, computed in that unit as they compute it, so both round
//! alike); then `σ` drops by `min(need, σ)`.
//! The rounding adds less than `G / limit` ns (below one tick) per admission, and
//! nothing once the key is warm (`σ ≤ T`: `A = 0`). Since the admission test is the
//! bucket's and the instant only moves further, a warm-up never admits more than the
//! same bucket without one.

use super::{KeyState, WarmState};
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
    /// The warm-up period in ns (0: none).
    warmup: Nanos,
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
            warmup: 0,
        }
    }

    /// Warms a key up over `warmup` ns (see the module documentation).
    pub(crate) fn with_warmup(mut self, warmup: Nanos) -> Self {
        self.warmup = warmup;
        self
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

impl Bucket {
    /// `M = warmup × limit`: the stored permits of a fully cold key, scaled.
    fn warm_max(&self) -> u128 {
        self.warmup as u128 * self.limit as u128
    }

    /// A warm state's bucket instant ahead of `now` and how far from fully cold the key
    /// is at `now` (both scaled by `limit`).
    fn warm_read(&self, state: &WarmState, now: Nanos) -> (u128, u128) {
        let fresh = state
            .fresh
            .scaled_instant(self.limit)
            .saturating_sub(now as u128 * self.limit as u128);
        let ahead = fresh.saturating_sub(state.used + self.warm_grace());
        (ahead, state.used.min(fresh))
    }

    /// How long past its bucket's instant a key in use stays as warm as it was, scaled:
    /// two stable intervals (`2 × window`). A key used at least at its cold rate (one
    /// admission per three intervals) does not cool, however its requests fall.
    fn warm_grace(&self) -> u128 {
        2 * self.window as u128
    }

    /// The warm state whose bucket instant is `ahead` past `now` and whose key is `used`
    /// from fully cold there.
    fn warm_write(&self, now: Nanos, ahead: u128, used: u128) -> WarmState {
        WarmState {
            fresh: KeyState {
                expires_at: now,
                word: 0,
            }
            .advanced(ahead + self.warm_grace() + used, self.limit),
            used,
        }
    }

    /// The time a request of `need` (scaled) admitted `used` from fully cold adds to the
    /// bucket's instant beyond `need` (see the module documentation, "Warm-up"),
    /// computed in units of the grid `G` (as the scripts compute it): `M` and `need` are
    /// whole multiples of it, and so is `used` wherever now is a whole number of ticks
    /// (always at 1 ns); otherwise `used` is taken down to one (a colder key: more time,
    /// never less). A key at or below the threshold (`2 × used ≥ M`) takes none.
    fn warm_extra(&self, used: u128, need: u128) -> u128 {
        let m = self.warm_max();
        if m <= 2 * used {
            return 0;
        }
        let grid = match warm_tick(self.limit, self.window, self.burst, self.warmup) {
            Some((tick, g)) => tick as u128 * g as u128,
            None => 1,
        };
        // M / G < 2^49 (`warm_tick`), so the products stay below 2^100.
        let (m, used, need) = (m / grid, used / grid, need / grid);
        let a = m.saturating_sub(2 * used);
        let b = a.saturating_sub(2 * need);
        ((a - b) * (a + b)).div_ceil(2 * m) * grid
    }

    /// [`check`](Self::check) with a warm-up, on its [`WarmState`].
    pub(crate) fn check_warm(
        &self,
        state: &mut WarmState,
        now: Nanos,
        cost: u64,
        debt: Debt,
    ) -> Decision {
        let (limit, w) = (self.limit, self.window);
        if limit == 0 {
            return Decision::reject(limit, 0, 0, NEVER);
        }
        let (ahead, used) = self.warm_read(state, now);
        let capacity = self.burst as u128 * w as u128;
        let tolerance = self.tolerance();
        let need = cost as u128 * w as u128;
        let filled = match debt {
            Debt::Rejects => ahead,
            Debt::Empties => ahead.min(tolerance),
        };
        if filled <= tolerance && need <= tolerance - filled {
            let mut after = filled + need;
            if cost > 0 {
                after += self.warm_extra(used, need);
                let used = (used + need).min(self.warm_max());
                *state = self.warm_write(now, after, used);
            }
            return Decision::allow(
                limit,
                floor_div(capacity.saturating_sub(after), w),
                ceil_div_nanos(after, limit),
            );
        }
        let retry = if cost as u128 > self.burst as u128 + self.overdraft as u128 {
            NEVER
        } else {
            ceil_div_nanos(ahead + need - tolerance, limit)
        };
        Decision::reject(
            limit,
            floor_div(capacity.saturating_sub(ahead), w),
            ceil_div_nanos(ahead, limit),
            retry,
        )
    }

    /// [`charge`](Self::charge) with a warm-up: the bucket's instant moves as without
    /// one, and the key gets no warmer (a request not admitted is no use).
    pub(crate) fn charge_warm(&self, state: &mut WarmState, now: Nanos, cost: u64) {
        if cost == 0 || self.limit == 0 {
            return;
        }
        let (ahead, used) = self.warm_read(state, now);
        let at = KeyState {
            expires_at: now,
            word: 0,
        }
        .advanced(ahead, self.limit);
        let charged = at.charged(
            now,
            self.limit,
            cost as u128 * self.window as u128,
            self.tolerance(),
        );
        let ahead = charged.scaled_instant(self.limit) - now as u128 * self.limit as u128;
        *state = self.warm_write(now, ahead, used);
    }
}

/// The largest `M = warmup × limit` the scripts take, in their units (`tick × gcd`).
const WARM_MAX_SCRIPT: u128 = 1 << 49;
/// Every quantity of the scripts stays below this (`store/redis/script.rs`).
const SCRIPT_MAX: u128 = 1 << 51;

/// The tick (1 ns, 1 us, 1 ms or 1 s) at which a bucket of `limit` per `window` ns
/// holding `burst` with a warm-up of `warmup` ns is computed, and
/// `g = gcd(limit, window / tick)`: the finest tick dividing the window and the warm-up
/// at which the Redis scripts' arithmetic stays exact (`M` below 2^49 and
/// `(3 × burst + 1) × window + M` below 2^51, in units of `tick × g / limit` ns). The
/// warm-up's extra time is rounded up to a multiple of `tick × g` (scaled by `limit`)
/// in memory as in the scripts. `None`: no tick will do (the warm-up is too long for
/// the rate).
pub(crate) fn warm_tick(
    limit: u64,
    window: Nanos,
    burst: u64,
    warmup: Nanos,
) -> Option<(u64, u64)> {
    for tick in [1, 1_000, 1_000_000, 1_000_000_000] {
        if window % tick != 0 || warmup % tick != 0 {
            continue;
        }
        let (wt, pt) = (window / tick, warmup / tick);
        let g = if limit == 0 {
            wt.max(1)
        } else {
            gcd(limit, wt)
        };
        let (r, wr) = (limit / g, (wt / g) as u128);
        let m = pt as u128 * r as u128;
        let span = (3 * burst as u128 + 1) * wr + m;
        if (limit as u128) < SCRIPT_MAX
            && wr < SCRIPT_MAX
            && m < WARM_MAX_SCRIPT
            && span < SCRIPT_MAX
        {
            return Some((tick, g));
        }
    }
    None
}

/// The greatest common divisor (`b` when `a` is 0).
fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
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
