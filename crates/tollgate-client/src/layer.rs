//! [`RetryLayer`]: a tower layer for HTTP clients that retries `429 Too Many Requests`
//! and `503 Service Unavailable` the way a rate limiter wants to be retried.
//!
//! - After the server's hint when it gives one: `Retry-After`, else the longest reset
//!   `t` of the `RateLimit` items with nothing left (`r=0`); a little jitter (up to the
//!   backoff's base) is added, so callers told the same instant do not all come back at
//!   it. Without a hint: exponential backoff with full jitter ([`Backoff`]).
//! - Bounded: at most [`Backoff::max_retries`] retries, none that would start later
//!   than [`Backoff::max_total`] after the first attempt (a longer hint returns the
//!   response as it is), and none past the shared [`Budget`].
//! - Only requests whose method is idempotent (GET, HEAD, OPTIONS, PUT, DELETE, TRACE),
//!   or that carry the [`Retryable`] extension, are retried: a POST may have been acted
//!   on.
//! - Optionally a [`Precheck`] holds back a request the server would reject.
//!
//! The request body must be `Clone` to be sent again (`Full<Bytes>` and `Empty` are);
//! a body that cannot be cloned can be buffered into one first. Errors of the inner
//! service are returned as they are, not retried.
//!
//! With the `reqwest` feature, `middleware::RetryMiddleware` does the same for a
//! `reqwest-middleware` client, with the same options.
//!
//! [`Backoff`]: crate::backoff::Backoff
//! [`Backoff::max_retries`]: crate::backoff::Backoff::max_retries
//! [`Backoff::max_total`]: crate::backoff::Backoff::max_total
//! [`Budget`]: crate::budget::Budget
//! [`Precheck`]: crate::precheck::Precheck

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::{Layer, Service, ServiceExt};

use crate::precheck::Exhausted;
pub use crate::retry::hinted_wait;
use crate::retry::{builder, Config, Front, Policy, Sending};

/// A request extension that lets a request of a non-idempotent method (POST, PATCH) be
/// retried: its sender knows that sending it twice does no harm.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Retryable;

/// The error of a [`Retry`] service.
#[derive(Debug)]
pub enum Error<E> {
    /// The inner service's error.
    Service(E),
    /// The pre-check held the request back (it was not sent).
    Exhausted(Exhausted),
}

impl<E: std::fmt::Display> std::fmt::Display for Error<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Service(e) => e.fmt(f),
            Error::Exhausted(e) => e.fmt(f),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for Error<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Service(e) => Some(e),
            Error::Exhausted(e) => Some(e),
        }
    }
}

/// The layer; see the [module](self) docs.
#[derive(Debug, Clone)]
pub struct RetryLayer {
    config: Config,
}

builder!(RetryLayer);

impl RetryLayer {
    fn with_config(config: Config) -> Self {
        RetryLayer { config }
    }

    fn configure(mut self, set: impl FnOnce(&mut Config)) -> Self {
        set(&mut self.config);
        self
    }
}

impl<S> Layer<S> for RetryLayer {
    type Service = Retry<S>;

    fn layer(&self, inner: S) -> Retry<S> {
        Retry {
            inner,
            policy: Arc::new(self.config.policy()),
        }
    }
}

/// The service [`RetryLayer`] makes.
#[derive(Debug, Clone)]
pub struct Retry<S> {
    inner: S,
    policy: Arc<Policy>,
}

/// Whether `req` may be sent again.
pub fn is_retryable<B>(req: &Request<B>) -> bool {
    crate::retry::retryable(req.method(), req.extensions().get::<Retryable>().is_some())
}

impl<S, B, RB> Service<Request<B>> for Retry<S>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    B: Clone + Send + 'static,
    RB: Send + 'static,
{
    type Response = Response<RB>;
    type Error = Error<S::Error>;
    type Future = Pin<Box<dyn Future<Output = Result<Response<RB>, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Error::Service)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The clone that was made ready goes with this call; a fresh one stays.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let policy = self.policy.clone();
        Box::pin(async move { policy.run(req, &mut Inner(inner)).await })
    }
}

/// The inner service, as the retries' front end.
struct Inner<S>(S);

