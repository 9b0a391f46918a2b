//! `tollgate-client`'s `RetryLayer` and its `reqwest-middleware` twin `RetryMiddleware`
//! against the real `tollgate proxy`: `Retry-After` honoured (the retry passes after the
//! reset, not before), in seconds and as an HTTP-date, a POST not retried unless marked,
//! a body that cannot be cloned sent once, the retry budget capping retries across
//! requests, and the pre-check waiting for the reset (or failing fast) instead of sending
//! a request the gateway would reject.
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
use tollgate_client::middleware::RetryMiddleware;
use tollgate_client::precheck::Exhausted;
use tollgate_client::retry_after::parse_http_date;
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
    gateway_to(name, addr).await
}

/// A gateway with [`RULES`] in front of the upstream at `addr`, answering through to it.
async fn gateway_to(name: &str, addr: std::net::SocketAddr) -> Proxy {
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

/// Records each exchange that reaches it (the ones the client really sent) in a log.
struct Record(Sent);

#[async_trait::async_trait]
impl reqwest_middleware::Middleware for Record {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut http::Extensions,
        next: reqwest_middleware::Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let method = req.method().clone();
        let r = next.run(req, extensions).await?;
        self.0
            .lock()
            .unwrap()
            .push((method, r.status(), Instant::now()));
        Ok(r)
    }
}

/// A reqwest-middleware client: `retry`, then a recorder of what was really sent.
fn recorded_reqwest(retry: RetryMiddleware) -> (reqwest_middleware::ClientWithMiddleware, Sent) {
    let sent: Sent = Arc::default();
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(retry)
        .with(Record(sent.clone()))
        .build();
    (client, sent)
}

/// The two front ends of the same retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Front {
    /// `RetryLayer` over a hyper client.
    Layer,
    /// `RetryMiddleware` in a reqwest-middleware client.
    Middleware,
}

const FRONTS: [Front; 2] = [Front::Layer, Front::Middleware];

/// What a test sets of the front end's options (the others are the defaults).
#[derive(Clone, Default)]
struct Options {
    seed: u64,
    max_retries: Option<u32>,
    budget: Option<Arc<Budget>>,
    precheck: Option<Arc<Precheck>>,
}

impl Options {
    /// The defaults, with jitter from `seed`.
    fn seeded(seed: u64) -> Options {
        Options {
            seed,
            ..Options::default()
        }
    }
}

/// `builder` (a `RetryLayer` or a `RetryMiddleware`) with `options`.
macro_rules! with_options {
    ($builder:expr, $options:expr) => {{
        let (mut b, o) = ($builder.seed($options.seed), $options);
        if let Some(n) = o.max_retries {
            b = b.backoff(Backoff::default().max_retries(n));
        }
        if let Some(budget) = &o.budget {
            b = b.budget(Some(budget.clone()));
        }
        if let Some(precheck) = &o.precheck {
            b = b.precheck(precheck.clone());
        }
        b
    }};
}

type LayerClient = tower::util::BoxCloneService<
    Request<Full<Bytes>>,
    Response<Incoming>,
    tollgate_client::Error<hyper_util::client::legacy::Error>,
>;

/// A client through one front end's retries; `sent` records what it really sent.
#[derive(Clone)]
struct Caller {
    via: Via,
    sent: Sent,
}

#[derive(Clone)]
enum Via {
    Layer(LayerClient),
    Middleware(reqwest_middleware::ClientWithMiddleware),
}

impl Caller {
    fn new(front: Front, options: &Options) -> Caller {
        match front {
            Front::Layer => {
                let (inner, sent) = recorded_client();
                let layer = with_options!(RetryLayer::new(), options);
                let via = Via::Layer(LayerClient::new(layer.layer(inner)));
                Caller { via, sent }
            }
            Front::Middleware => {
                let (client, sent) =
                    recorded_reqwest(with_options!(RetryMiddleware::new(), options));
                let via = Via::Middleware(client);
                Caller { via, sent }
            }
        }
    }

