//! The retries that [`RetryLayer`](crate::RetryLayer) and, with the `reqwest` feature,
//! `RetryMiddleware` share: which requests may be sent again, the pre-check before each
//! attempt, the budget, how long to wait before the next attempt, and the loop of
//! attempts ([`Policy::run`]). Each front end gives only its own sending and copying of
//! requests.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, Method, StatusCode, Uri};
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::backoff::{Backoff, Jitter};
use crate::budget::Budget;
use crate::precheck::{Exhausted, Precheck, WhenExhausted};
use crate::retry_after::{retry_after, states};

/// The options a front end is built with (see [`builder!`]).
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) backoff: Backoff,
    pub(crate) budget: Option<Arc<Budget>>,
    pub(crate) seed: Option<u64>,
    pub(crate) precheck: Option<Arc<Precheck>>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            backoff: Backoff::default(),
            budget: Some(Arc::new(Budget::default())),
            seed: None,
            precheck: None,
        }
    }
}

impl Config {
    /// The policy these options make, with its own jitter generator.
    pub(crate) fn policy(&self) -> Policy {
        Policy {
            backoff: self.backoff,
            budget: self.budget.clone(),
            jitter: Mutex::new(self.seed.map_or_else(Jitter::new, Jitter::seeded)),
            precheck: self.precheck.clone(),
        }
    }
}

/// The builder methods of a front end that holds its [`Config`] in a field `config`:
/// `new`, `backoff`, `budget`, `seed`, `precheck`, and `Default`.
macro_rules! builder {
    ($front:ty) => {
        impl Default for $front {
            fn default() -> Self {
                Self::new()
            }
        }

        impl $front {
            /// The default [`Backoff`](crate::backoff::Backoff) and
            /// [`Budget`](crate::budget::Budget), no pre-check.
            pub fn new() -> Self {
                Self::with_config($crate::retry::Config::default())
            }

            /// With `backoff`'s schedule and bounds.
            #[must_use]
            pub fn backoff(self, backoff: $crate::backoff::Backoff) -> Self {
                self.configure(|c| c.backoff = backoff)
            }

            /// With `budget` (shared with whatever else holds it), or none.
            #[must_use]
            pub fn budget(self, budget: Option<std::sync::Arc<$crate::budget::Budget>>) -> Self {
                self.configure(|c| c.budget = budget)
            }

            /// With jitter from a fixed `seed` (for reproducible tests).
            #[must_use]
            pub fn seed(self, seed: u64) -> Self {
                self.configure(|c| c.seed = Some(seed))
            }

            /// With `precheck` before each attempt (it learns from each response).
            #[must_use]
            pub fn precheck(self, precheck: std::sync::Arc<$crate::precheck::Precheck>) -> Self {
                self.configure(|c| c.precheck = Some(precheck))
            }
        }
    };
}
pub(crate) use builder;

/// How a front end sends a request of type `R` and copies it.
pub(crate) trait Front<R> {
    /// Its answer.
    type Answer;
    /// Its error.
    type Error;

    /// What the retries read of `req` before its first attempt.
    fn about<'r>(&self, req: &'r R) -> Sending<'r>;

    /// Sends `req` once.
    fn send(
        &mut self,
        req: R,
    ) -> impl std::future::Future<Output = Result<Self::Answer, Self::Error>> + Send + '_;

    /// What the retries read of `answer`: its status and header fields.
    fn read(answer: &Self::Answer) -> (StatusCode, &HeaderMap);

    /// A copy of `req` to send again, when one can be made.
    fn copy(req: &R) -> Option<R>;

    /// The error of a request the pre-check held back.
    fn held_back(exhausted: Exhausted) -> Self::Error;
}

/// What the retries read of a request before its first attempt.
#[derive(Debug, Clone)]
pub(crate) struct Sending<'r> {
    /// Its method.
    pub(crate) method: &'r Method,
    /// It carries [`Retryable`](crate::Retryable).
    pub(crate) marked: bool,
    /// Its URI, for the pre-check's key (`None`: not pre-checked).
    pub(crate) uri: Option<Uri>,
    /// Its header fields, for the pre-check's key.
    pub(crate) headers: &'r HeaderMap,
}

