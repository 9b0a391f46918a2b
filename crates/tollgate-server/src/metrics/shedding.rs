//! The gateway's load shedding in the metrics: each route's adaptive concurrency and
//! the system protection, read from the layer's [`Shedding`] when scraped.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tollgate::http::Shedding;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    domain: String,
    route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShedLabels {
    reason: &'static str,
    class: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// The families; series appear once the gateway has a route with adaptive concurrency,
/// or `system_protection`.
pub(super) struct SheddingMetrics {
    limit: Family<RouteLabels, Gauge>,
    in_flight: Family<RouteLabels, Gauge>,
    rtt: Family<RouteLabels, FloatGauge>,
    min_rtt: Family<RouteLabels, FloatGauge>,
    shed: Family<RouteLabels, Counter>,
    system_in_flight: Gauge,
    system_capacity: FloatGauge,
    system_cpu: FloatGauge,
    system_shed: Family<ShedLabels, Counter>,
    source: std::sync::OnceLock<Arc<Shedding>>,
}

impl SheddingMetrics {
    pub(super) fn register(registry: &mut Registry) -> Self {
        let adaptive_limit = Family::<RouteLabels, Gauge>::default();
        let adaptive_in_flight = Family::<RouteLabels, Gauge>::default();
        let adaptive_rtt = Family::<RouteLabels, FloatGauge>::default();
        let adaptive_min_rtt = Family::<RouteLabels, FloatGauge>::default();
        let adaptive_shed = Family::<RouteLabels, Counter>::default();
        let system_in_flight = Gauge::default();
        let system_capacity = FloatGauge::default();
        let system_cpu = FloatGauge::default();
        let system_shed = Family::<ShedLabels, Counter>::default();
        registry.register(
            "adaptive_limit",
            "Requests a route with adaptive concurrency may have in flight now",
            adaptive_limit.clone(),
        );
        registry.register(
            "adaptive_in_flight",
            "Requests in flight on a route with adaptive concurrency",
            adaptive_in_flight.clone(),
        );
        registry.register(
            "adaptive_rtt_seconds",
            "The route's measured latency in its last interval with answers (its percentile)",
            adaptive_rtt.clone(),
        );
        registry.register(
            "adaptive_min_rtt_seconds",
            "The route's last minimum latency measured",
            adaptive_min_rtt.clone(),
        );
        registry.register(
            "adaptive_shed",
            "Requests the route's adaptive concurrency shed (503)",
            adaptive_shed.clone(),
        );
        registry.register(
            "system_in_flight",
            "Requests in flight through the gateway (system protection)",
            system_in_flight.clone(),
        );
        registry.register(
            "system_capacity",
            "What the upstream can take in flight before requests queue: the most answers \
             per second times the least latency, over the last second",
            system_capacity.clone(),
        );
        registry.register(
            "system_cpu_ratio",
            "The host's CPU use over the last second, 0 to 1 (system protection)",
            system_cpu.clone(),
        );
        registry.register(
            "system_shed",
            "Requests system protection shed (503), by reason (capacity, cpu) and priority class",
            system_shed.clone(),
        );
        Self {
            limit: adaptive_limit,
            in_flight: adaptive_in_flight,
            rtt: adaptive_rtt,
            min_rtt: adaptive_min_rtt,
            shed: adaptive_shed,
            system_in_flight,
            system_capacity,
            system_cpu,
            system_shed,
            source: std::sync::OnceLock::new(),
        }
    }

    /// Reads `shedding` when scraped.
    pub(super) fn know(&self, shedding: Arc<Shedding>) {
        let _ = self.source.set(shedding);
    }

    pub(super) fn shedding(&self) -> Option<&Arc<Shedding>> {
        self.source.get()
    }

    /// Brings the series up to date; `sync` moves a counter up to a total.
    pub(super) fn render(&self, sync: impl Fn(&Counter, u64)) {
        let Some(shedding) = self.source.get() else {
            return;
        };
        // The gauges show the routes in force: a route a reload removed leaves them.
        self.limit.clear();
        self.in_flight.clear();
        self.rtt.clear();
        self.min_rtt.clear();
        for r in shedding.routes() {
            let labels = RouteLabels {
                domain: r.domain,
                route: r.route,
            };
            self.limit.get_or_create(&labels).set(i64::from(r.limit));
            self.in_flight
                .get_or_create(&labels)
                .set(i64::from(r.in_flight));
            // Not measured yet: NaN, not a latency of 0.
            let secs = |n: Option<u64>| n.map_or(f64::NAN, |n| n as f64 / 1e9);
            self.rtt.get_or_create(&labels).set(secs(r.rtt));
            self.min_rtt.get_or_create(&labels).set(secs(r.min_rtt));
            sync(&self.shed.get_or_create(&labels), r.shed);
        }
        if let Some(s) = shedding.system() {
            self.system_in_flight.set(i64::from(s.in_flight));
            self.system_capacity.set(s.capacity.unwrap_or(f64::NAN));
            self.system_cpu.set(s.cpu.unwrap_or(f64::NAN));
            for (class, by_capacity, by_cpu) in s.shed {
                for (reason, n) in [("capacity", by_capacity), ("cpu", by_cpu)] {
                    let labels = ShedLabels {
                        reason,
                        class: class.clone(),
                    };
                    sync(&self.system_shed.get_or_create(&labels), n);
                }
            }
        }
    }
}
