//! `RateLimitLayer` on an axum router, called without a socket (`oneshot`, the peer
//! address put in the request as axum's `ConnectInfo` would): routes, headers, and the
//! `http` section following the rule files' hot reload, request bytes charged
//! (declared, or streamed in batches).
#![allow(clippy::unwrap_used)]

#[path = "support/minute.rs"]
mod minute;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{Request, StatusCode};
use tollgate::http::RateLimitLayer;
use tollgate::limiter::Limiter;
use tollgate::rules::{LoadOptions, Rules};
use tollgate::store::MemoryStore;
use tower::ServiceExt;

fn rules_file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tollgate-layer-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("edge.yaml");
    std::fs::write(&file, text).unwrap();
    file
}

fn rules_for(path_prefix: &str) -> String {
    format!(
        "domain: edge
descriptors:
  - key: remote_address
    rate_limit: {{unit: minute, requests_per_unit: 1, name: per_ip}}
http:
  routes:
    - match: {{path_prefix: {path_prefix}}}
      rate_limits:
        - actions: [{{remote_address: {{}}}}]
"
    )
}

async fn status(app: &axum::Router, path: &str, peer: &str) -> (StatusCode, Option<String>) {
    let mut req = Request::get(path).body(Body::empty()).unwrap();
    let peer: SocketAddr = peer.parse().unwrap();
    req.extensions_mut().insert(ConnectInfo(peer));
    let r = app.clone().oneshot(req).await.unwrap();
    let legacy = r
        .headers()
        .get("x-ratelimit-remaining")
        .map(|v| v.to_str().unwrap().to_string());
    (r.status(), legacy)
}

