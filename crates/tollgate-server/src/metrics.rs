//! Prometheus metrics: per rule (domain and descriptor path), decision latency, rule
//! loads, store size.
//!
//! | metric | labels | meaning |
//! |---|---|---|
//! | `tollgate_total_hits_total` | domain, descriptor | hits (request cost) matched to a limited rule |
//! | `tollgate_over_limit_total` | domain, descriptor | hits rejected |
//! | `tollgate_near_limit_total` | domain, descriptor | hits admitted at or past the near-limit ratio of the limit |
//! | `tollgate_within_limit_total` | domain, descriptor | hits admitted |
//! | `tollgate_shadow_mode_total` | domain, descriptor | hits a shadow-mode rule would have rejected |
//! | `tollgate_decision_duration_seconds` | | histogram of the time to decide a request |
//! | `tollgate_config_load_success_total`, `tollgate_config_load_error_total` | | rule set loads |
//! | `tollgate_store_keys`, `tollgate_store_evictions_total` | | in-memory store size and evictions |
//! | `tollgate_invalid_requests_total` | | requests refused as malformed |
//! | `tollgate_over_limit_with_local_cache_total` | domain, descriptor | hits rejected by the blocked-key cache, without a Redis call |
//! | `tollgate_store_errors_total` | kind (`timeout`, `error`, `circuit_open`) | requests the store failed to decide |
//! | `tollgate_store_fallbacks_total` | domain, descriptor, mode | hits decided by a rule's `failure_mode` because the store failed |
//! | `tollgate_redis_calls_total`, `tollgate_redis_circuit_opened_total`, `tollgate_redis_circuit_open` | | Redis script calls, times the circuit breaker opened, 1 while it is open | Label sets are capped so that no traffic can grow them without
//! bound: past [`MAX_RULE_SERIES`] distinct (domain, path) pairs (only possible with
//! `detailed_metric`, which puts runtime values in the path), further pairs are
//! counted under the path `_overflow`.

use std::collections::HashSet;
use std::sync::Arc;

use parking_lot::RwLock;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
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
struct KindLabels {
    kind: &'static str,
}

/// Every metric the service exports.
pub struct Metrics {
    registry: Registry,
    total_hits: Family<RuleLabels, Counter>,
    over_limit: Family<RuleLabels, Counter>,
    near_limit: Family<RuleLabels, Counter>,
    within_limit: Family<RuleLabels, Counter>,
    shadow_mode: Family<RuleLabels, Counter>,
    decision_seconds: Histogram,
    config_load_success: Counter,
    config_load_error: Counter,
    store_keys: Gauge,
    store_evictions: Counter,
    invalid_requests: Counter,
    local_cache: Family<RuleLabels, Counter>,
    store_errors: Family<KindLabels, Counter>,
    fallbacks: Family<FallbackLabels, Counter>,
    redis_calls: Counter,
    circuit_opened: Counter,
    circuit_open: Gauge,
    seen: RwLock<HashSet<(Arc<str>, Arc<str>)>>,
    near_limit_ratio: f64,
}

impl Metrics {
    /// Creates the registry. `near_limit_ratio`: a hit counts as near the limit when
    /// the used share of the limit reaches it (Envoy's default 0.8).
    pub fn new(near_limit_ratio: f64) -> Self {
        let mut registry = Registry::with_prefix("tollgate");
        let total_hits = Family::<RuleLabels, Counter>::default();
        let over_limit = Family::<RuleLabels, Counter>::default();
        let near_limit = Family::<RuleLabels, Counter>::default();
        let within_limit = Family::<RuleLabels, Counter>::default();
        let shadow_mode = Family::<RuleLabels, Counter>::default();
        let decision_seconds = Histogram::new(exponential_buckets(1e-6, 2.0, 20));
        let config_load_success = Counter::default();
        let config_load_error = Counter::default();
        let store_keys = Gauge::default();
        let store_evictions = Counter::default();
        let invalid_requests = Counter::default();
        let local_cache = Family::<RuleLabels, Counter>::default();
        let store_errors = Family::<KindLabels, Counter>::default();
        let fallbacks = Family::<FallbackLabels, Counter>::default();
        let redis_calls = Counter::default();
        let circuit_opened = Counter::default();
        let circuit_open = Gauge::default();
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
            "invalid_requests",
            "Requests refused as malformed",
            invalid_requests.clone(),
        );
        Self {
            registry,
            total_hits,
            over_limit,
            near_limit,
            within_limit,
            shadow_mode,
            decision_seconds,
            config_load_success,
            config_load_error,
            store_keys,
            store_evictions,
            invalid_requests,
            local_cache,
            store_errors,
            fallbacks,
            redis_calls,
            circuit_opened,
            circuit_open,
            seen: RwLock::new(HashSet::new()),
            near_limit_ratio,
        }
    }

    /// Records one decided request and how long it took.
    pub fn record(&self, request: &RateLimitRequest, response: &RateLimitResponse, seconds: f64) {
        self.decision_seconds.observe(seconds);
        if let Some(kind) = response.store_failure {
            self.store_errors.get_or_create(&KindLabels { kind }).inc();
        }
        let default_cost = request.hits_addend.max(1);
        for (d, s) in request.descriptors.iter().zip(&response.statuses) {
            let (Some(metric), Some(limit)) = (&s.metric, &s.limit) else {
                continue;
            };
            let hits = d.hits_addend.unwrap_or(default_cost);
            let labels = self.labels(&metric.domain, &metric.path);
            self.total_hits.get_or_create(&labels).inc_by(hits);
            if let Some(mode) = s.failure_mode {
                let fallback = FallbackLabels {
                    domain: labels.domain.clone(),
                    descriptor: labels.descriptor.clone(),
                    mode: mode.name(),
                };
                self.fallbacks.get_or_create(&fallback).inc_by(hits);
            }
            if s.from_cache && s.code == Code::OverLimit {
                self.local_cache.get_or_create(&labels).inc_by(hits);
            }
            if s.would_reject {
                self.shadow_mode.get_or_create(&labels).inc_by(hits);
            } else if s.code == Code::OverLimit {
                self.over_limit.get_or_create(&labels).inc_by(hits);
            } else {
                self.within_limit.get_or_create(&labels).inc_by(hits);
                let used = limit.requests_per_unit.saturating_sub(s.remaining) as f64;
                if limit.requests_per_unit > 0
                    && used >= self.near_limit_ratio * limit.requests_per_unit as f64
                {
                    self.near_limit.get_or_create(&labels).inc_by(hits);
                }
            }
        }
    }

    /// Counts a malformed request.
    pub fn invalid_request(&self) {
        self.invalid_requests.inc();
    }

    fn labels(&self, domain: &Arc<str>, path: &Arc<str>) -> RuleLabels {
        let key = (Arc::clone(domain), Arc::clone(path));
        let known = self.seen.read().contains(&key);
        let path = if known {
            path.to_string()
        } else {
            let mut seen = self.seen.write();
            if seen.len() < MAX_RULE_SERIES {
                seen.insert(key);
                path.to_string()
            } else if seen.contains(&key) {
                path.to_string()
            } else {
                "_overflow".to_string()
            }
        };
        RuleLabels {
            domain: domain.to_string(),
            descriptor: path,
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
        self.store_keys
            .set(i64::try_from(stats.keys).unwrap_or(i64::MAX));
        sync(&self.store_evictions, stats.evictions);
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
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
