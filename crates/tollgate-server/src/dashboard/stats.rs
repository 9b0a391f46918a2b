//! `GET /v1/stats`: the dashboard's JSON, every field documented in
//! `docs/dashboard.md`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::{json, Value};

use crate::service::Service;

use super::tally::Point;

/// Hot keys shown per rule.
pub(crate) const TOP_KEYS: usize = 10;

/// Rules listed at most (the busiest first).
pub(crate) const MAX_RULES_SHOWN: usize = 100;

/// `GET /v1/stats`.
pub(crate) async fn handle(State(service): State<Arc<Service>>) -> impl IntoResponse {
    ([(header::CACHE_CONTROL, "no-store")], Json(stats(&service)))
}

/// A rule's row, before it is written out.
#[derive(Default)]
struct Row {
    domain: String,
    descriptor: String,
    in_rule_set: bool,
    limits: Vec<String>,
    shadow_mode: bool,
    counts: [u64; 5],
    rates: Vec<[f64; 5]>,
    /// Its rates over the last tick (every rule that counts has them, with a history of
    /// its own or not).
    latest: [f64; 5],
    hot: Option<Vec<tollgate::sketch::HeavyHitter>>,
}

impl Row {
    fn now(&self) -> [f64; 5] {
        self.latest
    }
}

/// The whole document.
pub(crate) fn stats(service: &Service) -> Value {
    let metrics = &service.metrics;
    let (points, rule_rates, latest) = metrics.dashboard.history();
    let [decisions, nanos, store_failures, fallback_hits] = metrics.dashboard.totals();
    let rules = service.limiter.rules();
    let set = rules.current();

    // Every rule of the set, then every rule that has counted (a detailed_metric path,
    // or a rule no longer in the set).
    let mut rows: Vec<Row> = Vec::new();
    let mut at: HashMap<(String, String), usize> = HashMap::new();
    for domain in set.domains() {
        for rule in domain.rules() {
            if rule.limits.is_empty() && !rule.unlimited {
                continue;
            }
            let key = (domain.name.to_string(), rule.stat_path.to_string());
            if at.contains_key(&key) {
                continue;
            }
            let limits = if rule.unlimited {
                vec!["unlimited".to_string()]
            } else {
                rule.limits
                    .iter()
                    .map(|l| format!("{}/{}", l.requests_per_unit, l.unit.name().to_lowercase()))
                    .collect()
            };
            at.insert(key.clone(), rows.len());
            rows.push(Row {
                domain: key.0,
                descriptor: key.1,
                in_rule_set: true,
                limits,
                shadow_mode: rule.shadow_mode,
                ..Row::default()
            });
        }
    }
    for counted in metrics.rule_counts(TOP_KEYS) {
        let key = (counted.domain, counted.descriptor);
        let i = *at.entry(key.clone()).or_insert_with(|| {
            rows.push(Row {
                domain: key.0.clone(),
                descriptor: key.1.clone(),
                ..Row::default()
            });
            rows.len() - 1
        });
        rows[i].counts = counted.counts;
        rows[i].hot = counted.hot;
    }
    for row in &mut rows {
        let key = (row.domain.clone(), row.descriptor.clone());
        if let Some(r) = rule_rates.get(&key) {
            row.rates.clone_from(r);
        }
        if let Some(r) = latest.get(&key) {
            row.latest = *r;
        }
    }
    // The busiest now, then the busiest so far, then by name.
    rows.sort_by(|a, b| {
        b.now()[0]
            .total_cmp(&a.now()[0])
            .then(b.counts[0].cmp(&a.counts[0]))
            .then_with(|| (&a.domain, &a.descriptor).cmp(&(&b.domain, &b.descriptor)))
    });
    let omitted = rows.len().saturating_sub(MAX_RULES_SHOWN);
    rows.truncate(MAX_RULES_SHOWN);

    let now_unix_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    json!({
        "now_unix_ms": now_unix_ms,
        "interval_seconds": super::tally::TICK.as_secs(),
        "totals": {
            "decisions": decisions,
            "decision_seconds": nanos as f64 / 1e9,
            "store_failures": store_failures,
            "fallback_hits": fallback_hits,
        },
        "rates": rates_json(&points),
        "rules": rows.iter().map(row_json).collect::<Vec<_>>(),
        "rules_omitted": omitted,
        "store": store_json(service, store_failures, fallback_hits),
        "rule_set": {
            "loaded": rules.is_loaded(),
            "loaded_at_unix": set.loaded_at().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map(|d| d.as_secs()),
            "files": set.files().iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
            "domains": set.domains().iter().map(|d| json!({"domain": &*d.name, "files": d.files, "rules": d.rule_count(), "limits": d.limit_count()})).collect::<Vec<_>>(),
            "reload_attempts": rules.reload_attempts(),
            "load_successes": rules.load_successes(),
            "load_failures": rules.load_failures(),
            "last_error": rules.last_error().map(|e| e.iter().map(ToString::to_string).collect::<Vec<_>>()),
        },
        "enforcement": crate::enforcement::to_json(&service.limiter.enforcement().state()),
        "adaptive": adaptive_json(service),
        "system": system_json(service),
    })
}

