//! In-flight permits as Redis leases, against a real `redis-server` started on a free
//! port: instances sharing one limit, a crashed instance's leases expiring, held
//! permits being renewed, an unreachable Redis failing fast, and key naming.
#![allow(clippy::unwrap_used)]

#[path = "support/redis_server.rs"]
mod redis_server;

use std::future::Future;
use std::time::{Duration, Instant};

use redis_server::{command, free_port, RedisServer};
use tollgate::inflight::{InFlight, Permit, RedisInFlight};
use tollgate::store::Error;

/// A runtime whose tasks (renewals, releases) run on both cores.
fn runtime(threads: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .unwrap()
}

/// One gateway instance's store. The deadline is generous: these tests check leases,
/// not latency, on a machine that may be busy.
async fn instance(url: &str, lease: Duration) -> RedisInFlight {
    RedisInFlight::builder(url)
        .prefix("tg")
        .lease(lease)
        .deadline(Duration::from_secs(1))
        .connect()
        .await
        .unwrap()
}

async fn take(store: &RedisInFlight, key: &[u8], max: u64) -> Option<Permit> {
    store.acquire(key, max).await.unwrap()
}

/// `ZCARD` of a Redis key, through a raw connection.
fn zcard(port: u16, name: &str) -> u64 {
    let reply = command(port, &format!("ZCARD {name}")).unwrap();
    reply.trim().trim_start_matches(':').parse().unwrap()
}

