//! `RateLimitLayer`'s load shedding on an axum app served on a real socket, asked with
//! real HTTP requests: a route's adaptive concurrency in front of a handler whose
//! latency grows with its concurrency (503 + `Retry-After`, then recovery), and system
//! protection driven by an injected CPU reading (lowest class first, health checks
//! never shed).

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

#[path = "support/queueing.rs"]
mod queueing;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use queueing::queueing_app;
use tollgate::adaptive::ManualCpu;
use tollgate::http::RateLimitLayer;
use tollgate::limiter::Limiter;
use tollgate::rules::{LoadOptions, Rules};
use tollgate::store::MemoryStore;

fn rules_file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tollgate-shedding-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("edge.yaml");
    std::fs::write(&file, text).unwrap();
    file
}

/// Serves `app` on a free port; its address.
async fn serve(app: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let service = app.into_make_service_with_connect_info::<SocketAddr>();
        axum::serve(listener, service).await.unwrap();
    });
    addr
}

fn layer(file: PathBuf) -> RateLimitLayer {
    let rules = Rules::load(vec![file], LoadOptions::default()).unwrap();
    RateLimitLayer::new(Arc::new(Limiter::new(Arc::new(rules), MemoryStore::new())))
}

const ADAPTIVE: &str = "domain: edge
descriptors: []
http:
  routes:
    - match: {path_prefix: /api/}
      adaptive_concurrency: {min_limit: 2, max_limit: 200, interval: 50ms, min_rtt_interval: 1h, min_rtt_samples: 10}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queueing_handler_is_shed_with_503_and_retry_after_then_recovers() {
    let layer = layer(rules_file("adaptive", ADAPTIVE));
    let shedding = layer.shedding();
    let addr = serve(queueing_app(4, &["/api/work"]).layer(layer)).await;
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/api/work");
    // The minimum RTT (about 10 ms) is measured one request at a time.
    for _ in 0..12 {
        assert_eq!(client.get(&url).send().await.unwrap().status(), 200);
    }
    let routes = shedding.routes();
    assert_eq!(routes.len(), 1);
    assert_eq!(routes[0].route, "0:/api/");
    assert!(!routes[0].measuring, "{routes:?}");
    // 64 callers at once for a second: far past the 4 workers. Some are shed with 503
    // and Retry-After; the limit stays within its bounds.
    let mut callers = Vec::new();
    for _ in 0..64 {
        let (client, url) = (client.clone(), url.clone());
        callers.push(tokio::spawn(async move {
            let (mut ok, mut shed) = (0, 0);
            let end = tokio::time::Instant::now() + Duration::from_secs(1);
            while tokio::time::Instant::now() < end {
                let r = client.get(&url).send().await.unwrap();
                match r.status().as_u16() {
                    200 => ok += 1,
                    503 => {
                        assert_eq!(r.headers()["retry-after"], "1");
                        shed += 1;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    s => panic!("unexpected status {s}"),
                }
            }
            (ok, shed)
        }));
    }
    let (mut ok, mut shed) = (0, 0);
    for c in callers {
        let (o, s) = c.await.unwrap();
        ok += o;
        shed += s;
    }
    assert!(ok > 0 && shed > 0, "ok {ok}, shed {shed}");
    let during = shedding.routes()[0].clone();
    assert!((2..=200).contains(&during.limit), "{during:?}");
    assert_eq!(during.shed, shed);
    // The load gone, requests pass again.
    for _ in 0..20 {
        assert_eq!(client.get(&url).send().await.unwrap().status(), 200);
    }
    assert_eq!(shedding.routes()[0].in_flight, 0);
}

const PROTECTED: &str = "domain: edge
descriptors: []
http:
  system_protection:
    max_cpu: 80%
    capacity: false
    exempt: [/healthz]
    priority: {header: x-priority, classes: [critical, default, sheddable], default_class: default}
  routes:
    - match: {path_prefix: /api/}
";

#[tokio::test]
async fn a_hot_cpu_sheds_the_lowest_class_first_and_never_the_health_check() {
    let cpu = ManualCpu::new();
    let layer = layer(rules_file("cpu", PROTECTED)).with_cpu_gauge(Arc::new(cpu.clone()));
    let shedding = layer.shedding();
    let app = axum::Router::new()
        .route("/api/x", axum::routing::get(|| async { "x" }))
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .layer(layer);
    let addr = serve(app).await;
    let client = reqwest::Client::new();
    let get = |path: &'static str, class: Option<&'static str>| {
        let mut r = client.get(format!("http://{addr}{path}"));
        if let Some(class) = class {
            r = r.header("x-priority", class);
        }
        async move {
            let r = r.send().await.unwrap();
            if r.status() == 503 {
                assert_eq!(r.headers()["retry-after"], "1");
            }
            r.status().as_u16()
        }
    };
    let classes = [Some("critical"), None, Some("sheddable")];
    let statuses = || async {
        let mut out = Vec::new();
        for class in classes {
            out.push(get("/api/x", class).await);
        }
        out.push(get("/healthz", Some("sheddable")).await);
        out
    };
    cpu.set(Some(0.5));
    assert_eq!(statuses().await, [200, 200, 200, 200]);
    // Each hot reading sheds one more class, from the lowest; a request naming no
    // class is `default`.
    cpu.set(Some(0.95));
    assert_eq!(statuses().await, [200, 200, 503, 200]);
    cpu.set(Some(0.9));
    assert_eq!(statuses().await, [200, 503, 503, 200]);
    cpu.set(Some(0.9));
    assert_eq!(statuses().await, [503, 503, 503, 200]);
    let system = shedding.system().unwrap();
    assert_eq!(system.cpu, Some(0.9));
    assert_eq!(system.cpu_level, 3);
    let by_cpu: Vec<u64> = system.shed.iter().map(|c| c.2).collect();
    assert_eq!(by_cpu, [1, 2, 3]);
    // Cool readings let them back in, highest first.
    cpu.set(Some(0.2));
    assert_eq!(statuses().await, [200, 503, 503, 200]);
    // Readings that come between requests count too: two more, two classes back.
    cpu.set(Some(0.2));
    cpu.set(Some(0.2));
    assert_eq!(statuses().await, [200, 200, 200, 200]);
    // A reading that cannot be read sheds nothing.
    cpu.set(Some(0.95));
    assert_eq!(statuses().await, [200, 200, 503, 200]);
    cpu.set(None);
    assert_eq!(statuses().await, [200, 200, 200, 200]);
}

/// A response that streams for as long as the client reads holds no adaptive place once
/// its head has come: long streams do not make the route shed, nor keep its minimum RTT
/// from being measured.
#[tokio::test]
async fn a_streaming_response_gives_its_place_back_at_its_head() {
    let layer = layer(rules_file("stream", ADAPTIVE));
    let shedding = layer.shedding();
    let app = queueing_app(4, &["/api/work"])
        .route(
            "/api/stream",
            axum::routing::get(|| async {
                let endless =
                    futures_util::stream::pending::<Result<bytes::Bytes, std::io::Error>>();
                axum::body::Body::from_stream(endless)
            }),
        )
        .layer(layer);
    let addr = serve(app).await;
    let client = reqwest::Client::new();
    // Three open streams, with the limit at 2 while the minimum RTT is measured.
    let mut open = Vec::new();
    for _ in 0..3 {
        let r = client
            .get(format!("http://{addr}/api/stream"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        open.push(r);
    }
    for _ in 0..12 {
        let r = client
            .get(format!("http://{addr}/api/work"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let route = &shedding.routes()[0];
    assert!(!route.measuring, "{route:?}");
    assert_eq!((route.in_flight, route.shed), (0, 0), "{route:?}");
    drop(open);
}

/// A reload that leaves a route and its settings as they were keeps its controller (and
/// what it measured); one that changes its settings starts a new one.
#[tokio::test]
async fn a_reload_keeps_the_controller_of_an_unchanged_route() {
    let file = rules_file("reload", ADAPTIVE);
    let rules = Arc::new(Rules::load(vec![file.clone()], LoadOptions::default()).unwrap());
    let limiter = Arc::new(Limiter::new(Arc::clone(&rules), MemoryStore::new()));
    let layer = RateLimitLayer::new(limiter);
    let shedding = layer.shedding();
    let addr = serve(queueing_app(4, &["/api/work"]).layer(layer)).await;
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/api/work");
    let get = || async { client.get(&url).send().await.unwrap().status().as_u16() };
    for _ in 0..12 {
        assert_eq!(get().await, 200);
    }
    let measured = shedding.routes()[0].min_rtt;
    assert!(measured.is_some());
    // The section changes elsewhere (its trusted proxies); the route does not.
    std::fs::write(
        &file,
        format!("{ADAPTIVE}  trusted_proxies: [10.0.0.0/8]\n"),
    )
    .unwrap();
    rules.reload().unwrap();
    assert_eq!(get().await, 200);
    let kept = shedding.routes()[0].clone();
    assert!(!kept.measuring && kept.min_rtt == measured, "{kept:?}");
    // Its settings change: a new controller, measuring again.
    std::fs::write(&file, ADAPTIVE.replace("min_limit: 2", "min_limit: 3")).unwrap();
    rules.reload().unwrap();
    assert_eq!(get().await, 200);
    let fresh = shedding.routes()[0].clone();
    assert!(fresh.measuring && fresh.min_rtt.is_none(), "{fresh:?}");
}
