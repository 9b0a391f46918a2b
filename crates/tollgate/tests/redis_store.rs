//! The Redis store against a real `redis-server` started on a free port: differential
//! tests against the in-memory store (same random traces, identical decisions), script
//! reloading, TTLs, the blocked-key cache, and a 3-master Redis Cluster.
#![allow(clippy::unwrap_used)]

#[path = "support/minute.rs"]
mod minute;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use redis_server::{command, RedisCluster, RedisServer};
use tollgate::algorithm::{
    Algorithm, FixedWindow, Gcra, LeakyBucket, LeakyMode, Limit, SlidingLog, SlidingWindow,
    TokenBucket,
};
use tollgate::decision::{Decision, NEVER};
use tollgate::store::{
    ChargeRejected, Check, MemoryStore, RedisStore, RedisStoreBuilder, ScriptCall, Store,
    TimeSource,
};

const T0: u64 = 1_700_000_000_123_456_789;
const S: u64 = 1_000_000_000;
/// The deadline of stores in tests that are not about deadlines: long enough that a
/// busy CI machine stalling a call for a while does not turn into a failure.
const SLOW_MACHINE: Duration = Duration::from_secs(2);

/// Connects `builder`'s store with the [`SLOW_MACHINE`] deadline.
fn slow_machine_store(rt: &tokio::runtime::Runtime, builder: RedisStoreBuilder) -> RedisStore {
    rt.block_on(builder.deadline(SLOW_MACHINE).connect())
        .unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A runtime whose tasks run on both cores, for concurrent requests.
fn two_threads() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A plain connection to `server` (for commands the store does not send).
fn connection(
    rt: &tokio::runtime::Runtime,
    server: &RedisServer,
) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(server.url()).unwrap();
    rt.block_on(client.get_multiplexed_async_connection())
        .unwrap()
}

static PREFIX: AtomicU64 = AtomicU64::new(0);

/// A store on `url` taking the caller's time, with a long TTL slack (Redis must not
/// expire keys by its own clock while the test's clock runs differently).
fn caller_time_store(rt: &tokio::runtime::Runtime, url: &str) -> RedisStore {
    caller_time_store_with(rt, url, true)
}

/// [`caller_time_store`], calling the scripts as Redis Functions or not (`EVALSHA`).
fn caller_time_store_with(rt: &tokio::runtime::Runtime, url: &str, functions: bool) -> RedisStore {
    let prefix = format!("t{}", PREFIX.fetch_add(1, Ordering::Relaxed));
    slow_machine_store(
        rt,
        RedisStore::builder(url)
            .prefix(prefix)
            .time_source(TimeSource::Caller)
            .ttl_slack(Duration::from_secs(3_600))
            .blocked_cache(0)
            .functions(functions),
    )
}

#[derive(Debug, Clone)]
struct Req {
    /// Nanoseconds since the previous request; negative when the caller's clock steps back.
    advance: i64,
    /// (limit, key, cost, shadow, quota group, charge_rejected)
    checks: Vec<(usize, usize, u64, bool, Option<u32>, ChargeRejected)>,
}

/// A check of a trace.
fn check_of<'a>(
    limits: &'a [Limit],
    key: &'a str,
    &(l, _, cost, shadow, quota, charge): &(usize, usize, u64, bool, Option<u32>, ChargeRejected),
) -> Check<'a> {
    Check {
        limit: &limits[l],
        key: key.as_bytes(),
        cost,
        shadow,
        quota,
        charge,
    }
}

fn window() -> impl Strategy<Value = Duration> {
    prop_oneof![
        Just(Duration::from_secs(1)),
        Just(Duration::from_secs(10)),
        Just(Duration::from_secs(60)),
        Just(Duration::from_secs(3_600)),
        Just(Duration::from_secs(86_400)),
        Just(Duration::from_millis(1_500)),
        Just(Duration::from_nanos(1_234_567_891)),
    ]
}

fn limit() -> impl Strategy<Value = Limit> {
    // Small limits reach their edges within a trace; large ones (up to 20,000 a day)
    // exercise the scripts' wide arithmetic.
    let n = prop_oneof![3 => 0u64..12, 1 => 1_000u64..20_000];
    // A third of the token buckets and GCRAs may go into debt (`overdraft`), and of
    // the others a half warm up (`warmup`, in ns: from a few intervals to minutes).
    let overdraft = prop_oneof![2 => Just(0u64), 1 => 1u64..10];
    let warmup = prop_oneof![
        1 => Just(0u64),
        1 => 1_000_000u64..120_000_000_000,
        1 => Just(30 * S),
    ];
    (
        0u8..7,
        n,
        window(),
        1u64..15,
        (overdraft, warmup),
        any::<bool>(),
    )
        .prop_map(|(alg, n, w, burst, (over, warm), lock)| {
            let warm = if over > 0 { 0 } else { warm };
            let warm = Duration::from_nanos(warm);
            let algorithm = match alg {
                0 => Algorithm::FixedWindow(FixedWindow::new(n, w)),
                1 => Algorithm::SlidingWindow(SlidingWindow::new(n, w)),
                2 => Algorithm::SlidingLog(SlidingLog::new(n, w)),
                3 => Algorithm::TokenBucket(
                    TokenBucket::new(n, w)
                        .with_burst(burst)
                        .with_overdraft(over)
                        .with_warmup(warm),
                ),
                4 => Algorithm::Gcra(
                    Gcra::new(n, w)
                        .with_burst(burst)
                        .with_overdraft(over)
                        .with_warmup(warm),
                ),
                5 => Algorithm::LeakyBucket(
                    LeakyBucket::new(n, w, LeakyMode::Meter).with_burst(burst),
                ),
                _ => Algorithm::LeakyBucket(
                    LeakyBucket::new(n, w, LeakyMode::Queue).with_burst(burst),
                ),
            };
            // A warm-up too long for its rate is refused: such a limit goes without it.
            let algorithm = match algorithm {
                Algorithm::TokenBucket(t) if Limit::new(algorithm).is_err() => {
                    Algorithm::TokenBucket(t.with_warmup(Duration::ZERO))
                }
                Algorithm::Gcra(g) if Limit::new(algorithm).is_err() => {
                    Algorithm::Gcra(g.with_warmup(Duration::ZERO))
                }
                a => a,
            };
            let l = Limit::new(algorithm).unwrap();
            if lock {
                l.with_lockout(Duration::from_secs(5))
            } else {
                l
            }
        })
}

/// `Req::advance` meaning "to the next whole hour".
const TO_NEXT_HOUR: i64 = i64::MAX;

fn trace(limits: usize) -> impl Strategy<Value = Vec<Req>> {
    let advance = prop_oneof![
        Just(0i64),
        0i64..1_000,
        0i64..50_000_000,
        0i64..2 * S as i64,
        0i64..90 * S as i64,
        -(2 * S as i64)..0,
        Just(TO_NEXT_HOUR),
    ];
    // Large costs fill large limits, so the scripts' wide products (count x window
    // beyond 2^53) are taken.
    let cost = prop_oneof![7 => 0u64..4, 1 => 100u64..6_000];
    let charge = prop_oneof![
        6 => Just(ChargeRejected::None),
        1 => Just(ChargeRejected::OverLimit),
        1 => Just(ChargeRejected::All),
    ];
    let check = (
        0..limits,
        0usize..2,
        cost,
        prop::bool::weighted(0.15),
        prop_oneof![8 => Just(None), 1 => Just(Some(0)), 1 => Just(Some(1))],
        charge,
    );
    prop::collection::vec(
        (advance, prop::collection::vec(check, 1..4))
            .prop_map(|(advance, checks)| Req { advance, checks }),
        1..40,
    )
}

/// The two keys of the differential traces (one needs escaping).
const KEYS: [&str; 2] = ["alice", "b{o}b:_ é"];

/// Runs the same trace on both stores and requires identical decisions.
fn differential(
    rt: &tokio::runtime::Runtime,
    url: &str,
    functions: bool,
    limits: &[Limit],
    reqs: &[Req],
) -> Result<(), TestCaseError> {
    differential_on(rt, url, functions, KEYS, limits, reqs)
}

/// [`differential`] with the trace's two keys.
fn differential_on(
    rt: &tokio::runtime::Runtime,
    url: &str,
    functions: bool,
    keys: [&str; 2],
    limits: &[Limit],
    reqs: &[Req],
) -> Result<(), TestCaseError> {
    // The same times in both: no monotonic clamp (the trace steps the clock back).
    let memory = MemoryStore::builder().monotonic(false).build();
    let redis = caller_time_store_with(rt, url, functions);
    let mut now = T0;
    for (step, r) in reqs.iter().enumerate() {
        now = if r.advance == TO_NEXT_HOUR {
            // Exactly on a window's start, where a sliding window's previous count
            // weighs in whole.
            (now / (3_600 * S) + 1) * 3_600 * S
        } else {
            now.saturating_add_signed(r.advance)
        };
        let checks: Vec<Check<'_>> = r
            .checks
            .iter()
            .map(|c| check_of(limits, keys[c.1], c))
            .collect();
        let expected = memory.check_all(now, &checks);
        let got: Vec<Decision> = rt.block_on(redis.check(now, &checks)).unwrap();
        prop_assert_eq!(
            &got,
            &expected,
            "step {} at T0+{}ns, checks {:?}, limits {:?}",
            step,
            now as i128 - T0 as i128,
            r.checks,
            limits
        );
    }
    Ok(())
}

/// Runs `cases` random traces of limits computed at 1 ns (every window up to a day
/// with burst x window / gcd(limit, window) below 2^51; coarser ticks are another
/// test's) through [`differential`] on `server`, calling the scripts as functions or not.
fn differential_traces(server: &RedisServer, functions: bool, cases: u32) {
    differential_traces_on(&server.url(), functions, KEYS, cases);
}

/// [`differential_traces`] on the Redis (or Redis Cluster) at `url`, with these keys.
fn differential_traces_on(url: &str, functions: bool, keys: [&str; 2], cases: u32) {
    let rt = runtime();
    // PROPTEST_CASES, when set, runs more (or fewer) traces, to hunt rare differences.
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    let mut runner = TestRunner::new(Config {
        cases,
        ..Config::default()
    });
    let exact = limit().prop_filter("computed at 1 ns", |l| RedisStore::tick_for(l) == Some(1));
    let strategy = prop::collection::vec(exact, 1..4).prop_flat_map(|limits| {
        let n = limits.len();
        (Just(limits), trace(n))
    });
    runner
        .run(&strategy, |(limits, reqs)| {
            differential_on(&rt, url, functions, keys, &limits, &reqs)
        })
        .unwrap();
}

#[test]
fn the_scripts_decide_exactly_what_the_in_memory_store_decides() {
    let server = RedisServer::start();
    differential_traces(&server, true, 160);
    // Every call went through the function library (Redis 7): that path was tested.
    assert!(server.calls("fcall") > 100, "decided by FCALL");
    assert_eq!(server.calls("evalsha"), 0, "no call fell back to EVALSHA");
}

/// The same differential test through `EVALSHA` (the path for Redis 6, or an ACL that
/// forbids functions): the same decisions.
#[test]
fn without_functions_the_scripts_decide_the_same_through_evalsha() {
    let server = RedisServer::start();
    differential_traces(&server, false, 48);
    assert!(server.calls("evalsha") > 30, "decided by EVALSHA");
    assert_eq!(
        server.calls("fcall"),
        0,
        "functions(false) never calls FCALL"
    );
}

/// The library of every set of algorithms loads (a library may reach no global but
/// `redis` while it loads, which `EVAL` scripts never noticed), under its own name.
#[test]
fn every_algorithm_set_loads_as_a_function_library() {
    let server = RedisServer::start();
    let rt = runtime();
    let mut conn = connection(&rt, &server);
    let names = tollgate::store::SCRIPT_ALGORITHMS;
    let mut functions = std::collections::HashSet::new();
    for mask in 1u8..64 {
        let set: Vec<&str> = (0..6)
            .filter(|i| mask & (1 << i) != 0)
            .map(|i| names[i])
            .collect();
        let (function, library) = tollgate::store::script_library(&set).unwrap();
        let loaded: String = rt
            .block_on(
                redis::cmd("FUNCTION")
                    .arg("LOAD")
                    .arg("REPLACE")
                    .arg(&library)
                    .query_async(&mut conn),
            )
            .unwrap_or_else(|e| panic!("{set:?}: {e}"));
        assert_eq!(loaded, function, "{set:?}");
        functions.insert(function);
    }
    assert_eq!(functions.len(), 63, "one function per set");
}

