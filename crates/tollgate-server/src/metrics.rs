//! Prometheus metrics: per rule (domain and descriptor path), decision latency, rule
//! loads, store size. With `--region`, every series also carries a `region` label.
//!
//! | metric | labels | meaning |
//! |---|---|---|
//! | `tollgate_total_hits_total` | domain, descriptor | hits (request cost) matched to a limited rule |
//! | `tollgate_over_limit_total` | domain, descriptor | hits rejected |
//! | `tollgate_near_limit_total` | domain, descriptor | hits admitted at or past the near-limit ratio of the limit |
//! | `tollgate_within_limit_total` | domain, descriptor | hits admitted |
//! | `tollgate_overdraft_total` | domain, descriptor | hits admitted into debt by a bucket's `overdraft` (counted in `within_limit` too) |
//! | `tollgate_overage_total` | domain, descriptor | hits admitted past `requests_per_unit`: within `overage_percent` (soft throttling), or borrowed from a pool (`borrow`) (counted in `within_limit` too) |
//! | `tollgate_shadow_mode_total` | domain, descriptor | hits a shadow-mode rule would have rejected |
//! | `tollgate_decision_duration_seconds` | | histogram of the time to decide a request |
//! | `tollgate_config_load_success_total`, `tollgate_config_load_error_total` | | rule set loads |
//! | `tollgate_unmatched_descriptors_total` | domain | descriptors of a loaded domain that no rule matched (answered OK, `remaining: 0`, as Envoy's service does) |
//! | `tollgate_unknown_domain_descriptors_total` | | descriptors of a domain no rule file defines (answered OK) |
//! | `tollgate_store_keys`, `tollgate_store_evictions_total` | | in-memory store size and evictions |
//! | `tollgate_store_limited_evictions_total` | | evictions of keys that had been refused (their clients may get one more limit early) |
//! | `tollgate_invalid_requests_total` | | requests refused as malformed |
//! | `tollgate_over_limit_with_local_cache_total` | domain, descriptor | hits rejected by the blocked-key cache, without a Redis call |
//! | `tollgate_store_errors_total` | kind (`timeout`, `error`, `circuit_open`) | requests the store failed to decide |
//! | `tollgate_store_fallbacks_total` | domain, descriptor, mode | hits decided by a rule's `failure_mode` because the store failed |
//! | `tollgate_redis_calls_total`, `tollgate_redis_circuit_opened_total`, `tollgate_redis_circuit_open` | | Redis script calls, times the circuit breaker opened, 1 while it is open |
//! | `tollgate_enforcement_shadow` | domain | the emergency switch (`POST /v1/enforcement`): 1 for a domain answered OK whatever its limits say, 0 for one switched back; `"*"` is every domain without a mode of its own |
//! | `tollgate_leases_total`, `tollgate_leases_refused_total` | domain, descriptor | leases taken from Redis (`consistency: leased`), and lease calls refused for want of room |
//! | `tollgate_leased_units_total`, `tollgate_leased_units_expired_total`, `tollgate_leased_units_returned_total` | domain, descriptor | units leased, units that expired unspent (the cause of under-admission), and unspent units given back to Redis (a key gone idle, the instance stopping) |
//! | `tollgate_local_decisions_total` | consistency (`leased`, `synced`) | checks decided without a Redis call |
//! | `tollgate_sync_calls_total`, `tollgate_sync_failures_total` | domain, descriptor | sync calls that carried the rule's keys (`consistency: synced`; one call per interval carries every key, and counts once for each rule), those that failed |
//! | `tollgate_synced_units_total` | domain, descriptor | units pushed by sync calls |
//! | `tollgate_adaptive_limit`, `tollgate_adaptive_in_flight` | domain, route | `tollgate proxy`: a route's adaptive concurrency limit, and its requests in flight (`route` is `index:path_prefix`) |
//! | `tollgate_adaptive_rtt_seconds`, `tollgate_adaptive_min_rtt_seconds` | domain, route | the route's measured latency (last interval) and its minimum RTT |
//! | `tollgate_adaptive_shed_total` | domain, route | requests the route's adaptive concurrency shed (503) |
//! | `tollgate_system_in_flight`, `tollgate_system_capacity`, `tollgate_system_cpu_ratio` | | system protection: requests in flight through the gateway, the capacity estimate (max answers per second × min latency), the host's CPU use (0 to 1) |
//! | `tollgate_system_shed_total` | reason (`capacity`, `cpu`), class | requests system protection shed (503), per priority class (`all` without classes) |
//! | `tollgate_sync_lag_seconds` | domain, descriptor | age of the oldest count a key of the rule in use is decided on, from the sync call that read it (0: no key in use) |
//! | `tollgate_global_lease_duration_seconds` | | round trip of each call to the global store that answered (`--global-store`; leases of `scope: global` limits, mostly taken ahead of need) |
//! | `tollgate_global_store_calls_total`, `tollgate_global_store_failures_total` | | calls to the global store, and those that failed |
//! | `tollgate_global_dry_refusals_total` | | requests of a hot global key refused at once with no leased unit in hand, rather than wait a round trip to the global store (its next lease on its way, or just asked for) |
//! | `tollgate_global_fallback_seconds_total` | | seconds the global store has been failing (from a failed call to the next that answered): the time global limits spent on leases in hand, then on their `failure_mode` |
//! | `tollgate_connections` | listener | connections open |
//! | `tollgate_connections_capped_total` | listener | times the listener reached `--max-connections` and stopped accepting until a connection closed |
//! | `tollgate_accept_errors_total` | listener | `accept` calls that failed for want of resources (file descriptors) | Label sets are capped so that no traffic can grow them without
//! bound: past [`MAX_RULE_SERIES`] distinct (domain, path) pairs (only possible with
//! `detailed_metric`, which puts runtime values in the path), further pairs are
//! counted under the path `_overflow`.

