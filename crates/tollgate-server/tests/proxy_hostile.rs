//! `tollgate proxy` against a hostile client: paths spelled to slip past a route's
//! prefix, methods outside a route's list, client-address headers the client wrote
//! itself, IPv6 clients rotating addresses within their network. Requests are written
//! raw (an HTTP library would normalize the path before sending it).

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

mod support;

use support::upstream::{raw_request, start_upstream, Upstream};
use support::{tempdir, Proxy};

/// Ten requests per minute per client on `/api/`, reads only; a catch-all after it.
/// Loopback is a trusted proxy (the tests' requests come from it).
const RULES: &str = r#"domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: everything
    rate_limit: {unit: minute, requests_per_unit: 1000}
  - key: case
    rate_limit: {unit: minute, requests_per_unit: 2}
http:
  trusted_proxies: [127.0.0.0/8]
  allow: {cidrs: [10.42.0.0/16]}
  routes:
    - match: {path_prefix: /Exact/, case_sensitive: true, keep_path_parameters: true}
      rate_limits:
        - actions: [{generic_key: {descriptor_key: case, descriptor_value: all}}]
    - match: {path_prefix: /api/, methods: [GET]}
      rate_limits:
        - actions: [{remote_address: {}}]
    - match: {}
      rate_limits:
        - actions: [{generic_key: {descriptor_key: everything, descriptor_value: all}}]
"#;

async fn gateway(name: &str, rules: &str) -> (Upstream, Proxy) {
    support::minute::away_from_a_minute_boundary(10);
    let (up, addr) = start_upstream().await;
    let dir = tempdir(name);
    std::fs::write(dir.join("edge.yaml"), rules).unwrap();
    let proxy = Proxy::start(&dir, &format!("http://{addr}"), &[]).await;
    (up, proxy)
}

/// The status of `method path` sent raw with `headers` (lines ending in `\r\n`).
async fn status(proxy: &Proxy, method: &str, path: &str, headers: &str) -> u16 {
    let request = format!("{method} {path} HTTP/1.1\r\nhost: t\r\n{headers}\r\n");
    raw_request(&proxy.addr, &request).await.0
}

/// How many of `n` requests the gateway let through.
async fn admitted(proxy: &Proxy, method: &str, path: &str, headers: &str, n: usize) -> usize {
    let mut ok = 0;
    for _ in 0..n {
        let code = status(proxy, method, path, headers).await;
        assert!(code == 200 || code == 429, "{method} {path}: {code}");
        ok += usize::from(code == 200);
    }
    ok
}

#[tokio::test]
async fn every_spelling_of_a_path_meets_the_routes_limit_and_is_forwarded_normalized() {
    let (up, proxy) = gateway("paths", RULES).await;
    // Each spelling from its own client (X-Forwarded-For through trusted loopback), so
    // each gets the route's full limit of 10, and no more, out of 15.
    let spellings = [
        "/api/items",
        "/%61pi/items",
        "//api/items",
        "/./api/items",
        "/x/../api/items",
        "/%2e/api/items",
        "/api;x=1/items",
        "/API/items",
        "/;p/api/items",
        "/x/..;/api/items",
    ];
    for (i, path) in spellings.iter().enumerate() {
        let client = format!("x-forwarded-for: 198.51.100.{i}\r\n");
        assert_eq!(
            admitted(&proxy, "GET", path, &client, 15).await,
            10,
            "{path}"
        );
    }
    // The upstream saw what was matched: the path in normal form (case and `;`
    // parameters are the upstream's to read, and the route ignored them).
    let paths = up.paths();
    let normal = |p: &str| paths.iter().filter(|seen| seen.as_str() == p).count();
    assert_eq!(normal("/api/items"), 80, "{paths:?}");
    assert_eq!(normal("/api;x=1/items"), 10);
    assert_eq!(normal("/API/items"), 10);
}

#[tokio::test]
async fn a_path_that_cannot_be_normalized_is_refused() {
    let (up, proxy) = gateway("unnormal", RULES).await;
    for path in [
        "/api%2Fitems",
        "/api/%2f../x",
        "/api/%00",
        "/api/%zz",
        "/api/%5c",
    ] {
        assert_eq!(status(&proxy, "GET", path, "").await, 400, "{path}");
    }
    assert!(up.paths().is_empty(), "{:?}", up.paths());
}

#[tokio::test]
async fn methods_are_matched_without_case_and_get_covers_head() {
    let (_up, proxy) = gateway("methods", RULES).await;
    let client = |i: u8| format!("x-forwarded-for: 198.51.100.{i}\r\n");
    assert_eq!(
        admitted(&proxy, "HEAD", "/api/items", &client(1), 12).await,
        10
    );
    assert_eq!(
        admitted(&proxy, "get", "/api/items", &client(2), 12).await,
        10
    );
    // A method outside the route's list falls through to the catch-all route.
    assert_eq!(
        admitted(&proxy, "PATCH", "/api/items", &client(3), 12).await,
        12
    );
}

#[tokio::test]
async fn a_case_sensitive_route_compares_case_and_parameters() {
    let (_up, proxy) = gateway("case", RULES).await;
    assert_eq!(admitted(&proxy, "GET", "/Exact/x", "", 3).await, 2);
    // Another case, or parameters, are another path for this route: the catch-all.
    assert_eq!(admitted(&proxy, "GET", "/exact/x", "", 3).await, 3);
    assert_eq!(admitted(&proxy, "GET", "/Exact;v=1/x", "", 3).await, 3);
}

