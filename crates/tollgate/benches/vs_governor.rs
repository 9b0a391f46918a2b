//! Tollgate's [`MemoryStore`] against the `governor` crate, check for check.
//!
//! Every scenario is one criterion group with the Tollgate and governor lines side by
//! side; criterion reports the time per check (and, as throughput, checks per second):
//!
//! - `single_key`: one key, one thread. Tollgate `MemoryStore::check_one` with GCRA
//!   (and token bucket and fixed window as extra lines) and Tollgate's un-keyed
//!   `DirectLimiter`, against governor's direct (un-keyed) limiter and its keyed
//!   limiter used with one key.
//! - `keys_100k`: one thread cycling through 100,000 pre-built keys `user:000000`...
//! - `keys_100k_2threads`: two threads, each cycling through its own half of those
//!   100,000 keys (disjoint halves); the figure is wall time divided by the checks of
//!   both threads, so its inverse is the total throughput.
//! - `clock_read`: what reading each side's clock costs on its own (Tollgate's
//!   `SystemClock`, `CLOCK_REALTIME`, against governor's default clock, quanta's TSC).
//!
//! Every check reads its clock: Tollgate's `now` comes from `SystemClock` in the loop,
//! as governor reads its own clock inside `check`. Every check is admitted: this
//! measures the steady-state admission path, not the rejection path. The quota is the
//! same on both sides: one per second with a burst of `u32::MAX` (about 4.3 × 10^9
//! checks before anything is rejected). The slow refill is deliberate: with a fast one
//! (say 10^9 per second) a Tollgate state is "fresh" again a few nanoseconds after each
//! check, and the store drops fresh states whenever it sweeps, so the keyed scenarios
//! would measure drop-and-reinsert churn while governor keeps every key (it forgets
//! keys only when asked to, with `retain_recent`). That churn case is kept as one extra
//! line, `keys_100k/tollgate/gcra_fast_refill`. Keyed limiters are filled with every
//! key before they are measured, so no other line includes first inserts.
//!
//! Run with:
//!
//! ```text
//! cargo bench -p tollgate --bench vs_governor
//! cargo bench -p tollgate --bench vs_governor -- --warm-up-time 1 --measurement-time 3
//! ```

use std::num::NonZeroU32;
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

use criterion::{black_box, Criterion, Throughput};
use governor::clock::Clock as _;
use governor::state::keyed::DefaultKeyedStateStore;
use governor::{Quota, RateLimiter};
use tollgate::algorithm::{Algorithm, FixedWindow, Gcra, Limit, TokenBucket};
use tollgate::clock::{Clock, SystemClock};
use tollgate::direct::DirectLimiter;
use tollgate::store::{Check, MemoryStore};

/// Burst on both sides: far more checks than a run makes (refill: one per second).
const BURST: u32 = u32::MAX;
/// Keys of the keyed scenarios.
const KEYS: usize = 100_000;

type GovernorKeyed = RateLimiter<
    String,
    DefaultKeyedStateStore<String>,
    governor::clock::DefaultClock,
    governor::middleware::NoOpMiddleware<
        <governor::clock::DefaultClock as governor::clock::Clock>::Instant,
    >,
>;

fn quota() -> Quota {
    Quota::per_second(NonZeroU32::MIN).allow_burst(NonZeroU32::MAX)
}

fn limit(algorithm: Algorithm) -> Limit {
    Limit::new(algorithm).expect("the benchmark limits are valid")
}

fn gcra() -> Limit {
    limit(Algorithm::Gcra(
        Gcra::new(1, Duration::from_secs(1)).with_burst(u64::from(BURST)),
    ))
}

/// GCRA at 10^9 per second: states are fresh again (and droppable) right away.
fn gcra_fast_refill() -> Limit {
    limit(Algorithm::Gcra(Gcra::new(
        1_000_000_000,
        Duration::from_secs(1),
    )))
}

fn token_bucket() -> Limit {
    limit(Algorithm::TokenBucket(
        TokenBucket::new(1, Duration::from_secs(1)).with_burst(u64::from(BURST)),
    ))
}

fn fixed_window() -> Limit {
    limit(Algorithm::FixedWindow(FixedWindow::new(
        u64::from(BURST),
        Duration::from_secs(1),
    )))
}

fn governor_keyed() -> GovernorKeyed {
    RateLimiter::keyed(quota())
}

fn keys() -> Vec<String> {
    (0..KEYS).map(|i| format!("user:{i:06}")).collect()
}

/// One Tollgate check of `key` at the system clock's `now`.
#[inline(always)]
fn tollgate_check(store: &MemoryStore, limit: &Limit, key: &str) -> bool {
    store
        .check_one(SystemClock.now(), &Check::new(limit, key, 1))
        .allowed
}

/// Runs every key once through both keyed limiters (so the measured loops only update
/// existing keys) and checks that each was admitted.
fn fill(store: &MemoryStore, limit: &Limit, governor: &GovernorKeyed, keys: &[String]) {
    for key in keys {
        assert!(tollgate_check(store, limit, key), "tollgate rejected {key}");
        assert!(governor.check_key(key).is_ok(), "governor rejected {key}");
    }
    assert_eq!(store.stats().keys, keys.len());
    assert_eq!(governor.len(), keys.len());
}

