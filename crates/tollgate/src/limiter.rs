//! [`Limiter`]: the one seam every front end calls: rules + store → decisions.
//!
//! gRPC, the HTTP API, the tower layer and the proxy all turn their input into a
//! [`RateLimitRequest`], call [`Limiter::check`], and turn the [`RateLimitResponse`]
//! into their output. None of them decides anything itself.
//!
//! ```
//! use std::sync::Arc;
//! use tollgate::clock::ManualClock;
//! use tollgate::limiter::{Code, Limiter, RateLimitRequest};
//! use tollgate::rules::{from_str, Rules};
//! use tollgate::store::MemoryStore;
//!
//! let set = from_str("auth.yaml", "domain: auth
//! descriptors:
//!   - key: login
//!     rate_limit: {unit: minute, requests_per_unit: 2, block_duration: 15m}
//! ")?;
//! let limiter = Limiter::new(Arc::new(Rules::fixed(set)), MemoryStore::new())
//!     .with_clock(Arc::new(ManualClock::new(1_700_000_000_000_000_000)));
//! let attempt = RateLimitRequest::new("auth", [vec![("login", "alice")]]);
//! assert_eq!(limiter.check_now(&attempt)?.overall, Code::Ok);
//! assert_eq!(limiter.check_now(&attempt)?.overall, Code::Ok);
//! let third = limiter.check_now(&attempt)?;
//! assert_eq!(third.overall, Code::OverLimit);
//! assert_eq!(third.statuses[0].retry_after_secs(), Some(900));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use crate::algorithm::Limit;
use crate::clock::{Clock, Nanos, SystemClock, NANOS_PER_SEC};
use crate::decision::{Decision, NEVER};
use crate::rules::{Domain, Rule, RuleLimit, Rules, Unit};
use crate::store::{self, Check, MemoryStore, Store};

/// A request: a domain and descriptors, each a list of (key, value) entries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RateLimitRequest {
    /// The rule domain.
    pub domain: String,
    /// The descriptors; each is limited on its own and the request is all-or-nothing.
    pub descriptors: Vec<Descriptor>,
    /// Cost of the request for every descriptor without its own; 0 means 1.
    pub hits_addend: u64,
}

/// One descriptor of a request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Descriptor {
    /// The (key, value) entries, outermost first.
    pub entries: Vec<(String, String)>,
    /// Replaces the configured numbers for this request (the counter stays the same).
    pub limit: Option<LimitOverride>,
    /// This descriptor's cost; overrides the request's. `Some(0)` checks without charging.
    pub hits_addend: Option<u64>,
}

/// A request's own numbers for a descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitOverride {
    /// Requests per unit.
    pub requests_per_unit: u64,
    /// The unit.
    pub unit: Unit,
}

/// OK or over the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// The request may proceed.
    Ok,
    /// The request is over a limit.
    OverLimit,
}

/// The answer to a [`RateLimitRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimitResponse {
    /// OVER_LIMIT when any enforced descriptor is over its limit (and global shadow mode is off).
    pub overall: Code,
    /// One status per request descriptor, in request order.
    pub statuses: Vec<DescriptorStatus>,
}

/// The limit reported for a descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportedLimit {
    /// The limit's name (`name:` in the rule file), if any.
    pub name: Option<String>,
    /// Requests per unit, as configured (without any soft overage).
    pub requests_per_unit: u64,
    /// The unit.
    pub unit: Unit,
}

/// Where a status came from, for metrics: the domain and the rule path, plus the
/// runtime values when the rule asks for detailed metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricKey {
    /// The domain.
    pub domain: String,
    /// `key_value.subkey`-style path of the rule (with runtime values for
    /// `detailed_metric` / `value_to_metric`).
    pub path: String,
}

/// The decision for one request descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescriptorStatus {
    /// OK or OVER_LIMIT (a shadow-mode rule always reports OK).
    pub code: Code,
    /// The limit that decided, `None` when no rule limits the descriptor.
    pub limit: Option<ReportedLimit>,
    /// Units left (uncharged, when the request as a whole was rejected); 4294967295
    /// for an `unlimited` rule; 0 when no rule applies.
    pub remaining: u64,
    /// Until the limit is fully replenished (window end, full bucket, lockout end).
    pub reset_after: Nanos,
    /// For OVER_LIMIT, until a request of the same cost could pass ([`NEVER`] if never).
    pub retry_after: Nanos,
    /// Queue mode: how long to hold the request before forwarding it.
    pub delay: Nanos,
    /// Soft throttling: admitted, but over `requests_per_unit` (within `overage_percent`).
    pub over_soft_limit: bool,
    /// The rule is in shadow mode: it would have rejected, if `would_reject`.
    pub shadow: bool,
    /// A shadow-mode rule that is over its limit.
    pub would_reject: bool,
    /// Metric identity, `None` when no rule matched.
    pub metric: Option<MetricKey>,
}