mod shedding;

use std::borrow::Cow;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, OnceLock};

use hashbrown::{Equivalent, HashMap};

use parking_lot::RwLock;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tollgate::clock::{Clock, SystemClock};
use tollgate::limiter::{Code, RateLimitRequest, RateLimitResponse};
use tollgate::rules::Rules;
use tollgate::store::MemoryStore;

use crate::store::AnyStore;

/// Distinct (domain, path) label pairs kept before new ones go to `_overflow`.
pub const MAX_RULE_SERIES: usize = 10_000;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RuleLabels {
    domain: String,
    descriptor: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FallbackLabels {
    domain: String,
    descriptor: String,
    mode: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DomainLabels {
    domain: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerLabels {
    listener: &'static str,
}

/// One listener's connection metrics (unregistered ones by default, for tests).
#[derive(Clone, Debug, Default)]
pub(crate) struct ListenerMetrics {
    /// Connections open.
    pub open: Gauge,
    /// Times the listener stopped accepting at its connection cap.
    pub capped: Counter,
    /// `accept` calls that failed for want of resources.
    pub accept_errors: Counter,
}

/// Every metric the service exports.
pub struct Metrics {
    registry: Registry,
    total_hits: Family<RuleLabels, Counter>,
    over_limit: Family<RuleLabels, Counter>,
    near_limit: Family<RuleLabels, Counter>,
    within_limit: Family<RuleLabels, Counter>,
    overdraft: Family<RuleLabels, Counter>,
    overage: Family<RuleLabels, Counter>,
    shadow_mode: Family<RuleLabels, Counter>,
    decision_seconds: Histogram,
    config_load_success: Counter,
    config_load_error: Counter,
    store_keys: Gauge,
    store_evictions: Counter,
    store_limited_evictions: Counter,
    unmatched: Family<DomainLabels, Counter>,
    unknown_domain: Counter,
    /// The rules in force, to tell a domain without a matching rule from an unknown one
    /// (set by the service that records here).
    rules_in_force: std::sync::OnceLock<Arc<tollgate::rules::Rules>>,
    invalid_requests: Counter,
    local_cache: Family<RuleLabels, Counter>,
    store_errors: Family<KindLabels, Counter>,
    fallbacks: Family<FallbackLabels, Counter>,
    redis_calls: Counter,
    circuit_opened: Counter,
    circuit_open: Gauge,
    enforcement_shadow: Family<DomainLabels, Gauge>,
    /// The domains `enforcement_shadow` has shown (set to 0 once no longer switched,
    /// rather than removed while a scrape may be reading).
    enforcement_shown: std::sync::Mutex<std::collections::BTreeSet<String>>,
    scale_out: ScaleOutMetrics,
    shedding: shedding::SheddingMetrics,
    connections: Family<ListenerLabels, Gauge>,
    connections_capped: Family<ListenerLabels, Counter>,
    accept_errors: Family<ListenerLabels, Counter>,
    /// Each rule's counters, resolved once: a decision then costs one map lookup
    /// instead of three label-set lookups and two allocations.
    rules: RwLock<HashMap<RuleKey, Arc<RuleCounters>, ahash::RandomState>>,
    near_limit_ratio: f64,
    /// The dashboard's figures: decisions, their time, store failures, and the
    /// per-second history its ticker keeps.
    pub(crate) dashboard: crate::dashboard::Tally,
}

/// A rule's (domain, path).
type RuleKey = (Arc<str>, Arc<str>);

/// A [`RuleKey`] borrowed, to look one up without cloning its two `Arc`s; it hashes as
/// the tuple does.
struct RuleRef<'a>(&'a str, &'a str);

impl Hash for RuleRef<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (self.0, self.1).hash(state);
    }
}

impl Equivalent<RuleKey> for RuleRef<'_> {
    fn equivalent(&self, key: &RuleKey) -> bool {
        self.0 == &*key.0 && self.1 == &*key.1
    }
}

/// The per-rule counter families, indexing [`RuleCounters::slots`].
#[derive(Clone, Copy)]
enum Slot {
    TotalHits,
    OverLimit,
    NearLimit,
    WithinLimit,
    ShadowMode,
    LocalCache,
    Overdraft,
    Overage,
}

