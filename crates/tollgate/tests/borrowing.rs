//! Borrowing from a shared pool (`pools:` and a limit's `borrow`), through the
//! `Limiter`, on the in-memory store and on a real Redis: held to a model of the rule
//! (own limit always, up to `up_to` while the pool has room, every admission charging
//! the pool) over random traffic, and the cases a model does not show (two descriptors
//! borrowing at once, `charge_rejected`, the store failing).

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

#[path = "support/redis_server.rs"]
mod redis_server;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use redis_server::RedisServer;
use tollgate::clock::{Clock, ManualClock, NANOS_PER_SEC};
use tollgate::limiter::{Code, Limiter, RateLimitRequest, RateLimitResponse};
use tollgate::rules::{from_str, Rules};
use tollgate::store::{MemoryStore, RedisStore, Store, TimeSource};

/// A minute boundary: the fixed windows below start here.
const T0: u64 = 1_699_920_000 * NANOS_PER_SEC;

/// Tenants `a`–`c`: 3 per minute of their own, up to 7 while the pool (10 per minute)
/// has room. `free` is not limited by the pool.
const RULES: &str = "
domain: pooled
pools:
  - {name: shared, rate_limit: {unit: minute, requests_per_unit: 10}}
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 3, borrow: {from: shared, up_to: 7}}
  - key: free
    rate_limit: {unit: minute, requests_per_unit: 1000}
";
const OWN: u64 = 3;
const UP_TO: u64 = 7;
const POOL: u64 = 10;

/// The rule, counted by hand per window.
#[derive(Default)]
struct Model {
    window: u64,
    own: HashMap<u8, u64>,
    borrowed: HashMap<u8, u64>,
    pool: u64,
}

impl Model {
    /// Admitted, and whether by borrowing.
    fn decide(&mut self, now: u64, tenant: u8) -> (bool, bool) {
        let window = (now - T0) / (60 * NANOS_PER_SEC);
        if window != self.window {
            *self = Model {
                window,
                ..Model::default()
            };
        }
        let own = self.own.entry(tenant).or_default();
        if *own < OWN {
            *own += 1;
            self.pool += 1;
            return (true, false);
        }
        let borrowed = self.borrowed.entry(tenant).or_default();
        if OWN + *borrowed < UP_TO && self.pool < POOL {
            *borrowed += 1;
            self.pool += 1;
            return (true, true);
        }
        (false, false)
    }
}

fn request(tenant: u8) -> RateLimitRequest {
    let t = char::from(b'a' + tenant).to_string();
    RateLimitRequest::new("pooled", [vec![("tenant", t.as_str())]])
}

fn limiter_on<S: Store>(store: S, clock: &ManualClock, rules: &str) -> Limiter<S> {
    let rules = Arc::new(Rules::fixed(from_str("pooled.yaml", rules).unwrap()));
    Limiter::new(rules, store).with_clock(Arc::new(clock.clone()))
}

/// Runs `steps` (seconds to advance, tenant) through `check` and the model, returning
/// the first difference.
fn against_the_model(
    steps: &[(u64, u8)],
    clock: &ManualClock,
    mut check: impl FnMut(&RateLimitRequest) -> RateLimitResponse,
) -> Result<(), String> {
    let mut model = Model::default();
    for (i, &(advance, tenant)) in steps.iter().enumerate() {
        clock.advance(Duration::from_secs(advance));
        let (admitted, borrowed) = model.decide(clock.now(), tenant);
        let got = check(&request(tenant));
        let status = &got.statuses[0];
        let got_admitted = got.overall == Code::Ok;
        if (got_admitted, status.over_soft_limit) != (admitted, borrowed) {
            return Err(format!(
                "step {i} (tenant {tenant}, +{advance}s): admitted {got_admitted} borrowed {}, the model says {admitted} {borrowed}",
                status.over_soft_limit
            ));
        }
        // Statuses report the tenant's own limit.
        let limit = status.limit.as_ref().map(|l| l.requests_per_unit);
        if limit != Some(OWN) || (borrowed && status.remaining != 0) {
            return Err(format!(
                "step {i}: reported {limit:?}, remaining {}",
                status.remaining
            ));
        }
    }
    Ok(())
}

