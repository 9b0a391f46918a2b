//! The HTTP gateway pieces (feature `tower`): [`RateLimitLayer`] for tower, axum and
//! hyper services, and what `tollgate proxy` is built from.
//!
//! ```no_run
//! use std::{net::SocketAddr, sync::Arc};
//! use tollgate::http::RateLimitLayer;
//! use tollgate::limiter::Limiter;
//! use tollgate::rules::{LoadOptions, Rules};
//! use tollgate::store::MemoryStore;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! // Rules and their `http` section (routes, actions) from the same files.
//! let rules = Rules::load(vec!["examples/gateway.yaml".into()], LoadOptions::default())?;
//! let limiter = Arc::new(Limiter::new(Arc::new(rules), MemoryStore::new()));
//! let app = axum::Router::new()
//!     .route("/api/hello", axum::routing::get(|| async { "hello" }))
//!     .layer(RateLimitLayer::new(limiter));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! // The client's address comes from the connection (and trusted proxies' headers).
//! axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
//! # Ok(()) }
//! ```
//!
//! The client's address comes from the request's `ConnectInfo<SocketAddr>` (axum's
//! `into_make_service_with_connect_info`) or a `SocketAddr` extension; without either,
//! every request counts as `0.0.0.0` (one shared `remote_address` key).
//!
//! - [`config`]: the `http` section of a rule file (routes, actions, trusted proxies,
//!   allow and deny lists, concurrency limits, fallbacks).
//! - [`actions`]: descriptors from a request, in Envoy's action vocabulary.
//! - [`path`]: the normalized request path routes compare (and that is forwarded).
//! - [`client_ip`](mod@client_ip): the client address through trusted proxies only,
//!   from one configured header; IPv6 clients keyed by their network.
//! - [`headers`]: `RateLimit-Policy`, `RateLimit`, `Retry-After`, legacy
//!   `X-RateLimit-*`, the problem body; shared with `tollgate serve`.
//! - `layer.rs` / `service.rs`: [`RateLimitLayer`] builds [`RateLimit`], both around
//!   `gate.rs` (what every request consults: limiter, permits, settings, a snapshot of
//!   the rules); `body.rs` holds concurrency permits until the response body ends;
//!   `bandwidth.rs` charges a streamed request body to `cost: request_bytes` entries.
//! - [`observer`]: [`DecisionObserver`], told of every decision (metrics).

pub mod actions;
mod adaptive;
mod bandwidth;
mod body;
pub mod client_ip;
pub mod config;
mod gate;
mod layer;
pub mod observer;
pub mod path;
mod protection;
mod service;
pub mod settings;
mod shedding;

pub use crate::headers;
pub use adaptive::RouteStats;
pub use client_ip::client_ip;
pub use config::HttpRules;
pub use layer::RateLimitLayer;
pub use observer::DecisionObserver;
pub use protection::SystemStats;
pub use service::RateLimit;
pub use shedding::Shedding;
