//! `tollgate proxy`: the HTTP gateway. `gateway.rs` assembles it (rules, store,
//! [`RateLimitLayer`](tollgate::http::RateLimitLayer), listener); `forward.rs` forwards
//! what the layer admits to the upstream, with the headers `headers.rs` removes and
//! adds. The decisions, shaping and concurrency permits are the library's layer, shared
//! with every tower/axum user.

pub mod forward;
pub mod gateway;
mod headers;
