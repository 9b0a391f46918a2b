//! [`DecisionObserver`]: what a [`RateLimitLayer`](super::RateLimitLayer) reports after
//! each limiter check, for metrics. `tollgate proxy` records them in the same Prometheus
//! metrics as `tollgate serve`.

use std::time::Duration;

use crate::limiter::{RateLimitRequest, RateLimitResponse};

/// Receives every decision a [`RateLimitLayer`](super::RateLimitLayer) makes.
///
/// Called on the request's task, after the check and before the response is built:
/// keep it cheap (count, do not block).
pub trait DecisionObserver: Send + Sync + 'static {
    /// `request` (the descriptors the layer built) was answered `response`; the check
    /// took `elapsed`.
    fn decided(&self, request: &RateLimitRequest, response: &RateLimitResponse, elapsed: Duration);
}
