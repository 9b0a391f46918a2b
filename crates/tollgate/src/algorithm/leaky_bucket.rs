//! Leaky bucket: a bucket of size `burst` that drains at `limit` per window, used as a
//! meter (reject when full) or as a queue (admit with a delay so that requests leave
//! at a constant rate; reject when the queue is full).
//!
//! **Guarantee.** Meter: never more than `burst + limit × T / window` cost units in any
//! interval `T` (it admits what a token bucket of the same numbers admits). Queue: the
//! same admissions, and the admitted requests, each released after its
//! [`Decision::delay`], leave no closer together than `window / limit` per unit of
//! cost; no request waits longer than `(burst - cost) × window / limit`.
//!
//! **State.** 16 bytes ([`KeyState`]): the exact instant the bucket will be empty (for
//! the queue, when the last admitted request will have left).
//!
//! **Maths**, in units of `1 / window` request: `level = max(0, empty_at × limit - now × limit)`,
//! `need = cost × window`, `capacity = burst × window`. Pass iff `level + need <= capacity`;
//! then `empty_at = now + (level + need) / limit`. In queue mode the request waits
//! `delay = ceil(level / limit)`, the time for the work ahead of it to drain.
//!
//! **Example.** A queue draining 2 per second with room for 3: three requests at once
//! leave at 0, 500 ms and 1 s; the fourth is rejected.
//! ```
//! use std::time::Duration;
//! use tollgate::algorithm::{KeyState, LeakyBucket, LeakyMode};
//! const MS: u64 = 1_000_000;
//! let queue = LeakyBucket::new(2, Duration::from_secs(1), LeakyMode::Queue).with_burst(3);
//! let mut state = KeyState::default();
//! let t0 = 1_699_920_000_000 * MS;
//! let delays: Vec<u64> = (0..3).map(|_| queue.check(&mut state, t0, 1).delay).collect();
//! assert_eq!(delays, [0, 500 * MS, 1_000 * MS]);
//! assert!(!queue.check(&mut state, t0, 1).allowed);
//! ```

use std::time::Duration;

use super::bucket::{ceil_div_nanos, Bucket, Debt};
use super::KeyState;
use crate::clock::{nanos, Nanos};
use crate::decision::Decision;

/// How a [`LeakyBucket`] treats a request that finds the bucket partly full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeakyMode {
    /// Admit at once while there is room (a meter, like a token bucket).
    Meter,
    /// Admit with a delay so that admitted requests leave at the drain rate.
    Queue,
}

/// Leaky bucket parameters: drains `limit` per `window`, holds `burst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeakyBucket {
    /// Drain rate: cost units per window.
    pub limit: u64,
    /// Window length in nanoseconds.
    pub window: Nanos,
    /// Bucket (queue) size in cost units (default `limit`).
    pub burst: u64,
    /// Meter or queue.
    pub mode: LeakyMode,
}

impl LeakyBucket {
    /// Drains `limit` per `window`, holds `burst = limit`.
    pub fn new(limit: u64, window: Duration, mode: LeakyMode) -> Self {
        Self {
            limit,
            window: nanos(window),
            burst: limit,
            mode,
        }
    }

    /// Sets the bucket (queue) size.
    pub fn with_burst(mut self, burst: u64) -> Self {
        self.burst = burst;
        self
    }

    /// Pours `cost` in at `now` whether it fits or not (`charge_rejected`): the level
    /// rises past the bucket's size (to at most twice it), and nothing fits until it has
    /// drained below again.
    pub fn charge(&self, state: &mut KeyState, now: Nanos, cost: u64) {
        self.bucket().charge(state, now, cost);
    }

