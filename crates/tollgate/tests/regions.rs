//! Multi-region counting in the library: `ScaleOut::with_global` counts `Scope::Global`
//! limits in the global store (leased) and the others in the region's store; a hot
//! global key's next lease is taken before its units run out, so that its decisions do
//! not wait on the distant store; requests stay all or nothing across both stores.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tollgate::algorithm::{Algorithm, Consistency, FixedWindow, Limit, Scope, TokenBucket};
use tollgate::clock::Nanos;
use tollgate::decision::Decision;
use tollgate::store::{Check, Error, LeaseToken, MemoryStore, ScaleOut, Store};

const MS: Nanos = 1_000_000;

/// A store whose calls wait while it is closed (a distant store that has not answered
/// yet), or fail while it is down; counting its calls.
struct Gate {
    store: MemoryStore,
    open: AtomicBool,
    down: AtomicBool,
    opened: tokio::sync::Notify,
    calls: AtomicU64,
    /// Calls that waited at the closed gate.
    held: AtomicU64,
}

impl Gate {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            store: MemoryStore::new(),
            open: AtomicBool::new(true),
            down: AtomicBool::new(false),
            opened: tokio::sync::Notify::new(),
            calls: AtomicU64::new(0),
            held: AtomicU64::new(0),
        })
    }

    async fn pass(&self) -> Result<(), Error> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if !self.open.load(Ordering::Acquire) {
            self.held.fetch_add(1, Ordering::Relaxed);
            while !self.open.load(Ordering::Acquire) {
                let woken = self.opened.notified();
                if self.open.load(Ordering::Acquire) {
                    break;
                }
                woken.await;
            }
        }
        if self.down.load(Ordering::Relaxed) {
            return Err(Error::backend("down"));
        }
        Ok(())
    }

    fn set_open(&self, open: bool) {
        self.open.store(open, Ordering::Release);
        if open {
            self.opened.notify_waiters();
        }
    }

    /// What is left of `limit`'s `key` in this store at `now` (a read).
    fn remaining(&self, limit: &Limit, key: &str, now: Nanos) -> u64 {
        let plain = limit.with_consistency(Consistency::Exact);
        self.store.check_all(now, &[Check::new(&plain, key, 0)])[0].remaining
    }
}

/// An instance's link to a [`Gate`].
struct Link(Arc<Gate>);

fn link(gate: &Arc<Gate>) -> Link {
    Link(Arc::clone(gate))
}

impl Store for Link {
    async fn check(&self, now: Nanos, checks: &[Check<'_>]) -> Result<Vec<Decision>, Error> {
        self.0.pass().await?;
        Ok(self.0.store.check_all(now, checks))
    }

    async fn lease(
        &self,
        now: Nanos,
        check: Check<'_>,
        _budget: Option<Duration>,
    ) -> Result<(Decision, Option<LeaseToken>), Error> {
        self.0.pass().await?;
        Ok(self.0.store.lease_one(now, &check))
    }

    async fn give_back(
        &self,
        now: Nanos,
        check: Check<'_>,
        token: &LeaseToken,
    ) -> Result<(), Error> {
        self.0.pass().await?;
        self.0.store.give_back_one(now, &check, token);
        Ok(())
    }
}

/// A runtime whose worker runs the leases taken in the background while the test's
/// thread blocks on its checks.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_time()
        .build()
        .unwrap()
}

/// A global fixed window of `n` per minute, leased every 100 ms.
fn global_window(n: u64, id: u64) -> Limit {
    Limit::new(Algorithm::FixedWindow(FixedWindow::new(
        n,
        Duration::from_secs(60),
    )))
    .unwrap()
    .with_id(id)
    .with_consistency(Consistency::Leased { period: 100 * MS })
    .with_scope(Scope::Global)
}

/// A regional (exact) fixed window of `n` per minute.
fn regional_window(n: u64, id: u64) -> Limit {
    Limit::new(Algorithm::FixedWindow(FixedWindow::new(
        n,
        Duration::from_secs(60),
    )))
    .unwrap()
    .with_id(id)
}

/// The start of a minute, far from the epoch.
const START: Nanos = 1_000 * 60_000 * MS;