#[tokio::test]
async fn the_http_section_follows_a_reload_and_a_broken_one_keeps_the_old() {
    // Counted against 1 per minute from here on (the system clock).
    minute::away_from_a_minute_boundary(10);
    let file = rules_file("reload", &rules_for("/a"));
    let rules = Arc::new(Rules::load(vec![file.clone()], LoadOptions::default()).unwrap());
    let limiter = Arc::new(Limiter::new(Arc::clone(&rules), MemoryStore::new()));
    let layer = RateLimitLayer::new(limiter).with_legacy_headers(true);
    let app = axum::Router::new().fallback(|| async { "ok" }).layer(layer);

    assert_eq!(
        status(&app, "/a", "192.0.2.1:5").await,
        (StatusCode::OK, Some("0".into()))
    );
    assert_eq!(
        status(&app, "/a", "192.0.2.1:6").await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        status(&app, "/a", "192.0.2.2:5").await.0,
        StatusCode::OK,
        "per client"
    );
    assert_eq!(
        status(&app, "/b", "192.0.2.1:5").await,
        (StatusCode::OK, None)
    );

    // The route moves to /b: the sections come with the new rules.
    std::fs::write(&file, rules_for("/b")).unwrap();
    rules.reload().unwrap();
    assert_eq!(status(&app, "/a", "192.0.2.3:5").await.0, StatusCode::OK);
    assert_eq!(
        status(&app, "/a", "192.0.2.3:5").await.0,
        StatusCode::OK,
        "/a is free now"
    );
    assert_eq!(status(&app, "/b", "192.0.2.3:5").await.0, StatusCode::OK);
    assert_eq!(
        status(&app, "/b", "192.0.2.3:5").await.0,
        StatusCode::TOO_MANY_REQUESTS
    );

    // A broken http section is a broken file: it does not load, with its place, and
    // the rules and routes in force stay, together.
    let broken = rules_for("/c").replace("path_prefix", "path_prefx");
    std::fs::write(&file, broken).unwrap();
    let e = rules.reload().unwrap_err();
    assert_eq!(e.0.len(), 1, "{e}");
    assert_eq!(e.0[0].line, 7, "{e}");
    assert!(e.0[0].message.contains("`path_prefx`"), "{e}");
    assert_eq!(status(&app, "/b", "192.0.2.4:5").await.0, StatusCode::OK);
    assert_eq!(
        status(&app, "/b", "192.0.2.4:5").await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(status(&app, "/c", "192.0.2.4:5").await.0, StatusCode::OK);
    assert_eq!(status(&app, "/c", "192.0.2.4:5").await.0, StatusCode::OK);
}

/// What an observer was told: domain, first descriptor's entries, overall code.
type Told = (String, Vec<(String, String)>, tollgate::limiter::Code);

/// Records what a `DecisionObserver` is told.
#[derive(Default)]
struct Seen(std::sync::Mutex<Vec<Told>>);

impl tollgate::http::DecisionObserver for Seen {
    fn decided(
        &self,
        request: &tollgate::limiter::RateLimitRequest,
        response: &tollgate::limiter::RateLimitResponse,
        _elapsed: std::time::Duration,
    ) {
        self.0.lock().unwrap().push((
            request.domain.clone(),
            request.descriptors[0].entries.clone(),
            response.overall,
        ));
    }
}

#[tokio::test]
async fn an_observer_is_told_of_every_decision_and_of_no_unlimited_request() {
    use tollgate::limiter::Code;
    minute::away_from_a_minute_boundary(10);
    let file = rules_file("observer", &rules_for("/a"));
    let rules = Arc::new(Rules::load(vec![file], LoadOptions::default()).unwrap());
    let limiter = Arc::new(Limiter::new(rules, MemoryStore::new()));
    let seen = Arc::new(Seen::default());
    let layer = RateLimitLayer::new(limiter)
        .with_observer(Arc::clone(&seen) as Arc<dyn tollgate::http::DecisionObserver>)
        .with_legacy_headers(true);
    let app = axum::Router::new().fallback(|| async { "ok" }).layer(layer);

    assert_eq!(status(&app, "/a", "192.0.2.1:5").await.0, StatusCode::OK);
    assert_eq!(
        status(&app, "/a", "192.0.2.1:5").await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(status(&app, "/b", "192.0.2.1:5").await.0, StatusCode::OK);

    let entries = vec![("remote_address".to_string(), "192.0.2.1".to_string())];
    assert_eq!(
        *seen.0.lock().unwrap(),
        [
            ("edge".to_string(), entries.clone(), Code::Ok),
            ("edge".to_string(), entries, Code::OverLimit),
        ],
        "two decisions on /a (the second over the limit, observer kept by with_legacy_headers); none for the unrouted /b"
    );
}

/// A client value longer than a descriptor value may be (64 KiB) is refused with 400,
/// not let through, and not answered 500 as the gateway's own mistake.
#[tokio::test]
async fn a_value_past_the_limiters_cap_is_a_bad_request() {
    let file = rules_file(
        "long-value",
        "domain: edge
descriptors:
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 100}
http:
  routes:
    - rate_limits:
        - actions: [{request_headers: {header_name: x-api-key, descriptor_key: api_key}}]
",
    );
    let rules = Arc::new(Rules::load(vec![file], LoadOptions::default()).unwrap());
    let limiter = Arc::new(Limiter::new(rules, MemoryStore::new()));
    let app = axum::Router::new()
        .fallback(|| async { "ok" })
        .layer(RateLimitLayer::new(limiter));
    let call = |key: String| {
        let mut req = Request::get("/")
            .header("x-api-key", key)
            .body(Body::empty())
            .unwrap();
        req.extensions_mut()
            .insert(ConnectInfo("192.0.2.9:1".parse::<SocketAddr>().unwrap()));
        app.clone().oneshot(req)
    };
    let r = call("k".repeat(65_537)).await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("the value is 65537 bytes"), "{text}");
    assert_eq!(
        call("k".repeat(65_536)).await.unwrap().status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn ipv6_clients_are_keyed_by_the_configured_prefix() {
    minute::away_from_a_minute_boundary(10);
    let text = rules_for("/").replace("http:\n", "http:\n  ipv6_prefix: 48\n");
    let file = rules_file("ipv6-48", &text);
    let rules = Arc::new(Rules::load(vec![file], LoadOptions::default()).unwrap());
    let limiter = Arc::new(Limiter::new(rules, MemoryStore::new()));
    let app = axum::Router::new()
        .fallback(|| async { "ok" })
        .layer(RateLimitLayer::new(limiter));
    assert_eq!(
        status(&app, "/x", "[2001:db8:1:2::1]:5").await.0,
        StatusCode::OK
    );
    // Another /64 of the same /48: the same client.
    assert_eq!(
        status(&app, "/x", "[2001:db8:1:ffff::9]:5").await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Another /48: another client.
    assert_eq!(
        status(&app, "/x", "[2001:db8:2::1]:5").await.0,
        StatusCode::OK
    );

    // More bits than an address has: refused, with the file and line.
    let text = rules_for("/").replace("http:\n", "http:\n  ipv6_prefix: 129\n");
    let file = rules_file("ipv6-129", &text);
    let Err(e) = Rules::load(vec![file.clone()], LoadOptions::default()) else {
        panic!("ipv6_prefix: 129 loaded");
    };
    let e = e.to_string();
    let place = format!("{}:6:", file.display());
    assert!(e.contains(&place), "{e}");
    assert!(
        e.contains("http.ipv6_prefix: 129 is more than the 128 bits of an IPv6 address"),
        "{e}"
    );
}

/// Counts the charges the layer makes (each call to the observer) and their costs.
#[derive(Default)]
struct Charges(std::sync::Mutex<Vec<(u64, bool)>>);

impl tollgate::http::DecisionObserver for Charges {
    fn decided(
        &self,
        request: &tollgate::limiter::RateLimitRequest,
        response: &tollgate::limiter::RateLimitResponse,
        _elapsed: std::time::Duration,
    ) {
        let cost = request.descriptors[0].hits_addend.unwrap_or(1);
        let over = response.overall == tollgate::limiter::Code::OverLimit;
        self.0.lock().unwrap().push((cost, over));
    }
}

/// The inner service: reads the body to its end, answers how many bytes came and
/// whether it ended or failed.
async fn read_all(body: Body) -> String {
    use http_body_util::BodyExt;
    let mut body = body;
    let mut bytes = 0;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => bytes += f.data_ref().map_or(0, |d| d.len()),
            Err(_) => return format!("aborted after {bytes}"),
        }
    }
    format!("read {bytes}")
}

#[tokio::test]
async fn request_bytes_are_charged_declared_or_streamed_in_batches() {
    minute::away_from_a_minute_boundary(10);
    let file = rules_file(
        "bytes",
        "domain: edge
descriptors:
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 200000, name: bytes}
http:
  routes:
    - rate_limits:
        - actions: [{request_headers: {header_name: x-api-key, descriptor_key: api_key}}]
          cost: request_bytes
",
    );
    let rules = Arc::new(Rules::load(vec![file], LoadOptions::default()).unwrap());
    let limiter = Arc::new(Limiter::new(rules, MemoryStore::new()));
    let charges = Arc::new(Charges::default());
    let layer = RateLimitLayer::new(limiter).with_observer(Arc::clone(&charges) as _);
    let (seen_tx, seen) = std::sync::mpsc::channel();
    let app = axum::Router::new()
        .fallback(move |req: Request<Body>| {
            let seen_tx = seen_tx.clone();
            async move {
                let said = read_all(req.into_body()).await;
                seen_tx.send(said.clone()).unwrap();
                said
            }
        })
        .layer(layer);
    let call = |key: &str, body: Body| {
        let mut req = Request::post("/up")
            .header("x-api-key", key)
            .body(body)
            .unwrap();
        req.extensions_mut()
            .insert(ConnectInfo("192.0.2.9:1".parse::<SocketAddr>().unwrap()));
        app.clone().oneshot(req)
    };
    // A known length: one check, charged up front.
    let r = call("a", Body::from(vec![0u8; 150_000])).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(seen.recv().unwrap(), "read 150000");
    assert_eq!(
        charges.0.lock().unwrap().drain(..).collect::<Vec<_>>(),
        [(150_000, false)]
    );
    let r = call("a", Body::from(vec![0u8; 60_000])).await.unwrap();
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    let r = call("a", Body::from(vec![0u8; 200_001])).await.unwrap();
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
    charges.0.lock().unwrap().clear();

    // Streamed, every chunk ready at once: a check of no cost, then one charge per 64 KiB.
    let chunks = (0..10).map(|_| Ok::<_, std::io::Error>(vec![0u8; 16 * 1024]));
    let body = Body::from_stream(futures_util::stream::iter(chunks));
    let r = call("b", body).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(seen.recv().unwrap(), "read 163840");
    assert_eq!(
        charges.0.lock().unwrap().drain(..).collect::<Vec<_>>(),
        [
            (0, false),
            (65_536, false),
            (65_536, false),
            (32_768, false)
        ]
    );

    // Streamed with pauses: each pause charges what came; over the limit, the inner
    // service sees the body fail and the client gets 429.
    let slow = futures_util::stream::unfold(0, |n| async move {
        if n == 3 {
            return None;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        Some((Ok::<_, std::io::Error>(vec![0u8; 15_000]), n + 1))
    });
    let r = call("b", Body::from_stream(slow)).await.unwrap();
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(r.headers().contains_key("retry-after"));
    assert_eq!(seen.recv().unwrap(), "aborted after 30000");
    assert_eq!(
        charges.0.lock().unwrap().drain(..).collect::<Vec<_>>(),
        [(0, false), (15_000, false), (15_000, false), (15_000, true)]
    );
}
