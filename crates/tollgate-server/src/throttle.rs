//! [`Throttle`]: a log line that may repeat in a tight loop (an `accept` failing while the
//! process is out of file descriptors, an upstream that is down failing every request)
//! written at most once per interval, that one saying how many times it happened.

use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

/// At most one log line per interval, that one saying how many times it happened since
/// the last. Shared by reference: concurrent requests may count on one throttle.
#[derive(Debug)]
pub(crate) struct Throttle {
    every: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// When the last line was logged.
    last: Option<Instant>,
    /// Occurrences not yet reported.
    count: u64,
}

impl Throttle {
    /// A throttle letting one line through per `every`.
    pub(crate) fn new(every: Duration) -> Self {
        Self {
            every,
            state: Mutex::new(State::default()),
        }
    }

    /// Counts one occurrence at `now`; `Some(n)` when it is to be logged, `n` the
    /// occurrences since the last log, this one included.
    pub(crate) fn hit(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock();
        state.count += 1;
        match state.last {
            Some(last) if now.saturating_duration_since(last) < self.every => None,
            _ => {
                state.last = Some(now);
                Some(std::mem::take(&mut state.count))
            }
        }
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
}
