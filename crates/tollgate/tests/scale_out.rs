//! Leased and synced counting (`ScaleOut`) between several instances sharing one store.
//!
//! The shared store here is a `MemoryStore`: the algorithms' Rust arithmetic, which the
//! Redis scripts are held to by the differential tests (`redis_store.rs`). Leasing adds
//! no arithmetic to the store (a lease is a charge by the limit's own algorithm), so
//! what is checked here is the instances' side: with any interleaving of decisions,
//! leases, window turns and refills, lost calls and lost answers, and instances that
//! crash and start again, the instances together never admit more than the limit.
//!
//! - a deterministic simulation over 10,000 seeds (a failing seed is printed; replay it
//!   with `SCALE_OUT_SEED=<seed>`);
//! - a property test of all-or-nothing requests mixing leased, synced and exact checks;
//! - synced counting's exchange: what each instance admits reaches the store by its
//!   next sync, and the over-admission stays within what the others admit in one
//!   interval.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tollgate::algorithm::{
    Algorithm, Consistency, FixedWindow, Gcra, LeakyBucket, LeakyMode, Limit, TokenBucket,
};
use tollgate::clock::Nanos;
use tollgate::decision::Decision;
use tollgate::store::{Check, Error, LeaseToken, MemoryStore, ScaleOut, Store};

const MS: Nanos = 1_000_000;

/// `SCALE_OUT_TRACE=1`: print every step of a simulated run (with `SCALE_OUT_SEED`).
fn tracing_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SCALE_OUT_TRACE").is_ok())
}

/// A current-thread runtime with timers, on which each instance's calls run.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
}

/// A small deterministic generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// The shared store as the network shows it to one instance: a call may be lost on
/// the way (nothing changes), or its answer lost (the store changed, the instance is
/// told it failed). Faults are drawn from a shared schedule.
struct Network {
    store: Arc<MemoryStore>,
    faults: Arc<parking_lot::Mutex<Rng>>,
    /// Percent of calls lost before the store, and of answers lost after it.
    lost_calls: u64,
    lost_answers: u64,
    /// The store is unreachable (a partition) while this is set.
    partitioned: Arc<AtomicU64>,
}

impl Network {
    /// Whether the call is lost on its way (`Err`), and whether its answer will be.
    fn faults(&self) -> Result<bool, Error> {
        if self.partitioned.load(Ordering::Relaxed) > 0 {
            return Err(Error::backend("partitioned"));
        }
        let (lose_call, lose_answer) = {
            let mut f = self.faults.lock();
            (f.chance(self.lost_calls), f.chance(self.lost_answers))
        };
        if lose_call {
            return Err(Error::Timeout(Duration::from_millis(20)));
        }
        Ok(lose_answer)
    }
}

impl Store for Network {
    async fn lease(
        &self,
        now: Nanos,
        check: Check<'_>,
        _budget: Option<Duration>,
    ) -> Result<(Decision, Option<LeaseToken>), Error> {
        let lose_answer = self.faults()?;
        let (d, token) = self.store.lease_one(now, &check);
        if tracing_on() {
            eprintln!(
                "  lease at {} ms cost {}: {d:?} lost answer {lose_answer}",
                now / MS,
                check.cost
            );
        }
        if lose_answer {
            return Err(Error::Timeout(Duration::from_millis(20)));
        }
        Ok((d, token))
    }

    async fn give_back(
        &self,
        now: Nanos,
        check: Check<'_>,
        token: &LeaseToken,
    ) -> Result<(), Error> {
        let lose_answer = self.faults()?;
        let d = self.store.give_back_one(now, &check, token);
        if tracing_on() {
            eprintln!(
                "  give back at {} ms {} units: store remaining {} lost answer {lose_answer}",
                now / MS,
                check.cost,
                d.remaining
            );
        }
        if lose_answer {
            return Err(Error::Timeout(Duration::from_millis(20)));
        }
        Ok(())
    }