fn steps() -> impl Strategy<Value = Vec<(u64, u8)>> {
    // Mostly within one window, sometimes on to the next.
    prop::collection::vec(
        (
            prop_oneof![8 => Just(0u64), 1 => 1u64..20, 1 => Just(60)],
            0u8..3,
        ),
        1..80,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Over random traffic from three tenants, the in-memory store admits exactly what
    /// the model does: each tenant its own 3, up to 7 while the pool has room, never
    /// the pool past 10 by borrowing.
    #[test]
    fn the_memory_store_borrows_as_the_model_does(steps in steps()) {
        let clock = ManualClock::new(T0);
        let limiter = limiter_on(MemoryStore::new(), &clock, RULES);
        let result = against_the_model(&steps, &clock, |r| limiter.check_now(r).unwrap());
        prop_assert!(result.is_ok(), "{}", result.unwrap_err());
    }
}

static PREFIX: AtomicU64 = AtomicU64::new(0);

fn redis_store(rt: &tokio::runtime::Runtime, url: &str) -> RedisStore {
    let prefix = format!("b{}", PREFIX.fetch_add(1, Ordering::Relaxed));
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

/// The same on a real Redis, over fewer sequences (each a new prefix).
#[test]
fn the_redis_store_borrows_as_the_model_does() {
    let server = RedisServer::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(24));
    runner
        .run(&steps(), |steps| {
            let clock = ManualClock::new(T0);
            let limiter = limiter_on(redis_store(&rt, &server.url()), &clock, RULES);
            let result =
                against_the_model(&steps, &clock, |r| rt.block_on(limiter.check(r)).unwrap());
            prop_assert!(result.is_ok(), "{}", result.unwrap_err());
            Ok(())
        })
        .unwrap();
}

/// Two descriptors of one request borrowing from one pool take two of its units, all
/// or nothing: with one unit left, neither borrows.
#[test]
fn two_descriptors_borrow_from_one_pool_all_or_nothing() {
    let clock = ManualClock::new(T0);
    let rules = "
domain: pooled
pools:
  - {name: shared, rate_limit: {unit: minute, requests_per_unit: 5}}
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 1, borrow: {from: shared, up_to: 4}}
";
    let l = limiter_on(MemoryStore::new(), &clock, rules);
    let both = RateLimitRequest::new("pooled", [vec![("tenant", "a")], vec![("tenant", "b")]]);
    // Own 1 each (pool 2), then both borrow (pool 4).
    let first = l.check_now(&both).unwrap();
    assert!(first.statuses.iter().all(|s| !s.over_soft_limit));
    let second = l.check_now(&both).unwrap();
    assert_eq!(second.overall, Code::Ok);
    assert!(second
        .statuses
        .iter()
        .all(|s| s.over_soft_limit && s.remaining == 0));
    // One unit left in the pool, two asked: refused, nothing charged.
    let third = l.check_now(&both).unwrap();
    assert_eq!(third.overall, Code::OverLimit);
    let one = l.check_now(&request(0)).unwrap();
    assert_eq!(
        one.overall,
        Code::Ok,
        "the unit refused to two is still there"
    );
    assert!(one.statuses[0].over_soft_limit);
    assert_eq!(l.check_now(&request(0)).unwrap().overall, Code::OverLimit);
}

/// A limit in the same request with `charge_rejected: all` keeps exactly one charge
/// when the request is rejected after trying to borrow, and one when it is admitted by
/// borrowing: the second call does not charge it again.
#[test]
fn a_request_that_borrows_charges_its_other_limits_once() {
    let clock = ManualClock::new(T0);
    let rules = "
domain: pooled
pools:
  - {name: shared, rate_limit: {unit: minute, requests_per_unit: 2}}
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 1, borrow: {from: shared, up_to: 3}}
  - key: route
    charge_rejected: all
    rate_limit: {unit: minute, requests_per_unit: 10}
";
    let l = limiter_on(MemoryStore::new(), &clock, rules);
    let r = RateLimitRequest::new("pooled", [vec![("tenant", "a")], vec![("route", "r")]]);
    let remaining = |resp: &RateLimitResponse| resp.statuses[1].remaining;
    // Own (pool 1), borrowed (pool 2), then refused: the pool is spent.
    assert_eq!(remaining(&l.check_now(&r).unwrap()), 9);
    let borrowed = l.check_now(&r).unwrap();
    assert!(borrowed.statuses[0].over_soft_limit);
    assert_eq!(remaining(&borrowed), 8, "charged once while borrowing");
    let refused = l.check_now(&r).unwrap();
    assert_eq!(refused.overall, Code::OverLimit);
    assert_eq!(
        remaining(&refused),
        7,
        "a rejected request charges `all` once"
    );
    let route_only = RateLimitRequest::new("pooled", [vec![("route", "r")]]);
    assert_eq!(l.check_now(&route_only).unwrap().statuses[0].remaining, 6);
}

/// A shadow-mode limit over its limit that is charged anyway (`over_limit`) is charged
/// once when the request beside it borrows, and still reports that it would reject.
#[test]
fn a_shadow_limit_charged_anyway_is_charged_once_and_still_reported() {
    let clock = ManualClock::new(T0);
    let rules = "
domain: pooled
pools:
  - {name: shared, rate_limit: {unit: minute, requests_per_unit: 10}}
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 1, borrow: {from: shared, up_to: 5}}
  - key: trial
    shadow_mode: true
    charge_rejected: over_limit
    rate_limit: {unit: minute, requests_per_unit: 1, algorithm: token_bucket, burst: 10}
