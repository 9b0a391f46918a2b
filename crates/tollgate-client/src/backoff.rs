//! Exponential backoff with full jitter, as in AWS's "Exponential Backoff and Jitter":
//! before retry `attempt` (0 for the first retry) a caller sleeps a uniformly random time
//! in `[0, min(cap, base × 2^attempt)]`. Callers that failed together then spread out
//! over the whole window instead of coming back in lockstep.
//!
//! [`Backoff`] also bounds a request's retries: at most [`Backoff::max_retries`], and no
//! retry whose wait would end past [`Backoff::max_total`] from the first attempt.
//! [`Jitter`] is the random source: a SplitMix64 generator, seeded from the clock and a
//! counter by default, or from a fixed seed for reproducible tests.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The schedule of retries of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The first retry's window (`base × 2^0`).
    pub base: Duration,
    /// The longest window.
    pub cap: Duration,
    /// The most retries of one request (attempts are one more).
    pub max_retries: u32,
    /// The longest time from the first attempt to the start of the last retry.
    pub max_total: Duration,
}

impl Default for Backoff {
    /// 100 ms base, 10 s cap, 3 retries, 30 s in all.
    fn default() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(10))
    }
}

impl Backoff {
    /// `base` and `cap`, with 3 retries and 30 s in all.
    pub fn new(base: Duration, cap: Duration) -> Self {
        Backoff {
            base,
            cap,
            max_retries: 3,
            max_total: Duration::from_secs(30),
        }
    }

    /// With at most `n` retries.
    pub fn max_retries(mut self, n: u32) -> Self {
        self.max_retries = n;
        self
    }

    /// With at most `total` from the first attempt to the last retry.
    pub fn max_total(mut self, total: Duration) -> Self {
        self.max_total = total;
        self
    }

    /// The window of retry `attempt` (0 first): `min(cap, base × 2^attempt)`.
    pub fn window(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.cap)
    }

    /// The sleep before retry `attempt` (0 first): uniform in `[0, window(attempt)]`.
    pub fn delay(&self, attempt: u32, jitter: &mut Jitter) -> Duration {
        let window = self.window(attempt).as_nanos().min(u128::from(u64::MAX)) as u64;
        Duration::from_nanos(jitter.below(window.saturating_add(1)))
    }

    /// Whether retry `attempt` (0 first) may start after `elapsed` since the first
    /// attempt and a further `wait`.
    pub fn allows(&self, attempt: u32, elapsed: Duration, wait: Duration) -> bool {
        attempt < self.max_retries && elapsed.saturating_add(wait) <= self.max_total
    }
}

/// A small, fast, non-cryptographic generator (SplitMix64) for jitter.
#[derive(Debug, Clone)]
pub struct Jitter {
    state: u64,
}

impl Default for Jitter {
    fn default() -> Self {
        Self::new()
    }
}

impl Jitter {
    /// Seeded from the clock and a process-wide counter: two generators made at the same
    /// instant still differ.
    pub fn new() -> Self {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let mut j = Jitter::seeded(nanos ^ n.wrapping_mul(0xA076_1D64_78BD_642F));
        // Mix in the process, so two processes started together differ too.
        j.state ^= u64::from(std::process::id()).rotate_left(32);
        j
    }

    /// From a fixed `seed`: the same sequence every run.
    pub fn seeded(seed: u64) -> Self {
        Jitter { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform number in `[0, n)` (0 when `n` is 0), by Lemire's multiply-shift; the
    /// bias is below `n / 2^64`, far under what jitter can notice.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_double_up_to_the_cap() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let w: Vec<u128> = (0..6).map(|a| b.window(a).as_millis()).collect();
        assert_eq!(w, [100, 200, 400, 800, 1000, 1000]);
        // No overflow for absurd attempts or bases.
        assert_eq!(b.window(u32::MAX), Duration::from_secs(1));
        let huge = Backoff::new(Duration::MAX, Duration::MAX);
        assert_eq!(huge.window(40), Duration::MAX);
        let mut j = Jitter::seeded(1);
        assert!(huge.delay(40, &mut j) <= Duration::MAX);
    }

    #[test]
    fn delays_are_full_jitter_within_the_window() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
        let mut j = Jitter::seeded(42);
        for attempt in 0..8 {
            let w = b.window(attempt);
            let delays: Vec<Duration> = (0..2000).map(|_| b.delay(attempt, &mut j)).collect();
            assert!(delays.iter().all(|d| *d <= w));
            // Full jitter: the whole window is used, its mean near the middle.
            let mean = delays.iter().sum::<Duration>() / delays.len() as u32;
            assert!(mean > w * 4 / 10 && mean < w * 6 / 10, "{mean:?} of {w:?}");
            assert!(delays.iter().any(|d| *d < w / 10));
            assert!(delays.iter().any(|d| *d > w * 9 / 10));
        }
    }

    #[test]
    fn a_seed_repeats_and_seeds_differ() {
        let b = Backoff::default();
        let run = |seed| {
            let mut j = Jitter::seeded(seed);
            (0..5).map(|a| b.delay(a, &mut j)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        assert_ne!(Jitter::new().next_u64(), Jitter::new().next_u64());
    }

    #[test]
    fn no_two_callers_retry_at_the_same_instant() {
        // A hundred callers rejected at the same instant, each with its own seed, at
        // millisecond resolution: each retry round spreads them over its window rather
        // than sending them back together.
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(60));
        let mut callers: Vec<Jitter> = (0..100).map(|i| Jitter::seeded(1000 + i)).collect();
        let mut at = vec![Duration::ZERO; callers.len()];
        for attempt in 0..3 {
            for (t, j) in at.iter_mut().zip(&mut callers) {
                *t += b.delay(attempt, j);
            }
            let mut micros: Vec<u128> = at.iter().map(|t| t.as_micros()).collect();
            micros.sort_unstable();
            micros.dedup();
            assert_eq!(micros.len(), callers.len(), "retry {attempt}");
        }
        // And they are spread: no 10 ms of the first round holds more than a fifth.
        let mut j: Vec<Jitter> = (0..100).map(|i| Jitter::seeded(1000 + i)).collect();
        let mut slots = [0u32; 11];
        for j in &mut j {
            slots[(b.delay(0, j).as_millis() / 10) as usize] += 1;
        }
        assert!(slots.iter().all(|n| *n <= 20), "{slots:?}");
    }

    #[test]
    fn bounded_in_retries_and_total_time() {
        let b = Backoff::default()
            .max_retries(2)
            .max_total(Duration::from_secs(5));
        assert!(b.allows(0, Duration::ZERO, Duration::from_secs(1)));
        assert!(b.allows(1, Duration::from_secs(4), Duration::from_secs(1)));
        assert!(!b.allows(2, Duration::ZERO, Duration::ZERO));
        assert!(!b.allows(1, Duration::from_secs(4), Duration::from_millis(1001)));
        assert!(!b.allows(0, Duration::MAX, Duration::MAX));
    }

    #[test]
    fn below_is_in_range() {
        let mut j = Jitter::seeded(3);
        assert_eq!(j.below(0), 0);
        assert_eq!(j.below(1), 0);
        assert!((0..1000).all(|_| j.below(7) < 7));
    }
}
