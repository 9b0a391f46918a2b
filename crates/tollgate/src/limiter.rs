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

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use crate::clock::{Clock, Nanos, SystemClock, NANOS_PER_SEC};
use crate::decision::{Decision, NEVER};
use crate::rules::Metadata;
use crate::rules::{Domain, FailureMode, Rule, RuleLimit, Rules, Unit};
use crate::store::{self, ChargeRejected, Check, MemoryStore, Store};

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
    /// Replaces the configured numbers for this request: the rule's counter when the unit is
    /// the rule's, else a counter of this descriptor and unit (as Envoy's service counts).
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
    /// The store's failure, when it failed and the failure modes decided instead:
    /// `timeout`, `error` or `circuit_open`.
    pub store_failure: Option<&'static str>,
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
    pub domain: Arc<str>,
    /// `key_value.subkey`-style path of the rule (with runtime values for
    /// `detailed_metric` / `value_to_metric`).
    pub path: Arc<str>,
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
    /// Rejected by the store's local cache of blocked keys, without a round trip.
    pub from_cache: bool,
    /// Set when the store failed and this status comes from the rule's failure mode.
    pub failure_mode: Option<FailureMode>,
    /// Quota mode, with the descriptor's quota group: over its limit, this descriptor
    /// alone does not make the request OVER_LIMIT; every quota group having a
    /// descriptor over its limit does (see [`quota_groups`]).
    pub quota: Option<u32>,
    /// The matched rule's `metadata`, for the response's dynamic metadata: set when the
    /// rule's own limit was checked (not for `unlimited`, a rule without a limit, or a
    /// request's own limit, as Envoy's service does).
    pub metadata: Option<Arc<Metadata>>,
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
            from_cache: false,
            failure_mode: None,
            quota: None,
            metadata: None,
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

/// How large a request may be: what [`RateLimitRequest::validate`] refuses beyond
/// (INVALID_ARGUMENT / 400), so that no single call can cost a worker more than a
/// bounded amount of work or make an answer of unbounded size.
///
/// The defaults are above what Envoy sends: one descriptor per `rate_limits` action
/// list of a route (a handful in practice), one entry per action, and values no longer
/// than Envoy's own limit on a request's headers (`max_request_headers_kb`, 60 KiB by
/// default), so that a request Envoy makes is never refused (Envoy's filter would then
/// let it through by `failure_mode_deny: false`, its default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// Most descriptors in one request (`--max-descriptors`; default 64).
    pub max_descriptors: usize,
    /// Most entries in one descriptor (`--max-entries`; default 32).
    pub max_entries: usize,
    /// Most bytes in one entry's key, and in its value (`--max-entry-bytes`; default
    /// 65,536).
    pub max_entry_bytes: usize,
}

impl RequestLimits {
    /// Default of [`max_descriptors`](Self::max_descriptors).
    pub const DEFAULT_MAX_DESCRIPTORS: usize = 64;
    /// Default of [`max_entries`](Self::max_entries).
    pub const DEFAULT_MAX_ENTRIES: usize = 32;
    /// Default of [`max_entry_bytes`](Self::max_entry_bytes).
    pub const DEFAULT_MAX_ENTRY_BYTES: usize = 64 << 10;

    /// `Err` once a request has more than [`max_descriptors`](Self::max_descriptors):
    /// `count` is how many it has (or has so far, for a decoder that stops there).
    pub fn check_descriptor_count(&self, count: usize) -> Result<(), Error> {
        if count > self.max_descriptors {
            return Err(Error::InvalidRequest(format!(
                "a request may carry at most {} descriptors (--max-descriptors)",
                self.max_descriptors
            )));
        }
        Ok(())
    }

    /// `Err` once descriptor `i` has more than [`max_entries`](Self::max_entries):
    /// `count` is how many it has (or has so far).
    pub fn check_entry_count(&self, i: usize, count: usize) -> Result<(), Error> {
        if count > self.max_entries {
            return Err(Error::InvalidRequest(format!(
                "descriptor {i}: a descriptor may carry at most {} entries (--max-entries)",
                self.max_entries
            )));
        }
        Ok(())
    }

