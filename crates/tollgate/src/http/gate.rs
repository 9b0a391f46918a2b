//! [`Gate`]: what every request of a [`RateLimitLayer`](super::RateLimitLayer) consults,
//! shared by the layer (which builds it) and the service (which reads it).

use std::sync::Arc;

use super::config::HttpRules;
use super::observer::DecisionObserver;
use super::shedding::Shedding;
use crate::headers::HeaderSettings;
use crate::limiter::Limiter;
use crate::rules::RuleSet;
use crate::store::Store;

/// What every request consults.
pub(crate) struct Gate<S, I> {
    pub limiter: Arc<Limiter<S>>,
    pub inflight: Arc<I>,
    pub headers: HeaderSettings,
    /// Told of every decision, if set.
    pub observer: Option<Arc<dyn DecisionObserver>>,
    /// Fixed `http` sections; `None`: those of the limiter's current rule set.
    pub fixed: Option<Arc<Vec<HttpRules>>>,
    /// Refuse an HTTP/1.1 request without `Host` (400) before deciding on it.
    pub require_host: bool,
    /// Adaptive concurrency and system protection.
    pub shedding: Arc<Shedding>,
}

/// The rules one request is decided by: the routes and the limits of one load.
pub(crate) struct Snapshot {
    pub set: Arc<RuleSet>,
    pub fixed: Option<Arc<Vec<HttpRules>>>,
}

impl Snapshot {
    /// The `http` sections, in file order.
    pub fn sections(&self) -> &[HttpRules] {
        match &self.fixed {
            Some(fixed) => fixed,
            None => self.set.http(),
        }
    }
}

impl<S: Store, I> Gate<S, I> {
    /// The rules now: the limiter's current rule set and its sections (or the fixed
    /// ones).
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            set: self.limiter.rules().current(),
            fixed: self.fixed.clone(),
        }
    }
}