/// Two regions of two instances each: a global limit of 600 admits at most 600 over all
/// four, counted in the global store only; a regional limit of 300 admits 300 in each
/// region, counted in that region's store only.
#[test]
fn a_global_limit_is_shared_by_every_region_and_a_regional_one_is_not() {
    let rt = runtime();
    let global_store = Gate::new();
    let regions = [Gate::new(), Gate::new()];
    let instances: Vec<(usize, ScaleOut<Link>)> = (0..4)
        .map(|i| {
            let region = i % 2;
            let s = ScaleOut::with_global(link(&regions[region]), link(&global_store), 10_000);
            (region, s)
        })
        .collect();
    let global = global_window(600, 1);
    let regional = regional_window(300, 2);
    let mut admitted_global = 0u64;
    let mut admitted_regional = [0u64; 2];
    // 1,000 a second offered, spread over the four instances.
    for n in 0..2_000u64 {
        let now = START + n * MS;
        let (region, i) = &instances[(n % 4) as usize];
        let d = rt
            .block_on(i.check(now, &[Check::new(&global, "tenant", 1)]))
            .unwrap();
        admitted_global += u64::from(d[0].allowed);
        let d = rt
            .block_on(i.check(now, &[Check::new(&regional, "ip", 1)]))
            .unwrap();
        admitted_regional[*region] += u64::from(d[0].allowed);
    }
    let end = START + 2_000 * MS;
    assert!(
        (588..=600).contains(&admitted_global),
        "{admitted_global} admitted"
    );
    assert_eq!(admitted_regional, [300, 300]);
    // Where each was counted: the global limit in the global store, the regional one in
    // each region's.
    assert!(global_store.remaining(&global, "tenant", end) <= 600 - admitted_global);
    assert_eq!(global_store.remaining(&regional, "ip", end), 300);
    for r in &regions {
        assert_eq!(r.remaining(&global, "tenant", end), 600);
        assert_eq!(r.remaining(&regional, "ip", end), 0);
    }
    // Well under a global call per ten decisions.
    let calls: u64 = instances.iter().map(|(_, i)| i.stats().global_calls).sum();
    assert!(calls * 10 < 2_000, "{calls} global calls");
}