/// Runs a [`ScriptCall`] as the store would (`EVALSHA`, loading the script when Redis
/// does not have it) and reads its answers.
fn run_call(
    rt: &tokio::runtime::Runtime,
    conn: &mut redis::aio::MultiplexedConnection,
    call: &ScriptCall,
) -> Vec<i64> {
    let script = redis::Script::new(&call.source);
    let mut invocation = script.prepare_invoke();
    for a in &call.args {
        invocation.arg(a.as_slice());
    }
    for k in &call.keys {
        invocation.key(k);
    }
    let reply: Vec<u8> = rt.block_on(invocation.invoke_async(conn)).unwrap();
    ScriptCall::answers(&reply).unwrap()
}

/// The requests of a trace in script calls of several, as the batcher sends them
/// ([`ScriptCall::batch`]: every state read up front with one `MGET`; a request that
/// shares a key with an earlier one in the call reads it again; one request's fast
/// path failing stops nothing): the same decisions as the in-memory store deciding the
/// requests one after another. Mostly lone checks (the fast paths) on four keys, so
/// that calls hold both fresh keys and repeated ones.
#[test]
fn batched_calls_decide_exactly_what_the_in_memory_store_decides() {
    let server = RedisServer::start();
    let rt = runtime();
    let conn = connection(&rt, &server);
    let mut runner = TestRunner::new(Config {
        cases: 120,
        ..Config::default()
    });
    let exact = limit().prop_filter("computed at 1 ns", |l| RedisStore::tick_for(l) == Some(1));
    let strategy = prop::collection::vec(exact, 1..4).prop_flat_map(|limits| {
        let n = limits.len();
        let per_request = (0usize..2, prop::bool::weighted(0.7));
        (
            Just(limits),
            trace(n),
            prop::collection::vec(per_request, 40),
            prop::collection::vec(1usize..9, 40),
        )
    });
    let keys = ["alice", "b{o}b:_ é", "carol", "dave"];
    runner
        .run(&strategy, |(limits, reqs, per_request, sizes)| {
            let memory = MemoryStore::builder().monotonic(false).build();
            let mut conn = conn.clone();
            let prefix = format!("b{}", PREFIX.fetch_add(1, Ordering::Relaxed));
            // Each request's time and checks, as `differential` steps them.
            let mut now = T0;
            let mut requests: Vec<(u64, Vec<Check<'_>>)> = Vec::new();
            for (r, &(high, lone)) in reqs.iter().zip(&per_request) {
                now = if r.advance == TO_NEXT_HOUR {
                    (now / (3_600 * S) + 1) * 3_600 * S
                } else {
                    now.saturating_add_signed(r.advance)
                };
                let n = if lone { 1 } else { r.checks.len() };
                let checks = r.checks[..n]
                    .iter()
                    .map(|c| check_of(&limits, keys[c.1 + 2 * high], c))
                    .collect();
                requests.push((now, checks));
            }
            let mut rest = requests.as_slice();
            for &size in sizes.iter().cycle() {
                if rest.is_empty() {
                    break;
                }
                let (batch, later) = rest.split_at(size.min(rest.len()));
                rest = later;
                let call = ScriptCall::batch(
                    &prefix,
                    Duration::from_secs(3_600),
                    batch
                        .iter()
                        .map(|(now, checks)| (Some(*now), checks.as_slice())),
                )
                .unwrap();
                let mut answers = run_call(&rt, &mut conn, &call).into_iter();
                for (now, checks) in batch {
                    let expected = memory.check_all(*now, checks);
                    // At 1 ns ticks the answers are the decision's own numbers.
                    let got: Vec<Decision> = checks
                        .iter()
                        .map(|c| {
                            let v: Vec<i64> = answers.by_ref().take(5).collect();
                            let ns = |t: i64| u64::try_from(t).unwrap();
                            let mut d = if v[0] == 1 {
                                Decision::allow(c.limit.limit(), ns(v[1]), ns(v[2]))
                            } else {
                                let retry = if v[3] < 0 { NEVER } else { ns(v[3]) };
                                Decision::reject(c.limit.limit(), ns(v[1]), ns(v[2]), retry)
                            };
                            // A delay of -1 flags an overdraft admission.
                            d.overdraft = v[0] == 1 && v[4] == -1;
                            d.delay = if d.overdraft { 0 } else { ns(v[4]) };
                            d
                        })
                        .collect();
                    prop_assert_eq!(
                        &got,
                        &expected,
                        "at T0+{}ns, batch of {}, checks {:?}",
                        *now as i128 - T0 as i128,
                        batch.len(),
                        checks
                    );
                }
            }
            Ok(())
        })
        .unwrap();
}

/// A call whose answer holds more than 1,000 numbers (the script packs its answer 1,000
/// numbers at a time: they pass through Lua's stack): every request still gets its own
/// decision, the same as the in-memory store's, in order.
#[test]
fn a_call_with_a_long_answer_is_answered_whole_and_in_order() {
    let server = RedisServer::start();
    let rt = runtime();
    let mut conn = connection(&rt, &server);
    let prefix = format!("long{}", PREFIX.fetch_add(1, Ordering::Relaxed));
    let small = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
        2,
        Duration::from_secs(60),
    )))
    .unwrap();
    let big = Limit::new(Algorithm::TokenBucket(TokenBucket::new(
        1_000,
        Duration::from_secs(60),
    )))
    .unwrap();
    let keys: Vec<String> = (0..40).map(|i| format!("k{i}")).collect();
    // 120 requests of two checks over 40 keys: six numbers per check, 1,440 in all; the
    // third request of a key is over the small limit.
    let requests: Vec<Vec<Check<'_>>> = (0..120)
        .map(|i| {
            let key = keys[i % keys.len()].as_bytes();
            vec![Check::new(&small, key, 1), Check::new(&big, key, 1)]
        })
        .collect();
    let call = ScriptCall::batch(
        &prefix,
        Duration::from_secs(3_600),
        requests.iter().map(|checks| (Some(T0), checks.as_slice())),
    )
    .unwrap();
    let answers = run_call(&rt, &mut conn, &call);
    assert_eq!(answers.len(), 120 * 2 * 5, "five numbers per check");
    let memory = MemoryStore::builder().monotonic(false).build();
    let mut admitted = 0;
    for (i, (checks, got)) in requests.iter().zip(answers.chunks(10)).enumerate() {
        let expected = memory.check_all(T0, checks);
        let allowed: Vec<bool> = got.chunks(5).map(|v| v[0] == 1).collect();
        let remaining: Vec<u64> = got.chunks(5).map(|v| v[1] as u64).collect();
        assert_eq!(
            allowed,
            expected.iter().map(|d| d.allowed).collect::<Vec<_>>(),
            "request {i}"
        );
        assert_eq!(
            remaining,
            expected.iter().map(|d| d.remaining).collect::<Vec<_>>(),
            "request {i}"
        );
        admitted += usize::from(allowed[0]);
    }
    assert_eq!(
        admitted,
        2 * keys.len(),
        "two per key under the small limit"
    );
}

/// A request of one check without lockout takes the script's fast path for its
/// algorithm (`ALONE` in `lua/fixed_window.lua`, `sliding_window.lua`,
/// `token_bucket.lua`, `gcra.lua`, `leaky_bucket.lua`: no undo log, few or no tables):
/// it must decide exactly as the general path and the in-memory store do.
#[test]
fn lone_checks_take_the_fast_path_and_decide_the_same() {
    let server = RedisServer::start();
    let rt = runtime();
    let mut runner = TestRunner::new(Config {
        cases: 160,
        ..Config::default()
    });
    let lone = limit().prop_filter("exact at 1 ns, no lockout", |l| {
        l.lockout().is_none() && RedisStore::tick_for(l) == Some(1)
    });
    let one_check = trace(1).prop_map(|reqs| {
        reqs.into_iter()
            .map(|mut r| {
                r.checks.truncate(1);
                r
            })
            .collect::<Vec<_>>()
    });
    runner
        .run(&(lone, one_check), |(limit, reqs)| {
            differential(&rt, &server.url(), true, &[limit], &reqs)
        })
        .unwrap();
}

/// Limits too large for 1 ns ticks (a month or a year, or an odd limit per hour with a
/// big burst): on traces at whole microseconds, the scripts admit exactly what the
/// in-memory store admits, and round durations up to their tick.
#[test]
fn coarse_ticks_admit_the_same_and_round_durations_up_to_the_tick() {
    let server = RedisServer::start();
    let rt = runtime();
    let mut runner = TestRunner::new(Config {
        cases: 48,
        ..Config::default()
    });
    let coarse = (0u8..4, 1u64..50, 0usize..5).prop_map(|(alg, n, wi)| {
        let w = [
            Duration::from_secs(30 * 86_400),
            Duration::from_secs(365 * 86_400),
            Duration::from_secs(86_400),
            Duration::from_secs(3_600),
            Duration::from_secs(365 * 86_400),
        ][wi];
        let n = match wi {
            // A huge yearly bucket: only a 1 s tick keeps it exact.
            4 => 1_000_003 + n,
            _ if w.as_secs() <= 86_400 => 99_991 + n,
            _ => n,
        };
        let a = match alg {
            0 => Algorithm::FixedWindow(FixedWindow::new(n, w)),
            1 => Algorithm::SlidingWindow(SlidingWindow::new(n, w)),
            2 => Algorithm::TokenBucket(TokenBucket::new(n, w).with_overdraft(n % 4)),
            _ => Algorithm::Gcra(Gcra::new(n, w).with_overdraft(n % 4)),
        };
        Limit::new(a).unwrap()
    });
    let coarse = coarse.prop_filter("coarser than 1 ns", |l| {
        RedisStore::tick_for(l).is_some_and(|t| t > 1)
    });
    let steps = prop::collection::vec((0u64..10_000_000, 0u64..3), 1..40);
    runner
        .run(&(coarse, steps), |(limit, steps)| {
            let tick = RedisStore::tick_for(&limit).unwrap();
            let memory = MemoryStore::new();
            let redis = caller_time_store(&rt, &server.url());
            let mut now = T0 - T0 % tick;
            for (advance_us, cost) in steps {
                now += advance_us * 1_000 * (limit.window() / 1_000_000_000_000).max(1);
                now -= now % tick;
                let checks = [Check::new(&limit, "k", cost)];
                let want = memory.check_all(now, &checks)[0];
                let got = rt.block_on(redis.check(now, &checks)).unwrap()[0];
                prop_assert_eq!(
                    (got.allowed, got.remaining, got.overdraft),
                    (want.allowed, want.remaining, want.overdraft),
                    "{:?}",
                    limit
                );
                for (g, w) in [
                    (got.reset_after, want.reset_after),
                    (got.retry_after, want.retry_after),
                ] {
                    prop_assert!(
                        g >= w && g - w < tick || g == w,
                        "{} vs {} at tick {} ({:?})",
                        g,
                        w,
                        tick,
                        limit
                    );
                }
            }
            Ok(())
        })
        .unwrap();
}

fn gcra(limit: u64, window: Duration) -> Limit {
    Limit::new(Algorithm::Gcra(Gcra::new(limit, window))).unwrap()
}

#[test]
fn scripts_are_loaded_again_after_a_flush_and_a_restart() {
    for functions in [true, false] {
        let mut server = RedisServer::start();
        let rt = runtime();
        let store = slow_machine_store(&rt, RedisStore::builder(server.url()).functions(functions));
        let l = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
            100,
            Duration::from_secs(3_600),
        )))
        .unwrap();
        let one = [Check::new(&l, "k", 1)];
        assert!(rt.block_on(store.check(0, &one)).unwrap()[0].allowed);
        let flush = if functions {
            "FUNCTION FLUSH"
        } else {
            "SCRIPT FLUSH"
        };
        assert!(command(server.port, flush).unwrap().starts_with("+OK"));
        let d = rt.block_on(store.check(0, &one)).unwrap();
        assert_eq!((d[0].allowed, d[0].remaining), (true, 98), "{flush}");
        if functions {
            // Loaded on the first call, then again after the flush.
            assert_eq!(server.calls("function|load"), 2);
            assert_eq!(server.calls("evalsha"), 0);
        } else {
            assert_eq!(server.calls("fcall"), 0);
        }
        server.restart();
        let start = std::time::Instant::now();
        let back = loop {
            if let Ok(d) = rt.block_on(store.check(0, &one)) {
                break d;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "Redis not used again within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(
            back[0].remaining, 99,
            "a restarted, empty Redis starts the key over"
        );
        let used = if functions { "fcall" } else { "evalsha" };
        assert!(server.calls(used) >= 1, "after the restart: {used}");
    }
}

