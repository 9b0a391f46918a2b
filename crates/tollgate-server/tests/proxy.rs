//! `tollgate proxy` end to end: a real upstream on loopback, the gateway binary in front
//! of it, and real HTTP clients. Limits and their headers, trusted-proxy client
//! addresses, allow and deny lists, lockouts, fallbacks, concurrency permits released
//! by a client that goes away, shaping, and upstream failures mapped to 502 / 504.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

mod support;

use std::time::{Duration, Instant};

use reqwest::{Client, StatusCode};
use serde_json::Value;
use support::upstream::{raw_get, raw_request, start_upstream, wait_for_200, Upstream};
use support::{tempdir, Proxy};
use tokio::io::AsyncReadExt;

const EDGE: &str = r#"domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 3, name: per_ip}
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 1, block_duration: 1h, name: per_key}
  - key: search
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: shaped
    rate_limit: {unit: second, requests_per_unit: 2, algorithm: leaky_bucket, mode: queue, burst: 4, name: shaped}
http:
  deny: {cidrs: [192.0.2.0/24], values: {api_key: [revoked]}}
  routes:
    - match: {path_prefix: /api/, methods: [GET, POST]}
      rate_limits:
        - actions: [{remote_address: {}}]
    - match: {path_prefix: /keyed/}
      rate_limits:
        - actions: [{request_headers: {header_name: x-api-key, descriptor_key: api_key}}]
    - match: {path_prefix: /search}
      rate_limits:
        - actions: [{generic_key: {descriptor_key: search, descriptor_value: all}}]
      fallback: {status: 200, content_type: application/json, body: '{"results":[]}'}
    - match: {path_prefix: /stream}
      max_in_flight:
        - actions: [{remote_address: {}}]
          limit: 1
    - match: {path_prefix: /shaped}
      rate_limits:
        - actions: [{generic_key: {descriptor_key: shaped, descriptor_value: all}}]
"#;

/// A second domain whose section trusts loopback as a proxy (as if a load balancer
/// ran on this host) and lets 10.1.0.0/16 through unlimited.
const BEHIND_LB: &str = r#"domain: lb
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 1, name: lb_per_ip}
http:
  trusted_proxies: [127.0.0.0/8]
  allow: {cidrs: [10.1.0.0/16]}
  routes:
    - match: {path_prefix: /lb/}
      rate_limits:
        - actions: [{remote_address: {}}]
"#;

/// The upstream: records when each request arrived; `/stream` sends a chunk every 20
/// ms until the client goes away; `/hang` never answers.
async fn gateway(name: &str, extra: &[&str]) -> (Upstream, Proxy) {
    // The tests count against per-minute limits from here on.
    support::minute::away_from_a_minute_boundary(10);
    let (up, addr) = start_upstream().await;
    let dir = tempdir(name);
    std::fs::write(dir.join("edge.yaml"), EDGE).unwrap();
    std::fs::write(dir.join("lb.yaml"), BEHIND_LB).unwrap();
    let proxy = Proxy::start(&dir, &format!("http://{addr}"), extra).await;
    (up, proxy)
}

#[tokio::test]
async fn limits_answer_429_with_the_draft_headers_and_a_problem_body() {
    let (up, proxy) = gateway("limits", &[]).await;
    let c = Client::new();
    for remaining in [2, 1, 0] {
        let r = c
            .get(format!("{}/api/items?x=1", proxy.url))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        let h = r.headers();
        // draft-ietf-httpapi-ratelimit-headers-10: a List of Items, each a String
        // naming the policy with integer parameters.
        assert_eq!(h["ratelimit-policy"], "\"per_ip\";q=3;w=60");
        let rl = h["ratelimit"].to_str().unwrap();
        let prefix = format!("\"per_ip\";r={remaining};t=");
        assert!(rl.starts_with(&prefix), "{rl}");
        let t: u64 = rl[prefix.len()..].parse().unwrap();
        assert!((1..=60).contains(&t), "{rl}");
        assert_eq!(r.text().await.unwrap(), "upstream saw /api/items");
    }
    let r = c
        .post(format!("{}/api/items", proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry));
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    assert!(r.headers()["ratelimit"]
        .to_str()
        .unwrap()
        .starts_with("\"per_ip\";r=0;t="));
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["status"], 429);
    assert_eq!(body["violated_policies"][0]["policy"], "per_ip");
    assert_eq!(
        up.arrivals.lock().unwrap().len(),
        3,
        "the 429 never went upstream"
    );
    // A method or path no route matches is not limited.
    for _ in 0..5 {
        let r = c
            .delete(format!("{}/api/items", proxy.url))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        assert!(r.headers().get("ratelimit").is_none());
        let r = c.get(format!("{}/public", proxy.url)).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
}

