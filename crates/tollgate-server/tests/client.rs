//! `tollgate-client`'s `RetryLayer` against the real `tollgate proxy`: `Retry-After`
//! honoured (the retry passes after the reset, not before), a POST not retried, the retry
//! budget capping retries across requests, and the pre-check waiting for the reset
//! instead of sending a request the gateway would reject.
//!
//! The limits are per second, on fixed windows aligned to the wall clock's seconds: each
//! test starts early in a second so that its burst falls in one window.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::upstream::start_upstream;
use support::{tempdir, Proxy};
use tokio::time::Instant;
use tollgate_client::backoff::Backoff;
use tollgate_client::budget::Budget;
use tollgate_client::{Precheck, RetryLayer, Retryable, WhenExhausted};
use tower::{Layer, Service, ServiceExt};

const RULES: &str = r#"domain: client
descriptors:
  - key: one
    rate_limit: {unit: second, requests_per_unit: 1, algorithm: fixed_window, name: one_per_second}
  - key: two
    rate_limit: {unit: second, requests_per_unit: 2, algorithm: fixed_window, name: two_per_second}
http:
  routes:
    - match: {path_prefix: /one/}
      rate_limits:
        - actions: [{generic_key: {descriptor_key: one, descriptor_value: all}}]
    - match: {path_prefix: /two/}
      rate_limits:
        - actions: [{generic_key: {descriptor_key: two, descriptor_value: all}}]
"#;

/// What the gateway answered to each request the client really sent: method, status,
/// and when the answer came.
type Sent = Arc<Mutex<Vec<(Method, StatusCode, Instant)>>>;

async fn gateway(name: &str) -> Proxy {
    let (_up, addr) = start_upstream().await;
    let dir = tempdir(name);
    std::fs::write(dir.join("client.yaml"), RULES).unwrap();
    let proxy = Proxy::start(&dir, &format!("http://{addr}"), &[]).await;
    // Accepting connections is not yet answering them: wait for an answer through to
    // the upstream on a path no rule limits, so the tests' first request counts.
    let client = reqwest::Client::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        let answered = client.get(format!("{}/ready", proxy.url)).send().await;
        if answered.is_ok_and(|r| r.status().is_success()) {
            return proxy;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the gateway never answered through to its upstream");
}

/// A hyper client that records each exchange in the returned log.
fn recorded_client() -> (
    impl Service<
            Request<Full<Bytes>>,
            Response = Response<Incoming>,
            Error = hyper_util::client::legacy::Error,
            Future = impl Send,
        > + Clone
        + Send
        + 'static,
    Sent,
) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let sent: Sent = Arc::default();
    let log = sent.clone();
    let svc = tower::service_fn(move |req: Request<Full<Bytes>>| {
        let (client, log) = (client.clone(), log.clone());
        async move {
            let method = req.method().clone();
            let r = client.request(req).await?;
            log.lock()
                .unwrap()
                .push((method, r.status(), Instant::now()));
            Ok(r)
        }
    });
    (svc, sent)
}

fn request(method: Method, url: &str) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri(url)
        .body(Full::new(Bytes::new()))
        .unwrap()
}

/// Sleeps until the wall clock is in the first 150 ms of a second.
async fn early_in_a_second() {
    loop {
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .subsec_millis();
        if ms < 150 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(u64::from(1000 - ms) + 5)).await;
    }
}

fn statuses(sent: &Sent) -> Vec<u16> {
    sent.lock()
        .unwrap()
        .iter()
        .map(|(_, s, _)| s.as_u16())
        .collect()
}

#[tokio::test]
async fn retry_after_is_honoured_and_the_retry_passes_after_the_reset() {
    let proxy = gateway("client-retry-after").await;
    let (inner, sent) = recorded_client();
    let mut svc = RetryLayer::new().seed(1).layer(inner);
    let url = format!("{}/one/x", proxy.url);
    early_in_a_second().await;
    let first = svc.ready().await.unwrap().call(request(Method::GET, &url));
    assert_eq!(first.await.unwrap().status(), 200);
    let second = svc.ready().await.unwrap().call(request(Method::GET, &url));
    assert_eq!(second.await.unwrap().status(), 200);
    // One 429 (with `Retry-After: 1`), then the retry a second later passes: had it come
    // before the reset, it would have been a second 429.
    assert_eq!(statuses(&sent), [200, 429, 200]);
    let sent = sent.lock().unwrap();
    let waited = sent[2].2 - sent[1].2;
    assert!(waited >= Duration::from_secs(1), "{waited:?}");
    assert!(waited < Duration::from_secs(3), "{waited:?}");
}