/// One rule's label set and its counters, each taken from its family the first time it
/// counts (so a series appears only once it has counted, as before).
struct RuleCounters {
    labels: RuleLabels,
    slots: [OnceLock<Counter>; 8],
    /// The rule's hottest keys, for the dashboard (the first
    /// [`dashboard::SKETCHED_RULES`](crate::dashboard::SKETCHED_RULES) rules only).
    hot: Option<crate::dashboard::HotKeys>,
}

impl RuleCounters {
    fn new(labels: RuleLabels, sketched: bool) -> Self {
        Self {
            labels,
            slots: Default::default(),
            hot: sketched.then(crate::dashboard::HotKeys::new),
        }
    }

    /// The count of `slot` so far.
    fn get(&self, slot: Slot) -> u64 {
        self.slots[slot as usize].get().map_or(0, Counter::get)
    }

    fn inc(&self, metrics: &Metrics, slot: Slot, by: u64) {
        let family = match slot {
            Slot::TotalHits => &metrics.total_hits,
            Slot::OverLimit => &metrics.over_limit,
            Slot::NearLimit => &metrics.near_limit,
            Slot::WithinLimit => &metrics.within_limit,
            Slot::ShadowMode => &metrics.shadow_mode,
            Slot::LocalCache => &metrics.local_cache,
            Slot::Overdraft => &metrics.overdraft,
            Slot::Overage => &metrics.overage,
        };
        self.slots[slot as usize]
            .get_or_init(|| family.get_or_create(&self.labels).clone())
            .inc_by(by);
    }
}

impl Metrics {
    /// Creates the registry. `near_limit_ratio`: a hit counts as near the limit when
    /// the used share of the limit reaches it (Envoy's default 0.8).
    #[cfg(test)]
    pub fn new(near_limit_ratio: f64) -> Self {
        Self::in_region(near_limit_ratio, None)
    }

