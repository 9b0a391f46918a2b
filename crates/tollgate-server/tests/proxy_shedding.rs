//! `tollgate proxy`'s load shedding end to end: a route's adaptive concurrency in front
//! of a real upstream whose latency grows with its concurrency (a pool of workers; past
//! it, requests queue). Under a burst far past the pool the gateway sheds with 503 and
//! `Retry-After`, the route's fallback answers where it has one, the metrics and
//! `/v1/stats` show the limit, and once the burst ends requests pass again.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

#[path = "../../tollgate/tests/support/queueing.rs"]
mod queueing;
mod support;

use std::net::SocketAddr;
use std::time::Duration;

use queueing::queueing_app;
use serde_json::Value;
use support::{tempdir, Proxy};

/// An upstream with `workers` workers, each answer taking 10 ms of one.
async fn queueing_upstream(workers: usize) -> SocketAddr {
    let app = queueing_app(workers, &["/api/work", "/soft/work"]);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// `tollgate proxy` on `rules` with an admin listener, in front of a queueing upstream
/// of 4 workers; the proxy and the admin listener's URL.
async fn gateway(name: &str, rules: &str) -> (Proxy, String) {
    let upstream = queueing_upstream(4).await;
    let dir = tempdir(name);
    std::fs::write(dir.join("edge.yaml"), rules).unwrap();
    let upstream = format!("http://{upstream}");
    Proxy::start_with_admin(&dir, &upstream, &[]).await
}

/// `GET url`'s body as JSON.
async fn json(url: String) -> Value {
    reqwest::get(url).await.unwrap().json().await.unwrap()
}

/// `GET url`'s body as text.
async fn text(url: String) -> String {
    reqwest::get(url).await.unwrap().text().await.unwrap()
}

const RULES: &str = "domain: edge
descriptors: []
http:
  routes:
    - match: {path_prefix: /api/}
      adaptive_concurrency: {min_limit: 2, max_limit: 100, interval: 50ms, min_rtt_interval: 1h, min_rtt_samples: 10}
    - match: {path_prefix: /soft/}
      adaptive_concurrency: {min_limit: 2, max_limit: 100, interval: 50ms, min_rtt_interval: 1h, min_rtt_samples: 10}
      fallback: {status: 200, body: busy}
";

/// `callers` concurrent callers of `url` for `secs`: how many got each status (200 with
/// body `busy` counted as 299), every 503 checked for `Retry-After: 1`.
async fn burst(url: &str, callers: usize, secs: u64) -> std::collections::BTreeMap<u16, u64> {
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for _ in 0..callers {
        let (client, url) = (client.clone(), url.to_string());
        tasks.push(tokio::spawn(async move {
            let mut seen = std::collections::BTreeMap::new();
            let end = tokio::time::Instant::now() + Duration::from_secs(secs);
            while tokio::time::Instant::now() < end {
                let r = client.get(&url).send().await.unwrap();
                let mut status = r.status().as_u16();
                if status == 503 {
                    assert_eq!(r.headers()["retry-after"], "1");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                if r.text().await.unwrap() == "busy" {
                    status = 299;
                }
                *seen.entry(status).or_insert(0) += 1;
            }
            seen
        }));
    }
    let mut all = std::collections::BTreeMap::new();
    for t in tasks {
        for (s, n) in t.await.unwrap() {
            *all.entry(s).or_insert(0) += n;
        }
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queueing_upstream_is_shed_with_503_and_the_gateway_recovers() {
    let (proxy, admin) = gateway("proxy-shedding", RULES).await;
    let client = reqwest::Client::new();
    let api = format!("{}/api/work", proxy.url);
    // The minimum RTTs, measured one request at a time.
    for path in ["/api/work", "/soft/work"] {
        for _ in 0..12 {
            let r = client
                .get(format!("{}{path}", proxy.url))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            assert_eq!(r.text().await.unwrap(), "done");
        }
    }
    // 48 callers at once, far past the 4 workers: the route sheds some with 503.
    let seen = burst(&api, 48, 1).await;
    assert!(
        seen.get(&200) > Some(&0) && seen.get(&503) > Some(&0),
        "{seen:?}"
    );
    assert_eq!(
        seen.keys().copied().collect::<Vec<_>>(),
        [200, 503],
        "{seen:?}"
    );
    // The route with a fallback answers it instead.
    let seen = burst(&format!("{}/soft/work", proxy.url), 48, 1).await;
    assert!(seen.get(&299) > Some(&0), "{seen:?}");
    assert_eq!(seen.get(&503), None, "{seen:?}");
    // The limit and the shed count, in /v1/stats and the metrics.
    let stats = json(format!("{admin}/v1/stats")).await;
    let routes = stats["adaptive"].as_array().unwrap();
    assert_eq!(routes.len(), 2, "{stats}");
    assert_eq!(routes[0]["route"], "0:/api/");
    let limit = routes[0]["limit"].as_u64().unwrap();
    assert!((2..=100).contains(&limit), "{stats}");
    assert!(routes[0]["shed"].as_u64() > Some(0), "{stats}");
    assert_eq!(routes[0]["measuring"], false);
    assert!(routes[0]["min_rtt_ms"].as_f64() >= Some(10.0), "{stats}");
    assert_eq!(stats["system"], Value::Null);
    let metrics = text(format!("{admin}/metrics")).await;
    let series = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(&format!("{name}{{domain=\"edge\",route=\"0:/api/\"}}")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    assert!(
        series("tollgate_adaptive_limit").is_some_and(|l| (2.0..=100.0).contains(&l)),
        "{metrics}"
    );
    assert!(
        series("tollgate_adaptive_shed_total").is_some_and(|n| n > 0.0),
        "{metrics}"
    );
    assert!(
        series("tollgate_adaptive_min_rtt_seconds").is_some_and(|s| s >= 0.01),
        "{metrics}"
    );
    // The burst over, requests pass again.
    for _ in 0..20 {
        assert_eq!(client.get(&api).send().await.unwrap().status(), 200);
    }
}

const PROTECTED: &str = "domain: edge
descriptors: []
http:
  system_protection: {min_in_flight: 4, exempt: [/healthz]}
  routes: []
";

/// System protection's capacity rule: past the upstream's measured capacity (the most
/// answers per second times the least latency), the gateway sheds with 503, counted
/// per reason and class.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_upstreams_capacity_the_gateway_sheds_and_counts_it() {
    let (proxy, admin) = gateway("proxy-capacity", PROTECTED).await;
    let seen = burst(&format!("{}/api/work", proxy.url), 48, 2).await;
    assert!(
        seen.get(&200) > Some(&0) && seen.get(&503) > Some(&0),
        "{seen:?}"
    );
    let stats = json(format!("{admin}/v1/stats")).await;
    let system = &stats["system"];
    assert_eq!(system["shed"][0]["class"], "all", "{stats}");
    assert!(system["shed"][0]["capacity"].as_u64() > Some(0), "{stats}");
    assert_eq!(system["shed"][0]["cpu"], 0, "{stats}");
    let metrics = text(format!("{admin}/metrics")).await;
    assert!(
        metrics.lines().any(|l| l
            .starts_with("tollgate_system_shed_total{reason=\"capacity\",class=\"all\"} ")
            && !l.ends_with(" 0")),
        "{metrics}"
    );
    assert!(metrics.contains("tollgate_system_capacity "), "{metrics}");
}