#[tokio::test]
async fn a_post_is_not_retried_unless_marked_retryable() {
    let proxy = gateway("client-post").await;
    let (inner, sent) = recorded_client();
    let mut svc = RetryLayer::new().seed(2).layer(inner);
    let url = format!("{}/one/x", proxy.url);
    early_in_a_second().await;
    let r = svc.ready().await.unwrap().call(request(Method::POST, &url));
    assert_eq!(r.await.unwrap().status(), 200);
    let r = svc.ready().await.unwrap().call(request(Method::POST, &url));
    assert_eq!(r.await.unwrap().status(), 429);
    assert_eq!(statuses(&sent), [200, 429]);
    // The caller says this POST may be sent twice: retried after the reset.
    let mut marked = request(Method::POST, &url);
    marked.extensions_mut().insert(Retryable);
    let r = svc.ready().await.unwrap().call(marked);
    assert_eq!(r.await.unwrap().status(), 200);
    assert_eq!(statuses(&sent), [200, 429, 429, 200]);
}

#[tokio::test]
async fn the_budget_caps_retries_across_requests() {
    let proxy = gateway("client-budget").await;
    let (inner, sent) = recorded_client();
    // No reserve, 20 % of requests: ten requests earn two retries in all.
    let budget = Arc::new(Budget::new(Duration::from_secs(60), 0, 0.2));
    let layer = RetryLayer::new()
        .backoff(Backoff::default().max_retries(5))
        .budget(Some(budget))
        .seed(3);
    let svc = layer.layer(inner);
    let url = format!("{}/one/x", proxy.url);
    early_in_a_second().await;
    let calls = (0..10).map(|_| {
        let mut svc = svc.clone();
        let req = request(Method::GET, &url);
        async move { svc.ready().await.unwrap().call(req).await.unwrap().status() }
    });
    let out = futures_util::future::join_all(calls).await;
    // One passes at once, nine get 429; two retries a second later, of which one
    // passes and the other is a 429 that the spent budget does not retry.
    assert_eq!(out.iter().filter(|s| **s == 200).count(), 2, "{out:?}");
    let sent = statuses(&sent);
    assert_eq!(sent.len(), 12, "{sent:?}");
    assert_eq!(sent.iter().filter(|s| **s == 200).count(), 2, "{sent:?}");
}

#[tokio::test]
async fn the_precheck_waits_for_the_reset_instead_of_sending_a_doomed_request() {
    let proxy = gateway("client-precheck").await;
    let (inner, sent) = recorded_client();
    let precheck = Arc::new(Precheck::new(WhenExhausted::Wait {
        max: Duration::from_secs(5),
    }));
    // No retries: every request the client sends must pass on its own.
    let mut svc = RetryLayer::new()
        .backoff(Backoff::default().max_retries(0))
        .precheck(precheck.clone())
        .layer(inner);
    let url = format!("{}/two/x", proxy.url);
    early_in_a_second().await;
    for _ in 0..4 {
        let r = svc.ready().await.unwrap().call(request(Method::GET, &url));
        assert_eq!(r.await.unwrap().status(), 200);
    }
    // Two in the first window; the third waited for the reset that `RateLimit` named
    // (`t=1`) rather than be sent into a 429.
    assert_eq!(statuses(&sent), [200, 200, 200, 200]);
    let sent = sent.lock().unwrap();
    let waited = sent[2].2 - sent[1].2;
    assert!(waited >= Duration::from_millis(800), "{waited:?}");
    assert!(waited < Duration::from_secs(3), "{waited:?}");
    // What it learned is kept under the host.
    assert!(!precheck.known(&proxy.addr).is_empty());
}

#[tokio::test]
async fn the_precheck_can_fail_fast_instead() {
    let proxy = gateway("client-fail-fast").await;
    let url = format!("{}/two/x", proxy.url);
    let fail_fast = Arc::new(Precheck::new(WhenExhausted::FailFast));
    let (inner, sent) = recorded_client();
    let mut svc = RetryLayer::new()
        .backoff(Backoff::default().max_retries(0))
        .precheck(fail_fast)
        .layer(inner);
    early_in_a_second().await;
    for _ in 0..2 {
        let r = svc.ready().await.unwrap().call(request(Method::GET, &url));
        assert_eq!(r.await.unwrap().status(), 200);
    }
    let r = svc.ready().await.unwrap().call(request(Method::GET, &url));
    match r.await {
        Err(tollgate_client::Error::Exhausted(e)) => {
            assert_eq!(e.policy, "two_per_second");
            assert!(e.reset <= Duration::from_secs(1));
        }
        other => panic!("not held back: {:?}", other.map(|r| r.status())),
    }
    assert_eq!(statuses(&sent), [200, 200]);
}
