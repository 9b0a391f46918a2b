//! [`Service`]: what every front end shares: the limiter, metrics, header settings and
//! readiness. [`Service::decide`] is the one decision path gRPC and HTTP call.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tollgate::limiter::{self, Limiter, RateLimitRequest, RateLimitResponse};

use crate::metrics::Metrics;
use crate::store::AnyStore;
use tollgate::headers::HeaderSettings;

/// What every API answers while no rules are loaded (the rule files were invalid or
/// missing at start and have not been fixed since), in envoyproxy/ratelimit's words:
/// gRPC `UNKNOWN` with this message, HTTP 503 with it as the problem's detail.
pub const NO_RULES: &str = "no rate limit configuration loaded";

/// Whether the service takes calls, as the health endpoints and the gRPC health
/// service report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// Starting (listeners not up, Redis not warm yet) or no rules loaded.
    NotReady,
    /// Rules loaded, warm, listeners up.
    Ready,
    /// SIGTERM: finishing the calls in flight, then exiting.
    Draining,
}

/// The state behind every listener.
pub struct Service {
    /// Rules + store → decisions (shared with the gateway's layer).
    pub limiter: Arc<Limiter<AnyStore>>,
    /// Prometheus metrics (shared with the gateway's layer, which records into them).
    pub metrics: Arc<Metrics>,
    /// Which rate limit headers to add.
    pub headers: HeaderSettings,
    /// Send the response's dynamic metadata (`--response-dynamic-metadata`; see
    /// `grpc::metadata`).
    pub dynamic_metadata: bool,
    /// Listeners up (and, on Redis, warm).
    started: AtomicBool,
    draining: AtomicBool,
    /// Whether `POST /v1/enforcement` may switch (an admin token, or the admin endpoints
    /// on a loopback listener): see [`allow_switch`](Self::allow_switch).
    switch_allowed: AtomicBool,
    /// The last [`Readiness`] published to watchers (the gRPC health `Watch`).
    readiness: watch::Sender<Readiness>,
}

impl Service {
    /// A service over `limiter`; not ready until [`set_ready`](Self::set_ready) and its
    /// rules are loaded.
    pub fn new(
        limiter: Arc<Limiter<AnyStore>>,
        metrics: Arc<Metrics>,
        headers: HeaderSettings,
    ) -> Self {
        metrics.know_rules(Arc::clone(limiter.rules()));
        Self {
            limiter,
            metrics,
            headers,
            dynamic_metadata: false,
            started: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            switch_allowed: AtomicBool::new(false),
            readiness: watch::Sender::new(Readiness::NotReady),
        }
    }
    /// The same service, sending the response's dynamic metadata or not.
    pub fn with_dynamic_metadata(mut self, on: bool) -> Self {
        self.dynamic_metadata = on;
        self
    }

    /// Decides a request, recording metrics. Front ends check
    /// [`rules_loaded`](Self::rules_loaded) first: without rules the limiter would
    /// answer every request OK.
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

    /// Whether rules are in force. False only while the rule files have not loaded
    /// since the start (they were invalid or missing): every API then answers
    /// [`NO_RULES`] instead of a decision.
    pub fn rules_loaded(&self) -> bool {
        self.limiter.rules().is_loaded()
    }

    /// Marks the service started (listeners bound, warm) or not; it is ready once its
    /// rules are loaded too.
    pub fn set_ready(&self, ready: bool) {
        self.started.store(ready, Ordering::Release);
        self.refresh();
    }

    /// Marks the service draining (SIGTERM): not ready from now on.
    /// Lets `POST /v1/enforcement` switch when the admin endpoints are guarded: an
    /// admin token is required (`token`), or they are served on `addr`, a loopback
    /// address. Otherwise anyone who can ask for a decision could stop every limit of
    /// the fleet, so the switch answers 403.
    pub fn allow_switch(&self, token: bool, addr: std::net::SocketAddr) {
        let allowed = token || addr.ip().to_canonical().is_loopback();
        self.switch_allowed.store(allowed, Ordering::Release);
    }

    /// Whether `POST /v1/enforcement` may switch.
    pub fn switch_allowed(&self) -> bool {
        self.switch_allowed.load(Ordering::Acquire)
    }

    pub fn drain(&self) {
        self.draining.store(true, Ordering::Release);
        self.refresh();
    }

    /// Whether the service takes calls now: `/readyz` answers 200 and the gRPC
    /// health service SERVING only while [`Readiness::Ready`].
    pub fn readiness(&self) -> Readiness {
        if self.draining.load(Ordering::Acquire) {
            Readiness::Draining
        } else if self.started.load(Ordering::Acquire) && self.rules_loaded() {
            Readiness::Ready
        } else {
            Readiness::NotReady
        }
    }

    /// Tells the watchers of [`watch_readiness`](Self::watch_readiness) the current
    /// readiness, if it changed. [`set_ready`](Self::set_ready) and
    /// [`drain`](Self::drain) call it; so must whoever sees the rules load (they load
    /// on another thread, from the file watcher, SIGHUP or `POST /reload`).
    pub fn refresh(&self) {
        let now = self.readiness();
        self.readiness.send_if_modified(|published| {
            let changed = *published != now;
            *published = now;
            changed
        });
    }

    /// A receiver of every change of readiness (as [`refresh`](Self::refresh) sees it).
    pub fn watch_readiness(&self) -> watch::Receiver<Readiness> {
        self.readiness.subscribe()
    }
}