fn single_key(c: &mut Criterion) {
    let mut group = c.benchmark_group("single_key");
    group.throughput(Throughput::Elements(1));
    let store = MemoryStore::new();
    for (name, limit) in [
        ("tollgate/gcra", gcra()),
        ("tollgate/token_bucket", token_bucket()),
        ("tollgate/fixed_window", fixed_window()),
    ] {
        assert!(tollgate_check(&store, &limit, "user:1"));
        group.bench_function(name, |b| {
            b.iter(|| tollgate_check(&store, &limit, black_box("user:1")));
        });
    }

    // Tollgate's un-keyed limiter, the counterpart of governor's direct one.
    let own = DirectLimiter::new(gcra());
    assert!(own.is_lock_free() && own.check(SystemClock.now(), 1).allowed);
    group.bench_function("tollgate/direct_gcra", |b| {
        b.iter(|| own.check(SystemClock.now(), black_box(1)).allowed);
    });

    let direct = RateLimiter::direct(quota());
    assert!(direct.check().is_ok());
    group.bench_function("governor/direct", |b| b.iter(|| direct.check().is_ok()));

    let keyed = governor_keyed();
    let key = String::from("user:1");
    assert!(keyed.check_key(&key).is_ok());
    group.bench_function("governor/keyed", |b| {
        b.iter(|| keyed.check_key(black_box(&key)).is_ok());
    });
    group.finish();
}

fn keys_100k(c: &mut Criterion) {
    let mut group = c.benchmark_group("keys_100k");
    group.throughput(Throughput::Elements(1));
    let keys = keys();
    let store = MemoryStore::new();
    let limit = gcra();
    let governor = governor_keyed();
    fill(&store, &limit, &governor, &keys);

    group.bench_function("tollgate/gcra", |b| {
        let mut i = 0;
        b.iter(|| {
            let allowed = tollgate_check(&store, &limit, &keys[i]);
            i = if i + 1 == keys.len() { 0 } else { i + 1 };
            allowed
        });
    });
    let fast = gcra_fast_refill();
    let churn = MemoryStore::new();
    group.bench_function("tollgate/gcra_fast_refill", |b| {
        let mut i = 0;
        b.iter(|| {
            let allowed = tollgate_check(&churn, &fast, &keys[i]);
            i = if i + 1 == keys.len() { 0 } else { i + 1 };
            allowed
        });
    });
    group.bench_function("governor/keyed", |b| {
        let mut i = 0;
        b.iter(|| {
            let allowed = governor.check_key(&keys[i]).is_ok();
            i = if i + 1 == keys.len() { 0 } else { i + 1 };
            allowed
        });
    });
    group.finish();
}

/// Runs `iters` checks in total on two threads, each cycling through its own half of
/// `keys`, and returns the wall time from the common start to the last thread's end.
fn two_threads(iters: u64, keys: &[String], check: impl Fn(&String) -> bool + Sync) -> Duration {
    let (first, second) = keys.split_at(keys.len() / 2);
    let per_thread = [iters / 2, iters - iters / 2];
    let start = Barrier::new(2);
    let spans: Vec<(Instant, Instant)> = thread::scope(|s| {
        let handles: Vec<_> = [first, second]
            .into_iter()
            .zip(per_thread)
            .map(|(half, n)| {
                let (start, check) = (&start, &check);
                s.spawn(move || {
                    start.wait();
                    let began = Instant::now();
                    let mut admitted = 0u64;
                    for key in half
                        .iter()
                        .cycle()
                        .take(usize::try_from(n).unwrap_or(usize::MAX))
                    {
                        admitted += u64::from(check(key));
                    }
                    let ended = Instant::now();
                    assert_eq!(black_box(admitted), n, "every check must be admitted");
                    (began, ended)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a benchmark thread panicked"))
            .collect()
    });
    let began = spans.iter().map(|s| s.0).min().expect("two spans");
    let ended = spans.iter().map(|s| s.1).max().expect("two spans");
    ended - began
}

fn keys_100k_2threads(c: &mut Criterion) {
    let mut group = c.benchmark_group("keys_100k_2threads");
    group.throughput(Throughput::Elements(1));
    let keys = keys();
    let store = MemoryStore::new();
    let limit = gcra();
    let governor = governor_keyed();
    fill(&store, &limit, &governor, &keys);

    group.bench_function("tollgate/gcra", |b| {
        b.iter_custom(|iters| two_threads(iters, &keys, |k| tollgate_check(&store, &limit, k)));
    });
    group.bench_function("governor/keyed", |b| {
        b.iter_custom(|iters| two_threads(iters, &keys, |k| governor.check_key(k).is_ok()));
    });
    group.finish();
}

fn clock_read(c: &mut Criterion) {
    let mut group = c.benchmark_group("clock_read");
    group.bench_function("tollgate/system_clock", |b| b.iter(|| SystemClock.now()));
    let clock = governor::clock::DefaultClock::default();
    group.bench_function("governor/default_clock", |b| b.iter(|| clock.now()));
    group.finish();
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    single_key(&mut criterion);
    keys_100k(&mut criterion);
    keys_100k_2threads(&mut criterion);
    clock_read(&mut criterion);
    criterion.final_summary();
}
