//! `tollgate serve` and `tollgate conformance` on a real Redis (and a real 3-master
//! Redis Cluster), started by the tests on free ports: shared cases, exactness across
//! four instances, TLS, gateways sharing Redis, `redis-prune`. What happens when Redis
//! dies or stops answering is in `redis_faults.rs`.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

#[path = "../../tollgate/tests/support/redis_server.rs"]
mod redis_server;
mod support;

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use redis_server::{RedisCluster, RedisServer, TlsFiles};
use support::{check_domain, spread_checks, tempdir, Server};

/// The repository's case files: the shared Envoy and Tollgate cases (kept identical to
/// `shared/cases`), and the project's own.
fn cases() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/cases")
}

fn conformance(store: &str, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["conformance", cases().to_str().unwrap(), "--store", store])
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// `--redis-ca-cert`, `--redis-client-cert` and `--redis-client-key` with `files`' CA and
/// client certificate.
fn tls_flags(files: &TlsFiles) -> Vec<String> {
    let mut flags = Vec::new();
    for (flag, file) in [
        ("--redis-ca-cert", "ca.pem"),
        ("--redis-client-cert", "client.pem"),
        ("--redis-client-key", "client.key"),
    ] {
        flags.push(flag.to_string());
        flags.push(files.path(file).to_string_lossy().into_owned());
    }
    flags
}

#[test]
fn every_shared_case_passes_on_a_redis_that_requires_tls() {
    let files = TlsFiles::generate("conformance");
    let redis = RedisServer::start_tls(&files, "yes");
    let flags = tls_flags(&files);
    let args: Vec<&str> = flags.iter().map(String::as_str).collect();
    let out = conformance(&redis.tls_url(), &args);
    assert!(out.ends_with(" passed, 0 failed\n"), "{out}");
    assert!(redis.script_calls() > 0, "decided in Redis");
}

