//! [`Gradient`]: a concurrency limit that follows the upstream's latency, as Envoy's
//! adaptive concurrency filter computes it (its "gradient controller").
//!
//! - **The minimum RTT.** At the start, and again every `min_rtt_interval` (plus up to
//!   `jitter` of it, so that a fleet of gateways does not measure at the same moment),
//!   the limit is pinned to `min_limit` until `min_rtt_samples` requests that started
//!   in that window have answered; the `percentile` of their latencies is the minimum
//!   RTT, the upstream's latency without queueing. The limit then returns to what it
//!   was.
//! - **The gradient.** Every `interval`, the `percentile` of the latencies answered in
//!   it is the measured RTT, and
//!   `gradient = clamp(min RTT × (1 + buffer) ÷ measured RTT, 0.5, 2)`,
//!   `limit = clamp(limit × gradient + √(limit × gradient), min_limit, max_limit)`.
//!   Under headroom (measured near the minimum) the limit grows; under queueing
//!   (measured past the target) it shrinks, at most halving per interval. The square
//!   root is Envoy's headroom: it keeps probing for more, so the limit settles where
//!   the latency is a little above the target.
//! - **Pinned at the minimum.** When five recalculations in a row leave the limit at
//!   `min_limit`, the minimum RTT is measured again at once (as Envoy does): the latency
//!   without queueing has likely changed (the upstream got slower for good, or the
//!   gateway itself is short of CPU and its own delay is in every latency), and a stale
//!   minimum would hold the limit at the bottom until the next scheduled measurement.
//! - **Not while idle.** As in Netflix's Gradient2, the limit does not grow in an
//!   interval in which fewer than half of it were in flight at once: light traffic says
//!   nothing about what the upstream can take, and a limit grown unseen to `max_limit`
//!   would take several intervals to come down when the traffic comes.
//!
//! The controller is pure: time comes in as [`Nanos`], latencies as samples, and the
//! limit goes out; the gateway (`http/adaptive.rs`) counts what is in flight. Samples
//! kept per interval are bounded ([`MAX_SAMPLES`], a uniform reservoir past that).

use std::time::Duration;

use crate::clock::{nanos, Nanos};

/// At most this many latencies are kept per interval (or minimum-RTT window); past it,
/// each new one replaces a random one (reservoir sampling), so the percentile stays an
/// unbiased estimate in bounded memory.
pub const MAX_SAMPLES: usize = 4096;

/// Recalculations in a row at `min_limit` that start a minimum-RTT measurement.
pub const PINNED_INTERVALS: u32 = 5;

/// The gradient's bounds, as Envoy's: at most halving, at most doubling per interval.
const GRADIENT_MIN: f64 = 0.5;
const GRADIENT_MAX: f64 = 2.0;

/// The controller's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradientSettings {
    /// The lowest the limit goes, and the limit while the minimum RTT is measured.
    pub min_limit: u32,
    /// The highest the limit goes.
    pub max_limit: u32,
    /// How often the limit is recalculated.
    pub interval: Duration,
    /// How often the minimum RTT is measured again (the rule files ask at least ten
    /// intervals).
    pub min_rtt_interval: Duration,
    /// Up to this share of `min_rtt_interval` is added at random to each wait for the
    /// next measurement (0 to 1).
    pub jitter: f64,
    /// How many answers make a minimum-RTT measurement.
    pub min_rtt_samples: u32,
    /// The target RTT is the minimum RTT times `1 + buffer` (0 to 10).
    pub buffer: f64,
    /// Which percentile of a window's latencies is its RTT (0 to 1, exclusive of 0).
    pub percentile: f64,
}

impl Default for GradientSettings {
    fn default() -> Self {
        Self {
            min_limit: 3,
            max_limit: 1000,
            interval: Duration::from_millis(100),
            min_rtt_interval: Duration::from_secs(30),
            jitter: 0.15,
            min_rtt_samples: 50,
            buffer: 0.25,
            percentile: 0.5,
        }
    }
}

/// What the controller is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Measuring the minimum RTT: the limit is `min_limit`, and `resume` is the limit
    /// to go back to.
    Measuring {
        /// The limit before the measurement.
        resume: u32,
    },
    /// Recalculating the limit every interval.
    Running,
}

