//! Multi-region limits (`scope: global`, `--region`, `--global-store`) between real
//! `tollgate serve` processes: two regions, each with its own Redis and two instances,
//! and a global Redis they share. A global limit holds for all regions together (with
//! few global calls), a regional one in each region; with the global store stopped, the
//! leases in hand are spent, then each instance's fallback share, then leasing resumes
//! when it comes back; what cannot be configured is refused.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

#[path = "../../tollgate/tests/support/redis_server.rs"]
mod redis_server;
mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis_server::RedisServer;
use support::{serve_refused, tempdir, Server};

/// Two instances of `region` on its Redis `regional`, beside the shared `global` one.
/// Deadlines of seconds on both stores: a loaded machine must not turn a slow answer
/// into a failure mode.
async fn region(dir: &std::path::Path, name: &str, regional: &str, global: &str) -> Vec<Server> {
    let args = [
        "--region",
        name,
        "--store",
        regional,
        "--global-store",
        global,
        "--redis-deadline",
        "5s",
        "--global-store-deadline",
        "5s",
        "--workers",
        "1",
    ];
    let mut servers = Vec::new();
    for _ in 0..2 {
        servers.push(Server::start(dir, &args).await);
    }
    servers
}

/// The sum of the samples of metric `name` (its whole name, `_total` included) whose
/// labels include every one of `labels`, in `/metrics` text; `None` when there is none.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (set, value) = match rest.strip_prefix('{') {
            Some(r) => match r.split_once("} ") {
                Some((set, value)) => (set, value),
                None => continue,
            },
            None => match rest.strip_prefix(' ') {
                Some(value) => ("", value),
                None => continue,
            },
        };
        if labels
            .iter()
            .all(|(k, v)| set.split(',').any(|p| p == format!("{k}=\"{v}\"")))
        {
            let v: f64 = value.trim().parse().unwrap();
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// [`sample`] of `server`'s `/metrics` now, 0 when absent.
async fn metric(server: &Server, name: &str, labels: &[(&str, &str)]) -> f64 {
    sample(&server.get_text("/metrics").await, name, labels).unwrap_or(0.0)
}

/// `POST /v1/check` of `{domain: world, descriptors: [{key: "x"}]}`: the status.
async fn check(client: &reqwest::Client, server: &Server, key: &str) -> u16 {
    let body = serde_json::json!({"domain": "world", "descriptors": [{key: "x"}]});
    client
        .post(format!("{}/v1/check", server.http))
        .json(&body)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// `total` checks of `key` from `in_flight` concurrent clients, client `c` sending to
/// `servers[c % servers.len()]`: how many each server admitted. Any status but 200 and
/// 429 fails the test.
async fn admitted_per_server(
    servers: &[&Server],
    in_flight: usize,
    total: u64,
    key: &'static str,
) -> Vec<u64> {
    let sent = Arc::new(AtomicU64::new(0));
    let admitted: Arc<Vec<AtomicU64>> =
        Arc::new(servers.iter().map(|_| AtomicU64::new(0)).collect());
    let urls: Arc<Vec<String>> = Arc::new(servers.iter().map(|s| s.http.clone()).collect());
    let mut clients = Vec::new();
    for c in 0..in_flight {
        let (sent, admitted, urls) = (Arc::clone(&sent), Arc::clone(&admitted), Arc::clone(&urls));
        clients.push(tokio::spawn(async move {
            let client = reqwest::Client::new();
            let i = c % urls.len();
            let body = serde_json::json!({"domain": "world", "descriptors": [{key: "x"}]});
            while sent.fetch_add(1, Ordering::Relaxed) < total {
                let status = client
                    .post(format!("{}/v1/check", urls[i]))
                    .json(&body)
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16();
                match status {
                    200 => {
                        admitted[i].fetch_add(1, Ordering::Relaxed);
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
    admitted.iter().map(|a| a.load(Ordering::Relaxed)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_limit_of_600_admits_588_to_600_across_two_regions_and_a_regional_300_admits_300_in_each(
) {
    let (global, east, west) = (
        RedisServer::start(),
        RedisServer::start(),
        RedisServer::start(),
    );
    let dir = tempdir("regions-limits");
    // fail_closed: a global call that failed could only admit fewer, never more.
    std::fs::write(
        dir.join("world.yaml"),
        "domain: world\nfailure_mode: fail_closed\ndescriptors:\n  - key: shared\n    scope: global\n    rate_limit: {unit: minute, requests_per_unit: 600}\n  - key: local\n    rate_limit: {unit: minute, requests_per_unit: 300}\n",
    )
    .unwrap();
    let g = global.url();
    let e = region(&dir, "east", &east.url(), &g).await;
    let w = region(&dir, "west", &west.url(), &g).await;
    let all = [&e[0], &w[0], &e[1], &w[1]];

    // 2,000 calls, 100 in flight, on one key of the global limit, over both regions.
    support::minute::away_from_a_minute_boundary(20);
    let calls_before = global.script_calls();
    let started = Instant::now();
    let admitted = admitted_per_server(&all, 100, 2_000, "shared").await;
    let elapsed = started.elapsed().as_secs_f64();
    let calls = global.script_calls() - calls_before;
    let total: u64 = admitted.iter().sum();
    let (in_east, in_west) = (admitted[0] + admitted[2], admitted[1] + admitted[3]);
    eprintln!(
        "global: {total} admitted (east {in_east}, west {in_west}; per instance {admitted:?}), {calls} global Redis calls, {elapsed:.2}s"
    );
    assert!(
        (588..=600).contains(&total),
        "{total} admitted of a global 600 (east {in_east}, west {in_west}) in {elapsed:.2}s"
    );
    assert!(in_east > 0 && in_west > 0, "east {in_east}, west {in_west}");
    assert!(
        calls * 10 < 2_000,
        "{calls} global Redis calls for 2,000 decisions"
    );
    // The global limit is counted in the global Redis alone.
    assert_eq!((east.dbsize(), west.dbsize()), (0, 0));
    assert!(global.dbsize() > 0);

    // The regional limit: 1,000 calls in each region at once (50 in flight each), one
    // key, 300 a minute in each region's own Redis.
    support::minute::away_from_a_minute_boundary(20);
    let global_keys = global.dbsize();
    let (east_servers, west_servers) = ([&e[0], &e[1]], [&w[0], &w[1]]);
    let (east_admitted, west_admitted) = tokio::join!(
        admitted_per_server(&east_servers, 50, 1_000, "local"),
        admitted_per_server(&west_servers, 50, 1_000, "local"),
    );
    let (east_admitted, west_admitted): (u64, u64) =
        (east_admitted.iter().sum(), west_admitted.iter().sum());
    assert_eq!((east_admitted, west_admitted), (300, 300));
    assert!(east.dbsize() > 0 && west.dbsize() > 0);
    // (The global key may expire meanwhile, no key may appear.)
    let now_in_global = global.dbsize();
    assert!(
        now_in_global <= global_keys,
        "a regional key in the global Redis: {global_keys} keys, then {now_in_global}"
    );

    // Every series carries the instance's region; each instance took leases of the
    // global rule and counted its global calls.
    for (server, mine, other) in [
        (&e[0], "east", "west"),
        (&e[1], "east", "west"),
        (&w[0], "west", "east"),
        (&w[1], "west", "east"),
    ] {
        let text = server.get_text("/metrics").await;
        let series: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("tollgate_"))
            .collect();
        assert!(!series.is_empty());
        let unlabelled: Vec<&&str> = series
            .iter()
            .filter(|l| !l.contains(&format!("region=\"{mine}\"")))
            .collect();
        assert!(
            unlabelled.is_empty(),
            "{mine}: without its region: {unlabelled:?}"
        );
        assert!(
            !text.contains(&format!("region=\"{other}\"")),
            "{mine}:\n{text}"
        );
        let rule = [
            ("region", mine),
            ("domain", "world"),
            ("descriptor", "shared"),
        ];
        let leases = sample(&text, "tollgate_leases_total", &rule);
        assert!(leases.is_some_and(|n| n > 0.0), "{mine}: leases {leases:?}");
        let region = [("region", mine)];
        let global_calls = sample(&text, "tollgate_global_store_calls_total", &region);
        assert!(
            global_calls.is_some_and(|n| n > 0.0),
            "{mine}: {global_calls:?}"
        );
        let failures = sample(&text, "tollgate_global_store_failures_total", &region);
        assert_eq!(failures, Some(0.0), "{mine}");
        let timed = sample(
            &text,
            "tollgate_global_lease_duration_seconds_count",
            &region,
        );
        assert!(timed.is_some_and(|n| n > 0.0), "{mine}: {timed:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_global_store_stopped_leases_in_hand_then_each_region_its_fallback_share_then_leasing_resumes(
) {
    let mut global = RedisServer::start();
    let (east, west) = (RedisServer::start(), RedisServer::start());
    let dir = tempdir("regions-down");
    // In fallback, 600 / (2 instances x 2 regions) = 150 a minute on each instance: 300
    // in each region. Leases of two seconds' worth (and given back only after eight idle
    // seconds): the instances still hold some when the global Redis stops.
    std::fs::write(
        dir.join("world.yaml"),
        "domain: world\nfailure_mode: local_fallback\nlocal_fallback_divisor: 2\nregions: 2\ndescriptors:\n  - key: shared\n    scope: global\n    lease_period: 2s\n    rate_limit: {unit: minute, requests_per_unit: 600}\n",
    )
    .unwrap();
    let g = global.url();
    let e = region(&dir, "east", &east.url(), &g).await;
    let w = region(&dir, "west", &west.url(), &g).await;
    let all: [(&Server, &str); 4] = [
        (&e[0], "east"),
        (&e[1], "east"),
        (&w[0], "west"),
        (&w[1], "west"),
    ];
    let rule = |region: &'static str| {
        [
            ("region", region),
            ("domain", "world"),
            ("descriptor", "shared"),
        ]
    };
    let fallbacks = |region: &'static str| {
        [
            ("region", region),
            ("domain", "world"),
            ("descriptor", "shared"),
            ("mode", "local_fallback"),
        ]
    };

    // The fallback windows are minutes: the run up to the end of the outage stays in one.
    support::minute::away_from_a_minute_boundary(25);
    // 50 checks on each instance at a steady pace: all admitted, from leases of the
    // global store.
    let phase = all.iter().map(|&(server, _)| async move {
        let client = reqwest::Client::new();
        for n in 0..50 {
            assert_eq!(check(&client, server, "shared").await, 200, "check {n}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    futures_util::future::join_all(phase).await;
    global.kill();
    // (A lease the global Redis answered just before it stopped is in hand by now.)
    tokio::time::sleep(Duration::from_millis(200)).await;
    // What each instance could hold when the global store went: what it leased, less the
    // 50 it spent (a lease answered just before the kill is in, a unit given back is not).
    let mut held = Vec::new();
    for &(server, region) in &all {
        let text = server.get_text("/metrics").await;
        let leased = sample(&text, "tollgate_leased_units_total", &rule(region)).unwrap_or(0.0);
        assert!(
            leased >= 50.0,
            "{region}: {leased} units leased for 50 admitted"
        );
        assert_eq!(
            sample(&text, "tollgate_store_fallbacks_total", &fallbacks(region)),
            None
        );
        held.push(leased as u64 - 50);
    }

    // The outage: each instance is sent checks one at a time until 30 in a row are
    // refused. Until its first fallback decision every check is admitted from leases in
    // hand; from then on, every one is the fallback's.
    let outage = all.iter().map(|&(server, region)| async move {
        let client = reqwest::Client::new();
        let (mut sent, mut admitted, mut from_leases, mut refused_in_a_row) = (0u64, 0u64, 0u64, 0);
        let mut fallen_back = false;
        while refused_in_a_row < 30 {
            assert!(
                sent < 2_000,
                "{region}: still admitting after {sent} checks"
            );
            let status = check(&client, server, "shared").await;
            sent += 1;
            if status == 200 {
                admitted += 1;
                refused_in_a_row = 0;
            } else {
                assert_eq!(status, 429);
                refused_in_a_row += 1;
            }
            if !fallen_back {
                fallen_back = metric(server, "tollgate_store_fallbacks_total", &fallbacks(region))
                    .await
                    > 0.0;
                if !fallen_back {
                    assert_eq!(status, 200, "{region}: refused from leases in hand");
                    from_leases += 1;
                }
            }
        }
        let by_fallback =
            metric(server, "tollgate_store_fallbacks_total", &fallbacks(region)).await as u64;
        (sent, admitted, from_leases, by_fallback)
    });
    let outcomes = futures_util::future::join_all(outage).await;
    eprintln!("held at the stop {held:?}; (sent, admitted, from leases, by fallback) {outcomes:?}");
    let mut region_admitted = [0u64; 2];
    let mut region_held = [0u64; 2];
    for (i, (&(_, region), &(sent, admitted, from_leases, by_fallback))) in
        all.iter().zip(&outcomes).enumerate()
    {
        // Leases first, then the failure mode alone.
        assert_eq!(
            sent.saturating_sub(by_fallback),
            from_leases,
            "{region} #{i}: decided from leases after the first fallback decision"
        );
        assert!(
            from_leases <= held[i],
            "{region} #{i}: {from_leases} from leases, {} held",
            held[i]
        );
        // The fallback share of an instance: 600 / 4, all of it (its window is fresh).
        assert_eq!(
            admitted - from_leases,
            150,
            "{region} #{i}: admitted by the fallback"
        );
        region_admitted[i / 2] += admitted;
        region_held[i / 2] += held[i];
    }
    for (r, region) in ["east", "west"].into_iter().enumerate() {
        assert!(
            region_admitted[r] <= region_held[r] + 300,
            "{region}: {} admitted in the outage, {} held in leases",
            region_admitted[r],
            region_held[r]
        );
    }
    let spent_from_leases: u64 = outcomes.iter().map(|o| o.2).sum();
    assert!(
        spent_from_leases > 0,
        "no lease in hand was spent: {outcomes:?}"
    );
    for &(server, region) in &all {
        let text = server.get_text("/metrics").await;
        let failures = sample(
            &text,
            "tollgate_global_store_failures_total",
            &[("region", region)],
        );
        assert!(failures.is_some_and(|n| n > 0.0), "{region}: {failures:?}");
        let down = sample(
            &text,
            "tollgate_global_fallback_seconds_total",
            &[("region", region)],
        );
        assert!(down.is_some_and(|s| s > 0.0), "{region}: {down:?}");
    }

    // The global Redis again (empty): each instance takes a new lease, and admits from
    // the global store again, not from its fallback.
    global.restart();
    let client = reqwest::Client::new();
    for &(server, region) in &all {
        let leases = metric(server, "tollgate_leases_total", &rule(region)).await;
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let fell_back =
                metric(server, "tollgate_store_fallbacks_total", &fallbacks(region)).await;
            let status = check(&client, server, "shared").await;
            let after = metric(server, "tollgate_store_fallbacks_total", &fallbacks(region)).await;
            if status == 200 && after == fell_back {
                break;
            }
            assert!(Instant::now() < deadline, "{region}: leasing never resumed");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let now = metric(server, "tollgate_leases_total", &rule(region)).await;
        assert!(now > leases, "{region}: no new lease ({leases} then {now})");
    }
    assert!(global.script_calls() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_synced_global_limit_is_refused_with_its_place_and_a_global_store_needs_a_redis_store() {
    let dir = tempdir("regions-refused");
    let bad = dir.join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    let file = bad.join("synced.yaml");
    std::fs::write(
        &file,
        "domain: world\ndescriptors:\n  - key: shared\n    scope: global\n    consistency: synced\n    rate_limit: {unit: minute, requests_per_unit: 600}\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["validate", bad.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let place = format!("{}:4:12: ", file.display());
    assert!(
        stderr.contains(&format!("{place}`scope: global` limits are leased from the global store, so they cannot be `consistency: synced`")),
        "{stderr}"
    );
    assert!(stderr.ends_with("1 error(s)\n"), "{stderr}");

    // A global store beside the in-memory store, or a global store that is not Redis.
    let good = dir.join("good");
    std::fs::create_dir_all(&good).unwrap();
    std::fs::write(
        good.join("world.yaml"),
        "domain: world\ndescriptors:\n  - key: shared\n    scope: global\n    rate_limit: {unit: minute, requests_per_unit: 600}\n",
    )
    .unwrap();
    let said = serve_refused(
        &good,
        &[
            "--store",
            "memory",
            "--global-store",
            "redis://127.0.0.1:6399",
        ],
    );
    assert!(
        said.contains(
            "a global store (`redis://127.0.0.1:6399`) needs a Redis store beside it, not `memory`"
        ),
        "{said}"
    );
    let regional = RedisServer::start();
    let said = serve_refused(
        &good,
        &[
            "--store",
            regional.url().as_str(),
            "--global-store",
            "memory",
        ],
    );
    assert!(
        said.contains("the global store must be Redis, not `memory`"),
        "{said}"
    );
}

/// A request is all or nothing: one that its regional limit rejects is not charged to
/// its global limit (with `charge_rejected: over_limit`, only the limit it is over is
/// charged), as on one store. The global check must be decided in the global store here
/// (`over_limit`); its charge is given back, in the background, when the region rejects
/// the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_its_regional_limit_rejects_is_not_charged_to_its_global_limit() {
    let (global, regional, single) = (
        RedisServer::start(),
        RedisServer::start(),
        RedisServer::start(),
    );
    let dir = tempdir("regions-all-or-nothing");
    std::fs::write(
        dir.join("world.yaml"),
        "domain: world\ncharge_rejected: over_limit\ndescriptors:\n  - key: shared\n    scope: global\n    rate_limit: {unit: minute, requests_per_unit: 100}\n  - key: local\n    rate_limit: {unit: minute, requests_per_unit: 2}\n",
    )
    .unwrap();
    let deadline = ["--redis-deadline", "5s", "--global-store-deadline", "5s"];
    let (g, r, one) = (global.url(), regional.url(), single.url());
    let split = Server::start(
        &dir,
        &[
            &["--store", r.as_str(), "--global-store", g.as_str()][..],
            &deadline,
        ]
        .concat(),
    )
    .await;
    // The same rules on one store (no global store: `scope` changes nothing there).
    let whole = Server::start(&dir, &[&["--store", one.as_str()][..], &deadline].concat()).await;
    support::minute::away_from_a_minute_boundary(10);
    let client = reqwest::Client::new();
    let both =
        serde_json::json!({"domain": "world", "descriptors": [{"shared": "x"}, {"local": "x"}]});
    let alone = serde_json::json!({"domain": "world", "descriptors": [{"shared": "x"}]});
    let mut left = Vec::new();
    for server in [&whole, &split] {
        let mut admitted = 0;
        for _ in 0..10 {
            let r = client
                .post(format!("{}/v1/check", server.http))
                .json(&both)
                .send()
                .await
                .unwrap();
            admitted += u32::from(r.status() == 200);
        }
        assert_eq!(admitted, 2, "{}", server.http);
        // The global charges of the rejected requests go back in the background.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let v: serde_json::Value = client
            .post(format!("{}/v1/check", server.http))
            .json(&alone)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        left.push(v["descriptors"][0]["remaining"].as_u64().unwrap());
    }
    // 100 - 2 admitted - this one.
    assert_eq!(left[0], 97, "one store");
    assert_eq!(left[1], 97, "regional and global stores");
}
