//! Many threads on one key: the in-memory store loses no update and admits exactly the limit.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use tollgate::algorithm::{
    Algorithm, FixedWindow, Gcra, LeakyBucket, LeakyMode, Limit, SlidingLog, SlidingWindow,
    TokenBucket,
};
use tollgate::clock::NANOS_PER_SEC;
use tollgate::store::{Check, MemoryStore};

const THREADS: usize = 8;
const ATTEMPTS_PER_THREAD: usize = 400;
const LIMIT: u64 = 1000;
const NOW: u64 = 1_699_920_000 * NANOS_PER_SEC;

fn every_algorithm() -> Vec<Limit> {
    let hour = Duration::from_secs(3600);
    [
        Algorithm::FixedWindow(FixedWindow::new(LIMIT, hour)),
        Algorithm::SlidingWindow(SlidingWindow::new(LIMIT, hour)),
        Algorithm::SlidingLog(SlidingLog::new(LIMIT, hour)),
        Algorithm::TokenBucket(TokenBucket::new(LIMIT, hour)),
        Algorithm::Gcra(Gcra::new(LIMIT, hour)),
        Algorithm::LeakyBucket(LeakyBucket::new(LIMIT, hour, LeakyMode::Meter)),
    ]
    .into_iter()
    .map(|a| Limit::new(a).unwrap())
    .collect()
}

/// Runs `THREADS` threads each making `ATTEMPTS_PER_THREAD` calls of `f`; returns the admissions.
fn hammer(f: impl Fn() -> bool + Send + Sync + 'static) -> usize {
    let f = Arc::new(f);
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            let f = Arc::clone(&f);
            thread::spawn(move || (0..ATTEMPTS_PER_THREAD).filter(|_| f()).count())
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).sum()
}

#[test]
fn threads_on_one_key_admit_exactly_the_limit_for_every_algorithm() {
    for limit in every_algorithm() {
        let store = Arc::new(MemoryStore::new());
        let s = Arc::clone(&store);
        let admitted = hammer(move || s.check_one(NOW, &Check::new(&limit, "hot-key", 1)).allowed);
        assert_eq!(admitted as u64, LIMIT, "{}", limit.algorithm().name());
    }
}

#[test]
fn concurrent_multi_key_requests_are_all_or_nothing() {
    // Threads alternate between a request on key A alone and one on A and B together;
    // B allows 300. Whatever the interleaving: B admits exactly 300 and A is charged
    // exactly once per admitted request, so A's total stays within its limit of 1000.
    let hour = Duration::from_secs(3600);
    let a = Limit::new(Algorithm::FixedWindow(FixedWindow::new(LIMIT, hour)))
        .unwrap()
        .with_id(1);
    let b = Limit::new(Algorithm::FixedWindow(FixedWindow::new(300, hour)))
        .unwrap()
        .with_id(2);
    let store = Arc::new(MemoryStore::new());
    let s = Arc::clone(&store);
    let counter = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let c = Arc::clone(&counter);
    let pairs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let p = Arc::clone(&pairs);
    let admitted = hammer(move || {
        let n = c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n % 2 == 0 {
            s.check_one(NOW, &Check::new(&a, "a", 1)).allowed
        } else {
            let d = s.check_all(NOW, &[Check::new(&a, "a", 1), Check::new(&b, "b", 1)]);
            let ok = d.iter().all(|d| d.allowed);
            if ok {
                p.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            ok
        }
    });
    let pairs = pairs.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(pairs, 300, "B admits exactly its limit");
    // A was charged once per admitted request (singles and pairs alike): no more than 1000.
    assert_eq!(
        admitted as u64,
        LIMIT.min((THREADS * ATTEMPTS_PER_THREAD) as u64)
    );
    let a_left = store.check_one(
        NOW,
        &Check::new(
            &Limit::new(Algorithm::FixedWindow(FixedWindow::new(LIMIT, hour)))
                .unwrap()
                .with_id(1),
            "a",
            0,
        ),
    );
    assert_eq!(a_left.remaining, 0);
}