    async fn check(&self, now: Nanos, checks: &[Check<'_>]) -> Result<Vec<Decision>, Error> {
        let lose_answer = self.faults()?;
        let d = self.store.check_all(now, checks);
        if tracing_on() {
            eprintln!(
                "  store call at {} ms cost {}: {:?} lost answer {lose_answer}",
                now / MS,
                checks[0].cost,
                d[0]
            );
        }
        if lose_answer {
            return Err(Error::Timeout(Duration::from_millis(20)));
        }
        Ok(d)
    }
}

fn limits(period: Nanos) -> Vec<Limit> {
    let s = Duration::from_secs(1);
    let leased = Consistency::Leased { period };
    vec![
        Limit::new(Algorithm::FixedWindow(FixedWindow::new(100, s))).unwrap(),
        Limit::new(Algorithm::TokenBucket(
            TokenBucket::new(100, s).with_burst(40),
        ))
        .unwrap(),
        Limit::new(Algorithm::Gcra(Gcra::new(50, s).with_burst(20))).unwrap(),
        Limit::new(Algorithm::LeakyBucket(
            LeakyBucket::new(80, s, LeakyMode::Meter).with_burst(30),
        ))
        .unwrap(),
    ]
    .into_iter()
    .map(|l| l.with_consistency(leased))
    .collect()
}

/// Whether `admitted` (instant, cost), in time order, is what an exact store deciding
/// `limit` alone would admit in full: every one of them fits.
fn an_exact_store_admits_all(limit: &Limit, admitted: &[(Nanos, u64)]) -> Result<(), String> {
    let exact = MemoryStore::new();
    let plain = limit.with_consistency(Consistency::Exact);
    for (n, &(at, cost)) in admitted.iter().enumerate() {
        let d = exact.check_all(at, &[Check::new(&plain, "k", cost)]);
        if tracing_on() {
            eprintln!("replay {} ms cost {cost}: {:?}", at / MS, d[0]);
        }
        if !d[0].allowed {
            return Err(format!(
                "{}: the admission #{n} at {} ms (cost {cost}) is more than an exact store admits",
                limit.algorithm().name(),
                at / MS
            ));
        }
    }
    Ok(())
}

/// One simulated run: 2–5 instances on one limit, random arrivals, faults, crashes and
/// partitions. Returns what went wrong, if anything.
fn simulate(seed: u64) -> Result<(), String> {
    let mut rng = Rng(seed);
    let period = [10, 50, 100, 500][rng.below(4) as usize] * MS;
    let all = limits(period);
    let limit = all[rng.below(all.len() as u64) as usize];
    let store = Arc::new(MemoryStore::new());
    let faults = Arc::new(parking_lot::Mutex::new(Rng(seed ^ 0xABCD)));
    let partitioned = Arc::new(AtomicU64::new(0));
    let (lost_calls, lost_answers) = if rng.chance(50) {
        (rng.below(20), rng.below(20))
    } else {
        (0, 0)
    };
    let instance = || {
        ScaleOut::new(Network {
            store: Arc::clone(&store),
            faults: Arc::clone(&faults),
            lost_calls,
            lost_answers,
            partitioned: Arc::clone(&partitioned),
        })
    };
    let count = 2 + rng.below(4) as usize;
    let mut instances: Vec<_> = (0..count).map(|_| instance()).collect();
    let rt = runtime();
    let mut now: Nanos = 1_000_000_000_000 + rng.below(1_000) * MS;
    let mut admitted: Vec<(Nanos, u64)> = Vec::new();
    let shadow_replay = MemoryStore::new();
    let trace = tracing_on();
    let mut returned = 0;
    // Requests every 7.5 ms on average (under most limits), or every 1.5 or 4 ms (over
    // them all: the limit binds, and a unit spent twice shows).
    let busy = [3, 8, 15][rng.below(3) as usize];
    for _ in 0..400 {
        let gap = if rng.chance(10) { 400 } else { busy };
        now += rng.below(gap) * MS + rng.below(MS);
        if rng.chance(2) {
            // An instance crashes and starts again, its leases lost.
            let i = rng.below(count as u64) as usize;
            instances[i] = instance();
        }
        if rng.chance(2) {
            // An instance stops: it gives its unspent units back, and starts again.
            let i = rng.below(count as u64) as usize;
            let given = rt.block_on(instances[i].give_back_leases(now, true));
            returned += given;
            if trace {
                eprintln!("{} ms: instance {i} stops, gives back {given}", now / MS);
            }
            instances[i] = instance();
        }
        if rng.chance(3) {
            // The instances' maintenance: keys gone idle give their units back.
            for x in &instances {
                returned += rt.block_on(x.give_back_leases(now, false));
            }
        }
        if rng.chance(2) {
            // An instance gives back all it holds and goes on deciding.
            let i = rng.below(count as u64) as usize;
            returned += rt.block_on(instances[i].give_back_leases(now, true));
        }
        if rng.chance(2) {
            partitioned.fetch_xor(1, Ordering::Relaxed);
        }
        let i = rng.below(count as u64) as usize;
        let cost = if rng.chance(80) { 1 } else { 1 + rng.below(5) };
        let check = [Check::new(&limit, "k", cost)];
        let r = rt.block_on(instances[i].check(now, &check));
        if trace {
            let plain = limit.with_consistency(Consistency::Exact);
            let s = store.check_all(now, &[Check::new(&plain, "k", 0)]);
            let hand: Vec<u64> = instances.iter().map(|x| x.units_in_hand(now)).collect();
            eprintln!(
                "{} ms: instance {i} cost {cost}: {r:?}; store remaining {} reset {} in hand {hand:?}",
                now / MS,
                s[0].remaining,
                s[0].reset_after / MS
            );
        }
        if let Ok(d) = r {
            if d[0].allowed {
                admitted.push((now, cost));
                if trace {
                    let plain = limit.with_consistency(Consistency::Exact);
                    shadow_replay.check_all(now, &[Check::new(&plain, "k", cost)]);
                }
            }
        }
        if trace {
            let plain = limit.with_consistency(Consistency::Exact);
            let s = store.check_all(now, &[Check::new(&plain, "k", 0)])[0];
            let r = shadow_replay.check_all(now, &[Check::new(&plain, "k", 0)])[0];
            let t = (limit.window() / limit.limit()) as f64;
            let d = (s.reset_after as f64 - r.reset_after as f64) / t;
            let hand: u64 = instances.iter().map(|x| x.units_in_hand(now)).sum();
            if d + 0.001 < hand as f64 {
                eprintln!("!! at {} ms D = {d:.3} < in hand {hand}", now / MS);
            }
        }
    }
    RETURNED.fetch_add(returned, Ordering::Relaxed);
    an_exact_store_admits_all(&limit, &admitted).map_err(|e| {
        format!(
            "seed {seed} ({count} instances, lease period {} ms): {e}",
            period / MS
        )
    })
}

/// Units given back over every simulated run (the runs must reach give-backs).
static RETURNED: AtomicU64 = AtomicU64::new(0);

#[test]
fn leased_instances_never_admit_more_than_the_limit_over_10_000_seeds() {
    if let Ok(seed) = std::env::var("SCALE_OUT_SEED") {
        simulate(seed.parse().unwrap()).unwrap();
        return;
    }
    let failures: Vec<String> = (0..10_000u64)
        .filter_map(|seed| simulate(seed).err())
        .take(5)
        .collect();
    assert!(
        failures.is_empty(),
        "replay with SCALE_OUT_SEED=<seed>:\n{}",
        failures.join("\n")
    );
    assert!(
        RETURNED.load(Ordering::Relaxed) > 0,
        "no unit was given back"
    );
}

/// Four instances, a hot key with a limit of 1,000 per minute, 3,000 calls spread over
/// them: never more than the limit (for the buckets, every admission is one an exact
/// store admits), all but a few units of what one exact store admits from the same
/// calls, and the store called well under once per ten decisions.
#[test]
fn a_hot_key_is_leased_in_blocks_and_admitted_to_its_limit() {
    let rt = runtime();
    let s = Duration::from_secs(60);
    for algorithm in [
        Algorithm::FixedWindow(FixedWindow::new(1_000, s)),
        Algorithm::TokenBucket(TokenBucket::new(1_000, s)),
        Algorithm::Gcra(Gcra::new(1_000, s)),
        Algorithm::LeakyBucket(LeakyBucket::new(1_000, s, LeakyMode::Meter)),
    ] {
        let limit = Limit::new(algorithm)
            .unwrap()
            .with_consistency(Consistency::Leased { period: 100 * MS });
        let plain = limit.with_consistency(Consistency::Exact);
        let store = Arc::new(Counting::default());
        let one_exact_store = MemoryStore::new();
        let instances: Vec<_> = (0..4).map(|_| ScaleOut::new(Arc::clone(&store))).collect();
        // 3,000 calls over 3 s, at the start of a minute.
        let mut now: Nanos = 60_000 * 1_000 * MS;
        let mut admitted = Vec::new();
        let mut exact = 0;
        for n in 0..3_000 {
            now += MS;
            let d = rt
                .block_on(instances[n % 4].check(now, &[Check::new(&limit, "hot", 1)]))
                .unwrap();
            if d[0].allowed {
                admitted.push((now, 1));
            }
            exact += u64::from(
                one_exact_store.check_all(now, &[Check::new(&plain, "hot", 1)])[0].allowed,
            );
        }
        let calls = store.calls.load(Ordering::Relaxed);
        let name = limit.algorithm().name();
        let count = admitted.len() as u64;
        an_exact_store_admits_all(&limit, &admitted).unwrap();
        if name == "fixed_window" {
            assert!((980..=1_000).contains(&count), "{name}: {count} admitted");
        }
        assert!(
            count + 20 >= exact,
            "{name}: {count} admitted, an exact store {exact}"
        );
        assert!(calls * 10 < 3_000, "{name}: {calls} store calls");
        eprintln!("{name}: {count} admitted (exact: {exact}), {calls} store calls");
    }
}

/// An instance that stops (or whose key goes idle) gives its unspent units back: the
/// store's count goes down by them, and another instance leases them. A fixed window
/// gives back every lease; a bucket its newest, while nothing charged the bucket since.
#[test]
fn unspent_units_go_back_to_the_store_when_an_instance_stops_or_a_key_goes_idle() {
    let rt = runtime();
    let s = Duration::from_secs(60);
    for algorithm in [
        Algorithm::FixedWindow(FixedWindow::new(100, s)),
        Algorithm::TokenBucket(TokenBucket::new(100, s)),
        Algorithm::Gcra(Gcra::new(100, s)),
        Algorithm::LeakyBucket(LeakyBucket::new(100, s, LeakyMode::Meter)),
    ] {
        let period = 100 * MS;
        let limit = Limit::new(algorithm)
            .unwrap()
            .with_consistency(Consistency::Leased { period });
        let plain = limit.with_consistency(Consistency::Exact);
        let name = limit.algorithm().name();
        let store = Arc::new(MemoryStore::new());
        let a = ScaleOut::new(Arc::clone(&store));
        let b = ScaleOut::new(Arc::clone(&store));
        let left = |now| store.check_all(now, &[Check::new(&plain, "k", 0)])[0].remaining;
        let mut now: Nanos = 60_000 * 1_000 * MS;
        // A hot key on one instance: its leases grow past what it spends.
        for _ in 0..30 {
            now += MS;
            let d = rt
                .block_on(a.check(now, &[Check::new(&limit, "k", 1)]))
                .unwrap();
            assert!(d[0].allowed);
        }
        let in_hand = a.units_in_hand(now);
        assert!(in_hand > 0, "{name}: nothing in hand");
        let before = left(now);
        // Not idle yet: nothing goes back.
        assert_eq!(rt.block_on(a.give_back_leases(now, false)), 0, "{name}");
        // Idle for four lease periods (at least a second): the units go back.
        now += 1_000 * MS;
        let usable = a.units_in_hand(now);
        let given = rt.block_on(a.give_back_leases(now, false));
        assert!(
            given > 0 && given <= usable,
            "{name}: gave {given} of {usable}"
        );
        assert_eq!(a.units_in_hand(now), usable - given, "{name}");
        assert!(left(now) >= before + given.min(100 - before) - 2, "{name}");
        assert_eq!(a.stats().units_returned, given, "{name}");
        // Another instance now admits what the store has left, and no more: the units
        // given back are no longer spent by the first.
        let mut admitted = 0;
        for _ in 0..200 {
            now += MS / 10;
            let d = rt
                .block_on(b.check(now, &[Check::new(&limit, "k", 1)]))
                .unwrap();
            admitted += u64::from(d[0].allowed);
        }
        assert!(
            admitted + 30 + 2 >= 100,
            "{name}: {admitted} admitted after 30"
        );
        // Stopping gives back everything still usable (here: what the second holds).
        let held = b.units_in_hand(now);
        let given = rt.block_on(b.give_back_leases(now, true));
        assert!(given <= held, "{name}");
        assert_eq!(b.units_in_hand(now), held - given, "{name}");
        eprintln!("{name}: gave back, then {admitted} admitted elsewhere");
    }
}

/// A shared store counting its calls.
#[derive(Default)]
struct Counting {
    store: MemoryStore,
    calls: AtomicU64,
}

impl Store for Counting {
    async fn check(&self, now: Nanos, checks: &[Check<'_>]) -> Result<Vec<Decision>, Error> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(self.store.check_all(now, checks))
    }
}

/// A request of a leased check and an exact check is all or nothing: when the exact
/// one rejects it, the leased one's units go back in hand, and the next request spends
/// them.
#[test]
fn a_rejected_request_gives_its_leased_units_back() {
    let rt = runtime();
    let s = Duration::from_secs(60);
    let leased = Limit::new(Algorithm::FixedWindow(FixedWindow::new(10, s)))
        .unwrap()
        .with_id(1)
        .with_consistency(Consistency::Leased { period: 100 * MS });
    let exact = Limit::new(Algorithm::FixedWindow(FixedWindow::new(1, s)))
        .unwrap()
        .with_id(2);
    let store = Arc::new(MemoryStore::new());
    let one = ScaleOut::new(Arc::clone(&store));
    let now = 60_000 * 1_000 * MS;
    let both = [Check::new(&leased, "k", 1), Check::new(&exact, "k", 1)];
    let d = rt.block_on(one.check(now, &both)).unwrap();
    assert!(d[0].allowed && d[1].allowed);
    // The exact limit is spent: the request is rejected, the leased unit given back.
    let d = rt.block_on(one.check(now + MS, &both)).unwrap();
    assert!(d[0].allowed && !d[1].allowed, "{d:?}");
    let in_hand = one.units_in_hand(now + MS);
    let d = rt.block_on(one.check(now + 2 * MS, &both)).unwrap();
    assert!(!d[1].allowed);
    assert_eq!(one.units_in_hand(now + 2 * MS), in_hand, "given back");
    // Alone, the leased check spends what is in hand, then leases again: ten in all.
    let mut admitted = 1;
    for n in 0..20 {
        let d = rt
            .block_on(one.check(now + (3 + n) * MS, &both[..1]))
            .unwrap();
        admitted += u64::from(d[0].allowed);
    }
    assert_eq!(admitted, 10);
}

/// Synced counting: each instance's admissions reach the store at its next sync, and
/// the instances together go over the limit by no more than what the others admitted
/// within one interval.
#[test]
fn synced_counts_reach_the_store_within_an_interval_and_stay_near_the_limit() {
    let rt = runtime();
    let interval = 100 * MS;
    let limit = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
        1_000,
        Duration::from_secs(60),
    )))
    .unwrap()
    .with_consistency(Consistency::Synced { interval });
    let store = Arc::new(MemoryStore::new());
    let instances: Vec<_> = (0..4).map(|_| ScaleOut::new(Arc::clone(&store))).collect();
    let start: Nanos = 60_000 * 1_000 * MS;
    let mut now = start;
    let mut admitted = 0u64;
    let mut next_sync = start + interval;
    // 2,000 per second offered, 4 s: the limit is reached after about half a second.
    for n in 0..8_000u64 {
        now = start + n * MS / 2;
        if now >= next_sync {
            for i in &instances {
                rt.block_on(i.sync(now)).unwrap();
            }
            next_sync += interval;
        }
        let d = rt
            .block_on(instances[(n % 4) as usize].check(now, &[Check::new(&limit, "k", 1)]))
            .unwrap();
        admitted += u64::from(d[0].allowed);
    }
    // One interval of 2,000 per second is 200; the others' share of it, 150.
    assert!(admitted >= 1_000, "{admitted}");
    assert!(admitted <= 1_000 + 150, "{admitted}");
    // Everything admitted is in the store after one more sync.
    for i in &instances {
        rt.block_on(i.flush(now)).unwrap();
        assert_eq!(i.units_unsynced(), 0);
    }
    let read = store.check_all(now, &[Check::new(&limit, "k", 0)]);
    let counted = 1_000 - read[0].remaining;
    assert!(counted >= 1_000.min(admitted), "{counted}");
    let stats: Vec<_> = instances.iter().map(ScaleOut::stats).collect();
    let synced: u64 = stats.iter().map(|s| s.units_synced).sum();
    let first: u64 = 4; // each instance's first decision went to the store itself
    assert_eq!(synced + first, admitted, "{stats:?}");
}