    /// As [`new`](Self::new), every series labelled with `region` when one is given
    /// (`--region`).
    pub fn in_region(near_limit_ratio: f64, region: Option<&str>) -> Self {
        let mut registry = match region {
            Some(r) => Registry::with_prefix_and_labels(
                "tollgate",
                [(Cow::Borrowed("region"), Cow::Owned(r.to_string()))].into_iter(),
            ),
            None => Registry::with_prefix("tollgate"),
        };
        let total_hits = Family::<RuleLabels, Counter>::default();
        let over_limit = Family::<RuleLabels, Counter>::default();
        let near_limit = Family::<RuleLabels, Counter>::default();
        let within_limit = Family::<RuleLabels, Counter>::default();
        let overdraft = Family::<RuleLabels, Counter>::default();
        let overage = Family::<RuleLabels, Counter>::default();
        let shadow_mode = Family::<RuleLabels, Counter>::default();
        let decision_seconds = Histogram::new(exponential_buckets(1e-6, 2.0, 20));
        let config_load_success = Counter::default();
        let config_load_error = Counter::default();
        let store_keys = Gauge::default();
        let store_evictions = Counter::default();
        let store_limited_evictions = Counter::default();
        let unmatched = Family::<DomainLabels, Counter>::default();
        let unknown_domain = Counter::default();
        let invalid_requests = Counter::default();
        let local_cache = Family::<RuleLabels, Counter>::default();
        let store_errors = Family::<KindLabels, Counter>::default();
        let fallbacks = Family::<FallbackLabels, Counter>::default();
        let redis_calls = Counter::default();
        let circuit_opened = Counter::default();
        let circuit_open = Gauge::default();
        let enforcement_shadow = Family::<DomainLabels, Gauge>::default();
        let scale_out = ScaleOutMetrics::register(&mut registry);
        let connections = Family::<ListenerLabels, Gauge>::default();
        let connections_capped = Family::<ListenerLabels, Counter>::default();
        let accept_errors = Family::<ListenerLabels, Counter>::default();
        registry.register(
            "connections",
            "Connections open, per listener",
            connections.clone(),
        );
        registry.register(
            "connections_capped",
            "Times the listener reached --max-connections and stopped accepting until a connection closed",
            connections_capped.clone(),
        );
        registry.register(
            "accept_errors",
            "Accepts that failed for want of resources (file descriptors), per listener",
            accept_errors.clone(),
        );
        registry.register(
            "over_limit_with_local_cache",
            "Hits rejected by the blocked-key cache without a store call",
            local_cache.clone(),
        );
        registry.register(
            "store_errors",
            "Requests the store failed to decide (timeout, error, circuit_open)",
            store_errors.clone(),
        );
        registry.register(
            "store_fallbacks",
            "Hits decided by the rule's failure_mode because the store failed",
            fallbacks.clone(),
        );
        registry.register("redis_calls", "Redis script calls", redis_calls.clone());
        registry.register(
            "redis_circuit_opened",
            "Times the Redis circuit breaker opened",
            circuit_opened.clone(),
        );
        registry.register(
            "redis_circuit_open",
            "1 while the Redis circuit breaker is open",
            circuit_open.clone(),
        );
        registry.register(
            "enforcement_shadow",
            "The emergency switch: 1 for a domain answered OK whatever its limits say (POST /v1/enforcement), 0 for one switched back to enforce; the domain * is every domain without a mode of its own",
            enforcement_shadow.clone(),
        );
        registry.register(
            "total_hits",
            "Hits (request cost) matched to a rule",
            total_hits.clone(),
        );
        registry.register("over_limit", "Hits rejected by a rule", over_limit.clone());
        registry.register(
            "near_limit",
            "Hits admitted with the rule's usage at or past the near-limit ratio",
            near_limit.clone(),
        );
        registry.register(
            "within_limit",
            "Hits admitted by a rule",
            within_limit.clone(),
        );
        registry.register(
            "overdraft",
            "Hits admitted into debt by a bucket's overdraft",
            overdraft.clone(),
        );
        registry.register(
            "overage",
            "Hits admitted past requests_per_unit: soft throttling, or borrowed from a pool",
            overage.clone(),
        );
        registry.register(
            "shadow_mode",
            "Hits a shadow-mode rule would have rejected",
            shadow_mode.clone(),
        );
        registry.register(
            "decision_duration_seconds",
            "Time to decide one request",
            decision_seconds.clone(),
        );
        registry.register(
            "config_load_success",
            "Rule sets loaded",
            config_load_success.clone(),
        );
        registry.register(
            "config_load_error",
            "Rule set loads that failed (the old rules kept serving)",
            config_load_error.clone(),
        );
        registry.register(
            "store_keys",
            "Keys held by the in-memory store",
            store_keys.clone(),
        );
        registry.register(
            "store_evictions",
            "Keys evicted because the in-memory store was full",
            store_evictions.clone(),
        );
        registry.register(
            "store_limited_evictions",
            "Keys evicted while over their limit (refused since their state began), because \
             the in-memory store held nothing else to evict",
            store_limited_evictions.clone(),
        );
        registry.register(
            "unmatched_descriptors",
            "Descriptors of a loaded domain that no rule matched (answered OK, remaining 0)",
            unmatched.clone(),
        );
        registry.register(
            "unknown_domain_descriptors",
            "Descriptors of a domain that no rule file defines (answered OK)",
            unknown_domain.clone(),
        );
        registry.register(
            "invalid_requests",
            "Requests refused as malformed",
            invalid_requests.clone(),
        );
        let shedding = shedding::SheddingMetrics::register(&mut registry);
        Self {
            registry,
            total_hits,
            over_limit,
            near_limit,
            within_limit,
            overdraft,
            overage,
            shadow_mode,
            decision_seconds,
            config_load_success,
            config_load_error,
            store_keys,
            store_evictions,
            store_limited_evictions,
            unmatched,
            unknown_domain,
            rules_in_force: std::sync::OnceLock::new(),
            invalid_requests,
            local_cache,
            store_errors,
            fallbacks,
            redis_calls,
            circuit_opened,
            circuit_open,
            enforcement_shadow,
            enforcement_shown: std::sync::Mutex::default(),
            scale_out,
            shedding,
            connections,
            connections_capped,
            accept_errors,
            rules: RwLock::new(HashMap::default()),
            near_limit_ratio,
            dashboard: crate::dashboard::Tally::default(),
        }
    }

    /// Records one decided request and how long it took.
    pub fn record(&self, request: &RateLimitRequest, response: &RateLimitResponse, seconds: f64) {
        self.decision_seconds.observe(seconds);
        self.dashboard
            .decided(seconds, response.store_failure.is_some());
        if let Some(kind) = response.store_failure {
            self.store_errors.get_or_create(&KindLabels { kind }).inc();
        }
        let default_cost = request.hits_addend.max(1);
        let mut known_domain = None;
        for (d, s) in request.descriptors.iter().zip(&response.statuses) {
            let Some(metric) = &s.metric else {
                self.unmatched(&request.domain, &mut known_domain);
                continue;
            };
            let Some(limit) = &s.limit else {
                continue;
            };
            let hits = d.hits_addend.unwrap_or(default_cost);
            let rule = self.rule(&metric.domain, &metric.path);
            rule.inc(self, Slot::TotalHits, hits);
            if let Some(hot) = &rule.hot {
                hot.offer(&d.entries, hits);
            }
            if let Some(mode) = s.failure_mode {
                self.dashboard.fell_back(hits);
                let fallback = FallbackLabels {
                    domain: rule.labels.domain.clone(),
                    descriptor: rule.labels.descriptor.clone(),
                    mode: mode.name(),
                };
                self.fallbacks.get_or_create(&fallback).inc_by(hits);
            }
            if s.from_cache && s.code == Code::OverLimit {
                rule.inc(self, Slot::LocalCache, hits);
            }
            if s.would_reject {
                rule.inc(self, Slot::ShadowMode, hits);
            } else if s.code == Code::OverLimit {
                rule.inc(self, Slot::OverLimit, hits);
            } else {
                rule.inc(self, Slot::WithinLimit, hits);
                if s.overdraft {
                    rule.inc(self, Slot::Overdraft, hits);
                }
                if s.over_soft_limit {
                    rule.inc(self, Slot::Overage, hits);
                }
                let used = limit.requests_per_unit.saturating_sub(s.remaining) as f64;
                if limit.requests_per_unit > 0
                    && used >= self.near_limit_ratio * limit.requests_per_unit as f64
                {
                    rule.inc(self, Slot::NearLimit, hits);
                }
            }
        }
    }