    /// Decides a request of `cost` at `now`, filling `state` if it passes.
    pub fn check(&self, state: &mut KeyState, now: Nanos, cost: u64) -> Decision {
        let (mut d, level) = self.bucket().check(state, now, cost, Debt::Rejects);
        if d.allowed && self.mode == LeakyMode::Queue {
            // Waits for the work ahead of it to drain.
            d.delay = ceil_div_nanos(level, self.limit);
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

    /// The shared bucket: `empty_at` is its instant, the level its `ahead`.
    fn bucket(&self) -> Bucket {
        Bucket::new(self.limit, self.window, self.burst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    const MS: u64 = 1_000_000;

    proptest! {
        /// At the largest numbers a rule file accepts (a full bucket drains within 100
        /// years, a queue holds a request at most a day) and any instant of the next
        /// century, requests at one instant get answers that only move one way:
        /// remaining down, reset and (queue) delay up.
        #[test]
        fn answers_stay_monotone_at_the_bounds_rule_files_allow(
            limit in 1u64..=u64::from(u32::MAX),
            unit in prop::sample::select(vec![1u64, 60, 3_600, 86_400, 604_800, 2_592_000, 31_536_000]),
            queue: bool,
            costs in prop::collection::vec(0.0f64..=0.6, 1..12),
            years in 0u64..100,
        ) {
            let most = if queue { 86_400u128 * u128::from(limit) / u128::from(unit) + 1 } else { 100 * 31_536_000u128 * u128::from(limit) / u128::from(unit) };
            let burst = u64::try_from(most).unwrap_or(u64::MAX).min(u64::from(u32::MAX)).max(1);
            let mode = if queue { LeakyMode::Queue } else { LeakyMode::Meter };
            let bucket = LeakyBucket::new(limit, Duration::from_secs(unit), mode).with_burst(burst);
            let now = 1_790_000_000 * 1_000_000_000 + years * 31_536_000 * 1_000_000_000;
            let mut state = KeyState::default();
            let mut last: Option<Decision> = None;
            for fraction in costs {
                let cost = ((burst as f64 * fraction) as u64).max(1);
                let d = bucket.check(&mut state, now, cost);
                if let Some(prev) = last {
                    prop_assert!(d.remaining <= prev.remaining, "{prev:?} then {d:?}");
                    prop_assert!(d.reset_after >= prev.reset_after, "{prev:?} then {d:?}");
                    if d.allowed && prev.allowed {
                        prop_assert!(d.delay >= prev.delay, "{prev:?} then {d:?}");
                    }
                }
                prop_assert!(d.delay <= 86_400 * 1_000_000_000);
                last = Some(d);
            }
        }
    }

    #[test]
    fn a_meter_admits_without_delay() {
        let meter = LeakyBucket::new(2, Duration::from_secs(1), LeakyMode::Meter);
        let mut st = KeyState::default();
        assert_eq!(meter.check(&mut st, 0, 1).delay, 0);
        assert_eq!(meter.check(&mut st, 0, 1).delay, 0);
        let third = meter.check(&mut st, 0, 1);
        assert_eq!((third.allowed, third.retry_after), (false, 500 * MS));
    }

    #[test]
    fn a_cost_above_the_bucket_still_reports_what_is_left() {
        let meter = LeakyBucket::new(10, Duration::from_secs(1), LeakyMode::Meter).with_burst(5);
        let mut st = KeyState::default();
        assert!(meter.check(&mut st, 0, 1).allowed);
        let before = st;
        let d = meter.check(&mut st, 0, 6);
        assert!(d.can_never_pass());
        assert_eq!((d.remaining, d.reset_after), (4, 100 * MS));
        assert_eq!(st, before, "nothing charged");
    }

    #[test]
    fn queued_requests_leave_at_the_drain_rate() {
        let q = LeakyBucket::new(10, Duration::from_secs(1), LeakyMode::Queue).with_burst(5);
        let mut st = KeyState::default();
        let mut departures = Vec::new();
        for i in 0..40u64 {
            let now = i * 20 * MS; // 50 per second offered
            let d = q.check(&mut st, now, 1);
            if d.allowed {
                assert!(d.delay <= 400 * MS, "waits at most (burst - 1) intervals");
                departures.push(now + d.delay);
            }
        }
        for pair in departures.windows(2) {
            assert!(pair[1] - pair[0] >= 100 * MS, "{pair:?}");
        }
        // 800 ms of offered load: 5 queued at once, then one per 100 ms drained.
        assert_eq!(departures.len(), 5 + 7);
    }
}