/// Each route with adaptive concurrency (`tollgate proxy`): its limit, in flight, RTTs
/// (milliseconds) and shed count.
fn adaptive_json(service: &Service) -> Value {
    let Some(shedding) = service.metrics.shedding() else {
        return json!([]);
    };
    let ms = |n: Option<u64>| n.map(|n| round(n as f64 / 1e6));
    Value::Array(
        shedding
            .routes()
            .into_iter()
            .map(|r| {
                json!({
                    "domain": r.domain,
                    "route": r.route,
                    "limit": r.limit,
                    "in_flight": r.in_flight,
                    "rtt_ms": ms(r.rtt),
                    "min_rtt_ms": ms(r.min_rtt),
                    "measuring": r.measuring,
                    "shed": r.shed,
                })
            })
            .collect(),
    )
}

/// System protection (`tollgate proxy`), or `null` while no rule file sets it.
fn system_json(service: &Service) -> Value {
    let Some(s) = service.metrics.shedding().and_then(|s| s.system()) else {
        return Value::Null;
    };
    json!({
        "in_flight": s.in_flight,
        "capacity": s.capacity.map(round),
        "cpu": s.cpu.map(round),
        "max_cpu": s.max_cpu,
        "cpu_level": s.cpu_level,
        "shed": s.shed.iter().map(|(class, capacity, cpu)| json!({"class": class, "capacity": capacity, "cpu": cpu})).collect::<Vec<_>>(),
    })
}

/// The service's history as one array per figure, oldest first.
fn rates_json(points: &[Point]) -> Value {
    let series = |f: fn(&Point) -> f64| points.iter().map(|p| round(f(p))).collect::<Vec<_>>();
    json!({
        "at_unix": points.iter().map(|p| p.at_unix).collect::<Vec<_>>(),
        "decisions": series(|p| p.decisions),
        "hits": series(|p| p.hits),
        "ok": series(|p| p.ok),
        "over_limit": series(|p| p.over_limit),
        "near_limit": series(|p| p.near_limit),
        "shadow": series(|p| p.shadow),
        "decision_micros": series(|p| p.decision_micros),
        "store_failures": series(|p| p.store_failures),
        "redis_round_trip_micros": series(|p| p.redis_micros),
    })
}

fn row_json(row: &Row) -> Value {
    let [total, over, near, within, shadow] = row.counts;
    let column = |i: usize| row.rates.iter().map(|r| round(r[i])).collect::<Vec<_>>();
    let now = row.now();
    json!({
        "domain": row.domain,
        "descriptor": row.descriptor,
        "in_rule_set": row.in_rule_set,
        "limits": row.limits,
        "shadow_mode": row.shadow_mode,
        "totals": {"hits": total, "ok": within, "over_limit": over, "near_limit": near, "shadow": shadow},
        "per_second": {"hits": round(now[0]), "ok": round(now[3]), "over_limit": round(now[1]), "near_limit": round(now[2]), "shadow": round(now[4])},
        "history": {"hits": column(0), "over_limit": column(1)},
        "hot_keys": row.hot.as_ref().map(|hot| hot.iter().map(|h| json!({
            "key": h.key,
            "truncated": h.truncated,
            "hits": h.count,
            "error": h.error,
        })).collect::<Vec<_>>()),
    })
}

fn store_json(service: &Service, failures: u64, fallback_hits: u64) -> Value {
    let store = service.limiter.store();
    let memory = store
        .memory()
        .unwrap_or_else(|| service.limiter.fallback())
        .stats();
    let redis = store.redis().map(|r| {
        let s = r.stats();
        json!({
            "calls": s.calls,
            "answered": s.answered,
            "round_trip_micros_mean": if s.answered == 0 {
                0.0
            } else {
                round(s.answered_nanos as f64 / s.answered as f64 / 1e3)
            },
            "errors": s.errors,
            "timeouts": s.timeouts,
            "circuit_open_refusals": s.circuit_open,
            "circuit_opened": s.circuit_opened,
            "circuit": if s.open_now { "open" } else { "closed" },
            "blocked_cache_hits": s.cache_hits,
        })
    });
    let leases = store.scale_out().map(|scale| {
        let s = scale.stats();
        json!({
            "leases_taken": s.leases_taken,
            "leases_refused": s.leases_refused,
            "units_leased": s.units_leased,
            "units_expired": s.units_expired,
            "units_returned": s.units_returned,
            "leased_local": s.leased_local,
            "sync_calls": s.sync_calls,
            "sync_failures": s.sync_failures,
            "global_calls": s.global_calls,
            "global_failures": s.global_failures,
        })
    });
    json!({
        "kind": store.name(),
        "keys": memory.keys,
        "evictions": memory.evictions,
        "failures": failures,
        "fallback_hits": fallback_hits,
        "redis": redis,
        "leases": leases,
    })
}

/// Three decimals are plenty on a chart, and keep the document short.
fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}