    /// `Err` when entry `j` of descriptor `i` has a key or a value longer than
    /// [`max_entry_bytes`](Self::max_entry_bytes).
    pub fn check_entry(&self, i: usize, j: usize, key: &str, value: &str) -> Result<(), Error> {
        for (what, text) in [("key", key), ("value", value)] {
            if text.len() > self.max_entry_bytes {
                return Err(Error::InvalidRequest(format!(
                    "descriptor {i}, entry {j}: the {what} is {} bytes; a key or value may be \
                     at most {} bytes (--max-entry-bytes)",
                    text.len(),
                    self.max_entry_bytes
                )));
            }
        }
        Ok(())
    }

    /// Checks the sizes of `descriptors` (each given by its entries) in the order a
    /// decoder reads them: descriptor by descriptor, the count of descriptors first,
    /// then each entry's count and lengths. The first size over a limit is reported,
    /// so a decoder that stops at it and a check of the whole request agree.
    pub fn check_sizes<'a, E>(&self, descriptors: impl IntoIterator<Item = E>) -> Result<(), Error>
    where
        E: IntoIterator<Item = (&'a str, &'a str)>,
    {
        for (i, entries) in descriptors.into_iter().enumerate() {
            self.check_descriptor_count(i + 1)?;
            for (j, (key, value)) in entries.into_iter().enumerate() {
                self.check_entry_count(i, j + 1)?;
                self.check_entry(i, j, key, value)?;
            }
        }
        Ok(())
    }
}

impl Default for RequestLimits {
    /// 64 descriptors of 32 entries, keys and values of at most 64 KiB.
    fn default() -> Self {
        Self {
            max_descriptors: Self::DEFAULT_MAX_DESCRIPTORS,
            max_entries: Self::DEFAULT_MAX_ENTRIES,
            max_entry_bytes: Self::DEFAULT_MAX_ENTRY_BYTES,
        }
    }
}

/// Service-wide settings of a [`Limiter`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Settings {
    /// Global shadow mode: statuses are reported as they are, but the overall answer is OK.
    pub global_shadow_mode: bool,
    /// Every descriptor in quota mode, as if each rule said `quota_mode: true`.
    pub global_quota_mode: bool,
    /// Whether a rejected request is charged, where the rule file does not say
    /// (`charge_rejected`; `None`, all or nothing, by default).
    pub charge_rejected: ChargeRejected,
    /// How large a request may be ([`RequestLimits::default`] unless set).
    pub limits: RequestLimits,
}

/// Rules + store → decisions.
pub struct Limiter<S = MemoryStore> {
    rules: Arc<Rules>,
    store: S,
    clock: Arc<dyn Clock>,
    settings: Settings,
    fallback: MemoryStore,
    failures: FailureLog,
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

    /// Checks what every front end must refuse: an empty domain, no descriptors (with
    /// Envoy's service's words), a request larger than `limits` allow (the first size
    /// over a limit, in [`RequestLimits::check_sizes`]'s order), an entry with an empty
    /// key. A descriptor without entries is not refused: no rule matches it, and it is
    /// answered OK with no limit, as Envoy's service answers it.
    pub fn validate(&self, limits: &RequestLimits) -> Result<(), Error> {
        if self.domain.is_empty() {
            return Err(Error::InvalidRequest(
                "rate limit domain must not be empty".into(),
            ));
        }
        if self.descriptors.is_empty() {
            return Err(Error::InvalidRequest(
                "rate limit descriptor list must not be empty".into(),
            ));
        }
        limits.check_sizes(
            self.descriptors
                .iter()
                .map(|d| d.entries.iter().map(|(k, v)| (k.as_str(), v.as_str()))),
        )?;
        for (i, d) in self.descriptors.iter().enumerate() {
            if let Some(j) = d.entries.iter().position(|(k, _)| k.is_empty()) {
                return Err(Error::InvalidRequest(format!(
                    "descriptor {i}, entry {j} has an empty key"
                )));
            }
        }
        Ok(())
    }
}