/// Synced counting with the store unreachable: decisions stay local while the last
/// count is recent, then go to the store (whose failure the limiter answers with the
/// rule's failure mode); once the store answers again, a sync makes them local again
/// and the units admitted meanwhile reach it.
#[test]
fn a_synced_key_goes_back_to_the_store_when_its_count_is_stale() {
    let rt = runtime();
    let interval = 100 * MS;
    let limit = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
        1_000,
        Duration::from_secs(3_600),
    )))
    .unwrap()
    .with_consistency(Consistency::Synced { interval });
    let store = Arc::new(MemoryStore::new());
    let partitioned = Arc::new(AtomicU64::new(0));
    let one = ScaleOut::new(Network {
        store: Arc::clone(&store),
        faults: Arc::new(parking_lot::Mutex::new(Rng(1))),
        lost_calls: 0,
        lost_answers: 0,
        partitioned: Arc::clone(&partitioned),
    });
    let start: Nanos = 3_600 * 1_000 * MS * 1_000;
    let check = [Check::new(&limit, "k", 1)];
    assert!(rt.block_on(one.check(start, &check)).unwrap()[0].allowed);
    partitioned.store(1, Ordering::Relaxed);
    // Within five intervals of the last answer (at least a second): local.
    for n in 1..=9u64 {
        let now = start + n * 100 * MS;
        assert!(rt.block_on(one.check(now, &check)).unwrap()[0].allowed);
        let _ = rt.block_on(one.sync(now));
    }
    assert!(one.stats().sync_failures > 0);
    // Past it: the store decides, and it is down.
    let late = start + 1_100 * MS;
    assert!(rt.block_on(one.check(late, &check)).is_err());
    partitioned.store(0, Ordering::Relaxed);
    assert_eq!(rt.block_on(one.sync(late + interval)).unwrap(), 1);
    assert!(rt.block_on(one.check(late + interval, &check)).unwrap()[0].allowed);
    assert_eq!(one.stats().synced_local, 10);
    // The first decision charged the store itself, the nine local ones came with the sync.
    let read = store.check_all(
        late,
        &[Check::new(
            &limit.with_consistency(Consistency::Exact),
            "k",
            0,
        )],
    );
    assert_eq!(read[0].remaining, 1_000 - 10);
}