/// The shared state of one front end: its bounds, budget, jitter and pre-check.
#[derive(Debug)]
pub(crate) struct Policy {
    backoff: Backoff,
    budget: Option<Arc<Budget>>,
    jitter: Mutex<Jitter>,
    precheck: Option<Arc<Precheck>>,
}

impl Policy {
    /// Sends `req` through `front`, then again, copied by it,
    /// while the answer is a 429 or 503 and the policy allows a retry; the pre-check
    /// before each attempt. The last answer, the front's error as it is, or the
    /// pre-check's refusal as the front's error.
    pub(crate) async fn run<R, F: Front<R>>(
        &self,
        req: R,
        front: &mut F,
    ) -> Result<F::Answer, F::Error> {
        let mut attempts = self.attempts(front.about(&req));
        let mut this = req;
        loop {
            let again = attempts.keep(|| F::copy(&this));
            attempts.before_send().await.map_err(F::held_back)?;
            let answer = front.send(this).await?;
            let (status, headers) = F::read(&answer);
            let (Some(wait), Some(again)) = (attempts.after(status, headers), again) else {
                return Ok(answer);
            };
            drop(answer);
            tokio::time::sleep(wait).await;
            this = again;
        }
    }

    /// The attempts at one request. Counts the request in the budget.
    pub(crate) fn attempts(&self, req: Sending<'_>) -> Attempts<'_> {
        let key = self
            .precheck
            .as_ref()
            .zip(req.uri.as_ref())
            .and_then(|(p, uri)| p.key_of(uri, req.headers));
        if let Some(budget) = &self.budget {
            budget.deposit();
        }
        Attempts {
            policy: self,
            start: Instant::now(),
            retryable: retryable(req.method, req.marked),
            key,
            attempt: 0,
            copied: false,
        }
    }
}

/// Where the attempts at one request stand.
#[derive(Debug)]
pub(crate) struct Attempts<'p> {
    policy: &'p Policy,
    start: Instant,
    retryable: bool,
    key: Option<String>,
    attempt: u32,
    /// A copy of the request is kept for the next attempt.
    copied: bool,
}

impl Attempts<'_> {
    /// A copy of the request for the next attempt, made by `copy`, while one may follow
    /// (`None` when none may, or `copy` cannot make one: then it is sent once).
    pub(crate) fn keep<T>(&mut self, copy: impl FnOnce() -> Option<T>) -> Option<T> {
        let kept = if self.retryable && self.attempt < self.policy.backoff.max_retries {
            copy()
        } else {
            None
        };
        self.copied = kept.is_some();
        kept
    }

    /// Before each attempt: the pre-check, which may wait for a reset or refuse.
    pub(crate) async fn before_send(&self) -> Result<(), Exhausted> {
        match (&self.policy.precheck, &self.key) {
            (Some(pc), Some(key)) => precheck(pc, key).await,
            _ => Ok(()),
        }
    }

    /// After an answer with `status` and `headers`: what the pre-check learns, then the
    /// wait before the next attempt, or `None` to return this answer as it is (not a 429
    /// or 503, no copy kept, past the bounds or the budget).
    pub(crate) fn after(&mut self, status: StatusCode, headers: &HeaderMap) -> Option<Duration> {
        let policy = self.policy;
        if let (Some(pc), Some(key)) = (&policy.precheck, &self.key) {
            pc.learn(key, headers);
        }
        if !self.copied
            || !matches!(
                status,
                StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
            )
        {
            return None;
        }
        let attempt = self.attempt;
        let wait = {
            let mut jitter = policy.jitter.lock();
            match hinted_wait(headers) {
                Some(hint) => hint.saturating_add(policy.backoff.delay(0, &mut jitter)),
                None => policy.backoff.delay(attempt, &mut jitter),
            }
        };
        if !policy.backoff.allows(attempt, self.start.elapsed(), wait) {
            tracing::debug!(attempt, ?wait, %status, "no retry: past the attempts or the total time");
            return None;
        }
        if let Some(budget) = &policy.budget {
            if !budget.withdraw() {
                tracing::debug!(attempt, %status, "no retry: the retry budget is spent");
                return None;
            }
        }
        tracing::debug!(attempt, ?wait, %status, "retrying");
        self.attempt += 1;
        Some(wait)
    }
}

