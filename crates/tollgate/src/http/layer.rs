//! [`RateLimitLayer`]: wraps any tower HTTP service in [`RateLimit`].

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;

use super::config::{self, HttpRules};
use super::headers::HeaderSettings;
use super::observer::DecisionObserver;
use super::service::RateLimit;
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

/// What every request consults.
pub(crate) struct Gate<S, I> {
    pub limiter: Arc<Limiter<S>>,
    pub inflight: Arc<I>,
    pub headers: HeaderSettings,
    /// Told of every decision, if set.
    pub observer: Option<Arc<dyn DecisionObserver>>,
    http: ArcSwap<Vec<HttpRules>>,
    /// The rule files the `http` sections are read again from when the limiter's rules
    /// reload (`None`: fixed sections).
    files: Option<Vec<PathBuf>>,
    /// The rule set the sections were read with (its address).
    seen: AtomicUsize,
}

impl<S: Store> RateLimitLayer<S, MemoryInFlight> {
    /// A layer over `limiter` reading the `http` sections of the limiter's own rule
    /// files, and again whenever those rules reload; concurrency permits in memory.
    /// Fails with every problem in the sections (file, line, problem).
    pub fn new(limiter: Arc<Limiter<S>>) -> Result<Self, crate::rules::ConfigErrors> {
        let files = limiter.rules().paths().to_vec();
        let http = config::load(&files)?;
        let set = limiter.rules().current();
        Ok(Self::build(
            limiter,
            MemoryInFlight::new(),
            http,
            Some(files),
            Arc::as_ptr(&set) as usize,
        ))
    }

    /// A layer with fixed `http` sections (e.g. from [`config::from_str`]).
    pub fn with_sections(limiter: Arc<Limiter<S>>, http: Vec<HttpRules>) -> Self {
        Self::build(limiter, MemoryInFlight::new(), http, None, 0)
    }
}

impl<S, I> RateLimitLayer<S, I> {
    fn build(
        limiter: Arc<Limiter<S>>,
        inflight: I,
        http: Vec<HttpRules>,
        files: Option<Vec<PathBuf>>,
        seen: usize,
    ) -> Self {
        Self {
            gate: Arc::new(Gate {
                limiter,
                inflight: Arc::new(inflight),
                headers: HeaderSettings::default(),
                observer: None,
                http: ArcSwap::from_pointee(http),
                files,
                seen: AtomicUsize::new(seen),
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
        let g = &self.gate;
        RateLimitLayer {
            gate: Arc::new(Gate {
                limiter: Arc::clone(&g.limiter),
                inflight,
                headers,
                observer,
                http: ArcSwap::new(g.http.load_full()),
                files: g.files.clone(),
                seen: AtomicUsize::new(g.seen.load(Ordering::Relaxed)),
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
        self.gate.sections().iter().map(|s| s.routes.len()).sum()
    }
}

impl<S: Store, I> Gate<S, I> {
    /// The current `http` sections, read again first if the rules have reloaded. A
    /// section that no longer reads keeps the old one serving (and is logged).
    pub fn sections(&self) -> Arc<Vec<HttpRules>> {
        if let Some(files) = &self.files {
            let set = self.limiter.rules().current();
            let now = Arc::as_ptr(&set) as usize;
            if self.seen.swap(now, Ordering::AcqRel) != now {
                match config::load(files) {
                    Ok(http) => self.http.store(Arc::new(http)),
                    Err(e) => tracing::error!(
                        errors = %e,
                        "the http sections did not reload; the previous ones keep serving"
                    ),
                }
            }
        }
        self.http.load_full()
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