/// A store on `url` (a Redis that cannot run functions for it) notices on its first
/// call, turns to `EVALSHA` for good, and decides exactly as before, with no failure.
fn decides_through_evalsha(server: &RedisServer, url: String) {
    let rt = runtime();
    let store = slow_machine_store(&rt, RedisStore::builder(url).blocked_cache(0));
    let l = fixed(3, Duration::from_secs(3_600));
    let remaining: Vec<(bool, u64)> = (0..4)
        .map(|_| {
            let d = rt
                .block_on(store.check(0, &[Check::new(&l, "k", 1)]))
                .unwrap();
            (d[0].allowed, d[0].remaining)
        })
        .collect();
    assert_eq!(remaining, [(true, 2), (true, 1), (true, 0), (false, 0)]);
    // (The first EVALSHA also counts its NOSCRIPT before redis-rs loads the script.)
    assert!(server.calls("evalsha") >= 4, "every decision by EVALSHA");
    assert_eq!(server.calls("fcall"), 0, "FCALL was refused, not run");
    assert_eq!(store.stats().errors, 0, "the refusal is no failure");
}

/// A Redis whose ACL forbids functions for our user (`NOPERM`).
#[test]
fn an_acl_that_forbids_functions_turns_the_store_to_evalsha() {
    let server = RedisServer::start();
    let reply = command(
        server.port,
        "ACL SETUSER nofn on >secret ~* &* +@all -fcall -fcall_ro -function",
    )
    .unwrap();
    assert!(reply.starts_with("+OK"), "{reply}");
    decides_through_evalsha(
        &server,
        format!("redis://nofn:secret@127.0.0.1:{}", server.port),
    );
}

/// A Redis without functions, as Redis 6 is (`FCALL` and `FUNCTION` renamed away:
/// "unknown command").
#[test]
fn a_redis_without_functions_turns_the_store_to_evalsha() {
    let server = RedisServer::start_with_args(&[
        "--rename-command",
        "FCALL",
        "",
        "--rename-command",
        "FUNCTION",
        "",
    ]);
    decides_through_evalsha(&server, server.url());
}

/// The rules of the warm-up tests: three algorithms, two in one descriptor's list.
const WARM_RULES: &str = "domain: w
descriptors:
  - key: a
    rate_limit: {unit: hour, requests_per_unit: 5, algorithm: gcra}
  - key: b
    rate_limits:
      - {unit: hour, requests_per_unit: 5, algorithm: token_bucket}
      - {unit: day, requests_per_unit: 50}
";

/// The warm-up: `load_scripts` loads a library for every set of the algorithms the rules
/// use (7 for three), which another instance then finds loaded; `connect_this_runtime`
/// makes the current-thread runtime's own connection, and the first request of every
/// set goes through it with no load.
#[test]
fn a_warm_up_loads_every_script_set_and_makes_the_runtimes_connection() {
    let server = RedisServer::start();
    let rules = tollgate::rules::from_str("w.yaml", WARM_RULES).unwrap();
    let sets = RedisStore::script_sets(&rules);
    assert_eq!(sets.len(), 7, "every non-empty subset of three algorithms");
    let rt = runtime();
    let store = slow_machine_store(&rt, RedisStore::builder(server.url()).blocked_cache(0));
    let loaded = rt.block_on(store.load_scripts(&sets)).unwrap();
    assert_eq!((loaded.sets, loaded.new, loaded.functions), (7, 7, true));
    let list = command(server.port, "FUNCTION LIST").unwrap();
    for set in &sets {
        let (name, _) = tollgate::store::script_library(&set.names()).unwrap();
        assert!(list.contains(&name), "{:?} not loaded: {list}", set.names());
    }
    // Another instance (a runtime of its own, dropped with its connection after).
    let elsewhere = runtime();
    let other = slow_machine_store(&elsewhere, RedisStore::builder(server.url()));
    let again = elsewhere.block_on(other.load_scripts(&sets)).unwrap();
    assert_eq!((again.sets, again.new), (7, 0), "found loaded");
    drop((other, elsewhere));
    let before = await_clients(&server, 1);
    assert!(rt.block_on(store.connect_this_runtime()));
    assert_eq!(connected_clients(&server), before + 1, "the runtime's own");
    let loads = server.calls("function|load");
    // One request per set: the rules' limits, in every combination.
    let domain = rules.domain("w").unwrap();
    let limits: Vec<&Limit> = domain
        .rules()
        .iter()
        .flat_map(|r| r.limits.iter().map(|l| &l.limit))
        .collect();
    for (i, set) in sets.iter().enumerate() {
        let key = format!("k{i}");
        let checks: Vec<Check<'_>> = limits
            .iter()
            .filter(|l| {
                tollgate::store::ScriptSet::of([**l])
                    .names()
                    .iter()
                    .all(|n| set.names().contains(n))
            })
            .map(|l| Check::new(l, &key, 1))
            .collect();
        assert_eq!(
            tollgate::store::ScriptSet::of(checks.iter().map(|c| c.limit)),
            *set
        );
        let decided = rt.block_on(store.check(0, &checks)).unwrap();
        assert!(decided.iter().all(|d| d.allowed), "{:?}", set.names());
    }
    assert_eq!(server.calls("function|load"), loads, "no load on first use");
    let clients = command(server.port, "CLIENT LIST").unwrap();
    assert!(
        !clients.contains(" cmd=ping "),
        "the runtime's connection carried the requests: {clients}"
    );
    assert_eq!(store.stats().errors, 0);
}

/// An ACL that lets the store load libraries but not call them (`FCALL` forbidden): the
/// warm-up finds out, turns the store to `EVALSHA` and loads the scripts, so that the
/// first requests find them (no `NOSCRIPT`, no load).
#[test]
fn a_warm_up_turns_to_evalsha_when_fcall_is_forbidden() {
    let server = RedisServer::start();
    let reply = command(
        server.port,
        "ACL SETUSER nofcall on >secret ~* &* +@all -fcall -fcall_ro",
    )
    .unwrap();
    assert!(reply.starts_with("+OK"), "{reply}");
    let url = format!("redis://nofcall:secret@127.0.0.1:{}", server.port);
    let rules = tollgate::rules::from_str("w.yaml", WARM_RULES).unwrap();
    let sets = RedisStore::script_sets(&rules);
    let rt = runtime();
    let store = slow_machine_store(&rt, RedisStore::builder(url).blocked_cache(0));
    let loaded = rt.block_on(store.load_scripts(&sets)).unwrap();
    assert_eq!((loaded.sets, loaded.functions), (7, false));
    let script_loads = server.calls("script|load");
    assert_eq!(script_loads, 7);
    let l = fixed(3, Duration::from_secs(3_600));
    for _ in 0..4 {
        rt.block_on(store.check(0, &[Check::new(&l, "k", 1)]))
            .unwrap();
    }
    assert_eq!(
        server.calls("evalsha"),
        4,
        "one EVALSHA per decision, no NOSCRIPT"
    );
    assert_eq!(
        server.calls("script|load"),
        script_loads,
        "no load on first use"
    );
    assert_eq!(store.stats().errors, 0);
}

#[test]
fn every_key_gets_a_ttl_just_past_the_time_it_matters() {
    minute::away_from_a_minute_boundary(10); // per-minute windows by Redis TIME
    let server = RedisServer::start();
    let rt = runtime();
    let store = slow_machine_store(&rt, RedisStore::builder(server.url()).prefix("ttl"));
    let fixed = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
        5,
        Duration::from_secs(60),
    )))
    .unwrap()
    .with_lockout(Duration::from_secs(900));
    let log = Limit::new(Algorithm::SlidingLog(SlidingLog::new(
        1,
        Duration::from_secs(10),
    )))
    .unwrap();
    let checks = [Check::new(&fixed, "u", 5), Check::new(&log, "u", 1)];
    assert!(rt
        .block_on(store.check(0, &checks))
        .unwrap()
        .iter()
        .all(|d| d.allowed));
    assert!(
        !rt.block_on(store.check(0, &checks[..1])).unwrap()[0].allowed,
        "locks out"
    );
    let keys = command(server.port, "KEYS ttl:*").unwrap();
    let names: Vec<&str> = keys.lines().filter(|l| l.starts_with("ttl:")).collect();
    assert_eq!(names.len(), 4, "state, lockout, log and log meta: {keys}");
    for name in names {
        let ttl: i64 = command(server.port, &format!("PTTL {name}"))
            .unwrap()
            .trim()
            .trim_start_matches(':')
            .parse()
            .unwrap();
        let bound = if name.ends_with(":l") {
            900_002
        } else if name.contains("{") && ttl > 10_002 {
            60_002
        } else {
            10_002
        };
        assert!(ttl > 0 && ttl <= bound, "{name}: PTTL {ttl} ms");
    }
}

/// The lone-check fast paths write the same TTLs as the general path: a fixed window's
/// key lives until its window ends (a second hit in the window keeps that TTL), a
/// bucket's until the instant it is full (or empty) again.
#[test]
fn lone_checks_set_ttls_just_past_the_time_they_matter() {
    minute::away_from_a_minute_boundary(10); // per-minute windows by Redis TIME
    let server = RedisServer::start();
    let rt = runtime();
    let store = slow_machine_store(&rt, RedisStore::builder(server.url()).prefix("lone"));
    let pttl = |name: &str| -> i64 {
        command(server.port, &format!("PTTL {name}"))
            .unwrap()
            .trim()
            .trim_start_matches(':')
            .parse()
            .unwrap()
    };
    let key_of = |runtime_key: &str| -> String {
        let keys = command(server.port, &format!("KEYS lone:*{runtime_key}*")).unwrap();
        let names: Vec<&str> = keys.lines().filter(|l| l.starts_with("lone:")).collect();
        assert_eq!(names.len(), 1, "one key for {runtime_key}: {keys}");
        names[0].to_string()
    };

    let fixed = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
        5,
        Duration::from_secs(60),
    )))
    .unwrap();
    assert!(
        rt.block_on(store.check(0, &[Check::new(&fixed, "fw", 1)]))
            .unwrap()[0]
            .allowed
    );
    let name = key_of("fw");
    let first = pttl(&name);
    assert!(first > 0 && first <= 60_002, "{name}: PTTL {first} ms");
    let d = rt
        .block_on(store.check(0, &[Check::new(&fixed, "fw", 1)]))
        .unwrap()[0];
    assert!(d.allowed && d.remaining == 3);
    let second = pttl(&name);
    assert!(
        second > 0 && second <= first,
        "the same window keeps its TTL: {first} then {second} ms"
    );

    let gcra = Limit::new(Algorithm::Gcra(Gcra::new(10, Duration::from_secs(10)))).unwrap();
    assert!(
        rt.block_on(store.check(0, &[Check::new(&gcra, "gc", 3)]))
            .unwrap()[0]
            .allowed
    );
    let name = key_of("gc");
    let ttl = pttl(&name);
    assert!(
        ttl > 2_000 && ttl <= 3_002,
        "{name}: PTTL {ttl} ms (3 s of emissions)"
    );

    let bucket = Limit::new(Algorithm::TokenBucket(TokenBucket::new(
        10,
        Duration::from_secs(10),
    )))
    .unwrap();
    assert!(
        rt.block_on(store.check(0, &[Check::new(&bucket, "tb", 2)]))
            .unwrap()[0]
            .allowed
    );
    let name = key_of("tb");
    let ttl = pttl(&name);
    assert!(
        ttl > 1_000 && ttl <= 2_002,
        "{name}: PTTL {ttl} ms (full again in 2 s)"
    );

    // A warm-up's key lives until it is fresh: its bucket full (2.933333334 s after a
    // cold key's first request at 1 per second, warm-up 30 s), the grace of two
    // intervals passed and the key cold again (1 s later): 5.93 s, on the fast path and
    // on the general path (a lockout takes it) alike.
    let warm = Limit::new(Algorithm::Gcra(
        Gcra::new(1, Duration::from_secs(1))
            .with_burst(1)
            .with_warmup(Duration::from_secs(30)),
    ))
    .unwrap();
    let locked = warm
        .with_lockout(Duration::from_secs(1))
        .with_id(warm.id() ^ 1);
    for (limit, key) in [(&warm, "wu"), (&locked, "wl")] {
        assert!(
            rt.block_on(store.check(0, &[Check::new(limit, key, 1)]))
                .unwrap()[0]
                .allowed
        );
        let name = key_of(key);
        let ttl = pttl(&name);
        assert!(
            ttl > 5_000 && ttl <= 5_936,
            "{name}: PTTL {ttl} ms (fresh again in 5.93 s)"
        );
    }
}

