//! [`Throttle`]: a log line that may repeat in a tight loop (a store that is down
//! failing every request, an `accept` failing while the process is out of file
//! descriptors, an upstream that is down) written at most once per interval, that one
//! saying how many times it happened.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// At most one log line per interval, that one saying how many times it happened since
/// the last. Shared by reference: concurrent requests may count on one throttle, which
/// takes no lock (a few atomic operations per occurrence).
///
/// ```
/// use std::time::{Duration, Instant};
/// use tollgate::throttle::Throttle;
///
/// let log = Throttle::new(Duration::from_secs(10));
/// let start = Instant::now();
/// // The first occurrence is logged at once; the next ones within the interval are
/// // only counted, and the first one after it says how many there were.
/// assert_eq!(log.hit(start), Some(1));
/// assert_eq!(log.hit(start + Duration::from_secs(1)), None);
/// assert_eq!(log.hit(start + Duration::from_secs(2)), None);
/// assert_eq!(log.hit(start + Duration::from_secs(10)), Some(3));
/// ```
#[derive(Debug)]
pub struct Throttle {
    /// The interval, in nanoseconds.
    every: u64,
    /// The instant of the first occurrence, from which the others are measured.
    origin: OnceLock<Instant>,
    /// When the last line was logged: nanoseconds after `origin`, plus one; [`NEVER`]
    /// before the first.
    last: AtomicU64,
    /// Occurrences not yet reported.
    count: AtomicU64,
}

/// [`Throttle::last`] before anything was logged.
const NEVER: u64 = 0;

impl Throttle {
    /// A throttle letting one line through per `every`.
    pub fn new(every: Duration) -> Self {
        Self {
            every: u64::try_from(every.as_nanos()).unwrap_or(u64::MAX),
            origin: OnceLock::new(),
            last: AtomicU64::new(NEVER),
            count: AtomicU64::new(0),
        }
    }

    /// Counts one occurrence at `now`; `Some(n)` when it is to be logged, `n` the
    /// occurrences since the last log, this one included (the first occurrence is
    /// logged at once, and so is the first one an interval or more after the last
    /// logged).
    pub fn hit(&self, now: Instant) -> Option<u64> {
        let origin = *self.origin.get_or_init(|| now);
        let at = u64::try_from(now.saturating_duration_since(origin).as_nanos())
            .unwrap_or(u64::MAX)
            .saturating_add(1);
        self.count.fetch_add(1, Relaxed);
        let last = self.last.load(Relaxed);
        if last != NEVER && at.saturating_sub(last) < self.every {
            return None;
        }
        // Of the occurrences that saw the same `last`, one logs.
        self.last
            .compare_exchange(last, at, Relaxed, Relaxed)
            .ok()
            .map(|_| self.count.swap(0, Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A throttle of `every`, and the instant `ms` milliseconds after a start.
    fn clocked(every: Duration) -> (Throttle, impl Fn(u64) -> Instant) {
        let start = Instant::now();
        (Throttle::new(every), move |ms| {
            start + Duration::from_millis(ms)
        })
    }

    #[test]
    fn a_repeated_line_is_logged_at_most_once_per_interval_with_its_count() {
        let (log, at) = clocked(Duration::from_secs(5));
        // The first occurrence is logged at once.
        assert_eq!(log.hit(at(0)), Some(1));
        // A failing accept retried in a loop: silent for the rest of the interval.
        for ms in 1..=100 {
            assert_eq!(log.hit(at(ms * 10)), None);
        }
        assert_eq!(log.hit(at(4_999)), None);
        // Then one line for the 101 occurrences since the last.
        assert_eq!(log.hit(at(5_000)), Some(102));
        assert_eq!(log.hit(at(5_001)), None);
        // After a quiet spell, the next occurrence is logged at once, with the one held
        // back.
        assert_eq!(log.hit(at(60_000)), Some(2));
        assert_eq!(log.hit(at(120_000)), Some(1));
    }

    #[test]
    fn a_failing_upstream_is_logged_at_most_once_a_second_with_a_count() {
        let (log, at) = clocked(Duration::from_secs(1));
        assert_eq!(log.hit(at(0)), Some(1));
        let quiet = (0..1_000).filter(|&ms| log.hit(at(ms)).is_some()).count();
        assert_eq!(quiet, 0, "no warning within the same second");
        assert_eq!(
            log.hit(at(1_100)),
            Some(1_001),
            "the next one counts what was held back"
        );
    }

    #[test]
    fn an_earlier_instant_than_the_first_counts_as_the_first() {
        // Threads read the clock, then hit: one may come with an instant before the
        // one that came first.
        let (log, at) = clocked(Duration::from_secs(1));
        assert_eq!(log.hit(at(500)), Some(1));
        assert_eq!(log.hit(at(0)), None);
        assert_eq!(log.hit(at(1_499)), None);
        assert_eq!(log.hit(at(1_500)), Some(3));
    }

    #[test]
    fn concurrent_occurrences_are_each_counted_once() {
        let log = Throttle::new(Duration::from_secs(3_600));
        let start = Instant::now();
        let logged: u64 = std::thread::scope(|s| {
            let threads: Vec<_> = (0..4)
                .map(|_| s.spawn(|| (0..1_000).filter_map(|_| log.hit(start)).sum::<u64>()))
                .collect();
            threads.into_iter().map(|t| t.join().expect("join")).sum()
        });
        // One line (the first occurrence) within the hour; the rest reported by the
        // next line, an hour later.
        let next = log.hit(start + Duration::from_secs(3_600)).expect("logged");
        assert_eq!(logged + next, 4_001);
    }
}