/// Whether a request of `method` may be sent again: an idempotent method (GET, HEAD,
/// OPTIONS, PUT, DELETE, TRACE), or `marked` [`Retryable`](crate::Retryable).
pub(crate) fn retryable(method: &Method, marked: bool) -> bool {
    marked
        || matches!(
            *method,
            Method::GET
                | Method::HEAD
                | Method::OPTIONS
                | Method::PUT
                | Method::DELETE
                | Method::TRACE
        )
}

/// The wait a 429 or 503 response asks for: `Retry-After`, else the longest reset of
/// the `RateLimit` items with nothing left.
pub fn hinted_wait(headers: &HeaderMap) -> Option<Duration> {
    retry_after(headers, SystemTime::now()).or_else(|| {
        states(headers)?
            .iter()
            .filter(|s| s.remaining == 0)
            .filter_map(|s| s.reset)
            .max()
            .map(Duration::from_secs)
    })
}

/// Holds back a request while `key` has a policy with nothing left: waits for its reset,
/// or fails, as the pre-check says.
async fn precheck(pc: &Precheck, key: &str) -> Result<(), Exhausted> {
    let mut waited = Duration::ZERO;
    loop {
        let exhausted = match pc.try_take(key) {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        match pc.when_exhausted() {
            WhenExhausted::Wait { max } if waited + exhausted.reset <= max => {
                tracing::debug!(key, policy = %exhausted.policy, wait = ?exhausted.reset, "pre-check: waiting for the reset");
                waited += exhausted.reset;
                tokio::time::sleep(exhausted.reset).await;
            }
            _ => return Err(exhausted),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().unwrap());
        }
        h
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_without_a_copy_is_sent_once() {
        let policy = Config::default().policy();
        let uri: Uri = "http://a.example/x".parse().unwrap();
        let about = Sending {
            method: &Method::GET,
            marked: false,
            uri: Some(uri),
            headers: &HeaderMap::new(),
        };
        let mut attempts = policy.attempts(about);
        // The body could not be copied.
        assert_eq!(attempts.keep(|| None::<()>), None);
        attempts.before_send().await.unwrap();
        let limited = headers(&[("retry-after", "1")]);
        assert_eq!(
            attempts.after(StatusCode::TOO_MANY_REQUESTS, &limited),
            None
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_retries_stop_at_the_bound() {
        let config = Config {
            backoff: Backoff::default().max_retries(2),
            ..Config::default()
        };
        let policy = config.policy();
        let about = Sending {
            method: &Method::POST,
            marked: true,
            uri: None,
            headers: &HeaderMap::new(),
        };
        let mut attempts = policy.attempts(about);
        let limited = headers(&[("retry-after", "1")]);
        for _ in 0..2 {
            assert_eq!(attempts.keep(|| Some(())), Some(()));
            let wait = attempts.after(StatusCode::SERVICE_UNAVAILABLE, &limited);
            assert!(
                wait.is_some_and(|w| w >= Duration::from_secs(1)),
                "{wait:?}"
            );
        }
        assert_eq!(attempts.keep(|| Some(())), None);
        assert_eq!(
            attempts.after(StatusCode::SERVICE_UNAVAILABLE, &limited),
            None
        );
    }

    #[test]
    fn retryable_methods() {
        assert!(retryable(&Method::GET, false));
        assert!(retryable(&Method::PUT, false));
        assert!(!retryable(&Method::POST, false));
        assert!(!retryable(&Method::PATCH, false));
        assert!(retryable(&Method::POST, true));
    }
}