/// What the limiter will do for one request: per descriptor its match and counter
/// key, and the limits to run.
struct Plan<'r> {
    /// Per request descriptor: the matched rule (if any) and its counter key.
    matched: Vec<Option<(&'r Rule, Vec<u8>)>>,
    /// The limits to run, in descriptor order.
    runs: Vec<Run<'r>>,
}

impl Plan<'_> {
    /// A run's failure mode: its rule's, or the domain's for a request's own limit.
    fn mode(&self, run: &Run<'_>, domain: Option<&Domain>) -> FailureMode {
        match &self.matched[run.descriptor] {
            Some((rule, _)) => rule.failure_mode,
            None => domain.map(|d| d.failure_mode).unwrap_or_default(),
        }
    }
}

/// One limit to run for one descriptor.
struct Run<'r> {
    descriptor: usize,
    limit: Cow<'r, RuleLimit>,
    cost: u64,
    shadow: bool,
    quota: Option<u32>,
    charge: ChargeRejected,
}

impl Plan<'_> {
    fn checks<'a>(&'a self, override_keys: &'a [Vec<u8>]) -> Vec<Check<'a>> {
        self.runs
            .iter()
            .map(|r| Check {
                limit: &r.limit.limit,
                key: match &self.matched[r.descriptor] {
                    Some((_, key)) => key,
                    None => &override_keys[r.descriptor],
                },
                cost: r.cost,
                shadow: r.shadow,
                quota: r.quota,
                charge: r.charge,
            })
            .collect()
    }
}

impl<S: Store> Limiter<S> {
    /// A limiter over `rules` and `store`, on the system clock.
    pub fn new(rules: Arc<Rules>, store: S) -> Self {
        Self {
            rules,
            store,
            clock: Arc::new(SystemClock),
            settings: Settings::default(),
            fallback: MemoryStore::new(),
            failures: FailureLog::default(),
        }
    }

    /// The in-memory store that decides `local_fallback` limits while the store fails
    /// (a default one otherwise; give one with a `max_keys` bound for production).
    pub fn with_fallback(mut self, fallback: MemoryStore) -> Self {
        self.fallback = fallback;
        self
    }

