//! [`Shedding`]: the gateway's load-shedding state, what outlives a reload: each
//! route's adaptive concurrency ([`RouteConcurrency`]) and the system guard
//! ([`SystemGuard`]). The rule set a request is decided by is bound to it once per
//! reload: a route whose place, path and settings are unchanged keeps its controller
//! (and what it measured), and the guard takes the new `system_protection`.
//!
//! [`RateLimitLayer::shedding`](super::RateLimitLayer::shedding) hands it out, read only,
//! for metrics and dashboards.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwapOption;
use parking_lot::Mutex;

use super::adaptive::{RouteConcurrency, RouteStats};
use super::gate::Snapshot;
use super::protection::{SystemGuard, SystemStats};
use crate::adaptive::CpuGauge;
use crate::clock::{nanos, Nanos};

/// The gateway's load-shedding state: each route's adaptive concurrency and the system
/// protection, kept across reloads (a route whose place, path prefix and settings are
/// unchanged keeps its controller and what it measured). Read only from outside: see
/// [`routes`](Self::routes) and [`system`](Self::system).
pub struct Shedding {
    started: Instant,
    system: Arc<SystemGuard>,
    bound: ArcSwapOption<Bound>,
    rebinding: Mutex<()>,
    seed: AtomicU64,
}

impl std::fmt::Debug for Shedding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shedding")
            .field("routes", &self.routes())
            .field("system", &self.system())
            .finish()
    }
}

/// The controllers of one rule set's routes.
pub(crate) struct Bound {
    set: Arc<crate::rules::RuleSet>,
    fixed: Option<Arc<Vec<super::HttpRules>>>,
    /// Per section, per route.
    routes: Vec<Vec<Option<Arc<RouteConcurrency>>>>,
}

impl Bound {
    /// The controller of route `route` of section `section`, if it has one.
    pub(crate) fn route(&self, section: usize, route: usize) -> Option<&Arc<RouteConcurrency>> {
        self.routes.get(section)?.get(route)?.as_ref()
    }
}

impl Shedding {
    pub(crate) fn new(cpu: Option<Arc<dyn CpuGauge>>) -> Self {
        Self {
            started: Instant::now(),
            system: Arc::new(SystemGuard::new(cpu)),
            bound: ArcSwapOption::empty(),
            rebinding: Mutex::new(()),
            seed: AtomicU64::new(0x5EED),
        }
    }

    /// Nanoseconds since the gateway started: the controllers' time.
    pub(crate) fn now(&self) -> Nanos {
        nanos(self.started.elapsed())
    }

    pub(crate) fn guard(&self) -> &Arc<SystemGuard> {
        &self.system
    }

    /// The controllers of the rule set `snapshot` came from, made (or kept) when it is
    /// new. `current` says whether it is the rule set in force (asked only when the
    /// snapshot is not the one bound): a request that read its snapshot before a reload
    /// and binds after it gets no controllers (it is let through) rather than bind the
    /// old set again over the new one.
    pub(crate) fn bind(&self, snapshot: &Snapshot, current: impl Fn() -> bool) -> Arc<Bound> {
        if let Some(b) = self.bound.load_full() {
            if b.matches(snapshot) {
                return b;
            }
        }
        if !current() {
            return Arc::new(Bound {
                set: Arc::clone(&snapshot.set),
                fixed: snapshot.fixed.clone(),
                routes: Vec::new(),
            });
        }
        let _one_at_a_time = self.rebinding.lock();
        let old = self.bound.load_full();
        if let Some(b) = &old {
            if b.matches(snapshot) {
                return Arc::clone(b);
            }
        }
        let bound = Arc::new(self.build(snapshot, old.as_deref()));
        self.bound.store(Some(Arc::clone(&bound)));
        bound
    }

    fn build(&self, snapshot: &Snapshot, old: Option<&Bound>) -> Bound {
        let mut previous: HashMap<String, Arc<RouteConcurrency>> = HashMap::new();
        for (s, section) in old.iter().flat_map(|b| b.routes.iter().enumerate()) {
            for r in section.iter().flatten() {
                previous.insert(key(s, &r.domain, &r.route), Arc::clone(r));
            }
        }
        let sections = snapshot.sections();
        let now = self.now();
        let routes = sections
            .iter()
            .enumerate()
            .map(|(s, section)| {
                section
                    .routes
                    .iter()
                    .enumerate()
                    .map(|(i, route)| {
                        let config = route.adaptive_concurrency.as_ref()?;
                        let name = format!(
                            "{i}:{}",
                            route.matcher.path_prefix.as_deref().unwrap_or("/")
                        );
                        match previous.get(&key(s, &section.domain, &name)) {
                            Some(r) if r.config == *config => Some(Arc::clone(r)),
                            _ => {
                                let seed = self.seed.fetch_add(0x9E37_79B9, Ordering::Relaxed);
                                Some(Arc::new(RouteConcurrency::new(
                                    section.domain.clone(),
                                    name,
                                    config.clone(),
                                    now,
                                    seed,
                                )))
                            }
                        }
                    })
                    .collect()
            })
            .collect();
        self.system
            .configure(sections.iter().find_map(|s| s.system_protection.as_ref()));
        Bound {
            set: Arc::clone(&snapshot.set),
            fixed: snapshot.fixed.clone(),
            routes,
        }
    }

    /// Each route with adaptive concurrency, as it is now, in file and route order.
    pub fn routes(&self) -> Vec<RouteStats> {
        self.bound.load().as_deref().map_or_else(Vec::new, |b| {
            b.routes
                .iter()
                .flatten()
                .flatten()
                .map(|r| r.stats())
                .collect()
        })
    }

    /// System protection as it is now; `None` while no rule file sets it.
    pub fn system(&self) -> Option<SystemStats> {
        self.system.stats(self.now())
    }
}

impl Bound {
    fn matches(&self, snapshot: &Snapshot) -> bool {
        Arc::ptr_eq(&self.set, &snapshot.set)
            && match (&self.fixed, &snapshot.fixed) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            }
    }
}

/// A route's identity across reloads: its section's place, domain, index and prefix.
fn key(section: usize, domain: &str, route: &str) -> String {
    format!("{section}\u{0}{}\u{0}{domain}\u{0}{route}", domain.len())
}
