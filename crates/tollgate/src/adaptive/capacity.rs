//! [`Capacity`]: what the upstream can take in flight, estimated as Sentinel's system
//! protection does (after BBR): the most answers completed per second times the least
//! latency, both over the last second.
//!
//! Past that many in flight, a request cannot be answered sooner: it waits behind
//! others. The second is ten buckets of 100 ms; the rate is the busiest ended bucket's,
//! scaled to a second, and the latency the lowest of the ended buckets' averages. Pure: time
//! and latencies come in as [`Nanos`].

use crate::clock::{Nanos, NANOS_PER_SEC};

/// Buckets in the window.
const BUCKETS: usize = 10;
/// One bucket's span.
const WIDTH: Nanos = NANOS_PER_SEC / BUCKETS as Nanos;

#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    /// Which 100 ms span since the epoch it counts (`now / WIDTH`).
    index: u64,
    completed: u64,
    latency_sum: Nanos,
}

/// The estimator; see the [module](self) docs.
#[derive(Debug, Clone, Default)]
pub struct Capacity {
    buckets: [Bucket; BUCKETS],
}

impl Capacity {
    /// An estimator with nothing recorded.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records an answer at `now` that took `latency`.
    pub fn record(&mut self, now: Nanos, latency: Nanos) {
        let index = now / WIDTH;
        let bucket = &mut self.buckets[(index % BUCKETS as u64) as usize];
        if bucket.index != index {
            *bucket = Bucket {
                index,
                ..Bucket::default()
            };
        }
        bucket.completed += 1;
        bucket.latency_sum = bucket.latency_sum.saturating_add(latency);
    }

    /// The buckets of the last second at `now` that have answers, and whether each has
    /// ended.
    fn recent(&self, now: Nanos) -> impl Iterator<Item = (&Bucket, bool)> {
        let current = now / WIDTH;
        self.buckets.iter().filter_map(move |b| {
            let recent =
                b.completed > 0 && b.index <= current && current - b.index < BUCKETS as u64;
            recent.then_some((b, b.index < current))
        })
    }

    /// The most answers completed per second: the busiest bucket that has ended in the
    /// last second, scaled.
    pub fn max_per_second(&self, now: Nanos) -> Option<f64> {
        self.recent(now)
            .filter(|(_, ended)| *ended)
            .map(|(b, _)| b.completed * BUCKETS as u64)
            .max()
            .map(|n| n as f64)
    }

    /// The least average latency of a bucket that has ended in the last second (a
    /// bucket just begun, with one fast answer, would say too little).
    pub fn min_latency(&self, now: Nanos) -> Option<Nanos> {
        self.recent(now)
            .filter(|(_, ended)| *ended)
            .map(|(b, _)| b.latency_sum / b.completed)
            .min()
    }

    /// How many may be in flight before they queue: the most per second times the least
    /// latency, in requests. `None` until a bucket has ended.
    pub fn estimate(&self, now: Nanos) -> Option<f64> {
        let rate = self.max_per_second(now)?;
        let latency = self.min_latency(now)?;
        Some(rate * latency as f64 / NANOS_PER_SEC as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;

    #[test]
    fn the_estimate_is_the_busiest_rate_times_the_least_latency() {
        let mut c = Capacity::new();
        let t0 = 1_000_000 * MS;
        assert_eq!(c.estimate(t0), None);
        // 100 ms at 40 answers of 10 ms, then 100 ms at 50 answers of 20 ms.
        for i in 0..40 {
            c.record(t0 + i * 2 * MS, 10 * MS);
        }
        // The first bucket has not ended: no rate yet.
        assert_eq!(c.estimate(t0 + 99 * MS), None);
        for i in 0..50 {
            c.record(t0 + 100 * MS + i * 2 * MS, 20 * MS);
        }
        let now = t0 + 250 * MS;
        assert_eq!(c.max_per_second(now), Some(500.0));
        assert_eq!(c.min_latency(now), Some(10 * MS));
        assert_eq!(c.estimate(now), Some(5.0));
    }

    #[test]
    fn buckets_older_than_a_second_are_forgotten() {
        let mut c = Capacity::new();
        let t0 = 1_000_000 * MS;
        for i in 0..100 {
            c.record(t0 + i * MS / 2, MS);
        }
        c.record(t0 + 500 * MS, 4 * MS);
        assert_eq!(c.max_per_second(t0 + 900 * MS), Some(1000.0));
        assert_eq!(c.min_latency(t0 + 900 * MS), Some(MS));
        // A second on, only the later bucket is left.
        let later = t0 + 1_050 * MS;
        assert_eq!(c.max_per_second(later), Some(10.0));
        assert_eq!(c.min_latency(later), Some(4 * MS));
        // A bucket not ended yet does not count; a slot reused for a later span starts
        // again from nothing.
        c.record(t0 + 1_000 * MS, 2 * MS);
        assert_eq!(c.min_latency(t0 + 1_050 * MS), Some(4 * MS));
        assert_eq!(c.min_latency(t0 + 1_100 * MS), Some(2 * MS));
        assert_eq!(c.estimate(t0 + 3_000 * MS), None);
    }
}