/// Four instances under a steady 2× the limit (1,000 a second, windows of a second, a
/// sync every 100 ms): each reads every active key's count at every sync and counts the
/// others' admissions at the rate it last saw, so each window stops close to the limit.
/// (Reading only the keys it pushed, an instance decided on counts up to a window old,
/// and counting none of the others' admissions since its last read, each window went
/// over by what they admit in an interval: a quarter of the limit here.)
#[test]
fn synced_instances_stop_close_to_the_limit_under_steady_load() {
    let rt = runtime();
    let interval = 100 * MS;
    let limit = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
        1_000,
        Duration::from_secs(1),
    )))
    .unwrap()
    .with_consistency(Consistency::Synced { interval });
    let store = Arc::new(MemoryStore::new());
    let instances: Vec<_> = (0..4).map(|_| ScaleOut::new(Arc::clone(&store))).collect();
    let start: Nanos = 1_000_000 * 1_000 * MS;
    let mut per_window = std::collections::BTreeMap::<u64, u64>::new();
    // 2,000 a second: a request every 500 µs, round robin; the sync task's tick is a
    // quarter interval.
    for step in 0..20_000u64 {
        let now = start + step * MS / 2;
        if step % 50 == 0 {
            for i in &instances {
                rt.block_on(i.sync(now)).unwrap();
            }
        }
        let i = &instances[(step % 4) as usize];
        let d = rt
            .block_on(i.check(now, &[Check::new(&limit, "k", 1)]))
            .unwrap();
        if d[0].allowed {
            *per_window.entry(step / 2_000).or_default() += 1;
        }
    }
    let worst = per_window.values().max().copied().unwrap_or(0);
    let least = per_window.values().min().copied().unwrap_or(0);
    eprintln!("per window: {per_window:?}");
    assert!(worst <= 1_010, "over by more than 1 %: {per_window:?}");
    assert!(least >= 990, "under by more than 1 %: {per_window:?}");
}

