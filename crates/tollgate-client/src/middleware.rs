//! [`RetryMiddleware`]: the retries of [`RetryLayer`](crate::RetryLayer) for a
//! [`reqwest_middleware`] client (feature `reqwest`).
//!
//! It behaves as the layer does, with the same options ([`backoff`], [`budget`],
//! [`seed`], [`precheck`]): a `429` or `503` is retried after `Retry-After` (or the
//! `RateLimit` reset), else with backoff and full jitter; bounded in retries, in total
//! time and by the budget; only idempotent methods, or a request marked
//! [`Retryable`] with `RequestBuilder::with_extension(Retryable)`. A request whose body
//! cannot be cloned (a stream: `reqwest::Request::try_clone` gives `None`) is sent once,
//! not retried. Errors of the rest of the chain are returned as they are.
//!
//! A request the pre-check holds back is not sent: the error is
//! [`reqwest_middleware::Error::Middleware`] wrapping an [`Exhausted`]; find it with
//! `downcast_ref::<Exhausted>()`:
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! use tollgate_client::middleware::RetryMiddleware;
//! use tollgate_client::precheck::Exhausted;
//! use tollgate_client::{Precheck, Retryable, WhenExhausted};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let precheck = Arc::new(Precheck::new(WhenExhausted::FailFast));
//! let client = reqwest_middleware::ClientBuilder::new(reqwest_middleware::reqwest::Client::new())
//!     .with(RetryMiddleware::new().precheck(precheck))
//!     .build();
//! match client.post("http://api.example/items").with_extension(Retryable).send().await {
//!     Ok(response) => println!("{}", response.status()),
//!     Err(reqwest_middleware::Error::Middleware(e)) if e.is::<Exhausted>() => {
//!         println!("held back: {e}");
//!     }
//!     Err(e) => return Err(e.into()),
//! }
//! # Ok(())
//! # }
//! ```
//!
//! [`backoff`]: RetryMiddleware::backoff
//! [`budget`]: RetryMiddleware::budget
//! [`seed`]: RetryMiddleware::seed
//! [`precheck`]: RetryMiddleware::precheck

use std::sync::OnceLock;

use http::{Extensions, Uri};
use reqwest_middleware::reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};

use crate::layer::Retryable;
use crate::precheck::Exhausted;
use crate::retry::{builder, Config, Front, Policy, Sending};

/// The middleware; see the [module](self) docs. Add it to a
/// `reqwest_middleware::ClientBuilder` with `with`.
#[derive(Debug)]
pub struct RetryMiddleware {
    config: Config,
    /// Made from `config` at the first request (the builder methods come before).
    policy: OnceLock<Policy>,
}

builder!(RetryMiddleware);

impl RetryMiddleware {
    fn with_config(config: Config) -> Self {
        RetryMiddleware {
            config,
            policy: OnceLock::new(),
        }
    }

    fn configure(mut self, set: impl FnOnce(&mut Config)) -> Self {
        set(&mut self.config);
        self.policy = OnceLock::new();
        self
    }

    fn policy(&self) -> &Policy {
        self.policy.get_or_init(|| self.config.policy())
    }
}

#[async_trait::async_trait]
impl Middleware for RetryMiddleware {
    async fn handle(
        &self,
        req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let mut chain = Chain { next, extensions };
        self.policy().run(req, &mut chain).await
    }
}

/// The rest of the middleware chain, as the retries' front end.
struct Chain<'a> {
    next: Next<'a>,
    extensions: &'a mut Extensions,
}

impl Front<Request> for Chain<'_> {
    type Answer = Response;
    type Error = reqwest_middleware::Error;

    fn about<'r>(&self, req: &'r Request) -> Sending<'r> {
        Sending {
            method: req.method(),
            marked: self.extensions.get::<Retryable>().is_some(),
            // A URL reqwest accepted is a valid URI; if not, it is not pre-checked.
            uri: req.url().as_str().parse::<Uri>().ok(),
            headers: req.headers(),
        }
    }

    fn send(
        &mut self,
        req: Request,
    ) -> impl std::future::Future<Output = reqwest_middleware::Result<Response>> + Send + '_ {
        self.next.clone().run(req, self.extensions)
    }

    fn read(answer: &Response) -> (http::StatusCode, &http::HeaderMap) {
        (answer.status(), answer.headers())
    }

    /// `None` for a body that cannot be cloned (a stream): sent once.
    fn copy(req: &Request) -> Option<Request> {
        req.try_clone()
    }

    /// `Error::Middleware` wrapping `exhausted`.
    fn held_back(exhausted: Exhausted) -> reqwest_middleware::Error {
        reqwest_middleware::Error::middleware(exhausted)
    }
}
