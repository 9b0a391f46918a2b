//! A retry budget, as tower's `TpsBudget` (and Finagle's before it): over a sliding
//! window (`ttl`), retries may be at most `retry_percent` of the requests sent, plus a
//! reserve of `min_per_sec × ttl` so that a caller sending little can still retry.
//!
//! Per-request retry limits alone let an overloaded server see every request several
//! times over; a budget shared by all of a client's requests caps the extra load at a
//! fixed share, however many requests fail at once.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// The number of slots the window is counted in.
const SLOTS: usize = 10;

/// A retry budget shared by the requests of a client (cheap to share: wrap in an `Arc`,
/// as the layer does).
#[derive(Debug)]
pub struct Budget {
    ttl: Duration,
    min_per_sec: u32,
    retry_percent: f64,
    slot_width: Duration,
    start: Instant,
    slots: Mutex<[Slot; SLOTS]>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    /// The slot's number since `start`; counts of another number are stale.
    epoch: u64,
    requests: u64,
    retries: u64,
}

impl Default for Budget {
    /// Tower's defaults: 10 s window, 10 retries a second in reserve, 20 % of requests.
    fn default() -> Self {
        Budget::new(Duration::from_secs(10), 10, 0.2)
    }
}

impl Budget {
    /// A budget over `ttl` (at least a millisecond) with `min_per_sec` retries a second
    /// always allowed and `retry_percent` (0.0 to 1000.0) of the requests on top.
    pub fn new(ttl: Duration, min_per_sec: u32, retry_percent: f64) -> Self {
        let ttl = ttl.max(Duration::from_millis(1));
        let retry_percent = if retry_percent.is_finite() {
            retry_percent.clamp(0.0, 1000.0)
        } else {
            0.0
        };
        Budget {
            ttl,
            min_per_sec,
            retry_percent,
            slot_width: ttl / SLOTS as u32,
            start: Instant::now(),
            slots: Mutex::new([Slot::default(); SLOTS]),
        }
    }

    /// Counts a request (each first attempt).
    pub fn deposit(&self) {
        self.deposit_at(Instant::now());
    }

    /// Takes one retry from the budget: `false` when it is spent.
    pub fn withdraw(&self) -> bool {
        self.withdraw_at(Instant::now())
    }

    /// [`deposit`](Self::deposit) at `now`.
    pub fn deposit_at(&self, now: Instant) {
        let mut slots = self.slots.lock();
        self.slot(&mut slots, now).requests += 1;
    }

    /// [`withdraw`](Self::withdraw) at `now`.
    pub fn withdraw_at(&self, now: Instant) -> bool {
        let mut slots = self.slots.lock();
        let current = self.epoch(now);
        let (mut requests, mut retries) = (0u64, 0u64);
        for s in slots.iter().filter(|s| fresh(s.epoch, current)) {
            requests += s.requests;
            retries += s.retries;
        }
        let reserve = f64::from(self.min_per_sec) * self.ttl.as_secs_f64();
        let allowed = reserve + self.retry_percent * requests as f64;
        if (retries + 1) as f64 > allowed {
            return false;
        }
        self.slot(&mut slots, now).retries += 1;
        true
    }

    fn epoch(&self, now: Instant) -> u64 {
        let since = now.saturating_duration_since(self.start).as_nanos();
        (since / self.slot_width.as_nanos().max(1)) as u64
    }

    /// The slot of `now`, cleared when it held an older epoch.
    fn slot<'a>(&self, slots: &'a mut [Slot; SLOTS], now: Instant) -> &'a mut Slot {
        let epoch = self.epoch(now);
        let slot = &mut slots[(epoch % SLOTS as u64) as usize];
        if slot.epoch != epoch {
            *slot = Slot {
                epoch,
                ..Slot::default()
            };
        }
        slot
    }
}

/// Whether a slot of `epoch` is in the window that ends in `current`.
fn fresh(epoch: u64, current: u64) -> bool {
    epoch <= current && current - epoch < SLOTS as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_alone() {
        // 1 retry a second over 2 s: 2 retries, then none, with no requests counted.
        let b = Budget::new(Duration::from_secs(2), 1, 0.0);
        let now = Instant::now();
        assert!(b.withdraw_at(now));
        assert!(b.withdraw_at(now));
        assert!(!b.withdraw_at(now));
    }

    #[test]
    fn a_share_of_the_requests() {
        let b = Budget::new(Duration::from_secs(10), 0, 0.2);
        let now = Instant::now();
        for _ in 0..100 {
            b.deposit_at(now);
        }
        let granted = (0..100).filter(|_| b.withdraw_at(now)).count();
        assert_eq!(granted, 20);
        // Five more requests: one more retry.
        for _ in 0..5 {
            b.deposit_at(now);
        }
        assert!(b.withdraw_at(now));
        assert!(!b.withdraw_at(now));
    }

    #[test]
    fn the_window_slides() {
        let b = Budget::new(Duration::from_secs(10), 0, 0.5);
        let t0 = Instant::now();
        for _ in 0..10 {
            b.deposit_at(t0);
        }
        assert_eq!((0..10).filter(|_| b.withdraw_at(t0)).count(), 5);
        // Half a window later the same requests and retries still count.
        let half = t0 + Duration::from_secs(5);
        assert!(!b.withdraw_at(half));
        // A whole window later they are forgotten: no requests, no retries.
        let later = t0 + Duration::from_secs(11);
        assert!(!b.withdraw_at(later));
        for _ in 0..4 {
            b.deposit_at(later);
        }
        assert_eq!((0..4).filter(|_| b.withdraw_at(later)).count(), 2);
    }

    #[test]
    fn odd_settings_do_not_panic() {
        let b = Budget::new(Duration::ZERO, u32::MAX, f64::NAN);
        assert!(b.withdraw());
        b.deposit();
        let b = Budget::new(Duration::MAX, 0, -1.0);
        b.deposit();
        assert!(!b.withdraw());
    }
}