    /// Sends `method` to `url`, marked [`Retryable`] when `marked`: the last status, or
    /// the pre-check's refusal.
    async fn send(&self, method: Method, url: &str, marked: bool) -> Result<u16, Exhausted> {
        match &self.via {
            Via::Layer(svc) => {
                let mut req = request(method, url);
                if marked {
                    req.extensions_mut().insert(Retryable);
                }
                match svc.clone().oneshot(req).await {
                    Ok(r) => Ok(r.status().as_u16()),
                    Err(tollgate_client::Error::Exhausted(e)) => Err(e),
                    Err(e) => panic!("{e}"),
                }
            }
            Via::Middleware(client) => {
                let mut req = client.request(method, url);
                if marked {
                    req = req.with_extension(Retryable);
                }
                match req.send().await {
                    Ok(r) => Ok(r.status().as_u16()),
                    Err(reqwest_middleware::Error::Middleware(e)) => {
                        Err(e.downcast::<Exhausted>().unwrap())
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }
    }

    /// Sends a GET to `url` and expects it to pass.
    async fn get_ok(&self, url: &str) {
        assert_eq!(self.send(Method::GET, url, false).await, Ok(200));
    }
}

/// For test `name` and `front`: a gateway, its URL for `path`, and a caller with
/// `options`; returns early in a second.
async fn start(name: &str, front: Front, path: &str, options: &Options) -> (Proxy, String, Caller) {
    let proxy = gateway(&format!("{name}-{front:?}")).await;
    let url = format!("{}{path}", proxy.url);
    let caller = Caller::new(front, options);
    early_in_a_second().await;
    (proxy, url, caller)
}

/// The time between the `i`th and the `i + 1`th exchange of `sent`.
fn gap(sent: &Sent, i: usize) -> Duration {
    let sent = sent.lock().unwrap();
    sent[i + 1].2 - sent[i].2
}

#[tokio::test]
async fn retry_after_is_honoured_and_the_retry_passes_after_the_reset() {
    for front in FRONTS {
        let options = Options::seeded(1);
        let (_proxy, url, caller) = start("client-retry-after", front, "/one/x", &options).await;
        caller.get_ok(&url).await;
        caller.get_ok(&url).await;
        // One 429 (with `Retry-After: 1`), then the retry a second later passes: had it
        // come before the reset, it would have been a second 429.
        assert_eq!(statuses(&caller.sent), [200, 429, 200], "{front:?}");
        let waited = gap(&caller.sent, 1);
        assert!(waited >= Duration::from_secs(1), "{front:?}: {waited:?}");
        assert!(waited < Duration::from_secs(3), "{front:?}: {waited:?}");
    }
}

#[tokio::test]
async fn a_post_is_not_retried_unless_marked_retryable() {
    for front in FRONTS {
        let options = Options::seeded(2);
        let (_proxy, url, caller) = start("client-post", front, "/one/x", &options).await;
        assert_eq!(caller.send(Method::POST, &url, false).await, Ok(200));
        assert_eq!(caller.send(Method::POST, &url, false).await, Ok(429));
        assert_eq!(statuses(&caller.sent), [200, 429], "{front:?}");
        // The caller says this POST may be sent twice: retried after the reset.
        assert_eq!(caller.send(Method::POST, &url, true).await, Ok(200));
        assert_eq!(statuses(&caller.sent), [200, 429, 429, 200], "{front:?}");
        let sent = caller.sent.lock().unwrap();
        assert!(sent.iter().all(|(m, _, _)| m == Method::POST));
    }
}

#[tokio::test]
async fn the_budget_caps_retries_across_requests() {
    for front in FRONTS {
        // No reserve, 20 % of requests: ten requests earn two retries in all.
        let options = Options {
            seed: 3,
            max_retries: Some(5),
            budget: Some(Arc::new(Budget::new(Duration::from_secs(60), 0, 0.2))),
            ..Options::default()
        };
        let (_proxy, url, caller) = start("client-budget", front, "/one/x", &options).await;
        let calls = (0..10).map(|_| caller.send(Method::GET, &url, false));
        let out = futures_util::future::join_all(calls).await;
        // One passes at once, nine get 429; two retries a second later, of which one
        // passes and the other is a 429 that the spent budget does not retry.
        assert_eq!(
            out.iter().filter(|s| **s == Ok(200)).count(),
            2,
            "{front:?}: {out:?}"
        );
        let sent = statuses(&caller.sent);
        assert_eq!(sent.len(), 12, "{front:?}: {sent:?}");
        assert_eq!(
            sent.iter().filter(|s| **s == 200).count(),
            2,
            "{front:?}: {sent:?}"
        );
    }
}

#[tokio::test]
async fn the_precheck_waits_for_the_reset_instead_of_sending_a_doomed_request() {
    for front in FRONTS {
        let precheck = Arc::new(Precheck::new(WhenExhausted::Wait {
            max: Duration::from_secs(5),
        }));
        // No retries: every request the client sends must pass on its own.
        let options = Options {
            max_retries: Some(0),
            precheck: Some(precheck.clone()),
            ..Options::default()
        };
        let (proxy, url, caller) = start("client-precheck", front, "/two/x", &options).await;
        for _ in 0..4 {
            caller.get_ok(&url).await;
        }
        // Two in the first window; the third waited for the reset that `RateLimit` named
        // (`t=1`) rather than be sent into a 429.
        assert_eq!(statuses(&caller.sent), [200, 200, 200, 200], "{front:?}");
        let waited = gap(&caller.sent, 1);
        assert!(
            waited >= Duration::from_millis(800),
            "{front:?}: {waited:?}"
        );
        assert!(waited < Duration::from_secs(3), "{front:?}: {waited:?}");
        // What it learned is kept under the host.
        assert!(!precheck.known(&proxy.addr).is_empty());
    }
}

#[tokio::test]
async fn the_precheck_can_fail_fast_instead() {
    for front in FRONTS {
        let options = Options {
            max_retries: Some(0),
            precheck: Some(Arc::new(Precheck::new(WhenExhausted::FailFast))),
            ..Options::default()
        };
        let (_proxy, url, caller) = start("client-fail-fast", front, "/two/x", &options).await;
        for _ in 0..2 {
            caller.get_ok(&url).await;
        }
        // The layer's `Error::Exhausted`; the middleware's `Error::Middleware` wrapping
        // `Exhausted`.
        let e = caller.send(Method::GET, &url, false).await.unwrap_err();
        assert_eq!(e.policy, "two_per_second");
        assert!(e.reset <= Duration::from_secs(1));
        assert_eq!(statuses(&caller.sent), [200, 200], "{front:?}");
    }
}

#[tokio::test]
async fn the_middleware_sends_a_body_it_cannot_clone_once() {
    let proxy = gateway("client-mw-stream").await;
    let (client, sent) = recorded_reqwest(RetryMiddleware::new().seed(3));
    let url = format!("{}/one/x", proxy.url);
    early_in_a_second().await;
    assert_eq!(client.get(&url).send().await.unwrap().status(), 200);
    // Marked retryable, but a stream cannot be sent again: the 429 is the answer.
    let chunks = futures_util::stream::iter([Ok::<_, std::io::Error>("a"), Ok("b")]);
    let streamed = client
        .put(&url)
        .body(reqwest::Body::wrap_stream(chunks))
        .with_extension(Retryable);
    assert_eq!(streamed.send().await.unwrap().status(), 429);
    assert_eq!(statuses(&sent), [200, 429]);
}

/// `t` as an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`), to the second.
fn imf_fixdate(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).unwrap().as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // 1970-01-01 was a Thursday.
    let weekday = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"][(days % 7) as usize];
    // Days to a civil date (Howard Hinnant's algorithm), for dates after 1970.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    let names = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    format!(
        "{weekday}, {day:02} {} {year} {:02}:{:02}:{:02} GMT",
        names[(month - 1) as usize],
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// What the date upstream saw and said, per path: each arrival, and the date it named.
#[derive(Clone, Default)]
struct DateUpstream {
    arrivals: Arc<Mutex<Vec<(String, SystemTime)>>>,
    dates: Arc<Mutex<Vec<(String, SystemTime)>>>,
}

/// An upstream that answers the first request on each `/date/` path with a 503 and
/// `Retry-After: <an HTTP-date 1 to 2 s ahead>`, and everything else with a 200.
async fn start_date_upstream() -> (DateUpstream, std::net::SocketAddr) {
    use axum::extract::{Request, State};
    use axum::response::{IntoResponse, Response};
    async fn answer(State(up): State<DateUpstream>, req: Request) -> Response {
        let path = req.uri().path().to_owned();
        let now = SystemTime::now();
        let first = {
            let mut arrivals = up.arrivals.lock().unwrap();
            let first = !arrivals.iter().any(|(p, _)| *p == path);
            arrivals.push((path.clone(), now));
            first
        };
        if !(path.starts_with("/date/") && first) {
            return "ok".into_response();
        }
        // The next whole second, plus one: 1 to 2 s ahead.
        let whole = now.duration_since(UNIX_EPOCH).unwrap().as_secs() + 2;
        let date = UNIX_EPOCH + Duration::from_secs(whole);
        up.dates.lock().unwrap().push((path, date));
        (
            StatusCode::SERVICE_UNAVAILABLE,
            [(http::header::RETRY_AFTER, imf_fixdate(date))],
            "later",
        )
            .into_response()
    }
    let up = DateUpstream::default();
    let app = axum::Router::new().fallback(answer).with_state(up.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (up, addr)
}

#[test]
fn the_fixdate_of_the_tests_parses_back() {
    for secs in [0, 784_111_777, 951_782_400, 1_700_000_000, 4_102_444_799] {
        let t = UNIX_EPOCH + Duration::from_secs(secs);
        assert_eq!(
            parse_http_date(&imf_fixdate(t)),
            Some(t),
            "{}",
            imf_fixdate(t)
        );
    }
    assert_eq!(
        imf_fixdate(UNIX_EPOCH + Duration::from_secs(784_111_777)),
        "Sun, 06 Nov 1994 08:49:37 GMT"
    );
}

#[tokio::test]
async fn a_retry_after_date_is_waited_for_by_the_layer_and_the_middleware() {
    let (up, addr) = start_date_upstream().await;
    let proxy = gateway_to("client-date", addr).await;
    for front in FRONTS {
        let caller = Caller::new(front, &Options::seeded(4));
        caller
            .get_ok(&format!("{}/date/{front:?}", proxy.url))
            .await;
        // Through the gateway: the 503 with its date, then the retry that passes.
        assert_eq!(statuses(&caller.sent), [503, 200], "{front:?}");
    }
    let arrivals = up.arrivals.lock().unwrap().clone();
    let dates = up.dates.lock().unwrap().clone();
    assert_eq!(dates.len(), 2, "{dates:?}");
    for (path, date) in dates {
        let seen: Vec<SystemTime> = arrivals
            .iter()
            .filter(|(p, _)| *p == path)
            .map(|(_, t)| *t)
            .collect();
        assert_eq!(seen.len(), 2, "{path}: {seen:?}");
        // The retry came no earlier than the date, and not long after it.
        assert!(seen[1] >= date, "{path}: retried before {date:?}: {seen:?}");
        let late = seen[1].duration_since(date).unwrap();
        assert!(late < Duration::from_secs(2), "{path}: {late:?}");
    }
}
