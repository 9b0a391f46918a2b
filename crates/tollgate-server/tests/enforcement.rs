//! The emergency switch (`GET`/`POST /v1/enforcement`) with a real client against the
//! real binary: a domain switched to shadow is answered OK (decided, counted, reported)
//! while another is still enforced; the switch survives a reload, shows in `/rules` and
//! a metric, answers only with the admin token, refuses a bad body; on a Redis shared by
//! two instances, a switch made on one applies on the other, also while clients keep
//! sending to both; and the gateway lets requests of a switched domain through.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

#[path = "../../tollgate/tests/support/redis_server.rs"]
mod redis_server;
mod support;

use std::time::{Duration, Instant};

use redis_server::RedisServer;
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};
use support::upstream::start_upstream;
use support::{free_port, tempdir, Proxy, Server};

/// Two domains of the same rule.
fn domain(name: &str) -> String {
    format!(
        "domain: {name}\ndescriptors:\n  - key: user\n    rate_limit: {{unit: minute, requests_per_unit: 2}}\n"
    )
}

const TOKEN: &str = "switch-Token_7";

fn rules(name: &str) -> std::path::PathBuf {
    let dir = tempdir(&format!("enforcement-{name}"));
    for name in ["api", "other"] {
        std::fs::write(dir.join(format!("{name}.yaml")), domain(name)).unwrap();
    }
    dir
}

/// `POST /v1/check` of `domain` for user `u`: the status and the body.
async fn check(c: &Client, server: &Server, domain: &str, user: &str) -> (StatusCode, Value) {
    let r = c
        .post(format!("{}/v1/check", server.http))
        .json(&json!({"domain": domain, "descriptors": [{"user": user}]}))
        .send()
        .await
        .unwrap();
    let status = r.status();
    (status, r.json().await.unwrap())
}