    /// Tells the metrics which rules are in force (to count unmatched descriptors by
    /// domain, and those of unknown domains apart). Without it, every unmatched
    /// descriptor counts as of an unknown domain.
    pub fn know_rules(&self, rules: Arc<tollgate::rules::Rules>) {
        let _ = self.rules_in_force.set(rules);
    }

    /// Counts a descriptor no rule matched: by domain when the domain is loaded (a
    /// label set bounded by the rule files), else without a label (clients choose
    /// the domain). `known` caches the answer for one request.
    fn unmatched(&self, domain: &str, known: &mut Option<bool>) {
        let is_known = *known.get_or_insert_with(|| {
            self.rules_in_force
                .get()
                .is_some_and(|r| r.current().domain(domain).is_some())
        });
        if is_known {
            self.unmatched
                .get_or_create(&DomainLabels {
                    domain: domain.to_string(),
                })
                .inc();
        } else {
            self.unknown_domain.inc();
        }
    }

    /// The connection metrics of the listener `name`, its series created now (at 0).
    pub(crate) fn listener(&self, name: &'static str) -> ListenerMetrics {
        let labels = ListenerLabels { listener: name };
        ListenerMetrics {
            open: self.connections.get_or_create(&labels).clone(),
            capped: self.connections_capped.get_or_create(&labels).clone(),
            accept_errors: self.accept_errors.get_or_create(&labels).clone(),
        }
    }

    /// Counts a malformed request.
    pub fn invalid_request(&self) {
        self.invalid_requests.inc();
    }

    /// The counters of the rule at (`domain`, `path`); past [`MAX_RULE_SERIES`] rules,
    /// new ones count under the path `_overflow` (not cached).
    fn rule(&self, domain: &Arc<str>, path: &Arc<str>) -> Arc<RuleCounters> {
        let key = RuleRef(domain, path);
        if let Some(rule) = self.rules.read().get(&key) {
            return Arc::clone(rule);
        }
        let mut rules = self.rules.write();
        if let Some(rule) = rules.get(&key) {
            return Arc::clone(rule);
        }
        let descriptor = if rules.len() < MAX_RULE_SERIES {
            path.to_string()
        } else {
            "_overflow".to_string()
        };
        let rule = Arc::new(RuleCounters::new(
            RuleLabels {
                domain: domain.to_string(),
                descriptor,
            },
            rules.len() < crate::dashboard::SKETCHED_RULES,
        ));
        if rules.len() < MAX_RULE_SERIES {
            rules.insert((Arc::clone(domain), Arc::clone(path)), Arc::clone(&rule));
        }
        rule
    }

    /// Each rule that has counted: its (domain, path), its counts so far (total, over
    /// limit, near limit, within limit, shadow) and its hottest keys (`top` of them; none
    /// asked for with 0).
    pub(crate) fn rule_counts(&self, top: usize) -> Vec<crate::dashboard::RuleCount> {
        self.rules
            .read()
            .values()
            .map(|r| crate::dashboard::RuleCount {
                domain: r.labels.domain.clone(),
                descriptor: r.labels.descriptor.clone(),
                counts: [
                    r.get(Slot::TotalHits),
                    r.get(Slot::OverLimit),
                    r.get(Slot::NearLimit),
                    r.get(Slot::WithinLimit),
                    r.get(Slot::ShadowMode),
                ],
                hot: r.hot.as_ref().filter(|_| top > 0).map(|h| h.top(top)),
            })
            .collect()
    }

    /// Metrics for `store` in `region` (see [`in_region`](Self::in_region)): with a
    /// global store, its calls' durations are observed as they happen.
    pub fn for_store(near_limit_ratio: f64, region: Option<&str>, store: &AnyStore) -> Self {
        let metrics = Self::in_region(near_limit_ratio, region);
        if let Some(scale) = store.scale_out() {
            let histogram = metrics.scale_out.global_call_seconds.clone();
            scale.observe_global_calls(Arc::new(move |d: std::time::Duration| {
                histogram.observe(d.as_secs_f64());
            }));
        }
        metrics
    }

    /// Shows the gateway's load shedding (`tollgate proxy`): its routes' adaptive
    /// concurrency and its system protection, read when scraped and by the dashboard.
    pub fn know_shedding(&self, shedding: Arc<tollgate::http::Shedding>) {
        self.shedding.know(shedding);
    }