#[test]
fn a_hammered_blocked_key_costs_redis_almost_nothing() {
    let server = RedisServer::start();
    let rt = runtime();
    let store = slow_machine_store(&rt, RedisStore::builder(server.url()));
    let l = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
        10,
        Duration::from_secs(3_600),
    )))
    .unwrap();
    let one = [Check::new(&l, "hammered", 1)];
    let mut rejected = 0u64;
    let before = server.script_calls();
    for _ in 0..10_010 {
        let d = rt.block_on(store.check(T0, &one)).unwrap();
        if !d[0].allowed {
            rejected += 1;
            assert!(d[0].retry_after > 0);
        }
    }
    let calls = server.script_calls() - before;
    assert_eq!(rejected, 10_000);
    // 10 admitted + the first rejection reach Redis; the rest are answered locally.
    assert!(
        calls <= 11 + rejected / 100,
        "{calls} Redis calls for {rejected} rejections"
    );
    assert!(store.stats().cache_hits >= 9_900);
}

/// Which of the cluster's masters holds `key`'s slot (a check on `key` names the hash
/// tag `escaped`): the one that answers for it instead of redirecting.
fn master_of(cluster: &RedisCluster, escaped: &str) -> usize {
    let owners: Vec<usize> = (0..cluster.nodes.len())
        .filter(|&i| {
            let reply = command(cluster.nodes[i].port, &format!("EXISTS {{{escaped}}}")).unwrap();
            reply.starts_with(':')
        })
        .collect();
    assert_eq!(owners.len(), 1, "one master owns {escaped}");
    owners[0]
}

/// The differential traces on a 3-master cluster, their two keys on two masters: a
/// request whose checks span both is one script call per master, and where one call
/// rejects, the other's charges are taken back (a second call). The same decisions as
/// the in-memory store, as on a single Redis.
#[test]
fn on_a_cluster_a_request_spanning_slots_decides_exactly_what_the_in_memory_store_decides() {
    let cluster = RedisCluster::start();
    let keys = ["alice", "d{o}b:_ é"];
    assert_ne!(
        master_of(&cluster, "alice"),
        master_of(&cluster, "d%7Bo%7Db%3A_%20%C3%A9"),
        "the keys are on different masters"
    );
    differential_traces_on(&cluster.url(), true, keys, 240);
}

/// A store on `url` taking the caller's time, with a deadline long enough to wait out
/// a paused master.
fn patient_store(rt: &tokio::runtime::Runtime, url: &str) -> RedisStore {
    let prefix = format!("t{}", PREFIX.fetch_add(1, Ordering::Relaxed));
    rt.block_on(
        RedisStore::builder(url)
            .prefix(prefix)
            .time_source(TimeSource::Caller)
            .ttl_slack(Duration::from_secs(3_600))
            .blocked_cache(0)
            .deadline(Duration::from_secs(10))
            .connect(),
    )
    .unwrap()
}

/// What `key` has left under `limit` at `now` (a check of cost 0).
fn left(
    rt: &tokio::runtime::Runtime,
    store: &RedisStore,
    limit: &Limit,
    key: &str,
    now: u64,
) -> u64 {
    rt.block_on(store.check(now, &[Check::new(limit, key, 0)]))
        .unwrap()[0]
        .remaining
}

/// One limit of each algorithm, `n` per hour (the buckets' burst `n` too).
fn every_algorithm(n: u64) -> Vec<Limit> {
    let h = Duration::from_secs(3_600);
    [
        Algorithm::FixedWindow(FixedWindow::new(n, h)),
        Algorithm::SlidingWindow(SlidingWindow::new(n, h)),
        Algorithm::SlidingLog(SlidingLog::new(n, h)),
        Algorithm::TokenBucket(TokenBucket::new(n, h)),
        Algorithm::Gcra(Gcra::new(n, h)),
        Algorithm::LeakyBucket(LeakyBucket::new(n, h, LeakyMode::Meter)),
        Algorithm::LeakyBucket(LeakyBucket::new(n, h, LeakyMode::Queue)),
    ]
    .into_iter()
    .map(|a| Limit::new(a).unwrap())
    .collect()
}

/// Two descriptors whose keys are on two masters, the second rejecting: on a cluster as
/// on a single Redis, the first key is not charged, reports all it has left, and later
/// requests pass.
#[test]
fn a_request_rejected_in_one_slot_leaves_the_other_slot_uncharged() {
    let cluster = RedisCluster::start();
    let single = RedisServer::start();
    assert_ne!(master_of(&cluster, "alice"), master_of(&cluster, "x"));
    let rt = runtime();
    for (l, one) in every_algorithm(3).into_iter().zip(every_algorithm(1)) {
        let mut answers = Vec::new();
        for url in [single.url(), cluster.url()] {
            let store = caller_time_store(&rt, &url);
            let both = [Check::new(&l, "alice", 1), Check::new(&one, "x", 1)];
            let mut seen = Vec::new();
            // The first passes in both slots; then "x" has nothing left.
            let d = rt.block_on(store.check(T0, &both)).unwrap();
            assert!(d[0].allowed && d[1].allowed, "{l:?} on {url}: {d:?}");
            assert_eq!(d[0].remaining, 2);
            for step in 1..=4u64 {
                let d = rt.block_on(store.check(T0 + step, &both)).unwrap();
                assert!(!d[1].allowed, "{l:?} on {url}");
                assert!(d[0].allowed, "{l:?} on {url}");
                assert_eq!(d[0].remaining, 2, "{l:?} on {url}: uncharged, step {step}");
                seen.push(d);
            }
            assert_eq!(left(&rt, &store, &l, "alice", T0 + 5), 2, "{l:?} on {url}");
            let d = rt
                .block_on(store.check(T0 + 6, &[Check::new(&l, "alice", 2)]))
                .unwrap();
            assert!(d[0].allowed, "{l:?} on {url}: the rest passes");
            assert_eq!(d[0].remaining, 0);
            seen.push(d);
            answers.push(seen);
        }
        assert_eq!(
            answers[0], answers[1],
            "{l:?}: the cluster answers as one Redis"
        );
    }
}

/// A refund that finds its key changed by another request since its charge takes back
/// its own charge only: request R charges "alice" on one master while the other master
/// (paused) holds back the answer that rejects it; meanwhile S charges "alice" too.
/// After R's refund "alice" holds exactly what the earlier request and S charged: not
/// R's charge (no refund), and not less (a snapshot put back would lose S's).
#[test]
fn a_refund_after_another_requests_charge_takes_back_only_its_own() {
    let cluster = RedisCluster::start();
    let rt = two_threads();
    let store = patient_store(&rt, &cluster.url());
    let paused = &cluster.nodes[master_of(&cluster, "x")];
    assert_ne!(master_of(&cluster, "alice"), master_of(&cluster, "x"));
    for (l, one) in every_algorithm(10).into_iter().zip(every_algorithm(1)) {
        // An earlier charge of 2, so that the state R finds is not fresh.
        let d = rt
            .block_on(store.check(T0, &[Check::new(&l, "alice", 2)]))
            .unwrap();
        assert!(d[0].allowed);
        command(paused.port, "CLIENT PAUSE 1500 WRITE").unwrap();
        let (r, s) = std::thread::scope(|scope| {
            let r = scope.spawn(|| {
                // A cost above the limit: rejected, nothing charged there.
                let both = [Check::new(&l, "alice", 3), Check::new(&one, "x", 2)];
                rt.block_on(store.check(T0 + 1, &both)).unwrap()
            });
            std::thread::sleep(Duration::from_millis(400));
            let s = rt
                .block_on(store.check(T0 + 2, &[Check::new(&l, "alice", 1)]))
                .unwrap();
            (r.join().unwrap(), s)
        });
        assert!(s[0].allowed, "{l:?}");
        assert_eq!(s[0].remaining, 4, "{l:?}: S found R's charge");
        assert!(!r[1].allowed && r[0].allowed, "{l:?}: {r:?}");
        assert_eq!(
            r[0].remaining, 7,
            "{l:?}: R reports alice without its charge"
        );
        assert_eq!(
            left(&rt, &store, &l, "alice", T0 + 2),
            7,
            "{l:?}: the charges of the earlier request and S stay, R's is gone"
        );
    }
}

/// Many concurrent requests on two keys on two masters, most spanning both: some
/// rejected in one slot, some in the other, their refunds interleaved with other
/// requests' charges. At the end each key holds exactly what the admitted requests
/// charged, as on a single Redis: no charge kept, none given back twice.
#[test]
fn concurrent_requests_spanning_slots_keep_exactly_the_admitted_charges() {
    let cluster = RedisCluster::start();
    let rt = two_threads();
    let store = patient_store(&rt, &cluster.url());
    assert_ne!(master_of(&cluster, "alice"), master_of(&cluster, "x"));
    for (a, b) in every_algorithm(70).into_iter().zip(every_algorithm(45)) {
        let admitted = std::sync::Mutex::new((0u64, 0u64));
        std::thread::scope(|scope| {
            for t in 0..8u64 {
                let (a, b, store, admitted) = (&a, &b, &store, &admitted);
                let rt = &rt;
                scope.spawn(move || {
                    for i in 0..30u64 {
                        let both = [Check::new(a, "alice", 1 + i % 2), Check::new(b, "x", 1)];
                        let request: &[Check<'_>] = match (t + i) % 4 {
                            0 => &both[..1],
                            1 => &both[1..],
                            _ => &both,
                        };
                        let d = rt.block_on(store.check(T0, request)).unwrap();
                        if d.iter().all(|d| d.allowed) {
                            let mut n = admitted.lock().unwrap();
                            for c in request {
                                if c.key == b"alice" {
                                    n.0 += c.cost;
                                } else {
                                    n.1 += c.cost;
                                }
                            }
                        }
                    }
                });
            }
        });
        let (on_a, on_b) = *admitted.lock().unwrap();
        assert!(on_a <= 70 && on_b <= 45, "{a:?}: {on_a}, {on_b}");
        assert!(
            on_a >= 60 && on_b >= 40,
            "{a:?}: both keys filled: {on_a}, {on_b}"
        );
        assert_eq!(left(&rt, &store, &a, "alice", T0), 70 - on_a, "{a:?}");
        assert_eq!(left(&rt, &store, &b, "x", T0), 45 - on_b, "{b:?}");
    }
}

#[test]
fn a_cluster_spreads_keys_over_its_masters_and_stays_exact() {
    let cluster = RedisCluster::start();
    let rt = runtime();
    let store = slow_machine_store(&rt, RedisStore::builder(cluster.url()).blocked_cache(0));
    assert!(store.is_cluster());
    let l = gcra(5, Duration::from_secs(60));
    let window = Limit::new(Algorithm::SlidingWindow(SlidingWindow::new(
        3,
        Duration::from_secs(60),
    )))
    .unwrap();
    for user in 0..60 {
        let key = format!("user{user}");
        let admitted = (0..8)
            .filter(|_| {
                rt.block_on(store.check(0, &[Check::new(&l, &key, 1)]))
                    .unwrap()[0]
                    .allowed
            })
            .count();
        assert_eq!(admitted, 5, "{key}");
    }
    // A request spanning two slots: each slot decided in one call, all admitted.
    let two = [Check::new(&window, "x", 1), Check::new(&window, "y", 1)];
    for _ in 0..3 {
        assert!(rt
            .block_on(store.check(0, &two))
            .unwrap()
            .iter()
            .all(|d| d.allowed));
    }
    assert!(rt
        .block_on(store.check(0, &two))
        .unwrap()
        .iter()
        .all(|d| !d.allowed));
    for node in &cluster.nodes {
        assert!(
            node.dbsize() >= 5,
            "node {} holds {} keys",
            node.port,
            node.dbsize()
        );
    }
}

mod failure_modes {
    use super::*;
    use std::sync::Arc;
    use tollgate::clock::ManualClock;
    use tollgate::limiter::{Code, Limiter, RateLimitRequest};
    use tollgate::rules::{from_str, FailureMode, Rules};