impl DescriptorStatus {
    fn unlimited_by_rules() -> Self {
        Self {
            code: Code::Ok,
            limit: None,
            remaining: 0,
            reset_after: 0,
            retry_after: 0,
            delay: 0,
            over_soft_limit: false,
            shadow: false,
            would_reject: false,
            metric: None,
        }
    }

    /// `retry_after` in whole seconds, rounded up; `None` when OK or never.
    pub fn retry_after_secs(&self) -> Option<u64> {
        (self.code == Code::OverLimit && self.retry_after != NEVER)
            .then(|| self.retry_after.div_ceil(NANOS_PER_SEC))
    }

    /// `reset_after` in whole seconds, rounded up.
    pub fn reset_after_secs(&self) -> u64 {
        self.reset_after.div_ceil(NANOS_PER_SEC)
    }
}

/// Why a request could not be decided.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request is malformed (answer INVALID_ARGUMENT / 400).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] store::Error),
}

/// Service-wide settings of a [`Limiter`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Settings {
    /// Global shadow mode: statuses are reported as they are, but the overall answer is OK.
    pub global_shadow_mode: bool,
}

/// Rules + store → decisions.
pub struct Limiter<S = MemoryStore> {
    rules: Arc<Rules>,
    store: S,
    clock: Arc<dyn Clock>,
    settings: Settings,
}

impl RateLimitRequest {
    /// A request on `domain` with one descriptor per item of `descriptors`, cost 1.
    pub fn new<K, V, D>(domain: &str, descriptors: impl IntoIterator<Item = D>) -> Self
    where
        K: Into<String>,
        V: Into<String>,
        D: IntoIterator<Item = (K, V)>,
    {
        Self {
            domain: domain.to_string(),
            descriptors: descriptors
                .into_iter()
                .map(|d| Descriptor {
                    entries: d.into_iter().map(|(k, v)| (k.into(), v.into())).collect(),
                    ..Descriptor::default()
                })
                .collect(),
            hits_addend: 0,
        }
    }

    /// Checks what every front end must refuse: an empty domain, no descriptors, a
    /// descriptor without entries, an entry with an empty key.
    pub fn validate(&self) -> Result<(), Error> {
        if self.domain.is_empty() {
            return Err(Error::InvalidRequest("the domain is empty".into()));
        }
        if self.descriptors.is_empty() {
            return Err(Error::InvalidRequest(
                "the request has no descriptors".into(),
            ));
        }
        for (i, d) in self.descriptors.iter().enumerate() {
            if d.entries.is_empty() {
                return Err(Error::InvalidRequest(format!(
                    "descriptor {i} has no entries"
                )));
            }
            if let Some(j) = d.entries.iter().position(|(k, _)| k.is_empty()) {
                return Err(Error::InvalidRequest(format!(
                    "descriptor {i}, entry {j} has an empty key"
                )));
            }
        }
        Ok(())
    }
}

/// One limit to run for one descriptor.
struct Planned<'r> {
    descriptor: usize,
    limit: RuleLimit,
    key: Vec<u8>,
    cost: u64,
    rule: Option<&'r Rule>,
}

impl<S: Store> Limiter<S> {
    /// A limiter over `rules` and `store`, on the system clock.
    pub fn new(rules: Arc<Rules>, store: S) -> Self {
        Self {
            rules,
            store,
            clock: Arc::new(SystemClock),
            settings: Settings::default(),
        }
    }

    /// Uses `clock` for `now` (a [`ManualClock`](crate::clock::ManualClock) in tests).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Sets the service-wide settings.
    pub fn with_settings(mut self, settings: Settings) -> Self {
        self.settings = settings;
        self
    }

