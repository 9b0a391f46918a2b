//! Behaviour of the in-memory store that a user would notice: all-or-nothing requests,
//! lockouts, bounded memory under a flood of keys, sweeping, and the async `Store` API.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tollgate::algorithm::{
    Algorithm, FixedWindow, Gcra, LeakyBucket, LeakyMode, Limit, SlidingLog, SlidingWindow,
    TokenBucket,
};
use tollgate::clock::NANOS_PER_SEC as S;
use tollgate::store::{Check, MemoryStore, Store};

const T0: u64 = 1_699_920_000 * S;

fn fixed(n: u64, secs: u64, id: u64) -> Limit {
    Limit::new(Algorithm::FixedWindow(FixedWindow::new(
        n,
        Duration::from_secs(secs),
    )))
    .unwrap()
    .with_id(id)
}

/// Polls a future that is ready at once (the memory store never waits).
fn ready<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("the memory store never waits"),
    }
}

#[test]
fn a_callers_budget_changes_nothing_in_memory() {
    let store = MemoryStore::new();
    let l = fixed(1, 60, 1);
    let within = |budget| ready(store.check_within(T0, &[Check::new(&l, "k", 1)], budget));
    assert!(
        within(Duration::ZERO).unwrap()[0].allowed,
        "decided, not timed out"
    );
    assert!(!within(Duration::ZERO).unwrap()[0].allowed, "and charged");
}

#[test]
fn a_rejected_request_charges_none_of_its_checks() {
    let store = MemoryStore::new();
    let (wide, narrow) = (fixed(20, 60, 1), fixed(1, 60, 2));
    let both = [Check::new(&wide, "x", 1), Check::new(&narrow, "x", 1)];
    let first = store.check_all(T0, &both);
    assert!(first.iter().all(|d| d.allowed));
    assert_eq!(first[0].remaining, 19);
    for _ in 0..5 {
        let d = store.check_all(T0, &both);
        assert!(d[0].allowed, "the wide limit itself had room");
        assert_eq!(d[0].remaining, 19, "and was not charged");
        assert!(!d[1].allowed);
    }
    assert_eq!(
        store.check_one(T0, &Check::new(&wide, "x", 1)).remaining,
        18
    );
}

#[test]
fn the_same_counter_twice_in_one_request_is_charged_twice() {
    let store = MemoryStore::new();
    let l = fixed(3, 60, 1);
    let d = store.check_all(T0, &[Check::new(&l, "k", 2), Check::new(&l, "k", 1)]);
    assert!(d.iter().all(|d| d.allowed));
    assert_eq!(d[1].remaining, 0);
    let d = store.check_all(T0, &[Check::new(&l, "k", 0), Check::new(&l, "k", 1)]);
    assert!(!d[1].allowed);
}

#[test]
fn a_lockout_started_by_a_rejected_request_stays_while_the_rest_is_undone() {
    let store = MemoryStore::new();
    let login = fixed(1, 60, 1).with_lockout(Duration::from_secs(600));
    let site = fixed(100, 60, 2);
    let req = [Check::new(&site, "ip", 1), Check::new(&login, "alice", 1)];
    assert!(store.check_all(T0, &req).iter().all(|d| d.allowed));
    let d = store.check_all(T0, &req);
    assert_eq!(d[1].retry_after, 600 * S);
    assert_eq!(d[0].remaining, 99, "the site limit was not charged");
    // Next minute the login limit has room again, but the lockout holds.
    let later = store.check_one(T0 + 120 * S, &Check::new(&login, "alice", 1));
    assert!(!later.allowed);
    assert_eq!(later.retry_after, 480 * S);
    assert!(
        store
            .check_one(T0 + 600 * S, &Check::new(&login, "alice", 1))
            .allowed
    );
}

#[test]
fn a_flood_of_distinct_keys_stays_under_max_keys() {
    let store = MemoryStore::builder().max_keys(4096).shards(4).build();
    let l = Limit::new(Algorithm::Gcra(Gcra::new(10, Duration::from_secs(3600)))).unwrap();
    for i in 0..200_000u32 {
        let key = format!("attacker:{i}");
        assert!(store.check_one(T0, &Check::new(&l, &key, 1)).allowed);
    }
    let stats = store.stats();
    assert!(stats.keys <= 4096, "{} keys kept", stats.keys);
    assert!(stats.evictions >= 200_000 - 4096);
}