    /// A Redis URL where nothing listens: every call fails with "connection refused".
    fn nowhere() -> String {
        format!("redis://127.0.0.1:{}", redis_server::free_port())
    }

    const RULES: &str = "domain: d
failure_mode: local_fallback
local_fallback_divisor: 2
descriptors:
  - key: open
    failure_mode: fail_open
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: closed
    failure_mode: fail_closed
    rate_limit: {unit: hour, requests_per_unit: 100}
    descriptors:
      - key: nested
        rate_limit: {unit: hour, requests_per_unit: 100}
  - key: local
    rate_limit: {unit: hour, requests_per_unit: 6, algorithm: gcra}
";

    #[test]
    fn each_rule_answers_by_its_own_mode_when_redis_is_unreachable() {
        let set = from_str("d.yaml", RULES).unwrap();
        let rt = runtime();
        let store = rt
            .block_on(
                RedisStore::builder(nowhere())
                    .deadline(Duration::from_millis(50))
                    .connect(),
            )
            .unwrap();
        let limiter = Limiter::new(Arc::new(Rules::fixed(set)), store)
            .with_clock(Arc::new(ManualClock::new(T0)));
        let ask = |k: &str| {
            rt.block_on(limiter.check(&RateLimitRequest::new("d", [vec![(k, "x")]])))
                .unwrap()
        };

        for _ in 0..3 {
            let open = ask("open");
            assert_eq!(
                open.overall,
                Code::Ok,
                "fail_open admits past the limit of 1"
            );
            assert!(open.store_failure.is_some());
            assert_eq!(open.statuses[0].failure_mode, Some(FailureMode::FailOpen));
            let closed = ask("closed");
            assert_eq!(closed.overall, Code::OverLimit);
            assert_eq!(closed.statuses[0].retry_after_secs(), Some(1));
        }
        // Nested descriptors inherit their parent's mode.
        let nested = rt
            .block_on(limiter.check(&RateLimitRequest::new(
                "d",
                [vec![("closed", "x"), ("nested", "y")]],
            )))
            .unwrap();
        assert_eq!(nested.overall, Code::OverLimit);
        // The domain's local_fallback: 6 per hour divided by 2 instances.
        let admitted = (0..10).filter(|_| ask("local").overall == Code::Ok).count();
        assert_eq!(admitted, 3);
        assert!(limiter.store().stats().errors + limiter.store().stats().circuit_open >= 10);
        assert!(
            limiter.store().stats().circuit_opened >= 1,
            "the breaker opened"
        );
    }
}

/// A store for hundreds of requests at once, which its batcher shares out over script
/// calls: no blocked-key cache (every request goes to Redis) and a deadline no busy
/// machine reaches.
/// A store on `server` without the blocked-key cache (every request reaches Redis),
/// answering within `deadline`.
fn uncached_store(
    rt: &tokio::runtime::Runtime,
    server: &RedisServer,
    deadline: Duration,
) -> RedisStore {
    let store = RedisStore::builder(server.url())
        .blocked_cache(0)
        .deadline(deadline)
        .connect();
    rt.block_on(store).unwrap()
}

fn batching_store(
    rt: &tokio::runtime::Runtime,
    server: &RedisServer,
) -> std::sync::Arc<RedisStore> {
    std::sync::Arc::new(uncached_store(rt, server, Duration::from_secs(5)))
}

#[test]
fn concurrent_requests_share_script_calls_and_each_stays_all_or_nothing() {
    let server = RedisServer::start();
    let rt = two_threads();
    let store = batching_store(&rt, &server);
    let hour = Duration::from_secs(3_600);
    let tight = fixed(100, hour);
    let loose = Limit::new(Algorithm::SlidingLog(SlidingLog::new(150, hour))).unwrap();
    let admitted = rt.block_on(async {
        let mut tasks = Vec::new();
        for _ in 0..300 {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                let checks = [
                    Check::new(&tight, "shared", 1),
                    Check::new(&loose, "other", 1),
                ];
                let d = store.check(0, &checks).await.unwrap();
                assert_eq!(d[0].allowed && d[1].allowed, d[0].allowed, "{d:?}");
                d[0].allowed
            }));
        }
        let mut n = 0;
        for t in tasks {
            n += usize::from(t.await.unwrap());
        }
        n
    });
    assert_eq!(admitted, 100);
    let peek = rt
        .block_on(store.check(0, &[Check::new(&loose, "other", 0)]))
        .unwrap();
    assert_eq!(
        peek[0].remaining, 50,
        "only the admitted requests charged the second limit"
    );
    assert!(
        store.stats().calls < 300,
        "{} script calls for 300 requests",
        store.stats().calls
    );
}

/// Lone checks batched into shared script calls under Redis `TIME`: the script unpacks
/// each distinct request once per call and reuses it for the same bytes (same limit,
/// same cost) later in the call. Every algorithm with a fast path, three keys per limit
/// (two at the same cost, whose requests are the same bytes, and one at another
/// cost), all at once: each key admits exactly what its limit holds and is left with
/// exactly the rest.
#[test]
fn batched_lone_checks_of_every_algorithm_stay_exact() {
    minute::away_from_a_minute_boundary(20); // per-minute windows by Redis TIME
    let server = RedisServer::start();
    let rt = two_threads();
    let store = batching_store(&rt, &server);
    let minute = Duration::from_secs(60);
    // Buckets refill one unit every 36 s: none during the test.
    let hour = Duration::from_secs(3_600);
    let limits = std::sync::Arc::new([
        fixed(100, minute),
        Limit::new(Algorithm::SlidingWindow(SlidingWindow::new(100, minute))).unwrap(),
        Limit::new(Algorithm::TokenBucket(TokenBucket::new(100, hour))).unwrap(),
        gcra(100, hour),
        Limit::new(Algorithm::LeakyBucket(LeakyBucket::new(
            100,
            hour,
            LeakyMode::Meter,
        )))
        .unwrap(),
    ]);
    // (key, cost, requests, admitted): 150 or 120 x 1 against 100 admit 100; 60 x 3, 33.
    let plan = [
        ("one", 1u64, 150usize, 100u64),
        ("also one", 1, 120, 100),
        ("three", 3, 60, 33),
    ];
    let admitted = rt.block_on(async {
        let mut tasks = Vec::new();
        for l in 0..limits.len() {
            for (k, &(key, cost, n, _)) in plan.iter().enumerate() {
                for _ in 0..n {
                    let (store, limits) = (store.clone(), limits.clone());
                    tasks.push(tokio::spawn(async move {
                        let d = store
                            .check(0, &[Check::new(&limits[l], key, cost)])
                            .await
                            .unwrap();
                        (l, k, d[0].allowed)
                    }));
                }
            }
        }
        let mut admitted = [[0u64; 3]; 5];
        for t in tasks {
            let (l, k, allowed) = t.await.unwrap();
            admitted[l][k] += u64::from(allowed);
        }
        admitted
    });
    for (l, limit) in limits.iter().enumerate() {
        assert_eq!(admitted[l], [100, 100, 33], "{:?}", limit.algorithm());
        for (key, cost, _, n) in plan {
            let peek = rt
                .block_on(store.check(0, &[Check::new(limit, key, 0)]))
                .unwrap();
            assert_eq!(
                peek[0].remaining,
                100 - n * cost,
                "{:?} {key}",
                limit.algorithm()
            );
        }
    }
    let requests = 5 * (150 + 120 + 60);
    assert!(
        store.stats().calls < requests,
        "{} script calls for {requests} requests: nothing was batched",
        store.stats().calls
    );
}

#[test]
fn a_reload_that_moves_a_limit_to_another_tick_still_reads_its_state() {
    let server = RedisServer::start();
    let rt = runtime();
    let day = Duration::from_secs(86_400);
    // Same counter id, numbers changed by a reload: burst 10 runs at 1 ns, 13 at 1 us.
    let before = Limit::new(Algorithm::Gcra(Gcra::new(1, day).with_burst(10)))
        .unwrap()
        .with_id(7);
    let after = Limit::new(Algorithm::Gcra(Gcra::new(1, day).with_burst(13)))
        .unwrap()
        .with_id(7);
    let log_before = Limit::new(Algorithm::SlidingLog(SlidingLog::new(5, day)))
        .unwrap()
        .with_id(8);
    let log_after = Limit::new(Algorithm::SlidingLog(SlidingLog::new(5, 2 * 366 * day)))
        .unwrap()
        .with_id(8);
    assert_eq!(RedisStore::tick_for(&before), Some(1));
    assert_eq!(RedisStore::tick_for(&after), Some(1_000));
    assert_eq!(RedisStore::tick_for(&log_before), Some(1));
    assert!(RedisStore::tick_for(&log_after).unwrap() > 1);
    let memory = MemoryStore::new();
    let redis = caller_time_store(&rt, &server.url());
    let now = T0 - T0 % 1_000 + 123_000; // a whole microsecond with a sub-second part
    for (old, new) in [(&before, &after), (&log_before, &log_after)] {
        for _ in 0..4 {
            let c = [Check::new(old, "k", 1)];
            assert_eq!(
                rt.block_on(redis.check(now, &c)).unwrap(),
                memory.check_all(now, &c)
            );
        }
        let later = now + 1_000_000;
        let c = [Check::new(new, "k", 1)];
        let got = rt.block_on(redis.check(later, &c)).unwrap()[0];
        let want = memory.check_all(later, &c)[0];
        assert_eq!(
            (got.allowed, got.remaining),
            (want.allowed, want.remaining),
            "{new:?}"
        );
        let tick = RedisStore::tick_for(new).unwrap();
        assert!(got.reset_after >= want.reset_after && got.reset_after - want.reset_after < tick);
    }
}

fn fixed(limit: u64, window: Duration) -> Limit {
    Limit::new(Algorithm::FixedWindow(FixedWindow::new(limit, window))).unwrap()
}

/// `rediss://` with the CA and a client certificate decides in Redis; a store that
/// trusts another CA, or presents no certificate where Redis asks for one, fails
/// (and never decides); certificates for a plain URL are refused at once.
#[cfg(feature = "redis-tls")]
#[test]
fn over_tls_the_store_decides_and_trusts_only_its_ca() {
    use tollgate::store::RedisTls;
    let files = redis_server::TlsFiles::generate("store");
    let server = RedisServer::start_tls(&files, "yes");
    let rt = two_threads();
    let l = fixed(3, Duration::from_secs(3_600));
    let connect = |ca: &str, client: bool| {
        let tls = RedisTls {
            ca_pem: Some(files.read(ca)),
            client_pem: client.then(|| (files.read("client.pem"), files.read("client.key"))),
        };
        rt.block_on(
            RedisStore::builder(server.tls_url())
                .deadline(Duration::from_secs(2))
                .blocked_cache(0)
                .tls(tls)
                .connect(),
        )
        .unwrap()
    };
    let ask = |store: &RedisStore| rt.block_on(store.check(0, &[Check::new(&l, "k", 1)]));

    let good = connect("ca.pem", true);
    let remaining: Vec<u64> = (0..3).map(|_| ask(&good).unwrap()[0].remaining).collect();
    assert_eq!(remaining, [2, 1, 0]);
    assert!(!ask(&good).unwrap()[0].allowed);
    let calls = server.script_calls();
    assert!(calls >= 4, "decided in Redis");

    for (ca, client, what) in [
        ("other-ca.pem", true, "a server certificate from another CA"),
        ("ca.pem", false, "no client certificate"),
    ] {
        let store = connect(ca, client);
        let e = ask(&store).expect_err(what).to_string();
        assert!(
            e.to_lowercase().contains("certificate"),
            "{what}: the error should say why: {e}"
        );
    }
    assert_eq!(
        server.script_calls(),
        calls,
        "the failed stores decided nothing"
    );

    let plain = rt.block_on(
        RedisStore::builder(server.url())
            .tls(RedisTls::default())
            .connect(),
    );
    let e = plain
        .err()
        .expect("certificates for redis:// are refused")
        .to_string();
    assert!(e.contains("rediss://"), "{e}");
}