    /// The rules this limiter reads.
    pub fn rules(&self) -> &Arc<Rules> {
        &self.rules
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Decides a request.
    pub async fn check(&self, request: &RateLimitRequest) -> Result<RateLimitResponse, Error> {
        request.validate()?;
        let set = self.rules.current();
        let domain = set.domain(&request.domain).map(Arc::as_ref);
        let plan = plan(domain, request);
        let limits: Vec<Limit> = plan.iter().map(|p| p.limit.limit).collect();
        let checks: Vec<Check<'_>> = plan
            .iter()
            .zip(&limits)
            .map(|(p, limit)| Check {
                limit,
                key: &p.key,
                cost: p.cost,
                shadow: p.rule.is_some_and(|r| r.shadow_mode),
            })
            .collect();
        let decisions = if checks.is_empty() {
            Vec::new()
        } else {
            self.store.check(self.clock.now(), &checks).await?
        };
        Ok(self.respond(request, domain, &plan, &decisions))
    }

    fn respond(
        &self,
        request: &RateLimitRequest,
        domain: Option<&Domain>,
        plan: &[Planned<'_>],
        decisions: &[Decision],
    ) -> RateLimitResponse {
        let mut statuses: Vec<DescriptorStatus> = request
            .descriptors
            .iter()
            .map(|d| static_status(domain, d))
            .collect();
        // Per descriptor: the limit that rejected, else the one with the least remaining.
        let mut chosen: Vec<Option<(&Planned<'_>, Decision)>> = vec![None; statuses.len()];
        for (p, d) in plan.iter().zip(decisions) {
            let slot = &mut chosen[p.descriptor];
            let better = match slot {
                None => true,
                Some((_, best)) => {
                    (!d.allowed && best.allowed)
                        || (d.allowed == best.allowed && d.remaining < best.remaining)
                }
            };
            if better {
                *slot = Some((p, *d));
            }
        }
        for (status, choice) in statuses.iter_mut().zip(chosen) {
            if let Some((p, d)) = choice {
                *status = decided_status(p, &d, request, domain);
            }
        }
        let over = statuses.iter().any(|s| s.code == Code::OverLimit);
        RateLimitResponse {
            overall: if over && !self.settings.global_shadow_mode {
                Code::OverLimit
            } else {
                Code::Ok
            },
            statuses,
        }
    }
}

impl Limiter<MemoryStore> {
    /// Decides a request synchronously on the in-memory store (the in-process fast path).
    pub fn check_now(&self, request: &RateLimitRequest) -> Result<RateLimitResponse, Error> {
        request.validate()?;
        let set = self.rules.current();
        let domain = set.domain(&request.domain).map(Arc::as_ref);
        let plan = plan(domain, request);
        let limits: Vec<Limit> = plan.iter().map(|p| p.limit.limit).collect();
        let checks: Vec<Check<'_>> = plan
            .iter()
            .zip(&limits)
            .map(|(p, limit)| Check {
                limit,
                key: &p.key,
                cost: p.cost,
                shadow: p.rule.is_some_and(|r| r.shadow_mode),
            })
            .collect();
        let decisions = self.store.check_all(self.clock.now(), &checks);
        Ok(self.respond(request, domain, &plan, &decisions))
    }
}

/// The status of a descriptor that no limit will be run for.
fn static_status(domain: Option<&Domain>, d: &Descriptor) -> DescriptorStatus {
    let mut status = DescriptorStatus::unlimited_by_rules();
    if let Some(m) = domain.and_then(|dom| dom.find(&d.entries)) {
        status.metric = Some(metric_key(m.domain, m.rule, &d.entries));
        if m.rule.unlimited {
            status.remaining = u64::from(u32::MAX);
        }
    }
    status
}

fn decided_status(
    p: &Planned<'_>,
    d: &Decision,
    request: &RateLimitRequest,
    domain: Option<&Domain>,
) -> DescriptorStatus {
    let l = &p.limit;
    let shadow = p.rule.is_some_and(|r| r.shadow_mode);
    // Soft throttling: the store enforces requests_per_unit plus the overage; report
    // remaining against requests_per_unit and flag the overage.
    let overage = l.hard_limit().saturating_sub(l.requests_per_unit);
    let remaining = d.remaining.saturating_sub(overage);
    let entries = &request.descriptors[p.descriptor].entries;
    DescriptorStatus {
        code: if d.allowed || shadow {
            Code::Ok
        } else {
            Code::OverLimit
        },
        limit: Some(ReportedLimit {
            name: l.name.clone(),
            requests_per_unit: l.requests_per_unit,
            unit: l.unit,
        }),
        remaining,
        reset_after: d.reset_after,
        retry_after: if d.allowed { 0 } else { d.retry_after },
        delay: d.delay,
        over_soft_limit: d.allowed && overage > 0 && d.remaining < overage,
        shadow,
        would_reject: shadow && !d.allowed,
        metric: match (domain, p.rule) {
            (Some(dom), Some(rule)) => Some(metric_key(dom, rule, entries)),
            (Some(dom), None) => Some(MetricKey {
                domain: dom.name.clone(),
                path: override_path(entries),
            }),
            _ => None,
        },
    }
}

/// Works out which limits to run: matching, `unlimited`, overrides and `replaces`.
fn plan<'r>(domain: Option<&'r Domain>, request: &RateLimitRequest) -> Vec<Planned<'r>> {
    let Some(domain) = domain else {
        return Vec::new();
    };
    let default_cost = request.hits_addend.max(1);
    let mut plan = Vec::new();
    for (i, d) in request.descriptors.iter().enumerate() {
        let cost = d.hits_addend.unwrap_or(default_cost);
        let found = domain.find(&d.entries);
        match (found, d.limit) {
            (Some(m), _) if m.rule.unlimited => {}
            (Some(m), Some(o)) => {
                if let Some(first) = m
                    .rule
                    .limits
                    .first()
                    .and_then(|l| l.with_override(o.requests_per_unit, o.unit))
                {
                    plan.push(Planned {
                        descriptor: i,
                        limit: first,
                        key: counter_key(domain, m.rule, &d.entries),
                        cost,
                        rule: Some(m.rule),
                    });
                }
            }
            (Some(m), None) => {
                for l in &m.rule.limits {
                    plan.push(Planned {
                        descriptor: i,
                        limit: l.clone(),
                        key: counter_key(domain, m.rule, &d.entries),
                        cost,
                        rule: Some(m.rule),
                    });
                }
            }
            // Envoy's service applies a request's own limit even where no rule matches.
            (None, Some(o)) => {
                if let Some(limit) = override_limit(domain, d, o) {
                    plan.push(Planned {
                        descriptor: i,
                        limit,
                        key: values_key(&d.entries),
                        cost,
                        rule: None,
                    });
                }
            }
            (None, None) => {}
        }
    }
    let replaced: Vec<String> = plan
        .iter()
        .flat_map(|p| p.limit.replaces.iter().cloned())
        .collect();
    if !replaced.is_empty() {
        plan.retain(|p| !p.limit.name.as_ref().is_some_and(|n| replaced.contains(n)));
    }
    plan
}

fn override_limit(domain: &Domain, d: &Descriptor, o: LimitOverride) -> Option<RuleLimit> {
    let mut h = DefaultHasher::new();
    (
        &domain.name,
        "override",
        d.entries.iter().map(|e| &e.0).collect::<Vec<_>>(),
    )
        .hash(&mut h);
    RuleLimit::fixed_window(o.requests_per_unit, o.unit, h.finish())
}

/// The counter key: the runtime values, each length-prefixed (so no value can be
/// confused with another split differently); below a `share_threshold` wildcard, the
/// pattern instead of the value.
fn counter_key(domain: &Domain, rule: &Rule, entries: &[(String, String)]) -> Vec<u8> {
    let mut chain = vec![rule];
    while let Some(parent) = domain.parent(chain[chain.len() - 1]) {
        chain.push(parent);
    }
    chain.reverse();
    let mut key = Vec::with_capacity(entries.iter().map(|e| e.1.len() + 5).sum());
    for (level, (_, value)) in entries.iter().enumerate() {
        match chain.get(level) {
            Some(r) if r.share_threshold => {
                key.push(1);
                push_part(&mut key, r.value.as_deref().unwrap_or(""));
            }
            _ => {
                key.push(0);
                push_part(&mut key, value);
            }
        }
    }
    key
}

fn values_key(entries: &[(String, String)]) -> Vec<u8> {
    let mut key = Vec::new();
    for (k, v) in entries {
        push_part(&mut key, k);
        push_part(&mut key, v);
    }
    key
}

fn push_part(key: &mut Vec<u8>, part: &str) {
    key.extend_from_slice(&(part.len() as u32).to_le_bytes());
    key.extend_from_slice(part.as_bytes());
}

fn metric_key(domain: &Domain, rule: &Rule, entries: &[(String, String)]) -> MetricKey {
    let path = if rule.detailed_metric {
        entries
            .iter()
            .map(|(k, v)| format!("{k}_{v}"))
            .collect::<Vec<_>>()
            .join(".")
    } else if rule.value_to_metric {
        let mut parts: Vec<&str> = rule.stat_path.split('.').collect();
        let last = entries.len().saturating_sub(1);
        let runtime = entries.get(last).map(|(k, v)| format!("{k}_{v}"));
        if let (Some(slot), Some(rt)) = (parts.last_mut(), runtime.as_deref()) {
            *slot = rt;
        }
        parts.join(".")
    } else {
        rule.stat_path.clone()
    };
    MetricKey {
        domain: domain.name.clone(),
        path,
    }
}

fn override_path(entries: &[(String, String)]) -> String {
    entries
        .iter()
        .map(|(k, _)| k.as_str())
        .collect::<Vec<_>>()
        .join(".")
}
