//! A route's adaptive concurrency in the gateway: [`RouteConcurrency`] counts the
//! requests waiting for the upstream's answer against the limit its [`Gradient`] sets,
//! and [`AdaptivePermit`] is one request's place: taken before the rate limits (so a
//! shed request is not charged), timed from the moment the request is forwarded, and
//! given back with its latency when the upstream's response head arrives (a streamed
//! body is then the client's and the upstream's business, not a queue).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::settings::AdaptiveConcurrency;
use crate::adaptive::{Gradient, Phase};
use crate::clock::Nanos;

/// One route's controller and count; shared by every request of the route, and kept
/// across reloads that leave the route and its settings as they were.
#[derive(Debug)]
pub(crate) struct RouteConcurrency {
    pub domain: String,
    /// `index:path_prefix`.
    pub route: String,
    pub config: AdaptiveConcurrency,
    gradient: Mutex<Gradient>,
    in_flight: AtomicU32,
    /// The most in flight since the controller last saw it.
    peak: AtomicU32,
    /// The controller's limit, epoch and next due instant, published for the fast path.
    limit: AtomicU32,
    epoch: AtomicU64,
    due: AtomicU64,
    shed: AtomicU64,
}

/// What the dashboard and the metrics show of a route.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteStats {
    /// The rule domain of the route's section.
    pub domain: String,
    /// The route: its index in the section and its path prefix (`0:/api/`).
    pub route: String,
    /// Requests that may be in flight now.
    pub limit: u32,
    /// Requests in flight now.
    pub in_flight: u32,
    /// The RTT of the last interval with answers, in nanoseconds.
    pub rtt: Option<Nanos>,
    /// The last minimum RTT measured, in nanoseconds.
    pub min_rtt: Option<Nanos>,
    /// Whether the minimum RTT is being measured (the limit pinned to `min_limit`).
    pub measuring: bool,
    /// Requests shed since the route's controller started.
    pub shed: u64,
}

impl RouteConcurrency {
    pub(crate) fn new(
        domain: String,
        route: String,
        config: AdaptiveConcurrency,
        now: Nanos,
        seed: u64,
    ) -> Self {
        let gradient = Gradient::new(config.settings, now, seed);
        Self {
            domain,
            route,
            limit: AtomicU32::new(gradient.limit()),
            epoch: AtomicU64::new(gradient.epoch()),
            due: AtomicU64::new(gradient.next_due()),
            gradient: Mutex::new(gradient),
            config,
            in_flight: AtomicU32::new(0),
            peak: AtomicU32::new(0),
            shed: AtomicU64::new(0),
        }
    }

    /// A place for a request at `now`, or `None` when the limit is reached (the caller
    /// counts it with [`shed`](Self::shed) if it sheds the request).
    pub(crate) fn try_acquire(self: &Arc<Self>, now: Nanos) -> Option<AdaptivePermit> {
        if now >= self.due.load(Ordering::Relaxed) {
            let mut g = self.gradient.lock();
            g.in_flight(self.peak.swap(0, Ordering::Relaxed));
            g.tick(now);
            self.publish(&g);
        }
        let limit = self.limit.load(Ordering::Relaxed);
        let mut current = self.in_flight.load(Ordering::Relaxed);
        loop {
            if current >= limit {
                return None;
            }
            match self.in_flight.compare_exchange_weak(
                current,
                current + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(now_in_flight) => current = now_in_flight,
            }
        }
        self.peak.fetch_max(current + 1, Ordering::Relaxed);
        Some(AdaptivePermit {
            owner: Arc::clone(self),
            started: now,
            epoch: self.epoch.load(Ordering::Relaxed),
        })
    }

    /// Counts a request shed.
    pub(crate) fn shed(&self) {
        self.shed.fetch_add(1, Ordering::Relaxed);
    }

    fn publish(&self, g: &Gradient) {
        self.limit.store(g.limit(), Ordering::Relaxed);
        self.epoch.store(g.epoch(), Ordering::Relaxed);
        self.due.store(g.next_due(), Ordering::Relaxed);
    }

    /// What the route shows now.
    pub(crate) fn stats(&self) -> RouteStats {
        let g = self.gradient.lock();
        RouteStats {
            domain: self.domain.clone(),
            route: self.route.clone(),
            limit: g.limit(),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            rtt: g.measured_rtt(),
            min_rtt: g.min_rtt(),
            measuring: matches!(g.phase(), Phase::Measuring { .. }),
            shed: self.shed.load(Ordering::Relaxed),
        }
    }
}

/// One request's place on a route; the place is given back when dropped (the
/// gateway drops it once the response head has come).
#[derive(Debug)]
pub(crate) struct AdaptivePermit {
    owner: Arc<RouteConcurrency>,
    started: Nanos,
    epoch: u64,
}

impl AdaptivePermit {
    /// The request is forwarded at `now`: its latency counts from here, not from when it
    /// took its place (the rate limits and a queue's delay are not the upstream's).
    pub(crate) fn start(&mut self, now: Nanos) {
        self.started = now;
    }

    /// The upstream answered `status` at `now`: the latency is a sample unless the
    /// route excludes the status.
    pub(crate) fn answered(&self, now: Nanos, status: u16) {
        let owner = &self.owner;
        if owner.config.exclude.contains(&status) {
            return;
        }
        let mut g = owner.gradient.lock();
        g.in_flight(owner.peak.swap(0, Ordering::Relaxed));
        g.record(now, self.epoch, now.saturating_sub(self.started));
        owner.publish(&g);
    }
}

impl Drop for AdaptivePermit {
    fn drop(&mut self) {
        self.owner.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adaptive::GradientSettings;

    const MS: Nanos = 1_000_000;

    #[test]
    fn places_are_counted_against_the_limit_and_given_back() {
        let config = AdaptiveConcurrency {
            settings: GradientSettings {
                min_limit: 2,
                min_rtt_samples: 3,
                ..GradientSettings::default()
            },
            exclude: vec![502],
        };
        let route = Arc::new(RouteConcurrency::new(
            "d".into(),
            "0:/".into(),
            config,
            0,
            1,
        ));
        let a = route.try_acquire(MS);
        let b = route.try_acquire(MS);
        assert!(a.is_some() && b.is_some());
        assert!(route.try_acquire(MS).is_none());
        route.shed();
        assert_eq!(route.stats().shed, 1);
        assert_eq!(route.stats().in_flight, 2);
        drop(a);
        let c = route.try_acquire(2 * MS);
        assert!(c.is_some());
        // An excluded status is not a sample; the others end the measurement.
        if let Some(b) = &b {
            b.answered(3 * MS, 502);
        }
        assert!(route.stats().measuring);
        for p in [&b, &c].into_iter().flatten() {
            p.answered(5 * MS, 200);
        }
        drop(b);
        let d = route.try_acquire(6 * MS);
        assert!(d.is_some());
        if let Some(d) = &d {
            d.answered(8 * MS, 200);
        }
        let stats = route.stats();
        assert!(!stats.measuring);
        assert_eq!(stats.min_rtt, Some(3 * MS));
        drop((c, d));
        assert_eq!(route.stats().in_flight, 0);
    }
}