/// A gradient concurrency controller; see the [module](self) docs.
#[derive(Debug, Clone)]
pub struct Gradient {
    settings: GradientSettings,
    limit: u32,
    phase: Phase,
    /// Changes whenever a minimum-RTT window starts or ends: a latency of a request
    /// that started under another epoch is not a sample of the window.
    epoch: u64,
    samples: Vec<Nanos>,
    /// Samples offered in this window (kept or not), for the reservoir.
    offered: u64,
    /// The most in flight at once in this interval.
    peak: u32,
    /// Recalculations in a row that left the limit at `min_limit`.
    pinned: u32,
    min_rtt: Option<Nanos>,
    measured: Option<Nanos>,
    next_update: Nanos,
    next_measure: Nanos,
    rng: u64,
}

impl Gradient {
    /// A controller starting at `now` by measuring the minimum RTT; `seed` drives the
    /// jitter and the reservoir.
    pub fn new(settings: GradientSettings, now: Nanos, seed: u64) -> Self {
        let min_limit = settings.min_limit.max(1);
        Self {
            settings: GradientSettings {
                min_limit,
                max_limit: settings.max_limit.max(min_limit),
                ..settings
            },
            limit: min_limit,
            phase: Phase::Measuring { resume: min_limit },
            epoch: 0,
            samples: Vec::new(),
            offered: 0,
            peak: 0,
            pinned: 0,
            min_rtt: None,
            measured: None,
            next_update: now,
            next_measure: Nanos::MAX,
            rng: seed,
        }
    }

    /// The settings in force.
    pub fn settings(&self) -> &GradientSettings {
        &self.settings
    }

    /// How many requests may be in flight now.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// What the controller is doing.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The epoch a request starting now belongs to; pass it back with its latency.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The last minimum RTT measured.
    pub fn min_rtt(&self) -> Option<Nanos> {
        self.min_rtt
    }

    /// The RTT of the last interval that had answers.
    pub fn measured_rtt(&self) -> Option<Nanos> {
        self.measured
    }

    /// When the limit is next due to change (the next recalculation, or the next
    /// minimum-RTT window), if nothing else comes first; `Nanos::MAX` while measuring.
    pub fn next_due(&self) -> Nanos {
        match self.phase {
            Phase::Measuring { .. } => Nanos::MAX,
            Phase::Running => self.next_update.min(self.next_measure),
        }
    }

    /// Notes that `in_flight` requests are in flight at once (the gateway calls it as
    /// it admits one).
    pub fn in_flight(&mut self, in_flight: u32) {
        self.peak = self.peak.max(in_flight);
    }

    /// Records the latency of a request that started in `epoch` and answered at `now`,
    /// then recalculates if due.
    pub fn record(&mut self, now: Nanos, epoch: u64, latency: Nanos) {
        // While measuring, only requests that started under the pinned limit count:
        // one that started before waited behind the old limit's queue.
        if epoch == self.epoch || self.phase == Phase::Running {
            self.offer(latency.max(1));
        }
        self.tick(now);
    }

    /// Recalculates the limit, or starts or ends a minimum-RTT window, when due at
    /// `now`. Returns whether the limit changed.
    pub fn tick(&mut self, now: Nanos) -> bool {
        let before = self.limit;
        match self.phase {
            Phase::Measuring { resume } => {
                if self.offered >= u64::from(self.settings.min_rtt_samples.max(1)) {
                    self.min_rtt = self.take_percentile();
                    self.limit = resume;
                    self.phase = Phase::Running;
                    self.epoch += 1;
                    self.next_update = now.saturating_add(nanos(self.settings.interval));
                    self.next_measure = now.saturating_add(self.measure_wait());
                }
            }
            Phase::Running => {
                // An interval that is due is recalculated first, even when a minimum-RTT
                // window is due too: its answers would otherwise be thrown away.
                if now >= self.next_update {
                    self.recalculate();
                    self.next_update = now.saturating_add(nanos(self.settings.interval));
                }
                if now >= self.next_measure || self.pinned >= PINNED_INTERVALS {
                    self.pinned = 0;
                    self.phase = Phase::Measuring { resume: self.limit };
                    self.limit = self.settings.min_limit;
                    self.epoch += 1;
                    self.clear();
                }
            }
        }
        self.limit != before
    }