/// Units a synced instance admitted in a window that has ended are not pushed into the
/// next one (they would be charged to it).
#[test]
fn a_finished_windows_synced_units_are_not_charged_to_the_next() {
    let rt = runtime();
    let interval = 100 * MS;
    let limit = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
        100,
        Duration::from_secs(1),
    )))
    .unwrap()
    .with_consistency(Consistency::Synced { interval });
    let store = Arc::new(MemoryStore::new());
    let one = ScaleOut::new(Arc::clone(&store));
    let second: Nanos = 1_000 * MS;
    let start = 1_000_000 * second;
    let check = [Check::new(&limit, "k", 1)];
    // The first decision reads the key in the store; five more stay pending.
    for n in 0..6 {
        let now = start + 900 * MS + n * MS;
        assert!(rt.block_on(one.check(now, &check)).unwrap()[0].allowed);
    }
    // The next sync comes after the window ended.
    rt.block_on(one.sync(start + second + 50 * MS)).unwrap();
    let plain = limit.with_consistency(Consistency::Exact);
    let read = store.check_all(start + second + 60 * MS, &[Check::new(&plain, "k", 0)]);
    assert_eq!(read[0].remaining, 100, "nothing charged to the new window");
}

/// A cold key on a bucket costs one store call per decision, as `exact` does: the
/// request that takes a one-unit lease spends it at once.
#[test]
fn a_cold_bucket_key_costs_one_call_per_decision() {
    let rt = runtime();
    let limit = Limit::new(Algorithm::TokenBucket(TokenBucket::new(
        1_000,
        Duration::from_secs(1),
    )))
    .unwrap()
    .with_consistency(Consistency::Leased { period: 10 * MS });
    let store = Arc::new(Counting::default());
    let one = ScaleOut::new(Arc::clone(&store));
    let start: Nanos = 1_000_000 * 1_000 * MS;
    // One decision every 100 ms: the bucket is full each time.
    for n in 0..20 {
        let d = rt
            .block_on(one.check(start + n * 100 * MS, &[Check::new(&limit, "k", 1)]))
            .unwrap();
        assert!(d[0].allowed);
    }
    assert_eq!(store.calls.load(Ordering::Relaxed), 20);
}

