//! Tollgate: exact, fast rate limiting.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::algorithm::{Algorithm, Limit, TokenBucket};
//! use tollgate::clock::{Clock, ManualClock};
//! use tollgate::store::{Check, MemoryStore};
//!
//! let clock = ManualClock::new(1_700_000_000_000_000_000);
//! let store = MemoryStore::new();
//! // 5 per second, bursts of 10.
//! let limit = Limit::new(Algorithm::TokenBucket(
//!     TokenBucket::new(5, Duration::from_secs(1)).with_burst(10),
//! ))?;
//! let admitted = (0..12)
//!     .filter(|_| store.check_one(clock.now(), &Check::new(&limit, "api-key-1", 1)).allowed)
//!     .count();
//! assert_eq!(admitted, 10);
//! clock.advance(Duration::from_millis(200)); // one token back
//! assert!(store.check_one(clock.now(), &Check::new(&limit, "api-key-1", 1)).allowed);
//! # Ok::<(), tollgate::algorithm::InvalidLimit>(())
//! ```
//!
//! ## Map
//! - [`algorithm`]: the pure algorithms: (parameters, state, now, cost) → decision.
//! - [`clock`]: time as [`Nanos`](clock::Nanos), the [`Clock`](clock::Clock) trait,
//!   the system clock and a manual clock for tests.
//! - [`decision`]: the [`Decision`] every limiter returns.
//! - [`direct`]: [`DirectLimiter`](direct::DirectLimiter), one limit for one implicit key, lock-free where it can be.
//! - [`http`] (feature `tower`): `RateLimitLayer` for tower/axum/hyper services, the
//!   gateway's `http` rule section, client IP through trusted proxies, RateLimit headers.
//! - [`inflight`]: concurrency permits (`max_in_flight`), in memory or as Redis leases.
//! - [`limiter`]: [`Limiter`](limiter::Limiter), the seam every front end calls: rules + store → decisions.
//! - [`rules`]: Envoy-format rule files, validation, matching, hot reload.
//! - [`sketch`]: [`SpaceSaving`](sketch::SpaceSaving), the heaviest keys of a stream in
//!   fixed memory (the dashboard's hot keys).
//! - [`store`]: the [`Store`](store::Store) trait (atomic, all-or-nothing per request)
//!   and the in-memory [`MemoryStore`](store::MemoryStore).
//! - [`throttle`]: [`Throttle`](throttle::Throttle), a repeating log line written at most
//!   once per interval with its count (the store's failures here, the server's accept
//!   and upstream failures).
//!
//! `docs/ARCHITECTURE.md` in the repository explains how the pieces fit.

pub mod adaptive;
pub mod algorithm;
pub mod clock;
pub mod decision;
pub mod direct;
pub mod headers;
#[cfg(feature = "tower")]
pub mod http;
pub mod inflight;
pub mod limiter;
pub mod rules;
pub mod sketch;
pub mod store;
pub mod throttle;

pub use decision::Decision;