    /// One interval's recalculation.
    fn recalculate(&mut self) {
        let peak = self.peak;
        let Some(rtt) = self.take_percentile() else {
            return;
        };
        self.measured = Some(rtt);
        let Some(min_rtt) = self.min_rtt else {
            return;
        };
        let target = min_rtt as f64 * (1.0 + self.settings.buffer);
        let gradient = (target / rtt as f64).clamp(GRADIENT_MIN, GRADIENT_MAX);
        let scaled = f64::from(self.limit) * gradient;
        let proposed = scaled + scaled.sqrt();
        // Light traffic says nothing about headroom: no growth unless half was used.
        let idle = u64::from(peak) * 2 < u64::from(self.limit);
        if idle && proposed > f64::from(self.limit) {
            return;
        }
        let (lo, hi) = (self.settings.min_limit, self.settings.max_limit);
        self.limit = (proposed.floor() as u32).clamp(lo, hi);
        self.pinned = if self.limit == lo { self.pinned + 1 } else { 0 };
    }

    fn offer(&mut self, latency: Nanos) {
        self.offered += 1;
        if self.samples.len() < MAX_SAMPLES {
            self.samples.push(latency);
            return;
        }
        let j = self.next_random() % self.offered;
        if let Some(slot) = usize::try_from(j)
            .ok()
            .and_then(|j| self.samples.get_mut(j))
        {
            *slot = latency;
        }
    }

    /// The window's percentile, and a fresh window.
    fn take_percentile(&mut self) -> Option<Nanos> {
        let value = percentile(&mut self.samples, self.settings.percentile);
        self.clear();
        value
    }

    fn clear(&mut self) {
        self.samples.clear();
        self.offered = 0;
        self.peak = 0;
    }

    fn measure_wait(&mut self) -> Nanos {
        let base = nanos(self.settings.min_rtt_interval);
        let spread = (base as f64 * self.settings.jitter.clamp(0.0, 1.0)) as u64;
        let extra = match spread {
            0 => 0,
            s => self.next_random() % (s + 1),
        };
        base.saturating_add(extra)
    }

