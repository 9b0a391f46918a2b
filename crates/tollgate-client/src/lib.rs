//! The caller's side of a rate limit.
//!
//! A rate limiter whose callers answer a `429 Too Many Requests` with an immediate retry
//! wastes the capacity it protects. This crate gives an HTTP client what it needs to
//! back off well:
//!
//! - [`retry_after`]: parses `Retry-After` (RFC 9110: delay-seconds or an HTTP-date) and
//!   the IETF draft fields `RateLimit-Policy` and `RateLimit` as Tollgate sends them;
//!   bad input gives `None`, never a panic.
//! - [`backoff`]: exponential backoff with full jitter
//!   (`sleep = random(0, min(cap, base × 2^attempt))`), bounded in attempts and in
//!   total time, with a seedable generator for tests.
//! - [`budget`]: a retry budget, as tower's: retries are at most a share of the
//!   requests over a window, plus a minimum per second.
//! - [`layer`]: [`RetryLayer`], a tower layer for HTTP clients that retries 429 and 503
//!   after the server's hint (else with backoff), within the bounds and the budget, and
//!   only requests that are safe to send twice (idempotent methods, or marked
//!   [`Retryable`]).
//! - [`precheck`]: [`Precheck`], an option of the layer that learns each policy from the
//!   responses' `RateLimit-Policy` and `RateLimit` fields, per partition key, and holds
//!   back a request the server would reject: it waits for the reset or fails fast.
//! - `middleware` (the `reqwest` feature, off by default): `RetryMiddleware`, the same
//!   retries with the same options for a [`reqwest-middleware`] client. A POST is retried
//!   only when marked with `RequestBuilder::with_extension(Retryable)`; a body that
//!   cannot be cloned (a stream) is sent once; a request the pre-check holds back fails
//!   with `reqwest_middleware::Error::Middleware` wrapping a [`precheck::Exhausted`].
//! - [`service`]: [`ServiceClient`], a client of `tollgate serve`'s `POST /v1/check`:
//!   `check(domain, descriptors, hits)` gives a [`Decision`] (allowed, limit, remaining,
//!   reset, retry-after, each descriptor's status), on a pooled connection, within a
//!   per-call deadline, with the caller's [`FailurePolicy`] when the service cannot
//!   answer; with the `grpc` feature, over Envoy's gRPC API too. It reads at most 64 KiB
//!   of an answer ([`ServiceClient::max_answer_bytes`]); a larger one is
//!   [`service::Error::AnswerTooLarge`], not memory without bound.
//!
//! [`reqwest-middleware`]: https://docs.rs/reqwest-middleware/0.4
//!
//! A client over any tower service of `http::Request<B>` with a `Clone` body (hyper-util's
//! legacy `Client` with `Full<Bytes>`, say; here a stub):
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! use http::{Request, Response};
//! use tollgate_client::backoff::Backoff;
//! use tollgate_client::{Precheck, RetryLayer, WhenExhausted};
//! use tower::{Layer, Service, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let http_client = tower::service_fn(|_req: Request<String>| async {
//!     Ok::<_, std::convert::Infallible>(Response::new(String::from("ok")))
//! });
//! // Wait up to 5 s for a policy's reset rather than send a request into a 429.
//! let precheck = Arc::new(Precheck::new(WhenExhausted::Wait {
//!     max: Duration::from_secs(5),
//! }));
//! let mut client = RetryLayer::new()
//!     .backoff(Backoff::new(Duration::from_millis(100), Duration::from_secs(10)).max_retries(3))
//!     .precheck(precheck)
//!     .layer(http_client);
//! let request = Request::get("http://api.example/items").body(String::new())?;
//! let response = client.ready().await?.call(request).await?;
//! assert_eq!(response.status(), 200);
//! # Ok(())
//! # }
//! ```
//!
//! The parts on their own:
//!
//! ```
//! use std::time::{Duration, SystemTime};
//! use tollgate_client::backoff::{Backoff, Jitter};
//! use tollgate_client::retry_after::{parse_retry_after, parse_ratelimit};
//!
//! // What Tollgate answers on a 429.
//! let wait = parse_retry_after("12", SystemTime::now());
//! assert_eq!(wait, Some(Duration::from_secs(12)));
//! let states = parse_ratelimit("\"per_user\";r=0;t=12").unwrap();
//! assert_eq!((states[0].remaining, states[0].reset), (0, Some(12)));
//!
//! // Without such a hint: exponential backoff with full jitter.
//! let backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
//! let mut jitter = Jitter::seeded(7);
//! let sleep = backoff.delay(3, &mut jitter);
//! assert!(sleep <= Duration::from_millis(800));
//! ```

pub mod backoff;
pub mod budget;
pub mod layer;
#[cfg(feature = "reqwest")]
pub mod middleware;
pub mod precheck;
mod retry;
pub mod retry_after;
pub mod service;

pub use layer::{Error, Retry, RetryLayer, Retryable};
#[cfg(feature = "reqwest")]
pub use middleware::RetryMiddleware;
pub use precheck::{Precheck, WhenExhausted};
pub use service::{Decision, Descriptor, FailurePolicy, ServiceClient};