#[tokio::test]
async fn a_gateway_without_routes_says_so_at_start() {
    let (_up, addr) = start_upstream().await;
    let dir = tempdir("no-routes");
    std::fs::write(
        dir.join("api.yaml"),
        "domain: api\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
    )
    .unwrap();
    let log = dir.join("proxy.log");
    let proxy = Proxy::start_logging(&dir, &format!("http://{addr}"), &[], &log).await;
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(
        said.contains("no rule file has an `http` section with routes: the gateway limits nothing"),
        "{said}"
    );
    drop(proxy);
    // With routes, no such warning.
    std::fs::write(dir.join("api.yaml"), EDGE).unwrap();
    let proxy = Proxy::start_logging(&dir, &format!("http://{addr}"), &[], &log).await;
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(!said.contains("limits nothing"), "{said}");
    drop(proxy);
}

/// The status code of the answer to `request` (raw HTTP/1.1) on a new connection.
async fn raw_status(addr: &str, request: &str) -> u16 {
    raw_request(addr, request).await.0
}

#[tokio::test]
async fn ambiguous_headers_are_refused_not_forwarded() {
    let (up, proxy) = gateway("ambiguous", &[]).await;
    // A revoked key sent second met no deny list before: the first one was read.
    let twice =
        "GET /keyed/x HTTP/1.1\r\nhost: t\r\nx-api-key: fresh\r\nx-api-key: revoked\r\n\r\n";
    assert_eq!(raw_status(&proxy.addr, twice).await, 400);
    // Two Host headers, or none on HTTP/1.1 (RFC 9112 §3.2).
    let hosts = "GET /search HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n";
    assert_eq!(raw_status(&proxy.addr, hosts).await, 400);
    let no_host = "GET /search HTTP/1.1\r\n\r\n";
    assert_eq!(raw_status(&proxy.addr, no_host).await, 400);
    // A header no rule reads may repeat; one key once is served.
    let fine =
        "GET /keyed/y HTTP/1.1\r\nhost: t\r\nx-api-key: fresh\r\naccept: a\r\naccept: b\r\n\r\n";
    assert_eq!(raw_status(&proxy.addr, fine).await, 200);
    assert_eq!(up.paths(), ["/keyed/y"]);
}

#[tokio::test]
async fn forwarded_for_is_believed_only_from_trusted_proxies() {
    let (up, proxy) = gateway("xff", &[]).await;
    let c = Client::new();
    // `edge` trusts nobody: a client rotating X-Forwarded-For is still one client.
    let statuses: Vec<u16> = futures_util::future::join_all((0..5).map(|i| {
        c.get(format!("{}/api/x", proxy.url))
            .header("x-forwarded-for", format!("203.0.113.{i}"))
            .send()
    }))
    .await
    .into_iter()
    .map(|r| r.unwrap().status().as_u16())
    .collect();
    assert_eq!(
        statuses.iter().filter(|&&s| s == 200).count(),
        3,
        "{statuses:?}"
    );
    // The gateway appends the address it saw to what it forwards.
    let seen = up.arrivals.lock().unwrap()[0].2.clone().unwrap();
    assert!(seen.ends_with(", 127.0.0.1"), "{seen}");
    // `lb` trusts loopback: the address left of it is the client, one limit each.
    for ip in ["198.51.100.1", "198.51.100.2"] {
        let first = c
            .get(format!("{}/lb/x", proxy.url))
            .header("x-forwarded-for", format!("6.6.6.6, {ip}"))
            .send()
            .await
            .unwrap();
        assert_eq!(first.status(), StatusCode::OK);
        let second = c
            .get(format!("{}/lb/x", proxy.url))
            .header("x-forwarded-for", format!("1.2.3.4, {ip}"))
            .send()
            .await
            .unwrap();
        assert_eq!(
            second.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "spoofing the left part does not escape the limit"
        );
    }
    // The allow list: never limited.
    for _ in 0..3 {
        let r = c
            .get(format!("{}/lb/x", proxy.url))
            .header("x-forwarded-for", "10.1.2.3")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
    }
}