#[test]
fn every_shared_case_passes_on_redis_and_on_a_redis_cluster() {
    let redis = RedisServer::start();
    let single = conformance(&redis.url(), &[]);
    assert!(single.ends_with(" passed, 0 failed\n"), "{single}");
    assert!(redis.script_calls() > 100, "the cases really ran on Redis");

    let cluster = RedisCluster::start();
    let spread = conformance(&cluster.url(), &[]);
    assert_eq!(single.lines().last(), spread.lines().last(), "{spread}");
    for node in &cluster.nodes {
        assert!(
            node.script_calls() > 0,
            "master {} took no script call",
            node.port
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_instances_on_one_redis_admit_exactly_the_limit() {
    let redis = RedisServer::start();
    let dir = tempdir("redis-exact");
    let mut rules = String::from("domain: exact\ndescriptors:\n");
    for alg in tollgate::store::SCRIPT_ALGORITHMS {
        rules.push_str(&format!(
            "  - key: alg\n    value: {alg}\n    rate_limit: {{unit: minute, requests_per_unit: 1000, algorithm: {alg}}}\n"
        ));
    }
    std::fs::write(dir.join("exact.yaml"), rules).unwrap();
    let store = redis.url();
    // A generous deadline: this test is about exactness, and a call that missed its
    // deadline would be answered by the failure mode (fail_open) instead.
    let args = [
        "--store",
        store.as_str(),
        "--blocked-cache",
        "0",
        "--redis-deadline",
        "5s",
    ];
    // Two instances with a connection per worker (the default), two sharing one.
    let mut servers = Vec::new();
    for i in 0..4 {
        let mut args = args.to_vec();
        args.extend(["--workers", "2"]);
        if i % 2 == 1 {
            args.push("--redis-shared-connection");
        }
        servers.push(Server::start(&dir, &args).await);
    }
    let urls: Vec<String> = servers.iter().map(|s| s.http.clone()).collect();
    for alg in tollgate::store::SCRIPT_ALGORITHMS {
        support::minute::away_from_a_minute_boundary(20);
        let started = Instant::now();
        let body = serde_json::json!({"domain": "exact", "descriptors": [{"alg": alg}]});
        let admitted = spread_checks(&urls, 200, 1_600, body).await;
        let elapsed = started.elapsed().as_secs_f64();
        if matches!(alg, "token_bucket" | "gcra" | "leaky_bucket") {
            // A bucket refills 1000/60 per second while the test runs: its documented
            // bound is burst + rate x elapsed.
            let bound = 1_000 + (1_000.0 * elapsed / 60.0).ceil() as u64;
            assert!(
                (1_000..=bound).contains(&admitted),
                "{alg}: {admitted} admitted in {elapsed:.2}s (bound {bound})"
            );
        } else {
            assert_eq!(admitted, 1_000, "{alg}");
        }
    }
    // Per instance: the store's shared connection, plus one per worker unless
    // --redis-shared-connection (every worker got client connections above).
    let info = redis_server::command(redis.port, "INFO clients").unwrap();
    let connected: usize = info
        .lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no connected_clients in {info}"));
    // Two instances with 1 + 2 connections, two with 1.
    assert_eq!(connected - 1, 2 * (1 + 2) + 2, "{info}");
}

/// Blocks until at least `margin` seconds are left in the current UTC day: a fixed or
/// sliding window of a day starts again at midnight.
fn away_from_a_day_boundary(margin: u64) {
    loop {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        if 86_400 - now.as_secs() % 86_400 > margin {
            return;
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

/// Script loads (`FUNCTION LOAD`, `SCRIPT LOAD`) and connections Redis has taken so far
/// (the one asking included), read with one `INFO all`.
fn loads_and_connections(port: u16) -> (u64, u64) {
    let info = redis_server::command(port, "INFO all").unwrap();
    let number = |prefix: &str| -> u64 {
        info.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    };
    let loads = number("cmdstat_function|load:calls=") + number("cmdstat_script|load:calls=");
    let connections = number("total_connections_received:");
    assert!(connections > 0, "no total_connections_received in {info}");
    (loads, connections)
}

/// Instances that have just started decide in Redis from their first request. Per
/// algorithm, four fresh `tollgate serve` (two with a connection per worker, two
/// sharing one) on a Redis holding no script, no library and no key, then 700 calls
/// with 100 in flight on one key limited to 300 a day. From the moment they are ready,
/// Redis sees no new connection and no script load (each worker's connection was made
/// and every script the rules can call was loaded before `/readyz` said ready), and
/// exactly 300 calls are admitted, none answered by a failure mode. Before the start-up
/// warm-up, the first calls made the connections and loaded the libraries under load:
/// with the default 20 ms deadline some timed out and `fail_open` admitted 302–374.
///
/// The deadline here is long: the connections and loads are counted by Redis itself,
/// and a short deadline would make the count depend on how busy the machine is (this
/// binary's other tests run beside it, and the instances are debug builds).
/// `tools/check-cold-start.sh` runs this test on release builds with the default 20 ms
/// (`COLD_START_DEADLINE`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_instances_decide_in_redis_from_their_first_request() {
    let redis = RedisServer::start();
    let dir = tempdir("redis-cold");
    let mut rules = String::from("domain: cold\ndescriptors:\n");
    for alg in tollgate::store::SCRIPT_ALGORITHMS {
        rules.push_str(&format!(
            "  - key: alg\n    value: {alg}\n    rate_limit: {{unit: day, requests_per_unit: 300, algorithm: {alg}}}\n"
        ));
    }
    std::fs::write(dir.join("cold.yaml"), rules).unwrap();
    let store = redis.url();
    let deadline = std::env::var("COLD_START_DEADLINE").unwrap_or_else(|_| "5s".into());
    let mut rounds = Vec::new();
    for alg in tollgate::store::SCRIPT_ALGORITHMS {
        for cmd in ["FUNCTION FLUSH", "SCRIPT FLUSH", "FLUSHALL"] {
            let said = redis_server::command(redis.port, cmd).unwrap();
            assert!(said.starts_with("+OK"), "{cmd}: {said}");
        }
        let mut servers = Vec::new();
        for i in 0..4 {
            let mut args = vec![
                "--store",
                store.as_str(),
                "--workers",
                "2",
                "--redis-deadline",
                deadline.as_str(),
            ];
            if i % 2 == 1 {
                args.push("--redis-shared-connection");
            }
            servers.push(Server::start(&dir, &args).await);
        }
        away_from_a_day_boundary(60);
        let (loads_before, connections_before) = loads_and_connections(redis.port);
        let urls: Vec<String> = servers.iter().map(|s| s.http.clone()).collect();
        let body = serde_json::json!({"domain": "cold", "descriptors": [{"alg": alg}]});
        let sent = Arc::new(AtomicU64::new(0));
        let admitted = Arc::new(AtomicU64::new(0));
        let mut clients = Vec::new();
        for c in 0..100 {
            let (sent, admitted, urls) = (sent.clone(), admitted.clone(), urls.clone());
            let body = body.clone();
            clients.push(tokio::spawn(async move {
                let client = reqwest::Client::new();
                let url = format!("{}/v1/check", urls[c % urls.len()]);
                while sent.fetch_add(1, Ordering::Relaxed) < 700 {
                    let status = client.post(&url).json(&body).send().await.unwrap().status();
                    match status.as_u16() {
                        200 => {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                        429 => {}
                        other => panic!("status {other}"),
                    }
                }
            }));
        }
        for c in clients {
            c.await.unwrap();
        }
        let mut failures = Vec::new();
        for server in &servers {
            let metrics = server.get_text("/metrics").await;
            failures.extend(
                metrics
                    .lines()
                    .filter(|l| {
                        l.starts_with("tollgate_store_errors_total{")
                            || l.starts_with("tollgate_store_fallbacks_total{")
                    })
                    .map(str::to_owned),
            );
        }
        let (loads_after, connections_after) = loads_and_connections(redis.port);
        rounds.push(Round {
            alg,
            admitted: admitted.load(Ordering::Relaxed),
            failures,
            loads: loads_after - loads_before,
            // Not counting the connection that asked the second time.
            connections: connections_after - connections_before - 1,
        });
    }
    // Every algorithm's first round: exactly the limit, from Redis alone, on
    // connections made and scripts loaded before the instances said they were ready.
    let expected: Vec<Round> = tollgate::store::SCRIPT_ALGORITHMS
        .iter()
        .map(|alg| Round {
            alg,
            admitted: 300,
            failures: Vec::new(),
            loads: 0,
            connections: 0,
        })
        .collect();
    assert_eq!(rounds, expected);
}

/// What one round of [`fresh_instances_decide_in_redis_from_their_first_request`] saw.
#[derive(Debug, PartialEq)]
struct Round {
    alg: &'static str,
    /// Calls admitted.
    admitted: u64,
    /// The store error and fallback lines of the instances' metrics.
    failures: Vec<String>,
    /// `FUNCTION LOAD` and `SCRIPT LOAD` calls Redis took during the round.
    loads: u64,
    /// Connections Redis accepted during the round.
    connections: u64,
}

/// A rule reload loads the scripts the new rules need before they serve: once `POST
/// /reload` has answered, Redis holds the library of every set of the new rules'
/// algorithms, and the first request under them loads nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_loads_the_new_rules_scripts_before_they_serve() {
    let redis = RedisServer::start();
    let dir = tempdir("redis-reload");
    let rule = |alg: &str| {
        format!("domain: r\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: 5, algorithm: {alg}}}\n")
    };
    std::fs::write(dir.join("r.yaml"), rule("fixed_window")).unwrap();
    let store = redis.url();
    let server = Server::start(&dir, &["--store", store.as_str(), "--redis-deadline", "5s"]).await;
    let library = |algs: &[&str]| tollgate::store::script_library(algs).unwrap().0;
    let list = redis_server::command(redis.port, "FUNCTION LIST").unwrap();
    assert!(list.contains(&library(&["fixed_window"])), "{list}");
    assert!(!list.contains(&library(&["gcra"])), "{list}");

    std::fs::write(dir.join("r.yaml"), rule("gcra")).unwrap();
    let reloaded = reqwest::Client::new()
        .post(format!("{}/reload", server.http))
        .send()
        .await
        .unwrap();
    assert_eq!(reloaded.status(), 200);
    let list = redis_server::command(redis.port, "FUNCTION LIST").unwrap();
    assert!(list.contains(&library(&["gcra"])), "{list}");
    let loads = redis.calls("function|load");
    let (status, _) = check_domain(&reqwest::Client::new(), &server.http, "r").await;
    assert_eq!(status, 200);
    assert_eq!(redis.calls("function|load"), loads, "no load on first use");
    assert!(redis.calls("fcall") > 0, "decided in Redis");
}

/// `tollgate serve --store rediss://…` with the CA and a client certificate (Redis
/// requires one) decides in Redis; a certificate file that cannot be read stops the
/// start, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_decides_on_a_redis_that_requires_tls() {
    let files = TlsFiles::generate("serve");
    let redis = RedisServer::start_tls(&files, "yes");
    let dir = tempdir("redis-tls");
    std::fs::write(
        dir.join("tls.yaml"),
        "domain: tls\nfailure_mode: fail_open\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 2}\n",
    )
    .unwrap();
    let url = redis.tls_url();
    let flags = tls_flags(&files);
    let mut args = vec!["--store", url.as_str(), "--redis-deadline", "2s"];
    args.extend(flags.iter().map(String::as_str));
    let server = Server::start(&dir, &args).await;
    let client = reqwest::Client::new();
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(check_domain(&client, &server.http, "tls").await.0);
    }
    // fail_open would admit all three: the third is Redis's rejection.
    assert_eq!(statuses, [200, 200, 429]);
    assert!(redis.script_calls() >= 3, "decided in Redis");
    let metrics = server.get_text("/metrics").await;
    assert!(
        !metrics.contains("tollgate_store_errors_total{"),
        "{metrics}"
    );

    let missing = dir.join("no-such-ca.pem");
    let args = [
        "--store",
        url.as_str(),
        "--redis-ca-cert",
        missing.to_str().unwrap(),
    ];
    let said = support::serve_refused(&dir, &args);
    assert!(
        said.contains("cannot read") && said.contains("no-such-ca.pem"),
        "{said}"
    );
    // Certificates for a store that cannot use them are refused, not ignored.
    let ca = files.path("ca.pem");
    for store in ["memory", redis.url().as_str()] {
        let args = ["--store", store, "--redis-ca-cert", ca.to_str().unwrap()];
        let said = support::serve_refused(&dir, &args);
        assert!(said.contains("rediss://"), "{store}: {said}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hammered_key_is_rejected_locally_and_counted() {
    let redis = RedisServer::start();
    let dir = tempdir("redis-cache");
    std::fs::write(
        dir.join("login.yaml"),
        "domain: login\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 3}\n",
    )
    .unwrap();
    let store = redis.url();
    // A request timed out by a stalled machine would be admitted uncharged (fail_open)
    // and spoil the count; this test is about the blocked-key cache, not deadlines.
    let server = Server::start(&dir, &["--store", store.as_str(), "--redis-deadline", "2s"]).await;
    let client = reqwest::Client::new();
    let body = serde_json::json!({"domain": "login", "descriptors": [{"user": "mallory"}]});
    let before = redis.script_calls();
    let mut rejected = 0;
    for _ in 0..1_003 {
        let r = client
            .post(format!("{}/v1/check", server.http))
            .json(&body)
            .send()
            .await
            .unwrap();
        if r.status() == 429 {
            rejected += 1;
            assert!(r.headers().get("retry-after").is_some());
        }
    }
    assert_eq!(rejected, 1_000);
    let calls = redis.script_calls() - before;
    assert!(
        calls <= 3 + 1 + rejected / 100,
        "{calls} Redis calls for {rejected} rejections"
    );
    let metrics = server.get_text("/metrics").await;
    assert!(
        metrics.contains(
            "tollgate_over_limit_with_local_cache_total{domain=\"login\",descriptor=\"user\"} 999"
        ),
        "{metrics}"
    );
}

/// Two gateways on one Redis: one limit, one set of concurrency permits (leases).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_one_redis_share_limits_and_permits() {
    use support::upstream::{raw_get, start_upstream, wait_for_200};
    use support::Proxy;
    // Counted against 5 per minute (Redis TIME) from here on.
    support::minute::away_from_a_minute_boundary(10);
    let redis = RedisServer::start();
    let (_up, upstream) = start_upstream().await;
    let dir = tempdir("gateways-redis");
    std::fs::write(
        dir.join("edge.yaml"),
        "domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 5}
http:
  routes:
    - match: {path_prefix: /api/}
      rate_limits:
        - actions: [{remote_address: {}}]
    - match: {path_prefix: /stream}
      max_in_flight:
        - actions: [{remote_address: {}}]
          limit: 1
",
    )
    .unwrap();
    let url = redis.url();
    let upstream = format!("http://{upstream}");
    let args = ["--store", url.as_str(), "--redis-deadline", "500ms"];
    let a = Proxy::start(&dir, &upstream, &args).await;
    let b = Proxy::start(&dir, &upstream, &args).await;
    let c = reqwest::Client::new();
    let mut admitted = 0;
    for i in 0..10 {
        let p = if i % 2 == 0 { &a } else { &b };
        let r = c.get(format!("{}/api/x", p.url)).send().await.unwrap();
        admitted += usize::from(r.status() == 200);
    }
    assert_eq!(admitted, 5, "one limit across both gateways");
    let (code, held) = raw_get(&a.addr, "/stream").await;
    assert_eq!(code, 200);
    let (code, _) = raw_get(&b.addr, "/stream").await;
    assert_eq!(code, 429, "the other gateway sees the permit taken");
    drop(held);
    wait_for_200(&b.addr, "/stream", "the lease was never released").await;
}

/// Loads a function library into `redis` with `redis-cli`.
fn function_load(redis: &RedisServer, library: &str) {
    use std::io::Write;
    let mut cli = Command::new("redis-cli")
        .args([
            "-p",
            &redis.port.to_string(),
            "-x",
            "FUNCTION",
            "LOAD",
            "REPLACE",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("redis-cli (apt-get install redis-tools)");
    cli.stdin
        .take()
        .unwrap()
        .write_all(library.as_bytes())
        .unwrap();
    let out = cli.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(!said.contains("ERR"), "FUNCTION LOAD: {said}");
}

/// `tollgate <args>`: its status and stdout.
fn tollgate(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn redis_prune_deletes_only_other_tollgate_versions_libraries() {
    let redis = RedisServer::start();
    let (ok, current) = tollgate(&["redis-script", "--library", "fixed_window"]);
    assert!(ok);
    function_load(&redis, &current);
    let current_name = current
        .lines()
        .next()
        .unwrap()
        .trim_start_matches("#!lua name=")
        .to_owned();
    let old: Vec<String> = ["a", "b"]
        .iter()
        .map(|d| format!("tollgate_{}", d.repeat(40)))
        .collect();
    for name in &old {
        function_load(
            &redis,
            &format!(
                "#!lua name={name}\nredis.register_function('{name}', function() return 1 end)\n"
            ),
        );
    }
    function_load(
        &redis,
        "#!lua name=mylib\nredis.register_function('myfn', function() return 1 end)\n",
    );
    let store = redis.url();
    let (ok, deleted) = tollgate(&["redis-prune", "--store", &store]);
    assert!(ok, "{deleted}");
    assert_eq!(deleted.lines().collect::<Vec<_>>(), old, "{deleted}");
    let list = redis_server::command(redis.port, "FUNCTION LIST").unwrap();
    assert!(list.contains(&current_name), "{list}");
    assert!(list.contains("mylib"), "{list}");
    assert!(!old.iter().any(|n| list.contains(n.as_str())), "{list}");
    // Nothing left to delete.
    let (ok, deleted) = tollgate(&["redis-prune", "--store", &store]);
    assert!(ok && deleted.is_empty(), "{deleted}");
    // A store that cannot be reached fails, naming it.
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["redis-prune", "--store", "memory"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("memory"));
}
