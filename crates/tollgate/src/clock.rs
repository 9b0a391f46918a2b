//! Time, as Tollgate's algorithms see it: whole nanoseconds since the Unix epoch.
//!
//! The algorithms never read a clock; callers pass `now` in. A [`Clock`] is what the
//! stores and front ends use to produce that `now`: [`SystemClock`] in production and
//! [`ManualClock`] in tests (yours too), where time moves only when you move it.
//!
//! ```
//! use tollgate::clock::{Clock, ManualClock, NANOS_PER_SEC};
//! let clock = ManualClock::new(1_699_920_000 * NANOS_PER_SEC);
//! let handle = clock.clone(); // clones share one time
//! handle.advance_secs_f64(1.5);
//! assert_eq!(clock.now(), 1_699_920_001 * NANOS_PER_SEC + 500_000_000);
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A point in time or a span of time, in whole nanoseconds.
///
/// As a point it counts from the Unix epoch; `u64` nanoseconds reach the year 2554.
/// Every algorithm does its arithmetic on this one unit, so nothing is lost to
/// floating point or unit conversions.
pub type Nanos = u64;

/// Nanoseconds in one second.
pub const NANOS_PER_SEC: Nanos = 1_000_000_000;

/// Converts a [`Duration`] to [`Nanos`], saturating at `u64::MAX` (about 584 years).
pub fn nanos(duration: Duration) -> Nanos {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// A source of the current time.
pub trait Clock: Send + Sync {
    /// The current time in nanoseconds since the Unix epoch.
    fn now(&self) -> Nanos;
}

/// The wall clock, read fast.
///
/// Wall time (nanoseconds since the Unix epoch) is what epoch-aligned fixed windows
/// need and what several Tollgate instances can agree on. Reading `CLOCK_REALTIME`
/// can cost more than a whole check on a virtual machine (docs/benchmarks.md, Library),
/// so this clock reads the CPU's time-stamp counter (through `quanta`, which falls back
/// to the OS clock where the TSC is not usable) and adds it to a wall-clock reading taken at most
/// 100 ms earlier. The counter's rate is calibrated once, and a busy virtual machine
/// can get it wrong by a part in a thousand; re-anchoring every 100 ms keeps the clock
/// within a fraction of a millisecond of the system clock, NTP adjustments included.
///
/// If the wall clock steps backwards, the algorithms treat the step as no time passing:
/// a stored state is never rewound, so a backwards step can only make a limit stricter
/// for a moment, never looser.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Nanos {
        anchored::now()
    }
}

/// The TSC-plus-anchor reading behind [`SystemClock`]; a seqlock of atomics.
mod anchored {
    use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
    use std::sync::OnceLock;
    use std::time::{SystemTime, UNIX_EPOCH};

    use super::{nanos, Nanos};

    /// How long a wall-clock reading anchors the counter before another is taken.
    const REANCHOR_EVERY: Nanos = 100_000_000;

    struct Anchor {
        clock: quanta::Clock,
        seq: AtomicU64,
        wall: AtomicU64,
        raw: AtomicU64,
        updating: AtomicBool,
    }

    static ANCHOR: OnceLock<Anchor> = OnceLock::new();

    fn wall() -> Nanos {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(nanos)
            .unwrap_or(0)
    }

    fn anchor() -> &'static Anchor {
        ANCHOR.get_or_init(|| {
            let clock = quanta::Clock::new();
            let raw = clock.raw();
            Anchor {
                seq: AtomicU64::new(0),
                wall: AtomicU64::new(wall()),
                raw: AtomicU64::new(raw),
                updating: AtomicBool::new(false),
                clock,
            }
        })
    }

    pub(super) fn now() -> Nanos {
        let a = anchor();
        loop {
            let seq = a.seq.load(Ordering::Acquire);
            let (wall_at, raw_at) = (
                a.wall.load(Ordering::Relaxed),
                a.raw.load(Ordering::Relaxed),
            );
            fence(Ordering::Acquire);
            if seq % 2 == 1 || a.seq.load(Ordering::Relaxed) != seq {
                std::hint::spin_loop();
                continue;
            }
            let raw = a.clock.raw();
            let elapsed = a.clock.delta_as_nanos(raw_at, raw);
            if elapsed >= REANCHOR_EVERY {
                reanchor(a);
            }
            return wall_at.saturating_add(elapsed);
        }
    }

    /// Takes a fresh wall-clock reading; one thread at a time, the others keep reading.
    fn reanchor(a: &Anchor) {
        if a.updating.swap(true, Ordering::Acquire) {
            return;
        }
        let raw = a.clock.raw();
        let w = wall();
        a.seq.fetch_add(1, Ordering::AcqRel);
        a.wall.store(w, Ordering::Relaxed);
        a.raw.store(raw, Ordering::Relaxed);
        a.seq.fetch_add(1, Ordering::Release);
        a.updating.store(false, Ordering::Release);
    }
}

/// A clock that moves only when told to; clones share the same time.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock showing `start` nanoseconds since the epoch.
    pub fn new(start: Nanos) -> Self {
        Self {
            now: Arc::new(AtomicU64::new(start)),
        }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.advance_nanos(nanos(by));
    }

    /// Moves the clock forward by `by` nanoseconds.
    pub fn advance_nanos(&self, by: Nanos) {
        self.now.fetch_add(by, Ordering::SeqCst);
    }

    /// Moves the clock forward by `secs` seconds, rounded to the nearest nanosecond
    /// (the rule the conformance cases use: `advance: 0.1` is exactly 100,000,000 ns).
    pub fn advance_secs_f64(&self, secs: f64) {
        self.advance_nanos(secs_f64_to_nanos(secs));
    }

    /// Sets the clock to `to` nanoseconds since the epoch.
    pub fn set(&self, to: Nanos) {
        self.now.store(to, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Nanos {
        self.now.load(Ordering::SeqCst)
    }
}

/// Converts seconds given as a decimal number to whole nanoseconds, rounding to nearest.
/// Negative and non-finite inputs give 0.
pub fn secs_f64_to_nanos(secs: f64) -> Nanos {
    if secs.is_finite() && secs > 0.0 {
        // `as` saturates at u64::MAX for huge values.
        (secs * NANOS_PER_SEC as f64).round() as u64
    } else {
        0
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Nanos {
        (**self).now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{SystemTime, UNIX_EPOCH};

    #[test]
    fn manual_clock_clones_share_time() {
        let a = ManualClock::new(10);
        let b = a.clone();
        b.advance(Duration::from_millis(1));
        assert_eq!(a.now(), 1_000_010);
        a.set(5);
        assert_eq!(b.now(), 5);
    }

    #[test]
    fn decimal_seconds_round_to_the_nearest_nanosecond() {
        assert_eq!(secs_f64_to_nanos(0.1), 100_000_000);
        assert_eq!(secs_f64_to_nanos(1e-9 * 0.6), 1);
        assert_eq!(secs_f64_to_nanos(-3.0), 0);
        assert_eq!(secs_f64_to_nanos(f64::NAN), 0);
    }

    #[test]
    fn system_clock_agrees_with_the_os_wall_clock() {
        let os = || {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(nanos)
                .unwrap_or(0)
        };
        for _ in 0..3 {
            let before = os();
            let ours = SystemClock.now();
            let after = os();
            // Within a millisecond of the OS reading (it re-anchors every 100 ms).
            assert!(
                ours + 1_000_000 >= before && ours <= after + 1_000_000,
                "{before} {ours} {after}"
            );
            std::thread::sleep(Duration::from_millis(600));
        }
    }
}