/// Once half of a hot global key's lease is spent, the next one is asked for in the
/// background: with the global store slow to answer (here: not answering until let
/// through), decisions go on from the units in hand and none waits for it.
#[test]
fn a_hot_global_key_takes_its_next_lease_before_its_units_run_out() {
    let rt = runtime();
    let global_store = Gate::new();
    let region = Gate::new();
    let one = ScaleOut::with_global(link(&region), link(&global_store), 10_000);
    let limit = global_window(100_000, 1);
    let check = [Check::new(&limit, "k", 1)];
    // Warm: one decision per millisecond, leases grow to about 100 units.
    let mut now = START;
    for _ in 0..1_000 {
        now += MS;
        assert!(rt.block_on(one.check(now, &check)).unwrap()[0].allowed);
    }
    assert!(one.stats().leases_taken < 30, "{:?}", one.stats());
    // The global store stops answering: the next lease is asked for ahead and held;
    // every decision is still made, at once, from the units in hand.
    global_store.set_open(false);
    let mut decided = 0;
    while global_store.held.load(Ordering::Relaxed) == 0 && decided < 500 {
        now += MS;
        let d = rt
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(5), one.check(now, &check)).await
            })
            .expect("a decision waited for the global store");
        assert!(d.unwrap()[0].allowed);
        decided += 1;
    }
    assert_eq!(global_store.held.load(Ordering::Relaxed), 1);
    // Half a lease or more was still in hand when it was asked for: ten more decisions
    // need no call.
    for _ in 0..10 {
        now += MS;
        let d = rt
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(5), one.check(now, &check)).await
            })
            .expect("a decision waited for the global store");
        assert!(d.unwrap()[0].allowed);
    }
    let before = one.stats().leases_taken;
    global_store.set_open(true);
    // The held lease lands; decisions go on without a wait.
    rt.block_on(async {
        for _ in 0..100 {
            if one.stats().leases_taken > before {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    assert_eq!(one.stats().leases_taken, before + 1);
    assert_eq!(region.calls.load(Ordering::Relaxed), 0);
}

/// A hot global key far from its store (round trips timed at 10 ms) that finds nothing
/// in hand while its next lease is on its way is refused at once, not kept waiting for
/// the store; its demand makes the next lease bigger, and once the lease lands the key
/// is admitted again.
#[test]
fn a_hot_global_key_far_from_its_store_is_refused_at_once_rather_than_wait() {
    let rt = runtime();
    let global_store = Gate::new();
    let region = Gate::new();
    let one = ScaleOut::with_global(link(&region), link(&global_store), 10_000);
    // Every reading of the timer is 10 ms after the last: each call seems to take 10 ms.
    let clock = Arc::new(AtomicU64::new(0));
    let ticks = Arc::clone(&clock);
    assert!(one.time_with(Arc::new(move || ticks.fetch_add(10 * MS, Ordering::Relaxed))));
    let limit = global_window(100_000, 1);
    let check = [Check::new(&limit, "k", 1)];
    let decide = |now: Nanos| {
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), one.check(now, &check)).await
        })
        .expect("a decision waited for the global store")
        .unwrap()[0]
    };
    // Warm, with the store answering: the key is leased in blocks.
    let mut now = START;
    for _ in 0..200 {
        now += MS;
        assert!(decide(now).allowed);
        settle_briefly(&rt);
    }
    let dry = one.stats().leased_dry;
    // The store stops answering; a burst at one instant spends what is in hand, and the
    // request that finds nothing is refused at once.
    global_store.set_open(false);
    let mut admitted = 0;
    let refused = loop {
        let d = decide(now);
        if !d.allowed {
            break d;
        }
        admitted += 1;
        assert!(admitted < 10_000, "the units in hand never ran out");
    };
    assert!(admitted > 0);
    assert_eq!(one.stats().leased_dry, dry + 1);
    assert!(refused.retry_after > 0);
    // Its lease call, in the background, reaches the store (which holds it).
    let reached = (0..1_000).any(|_| {
        settle_briefly(&rt);
        global_store.held.load(Ordering::Relaxed) >= 1
    });
    assert!(reached, "no lease call reached the global store");
    // Requests go on being refused at once, with one call in flight.
    for _ in 0..20 {
        assert!(!decide(now).allowed);
    }
    assert_eq!(global_store.held.load(Ordering::Relaxed), 1);
    // The store answers: the lease lands and the key is admitted again.
    global_store.set_open(true);
    let again = (0..100).any(|_| {
        settle_briefly(&rt);
        decide(now + MS).allowed
    });
    assert!(
        again,
        "the key was not admitted again once its lease landed"
    );
}

/// Lets a lease taken in the background land before the next request.
fn settle_briefly(rt: &tokio::runtime::Runtime) {
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(1)).await });
}