    /// SplitMix64.
    fn next_random(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// The `p` percentile (0 < p ≤ 1) of `samples` by the nearest-rank method; `None` when
/// empty. Reorders `samples`.
pub fn percentile(samples: &mut [Nanos], p: f64) -> Option<Nanos> {
    if samples.is_empty() {
        return None;
    }
    let n = samples.len();
    let rank = ((p.clamp(0.0, 1.0) * n as f64).ceil() as usize).clamp(1, n);
    let (_, value, _) = samples.select_nth_unstable(rank - 1);
    Some(*value)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;

    fn settings() -> GradientSettings {
        GradientSettings {
            min_limit: 3,
            max_limit: 200,
            interval: Duration::from_millis(100),
            min_rtt_interval: Duration::from_secs(30),
            jitter: 0.0,
            min_rtt_samples: 10,
            buffer: 0.25,
            percentile: 0.5,
        }
    }

    /// A controller whose minimum RTT (10 ms) is measured, at `now`.
    fn measured(now: &mut Nanos) -> Gradient {
        let mut g = Gradient::new(settings(), *now, 1);
        assert_eq!(g.limit(), 3);
        assert!(matches!(g.phase(), Phase::Measuring { .. }));
        for _ in 0..10 {
            *now += MS;
            g.record(*now, g.epoch(), 10 * MS);
        }
        assert_eq!(g.phase(), Phase::Running);
        assert_eq!(g.min_rtt(), Some(10 * MS));
        g
    }

    /// One interval in which `in_flight` were in flight and every answer took
    /// `latency`; returns the limit after it.
    fn interval(g: &mut Gradient, now: &mut Nanos, in_flight: u32, latency: Nanos) -> u32 {
        g.in_flight(in_flight);
        for _ in 0..5 {
            *now += 20 * MS;
            g.record(*now, g.epoch(), latency);
        }
        g.limit()
    }

    #[test]
    fn the_limit_rises_under_headroom_and_falls_under_queueing() {
        let mut now = 1_000 * MS;
        let mut g = measured(&mut now);
        // Answers at the minimum RTT with the limit in use: it grows (at most doubling
        // plus its square root per interval).
        let mut last = g.limit();
        for _ in 0..4 {
            let limit = interval(&mut g, &mut now, last, 10 * MS);
            assert!(limit > last, "{limit} after {last}");
            let bound = f64::from(last) * 2.0 + (f64::from(last) * 2.0).sqrt();
            assert!(f64::from(limit) <= bound, "{limit} past {bound}");
            last = limit;
        }
        // Queueing: answers at three times the minimum. It falls, at most halving.
        for _ in 0..3 {
            let limit = interval(&mut g, &mut now, last, 30 * MS);
            assert!(limit < last, "{limit} after {last}");
            assert!(limit >= last / 2, "{limit} after {last}");
            last = limit;
        }
        assert_eq!(g.measured_rtt(), Some(30 * MS));
    }

    #[test]
    fn the_arithmetic_is_envoys() {
        let mut now = 1_000 * MS;
        let mut g = measured(&mut now);
        g.limit = 40;
        // Target 12.5 ms; measured 20 ms: gradient 0.625; 25 + 5 = 30.
        assert_eq!(interval(&mut g, &mut now, 40, 20 * MS), 30);
        // Measured 12.5 ms exactly: gradient 1; 30 + √30 = 35.47 → 35.
        assert_eq!(interval(&mut g, &mut now, 30, 12_500_000), 35);
        // Measured 1 ms: gradient capped at 2; 70 + √70 = 78.37 → 78.
        assert_eq!(interval(&mut g, &mut now, 35, MS), 78);
        // Measured 100 ms: gradient floored at 0.5; 39 + √39 = 45.2 → 45.
        assert_eq!(interval(&mut g, &mut now, 78, 100 * MS), 45);
    }

    #[test]
    fn the_limit_stays_within_its_bounds() {
        let mut now = 1_000 * MS;
        let mut g = measured(&mut now);
        for _ in 0..20 {
            let used = g.limit();
            let limit = interval(&mut g, &mut now, used, MS);
            assert!(limit <= 200);
        }
        assert_eq!(g.limit(), 200);
        let mut lowest = u32::MAX;
        for _ in 0..12 {
            let used = g.limit();
            let limit = interval(&mut g, &mut now, used, 1_000 * MS);
            assert!(limit >= 3);
            lowest = lowest.min(limit);
        }
        assert_eq!(lowest, 3);
    }

    #[test]
    fn light_traffic_does_not_grow_the_limit_but_queueing_still_shrinks_it() {
        let mut now = 1_000 * MS;
        let mut g = measured(&mut now);
        g.limit = 50;
        // 10 in flight of 50: fast answers do not grow it.
        assert_eq!(interval(&mut g, &mut now, 10, 5 * MS), 50);
        // But slow ones shrink it.
        assert!(interval(&mut g, &mut now, 10, 40 * MS) < 50);
    }

    #[test]
    fn an_interval_without_answers_changes_nothing() {
        let mut now = 1_000 * MS;
        let mut g = measured(&mut now);
        let limit = g.limit();
        now += 500 * MS;
        assert!(!g.tick(now));
        assert_eq!(g.limit(), limit);
    }

    #[test]
    fn the_minimum_rtt_is_measured_again_with_the_limit_pinned_then_resumed() {
        let mut now = 1_000 * MS;
        let mut g = measured(&mut now);
        g.limit = 80;
        now += 30_000 * MS;
        assert!(g.tick(now));
        assert_eq!(g.phase(), Phase::Measuring { resume: 80 });
        assert_eq!(g.limit(), 3);
        // Answers of requests that started before the window are not samples of it.
        let before = g.epoch() - 1;
        for _ in 0..20 {
            now += MS;
            g.record(now, before, 500 * MS);
        }
        assert_eq!(g.limit(), 3);
        // The upstream got faster: the new minimum is 4 ms, and the limit resumes.
        for _ in 0..10 {
            now += MS;
            g.record(now, g.epoch(), 4 * MS);
        }
        assert_eq!(g.phase(), Phase::Running);
        assert_eq!(g.min_rtt(), Some(4 * MS));
        assert_eq!(g.limit(), 80);
        // Against the new target (5 ms), 10 ms answers are queueing: it falls.
        assert!(interval(&mut g, &mut now, 80, 10 * MS) < 80);
    }

    #[test]
    fn an_interval_due_with_a_measurement_is_recalculated_first() {
        let s = GradientSettings {
            min_rtt_interval: Duration::from_millis(100),
            ..settings()
        };
        let mut now = 0;
        let mut g = Gradient::new(s, now, 1);
        for _ in 0..10 {
            now += MS;
            g.record(now, g.epoch(), 10 * MS);
        }
        // Both due at once, each time: the limit still grows between measurements.
        let mut grown = 0;
        for _ in 0..5 {
            g.in_flight(g.limit());
            now += 100 * MS;
            g.record(now, g.epoch(), 10 * MS);
            assert!(matches!(g.phase(), Phase::Measuring { .. }));
            for _ in 0..10 {
                now += MS;
                g.record(now, g.epoch(), 10 * MS);
            }
            grown = g.limit();
        }
        assert!(grown > 20, "{grown}");
    }

    #[test]
    fn a_limit_pinned_at_the_minimum_measures_the_minimum_rtt_again() {
        let mut now = 1_000 * MS;
        let mut g = measured(&mut now);
        g.limit = 40;
        // The upstream is four times slower for good: the limit falls to the bottom...
        let mut intervals = 0;
        while !matches!(g.phase(), Phase::Measuring { .. }) {
            let used = g.limit();
            interval(&mut g, &mut now, used, 40 * MS);
            intervals += 1;
            assert!(intervals < 20, "never measured again");
        }
        // ... stays there five intervals, then measures again, long before 30 s.
        assert_eq!(g.limit(), 3);
        assert!(now < 1_000 * MS + 5_000 * MS);
        for _ in 0..10 {
            now += MS;
            g.record(now, g.epoch(), 40 * MS);
        }
        assert_eq!(g.min_rtt(), Some(40 * MS));
        // Against the new minimum, answers at it grow the limit again.
        let used = g.limit();
        assert!(interval(&mut g, &mut now, used, 40 * MS) > 3);
    }

    #[test]
    fn jitter_spreads_the_next_measurement_within_its_share() {
        let s = GradientSettings {
            jitter: 0.5,
            ..settings()
        };
        let mut waits = Vec::new();
        for seed in 0..20 {
            let mut g = Gradient::new(s, 0, seed);
            waits.push(g.measure_wait());
        }
        let base = 30_000 * MS;
        assert!(waits.iter().all(|w| (base..=base + base / 2).contains(w)));
        waits.sort_unstable();
        waits.dedup();
        assert!(waits.len() > 10, "{waits:?}");
    }

    #[test]
    fn percentiles_by_nearest_rank_and_a_bounded_reservoir() {
        let mut v: Vec<Nanos> = (1..=100).collect();
        assert_eq!(percentile(&mut v, 0.5), Some(50));
        assert_eq!(percentile(&mut v, 0.99), Some(99));
        assert_eq!(percentile(&mut v, 1.0), Some(100));
        assert_eq!(percentile(&mut [7], 0.01), Some(7));
        assert_eq!(percentile(&mut [], 0.5), None);
        let mut g = Gradient::new(settings(), 0, 3);
        g.phase = Phase::Running;
        for i in 0..(MAX_SAMPLES as u64 * 3) {
            g.offer(i + 1);
        }
        assert_eq!(g.samples.len(), MAX_SAMPLES);
        // The reservoir's median is near the stream's (6144).
        let median = percentile(&mut g.samples.clone(), 0.5).unwrap_or(0);
        assert!((5_000..7_300).contains(&median), "{median}");
    }
}