impl<S, B, RB> Front<Request<B>> for Inner<S>
where
    S: Service<Request<B>, Response = Response<RB>> + Send + 'static,
    S::Future: Send,
    B: Clone + Send + 'static,
    RB: Send + 'static,
{
    type Answer = Response<RB>;
    type Error = Error<S::Error>;

    fn about<'r>(&self, req: &'r Request<B>) -> Sending<'r> {
        Sending {
            method: req.method(),
            marked: req.extensions().get::<Retryable>().is_some(),
            uri: Some(req.uri().clone()),
            headers: req.headers(),
        }
    }

    async fn send(&mut self, req: Request<B>) -> Result<Response<RB>, Error<S::Error>> {
        let ready = self.0.ready().await.map_err(Error::Service)?;
        ready.call(req).await.map_err(Error::Service)
    }

    fn read(answer: &Response<RB>) -> (http::StatusCode, &http::HeaderMap) {
        (answer.status(), answer.headers())
    }

    fn copy(req: &Request<B>) -> Option<Request<B>> {
        Some(clone_request(req))
    }

    fn held_back(exhausted: Exhausted) -> Error<S::Error> {
        Error::Exhausted(exhausted)
    }
}

/// A copy of `req`: method, URI, version, headers, body and the [`Retryable`] marker
/// (other extensions are not `Clone` in general, and are not copied).
fn clone_request<B: Clone>(req: &Request<B>) -> Request<B> {
    let mut out = Request::new(req.body().clone());
    *out.method_mut() = req.method().clone();
    *out.uri_mut() = req.uri().clone();
    *out.version_mut() = req.version();
    *out.headers_mut() = req.headers().clone();
    if let Some(r) = req.extensions().get::<Retryable>() {
        out.extensions_mut().insert(*r);
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    use http::{Method, StatusCode};
    use parking_lot::Mutex;
    use tokio::time::Instant;

    use super::*;
    use crate::backoff::Backoff;
    use crate::budget::Budget;
    use crate::precheck::{Precheck, WhenExhausted};

    /// What a scripted service saw: each request's method and when it came.
    type Seen = Arc<Mutex<Vec<(Method, Instant)>>>;

    /// A service answering from `statuses` in turn (then 200), each with `headers`,
    /// recording when each request came.
    fn scripted(
        statuses: Vec<(u16, Vec<(&'static str, &'static str)>)>,
    ) -> (
        impl Service<
                Request<String>,
                Response = Response<()>,
                Error = std::convert::Infallible,
                Future = impl Send,
            > + Clone
            + Send
            + 'static,
        Seen,
    ) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let statuses = Arc::new(statuses);
        let n = Arc::new(AtomicU32::new(0));
        let log = seen.clone();
        let svc = tower::service_fn(move |req: Request<String>| {
            log.lock().push((req.method().clone(), Instant::now()));
            let i = n.fetch_add(1, Ordering::SeqCst) as usize;
            let mut r = Response::new(());
            if let Some((status, headers)) = statuses.get(i) {
                *r.status_mut() = StatusCode::from_u16(*status).unwrap();
                for (k, v) in headers {
                    r.headers_mut().append(*k, v.parse().unwrap());
                }
            }
            async move { Ok::<_, std::convert::Infallible>(r) }
        });
        (svc, seen)
    }

    fn get() -> Request<String> {
        Request::get("http://a.example/x")
            .body(String::new())
            .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn retry_after_is_honoured() {
        let (svc, seen) = scripted(vec![(429, vec![("retry-after", "3")])]);
        let mut svc = RetryLayer::new().seed(1).layer(svc);
        let r = svc.ready().await.unwrap().call(get()).await.unwrap();
        assert_eq!(r.status(), 200);
        let seen = seen.lock();
        assert_eq!(seen.len(), 2);
        let gap = seen[1].1 - seen[0].1;
        // The hint, plus at most the base's jitter.
        assert!(gap >= Duration::from_secs(3), "{gap:?}");
        assert!(gap <= Duration::from_millis(3100), "{gap:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn the_ratelimit_reset_when_no_retry_after() {
        let (svc, seen) = scripted(vec![(
            503,
            vec![("ratelimit", r#""a";r=0;t=5, "b";r=0;t=2, "c";r=9;t=60"#)],
        )]);
        let mut svc = RetryLayer::new().seed(2).layer(svc);
        let r = svc.ready().await.unwrap().call(get()).await.unwrap();
        assert_eq!(r.status(), 200);
        let seen = seen.lock();
        let gap = seen[1].1 - seen[0].1;
        assert!(gap >= Duration::from_secs(5) && gap < Duration::from_secs(6));
    }

    #[tokio::test(start_paused = true)]
    async fn backoff_without_a_hint_and_bounded_attempts() {
        let (svc, seen) = scripted(vec![(429, vec![]); 10]);
        let backoff =
            Backoff::new(Duration::from_millis(100), Duration::from_secs(1)).max_retries(3);
        let mut svc = RetryLayer::new().backoff(backoff).seed(3).layer(svc);
        let r = svc.ready().await.unwrap().call(get()).await.unwrap();
        assert_eq!(r.status(), 429);
        let seen = seen.lock();
        assert_eq!(seen.len(), 4);
        for (i, w) in seen.windows(2).enumerate() {
            assert!(w[1].1 - w[0].1 <= backoff.window(i as u32));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_hint_past_the_total_time_is_not_waited_for() {
        let (svc, seen) = scripted(vec![(429, vec![("retry-after", "120")])]);
        let mut svc = RetryLayer::new().layer(svc);
        let r = svc.ready().await.unwrap().call(get()).await.unwrap();
        assert_eq!(r.status(), 429);
        assert_eq!(seen.lock().len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn only_idempotent_or_marked_requests_are_retried() {
        for (method, marked, sent) in [
            (Method::POST, false, 1),
            (Method::PATCH, false, 1),
            (Method::POST, true, 2),
            (Method::PUT, false, 2),
            (Method::DELETE, false, 2),
        ] {
            let (svc, seen) = scripted(vec![(429, vec![("retry-after", "1")])]);
            let mut svc = RetryLayer::new().layer(svc);
            let mut req = get();
            *req.method_mut() = method.clone();
            if marked {
                req.extensions_mut().insert(Retryable);
            }
            let _ = svc.ready().await.unwrap().call(req).await.unwrap();
            let seen = seen.lock();
            assert_eq!(seen.len(), sent, "{method} marked={marked}");
            assert!(seen.iter().all(|(m, _)| *m == method));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn other_statuses_are_returned_at_once() {
        for status in [200, 400, 404, 500, 502] {
            let (svc, seen) = scripted(vec![(status, vec![("retry-after", "1")])]);
            let mut svc = RetryLayer::new().layer(svc);
            let r = svc.ready().await.unwrap().call(get()).await.unwrap();
            assert_eq!(r.status(), status);
            assert_eq!(seen.lock().len(), 1);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_budget_caps_retries_across_requests() {
        let (svc, seen) = scripted(vec![(429, vec![("retry-after", "0")]); 100]);
        // No reserve, 10 % of requests: 10 requests earn one retry.
        let budget = Arc::new(Budget::new(Duration::from_secs(60), 0, 0.1));
        let mut svc = RetryLayer::new()
            .backoff(Backoff::default().max_retries(5))
            .budget(Some(budget))
            .layer(svc);
        for _ in 0..10 {
            let _ = svc.ready().await.unwrap().call(get()).await.unwrap();
        }
        assert_eq!(seen.lock().len(), 11);
    }

    #[tokio::test(start_paused = true)]
    async fn precheck_waits_for_the_reset_or_fails_fast() {
        let limited = vec![
            ("ratelimit-policy", r#""p";q=1;w=10"#),
            ("ratelimit", r#""p";r=0;t=10"#),
        ];
        for when in [
            WhenExhausted::Wait {
                max: Duration::from_secs(30),
            },
            WhenExhausted::FailFast,
        ] {
            let (svc, seen) = scripted(vec![(200, limited.clone())]);
            let pc = Arc::new(Precheck::new(when));
            let mut svc = RetryLayer::new().precheck(pc).layer(svc);
            let r = svc.ready().await.unwrap().call(get()).await.unwrap();
            assert_eq!(r.status(), 200);
            let second = svc.ready().await.unwrap().call(get()).await;
            let seen = seen.lock();
            match when {
                WhenExhausted::Wait { .. } => {
                    assert_eq!(second.unwrap().status(), 200);
                    assert_eq!(seen.len(), 2);
                    assert!(seen[1].1 - seen[0].1 >= Duration::from_secs(10));
                }
                WhenExhausted::FailFast => {
                    let Err(Error::Exhausted(e)) = second else {
                        panic!("not held back")
                    };
                    assert_eq!(e.policy, "p");
                    assert_eq!(seen.len(), 1);
                }
            }
        }
    }
}