/// A request with a global and a regional limit is all or nothing: when the regional
/// one rejects it, the global units it spent go back in hand (the next request spends
/// them); when the global one rejects it, the regional limit is not charged.
#[test]
fn a_request_over_either_limit_charges_neither() {
    let rt = runtime();
    let global_store = Gate::new();
    let region = Gate::new();
    let one = ScaleOut::with_global(link(&region), link(&global_store), 10_000);
    let global = global_window(10, 1);
    let regional = regional_window(3, 2);
    let both = [
        Check::new(&global, "tenant", 1),
        Check::new(&regional, "ip", 1),
    ];
    let mut now = START;
    let mut admitted = 0;
    for _ in 0..6 {
        now += MS;
        let d = rt.block_on(one.check(now, &both)).unwrap();
        if d.iter().all(|d| d.allowed) {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 3);
    // Only three units of the global limit were spent: seven more pass alone.
    let alone = [Check::new(&global, "tenant", 1)];
    let mut more = 0;
    for _ in 0..10 {
        now += MS;
        more += u64::from(rt.block_on(one.check(now, &alone)).unwrap()[0].allowed);
    }
    assert_eq!(more, 7);
    // The global limit is spent: a request with a fresh regional key is rejected, and
    // that key is not charged.
    let other = [
        Check::new(&global, "tenant", 1),
        Check::new(&regional, "ip2", 1),
    ];
    let d = rt.block_on(one.check(now, &other)).unwrap();
    assert!(!d[0].allowed);
    assert_eq!(region.remaining(&regional, "ip2", now), 3);
}

/// A check of a global limit that must be exact (here: a read, `hits_addend: 0`) is
/// decided by the global store; the region's store never sees the global limit.
#[test]
fn a_global_check_that_must_be_exact_goes_to_the_global_store() {
    let rt = runtime();
    let global_store = Gate::new();
    let region = Gate::new();
    let one = ScaleOut::with_global(link(&region), link(&global_store), 10_000);
    let global = global_window(10, 1);
    let now = START + MS;
    let d = rt
        .block_on(one.check(now, &[Check::new(&global, "tenant", 4)]))
        .unwrap();
    assert!(d[0].allowed);
    let read = rt
        .block_on(one.check(now, &[Check::new(&global, "tenant", 0)]))
        .unwrap();
    assert_eq!(read[0].remaining, 6);
    assert_eq!(region.calls.load(Ordering::Relaxed), 0);
    assert_eq!(global_store.calls.load(Ordering::Relaxed), 2);
}

/// While the global store fails, a global key's units in hand are spent, then the
/// check fails (the limiter answers it with the rule's failure mode); the time it was
/// failing is counted, and leasing resumes when it answers again. A bucket, here.
#[test]
fn a_failing_global_store_is_timed_and_leasing_resumes_after_it() {
    let rt = runtime();
    let global_store = Gate::new();
    let region = Gate::new();
    let one = ScaleOut::with_global(link(&region), link(&global_store), 10_000);
    let limit = Limit::new(Algorithm::TokenBucket(TokenBucket::new(
        1_000,
        Duration::from_secs(1),
    )))
    .unwrap()
    .with_consistency(Consistency::Leased { period: 100 * MS })
    .with_scope(Scope::Global);
    let check = [Check::new(&limit, "k", 1)];
    let mut now = START;
    for _ in 0..200 {
        now += MS;
        assert!(rt.block_on(one.check(now, &check)).unwrap()[0].allowed);
    }
    global_store.down.store(true, Ordering::Relaxed);
    let down_at = now;
    let mut spent = 0;
    let failed_at = loop {
        now += MS;
        match rt.block_on(one.check(now, &check)) {
            Ok(d) => {
                assert!(d[0].allowed);
                spent += 1;
            }
            Err(_) => break now,
        }
        assert!(spent < 1_000, "never failed");
    };
    assert!(spent > 0, "no unit in hand was spent");
    let stats = one.stats();
    assert!(stats.global_failures > 0);
    now = failed_at + 500 * MS;
    assert!(one.global_down(now) >= now - failed_at);
    // (The spell is timed from the failed call's instant: a lease taken ahead of need
    // may have been sent by the check just before the store went down.)
    assert!(one.global_down(now) <= now - down_at + 100 * MS);
    global_store.down.store(false, Ordering::Relaxed);
    let before = one.stats().leases_taken;
    assert!(rt.block_on(one.check(now, &check)).unwrap()[0].allowed);
    assert!(one.stats().leases_taken > before);
    // The spell is over: it no longer grows.
    let total = one.global_down(now);
    assert_eq!(one.global_down(now + 10_000 * MS), total);
}

/// Lets background calls run.
fn settle(rt: &tokio::runtime::Runtime) {
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(50)).await });
}

/// A cold global key whose request costs more than one unit leases that cost, and no
/// lease ahead right after it (its rate is not known yet).
#[test]
fn a_cold_global_key_leases_its_requests_cost_and_nothing_ahead() {
    let rt = runtime();
    let global_store = Gate::new();
    let region = Gate::new();
    let one = ScaleOut::with_global(link(&region), link(&global_store), 10_000);
    let limit = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
        1_000,
        Duration::from_secs(60),
    )))
    .unwrap()
    .with_consistency(Consistency::Leased { period: 100 * MS })
    .with_scope(Scope::Global);
    let now = START + MS;
    assert!(
        rt.block_on(one.check(now, &[Check::new(&limit, "cold", 5)]))
            .unwrap()[0]
            .allowed
    );
    settle(&rt);
    let left = global_store.remaining(&limit, "cold", now + MS);
    eprintln!(
        "global remaining after one request of cost 5: {left}; stats {:?}",
        one.stats()
    );
    assert_eq!(
        left, 995,
        "the cold key holds more than its request in hand"
    );
}

