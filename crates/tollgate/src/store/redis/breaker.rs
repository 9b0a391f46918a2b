//! A circuit breaker: after `threshold` consecutive failures, stop calling Redis for
//! `cooldown`, then let one probe through; a success closes the circuit.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Consecutive-failure circuit breaker (lock-free).
#[derive(Debug)]
pub(crate) struct Breaker {
    threshold: u32,
    cooldown: Duration,
    start: Instant,
    failures: AtomicU32,
    /// Nanoseconds since `start` until which the circuit is open; 0 when closed.
    open_until: AtomicU64,
    opened: AtomicU64,
}

impl Breaker {
    pub fn new(threshold: u32, cooldown: Duration) -> Self {
        Self {
            threshold: threshold.max(1),
            cooldown,
            start: Instant::now(),
            failures: AtomicU32::new(0),
            open_until: AtomicU64::new(0),
            opened: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// May a call go to Redis now? While open: no, except one probe per cooldown.
    pub fn permit(&self) -> bool {
        let until = self.open_until.load(Ordering::Acquire);
        if until == 0 {
            return true;
        }
        let now = self.now();
        if now < until {
            return false;
        }
        // Half-open: the caller that moves the deadline on is the probe.
        let next = now.saturating_add(self.cooldown.as_nanos() as u64);
        self.open_until
            .compare_exchange(until, next, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    pub fn success(&self) {
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
        }
        if self.open_until.load(Ordering::Relaxed) != 0 {
            self.open_until.store(0, Ordering::Release);
        }
    }

    pub fn failure(&self) {
        let failures = self
            .failures
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        if failures >= self.threshold {
            let until = self.now().saturating_add(self.cooldown.as_nanos() as u64);
            if self.open_until.swap(until, Ordering::AcqRel) == 0 {
                self.opened.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// True while the circuit is open (calls are refused).
    pub fn is_open(&self) -> bool {
        self.open_until.load(Ordering::Acquire) != 0
    }

    /// How many times the circuit has opened.
    pub fn times_opened(&self) -> u64 {
        self.opened.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_the_threshold_and_lets_one_probe_through_after_the_cooldown() {
        // A cooldown long enough that a stalled test thread does not outlast it
        // between two of the checks below.
        let b = Breaker::new(3, Duration::from_millis(500));
        b.failure();
        b.failure();
        assert!(b.permit(), "two failures keep it closed");
        b.failure();
        assert!(!b.permit(), "the third opens it");
        std::thread::sleep(Duration::from_millis(600));
        assert!(b.permit(), "one probe after the cooldown");
        assert!(!b.permit(), "and only one");
        b.success();
        assert!(b.permit() && !b.is_open());
        assert_eq!(b.times_opened(), 1);
    }
}