/// Near a fixed window's end a lease is sized for what is left of the window, not for a
/// whole lease period: what is in hand when the window ends is small.
#[test]
fn a_lease_near_a_windows_end_covers_only_its_rest() {
    let rt = runtime();
    let limit = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
        100_000,
        Duration::from_secs(1),
    )))
    .unwrap()
    .with_consistency(Consistency::Leased { period: 500 * MS });
    let store = Arc::new(MemoryStore::new());
    let one = ScaleOut::new(Arc::clone(&store));
    let start: Nanos = 1_000_000 * 1_000 * MS;
    // 10 a millisecond: a lease period's worth would be 5,000.
    let mut now = start;
    while now < start + 995 * MS {
        rt.block_on(one.check(now, &[Check::new(&limit, "k", 1)]))
            .unwrap();
        now += MS / 10;
    }
    let in_hand = one.units_in_hand(now);
    assert!(
        in_hand <= 200,
        "{in_hand} units in hand 5 ms before the window ends"
    );
}

/// A burst on a synced key after a pause: the instance's count is older than the
/// others' admissions meanwhile, so the burst's first decision is made in the store and
/// the key is counted again from its answer. (Sending only that first decision to the
/// store and deciding the rest of the burst on the old count, an instance admitted the
/// burst past the limit the others had reached.)
#[test]
fn a_synced_burst_after_a_pause_does_not_pass_the_limit() {
    let rt = runtime();
    let interval = 100 * MS;
    let limit = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
        100,
        Duration::from_secs(60),
    )))
    .unwrap()
    .with_consistency(Consistency::Synced { interval });
    let store = Arc::new(MemoryStore::new());
    let a = ScaleOut::new(Arc::clone(&store));
    let b = ScaleOut::new(Arc::clone(&store));
    let start: Nanos = 60_000 * 1_000 * MS;
    let check = [Check::new(&limit, "k", 1)];
    let mut admitted = 0u64;
    let sync_both = |until: Nanos, from: Nanos| {
        let mut t = from;
        while t <= until {
            rt.block_on(a.sync(t)).unwrap();
            rt.block_on(b.sync(t)).unwrap();
            t += interval / 4;
        }
    };
    // A admits once, then goes quiet.
    admitted += u64::from(rt.block_on(a.check(start, &check)).unwrap()[0].allowed);
    sync_both(start + 300 * MS, start);
    // B spends the rest of the window while A does not read the key.
    let mut now = start + 300 * MS;
    for _ in 0..150 {
        now += MS;
        admitted += u64::from(rt.block_on(b.check(now, &check)).unwrap()[0].allowed);
        if now % (interval / 4) == 0 {
            rt.block_on(a.sync(now)).unwrap();
            rt.block_on(b.sync(now)).unwrap();
        }
    }
    sync_both(start + 700 * MS, now);
    // A burst of 50 on A at one instant, after its pause.
    let burst = start + 750 * MS;
    for _ in 0..50 {
        admitted += u64::from(rt.block_on(a.check(burst, &check)).unwrap()[0].allowed);
    }
    for i in [&a, &b] {
        rt.block_on(i.flush(burst)).unwrap();
    }
    let plain = limit.with_consistency(Consistency::Exact);
    let read = store.check_all(burst, &[Check::new(&plain, "k", 0)]);
    eprintln!(
        "admitted {admitted}, the store has {} left",
        read[0].remaining
    );
    assert!(
        admitted <= 100 + 2,
        "the burst passed the limit: {admitted}"
    );
    assert!(admitted >= 98, "{admitted}");
}