/// A lease ahead of need whose task is dropped before it ran (its runtime shut down)
/// still marks the call over: later requests do not wait for it.
#[test]
fn a_renewal_dropped_before_it_ran_does_not_leave_its_key_waiting() {
    let global_store = Gate::new();
    let region = Gate::new();
    let one = ScaleOut::with_global(link(&region), link(&global_store), 10_000);
    let limit = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
        100_000,
        Duration::from_secs(60),
    )))
    .unwrap()
    .with_consistency(Consistency::Leased { period: 100 * MS })
    .with_scope(Scope::Global);
    let check = [Check::new(&limit, "k", 1)];
    let rt = runtime();
    let mut now = START;
    for _ in 0..300 {
        now += MS;
        assert!(rt.block_on(one.check(now, &check)).unwrap()[0].allowed);
    }
    settle(&rt);
    // A current-thread runtime: the renewal is spawned, then the runtime is dropped
    // before the task is polled.
    let before = one.stats().global_calls;
    for _ in 0..1000 {
        let ct = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        now += MS;
        assert!(ct.block_on(one.check(now, &check)).unwrap()[0].allowed);
        drop(ct);
    }
    let after = one.stats().global_calls;
    assert!(after >= before);
    // Now spend with a real runtime: no request waits for a call that never runs.
    for _ in 0..20 {
        now += MS;
        let d = rt
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(2), one.check(now, &check)).await
            })
            .expect("a request waited for a lease call that never ran");
        assert!(d.unwrap()[0].allowed);
    }
}

/// A limit of `Scope::Global` whose consistency is exact is leased only if a lease keeps
/// its meaning: a leaky bucket's queue is decided in the global store, its delays as one
/// store gives them.
#[test]
fn a_global_queue_is_decided_exactly_in_the_global_store() {
    use tollgate::algorithm::{LeakyBucket, LeakyMode};
    let rt = runtime();
    let global_store = Gate::new();
    let region = Gate::new();
    let limit = Limit::new(Algorithm::LeakyBucket(LeakyBucket::new(
        10,
        Duration::from_secs(1),
        LeakyMode::Queue,
    )))
    .unwrap()
    .with_scope(Scope::Global);
    let one = ScaleOut::with_global(link(&region), link(&global_store), 10_000);
    let direct = MemoryStore::new();
    let (mut vd, mut rdl) = (Vec::new(), Vec::new());
    for n in 0..10u64 {
        let now = START + n * MS;
        let check = [Check::new(&limit, "k", 1)];
        vd.push(rt.block_on(one.check(now, &check)).unwrap()[0].delay / MS);
        rdl.push(direct.check_all(now, &check)[0].delay / MS);
    }
    eprintln!("queue delays (ms): scale_out {vd:?}, one store {rdl:?}");
    assert_eq!(vd, rdl);
}

/// A global store 300 ms away: requests that wait for another request's lease call wait
/// for its answer, and the next lease covers them, rather than each calling.
#[test]
fn requests_waiting_for_a_far_lease_call_do_not_each_call() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_time()
        .build()
        .unwrap();
    let global_store = Gate::new();
    let region = Gate::new();
    let one = Arc::new(ScaleOut::with_global(
        link(&region),
        link(&global_store),
        10_000,
    ));
    let limit = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
        100_000,
        Duration::from_secs(60),
    )))
    .unwrap()
    .with_consistency(Consistency::Leased { period: 100 * MS })
    .with_scope(Scope::Global);
    global_store.set_open(false);
    let now = START + MS;
    let handles: Vec<_> = (0..20)
        .map(|_| {
            let one = Arc::clone(&one);
            rt.spawn(async move {
                one.check(now, &[Check::new(&limit, "k", 1)]).await.unwrap()[0].allowed
            })
        })
        .collect();
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(300)).await });
    global_store.set_open(true);
    for h in handles {
        assert!(rt.block_on(h).unwrap());
    }
    // The calls made while the store held its answer: the waiters' own. (Once the lease
    // lands the key is hot, and its next leases are taken ahead in the background.)
    let held = global_store.held.load(Ordering::Relaxed);
    let calls = global_store.calls.load(Ordering::Relaxed);
    eprintln!("20 concurrent requests, global store answering after 300 ms: {held} calls held, {calls} in all");
    assert_eq!(held, 1);
}