";
    let l = limiter_on(MemoryStore::new(), &clock, rules);
    let r = RateLimitRequest::new("pooled", [vec![("tenant", "a")], vec![("trial", "t")]]);
    let trial = RateLimitRequest::new("pooled", [vec![("trial", "t")]]);
    // The tenant's own 1, and the trial bucket's 10 tokens spent.
    assert!(!l.check_now(&r).unwrap().statuses[1].would_reject);
    for _ in 0..9 {
        assert!(!l.check_now(&trial).unwrap().statuses[0].would_reject);
    }
    // Borrowed; the trial bucket is over, charged anyway: one token into debt.
    let borrowed = l.check_now(&r).unwrap();
    assert_eq!(borrowed.overall, Code::Ok);
    assert!(borrowed.statuses[0].over_soft_limit);
    assert!(borrowed.statuses[1].would_reject);
    // One token a minute: 11 minutes later the bucket is full again (10 + 1 owed); a
    // second charge would have left it a token short.
    clock.advance(Duration::from_secs(11 * 60));
    let after = l.check_now(&trial).unwrap();
    assert_eq!(after.statuses[0].remaining, 9, "charged once");
}

/// A borrowing limit in shadow mode over its own limit charges the pool for each
/// request, past the pool's limit once it is spent: the pool's debt then holds another
/// key to its guarantee after the refill.
#[test]
fn a_shadowed_borrower_charges_a_spent_pool() {
    let clock = ManualClock::new(T0);
    let rules = "
domain: pooled
pools:
  - {name: shared, rate_limit: {unit: minute, requests_per_unit: 2, algorithm: token_bucket}}
descriptors:
  - key: trial
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1, borrow: {from: shared, up_to: 3}}
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 1, borrow: {from: shared, up_to: 3}}
";
    let l = limiter_on(MemoryStore::new(), &clock, rules);
    let trial = RateLimitRequest::new("pooled", [vec![("trial", "t")]]);
    // Its own 1, then 3 over it (shadow: answered OK): the pool's 2 tokens, then 2 owed.
    for _ in 0..4 {
        assert_eq!(l.check_now(&trial).unwrap().overall, Code::Ok);
    }
    assert!(l.check_now(&trial).unwrap().statuses[0].would_reject);
    // A minute later the pool has repaid its debt and holds nothing: a tenant gets its
    // own 1, and may not borrow.
    clock.advance(Duration::from_secs(60));
    assert_eq!(l.check_now(&request(0)).unwrap().overall, Code::Ok);
    assert_eq!(
        l.check_now(&request(0)).unwrap().overall,
        Code::OverLimit,
        "the pool was not charged while spent"
    );
}

/// With every descriptor in quota mode (`--quota-mode`), a limit that borrows is still
/// judged on its own: a tenant past its own limit borrows, another descriptor of the
/// request does not outvote it.
#[test]
fn a_borrowing_limit_is_not_in_quota_mode() {
    let clock = ManualClock::new(T0);
    let rules = Arc::new(Rules::fixed(from_str("pooled.yaml", RULES).unwrap()));
    let l = Limiter::new(rules, MemoryStore::new())
        .with_clock(Arc::new(clock.clone()))
        .with_settings(tollgate::limiter::Settings {
            global_quota_mode: true,
            ..Default::default()
        });
    let r = RateLimitRequest::new("pooled", [vec![("tenant", "a")], vec![("free", "f")]]);
    let mut model = Model::default();
    for i in 0..12 {
        let (admitted, borrowed) = model.decide(clock.now(), 0);
        let got = l.check_now(&r).unwrap();
        let s = &got.statuses[0];
        assert_eq!(
            (s.code == Code::Ok, s.over_soft_limit),
            (admitted, borrowed),
            "request {i}"
        );
        assert_eq!(s.quota, None, "request {i}");
    }
}

/// A store that fails answers by the failure mode, borrowing or not.
#[test]
fn a_failing_store_answers_by_the_failure_mode() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut server = RedisServer::start();
    let clock = ManualClock::new(T0);
    let store = redis_store(&rt, &server.url());
    let closed = RULES.replace(
        "domain: pooled",
        "domain: pooled\nfailure_mode: fail_closed",
    );
    let l = limiter_on(store, &clock, &closed);
    assert_eq!(rt.block_on(l.check(&request(0))).unwrap().overall, Code::Ok);
    server.kill();
    let failed = rt.block_on(l.check(&request(0))).unwrap();
    assert_eq!(failed.overall, Code::OverLimit);
    assert!(failed.store_failure.is_some());
}
