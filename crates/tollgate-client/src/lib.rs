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
pub mod precheck;
pub mod retry_after;

pub use layer::{Error, Retry, RetryLayer, Retryable};
pub use precheck::{Precheck, WhenExhausted};