#[tokio::test]
async fn a_forwarded_header_the_client_wrote_is_not_read() {
    let (_up, proxy) = gateway("forwarded", RULES).await;
    // nginx appends the client to X-Forwarded-For and passes `Forwarded` through: a
    // client rotating its own `Forwarded` is still the address nginx saw.
    let mut ok = 0;
    for i in 0..15 {
        let headers = format!("forwarded: for=1.2.3.{i}\r\nx-forwarded-for: 198.51.100.77\r\n");
        ok += usize::from(status(&proxy, "GET", "/api/items", &headers).await == 200);
    }
    assert_eq!(ok, 10);
    // Nor does it reach the allow list.
    let allowed = "forwarded: for=10.42.0.9\r\nx-forwarded-for: 198.51.100.78\r\n";
    assert_eq!(admitted(&proxy, "GET", "/api/items", allowed, 12).await, 10);
}

#[tokio::test]
async fn the_configured_header_is_the_one_read() {
    let rules = RULES.replace(
        "trusted_proxies: [127.0.0.0/8]",
        "trusted_proxies: [127.0.0.0/8]\n  client_address_header: forwarded",
    );
    let (_up, proxy) = gateway("forwarded-configured", &rules).await;
    // Now `Forwarded` names the client, and X-Forwarded-For is the one ignored.
    for i in 0..3 {
        let headers = format!("forwarded: for=198.51.100.{i}\r\nx-forwarded-for: 6.6.6.6\r\n");
        assert_eq!(
            admitted(&proxy, "GET", "/api/items", &headers, 12).await,
            10
        );
    }
}

#[tokio::test]
async fn an_ipv6_client_is_keyed_by_its_network() {
    let (_up, proxy) = gateway("ipv6", RULES).await;
    // 15 addresses of one /64: one client.
    let mut ok = 0;
    for i in 0..15 {
        let headers = format!("x-forwarded-for: 2001:db8:1:2::{i:x}\r\n");
        ok += usize::from(status(&proxy, "GET", "/api/items", &headers).await == 200);
    }
    assert_eq!(ok, 10);
    // Another /64 is another client.
    let other = "x-forwarded-for: 2001:db8:1:3::1\r\n";
    assert_eq!(admitted(&proxy, "GET", "/api/items", other, 1).await, 1);
}

/// A query parameter and a header that rules read, and a small limit on everything.
const READS: &str = r#"domain: reads
descriptors:
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: bot
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: everything
    rate_limit: {unit: minute, requests_per_unit: 3}
http:
  deny: {values: {api_key: [revoked]}}
  routes:
    - match: {path_prefix: /q/}
      rate_limits:
        - actions: [{query_parameter: {query_parameter_name: key, descriptor_key: api_key}}]
    - match: {path_prefix: /h/}
      rate_limits:
        - actions: [{header_value_match: {descriptor_key: bot, descriptor_value: curl, headers: [{name: user-agent, prefix_match: curl}]}}]
    - match: {}
      rate_limits:
        - actions: [{generic_key: {descriptor_key: everything, descriptor_value: all}}]
"#;

/// The status and the whole answer of `request`, sent raw (it should ask to close).
async fn answer(proxy: &Proxy, request: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(&proxy.addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut all = Vec::new();
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        stream.read_to_end(&mut all),
    )
    .await;
    let all = String::from_utf8_lossy(&all).into_owned();
    let code = all
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, all)
}

#[tokio::test]
async fn a_repeated_query_parameter_that_a_rule_reads_is_refused() {
    let (up, proxy) = gateway("query-twice", READS).await;
    assert_eq!(status(&proxy, "GET", "/q/x?key=revoked", "").await, 403);
    assert_eq!(status(&proxy, "GET", "/q/x?key=fine", "").await, 200);
    // A revoked key sent second met no deny list: the first one was read.
    for query in [
        "key=a&key=revoked",
        "key=a&other=1&key=a",
        "key=a&k%65y=revoked",
        "key&key=revoked",
    ] {
        let request = format!("GET /q/x?{query} HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n");
        let (code, body) = answer(&proxy, &request).await;
        assert_eq!(code, 400, "{query}");
        assert!(
            body.contains("the query parameter `key` comes more than once"),
            "{query}: {body}"
        );
    }
    assert_eq!(up.paths().len(), 1, "{:?}", up.paths());
    // A parameter no rule reads may repeat.
    assert_eq!(
        status(&proxy, "GET", "/q/x?key=b&tag=1&tag=2", "").await,
        200
    );
}

#[tokio::test]
async fn a_repeated_header_that_a_header_match_reads_is_refused() {
    let (up, proxy) = gateway("match-twice", READS).await;
    assert_eq!(
        status(&proxy, "GET", "/h/x", "user-agent: curl/8\r\n").await,
        200
    );
    let request =
        "GET /h/x HTTP/1.1\r\nhost: t\r\nuser-agent: browser\r\nuser-agent: curl/8\r\nconnection: close\r\n\r\n";
    let (code, body) = answer(&proxy, request).await;
    assert_eq!(code, 400);
    assert!(
        body.contains("the header `user-agent` comes more than once"),
        "{body}"
    );
    assert_eq!(up.paths().len(), 1, "{:?}", up.paths());
}

#[tokio::test]
async fn a_request_without_host_is_refused_before_it_is_counted() {
    let (up, proxy) = gateway("no-host", READS).await;
    for _ in 0..5 {
        let (code, body) = answer(&proxy, "GET /any HTTP/1.1\r\nconnection: close\r\n\r\n").await;
        assert_eq!(code, 400);
        assert!(body.contains("exactly one Host header"), "{body}");
    }
    // None of the five was charged: the limit of 3 is whole.
    assert_eq!(admitted(&proxy, "GET", "/any", "", 4).await, 3);
    assert_eq!(up.paths().len(), 3, "{:?}", up.paths());
}
