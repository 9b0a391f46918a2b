//! What an attacker can do to clients over their limit by flooding a bounded
//! [`MemoryStore`] (`max_keys`) with keys of its own.
//!
//! For each algorithm: a store of `MAX_KEYS` keys (default 100,000; 64 shards), a limit
//! of 10 per day, and 1,000 victims that each sent 11 requests (so each is over its
//! limit, refused once). Then two attacks, each on a fresh store:
//!
//! - **fresh flood**: `FLOOD` distinct keys (default 3,000,000), one request each (each
//!   admitted, none refused). Printed: how many victims the flood reset (their next
//!   request admitted), the store's evictions, and how many of them were limited keys.
//! - **refused flood**: distinct keys of 11 requests each (each refused once, as the
//!   victims were), until half the victims are reset. Printed: how many requests that
//!   took, as a multiple of `MAX_KEYS × 11` (filling the store with refused keys).
//!
//! Victims are looked at with checks of cost 0, which change nothing. The numbers are
//! deterministic (a manual clock; one request per microsecond).
//! `ALGORITHMS=fixed_window,gcra` runs only those. Run with:
//!
//! ```text
//! cargo bench -p tollgate --bench eviction
//! ```

use std::time::Duration;

use tollgate::algorithm::{
    Algorithm, FixedWindow, Gcra, LeakyBucket, LeakyMode, Limit, SlidingLog, SlidingWindow,
    TokenBucket,
};
use tollgate::clock::{Nanos, NANOS_PER_SEC};
use tollgate::store::{Check, MemoryStore};

const START: Nanos = 1_699_920_000 * NANOS_PER_SEC;
const VICTIMS: usize = 1_000;
const LIMIT: u64 = 10;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A store with the victims over their limit; returns it and the clock after them.
fn with_victims(limit: &Limit, max_keys: usize) -> (MemoryStore, Nanos) {
    let store = MemoryStore::builder().max_keys(max_keys).build();
    let mut now = START;
    for v in 0..VICTIMS {
        let key = format!("victim:{v}");
        for _ in 0..=LIMIT {
            store.check_one(now, &Check::new(limit, key.as_bytes(), 1));
            now += 1_000;
        }
    }
    (store, now)
}

/// How many victims have room again (a cost-0 check says so, and changes nothing).
fn reset_victims(store: &MemoryStore, limit: &Limit, now: Nanos) -> usize {
    (0..VICTIMS)
        .filter(|v| {
            let key = format!("victim:{v}");
            store
                .check_one(now, &Check::new(limit, key.as_bytes(), 0))
                .remaining
                > 0
        })
        .count()
}

fn main() {
    let max_keys = env("MAX_KEYS", 100_000);
    let flood = env("FLOOD", 3_000_000);
    let day = Duration::from_secs(86_400);
    let algorithms = [
        (
            "fixed_window",
            Algorithm::FixedWindow(FixedWindow::new(LIMIT, day)),
        ),
        (
            "sliding_window",
            Algorithm::SlidingWindow(SlidingWindow::new(LIMIT, day)),
        ),
        (
            "sliding_log",
            Algorithm::SlidingLog(SlidingLog::new(LIMIT, day)),
        ),
        (
            "token_bucket",
            Algorithm::TokenBucket(TokenBucket::new(LIMIT, day)),
        ),
        ("gcra", Algorithm::Gcra(Gcra::new(LIMIT, day))),
        (
            "leaky_bucket",
            Algorithm::LeakyBucket(LeakyBucket::new(LIMIT, day, LeakyMode::Meter)),
        ),
    ];
    println!(
        "max_keys {max_keys}, limit {LIMIT}/day, {VICTIMS} victims over their limit; fresh flood of {flood} keys"
    );
    println!(
        "{:<15} {:>14} {:>12} {:>16} {:>22}",
        "algorithm", "fresh: reset", "evictions", "limited evicted", "refused: requests/(K×11)"
    );
    let only = std::env::var("ALGORITHMS").ok();
    for (name, algorithm) in algorithms {
        if only
            .as_deref()
            .is_some_and(|o| !o.split(',').any(|a| a == name))
        {
            continue;
        }
        let limit = Limit::new(algorithm).expect("a valid limit");

        let (store, mut now) = with_victims(&limit, max_keys);
        for i in 0..flood {
            let key = format!("flood:{i}");
            store.check_one(now, &Check::new(&limit, key.as_bytes(), 1));
            now += 1_000;
        }
        let fresh_reset = reset_victims(&store, &limit, now);
        let stats = store.stats();

        let (store, mut now) = with_victims(&limit, max_keys);
        let mut requests = 0usize;
        let mut key = 0usize;
        let budget = max_keys * (LIMIT as usize + 1) * 4;
        let half = loop {
            for _ in 0..1_000 {
                let k = format!("refused:{key}");
                for _ in 0..=LIMIT {
                    store.check_one(now, &Check::new(&limit, k.as_bytes(), 1));
                    now += 1_000;
                }
                key += 1;
                requests += LIMIT as usize + 1;
            }
            if reset_victims(&store, &limit, now) >= VICTIMS / 2 {
                break Some(requests);
            }
            if requests >= budget {
                break None;
            }
        };
        let ratio = half.map_or(
            format!("> {:.1}", budget as f64 / (max_keys as f64 * 11.0)),
            |r| format!("{:.2}", r as f64 / (max_keys as f64 * 11.0)),
        );
        println!(
            "{name:<15} {:>14} {:>12} {:>16} {:>22}",
            format!("{fresh_reset}/{VICTIMS}"),
            stats.evictions,
            stats.limited_evictions,
            ratio
        );
    }
}