    /// The local fallback store (to sweep it, or read its size).
    pub fn fallback(&self) -> &MemoryStore {
        &self.fallback
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

    /// The service-wide settings.
    pub fn settings(&self) -> &Settings {
        &self.settings
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
        self.check_within(request, None).await
    }

    /// Decides a request for a caller that waits at most `budget` (a gRPC client's
    /// `grpc-timeout`, say): a store that may wait answers by then, and if it could not,
    /// each rule's `failure_mode` does ([`Store::check_within`]), so that the caller gets
    /// the rule's answer rather than its own timeout. `None`: the store's own deadline.
    pub async fn check_within(
        &self,
        request: &RateLimitRequest,
        budget: Option<std::time::Duration>,
    ) -> Result<RateLimitResponse, Error> {
        self.check_in(&self.rules.current(), request, budget).await
    }

    /// Decides a request by the rules of `set` (a snapshot of [`rules`](Self::rules)
    /// the caller already holds, e.g. the one its gateway routes came from) rather than
    /// the current one: what the caller matched and what is checked cannot come from
    /// two reloads.
    pub async fn check_in(
        &self,
        set: &crate::rules::RuleSet,
        request: &RateLimitRequest,
        budget: Option<std::time::Duration>,
    ) -> Result<RateLimitResponse, Error> {
        request.validate(&self.settings.limits)?;
        let domain = set.domain(&request.domain).map(Arc::as_ref);
        let plan = plan(domain, request, self.settings);
        let override_keys = override_keys(&plan, request);
        let checks = plan.checks(&override_keys);
        if checks.is_empty() {
            return Ok(self.respond(request, domain, &plan, &[], None));
        }
        let now = self.clock.now();
        let decided = match budget {
            None => self.store.check(now, &checks).await,
            Some(budget) => self.store.check_within(now, &checks, budget).await,
        };
        match decided {
            Ok(decisions) => Ok(self.respond(request, domain, &plan, &decisions, None)),
            Err(e) => {
                self.failures.record(&e);
                let decisions = self.fail(now, domain, &plan, &checks);
                let mut response = self.respond(request, domain, &plan, &decisions, Some(domain));
                response.store_failure = Some(e.kind());
                Ok(response)
            }
        }
    }

    /// Decisions by each check's failure mode, when the store failed.
    fn fail(
        &self,
        now: Nanos,
        domain: Option<&Domain>,
        plan: &Plan<'_>,
        checks: &[Check<'_>],
    ) -> Vec<Decision> {
        let modes: Vec<FailureMode> = plan.runs.iter().map(|r| plan.mode(r, domain)).collect();
        let closed = modes
            .iter()
            .zip(checks)
            .any(|(m, c)| *m == FailureMode::FailClosed && !c.shadow);
        // The fallback store decides the local_fallback checks together (all or
        // nothing among them); if a fail_closed check rejects the request anyway,
        // they are only looked at.
        let local: Vec<usize> = (0..checks.len())
            .filter(|&i| matches!(modes[i], FailureMode::LocalFallback { .. }))
            .collect();
        let local_checks: Vec<Check<'_>> = local
            .iter()
            .map(|&i| Check {
                limit: &plan.runs[i].limit.fallback,
                cost: if closed { 0 } else { checks[i].cost },
                ..checks[i]
            })
            .collect();
        let mut local_decisions = self.fallback.check_all(now, &local_checks).into_iter();
        modes
            .iter()
            .zip(checks)
            .map(|(mode, c)| match mode {
                FailureMode::FailOpen => Decision::allow(c.limit.limit(), c.limit.limit(), 0),
                FailureMode::FailClosed => Decision::reject(c.limit.limit(), 0, 0, NANOS_PER_SEC),
                FailureMode::LocalFallback { .. } => local_decisions
                    .next()
                    .unwrap_or_else(|| Decision::allow(c.limit.limit(), c.limit.limit(), 0)),
            })
            .collect()
    }

    fn respond(
        &self,
        request: &RateLimitRequest,
        domain: Option<&Domain>,
        plan: &Plan<'_>,
        decisions: &[Decision],
        failed: Option<Option<&Domain>>,
    ) -> RateLimitResponse {
        // Per descriptor: the limit that rejected, else the one with the least remaining.
        let mut chosen: Vec<Option<(&Run<'_>, Decision)>> = vec![None; request.descriptors.len()];
        for (run, d) in plan.runs.iter().zip(decisions) {
            let slot = &mut chosen[run.descriptor];
            let better = match slot {
                None => true,
                Some((_, best)) => {
                    (!d.allowed && best.allowed)
                        || (d.allowed == best.allowed && d.remaining < best.remaining)
                }
            };
            if better {
                *slot = Some((run, *d));
            }
        }
        let statuses: Vec<DescriptorStatus> = chosen
            .into_iter()
            .enumerate()
            .map(|(i, choice)| {
                let entries = &request.descriptors[i].entries;
                let rule = plan.matched[i].as_ref().map(|m| m.0);
                match choice {
                    Some((run, d)) => {
                        let mut status = decided_status(run, &d, rule, entries, domain);
                        if let Some(domain) = failed {
                            status.failure_mode = Some(plan.mode(run, domain));
                        }
                        status
                    }
                    None => static_status(domain, rule, entries),
                }
            })
            .collect();
        // Quota-mode descriptors over their limit reject the request only when every
        // quota group has one (the stores' rule: `store::rejects`).
        let over = crate::store::rejects_by(
            statuses
                .iter()
                .map(|s| (false, s.quota, s.code == Code::Ok)),
        );
        RateLimitResponse {
            overall: if over && !self.settings.global_shadow_mode {
                Code::OverLimit
            } else {
                Code::Ok
            },
            statuses,
            store_failure: None,
        }
    }
}

/// Logs store failures without flooding: the first at once, then at most one line
/// per ten seconds with the number of failures in between.
#[derive(Default)]
struct FailureLog {
    last: std::sync::atomic::AtomicU64,
    quiet: std::sync::atomic::AtomicU64,
}

impl FailureLog {
    const EVERY: u64 = 10 * NANOS_PER_SEC;

    fn record(&self, e: &store::Error) {
        use std::sync::atomic::Ordering::Relaxed;
        let now = crate::clock::SystemClock.now();
        let last = self.last.load(Relaxed);
        if now.saturating_sub(last) >= Self::EVERY
            && self
                .last
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_ok()
        {
            let suppressed = self.quiet.swap(0, Relaxed);
            tracing::warn!(error = %e, suppressed, "the store failed; answering by each rule's failure_mode");
        } else {
            self.quiet.fetch_add(1, Relaxed);
        }
    }
}

impl Limiter<MemoryStore> {
    /// Decides a request synchronously on the in-memory store (the in-process fast path).
    ///
    /// The same code as [`check`](Self::check): the memory store never waits, so its
    /// future is ready at the first poll.
    pub fn check_now(&self, request: &RateLimitRequest) -> Result<RateLimitResponse, Error> {
        let mut decision = std::pin::pin!(self.check(request));
        match decision
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
        {
            Poll::Ready(result) => result,
            Poll::Pending => Err(Error::Store(store::Error::Backend(
                "the in-memory store waited, which it never does".into(),
            ))),
        }
    }
}

/// Counter keys for descriptors that no rule matched but whose request carries its own
/// limit (empty for every other descriptor: no allocation in the common case).
fn override_keys(plan: &Plan<'_>, request: &RateLimitRequest) -> Vec<Vec<u8>> {
    if plan
        .runs
        .iter()
        .all(|r| plan.matched[r.descriptor].is_some())
    {
        return Vec::new();
    }
    request
        .descriptors
        .iter()
        .zip(&plan.matched)
        .map(|(d, m)| {
            if m.is_none() {
                values_key(&d.entries)
            } else {
                Vec::new()
            }
        })
        .collect()
}

/// The status of a descriptor that no limit was run for.
fn static_status(
    domain: Option<&Domain>,
    rule: Option<&Rule>,
    entries: &[(String, String)],
) -> DescriptorStatus {
    let mut status = DescriptorStatus::unlimited_by_rules();
    if let (Some(domain), Some(rule)) = (domain, rule) {
        status.metric = Some(metric_key(domain, rule, entries));
        if rule.unlimited {
            status.remaining = u64::from(u32::MAX);
        }
    }
    status
}

fn decided_status(
    run: &Run<'_>,
    d: &Decision,
    rule: Option<&Rule>,
    entries: &[(String, String)],
    domain: Option<&Domain>,
) -> DescriptorStatus {
    let l = &*run.limit;
    // Soft throttling: the store enforces requests_per_unit plus the overage; report
    // remaining against requests_per_unit and flag the overage.
    let overage = l.hard_limit().saturating_sub(l.requests_per_unit);
    let over = !d.allowed && !run.shadow;
    DescriptorStatus {
        code: if over { Code::OverLimit } else { Code::Ok },
        limit: Some(ReportedLimit {
            name: l.name.clone(),
            requests_per_unit: l.requests_per_unit,
            unit: l.unit,
        }),
        // A rejection that charges anyway reports nothing left, as Envoy's service does.
        remaining: if over && run.charge.when_over() {
            0
        } else {
            d.remaining.saturating_sub(overage)
        },
        reset_after: d.reset_after,
        retry_after: if d.allowed { 0 } else { d.retry_after },
        delay: d.delay,
        over_soft_limit: d.allowed && overage > 0 && d.remaining < overage,
        shadow: run.shadow,
        would_reject: run.shadow && !d.allowed,
        from_cache: d.from_cache,
        failure_mode: None,
        quota: run.quota,
        // The rule's own limit carries its metadata; a request's own limit has none.
        metadata: match run.limit {
            Cow::Borrowed(_) => rule.and_then(|r| r.metadata.clone()),
            Cow::Owned(_) => None,
        },
        metric: match (domain, rule) {
            (Some(dom), Some(rule)) => Some(metric_key(dom, rule, entries)),
            (Some(dom), None) => Some(MetricKey {
                domain: Arc::clone(&dom.name),
                path: override_path(entries).into(),
            }),
            _ => None,
        },
    }
}

/// The quota group of each descriptor, as Envoy's service groups quota-mode descriptors:
/// those naming the same `backend_name` and `model_name_override` (one of them may be
/// missing) are one group, and any other descriptor is grouped with those of identical
/// entries. A group is named by the index of its first descriptor.
pub fn quota_groups(descriptors: &[Descriptor]) -> Vec<u32> {
    #[derive(PartialEq, Eq, Hash)]
    enum Key<'a> {
        Model(&'a str, &'a str),
        Entries(&'a [(String, String)]),
    }
    let mut first: HashMap<Key<'_>, u32> = HashMap::with_capacity(descriptors.len());
    descriptors
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let (mut backend, mut model) = ("", "");
            for (k, v) in &d.entries {
                match k.as_str() {
                    "backend_name" => backend = v,
                    "model_name_override" => model = v,
                    _ => {}
                }
            }
            let key = if backend.is_empty() && model.is_empty() {
                Key::Entries(&d.entries)
            } else {
                Key::Model(backend, model)
            };
            *first
                .entry(key)
                .or_insert(u32::try_from(i).unwrap_or(u32::MAX))
        })
        .collect()
}

/// Works out which limits to run: matching (once per descriptor), `unlimited`,
/// overrides and `replaces`.
fn plan<'r>(
    domain: Option<&'r Domain>,
    request: &RateLimitRequest,
    settings: Settings,
) -> Plan<'r> {
    let mut plan = Plan {
        matched: Vec::with_capacity(request.descriptors.len()),
        runs: Vec::new(),
    };
    let Some(domain) = domain else {
        plan.matched.resize_with(request.descriptors.len(), || None);
        return plan;
    };
    let default_cost = request.hits_addend.max(1);
    let mut groups: Option<Vec<u32>> = None;
    for (i, d) in request.descriptors.iter().enumerate() {
        let cost = d.hits_addend.unwrap_or(default_cost);
        let rule = domain.find(&d.entries).map(|m| m.rule);
        plan.matched
            .push(rule.map(|r| (r, counter_key(domain, r, &d.entries))));
        let shadow = rule.is_some_and(|r| r.shadow_mode);
        let quota = (settings.global_quota_mode || rule.is_some_and(|r| r.quota_mode))
            .then(|| groups.get_or_insert_with(|| quota_groups(&request.descriptors))[i]);
        let charge = rule
            .and_then(|r| r.charge_rejected)
            .or(domain.charge_rejected)
            .unwrap_or(settings.charge_rejected);
        match (rule, d.limit) {
            (Some(r), _) if r.unlimited => {}
            (Some(r), Some(o)) => {
                let first = r
                    .limits
                    .first()
                    .and_then(|l| l.with_override(o.requests_per_unit, o.unit));
                if let Some(limit) = first {
                    plan.runs.push(Run {
                        descriptor: i,
                        limit: Cow::Owned(limit),
                        cost,
                        shadow,
                        quota,
                        charge,
                    });
                }
            }
            (Some(r), None) => {
                for l in &r.limits {
                    plan.runs.push(Run {
                        descriptor: i,
                        limit: Cow::Borrowed(l),
                        cost,
                        shadow,
                        quota,
                        charge,
                    });
                }
            }
            // Envoy's service applies a request's own limit even where no rule matches.
            (None, Some(o)) => {
                if let Some(limit) = override_limit(domain, d, o) {
                    plan.runs.push(Run {
                        descriptor: i,
                        limit: Cow::Owned(limit),
                        cost,
                        shadow: false,
                        quota,
                        charge,
                    });
                }
            }
            (None, None) => {}
        }
    }
    if plan.runs.iter().any(|r| !r.limit.replaces.is_empty()) {
        // A set: every run looks its name up (a list made this quadratic in descriptors).
        let replaced: HashSet<&str> = plan
            .runs
            .iter()
            .flat_map(|r| r.limit.replaces.iter().map(String::as_str))
            .collect();
        let dropped: Vec<bool> = plan
            .runs
            .iter()
            .map(|r| {
                r.limit
                    .name
                    .as_deref()
                    .is_some_and(|n| replaced.contains(n))
            })
            .collect();
        let mut dropped = dropped.into_iter();
        plan.runs.retain(|_| !dropped.next().unwrap_or(false));
    }
    plan
}