/// `rediss+cluster://` with the CA: each key's limit is exact on whichever master owns it.
#[cfg(feature = "redis-tls")]
#[test]
fn a_cluster_over_tls_decides_exactly() {
    let files = redis_server::TlsFiles::generate("cluster");
    let cluster = RedisCluster::start_tls(&files);
    let rt = two_threads();
    let store = rt
        .block_on(
            RedisStore::builder(cluster.tls_url())
                .deadline(Duration::from_secs(2))
                .blocked_cache(0)
                .tls(tollgate::store::RedisTls {
                    ca_pem: Some(files.read("ca.pem")),
                    client_pem: None,
                })
                .connect(),
        )
        .unwrap();
    let l = fixed(2, Duration::from_secs(3_600));
    let keys: Vec<String> = (0..12).map(|i| format!("user-{i}")).collect();
    for expected in [true, true, false] {
        for k in &keys {
            let d = rt
                .block_on(store.check(0, &[Check::new(&l, k, 1)]))
                .unwrap();
            assert_eq!(d[0].allowed, expected, "{k}");
        }
    }
    let per_node: Vec<u64> = cluster.nodes.iter().map(RedisServer::dbsize).collect();
    assert_eq!(per_node.iter().sum::<u64>(), 12, "{per_node:?}");
    assert!(
        per_node.iter().all(|&n| n > 0),
        "keys on every master: {per_node:?}"
    );
}

#[test]
fn a_callers_budget_shorter_than_the_deadline_bounds_the_wait() {
    let server = RedisServer::start();
    let rt = two_threads();
    let store = uncached_store(&rt, &server, Duration::from_millis(400));
    let l = fixed(1_000, Duration::from_secs(3_600));
    // Connected and the script loaded (which a busy machine may not do in the budget).
    rt.block_on(store.check(0, &[Check::new(&l, "k", 0)]))
        .unwrap();
    // (Under redis-rs's own 500 ms response timeout, and at least half the deadline.)
    let budget = Duration::from_millis(250);
    // Up: the budget changes nothing.
    let d = rt
        .block_on(store.check_within(0, &[Check::new(&l, "k", 1)], budget))
        .unwrap();
    assert_eq!(d[0].remaining, 999);
    server.pause(true);
    let start = std::time::Instant::now();
    let answer = rt.block_on(store.check_within(0, &[Check::new(&l, "k", 1)], budget));
    let took = start.elapsed();
    server.pause(false);
    assert!(
        matches!(answer, Err(tollgate::store::Error::Timeout(t)) if t == budget),
        "{answer:?}"
    );
    assert!(took < Duration::from_secs(2), "waited {took:?}");
    assert_eq!(
        store.stats().timeouts,
        1,
        "counted as the store's own timeout"
    );
    // A budget longer than the deadline leaves the deadline in force.
    server.pause(true);
    let answer = rt.block_on(async {
        let short = RedisStore::builder(server.url())
            .deadline(Duration::from_millis(50))
            .connect()
            .await
            .unwrap();
        short
            .check_within(0, &[Check::new(&l, "k", 1)], Duration::from_secs(60))
            .await
    });
    server.pause(false);
    assert!(
        matches!(answer, Err(tollgate::store::Error::Timeout(t)) if t == Duration::from_millis(50)),
        "{answer:?}"
    );
}

/// A caller cannot buy its rules' failure mode by being impatient: a budget under half
/// the deadline (`grpc-timeout: 0m`) is not honoured, so a healthy Redis still decides.
#[test]
fn a_tiny_budget_still_gets_redis_decision() {
    let server = RedisServer::start();
    let rt = two_threads();
    let store = uncached_store(&rt, &server, Duration::from_secs(5));
    let l = fixed(2, Duration::from_secs(3_600));
    let allowed: Vec<bool> = (0..3)
        .map(|_| {
            let d = rt.block_on(store.check_within(0, &[Check::new(&l, "k", 1)], Duration::ZERO));
            d.unwrap()[0].allowed
        })
        .collect();
    assert_eq!(allowed, [true, true, false]);
    assert_eq!(store.stats().timeouts, 0);
}

/// A Redis on the same host reached through its Unix socket (`redis+unix:///path`):
/// the store decides there exactly as over TCP, and its script calls arrive through the
/// socket.
#[test]
fn a_redis_on_a_unix_socket_decides_exactly() {
    let socket = std::env::temp_dir().join(format!(
        "tollgate-test-{}-{}.sock",
        std::process::id(),
        PREFIX.fetch_add(1, Ordering::Relaxed)
    ));
    let path = socket.to_str().unwrap().to_string();
    let server = RedisServer::start_with_args(&["--unixsocket", &path, "--unixsocketperm", "700"]);
    let rt = two_threads();
    let store = rt
        .block_on(
            RedisStore::builder(format!("redis+unix://{path}"))
                .deadline(Duration::from_secs(5))
                .blocked_cache(0)
                .connect(),
        )
        .unwrap();
    let l = fixed(2, Duration::from_secs(3_600));
    let allowed: Vec<bool> = (0..3)
        .map(|_| {
            rt.block_on(store.check(0, &[Check::new(&l, "k", 1)]))
                .unwrap()[0]
                .allowed
        })
        .collect();
    assert_eq!(allowed, [true, true, false]);
    let clients = command(server.port, "CLIENT LIST").unwrap();
    assert!(
        clients.lines().any(|c| c.contains(&format!("addr={path}"))),
        "no client on the socket: {clients}"
    );
    drop(server);
    let _ = std::fs::remove_file(&socket);
}

#[test]
fn requests_that_missed_their_deadline_are_not_charged_later() {
    let server = RedisServer::start();
    let rt = two_threads();
    let store = std::sync::Arc::new(
        rt.block_on(
            RedisStore::builder(server.url())
                .deadline(Duration::from_millis(20))
                .circuit_breaker(1_000, Duration::from_millis(10))
                .blocked_cache(0)
                .connect(),
        )
        .unwrap(),
    );
    let l = fixed(1_000, Duration::from_secs(3_600));
    // What `k` has left, asked (cost 0, so charging nothing) until an answer comes
    // within the 20 ms deadline: a slow machine may miss one now and then.
    let peek = || {
        let start = std::time::Instant::now();
        loop {
            match rt.block_on(store.check(0, &[Check::new(&l, "k", 0)])) {
                Ok(d) => return d[0].remaining,
                Err(e) => assert!(start.elapsed() < Duration::from_secs(10), "{e}"),
            }
        }
    };
    // Connected and the script loaded.
    assert_eq!(peek(), 1_000);
    server.pause(true);
    let timed_out = rt.block_on(async {
        let spawn = |_| {
            let (store, l) = (store.clone(), l);
            tokio::spawn(async move { store.check(0, &[Check::new(&l, "k", 1)]).await })
        };
        // The first request's call goes to the stopped Redis and occupies the one
        // call in flight; the 49 after it wait in the queue behind it.
        let mut tasks = vec![spawn(0)];
        tokio::time::sleep(Duration::from_millis(100)).await;
        tasks.extend((1..50).map(spawn));
        let mut timed_out = 0;
        for t in tasks {
            if matches!(t.await.unwrap(), Err(tollgate::store::Error::Timeout(_))) {
                timed_out += 1;
            }
        }
        timed_out
    });
    server.pause(false);
    assert_eq!(timed_out, 50, "every request answered by its deadline");
    std::thread::sleep(Duration::from_millis(100));
    let left = peek();
    // The one call already written to the socket runs when Redis wakes up (it
    // holds the first request alone); the requests still queued were dropped.
    assert!(
        left >= 999,
        "{} requests that timed out were charged",
        1_000 - left
    );
}

#[test]
fn a_request_the_script_fails_on_fails_alone_and_does_not_trip_the_breaker() {
    let server = RedisServer::start();
    let rt = runtime();
    let store = rt
        .block_on(
            RedisStore::builder(server.url())
                .prefix("p")
                .circuit_breaker(3, Duration::from_secs(60))
                // About script failures, not deadlines: a loaded test machine must not
                // turn a call into a timeout.
                .deadline(Duration::from_secs(2))
                .connect(),
        )
        .unwrap();
    let l = gcra(100, Duration::from_secs(60));
    // Someone else's list where the "bad" key's state should be.
    let bad = ScriptCall::new("p", &[Check::new(&l, "bad", 1)]).unwrap();
    command(server.port, &format!("RPUSH {} x", bad.keys[0])).unwrap();
    for _ in 0..10 {
        let err = rt
            .block_on(store.check(0, &[Check::new(&l, "bad", 1)]))
            .unwrap_err();
        assert!(err.to_string().contains("failed on this request"), "{err}");
    }
    assert_eq!(store.stats().circuit_opened, 0, "Redis itself is healthy");
    let good = rt
        .block_on(store.check(0, &[Check::new(&l, "good", 1)]))
        .unwrap();
    assert!(good[0].allowed);
    // In one request with a good key, the good key's charge is taken back.
    let both = [Check::new(&l, "good", 1), Check::new(&l, "bad", 1)];
    assert!(rt.block_on(store.check(0, &both)).is_err());
    let peek = rt
        .block_on(store.check(0, &[Check::new(&l, "good", 0)]))
        .unwrap();
    assert_eq!(
        peek[0].remaining, 99,
        "only the lone request charged `good`"
    );
}

/// In a call of several requests every state is read up front with `MGET`, which
/// answers a key holding another type as if it were missing: the fast paths must still
/// not overwrite it. For every algorithm with a fast path, someone else's list where a
/// lone check's state should be fails that request alone (-2, as a lone call's `GET`
/// makes it fail), the list stays, and the requests around it are decided.
#[test]
fn in_a_batch_a_key_of_another_type_fails_its_request_alone_and_is_kept() {
    let server = RedisServer::start();
    let rt = runtime();
    let mut conn = connection(&rt, &server);
    let hour = Duration::from_secs(3_600);
    let limits = [
        fixed(10, hour),
        Limit::new(Algorithm::SlidingWindow(SlidingWindow::new(10, hour))).unwrap(),
        Limit::new(Algorithm::TokenBucket(TokenBucket::new(10, hour))).unwrap(),
        gcra(10, hour),
        Limit::new(Algorithm::LeakyBucket(LeakyBucket::new(
            10,
            hour,
            LeakyMode::Queue,
        )))
        .unwrap(),
    ];
    for (i, l) in limits.iter().enumerate() {
        let prefix = format!("w{i}");
        let bad = ScriptCall::new(&prefix, &[Check::new(l, "bad", 1)]).unwrap();
        command(server.port, &format!("RPUSH {} x", bad.keys[0])).unwrap();
        let requests = [
            vec![Check::new(l, "a", 1)],
            vec![Check::new(l, "bad", 1)],
            vec![Check::new(l, "b", 1)],
        ];
        let call = ScriptCall::batch(
            &prefix,
            Duration::from_millis(1),
            requests.iter().map(|r| (None, r.as_slice())),
        )
        .unwrap();
        let answers = run_call(&rt, &mut conn, &call);
        let allowed: Vec<i64> = answers.chunks(5).map(|d| d[0]).collect();
        assert_eq!(allowed, [1, -2, 1], "{:?}", l.algorithm());
        let kind = command(server.port, &format!("TYPE {}", bad.keys[0])).unwrap();
        assert_eq!(kind.trim(), "+list", "{:?}", l.algorithm());
    }
}

