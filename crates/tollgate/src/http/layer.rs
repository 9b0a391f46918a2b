//! [`RateLimitLayer`]: wraps any tower HTTP service in [`RateLimit`].

use std::sync::Arc;

use super::config::HttpRules;
use super::gate::Gate;
use super::observer::DecisionObserver;
use super::service::RateLimit;
use super::shedding::Shedding;
use crate::adaptive::CpuGauge;
use crate::headers::HeaderSettings;
use crate::inflight::{InFlight, MemoryInFlight};
use crate::limiter::Limiter;
use crate::store::{MemoryStore, Store};

/// A tower layer limiting requests by the `http` section of the rule files. Cloning
/// is cheap; every clone shares the limiter, the permits and the configuration.
pub struct RateLimitLayer<S = MemoryStore, I = MemoryInFlight> {
    pub(crate) gate: Arc<Gate<S, I>>,
}

impl<S, I> Clone for RateLimitLayer<S, I> {
    fn clone(&self) -> Self {
        Self {
            gate: Arc::clone(&self.gate),
        }
    }
}

impl<S: Store> RateLimitLayer<S, MemoryInFlight> {
    /// A layer over `limiter` routing by the `http` sections of the limiter's own rule
    /// files: they are read with the rules, in the same load, so a reload changes routes
    /// and limits together (and no request reads a file). Concurrency permits in memory.
    pub fn new(limiter: Arc<Limiter<S>>) -> Self {
        Self::build(limiter, MemoryInFlight::new(), None)
    }

    /// A layer with fixed `http` sections (e.g. from [`config::from_str`](super::config::from_str)).
    ///
    /// The routes stay these for the life of the layer: a reload of the limiter's rules
    /// changes the limits (the numbers, the algorithms, rules added or removed) but not
    /// the routes, nor which descriptors a request sends. Build the layer with
    /// [`new`](Self::new) for routes that follow the rule files.
    pub fn with_sections(limiter: Arc<Limiter<S>>, http: Vec<HttpRules>) -> Self {
        Self::build(limiter, MemoryInFlight::new(), Some(Arc::new(http)))
    }
}

impl<S, I> RateLimitLayer<S, I> {
    fn build(limiter: Arc<Limiter<S>>, inflight: I, fixed: Option<Arc<Vec<HttpRules>>>) -> Self {
        Self {
            gate: Arc::new(Gate {
                limiter,
                inflight: Arc::new(inflight),
                headers: HeaderSettings::default(),
                observer: None,
                fixed,
                require_host: false,
                shedding: Arc::new(Shedding::new(None)),
            }),
        }
    }

    /// The same layer with other permits, header settings or observer.
    fn rebuild<J>(
        &self,
        inflight: Arc<J>,
        headers: HeaderSettings,
        observer: Option<Arc<dyn DecisionObserver>>,
    ) -> RateLimitLayer<S, J> {
        self.rebuild_with(
            inflight,
            headers,
            observer,
            self.gate.require_host,
            Arc::clone(&self.gate.shedding),
        )
    }

    fn rebuild_with<J>(
        &self,
        inflight: Arc<J>,
        headers: HeaderSettings,
        observer: Option<Arc<dyn DecisionObserver>>,
        require_host: bool,
        shedding: Arc<Shedding>,
    ) -> RateLimitLayer<S, J> {
        let g = &self.gate;
        RateLimitLayer {
            gate: Arc::new(Gate {
                limiter: Arc::clone(&g.limiter),
                inflight,
                headers,
                observer,
                fixed: g.fixed.clone(),
                require_host,
                shedding,
            }),
        }
    }

    /// Concurrency permits from `inflight` (e.g. a `RedisInFlight`, whose leases expire
    /// if this instance dies) instead of memory.
    pub fn with_inflight<J: InFlight>(self, inflight: J) -> RateLimitLayer<S, J> {
        self.rebuild(
            Arc::new(inflight),
            self.gate.headers,
            self.gate.observer.clone(),
        )
    }

    /// Also add the legacy `X-RateLimit-Limit/Remaining/Reset` headers.
    pub fn with_legacy_headers(self, legacy: bool) -> Self {
        let headers = HeaderSettings {
            legacy,
            ..self.gate.headers
        };
        self.rebuild(
            Arc::clone(&self.gate.inflight),
            headers,
            self.gate.observer.clone(),
        )
    }

    /// Refuse (400, before any limit is charged) an HTTP/1.1 request without a `Host`
    /// header, as RFC 9112 §3.2 asks of a server; a repeated `Host` is refused either
    /// way. Off by default, since requests built in-process (tests, `oneshot`) often
    /// have none; `tollgate proxy` turns it on, so that a request its forwarder would
    /// refuse is not counted first.
    pub fn with_host_required(self, required: bool) -> Self {
        self.rebuild_with(
            Arc::clone(&self.gate.inflight),
            self.gate.headers,
            self.gate.observer.clone(),
            required,
            Arc::clone(&self.gate.shedding),
        )
    }

    /// Read the host's CPU use from `gauge` for `system_protection`'s `max_cpu` (e.g.
    /// [`ProcStat`](crate::adaptive::ProcStat)); without one the CPU rule sheds
    /// nothing. Call it before the layer serves: what was measured starts again.
    pub fn with_cpu_gauge(self, gauge: Arc<dyn CpuGauge>) -> Self {
        self.rebuild_with(
            Arc::clone(&self.gate.inflight),
            self.gate.headers,
            self.gate.observer.clone(),
            self.gate.require_host,
            Arc::new(Shedding::new(Some(gauge))),
        )
    }

    /// The layer's load shedding as it is now: each route's adaptive concurrency and
    /// the system protection, for metrics and dashboards.
    pub fn shedding(&self) -> Arc<Shedding> {
        Arc::clone(&self.gate.shedding)
    }

    /// Tell `observer` of every decision (the request built, the answer, the time the
    /// check took), e.g. to count them in metrics.
    pub fn with_observer(self, observer: Arc<dyn DecisionObserver>) -> Self {
        self.rebuild(
            Arc::clone(&self.gate.inflight),
            self.gate.headers,
            Some(observer),
        )
    }
}

impl<S: Store, I> RateLimitLayer<S, I> {
    /// How many routes the `http` sections have now: with none, the layer limits
    /// nothing (every request passes through).
    pub fn route_count(&self) -> usize {
        let now = self.gate.snapshot();
        now.sections().iter().map(|s| s.routes.len()).sum()
    }
}

impl<Svc, S, I> tower::Layer<Svc> for RateLimitLayer<S, I> {
    type Service = RateLimit<Svc, S, I>;

    fn layer(&self, inner: Svc) -> Self::Service {
        RateLimit {
            inner,
            gate: Arc::clone(&self.gate),
        }
    }
}