/// With `max_keys` reached, a flood of fresh keys (one request each) used to evict
/// every key alike, so a client over its daily limit came back with a full one. Keys
/// that were refused are evicted only after every key that was not.
#[test]
fn a_flood_of_new_keys_does_not_reset_a_limited_key() {
    let day = Duration::from_secs(86_400);
    let algorithms = [
        Algorithm::FixedWindow(FixedWindow::new(10, day)),
        Algorithm::SlidingWindow(SlidingWindow::new(10, day)),
        Algorithm::SlidingLog(SlidingLog::new(10, day)),
        Algorithm::TokenBucket(TokenBucket::new(10, day)),
        Algorithm::Gcra(Gcra::new(10, day)),
        Algorithm::LeakyBucket(LeakyBucket::new(10, day, LeakyMode::Meter)),
    ];
    for algorithm in algorithms {
        let store = MemoryStore::builder().max_keys(4096).shards(4).build();
        let limit = Limit::new(algorithm).unwrap();
        let victim = |t: u64| store.check_one(T0 + t * S, &Check::new(&limit, "victim", 1));
        for _ in 0..10 {
            assert!(victim(0).allowed);
        }
        assert!(!victim(1).allowed, "{algorithm:?}");
        // 100 keys the flood's own size over the cap, each one request a second apart
        // from the next batch: every key lives for the day.
        for i in 0..100_000u32 {
            let key = format!("flood:{i}");
            store.check_one(
                T0 + 2 * S + u64::from(i / 1000) * S,
                &Check::new(&limit, &key, 1),
            );
        }
        let stats = store.stats();
        assert!(stats.keys <= 4096, "{algorithm:?}: {} keys", stats.keys);
        assert!(stats.evictions >= 100_000 - 4096);
        assert_eq!(stats.limited_evictions, 0, "{algorithm:?}");
        assert!(
            !victim(200).allowed,
            "{algorithm:?}: the flood reset the victim"
        );
    }
}

/// Refused keys are evicted last, not never: a shard full of them still makes room,
/// and counts each such eviction.
#[test]
fn refused_keys_make_room_when_nothing_else_is_left() {
    let store = MemoryStore::builder().max_keys(256).shards(1).build();
    let limit = fixed(1, 86_400, 1);
    for i in 0..1000u32 {
        let key = format!("k{i}");
        assert!(store.check_one(T0, &Check::new(&limit, &key, 1)).allowed);
        assert!(!store.check_one(T0, &Check::new(&limit, &key, 1)).allowed);
    }
    let stats = store.stats();
    assert!(stats.keys <= 256, "{} keys", stats.keys);
    assert!(stats.limited_evictions >= 1000 - 256, "{stats:?}");
    assert_eq!(stats.limited_evictions, stats.evictions);
}

/// Every window of a fixed-window or sliding-window limit ends at the same instant, so
/// a flood's states all become fresh together: eviction must still evict (ties
/// included) and keep the store under `max_keys`, at a bounded cost per key.
#[test]
fn a_flood_of_states_that_end_together_stays_under_max_keys() {
    let day = Duration::from_secs(86_400);
    for algorithm in [
        Algorithm::FixedWindow(FixedWindow::new(10, day)),
        Algorithm::SlidingWindow(SlidingWindow::new(10, day)),
    ] {
        let store = MemoryStore::builder().max_keys(256).shards(1).build();
        let limit = Limit::new(algorithm).unwrap();
        for i in 0..20_000u32 {
            store.check_one(T0, &Check::new(&limit, &format!("k{i}"), 1));
        }
        let stats = store.stats();
        assert!(stats.keys <= 256, "{algorithm:?}: {} keys", stats.keys);
        assert!(stats.evictions >= 20_000 - 256, "{algorithm:?}: {stats:?}");
    }
}

#[test]
fn a_flood_of_new_keys_does_not_end_a_lockout() {
    let store = MemoryStore::builder().max_keys(256).shards(1).build();
    let login = fixed(1, 60, 1).with_lockout(Duration::from_secs(900));
    assert!(store.check_one(T0, &Check::new(&login, "alice", 1)).allowed);
    assert!(!store.check_one(T0, &Check::new(&login, "alice", 1)).allowed);
    let other = fixed(5, 3600, 2);
    for i in 0..10_000u32 {
        store.check_one(T0 + S, &Check::new(&other, &format!("k{i}"), 1));
    }
    assert!(
        !store
            .check_one(T0 + 2 * S, &Check::new(&login, "alice", 1))
            .allowed
    );
}

#[test]
fn the_keys_evicted_first_are_those_closest_to_fresh() {
    let store = MemoryStore::builder().max_keys(100).shards(1).build();
    let short = fixed(5, 1, 1); // its window ends within a second
    let long = fixed(5, 3600, 2);
    for i in 0..50u32 {
        store.check_one(T0, &Check::new(&long, &format!("long{i}"), 5));
    }
    for i in 0..200u32 {
        store.check_one(T0, &Check::new(&short, &format!("short{i}"), 1));
    }
    // Every long-window key is still spent: none was evicted.
    for i in 0..50u32 {
        assert!(
            !store
                .check_one(T0, &Check::new(&long, &format!("long{i}"), 1))
                .allowed,
            "long{i}"
        );
    }
}

