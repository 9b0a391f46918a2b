//! Accuracy of each algorithm against the exact rule, on simulated traffic.
//!
//! For each algorithm, traffic pattern and load, `KEYS` independent keys (default 200)
//! send requests of cost 1 for `MINUTES` simulated minutes (default 30) at a limit of
//! `LIMIT` (default 100) per 60 s, through the real [`MemoryStore`] on a manual clock.
//! Patterns, each at 0.5, 0.9, 1, 2 and 5 times the limit:
//! - `steady`: evenly spaced, each key at a random phase;
//! - `poisson`: exponential gaps;
//! - `bursty`: bursts of a fifth of the limit at once, as often as the load needs.
//!
//! Printed per line:
//! - `admitted`: what was admitted, as a share of the limit over the run;
//! - `max/limit`: the most admitted in any rolling window of 60 s, over every key, as a
//!   multiple of the limit;
//! - `differ`: the share of decisions that differ from what the exact rule (at most
//!   `LIMIT` in any rolling 60 s, the sliding log's rule) would decide on the same key's
//!   history as this algorithm admitted it; `over` counts admissions the exact rule would
//!   refuse, `under` refusals it would admit.
//!
//! The token bucket, GCRA and leaky bucket enforce another rule (a burst of `LIMIT`
//! plus a steady refill) and are listed for comparison. The numbers are deterministic
//! (a fixed seed). Run with `bash tools/bench-accuracy.sh` or:
//!
//! ```text
//! cargo bench -p tollgate --bench accuracy
//! ```

use std::collections::VecDeque;
use std::time::Duration;

use tollgate::algorithm::{
    Algorithm, FixedWindow, Gcra, LeakyBucket, LeakyMode, Limit, SlidingLog, SlidingWindow,
    TokenBucket,
};
use tollgate::clock::{Nanos, NANOS_PER_SEC};
use tollgate::store::{Check, MemoryStore};

const WINDOW: Nanos = 60 * NANOS_PER_SEC;
const LOADS: [f64; 5] = [0.5, 0.9, 1.0, 2.0, 5.0];
/// A whole day, so the aligned windows start at the run's start.
const START: Nanos = 1_699_920_000 * NANOS_PER_SEC;

/// A small, seeded generator (splitmix64): the same traffic for every algorithm.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }
}

#[derive(Clone, Copy)]
enum Pattern {
    Steady,
    Poisson,
    Bursty,
}

impl Pattern {
    fn name(self) -> &'static str {
        match self {
            Pattern::Steady => "steady",
            Pattern::Poisson => "poisson",
            Pattern::Bursty => "bursty",
        }
    }

    /// One key's arrival instants over `duration` at `rate` per nanosecond.
    fn arrivals(self, rng: &mut Rng, limit: u64, rate: f64, duration: Nanos) -> Vec<Nanos> {
        let mut out = Vec::new();
        match self {
            Pattern::Steady => {
                let gap = 1.0 / rate;
                let mut t = rng.unit() * gap;
                while (t as Nanos) < duration {
                    out.push(t as Nanos);
                    t += gap;
                }
            }
            Pattern::Poisson => {
                let mut t = 0.0;
                loop {
                    t += -rng.unit().ln() / rate;
                    if t as Nanos >= duration {
                        break;
                    }
                    out.push(t as Nanos);
                }
            }
            Pattern::Bursty => {
                let size = (limit / 5).max(1);
                let gap = size as f64 / rate;
                let mut t = rng.unit() * gap;
                while (t as Nanos) < duration {
                    out.extend(std::iter::repeat_n(t as Nanos, size as usize));
                    t += gap;
                }
            }
        }
        out
    }
}

#[derive(Default)]
struct Tally {
    requests: u64,
    admitted: u64,
    over: u64,
    under: u64,
    max_in_window: u64,
}

fn limits(limit: u64) -> Vec<(&'static str, Limit)> {
    let w = Duration::from_nanos(WINDOW);
    [
        Algorithm::FixedWindow(FixedWindow::new(limit, w)),
        Algorithm::SlidingWindow(SlidingWindow::new(limit, w)),
        Algorithm::SlidingLog(SlidingLog::new(limit, w)),
        Algorithm::TokenBucket(TokenBucket::new(limit, w)),
        Algorithm::Gcra(Gcra::new(limit, w)),
        Algorithm::LeakyBucket(LeakyBucket::new(limit, w, LeakyMode::Meter)),
    ]
    .into_iter()
    .map(|a| (a.name(), Limit::new(a).expect("a valid limit")))
    .collect()
}

fn run(limit: &Limit, pattern: Pattern, load: f64, keys: u64, minutes: u64) -> Tally {
    let cap = limit.limit();
    let duration = minutes * WINDOW;
    let rate = load * cap as f64 / WINDOW as f64;
    // Keys are replayed one after another from the start: no shard may keep time
    // moving forward across them.
    let store = MemoryStore::builder().monotonic(false).build();
    let mut rng = Rng(0x5eed ^ (load * 1000.0) as u64 ^ (pattern as u64) << 32);
    let mut tally = Tally::default();
    for key in 0..keys {
        let name = key.to_le_bytes();
        // This key's admissions still inside the exact rule's window, and all of them.
        let mut recent: VecDeque<Nanos> = VecDeque::new();
        let mut admitted: Vec<Nanos> = Vec::new();
        for at in pattern.arrivals(&mut rng, cap, rate, duration) {
            let now = START + at;
            while recent.front().is_some_and(|&t| t + WINDOW <= now) {
                recent.pop_front();
            }
            let exact = (recent.len() as u64) < cap;
            let decision = store.check_one(now, &Check::new(limit, &name, 1));
            tally.requests += 1;
            match (decision.allowed, exact) {
                (true, false) => tally.over += 1,
                (false, true) => tally.under += 1,
                _ => {}
            }
            if decision.allowed {
                tally.admitted += 1;
                recent.push_back(now);
                admitted.push(now);
            }
        }
        // The most admitted in any window [t, t + WINDOW).
        let mut first = 0;
        for (i, &t) in admitted.iter().enumerate() {
            while admitted[first] + WINDOW <= t {
                first += 1;
            }
            tally.max_in_window = tally.max_in_window.max((i - first + 1) as u64);
        }
    }
    tally
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    // `cargo bench` passes `--bench`; there is nothing else to parse.
    let keys = env("KEYS", 200);
    let minutes = env("MINUTES", 30);
    let limit = env("LIMIT", 100);
    println!(
        "# {keys} keys, {minutes} simulated minutes, {limit} per 60 s, cost 1; \
         differ = decisions unlike the exact rule's on the same history (over + under)"
    );
    println!(
        "{:<15} {:<8} {:>5} {:>9} {:>10} {:>8} {:>8} {:>8}",
        "algorithm", "pattern", "load", "admitted", "max/limit", "differ", "over", "under"
    );
    for (name, l) in limits(limit) {
        for pattern in [Pattern::Steady, Pattern::Poisson, Pattern::Bursty] {
            for load in LOADS {
                let t = run(&l, pattern, load, keys, minutes);
                let pct = |n: u64| 100.0 * n as f64 / t.requests.max(1) as f64;
                println!(
                    "{:<15} {:<8} {:>5} {:>9.3} {:>10.2} {:>7.1}% {:>7.1}% {:>7.1}%",
                    name,
                    pattern.name(),
                    load,
                    t.admitted as f64 / (limit * minutes * keys) as f64,
                    t.max_in_window as f64 / limit as f64,
                    pct(t.over + t.under),
                    pct(t.over),
                    pct(t.under),
                );
            }
        }
    }
}
