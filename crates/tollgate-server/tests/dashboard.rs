//! The dashboard end to end: `GET /v1/stats` on the real binary (its fields, the admin
//! token, counts that move with traffic, hot keys), and `GET /dashboard` loaded in a
//! real headless Chromium while traffic runs, on `serve` and on `proxy --admin-listen`:
//! the page shows the rules, non-zero rates and the hottest key, then the error of a
//! reload that failed; and the gateway's load shedding (adaptive concurrency per
//! route, system protection) in `/v1/stats` and on the page.
//!
//! On Redis: the store's health, its circuit breaker open once Redis is gone.
//!
//! The browser is Debian's `chromium` (`.ci/run` installs it); `TOLLGATE_CHROMIUM`
//! names another binary.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

#[path = "../../tollgate/tests/support/redis_server.rs"]
mod redis_server;
mod support;

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::{Client, StatusCode};
use serde_json::{json, Value};
use support::upstream::start_upstream;
use support::{tempdir, Proxy, Server};

const TOKEN: &str = "dash-Token_7";

const RULES: &str = "domain: api
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 20}
  - key: path
    rate_limit: {unit: minute, requests_per_unit: 5}
    shadow_mode: true
";

const GATEWAY: &str = r#"domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 10}
http:
  routes:
    - match: {path_prefix: /api/}
      rate_limits:
        - actions: [{remote_address: {}}]
"#;

/// A gateway that sheds load: adaptive concurrency on `/api/`, and system protection
/// that sheds nothing (a CPU threshold at 99 %, capacity never below 1000 in flight).
const SHEDDING: &str = "domain: edge
descriptors: []
http:
  system_protection:
    max_cpu: 99%
    min_in_flight: 1000
    priority: {header: x-priority, classes: [critical, default]}
  routes:
    - match: {path_prefix: /api/}
      adaptive_concurrency: {min_limit: 5, max_limit: 200, interval: 50ms, min_rtt_samples: 10}
";

/// A rule file that does not load.
const BROKEN: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n";

/// The browser to run.
fn chromium() -> PathBuf {
    if let Some(path) = std::env::var_os("TOLLGATE_CHROMIUM") {
        return PathBuf::from(path);
    }
    for candidate in ["/usr/bin/chromium", "/usr/bin/chromium-browser"] {
        if std::path::Path::new(candidate).exists() {
            return PathBuf::from(candidate);
        }
    }
    panic!("no chromium: install Debian's `chromium` (.ci/run does) or set TOLLGATE_CHROMIUM");
}