#[test]
fn sweeping_drops_states_that_are_fresh_again() {
    let store = MemoryStore::new();
    let l = fixed(10, 60, 1);
    let log = Limit::new(Algorithm::SlidingLog(SlidingLog::new(
        10,
        Duration::from_secs(60),
    )))
    .unwrap();
    for i in 0..100u32 {
        store.check_one(T0, &Check::new(&l, &format!("u{i}"), 1));
        store.check_one(T0, &Check::new(&log, &format!("u{i}"), 1));
    }
    assert_eq!(store.stats().keys, 200);
    assert_eq!(store.sweep(T0 + 59 * S), 0);
    assert_eq!(store.sweep(T0 + 60 * S), 200);
    assert_eq!(store.stats().keys, 0);
}

#[test]
fn a_request_that_changes_nothing_stores_nothing() {
    let store = MemoryStore::new();
    let l = fixed(10, 60, 1);
    store.check_one(T0, &Check::new(&l, "a", 0));
    store.check_one(T0, &Check::new(&l, "b", 11));
    assert_eq!(store.stats().keys, 0);
}

#[test]
fn keys_of_different_limits_are_separate_counters() {
    let store = MemoryStore::new();
    let (a, b) = (fixed(1, 60, 1), fixed(1, 60, 2));
    assert!(store.check_one(T0, &Check::new(&a, "same", 1)).allowed);
    assert!(store.check_one(T0, &Check::new(&b, "same", 1)).allowed);
    assert!(!store.check_one(T0, &Check::new(&a, "same", 1)).allowed);
}

#[test]
fn the_store_trait_gives_the_same_answers() {
    let store = MemoryStore::new();
    let l = fixed(2, 60, 1);
    let checks = [Check::new(&l, "k", 1)];
    let answers: Vec<bool> = (0..3)
        .map(|_| ready(Store::check(&store, T0, &checks)).unwrap()[0].allowed)
        .collect();
    assert_eq!(answers, [true, true, false]);
}

/// A request descheduled between reading the clock and taking the shard lock arrives
/// with a stale "now". Under a tight bucket (10,000,000 a second, bursts of 1,000:
/// 100 µs of tolerance) the requests that overtook it would have it rejected; the
/// store decides it at the latest time already seen instead (found by the gateway
/// benchmark: a few spurious 429s per 10 s at 64 connections).
#[test]
fn a_stale_clock_read_is_decided_at_the_latest_time_seen_not_rejected() {
    let limit = Limit::new(Algorithm::Gcra(
        Gcra::new(10_000_000, Duration::from_secs(1)).with_burst(1_000),
    ))
    .unwrap();
    let run = |store: &MemoryStore| {
        let check = Check::new(&limit, "ip", 1);
        for i in 0..2_000 {
            assert!(store.check_one(T0 + i * 100, &check).allowed);
        }
        // Read the clock 200 µs ago, decided now.
        store.check_one(T0 + 2_000 * 100 - 200_000, &check).allowed
    };
    assert!(run(&MemoryStore::new()), "decided at the latest time seen");
    assert!(
        !run(&MemoryStore::builder().monotonic(false).build()),
        "at exactly the stale time it is rejected"
    );
}

#[test]
fn a_warm_up_state_is_swept_once_full_and_cold_and_undone_with_its_request() {
    // 10 per second, burst 1, warm-up 2 s: a cold key's request moves the bucket's
    // instant 0.29 s ahead (an interval and 1.9 more) and warms the key by one permit,
    // which it rests off in one interval after the grace of two past that instant:
    // fresh at 0.59 s.
    let warm = Limit::new(Algorithm::Gcra(
        Gcra::new(10, Duration::from_secs(1))
            .with_burst(1)
            .with_warmup(Duration::from_secs(2)),
    ))
    .unwrap();
    let store = MemoryStore::new();
    assert!(store.check_one(T0, &Check::new(&warm, "k", 1)).allowed);
    assert_eq!(store.stats().keys, 1);
    assert_eq!(store.sweep(T0 + 589_999_999), 0, "still warmer than cold");
    assert_eq!(store.sweep(T0 + 590_000_000), 1);
    assert_eq!(store.stats().keys, 0);
    // All or nothing: a request refused by another limit leaves the warm key as it was.
    let none = fixed(0, 60, 7);
    let both = [Check::new(&warm, "k", 1), Check::new(&none, "k", 1)];
    let d = store.check_all(T0 + 4 * S, &both);
    assert!(d[0].allowed && !d[1].allowed);
    assert_eq!(
        store.stats().keys,
        0,
        "the warm key's charge was taken back"
    );
}