#[tokio::test]
async fn deny_lists_lockouts_and_fallbacks() {
    let (up, proxy) = gateway("lists", &[]).await;
    let c = Client::new();
    let key = |k: &'static str| {
        c.get(format!("{}/keyed/x", proxy.url))
            .header("x-api-key", k)
            .send()
    };
    let denied = key("revoked").await.unwrap();
    assert_eq!(denied.status(), StatusCode::FORBIDDEN);
    assert_eq!(denied.headers()["content-type"], "application/problem+json");
    // One per minute, then locked out for an hour: Retry-After says the hour.
    assert_eq!(key("k1").await.unwrap().status(), StatusCode::OK);
    let locked = key("k1").await.unwrap();
    assert_eq!(locked.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = locked.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((3_590..=3_600).contains(&retry), "{retry}");
    assert_eq!(key("k2").await.unwrap().status(), StatusCode::OK);
    // The search route degrades: its fallback instead of a 429.
    let first = c
        .get(format!("{}/search?q=a", proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(first.text().await.unwrap(), "upstream saw /search");
    let degraded = c
        .get(format!("{}/search?q=a", proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(degraded.status(), StatusCode::OK);
    assert_eq!(degraded.headers()["content-type"], "application/json");
    assert!(degraded.headers()["ratelimit"]
        .to_str()
        .unwrap()
        .contains(";r=0;"));
    assert_eq!(degraded.text().await.unwrap(), r#"{"results":[]}"#);
    assert_eq!(up.paths(), ["/keyed/x", "/keyed/x", "/search"]);
}

#[tokio::test]
async fn a_permit_comes_back_when_the_client_goes_away_mid_response() {
    let (_up, proxy) = gateway("permits", &[]).await;
    let (code, mut first) = raw_get(&proxy.addr, "/stream").await;
    assert_eq!(code, 200);
    let mut chunk = [0u8; 64];
    assert!(
        first.read(&mut chunk).await.unwrap() > 0,
        "the body streams"
    );
    // One in flight per client: a second request waits for nothing, it is refused.
    let (code, _) = raw_get(&proxy.addr, "/stream").await;
    assert_eq!(code, 429);
    drop(first);
    // The first client hung up mid-body: its permit is released.
    wait_for_200(&proxy.addr, "/stream", "the permit never came back").await;
}

#[tokio::test]
async fn a_queue_mode_leaky_bucket_spaces_requests_out_instead_of_refusing() {
    let (up, proxy) = gateway("shaping", &[]).await;
    let c = Client::new();
    // 2 per second with room for 4: 8 at once → 4 are sent at 500 ms spacing (one
    // at once, three queued), 4 are refused. (The spacing is wide so that a busy
    // machine spreading the 8 decisions out over up to half a second does not let a
    // 5th in.)
    let sent = Instant::now();
    let statuses: Vec<u16> = futures_util::future::join_all(
        (0..8).map(|_| c.get(format!("{}/shaped", proxy.url)).send()),
    )
    .await
    .into_iter()
    .map(|r| r.unwrap().status().as_u16())
    .collect();
    assert_eq!(
        statuses.iter().filter(|&&s| s == 200).count(),
        4,
        "{statuses:?}"
    );
    assert_eq!(statuses.iter().filter(|&&s| s == 429).count(), 4);
    let mut at: Vec<Instant> = up
        .arrivals
        .lock()
        .unwrap()
        .iter()
        .filter(|a| a.0 == "/shaped")
        .map(|a| a.1)
        .collect();
    at.sort();
    // The queue drains at the configured rate: the k-th request reaches the upstream
    // no sooner than k × 500 ms after the first was decided, hence after they were
    // sent (unshaped, all four would arrive within a few ms). A busy machine can only
    // make an arrival later, never earlier, so this bound does not flake; the 5 ms
    // are for timer rounding.
    let since_sent: Vec<u128> = at.iter().map(|a| (*a - sent).as_millis()).collect();
    for (k, ms) in since_sent.iter().enumerate() {
        assert!(
            *ms + 5 >= 500 * k as u128,
            "request {k} arrived {ms} ms after sending: {since_sent:?}"
        );
    }
}

#[tokio::test]
async fn upstream_failures_answer_502_and_504() {
    // Nothing listens on the upstream's port.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_addr = dead.local_addr().unwrap();
    drop(dead);
    let dir = tempdir("bad-gateway");
    std::fs::write(dir.join("edge.yaml"), EDGE).unwrap();
    let proxy = Proxy::start(&dir, &format!("http://{dead_addr}"), &[]).await;
    let r = reqwest::get(format!("{}/public", proxy.url)).await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["status"], 502);

    let (_up, slow) = gateway("timeout", &["--upstream-timeout", "300ms"]).await;
    let started = Instant::now();
    let r = reqwest::get(format!("{}/hang", slow.url)).await.unwrap();
    assert_eq!(r.status(), StatusCode::GATEWAY_TIMEOUT);
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[tokio::test]
async fn the_admin_listener_serves_health_and_the_gateways_metrics() {
    let admin = format!("127.0.0.1:{}", support::free_port());
    let (_up, proxy) = gateway("admin", &["--admin-listen", &admin]).await;
    let client = Client::new();
    let admin_url = format!("http://{admin}");
    wait_for_200(&admin, "/readyz", "the admin listener").await;

    let mut codes = Vec::new();
    for _ in 0..4 {
        let r = client
            .get(format!("{}/api/items", proxy.url))
            .send()
            .await
            .unwrap();
        codes.push(r.status().as_u16());
    }
    assert_eq!(codes, [200, 200, 200, 429]);
    // Not routed: not decided, not counted.
    let r = client
        .get(format!("{}/elsewhere", proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);

    let metrics = client
        .get(format!("{admin_url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "tollgate_total_hits_total{domain=\"edge\",descriptor=\"remote_address\"} 4",
        "tollgate_over_limit_total{domain=\"edge\",descriptor=\"remote_address\"} 1",
        "tollgate_within_limit_total{domain=\"edge\",descriptor=\"remote_address\"} 3",
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "missing {line:?} in:\n{metrics}"
        );
    }
    assert!(
        metrics.contains("tollgate_decision_duration_seconds_count 4"),
        "{metrics}"
    );
    let health = client
        .get(format!("{admin_url}/healthcheck"))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), StatusCode::OK);
    // The check APIs stay on `serve`: the gateway's admin port has none.
    let check = client
        .post(format!("{admin_url}/v1/check"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(check.status(), StatusCode::NOT_FOUND);
}
