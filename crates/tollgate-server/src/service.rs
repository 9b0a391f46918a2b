//! [`Service`]: what every front end shares: the limiter, metrics, header settings and
//! readiness. [`Service::decide`] is the one decision path gRPC and HTTP call.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate::limiter::{self, Limiter, RateLimitRequest, RateLimitResponse};

use crate::metrics::Metrics;
use crate::store::AnyStore;
use tollgate::http::headers::HeaderSettings;

/// The state behind every listener.
pub struct Service {
    /// Rules + store → decisions (shared with the gateway's layer).
    pub limiter: Arc<Limiter<AnyStore>>,
    /// Prometheus metrics (shared with the gateway's layer, which records into them).
    pub metrics: Arc<Metrics>,
    /// Which rate limit headers to add.
    pub headers: HeaderSettings,
    ready: AtomicBool,
}

impl Service {
    /// A service over `limiter`; not ready until [`set_ready`](Self::set_ready).
    pub fn new(
        limiter: Arc<Limiter<AnyStore>>,
        metrics: Arc<Metrics>,
        headers: HeaderSettings,
    ) -> Self {
        Self {
            limiter,
            metrics,
            headers,
            ready: AtomicBool::new(false),
        }
    }

    /// Decides a request, recording metrics.
    pub async fn decide(
        &self,
        request: &RateLimitRequest,
    ) -> Result<RateLimitResponse, limiter::Error> {
        self.decide_within(request, None).await
    }

    /// [`decide`](Self::decide) for a caller that waits at most `budget` for the store
    /// ([`Limiter::check_within`]).
    pub async fn decide_within(
        &self,
        request: &RateLimitRequest,
        budget: Option<Duration>,
    ) -> Result<RateLimitResponse, limiter::Error> {
        let started = Instant::now();
        match self.limiter.check_within(request, budget).await {
            Ok(response) => {
                self.metrics
                    .record(request, &response, started.elapsed().as_secs_f64());
                Ok(response)
            }
            Err(e) => {
                if matches!(e, limiter::Error::InvalidRequest(_)) {
                    self.metrics.invalid_request();
                }
                Err(e)
            }
        }
    }

    /// Marks the service ready (rules loaded, listeners bound) or not (draining).
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Release);
    }

    /// Whether `/readyz` answers 200.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }
}