/// Four instances under a steady 2× the limit (1,000 a second, windows of a second, a
/// sync every 100 ms), each request sent to an instance drawn at random and each
/// instance's sync task ticking every quarter interval at a phase of its own: between
/// reads, each admits at most its share of the room it last saw (its share learned from
/// its own pushes against what the room lost), so the fleet together stops within 1 %
/// of the limit in every window, and close to it.
#[test]
fn synced_instances_keep_to_their_share_of_the_room() {
    let rt = runtime();
    let interval = 100 * MS;
    let limit = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
        1_000,
        Duration::from_secs(1),
    )))
    .unwrap()
    .with_consistency(Consistency::Synced { interval });
    let store = Arc::new(MemoryStore::new());
    let instances: Vec<_> = (0..4).map(|_| ScaleOut::new(Arc::clone(&store))).collect();
    let start: Nanos = 1_000_000 * 1_000 * MS;
    let tick = interval / 4;
    let mut rng = Rng(7);
    let mut next: Vec<Nanos> = (0..4).map(|_| start + rng.below(tick)).collect();
    let mut per_window = std::collections::BTreeMap::<u64, u64>::new();
    let windows = 20u64;
    // 2,000 a second: a request every 500 µs.
    for step in 0..windows * 2_000 {
        let now = start + step * MS / 2;
        // The instances' ticks due by now, in time order.
        while let Some((k, at)) = next
            .iter()
            .copied()
            .enumerate()
            .filter(|&(_, at)| at <= now)
            .min_by_key(|&(k, at)| (at, k))
        {
            rt.block_on(instances[k].sync(at)).unwrap();
            next[k] = at + tick;
        }
        let i = &instances[rng.below(4) as usize];
        let d = rt
            .block_on(i.check(now, &[Check::new(&limit, "k", 1)]))
            .unwrap();
        if d[0].allowed {
            *per_window.entry(step / 2_000).or_default() += 1;
        }
    }
    eprintln!("per window: {per_window:?}");
    // The first windows teach each instance its share.
    let settled: Vec<u64> = per_window.range(2..).map(|(_, &n)| n).collect();
    let worst = settled.iter().max().copied().unwrap_or(0);
    let least = settled.iter().min().copied().unwrap_or(0);
    assert!(worst <= 1_010, "over by more than 1 %: {per_window:?}");
    assert!(least >= 970, "under by more than 3 %: {per_window:?}");
}