#[test]
fn a_cached_rejection_still_starts_the_lockouts_and_survives_a_redis_failure() {
    minute::away_from_a_minute_boundary(10); // per-minute windows by Redis TIME
    let mut server = RedisServer::start();
    let rt = runtime();
    let store = slow_machine_store(&rt, RedisStore::builder(server.url()));
    let hour = Duration::from_secs(3_600);
    let hot = fixed(1, hour);
    let login = fixed(1, Duration::from_secs(60)).with_lockout(hour);
    let memory = MemoryStore::new();
    let steps: [&[Check<'_>]; 3] = [
        &[Check::new(&hot, "ip", 1)],
        &[Check::new(&hot, "ip", 1)],
        &[Check::new(&login, "alice", 1)],
    ];
    for checks in steps {
        let got = rt.block_on(store.check(0, checks)).unwrap();
        let want = memory.check_all(T0, checks);
        assert_eq!(got[0].allowed, want[0].allowed);
    }
    // `ip` is now rejected from the cache; `alice` is over her limit too, and her
    // rejection starts a lockout, as it does in the in-memory store.
    let both = [Check::new(&hot, "ip", 1), Check::new(&login, "alice", 1)];
    let got = rt.block_on(store.check(0, &both)).unwrap();
    let want = memory.check_all(T0, &both);
    assert!(got[0].from_cache && !got[0].allowed);
    assert_eq!(got[1].allowed, want[1].allowed);
    assert!(!got[1].allowed);
    let alice = [Check::new(&login, "alice", 0)];
    let locked = rt.block_on(store.check(0, &alice)).unwrap()[0];
    assert_eq!(
        memory.check_all(T0, &alice)[0].retry_after,
        hour.as_nanos() as u64
    );
    assert!(
        locked.retry_after > 3_500 * S,
        "locked out for the hour, not just to the minute's end: {locked:?}"
    );
    // Redis gone: the cached rejection still answers (not the failure policy), and
    // the other check is reported uncharged.
    server.kill();
    let other = fixed(10, hour);
    let mixed = [Check::new(&hot, "ip", 1), Check::new(&other, "bob", 1)];
    let got = rt.block_on(store.check(0, &mixed)).unwrap();
    assert!(got[0].from_cache && !got[0].allowed);
    assert!(got[1].allowed && got[1].remaining == 10);
}

/// A script call built with [`ScriptCall::batch`], as the batcher builds one (each
/// distinct packed request once, an index naming each request's and marking those
/// whose keys came earlier, every state read up front with one `MGET`), decides what
/// the same requests decide one call each: lone checks sharing their bytes and their
/// key, a lockout that starts partway, a request of two checks, and a lone check
/// rejected at its limit. The answers are read with [`ScriptCall::answers`], as
/// tollgate-load reads them.
#[test]
fn a_hand_built_batch_decides_as_the_same_calls_one_by_one() {
    let server = RedisServer::start();
    let rt = runtime();
    let hour = Duration::from_secs(3_600);
    // Buckets, not windows: no boundary for the two runs to straddle.
    let lone = Limit::new(Algorithm::TokenBucket(TokenBucket::new(5, hour))).unwrap();
    let login = gcra(2, hour).with_lockout(hour);
    // A tail of lone requests: a batch of 121 requests, as a busy batcher sends.
    let tail: Vec<String> = (0..110).map(|i| format!("t{i}")).collect();
    let mut requests: Vec<Vec<Check<'_>>> = vec![
        vec![Check::new(&lone, "a", 1)],
        vec![Check::new(&lone, "a", 1)],
        vec![Check::new(&login, "x", 1)],
        vec![Check::new(&lone, "b", 1)],
        vec![Check::new(&login, "x", 1)],
        vec![Check::new(&lone, "a", 1), Check::new(&login, "y", 1)],
        vec![Check::new(&login, "x", 1)], // over: the lockout starts
        vec![Check::new(&lone, "a", 1)],
        vec![Check::new(&lone, "a", 1)],
        vec![Check::new(&login, "x", 1)], // locked out
        vec![Check::new(&lone, "a", 1)],  // the 6th on "a": over
    ];
    requests.extend(tail.iter().map(|k| vec![Check::new(&lone, k, 1)]));
    let mut conn = connection(&rt, &server);
    let mut call = |prefix: &str, batch: &[Vec<Check<'_>>]| -> Vec<i64> {
        let call = ScriptCall::batch(
            prefix,
            Duration::from_millis(1),
            batch.iter().map(|r| (None, r.as_slice())),
        )
        .unwrap();
        run_call(&rt, &mut conn, &call)
    };
    let batched = call("p", &requests);
    let one_by_one: Vec<i64> = requests
        .iter()
        .flat_map(|r| call("q", std::slice::from_ref(r)))
        .collect();
    // allowed and remaining per check (the reset times follow Redis TIME, which moved).
    let allowed_remaining =
        |v: &[i64]| -> Vec<(i64, i64)> { v.chunks(5).map(|d| (d[0], d[1])).collect() };
    assert_eq!(allowed_remaining(&batched), allowed_remaining(&one_by_one));
    // Per check; the request of two checks is the 6th and 7th.
    let allowed: Vec<i64> = batched.chunks(5).map(|d| d[0]).collect();
    assert_eq!(
        allowed[..12],
        [1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 0, 0],
        "{batched:?}"
    );
    assert_eq!(allowed[12..], [1; 110]);
    let remaining: Vec<i64> = batched.chunks(5).skip(12).map(|d| d[1]).collect();
    assert_eq!(
        remaining, [4; 110],
        "each tail key charged once, answered in order"
    );
}

/// Connections Redis has open (`INFO clients`), less the one asking.
fn connected_clients(server: &RedisServer) -> usize {
    let info = command(server.port, "INFO clients").unwrap();
    let n = info
        .lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|n| n.trim().parse::<usize>().ok())
        .unwrap_or_else(|| panic!("no connected_clients in {info}"));
    n - 1
}