fn override_limit(domain: &Domain, d: &Descriptor, o: LimitOverride) -> Option<RuleLimit> {
    // A counter per descriptor and unit, as Envoy's service keys them.
    let mut h = DefaultHasher::new();
    (
        &*domain.name,
        "override",
        d.entries.iter().map(|e| &e.0).collect::<Vec<_>>(),
        o.unit,
    )
        .hash(&mut h);
    RuleLimit::fixed_window(o.requests_per_unit, o.unit, h.finish(), domain.failure_mode)
}

/// The counter key: the runtime values, each length-prefixed (so no value can be
/// confused with another split differently); below a `share_threshold` wildcard, the
/// pattern instead of the value.
fn counter_key(domain: &Domain, rule: &Rule, entries: &[(String, String)]) -> Vec<u8> {
    let mut key = Vec::with_capacity(entries.iter().map(|e| e.1.len() + 5).sum());
    if !rule.shares {
        for (_, value) in entries {
            key.push(0);
            push_part(&mut key, value);
        }
        return key;
    }
    let mut chain = vec![rule];
    while let Some(parent) = domain.parent(chain[chain.len() - 1]) {
        chain.push(parent);
    }
    chain.reverse();
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
    let path: Arc<str> = if rule.detailed_metric {
        entries
            .iter()
            .map(|(k, v)| format!("{k}_{v}"))
            .collect::<Vec<_>>()
            .join(".")
            .into()
    } else if rule.value_to_metric {
        let mut parts: Vec<&str> = rule.stat_path.split('.').collect();
        let runtime = entries.last().map(|(k, v)| format!("{k}_{v}"));
        if let (Some(slot), Some(rt)) = (parts.last_mut(), runtime.as_deref()) {
            *slot = rt;
        }
        parts.join(".").into()
    } else {
        Arc::clone(&rule.stat_path)
    };
    MetricKey {
        domain: Arc::clone(&domain.name),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::rules::from_str;

    fn limiter(rules: &str, limits: RequestLimits) -> Limiter<MemoryStore> {
        let set = from_str("rules.yaml", rules).expect("valid rules");
        Limiter::new(Arc::new(Rules::fixed(set)), MemoryStore::new())
            .with_clock(Arc::new(ManualClock::new(1_700_000_000_000_000_000)))
            .with_settings(Settings {
                limits,
                ..Settings::default()
            })
    }

    /// `n` descriptors `[("user", "u<i>"), ...]` of `entries` entries each.
    fn request(n: usize, entries: usize) -> RateLimitRequest {
        RateLimitRequest::new(
            "d",
            (0..n).map(|i| {
                (0..entries)
                    .map(|j| {
                        (
                            if j == 0 {
                                "user".to_string()
                            } else {
                                format!("k{j}")
                            },
                            format!("u{i}"),
                        )
                    })
                    .collect::<Vec<_>>()
            }),
        )
    }

    fn refusal(r: Result<(), Error>) -> String {
        match r {
            Err(Error::InvalidRequest(why)) => why,
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn requests_over_the_caps_are_refused_naming_the_cap() {
        let limits = RequestLimits::default();
        assert!(request(64, 32).validate(&limits).is_ok());
        assert_eq!(
            refusal(request(65, 1).validate(&limits)),
            "a request may carry at most 64 descriptors (--max-descriptors)"
        );
        assert_eq!(
            refusal(request(1, 33).validate(&limits)),
            "descriptor 0: a descriptor may carry at most 32 entries (--max-entries)"
        );
        let mut long = request(2, 1);
        long.descriptors[1].entries[0].1 = "x".repeat(1 << 20);
        assert_eq!(
            refusal(long.validate(&limits)),
            "descriptor 1, entry 0: the value is 1048576 bytes; a key or value may be at most \
             65536 bytes (--max-entry-bytes)"
        );
        long.descriptors[1].entries[0] = ("k".repeat(65_537), String::new());
        assert!(refusal(long.validate(&limits)).starts_with("descriptor 1, entry 0: the key is"));
        long.descriptors[1].entries[0].0 = "k".repeat(65_536);
        assert!(long.validate(&limits).is_ok());
        // The first size over a limit, in the order a decoder reads: descriptor 1's
        // 33rd entry comes before the 65th descriptor.
        let mut both = request(65, 1);
        both.descriptors[1].entries = request(1, 33).descriptors.remove(0).entries;
        assert_eq!(
            refusal(both.validate(&limits)),
            "descriptor 1: a descriptor may carry at most 32 entries (--max-entries)"
        );
    }

    /// The limiter refuses by its own settings, whatever the front end.
    #[test]
    fn the_limiter_checks_its_own_caps() {
        let rules = "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";
        let small = limiter(
            rules,
            RequestLimits {
                max_descriptors: 2,
                max_entries: 2,
                max_entry_bytes: 8,
            },
        );
        assert!(small.check_now(&request(2, 2)).is_ok());
        let Err(Error::InvalidRequest(why)) = small.check_now(&request(3, 1)) else {
            panic!("three descriptors passed a limit of two");
        };
        assert_eq!(
            why,
            "a request may carry at most 2 descriptors (--max-descriptors)"
        );
        assert!(small.check_now(&request(1, 3)).is_err());
        let default = limiter(rules, RequestLimits::default());
        assert!(default.check_now(&request(64, 1)).is_ok());
        assert!(default.check_now(&request(65, 1)).is_err());
    }

    /// Per-request work is linear in the descriptors: a request of 20,000 descriptors
    /// (with the caps raised), each in a quota group of its own, with limits that
    /// `replace` others, over a store that must undo every charge, completes, with the
    /// right answer. The steps that looked each descriptor up in a list of the others
    /// (the quota groups, the `replaces` names, the store's undo log) made such a
    /// request cost minutes; now it costs tens of milliseconds.
    #[test]
    fn a_request_far_past_the_caps_is_decided_in_linear_work() {
        let rules = "
domain: d
descriptors:
  - key: user
    quota_mode: true
    rate_limits:
      - {unit: minute, requests_per_unit: 1, name: per_user, replaces: [{name: spare}]}
      - {unit: hour, requests_per_unit: 9, name: spare}
";
        let n = 20_000;
        let big = limiter(
            rules,
            RequestLimits {
                max_descriptors: n,
                ..RequestLimits::default()
            },
        );
        let first = big.check_now(&request(n, 1)).expect("decided");
        assert_eq!(first.overall, Code::Ok);
        assert_eq!(first.statuses.len(), n);
        assert!(first.statuses.iter().all(|s| s.remaining == 0
            && s.limit.as_ref().and_then(|l| l.name.as_deref()) == Some("per_user")));
        // Every group over: rejected, and every charge undone but the ones now over.
        let again = big.check_now(&request(n, 1)).expect("decided");
        assert_eq!(again.overall, Code::OverLimit);
        assert_eq!(quota_groups(&request(n, 1).descriptors).len(), n);
    }
}