/// `POST /v1/enforcement` with `body` (and the admin token when `token`).
async fn switch(c: &Client, server: &Server, body: Value, token: bool) -> (StatusCode, Value) {
    let mut request = c.post(format!("{}/v1/enforcement", server.http));
    if token {
        request = request.bearer_auth(TOKEN);
    }
    let r = request.json(&body).send().await.unwrap();
    let status = r.status();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// `GET path` with the admin token, as JSON.
async fn admin_json(c: &Client, server: &Server, path: &str) -> Value {
    c.get(format!("{}{path}", server.http))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_domain_switched_to_shadow_is_answered_ok_until_it_is_switched_back() {
    let c = Client::new();
    let dir = rules("memory");
    let server = Server::start(&dir, &["--admin-token", TOKEN]).await;
    for domain in ["api", "other"] {
        for _ in 0..2 {
            assert_eq!(check(&c, &server, domain, "a").await.0, StatusCode::OK);
        }
        assert_eq!(
            check(&c, &server, domain, "a").await.0,
            StatusCode::TOO_MANY_REQUESTS
        );
    }

    // Only the admin may switch, with a body that says what to switch.
    let asked = json!({"domain": "api", "mode": "shadow"});
    assert_eq!(
        switch(&c, &server, asked.clone(), false).await.0,
        StatusCode::UNAUTHORIZED
    );
    let (status, body) = switch(&c, &server, json!({"domain": "api", "mode": "off"}), true).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body["error"].as_str().unwrap().contains("`off`"), "{body}");
    let (status, body) = switch(&c, &server, json!({"mode": "shadow"}), true).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");

    let (status, body) = switch(&c, &server, asked, true).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["enforcement"]["domains"]["api"], "shadow", "{body}");
    assert_eq!(body["enforcement"]["all"], "enforce", "{body}");
    assert_eq!(body["shared"], Value::Null, "{body}");
    let change = &body["enforcement"]["last_change"];
    assert!(
        change["by"].as_str().unwrap().starts_with("127.0.0.1:"),
        "{body}"
    );
    assert!(
        change["at_unix"].as_u64().unwrap() > 1_700_000_000,
        "{body}"
    );

    // `api` is over its limit but answered OK, its status flagged shadow; `other` is
    // still enforced.
    let (status, body) = check(&c, &server, "api", "a").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["descriptors"][0]["shadow"], true, "{body}");
    assert_eq!(
        check(&c, &server, "other", "a").await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Decided and counted: a fresh key of `api` still spends its limit.
    for remaining in [1, 0] {
        let (_, body) = check(&c, &server, "api", "b").await;
        assert_eq!(body["descriptors"][0]["remaining"], remaining, "{body}");
    }
    let metrics = server.get_text("/metrics").await;
    assert!(
        metrics.contains("tollgate_enforcement_shadow{domain=\"api\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("tollgate_enforcement_shadow{domain=\"*\"} 0"));
    assert!(
        metrics.contains("tollgate_shadow_mode_total{domain=\"api\""),
        "{metrics}"
    );

    // Shown in /rules, and kept by a reload.
    let shown = admin_json(&c, &server, "/rules").await;
    assert_eq!(shown["enforcement"]["domains"]["api"], "shadow", "{shown}");
    let reload = c
        .post(format!("{}/reload", server.http))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(reload.status(), StatusCode::OK);
    assert_eq!(check(&c, &server, "api", "a").await.0, StatusCode::OK);
    assert_eq!(
        admin_json(&c, &server, "/v1/enforcement").await["enforcement"]["domains"]["api"],
        "shadow"
    );

    // Every domain to shadow, then every domain back to enforce.
    assert_eq!(
        switch(&c, &server, json!({"domain": "*", "mode": "shadow"}), true)
            .await
            .0,
        StatusCode::OK
    );
    assert_eq!(check(&c, &server, "other", "a").await.0, StatusCode::OK);
    let (status, body) = switch(&c, &server, json!({"domain": "*", "mode": "enforce"}), true).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["enforcement"]["domains"], json!({}), "{body}");
    for domain in ["api", "other"] {
        assert_eq!(
            check(&c, &server, domain, "a").await.0,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
}

/// Polls `check` of `domain` on `server` until it answers `want`; how long it took.
async fn until(c: &Client, server: &Server, domain: &str, want: StatusCode) -> Duration {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(10) {
        if check(c, server, domain, "a").await.0 == want {
            return started.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{domain} never answered {want} on {}", server.http);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_on_one_instance_applies_to_another_sharing_redis() {
    let redis = RedisServer::start();
    let url = redis.url();
    let dir = rules("redis");
    let args = ["--store", url.as_str(), "--admin-token", TOKEN];
    let a = Server::start(&dir, &args).await;
    let b = Server::start(&dir, &args).await;
    let c = Client::new();
    for _ in 0..2 {
        assert_eq!(check(&c, &a, "api", "a").await.0, StatusCode::OK);
    }
    assert_eq!(
        check(&c, &b, "api", "a").await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    let (status, body) = switch(&c, &a, json!({"domain": "api", "mode": "shadow"}), true).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["shared"], true, "{body}");
    let took = until(&c, &b, "api", StatusCode::OK).await;
    eprintln!("switched on one instance, applied on the other after {took:?}");
    assert_eq!(
        admin_json(&c, &b, "/v1/enforcement").await["enforcement"]["domains"]["api"],
        "shadow"
    );
    // Switched back on the other instance: the first one enforces again.
    let (status, _) = switch(&c, &b, json!({"domain": "*", "mode": "enforce"}), true).await;
    assert_eq!(status, StatusCode::OK);
    until(&c, &a, "api", StatusCode::TOO_MANY_REQUESTS).await;
    // A new instance reads the switch as it starts.
    for _ in 0..2 {
        assert_eq!(check(&c, &a, "other", "a").await.0, StatusCode::OK);
    }
    switch(&c, &a, json!({"domain": "other", "mode": "shadow"}), true).await;
    let late = Server::start(&dir, &args).await;
    until(&c, &late, "other", StatusCode::OK).await;
    assert_eq!(
        admin_json(&c, &late, "/v1/enforcement").await["enforcement"]["domains"]["other"],
        "shadow"
    );
    drop(redis);
}

/// Under load: clients keep sending to two instances sharing Redis while the switch is
/// thrown on one of them and back on the other. Each instance goes over to shadow (every
/// answer OK, the would-be rejections counted) and back to enforcing (429s again) while
/// the traffic runs, and no request fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_switch_applies_to_two_instances_under_load() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    let redis = RedisServer::start();
    let url = redis.url();
    let dir = rules("load");
    let args = ["--store", url.as_str(), "--admin-token", TOKEN];
    let servers = [
        Arc::new(Server::start(&dir, &args).await),
        Arc::new(Server::start(&dir, &args).await),
    ];
    let c = Client::new();
    let stop = Arc::new(AtomicBool::new(false));
    // Per instance: answers seen, and whether the last one was a 429.
    let counts: Arc<[[AtomicU64; 3]; 2]> = Arc::new(Default::default());
    let mut tasks = Vec::new();
    for (i, server) in servers.iter().enumerate() {
        for t in 0..4 {
            let (c, server, stop, counts) = (
                c.clone(),
                Arc::clone(server),
                Arc::clone(&stop),
                Arc::clone(&counts),
            );
            tasks.push(tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    // Ten users per task, each far past its 2 a minute.
                    let user = format!("u{i}-{t}-{}", n % 10);
                    n += 1;
                    let status = check(&c, &server, "api", &user).await.0;
                    let slot = match status {
                        StatusCode::OK => 0,
                        StatusCode::TOO_MANY_REQUESTS => 1,
                        _ => 2,
                    };
                    counts[i][slot].fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
    }
    let seen = |i: usize, slot: usize| counts[i][slot].load(Ordering::Relaxed);
    // Wait (under the load) until an instance's answers are all `want` for 300 ms.
    let settled = |i: usize, ok: bool| {
        let counts = Arc::clone(&counts);
        async move {
            let started = Instant::now();
            let mut since = Instant::now();
            let mut last = (
                counts[i][0].load(Ordering::Relaxed),
                counts[i][1].load(Ordering::Relaxed),
            );
            while started.elapsed() < Duration::from_secs(10) {
                tokio::time::sleep(Duration::from_millis(20)).await;
                let now = (
                    counts[i][0].load(Ordering::Relaxed),
                    counts[i][1].load(Ordering::Relaxed),
                );
                let wrong = if ok { now.1 > last.1 } else { now.0 > last.0 };
                let moved = now.0 + now.1 > last.0 + last.1;
                if wrong || !moved {
                    since = Instant::now();
                } else if since.elapsed() >= Duration::from_millis(300) {
                    return started.elapsed();
                }
                last = now;
            }
            panic!(
                "instance {i} never settled to {}",
                if ok { "OK" } else { "429" }
            );
        }
    };
    settled(0, false).await;
    settled(1, false).await;
    let (status, _) = switch(
        &c,
        &servers[0],
        json!({"domain": "api", "mode": "shadow"}),
        true,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let on = tokio::join!(settled(0, true), settled(1, true));
    let (status, _) = switch(
        &c,
        &servers[1],
        json!({"domain": "api", "mode": "enforce"}),
        true,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let off = tokio::join!(settled(0, false), settled(1, false));
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    eprintln!(
        "under load, from the switch: shadow on each instance after {on:?}, enforcing on each after {off:?} (each + 300 ms steady); answers (OK, 429, failed) {:?}",
        [0, 1].map(|i| [seen(i, 0), seen(i, 1), seen(i, 2)])
    );
    for (i, server) in servers.iter().enumerate() {
        assert_eq!(seen(i, 2), 0, "instance {i}: a request failed");
        let metrics = server.get_text("/metrics").await;
        assert!(
            metrics.contains("tollgate_shadow_mode_total{domain=\"api\""),
            "instance {i} counted no would-be rejection in shadow"
        );
    }
    drop(redis);
}

#[tokio::test]
async fn the_gateway_lets_a_switched_domains_requests_through() {
    let dir = tempdir("enforcement-gateway");
    std::fs::write(
        dir.join("edge.yaml"),
        "domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 1}
http:
  routes:
    - match: {path_prefix: /}
      rate_limits:
        - actions: [{remote_address: {}}]
",
    )
    .unwrap();
    let (_up, upstream) = start_upstream().await;
    let upstream = format!("http://{upstream}");
    let (proxy, admin_url) =
        Proxy::start_with_admin(&dir, &upstream, &["--admin-token", TOKEN]).await;
    let c = Client::new();
    let get = || async {
        c.get(format!("{}/a", proxy.url))
            .send()
            .await
            .unwrap()
            .status()
    };
    assert_eq!(get().await, StatusCode::OK);
    assert_eq!(get().await, StatusCode::TOO_MANY_REQUESTS);
    let mut switched = None;
    for _ in 0..100 {
        // The admin listener may still be starting.
        if let Ok(r) = c
            .post(format!("{admin_url}/v1/enforcement"))
            .bearer_auth(TOKEN)
            .json(&json!({"domain": "edge", "mode": "shadow"}))
            .send()
            .await
        {
            switched = Some(r.status());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(switched, Some(StatusCode::OK));
    assert_eq!(get().await, StatusCode::OK);
    let back = c
        .post(format!("{admin_url}/v1/enforcement"))
        .bearer_auth(TOKEN)
        .json(&json!({"domain": "*", "mode": "enforce"}))
        .send()
        .await
        .unwrap();
    assert_eq!(back.status(), StatusCode::OK);
    assert_eq!(get().await, StatusCode::TOO_MANY_REQUESTS);
}

/// With admin endpoints anyone can reach (no token, not on loopback), the switch is off:
/// 403, and nothing is switched.
#[tokio::test]
async fn the_switch_is_off_while_the_admin_endpoints_are_open() {
    let dir = rules("open");
    let port = free_port();
    let server = Server::start(&dir, &["--admin-listen", &format!("0.0.0.0:{port}")]).await;
    let c = Client::new();
    let admin_url = format!("http://127.0.0.1:{port}");
    let mut answer = None;
    for _ in 0..100 {
        if let Ok(r) = c
            .post(format!("{admin_url}/v1/enforcement"))
            .json(&json!({"domain": "api", "mode": "shadow"}))
            .send()
            .await
        {
            answer = Some((r.status(), r.json::<Value>().await.unwrap()));
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, body) = answer.expect("the admin listener answers");
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("admin token"),
        "{body}"
    );
    for _ in 0..2 {
        check(&c, &server, "api", "a").await;
    }
    assert_eq!(
        check(&c, &server, "api", "a").await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
}