/// Waits (up to 5 s) until Redis has `want` connections open besides the asker's.
fn await_clients(server: &RedisServer, want: usize) -> usize {
    let start = std::time::Instant::now();
    loop {
        let n = connected_clients(server);
        if n == want || start.elapsed() > Duration::from_secs(5) {
            return n;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Connections that carried script calls (`CLIENT LIST`: last command `fcall`).
fn script_connections(server: &RedisServer) -> usize {
    let list = command(server.port, "CLIENT LIST").unwrap();
    list.lines().filter(|l| l.contains(" cmd=fcall ")).count()
}

/// Threads each driving a current-thread runtime of its own (as `tollgate serve`'s
/// workers): each runs its work, reports the result, and then keeps its runtime running
/// (so that whatever batcher and connection the runtime holds lives on, and sees the
/// store go) until [`RuntimeThreads::finish`].
struct RuntimeThreads<T> {
    results: std::sync::mpsc::Receiver<T>,
    stop: std::sync::mpsc::Sender<()>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl<T: Send + 'static> RuntimeThreads<T> {
    /// Starts `n` threads running `work()`; `work` (and what it holds, such as the
    /// store) is dropped as soon as its future is done.
    fn spawn<F, Fut>(n: usize, work: F) -> Self
    where
        F: Fn() -> Fut + Clone + Send + 'static,
        Fut: std::future::Future<Output = T>,
    {
        let (stop, stop_rx) = std::sync::mpsc::channel::<()>();
        let stop_rx = std::sync::Arc::new(std::sync::Mutex::new(stop_rx));
        let (done, results) = std::sync::mpsc::channel::<T>();
        let threads = (0..n)
            .map(|_| {
                let (work, done, stop_rx) = (work.clone(), done.clone(), stop_rx.clone());
                std::thread::spawn(move || {
                    let rt = runtime();
                    let result = rt.block_on(work());
                    drop(work);
                    done.send(result).unwrap();
                    rt.block_on(async {
                        while stop_rx.lock().unwrap().try_recv().is_err() {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    });
                })
            })
            .collect();
        Self {
            results,
            stop,
            threads,
        }
    }

    /// Every thread's result, waiting for each.
    fn results(&self) -> Vec<T> {
        self.threads
            .iter()
            .map(|_| self.results.recv().unwrap())
            .collect()
    }

    /// Stops the threads' runtimes and joins them.
    fn finish(self) {
        for _ in &self.threads {
            self.stop.send(()).unwrap();
        }
        for t in self.threads {
            t.join().unwrap();
        }
    }
}

/// Callers on current-thread runtimes (as `tollgate serve`'s workers) get a batcher and
/// a connection of their own thread, used once it has answered a `PING`: one connection
/// per thread, each carrying that thread's script calls, one limit still exact across the
/// threads, and the connections closed when the store is dropped. With
/// `per_thread(false)` the threads share the store's one connection.
#[test]
fn each_current_thread_runtime_has_its_own_connection_and_limits_stay_exact() {
    for per_thread in [true, false] {
        let server = RedisServer::start();
        let rt = two_threads();
        // The caller's time (0 throughout): no window can end during the test.
        let store = std::sync::Arc::new(slow_machine_store(
            &rt,
            RedisStore::builder(server.url())
                .time_source(TimeSource::Caller)
                .ttl_slack(Duration::from_secs(3_600))
                .blocked_cache(0)
                .per_thread(per_thread),
        ));
        // The store's shared connection (its version check opens it).
        assert_eq!(await_clients(&server, 1), 1);
        let expected = if per_thread { 4 } else { 1 };
        let limit = std::sync::Arc::new(
            Limit::new(Algorithm::FixedWindow(FixedWindow::new(
                50,
                Duration::from_secs(3_600),
            )))
            .unwrap(),
        );
        // Set once every connection expected to carry script calls has: the threads
        // keep sending until then (at least 40 requests each).
        let used = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = RuntimeThreads::spawn(3, {
            let (store, limit, used) = (store.clone(), limit.clone(), used.clone());
            move || {
                let (store, limit, used) = (store.clone(), limit.clone(), used.clone());
                async move {
                    let (mut sent, mut admitted) = (0u64, 0u64);
                    while sent < 40 || (!used.load(Ordering::Relaxed) && sent < 3_000) {
                        let one = [Check::new(&limit, "shared", 1)];
                        sent += 1;
                        admitted += u64::from(store.check(0, &one).await.unwrap()[0].allowed);
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    (sent, admitted)
                }
            }
        });
        let start = std::time::Instant::now();
        while script_connections(&server) < expected && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        used.store(true, Ordering::Relaxed);
        let results = threads.results();
        let sent: u64 = results.iter().map(|r| r.0).sum();
        let admitted: u64 = results.iter().map(|r| r.1).sum();
        assert_eq!(
            admitted, 50,
            "per_thread {per_thread}: {sent} requests, limit 50"
        );
        let (busy, scripted) = (connected_clients(&server), script_connections(&server));
        drop(store);
        let after = await_clients(&server, 0);
        threads.finish();
        assert_eq!(busy, expected, "per_thread {per_thread}: connections");
        assert_eq!(
            scripted, expected,
            "per_thread {per_thread}: connections with script calls"
        );
        assert_eq!(after, 0, "per_thread {per_thread}: connections left open");
    }
}

/// Over TLS the callers on current-thread runtimes share the store's one connection,
/// though `per_thread` asks for one each (redis-rs reads the system's certificate store
/// on every TLS connect, which would stall a worker): three threads, each on a runtime of
/// its own and each sending for at least 200 ms (a connection of its own would be open and
/// in use by then), leave Redis with one connection, which carried the script calls; the
/// limit stays exact; dropping the store closes it.
#[cfg(feature = "redis-tls")]
#[test]
fn over_tls_current_thread_runtimes_share_the_one_connection() {
    use tollgate::store::RedisTls;
    let files = redis_server::TlsFiles::generate("per-thread");
    let server = RedisServer::start_tls(&files, "yes");
    let rt = two_threads();
    let tls = RedisTls {
        ca_pem: Some(files.read("ca.pem")),
        client_pem: Some((files.read("client.pem"), files.read("client.key"))),
    };
    // The caller's time (0 throughout): no window can end during the test.
    let store = std::sync::Arc::new(slow_machine_store(
        &rt,
        RedisStore::builder(server.tls_url())
            .time_source(TimeSource::Caller)
            .ttl_slack(Duration::from_secs(3_600))
            .blocked_cache(0)
            .per_thread(true)
            .tls(tls),
    ));
    let limit = std::sync::Arc::new(fixed(50, Duration::from_secs(3_600)));
    let threads = RuntimeThreads::spawn(3, {
        let store = store.clone();
        move || {
            let (store, limit) = (store.clone(), limit.clone());
            async move {
                let mut admitted = 0u64;
                for _ in 0..40 {
                    let one = [Check::new(&limit, "shared", 1)];
                    admitted += u64::from(store.check(0, &one).await.unwrap()[0].allowed);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                admitted
            }
        }
    });
    let admitted: u64 = threads.results().into_iter().sum();
    assert_eq!(admitted, 50, "120 requests, limit 50");
    // A connection of a runtime's own, still connecting, would show within the second.
    let start = std::time::Instant::now();
    while connected_clients(&server) == 1 && start.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let (open, scripted) = (connected_clients(&server), script_connections(&server));
    drop(store);
    let after = await_clients(&server, 0);
    threads.finish();
    assert_eq!(open, 1, "connections over TLS");
    assert_eq!(scripted, 1, "connections with script calls");
    assert_eq!(after, 0, "connections left open");
}

/// A thread that leaves a current-thread runtime (still alive, no longer run) for
/// another gets the new runtime's batcher, not the old one's, which would never run.
#[test]
fn a_thread_moving_to_another_runtime_uses_that_runtimes_batcher() {
    let server = RedisServer::start();
    let rt = two_threads();
    let store = slow_machine_store(
        &rt,
        RedisStore::builder(server.url())
            .time_source(TimeSource::Caller)
            .ttl_slack(Duration::from_secs(3_600))
            .blocked_cache(0),
    );
    let limit = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
        1_000_000,
        Duration::from_secs(3_600),
    )))
    .unwrap();
    let one = [Check::new(&limit, "k", 1)];
    // Requests on `runtime` until `connections` connections carried script calls.
    let until = |runtime: &tokio::runtime::Runtime, connections: usize| {
        let start = std::time::Instant::now();
        while script_connections(&server) < connections {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "never {connections}"
            );
            let d = runtime.block_on(async {
                let d = store.check(0, &one).await;
                tokio::time::sleep(Duration::from_millis(5)).await;
                d
            });
            assert!(d.unwrap()[0].allowed);
        }
    };
    let first = runtime();
    // The shared connection, then the first runtime's.
    until(&first, 2);
    let second = runtime();
    until(&second, 3);
    for _ in 0..20 {
        assert!(second.block_on(store.check(0, &one)).unwrap()[0].allowed);
    }
    drop(first);
}

/// Sets `key` to `value`, bytes as they are (an inline command cannot carry them).
fn set_raw(port: u16, key: &str, value: &[u8]) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut req = format!(
        "*3\r\n$3\r\nSET\r\n${}\r\n{key}\r\n${}\r\n",
        key.len(),
        value.len()
    )
    .into_bytes();
    req.extend_from_slice(value);
    req.extend_from_slice(b"\r\n");
    s.write_all(&req).unwrap();
    let mut reply = [0u8; 5];
    s.read_exact(&mut reply).unwrap();
    assert_eq!(&reply, b"+OK\r\n");
}

/// A sliding window's state as an earlier version of Tollgate wrote it (32 bytes: the
/// aligned window's end + one window, the previous and the current count) is read
/// conservatively: each count is held against the limit as late as it can have been
/// admitted, so nothing passes that the counts may still cover; the first admission
/// writes the state anew.
#[test]
fn a_sliding_window_state_of_the_earlier_format_is_held_against_the_limit() {
    let server = RedisServer::start();
    let rt = runtime();
    let w = 60 * S;
    let limit = Limit::new(Algorithm::SlidingWindow(SlidingWindow::new(
        10,
        Duration::from_secs(60),
    )))
    .unwrap();
    let redis = caller_time_store(&rt, &server.url());
    let start = T0 - T0 % w; // a minute's start
    let now = start + 30 * S;
    let check = [Check::new(&limit, "k", 1)];
    assert!(rt.block_on(redis.check(now, &check)).unwrap()[0].allowed);
    let keys = command(server.port, "KEYS *").unwrap();
    let key = keys
        .lines()
        .find(|l| l.starts_with('t'))
        .unwrap_or_else(|| panic!("no state key in {keys}"))
        .to_string();
    assert_eq!(
        command(server.port, &format!("STRLEN {key}")).unwrap(),
        ":332\r\n"
    );
    // 10 in the previous minute, 2 in this one. The old estimate, 2 + floor(10 × 30/60)
    // = 7, let 3 more through; but the previous minute's 10 may all lie in its last
    // second, still inside the rolling minute.
    let end_plus_window = start + 2 * w;
    let mut old = Vec::new();
    for v in [
        (end_plus_window / S) as f64,
        (end_plus_window % S) as f64,
        10.0,
        2.0,
    ] {
        old.extend_from_slice(&v.to_le_bytes());
    }
    set_raw(server.port, &key, &old);
    let admitted = (0..5)
        .filter(|_| rt.block_on(redis.check(now, &check)).unwrap()[0].allowed)
        .count();
    assert_eq!(admitted, 0);
    assert_eq!(
        command(server.port, &format!("STRLEN {key}")).unwrap(),
        ":32\r\n",
        "a rejection writes nothing"
    );
    // A second into the next minute the previous minute's 10 have left; this minute's 2
    // (now the previous) still count: 8 pass by the bound, one more by the estimate.
    let next = start + w + S;
    let admitted = (0..12)
        .filter(|_| rt.block_on(redis.check(next, &check)).unwrap()[0].allowed)
        .count();
    assert_eq!(admitted, 9);
    assert_eq!(
        command(server.port, &format!("STRLEN {key}")).unwrap(),
        ":332\r\n"
    );
}

/// A check kept charged in a rejected request (`charge_rejected: all`) that a lockout
/// started by another check of its request (here one in quota mode, on another slot's
/// request) rejects when decided again is charged anyway, on a single Redis, on a
/// cluster's refund, and in memory alike.
#[test]
fn a_kept_charge_that_a_lockout_of_its_own_request_rejects_is_charged_anyway() {
    let with_lockout = |a| Limit::new(a).unwrap().with_lockout(Duration::from_secs(5));
    let limits = vec![
        with_lockout(Algorithm::FixedWindow(FixedWindow::new(
            10_422,
            Duration::from_secs(86_400),
        ))),
        with_lockout(Algorithm::Gcra(
            Gcra::new(11, Duration::from_secs(86_400)).with_burst(1),
        )),
    ];
    let reqs = vec![
        Req {
            advance: 0,
            checks: vec![
                (1, 0, 1, false, None, ChargeRejected::All),
                (1, 0, 1, false, Some(0), ChargeRejected::None),
                (0, 1, 0, false, None, ChargeRejected::None),
            ],
        },
        Req {
            advance: TO_NEXT_HOUR,
            checks: vec![(1, 0, 0, false, None, ChargeRejected::None)],
        },
    ];
    let rt = runtime();
    let server = RedisServer::start();
    differential(&rt, &server.url(), true, &limits, &reqs).unwrap();
    let cluster = RedisCluster::start();
    differential_on(
        &rt,
        &cluster.url(),
        true,
        ["alice", "d{o}b:_ é"],
        &limits,
        &reqs,
    )
    .unwrap();
}

/// A sliding log charged anyway (`charge_rejected`) for a shadow-mode check of a request
/// that another slot rejects: the refund puts the log back whole, that charge included,
/// and makes it once more; it is not counted twice (which later made the log's total
/// negative once its entries left the window).
#[test]
fn on_a_cluster_a_refunded_log_keeps_a_charge_made_anyway_once() {
    let limits = vec![Limit::new(Algorithm::SlidingLog(SlidingLog::new(
        0,
        Duration::from_secs(1),
    )))
    .unwrap()];
    let over = ChargeRejected::OverLimit;
    let none = ChargeRejected::None;
    let reqs = vec![
        Req {
            advance: TO_NEXT_HOUR,
            checks: vec![(0, 0, 2, false, None, ChargeRejected::All)],
        },
        Req {
            advance: 1_286_622_192,
            checks: vec![(0, 1, 3, false, None, over)],
        },
        // "alice" (shadow) is charged anyway; the other key, over, rejects the request.
        Req {
            advance: 0,
            checks: vec![(0, 0, 2, true, None, over), (0, 1, 0, false, None, none)],
        },
        Req {
            advance: 50_589_362_322,
            checks: vec![(0, 1, 1, true, None, none)],
        },
        Req {
            advance: 0,
            checks: vec![
                (0, 1, 1, false, Some(0), over),
                (0, 0, 1, false, None, over),
            ],
        },
        // Back in time: the log's total must not have gone below 0.
        Req {
            advance: -156_181_816,
            checks: vec![(0, 0, 3, true, None, none)],
        },
    ];
    let rt = runtime();
    let server = RedisServer::start();
    differential(&rt, &server.url(), true, &limits, &reqs).unwrap();
    let cluster = RedisCluster::start();
    let keys = ["alice", "d{o}b:_ é"];
    differential_on(&rt, &cluster.url(), true, keys, &limits, &reqs).unwrap();
}

/// One step of a lease trace: time passes, then a lease (leased counting's charge,
/// answering a token), a plain charge (another instance's requests), or a give-back of
/// unspent units of an earlier lease.
#[derive(Debug, Clone)]
enum LeaseOp {
    Lease(u64),
    Charge(u64),
    GiveBack(usize, u64),
}

/// Leasable limits (no lockout, no queue): the fixed window and the buckets.
fn leasable_limit() -> impl Strategy<Value = Limit> {
    let n = prop_oneof![3 => 1u64..12, 1 => 1_000u64..20_000];
    (0u8..4, n, window(), 1u64..15).prop_map(|(alg, n, w, burst)| {
        let algorithm = match alg {
            0 => Algorithm::FixedWindow(FixedWindow::new(n, w)),
            1 => Algorithm::TokenBucket(TokenBucket::new(n, w).with_burst(burst)),
            2 => Algorithm::Gcra(Gcra::new(n, w).with_burst(burst)),
            _ => Algorithm::LeakyBucket(LeakyBucket::new(n, w, LeakyMode::Meter).with_burst(burst)),
        };
        Limit::new(algorithm).unwrap()
    })
}

fn lease_trace() -> impl Strategy<Value = Vec<(i64, LeaseOp)>> {
    let advance = prop_oneof![
        Just(0i64),
        0i64..50_000_000,
        0i64..2 * S as i64,
        0i64..90 * S as i64,
    ];
    let cost = prop_oneof![7 => 1u64..6, 1 => 100u64..6_000];
    let op = prop_oneof![
        3 => cost.clone().prop_map(LeaseOp::Lease),
        2 => cost.clone().prop_map(LeaseOp::Charge),
        3 => (0usize..8, cost).prop_map(|(i, u)| LeaseOp::GiveBack(i, u)),
    ];
    prop::collection::vec((advance, op), 1..40)
}

/// Redis's give-back (`lua/driver.lua`'s `give_back_request`, from the receipt of the
/// lease's call) leaves every key as the in-memory store's (`Limit::give_back_key`,
/// from the state after the charge): a fixed window counts down while it is the window
/// charged, a bucket moves back only while nothing charged it since.
#[test]
fn a_lease_given_back_in_redis_leaves_what_the_in_memory_store_leaves() {
    let rt = runtime();
    let server = RedisServer::start();
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let mut runner = TestRunner::new(Config {
        cases,
        ..Config::default()
    });
    let exact =
        leasable_limit().prop_filter("computed at 1 ns", |l| RedisStore::tick_for(l) == Some(1));
    let url = server.url();
    // Give-backs that changed a key, over every trace: the traces must reach them.
    let changed = AtomicU64::new(0);
    runner
        .run(&(exact, lease_trace()), |(limit, ops)| {
            let memory = MemoryStore::builder().monotonic(false).build();
            let redis = caller_time_store(&rt, &url);
            let key = KEYS[1].as_bytes();
            let mut tokens = Vec::new();
            let mut now = T0;
            for (step, (advance, op)) in ops.iter().enumerate() {
                now = now.saturating_add_signed(*advance);
                match *op {
                    LeaseOp::Lease(cost) => {
                        let check = Check::new(&limit, key, cost);
                        let (want, mine) = rt.block_on(memory.lease(now, check, None)).unwrap();
                        let (got, theirs) = rt.block_on(redis.lease(now, check, None)).unwrap();
                        prop_assert_eq!(got, want, "lease at step {}", step);
                        prop_assert_eq!(mine.is_some(), want.allowed);
                        prop_assert_eq!(theirs.is_some(), got.allowed);
                        if let (Some(m), Some(r)) = (mine, theirs) {
                            tokens.push((m, r));
                        }
                    }
                    LeaseOp::Charge(cost) => {
                        let checks = [Check::new(&limit, key, cost)];
                        let want = memory.check_all(now, &checks);
                        let got = rt.block_on(redis.check(now, &checks)).unwrap();
                        prop_assert_eq!(got, want, "charge at step {}", step);
                    }
                    LeaseOp::GiveBack(i, units) => {
                        let Some((m, r)) = tokens.get(i % tokens.len().max(1)) else {
                            continue;
                        };
                        let check = Check::new(&limit, key, units);
                        let before = memory.check_all(now, &[Check::new(&limit, key, 0)]);
                        rt.block_on(memory.give_back(now, check, m)).unwrap();
                        rt.block_on(redis.give_back(now, check, r)).unwrap();
                        let peek = [Check::new(&limit, key, 0)];
                        let want = memory.check_all(now, &peek);
                        let got = rt.block_on(redis.check(now, &peek)).unwrap();
                        prop_assert_eq!(&got, &want, "after a give-back at step {}", step);
                        if want != before {
                            changed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
            Ok(())
        })
        .unwrap();
    assert!(
        changed.load(Ordering::Relaxed) > 0,
        "no give-back changed a key"
    );
}