/// Polls `attempt` every 10 ms until it gives a value, failing after `within`.
async fn eventually<T, F, Fut>(within: Duration, what: &str, mut attempt: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = attempt().await {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Over TLS (`rediss://`, Redis requiring a client certificate), permits are taken
/// and counted in Redis as over plain TCP.
#[cfg(feature = "redis-tls")]
#[test]
fn permits_work_over_tls() {
    let files = redis_server::TlsFiles::generate("inflight");
    let server = RedisServer::start_tls(&files, "yes");
    runtime(2).block_on(async {
        let store = RedisInFlight::builder(server.tls_url())
            .prefix("tg")
            .deadline(Duration::from_secs(1))
            .tls(tollgate::store::RedisTls {
                ca_pem: Some(files.read("ca.pem")),
                client_pem: Some((files.read("client.pem"), files.read("client.key"))),
            })
            .connect()
            .await
            .unwrap();
        let first = take(&store, b"k", 1).await;
        assert!(first.is_some());
        assert!(
            take(&store, b"k", 1).await.is_none(),
            "the one permit is taken"
        );
    });
    assert!(
        server.calls("evalsha") + server.calls("eval") >= 2,
        "counted in Redis"
    );
}

#[test]
fn two_instances_share_one_max() {
    let server = RedisServer::start();
    let (url, port) = (server.url(), server.port);
    runtime(2).block_on(async {
        let a = instance(&url, Duration::from_secs(30)).await;
        let b = instance(&url, Duration::from_secs(30)).await;
        let name = a.key_name(b"user:1");
        assert_eq!(name, b.key_name(b"user:1"));
        let mut held = vec![
            take(&a, b"user:1", 3).await.expect("1st of 3"),
            take(&b, b"user:1", 3).await.expect("2nd of 3"),
            take(&a, b"user:1", 3).await.expect("3rd of 3"),
        ];
        assert!(take(&a, b"user:1", 3).await.is_none(), "4th on A");
        assert!(take(&b, b"user:1", 3).await.is_none(), "4th on B");
        assert_eq!(zcard(port, &name), 3, "refusals add no lease");
        // Another key has its own permits.
        let other = take(&b, b"user:2", 3).await.expect("another key");

        // A permit of A ends: B gets one, once the release reached Redis.
        drop(held.remove(0));
        let again = eventually(Duration::from_secs(2), "B after A's release", || {
            take(&b, b"user:1", 3)
        })
        .await;
        held.push(again);
        assert!(take(&a, b"user:1", 3).await.is_none());
        assert_eq!(zcard(port, &name), 3);

        // Everything ends: the sets empty, and Redis drops empty sets.
        drop(held);
        drop(other);
        eventually(Duration::from_secs(2), "every lease released", || async {
            (server.dbsize() == 0).then_some(())
        })
        .await;
    });
}

#[test]
fn a_crashed_instance_leaks_nothing() {
    let server = RedisServer::start();
    let (url, port) = (server.url(), server.port);
    // Long enough that a stalled machine does not let a lease lapse before the test
    // means it to (renewals come every third of it).
    let lease = Duration::from_secs(1);
    // Instance A runs on its own runtime, which renews its leases in the background.
    let crashing = runtime(1);
    let a = crashing.block_on(instance(&url, lease));
    let permits: Vec<Permit> = crashing.block_on(async {
        let mut permits = Vec::new();
        for i in 0..3 {
            permits.push(take(&a, b"k", 3).await.unwrap_or_else(|| panic!("{i}")));
        }
        permits
    });
    let rt = runtime(1);
    let b = rt.block_on(instance(&url, lease));
    assert!(rt.block_on(take(&b, b"k", 3)).is_none(), "A holds all 3");

    // A crashes: no permit is dropped (no release), no renewal runs any more.
    for permit in permits {
        std::mem::forget(permit);
    }
    crashing.shutdown_background();
    drop(a);
    assert_eq!(
        zcard(port, &b.key_name(b"k")),
        3,
        "the leases are still there"
    );

    // Once the leases expire, B gets all 3 permits. A took them one after another, so
    // they expire a few milliseconds apart: each is waited for.
    rt.block_on(async {
        let first = eventually(Duration::from_secs(6), "A's 1st lease expires", || {
            take(&b, b"k", 3)
        })
        .await;
        let second = eventually(Duration::from_secs(3), "A's 2nd lease expires", || {
            take(&b, b"k", 3)
        })
        .await;
        let third = eventually(Duration::from_secs(3), "A's 3rd lease expires", || {
            take(&b, b"k", 3)
        })
        .await;
        assert!(take(&b, b"k", 3).await.is_none());
        assert_eq!(
            zcard(port, &b.key_name(b"k")),
            3,
            "only B's leases are left"
        );
        drop((first, second, third));
    });
}

#[test]
fn a_held_permit_is_renewed() {
    let server = RedisServer::start();
    let url = server.url();
    runtime(2).block_on(async {
        // Renewed every third of the lease: a renewal would have to be 1 s late for B
        // to get the permit on a machine that works.
        let lease = Duration::from_millis(1_500);
        let a = instance(&url, lease).await;
        let b = instance(&url, lease).await;
        let permit = take(&a, b"k", 1).await.expect("the only permit");
        let start = Instant::now();
        let mut refused = 0;
        while start.elapsed() < Duration::from_millis(4_000) {
            let at = start.elapsed();
            assert!(
                take(&b, b"k", 1).await.is_none(),
                "B got a permit {at:?} into A's lease of {lease:?}: it was not renewed"
            );
            refused += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(refused > 10, "only {refused} attempts in 4 s");
        drop(permit);
        let after = eventually(Duration::from_secs(2), "B after A's release", || {
            take(&b, b"k", 1)
        })
        .await;
        drop(after);
    });
}

#[test]
fn an_unreachable_redis_fails_fast() {
    // A free port with nothing listening.
    let port = free_port();
    runtime(1).block_on(async {
        let deadline = Duration::from_millis(100);
        let store = RedisInFlight::builder(format!("redis://127.0.0.1:{port}"))
            .deadline(deadline)
            .connect()
            .await
            .expect("connecting is lazy");
        for _ in 0..3 {
            let start = Instant::now();
            let answer = store.acquire(b"k", 3).await;
            let took = start.elapsed();
            assert!(
                matches!(answer, Err(Error::Timeout(_) | Error::Backend { .. })),
                "{answer:?}"
            );
            assert!(took < deadline + Duration::from_secs(1), "took {took:?}");
        }
    });
}

#[test]
fn a_restarted_redis_works_again() {
    let mut server = RedisServer::start();
    let url = server.url();
    let rt = runtime(2);
    let store = rt.block_on(instance(&url, Duration::from_secs(30)));
    let permit = rt.block_on(take(&store, b"k", 1)).expect("first");
    server.restart(); // empty: the lease and the script are gone
    rt.block_on(async {
        // The connection comes back, and the script is loaded again.
        let again = eventually(Duration::from_secs(3), "Redis back", || async {
            store.acquire(b"k", 1).await.ok().flatten()
        })
        .await;
        drop(permit); // its lease is gone already: releasing it harms nothing
        assert!(
            take(&store, b"k", 1).await.is_none(),
            "the new permit is held"
        );
        drop(again);
    });
}

#[test]
fn a_cluster_url_is_refused() {
    runtime(1).block_on(async {
        match RedisInFlight::builder("redis+cluster://127.0.0.1:7000,127.0.0.1:7001")
            .connect()
            .await
        {
            Err(Error::Backend { message, .. }) => {
                assert!(message.contains("Cluster"), "{message}")
            }
            other => panic!("a cluster URL must be refused, got {other:?}"),
        }
    });
}

#[test]
fn tricky_keys_are_distinct_sets_with_one_hash_tag() {
    let server = RedisServer::start();
    let (url, port) = (server.url(), server.port);
    runtime(1).block_on(async {
        let store = instance(&url, Duration::from_secs(30)).await;
        let keys: [&[u8]; 8] = [b"a:b", b"a_b", b"{a}", b"a}", b"{", b"a b", b"", b"%"];
        let mut names: Vec<String> = Vec::new();
        let mut permits = Vec::new();
        for key in keys {
            let name = store.key_name(key);
            assert_eq!(name.matches('{').count(), 1, "{key:?} -> {name}");
            assert_eq!(name.matches('}').count(), 1, "{key:?} -> {name}");
            assert!(!name.contains(' '), "{key:?} -> {name}");
            let tag = &name[name.find('{').unwrap() + 1..name.find('}').unwrap()];
            assert!(!tag.is_empty(), "{key:?} -> {name}");
            // Each key has its own set: max 1 admits one permit per key.
            permits.push(take(&store, key, 1).await.expect("a key of its own"));
            assert_eq!(zcard(port, &name), 1, "{key:?} -> {name}");
            names.push(name);
        }
        let mut distinct = names.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), keys.len(), "{names:?}");
        drop(permits);
    });
}