/// The DOM of `url` after the page has run for a few (virtual) seconds, as headless
/// Chromium prints it.
async fn dump_dom(url: String, name: &str) -> String {
    let profile = tempdir(&format!("dashboard-chromium-{name}"));
    tokio::task::spawn_blocking(move || {
        let out = Command::new(chromium())
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--virtual-time-budget=4000",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("--dump-dom")
            .arg(&url)
            .output()
            .unwrap();
        let _ = std::fs::remove_dir_all(&profile);
        assert!(
            out.status.success(),
            "chromium failed on {url}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    })
    .await
    .unwrap()
}

/// The `data-value` of the element with `id` in `dom`.
fn value_of(dom: &str, id: &str) -> f64 {
    let at = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no #{id} in the page: {dom}"));
    let rest = &dom[at..];
    let start = rest.find("data-value=\"").unwrap() + "data-value=\"".len();
    let end = start + rest[start..].find('"').unwrap();
    rest[start..end].parse().unwrap()
}

/// Sends checks to `url` until `stop`: mostly for `alice`, some for others.
fn traffic(url: String, body: fn(u64) -> Value, stop: Arc<AtomicBool>) {
    tokio::spawn(async move {
        let c = Client::new();
        let mut i = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let _ = c.post(&url).json(&body(i)).send().await;
            i += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
}

/// `tollgate proxy` on `rules` (`edge.yaml` in a new directory `name`) in front of a real
/// upstream, its admin endpoints (guarded by the token) on a listener of their own: the
/// proxy, the rule directory, and the admin listener's URL.
async fn gateway(name: &str, rules: &str) -> (Proxy, PathBuf, String) {
    let (_up, upstream) = start_upstream().await;
    let dir = tempdir(name);
    std::fs::write(dir.join("edge.yaml"), rules).unwrap();
    let upstream = format!("http://{upstream}");
    let (proxy, admin) = Proxy::start_with_admin(&dir, &upstream, &["--admin-token", TOKEN]).await;
    (proxy, dir, admin)
}

/// Sends `GET url` through a gateway until `stop`, every other request as
/// `x-priority: critical`.
fn browse(url: String, stop: Arc<AtomicBool>) {
    tokio::spawn(async move {
        let c = Client::new();
        let mut i = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let mut get = c.get(&url);
            if i % 2 == 0 {
                get = get.header("x-priority", "critical");
            }
            let _ = get.send().await;
            i += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
}

fn check(i: u64) -> Value {
    let user = if i % 4 == 0 {
        format!("user-{}", i % 13)
    } else {
        "alice".to_string()
    };
    json!({"domain": "api", "descriptors": [{"user": user}, {"path": "/orders"}]})
}

/// `GET url` with the token, as JSON.
async fn stats(c: &Client, url: &str) -> Value {
    let r = c.get(url).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    r.json().await.unwrap()
}

/// Polls `/v1/stats` at `base` until `ok` says yes; panics after 10 s.
async fn stats_until(c: &Client, base: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = stats(c, &format!("{base}/v1/stats")).await;
        if ok(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "never: {s:#}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The row of `descriptor` among `s`'s rules.
fn rule<'a>(s: &'a Value, descriptor: &str) -> &'a Value {
    s["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["descriptor"] == descriptor)
        .unwrap_or_else(|| panic!("no rule {descriptor}: {s:#}"))
}

#[tokio::test]
async fn stats_are_guarded_and_move_with_traffic() {
    // Counted against per-minute limits from here on.
    support::minute::away_from_a_minute_boundary(10);
    let dir = tempdir("dashboard-stats");
    std::fs::write(
        dir.join("api.yaml"),
        RULES.replace("unit: second", "unit: minute"),
    )
    .unwrap();
    let server = Server::start(&dir, &["--admin-token", TOKEN]).await;
    let c = Client::new();
    let url = format!("{}/v1/stats", server.http);
    let refused = c.get(&url).send().await.unwrap();
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    let wrong = c.get(&url).bearer_auth("nope").send().await.unwrap();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    // The page itself holds no data: it is served without the token.
    let page = c
        .get(format!("{}/dashboard", server.http))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), StatusCode::OK);
    assert!(page.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    assert!(page.headers().contains_key("content-security-policy"));
    assert!(page.text().await.unwrap().contains("v1/stats"));

    let s = stats(&c, &url).await;
    for field in [
        "now_unix_ms",
        "interval_seconds",
        "totals",
        "rates",
        "rules",
        "rules_omitted",
        "store",
        "rule_set",
        "enforcement",
        "adaptive",
        "system",
    ] {
        assert!(s.get(field).is_some(), "no {field}: {s:#}");
    }
    assert_eq!(s["totals"]["decisions"], 0);
    assert_eq!(s["store"]["kind"], "memory");
    assert!(s["store"]["redis"].is_null());
    assert_eq!(s["rule_set"]["loaded"], true);
    assert_eq!(s["rule_set"]["domains"][0]["domain"], "api");
    assert!(s["rule_set"]["last_error"].is_null());
    assert_eq!(s["enforcement"]["all"], "enforce");
    // No gateway, no load shedding.
    assert_eq!(s["adaptive"], json!([]));
    assert!(s["system"].is_null());
    assert_eq!(rule(&s, "user")["limits"], json!(["20/minute"]));
    assert_eq!(rule(&s, "path")["shadow_mode"], true);

    // 30 checks in a burst, 27 for alice (20 admitted, 7 over her limit) and 3 for bob:
    // alice is the hottest key.
    for i in 0..30 {
        let user = if i % 10 == 0 { "bob" } else { "alice" };
        let body = json!({"domain": "api", "descriptors": [{"user": user}, {"path": "/orders"}]});
        c.post(format!("{}/v1/check", server.http))
            .json(&body)
            .send()
            .await
            .unwrap();
    }
    let s = stats_until(&c, &server.http, |s| {
        s["totals"]["decisions"] == 30 && s["rates"]["decisions"].as_array().unwrap().len() >= 2
    })
    .await;
    let user = rule(&s, "user");
    assert_eq!(user["totals"]["hits"], 30, "{s:#}");
    assert_eq!(user["totals"]["over_limit"], 7, "{s:#}");
    let hot = user["hot_keys"].as_array().unwrap();
    assert_eq!(hot[0]["key"], "user=alice");
    assert_eq!(hot[0]["hits"], 27);
    assert_eq!(hot[1]["key"], "user=bob");
    let path = rule(&s, "path");
    assert!(path["totals"]["shadow"].as_u64().unwrap() >= 10, "{s:#}");
    // The second that saw them counted them.
    let decided: f64 = s["rates"]["decisions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .sum();
    assert!(decided > 0.0, "{s:#}");

    // A key longer than the sketch keeps is shown cut.
    let long = "x".repeat(500);
    let body = json!({"domain": "api", "descriptors": [{"user": long}]});
    for _ in 0..40 {
        c.post(format!("{}/v1/check", server.http))
            .json(&body)
            .send()
            .await
            .unwrap();
    }
    let s = stats_until(&c, &server.http, |s| s["totals"]["decisions"] == 70).await;
    let top = &rule(&s, "user")["hot_keys"][0];
    assert_eq!(top["truncated"], true, "{s:#}");
    assert_eq!(top["key"].as_str().unwrap().len(), 96);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_rules_rates_hot_keys_and_a_reload_error() {
    let dir = tempdir("dashboard-page");
    std::fs::write(dir.join("api.yaml"), RULES).unwrap();
    let server = Server::start(&dir, &["--admin-token", TOKEN]).await;
    let stop = Arc::new(AtomicBool::new(false));
    traffic(
        format!("{}/v1/check", server.http),
        check,
        Arc::clone(&stop),
    );
    let c = Client::new();
    stats_until(&c, &server.http, |s| {
        s["rates"]["decisions"]
            .as_array()
            .and_then(|a| a.last())
            .and_then(Value::as_f64)
            .is_some_and(|v| v > 0.0)
    })
    .await;

    let page = format!("{}/dashboard#token={TOKEN}", server.http);
    let dom = dump_dom(page.clone(), "serve").await;
    assert!(dom.contains(">live<"), "{dom}");
    assert!(value_of(&dom, "decisions-now") > 0.0, "{dom}");
    assert!(value_of(&dom, "hits-now") > 0.0, "{dom}");
    assert!(dom.contains("20/second") && dom.contains(">user<"), "{dom}");
    assert!(dom.contains(">path<") && dom.contains(">shadow<"), "{dom}");
    assert!(dom.contains("user=alice"), "{dom}");
    assert!(dom.contains("api.yaml"), "{dom}");
    assert!(!dom.contains("id=\"reload-error\""), "{dom}");

    // Without the token the page says what it needs, and shows nothing else.
    let bare = dump_dom(format!("{}/dashboard", server.http), "serve-bare").await;
    assert!(bare.contains("requires the admin token"), "{bare}");
    assert!(!bare.contains("user=alice"), "{bare}");

    // A reload that fails: the old rules keep serving, the page shows why.
    std::fs::write(dir.join("api.yaml"), BROKEN).unwrap();
    let r = c
        .post(format!("{}/reload", server.http))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let dom = dump_dom(page, "serve-broken").await;
    stop.store(true, Ordering::Relaxed);
    assert!(dom.contains("id=\"reload-error\""), "{dom}");
    assert!(dom.contains("The last reload failed"), "{dom}");
    assert!(dom.contains("fortnight"), "{dom}");
    assert!(value_of(&dom, "decisions-now") > 0.0, "{dom}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_admin_listener_serves_the_dashboard() {
    let (proxy, dir, base) = gateway("dashboard-gateway", GATEWAY).await;
    let c = Client::new();
    let refused = c.get(format!("{base}/v1/stats")).send().await.unwrap();
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    let stop = Arc::new(AtomicBool::new(false));
    browse(format!("{}/api/items", proxy.url), Arc::clone(&stop));
    let s = stats_until(&c, &base, |s| {
        s["rates"]["hits"]
            .as_array()
            .and_then(|a| a.last())
            .and_then(Value::as_f64)
            .is_some_and(|v| v > 0.0)
    })
    .await;
    assert_eq!(
        rule(&s, "remote_address")["hot_keys"][0]["key"],
        "remote_address=127.0.0.1"
    );
    let page = format!("{base}/dashboard#token={TOKEN}");
    let dom = dump_dom(page.clone(), "proxy").await;
    assert!(value_of(&dom, "hits-now") > 0.0, "{dom}");
    assert!(
        dom.contains("10/second") && dom.contains(">remote_address<"),
        "{dom}"
    );
    assert!(dom.contains("remote_address=127.0.0.1"), "{dom}");
    // Without load shedding, its panel stays hidden.
    assert_eq!(s["adaptive"], json!([]));
    assert!(s["system"].is_null());
    assert!(dom.contains("id=\"shedding-card\" hidden"), "{dom}");

    std::fs::write(
        dir.join("edge.yaml"),
        GATEWAY.replace("unit: second", "unit: fortnight"),
    )
    .unwrap();
    let r = c
        .post(format!("{base}/reload"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let dom = dump_dom(page, "proxy-broken").await;
    stop.store(true, Ordering::Relaxed);
    assert!(
        dom.contains("id=\"reload-error\"") && dom.contains("fortnight"),
        "{dom}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_load_shedding_is_shown() {
    let (proxy, _, base) = gateway("dashboard-shedding", SHEDDING).await;
    let c = Client::new();
    let stop = Arc::new(AtomicBool::new(false));
    browse(format!("{}/api/items", proxy.url), Arc::clone(&stop));
    // The route's controller and the guard exist once a request has come.
    let s = stats_until(&c, &base, |s| {
        s["adaptive"].as_array().is_some_and(|a| !a.is_empty()) && s["system"].is_object()
    })
    .await;
    let route = &s["adaptive"][0];
    assert_eq!(route["domain"], "edge", "{s:#}");
    assert_eq!(route["route"], "0:/api/", "{s:#}");
    let limit = route["limit"].as_u64().unwrap();
    assert!((5..=200).contains(&limit), "{s:#}");
    let system = &s["system"];
    assert_eq!(system["max_cpu"], 0.99, "{s:#}");
    let classes: Vec<&Value> = system["shed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| &c["class"])
        .collect();
    assert_eq!(classes, [&json!("critical"), &json!("default")], "{s:#}");
    // Never below 1000 in flight: nothing is shed by capacity.
    assert!(
        system["shed"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["capacity"] == 0),
        "{s:#}"
    );

    let dom = dump_dom(format!("{base}/dashboard#token={TOKEN}"), "shedding").await;
    stop.store(true, Ordering::Relaxed);
    assert!(
        dom.contains("<section class=\"card\" id=\"shedding-card\">"),
        "{dom}"
    );
    assert!(dom.contains(">Load shedding<"), "{dom}");
    assert!(dom.contains("id=\"adaptive-route-0\">0:/api/<"), "{dom}");
    let shown = value_of(&dom, "adaptive-limit-0");
    assert!((5.0..=200.0).contains(&shown), "{dom}");
    assert!(value_of(&dom, "system-in-flight") >= 0.0, "{dom}");
    assert_eq!(value_of(&dom, "system-max-cpu"), 99.0, "{dom}");
    assert_eq!(value_of(&dom, "system-shed-capacity-0"), 0.0, "{dom}");
    assert!(dom.contains("id=\"system-class-0\">critical<"), "{dom}");
    assert!(dom.contains("id=\"system-class-1\">default<"), "{dom}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_health_shows_redis_and_its_circuit() {
    let mut redis = redis_server::RedisServer::start();
    let dir = tempdir("dashboard-redis");
    std::fs::write(dir.join("api.yaml"), RULES).unwrap();
    let store = redis.url();
    let server = Server::start(&dir, &["--store", store.as_str(), "--admin-token", TOKEN]).await;
    let c = Client::new();
    let send = |n: u64| {
        let (c, url) = (c.clone(), format!("{}/v1/check", server.http));
        async move {
            for i in 0..n {
                let _ = c.post(&url).json(&check(i)).send().await;
            }
        }
    };
    send(20).await;
    let s = stats_until(&c, &server.http, |s| {
        s["store"]["redis"]["calls"].as_u64().is_some_and(|n| n > 0)
    })
    .await;
    assert_eq!(s["store"]["kind"], "redis");
    assert_eq!(s["store"]["redis"]["circuit"], "closed");
    // Redis's round trip, timed apart from the decision.
    assert!(
        s["store"]["redis"]["answered"]
            .as_u64()
            .is_some_and(|n| n > 0)
            && s["store"]["redis"]["round_trip_micros_mean"]
                .as_f64()
                .is_some_and(|us| us > 0.0),
        "{s:#}"
    );
    assert_eq!(s["store"]["failures"], 0);
    assert!(s["store"]["leases"].is_object(), "{s:#}");

    // Redis gone: the store fails, the rules' failure mode answers, the circuit opens.
    redis.kill();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        send(10).await;
        let s = stats(&c, &format!("{}/v1/stats", server.http)).await;
        if s["store"]["redis"]["circuit"] == "open" {
            assert!(s["store"]["failures"].as_u64().unwrap() > 0, "{s:#}");
            assert!(s["store"]["fallback_hits"].as_u64().unwrap() > 0, "{s:#}");
            break;
        }
        assert!(Instant::now() < deadline, "the circuit never opened: {s:#}");
    }
    let dom = dump_dom(format!("{}/dashboard#token={TOKEN}", server.http), "redis").await;
    assert!(dom.contains("id=\"circuit\""), "{dom}");
    assert!(dom.contains(">open<"), "{dom}");
}

/// An admin token may hold `&` and `%`: the page takes everything after `#token=`, as
/// written or percent-encoded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_with_ampersand_and_percent_opens_the_page() {
    let dir = tempdir("dashboard-odd-token");
    std::fs::write(dir.join("api.yaml"), RULES).unwrap();
    let token = "a&b%zz=1";
    let server = Server::start(&dir, &["--admin-token", token]).await;
    for (fragment, name) in [(token, "odd-raw"), ("a%26b%25zz%3D1", "odd-encoded")] {
        let dom = dump_dom(format!("{}/dashboard#token={fragment}", server.http), name).await;
        assert!(dom.contains(">live<"), "{fragment}: {dom}");
    }
}