    /// The gateway's load shedding, if known.
    pub fn shedding(&self) -> Option<&Arc<tollgate::http::Shedding>> {
        self.shedding.shedding()
    }

    /// Shows the emergency switch's `state`: a series per domain it names, and `"*"`.
    pub fn enforcement(&self, state: &tollgate::limiter::EnforcementState) {
        use tollgate::limiter::Mode;
        let family = &self.enforcement_shadow;
        let shadow = |m: Mode| i64::from(m == Mode::Shadow);
        let set = |domain: &str, value: i64| {
            family
                .get_or_create(&DomainLabels {
                    domain: domain.to_string(),
                })
                .set(value);
        };
        set("*", shadow(state.all));
        let Ok(mut shown) = self.enforcement_shown.lock() else {
            return;
        };
        for domain in shown.iter() {
            if !state.domains.contains_key(domain) {
                set(domain, shadow(state.all));
            }
        }
        for (domain, mode) in &state.domains {
            set(domain, shadow(*mode));
            // The series stay bounded: at most the switch's cap of named domains each
            // time, and the first ones shown.
            if shown.len() < 4 * tollgate::limiter::MAX_SWITCHED_DOMAINS {
                shown.insert(domain.clone());
            }
        }
    }

    /// The exposition text, with the rule-load and store figures brought up to date.
    pub fn render(&self, rules: &Rules, store: &AnyStore, fallback: &MemoryStore) -> String {
        let sync = |c: &Counter, total: u64| {
            let now = c.get();
            if total > now {
                c.inc_by(total - now);
            }
        };
        sync(&self.config_load_success, rules.load_successes());
        sync(&self.config_load_error, rules.load_failures());
        let stats = store.memory().unwrap_or(fallback).stats();
        if let Some(redis) = store.redis() {
            let r = redis.stats();
            sync(&self.redis_calls, r.calls);
            sync(&self.circuit_opened, r.circuit_opened);
            self.circuit_open.set(i64::from(r.open_now));
        }
        if let Some(scale) = store.scale_out() {
            let now = SystemClock.now();
            self.scale_out.render(
                &scale.stats(),
                &scale.per_limit(),
                &scale.sync_lag(now),
                scale.global_down(now),
                rules,
                sync,
            );
        }
        self.shedding.render(sync);
        self.store_keys
            .set(i64::try_from(stats.keys).unwrap_or(i64::MAX));
        sync(&self.store_evictions, stats.evictions);
        sync(&self.store_limited_evictions, stats.limited_evictions);
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Leased and synced counting's figures.
struct ScaleOutMetrics {
    leases: Family<RuleLabels, Counter>,
    refused: Family<RuleLabels, Counter>,
    units: Family<RuleLabels, Counter>,
    expired: Family<RuleLabels, Counter>,
    returned: Family<RuleLabels, Counter>,
    local: Family<ConsistencyLabels, Counter>,
    sync_calls: Family<RuleLabels, Counter>,
    sync_failures: Family<RuleLabels, Counter>,
    synced_units: Family<RuleLabels, Counter>,
    sync_lag: Family<RuleLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    global_call_seconds: Histogram,
    global_calls: Counter,
    global_dry: Counter,
    global_failures: Counter,
    global_down_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConsistencyLabels {
    consistency: &'static str,
}

impl ScaleOutMetrics {
    fn register(registry: &mut Registry) -> Self {
        let leases = Family::<RuleLabels, Counter>::default();
        let leases_refused = Family::<RuleLabels, Counter>::default();
        let leased_units = Family::<RuleLabels, Counter>::default();
        let leased_units_expired = Family::<RuleLabels, Counter>::default();
        let leased_units_returned = Family::<RuleLabels, Counter>::default();
        let local_decisions = Family::<ConsistencyLabels, Counter>::default();
        let sync_calls = Family::<RuleLabels, Counter>::default();
        let sync_failures = Family::<RuleLabels, Counter>::default();
        let synced_units = Family::<RuleLabels, Counter>::default();
        let sync_lag = Family::<RuleLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register(
            "leases",
            "Leases taken from the store (consistency: leased)",
            leases.clone(),
        );
        registry.register(
            "leases_refused",
            "Lease calls the store refused for want of room",
            leases_refused.clone(),
        );
        registry.register(
            "leased_units",
            "Units leased from the store",
            leased_units.clone(),
        );
        registry.register(
            "leased_units_expired",
            "Leased units that expired unspent",
            leased_units_expired.clone(),
        );
        registry.register(
            "leased_units_returned",
            "Unspent leased units given back to the store (a key gone idle, the instance stopping)",
            leased_units_returned.clone(),
        );
        registry.register(
            "local_decisions",
            "Checks decided without a store call, per consistency",
            local_decisions.clone(),
        );
        registry.register(
            "sync_calls",
            "Sync calls that carried the rule's keys (consistency: synced; a call carrying several rules' keys counts for each)",
            sync_calls.clone(),
        );
        registry.register(
            "sync_failures",
            "Sync calls that failed (their units are sent again)",
            sync_failures.clone(),
        );
        registry.register(
            "synced_units",
            "Units pushed to the store by sync calls",
            synced_units.clone(),
        );
        registry.register(
            "sync_lag_seconds",
            "Age in seconds of the oldest count a key of the rule in use is decided on (0: none in use)",
            sync_lag.clone(),
        );
        let global_call_seconds = Histogram::new(exponential_buckets(0.000_5, 2.0, 14));
        let global_calls = Counter::default();
        let global_dry = Counter::default();
        let global_failures = Counter::default();
        let global_down_seconds = Counter::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "global_lease_duration_seconds",
            "Round trip of each call to the global store that answered (leases of scope: global limits, mostly taken ahead of need)",
            global_call_seconds.clone(),
        );
        registry.register(
            "global_store_calls",
            "Calls to the global store (leases, give-backs, exact checks of global limits)",
            global_calls.clone(),
        );
        registry.register(
            "global_dry_refusals",
            "Requests of a hot scope: global key refused at once with no leased unit in hand, rather than wait a round trip to the distant global store",
            global_dry.clone(),
        );
        registry.register(
            "global_store_failures",
            "Calls to the global store that failed (then the rule's failure_mode answers requests that needed it)",
            global_failures.clone(),
        );
        registry.register(
            "global_fallback_seconds",
            "Seconds the global store has been failing, from a failed call to the next one that answered",
            global_down_seconds.clone(),
        );
        Self {
            global_call_seconds,
            global_calls,
            global_dry,
            global_failures,
            global_down_seconds,
            leases,
            refused: leases_refused,
            units: leased_units,
            expired: leased_units_expired,
            returned: leased_units_returned,
            local: local_decisions,
            sync_calls,
            sync_failures,
            synced_units,
            sync_lag,
        }
    }

    /// Brings the figures up to date: the instance's, and each rule's (its limits' ids
    /// found in the rules in force; a limit no longer in them is no longer counted).
    fn render(
        &self,
        s: &tollgate::store::ScaleOutStats,
        per_limit: &[(u64, tollgate::store::LimitStats)],
        sync_lag: &[(u64, tollgate::clock::Nanos)],
        global_down: tollgate::clock::Nanos,
        rules: &Rules,
        sync: impl Fn(&Counter, u64),
    ) {
        let set = rules.current();
        let mut rule_of: HashMap<u64, RuleLabels> = HashMap::default();
        for domain in set.domains() {
            for rule in domain.rules() {
                for l in &rule.limits {
                    rule_of.insert(
                        l.limit.id(),
                        RuleLabels {
                            domain: domain.name.to_string(),
                            descriptor: rule.stat_path.to_string(),
                        },
                    );
                }
            }
        }
        let mut per_rule: HashMap<RuleLabels, tollgate::store::LimitStats> = HashMap::default();
        for (id, l) in per_limit {
            if let Some(labels) = rule_of.get(id) {
                let t = per_rule.entry(labels.clone()).or_default();
                t.leases += l.leases;
                t.leases_refused += l.leases_refused;
                t.units_leased += l.units_leased;
                t.units_expired += l.units_expired;
                t.units_returned += l.units_returned;
                t.units_synced += l.units_synced;
                t.sync_calls += l.sync_calls;
                t.sync_failures += l.sync_failures;
            }
        }
        for (labels, t) in &per_rule {
            for (family, total) in [
                (&self.leases, t.leases),
                (&self.refused, t.leases_refused),
                (&self.units, t.units_leased),
                (&self.expired, t.units_expired),
                (&self.returned, t.units_returned),
                (&self.synced_units, t.units_synced),
                (&self.sync_calls, t.sync_calls),
                (&self.sync_failures, t.sync_failures),
            ] {
                if total > 0 {
                    sync(&family.get_or_create(labels), total);
                }
            }
        }
        // The lag of each rule with a key in use; a synced rule with none in use, 0.
        let mut lag_of: HashMap<RuleLabels, tollgate::clock::Nanos> = HashMap::default();
        for (id, lag) in sync_lag {
            if let Some(labels) = rule_of.get(id) {
                let l = lag_of.entry(labels.clone()).or_default();
                *l = (*l).max(*lag);
            }
        }
        for (labels, t) in &per_rule {
            if t.sync_calls > 0 && !lag_of.contains_key(labels) {
                lag_of.insert(labels.clone(), 0);
            }
        }
        for (labels, lag) in &lag_of {
            self.sync_lag.get_or_create(labels).set(*lag as f64 / 1e9);
        }
        sync(
            &self.local.get_or_create(&ConsistencyLabels {
                consistency: "leased",
            }),
            s.leased_local,
        );
        sync(&self.global_calls, s.global_calls);
        sync(&self.global_dry, s.leased_dry);
        sync(&self.global_failures, s.global_failures);
        let down = global_down as f64 / 1e9;
        let counted = self.global_down_seconds.get();
        if down > counted {
            self.global_down_seconds.inc_by(down - counted);
        }
        sync(
            &self.local.get_or_create(&ConsistencyLabels {
                consistency: "synced",
            }),
            s.synced_local,
        );
    }
}

/// The gateway's decisions, counted as `tollgate serve` counts its own.
impl tollgate::http::DecisionObserver for Metrics {
    fn decided(
        &self,
        request: &tollgate::limiter::RateLimitRequest,
        response: &tollgate::limiter::RateLimitResponse,
        elapsed: std::time::Duration,
    ) {
        self.record(request, response, elapsed.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate::limiter::{
        Descriptor, DescriptorStatus, MetricKey, RateLimitRequest, RateLimitResponse, ReportedLimit,
    };
    use tollgate::rules::Unit;

    fn decision(path: &str, code: Code, remaining: u64) -> (RateLimitRequest, RateLimitResponse) {
        let request = RateLimitRequest {
            domain: "d".into(),
            descriptors: vec![Descriptor::default()],
            hits_addend: 1,
        };
        let status = DescriptorStatus {
            code,
            limit: Some(ReportedLimit {
                name: None,
                requests_per_unit: 10,
                unit: Unit::Minute,
            }),
            remaining,
            reset_after: 0,
            retry_after: 0,
            delay: 0,
            over_soft_limit: false,
            overdraft: false,
            shadow: false,
            would_reject: false,
            metric: Some(MetricKey {
                domain: "d".into(),
                path: path.into(),
            }),
            from_cache: false,
            failure_mode: None,
            quota: None,
            metadata: None,
        };
        let response = RateLimitResponse {
            overall: code,
            statuses: vec![status],
            store_failure: None,
        };
        (request, response)
    }

    fn exposition(metrics: &Metrics) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &metrics.registry).expect("encodes");
        out
    }

    fn value(text: &str, series: &str) -> Option<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series))
            .and_then(|v| v.trim().parse().ok())
    }

    #[test]
    fn each_rule_counts_on_its_own_series_and_the_label_sets_stay_bounded() {
        let metrics = Metrics::new(0.8);
        let (req, resp) = decision("user", Code::Ok, 9);
        metrics.record(&req, &resp, 0.0);
        metrics.record(&req, &resp, 0.0);
        let (req, resp) = decision("user", Code::OverLimit, 0);
        metrics.record(&req, &resp, 0.0);
        let (req, resp) = decision("user", Code::Ok, 1);
        metrics.record(&req, &resp, 0.0);
        let text = exposition(&metrics);
        let user = "{domain=\"d\",descriptor=\"user\"}";
        assert_eq!(
            value(&text, &format!("tollgate_total_hits_total{user}")),
            Some(4)
        );
        assert_eq!(
            value(&text, &format!("tollgate_within_limit_total{user}")),
            Some(3)
        );
        assert_eq!(
            value(&text, &format!("tollgate_over_limit_total{user}")),
            Some(1)
        );
        assert_eq!(
            value(&text, &format!("tollgate_near_limit_total{user}")),
            Some(1)
        );
        assert_eq!(
            value(&text, &format!("tollgate_shadow_mode_total{user}")),
            None,
            "never counted"
        );
        assert_eq!(
            value(&text, &format!("tollgate_overdraft_total{user}")),
            None,
            "never counted"
        );
        let (req, mut resp) = decision("user", Code::Ok, 0);
        resp.statuses[0].overdraft = true;
        metrics.record(&req, &resp, 0.0);
        let text = exposition(&metrics);
        assert_eq!(
            value(&text, &format!("tollgate_overdraft_total{user}")),
            Some(1)
        );
        assert_eq!(
            value(&text, &format!("tollgate_within_limit_total{user}")),
            Some(4),
            "an overdraft is admitted"
        );
        assert_eq!(
            value(&text, &format!("tollgate_overage_total{user}")),
            None,
            "never counted"
        );
        let (req, mut resp) = decision("user", Code::Ok, 0);
        resp.statuses[0].over_soft_limit = true;
        metrics.record(&req, &resp, 0.0);
        let text = exposition(&metrics);
        assert_eq!(
            value(&text, &format!("tollgate_overage_total{user}")),
            Some(1)
        );
        assert_eq!(
            value(&text, &format!("tollgate_within_limit_total{user}")),
            Some(5),
            "an overage is admitted"
        );

        // Runtime values in paths (detailed_metric): past the cap, new paths share one
        // `_overflow` series.
        for i in 0..MAX_RULE_SERIES + 5 {
            let (req, resp) = decision(&format!("user_{i}"), Code::Ok, 9);
            metrics.record(&req, &resp, 0.0);
        }
        let text = exposition(&metrics);
        let series = text
            .lines()
            .filter(|l| l.starts_with("tollgate_total_hits_total{"))
            .count();
        assert_eq!(series, MAX_RULE_SERIES + 1);
        let overflow = "{domain=\"d\",descriptor=\"_overflow\"}";
        assert_eq!(
            value(&text, &format!("tollgate_total_hits_total{overflow}")),
            Some(6)
        );
    }
}
