//! System protection in the gateway: [`SystemGuard`] applies the rule set's
//! `system_protection` ([`Protection`]) to every request before its routes, counts the
//! requests in flight, reads the CPU gauge, and counts what it sheds per reason and
//! class; [`SystemPermit`] is one admitted request's place, held until the upstream's
//! response head comes, which records its latency (from forwarding) for the capacity
//! estimate.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwapOption;
use parking_lot::Mutex;

use super::settings::{SystemProtection, MAX_CLASSES};
use crate::adaptive::{CpuGauge, Protection, ProtectionSettings, Shed};
use crate::clock::Nanos;

/// The gateway's guard; idle (one atomic load per request) while no rule file sets
/// `system_protection`.
pub(crate) struct SystemGuard {
    config: ArcSwapOption<SystemProtection>,
    state: Mutex<Protection>,
    in_flight: AtomicU32,
    cpu: Option<Arc<dyn CpuGauge>>,
    /// How many CPU readings the state has seen.
    cpu_seq: AtomicU64,
    /// Shed requests per class rank: by capacity, by CPU.
    shed: Box<[[AtomicU64; 2]]>,
}

/// What the dashboard and the metrics show of system protection.
#[derive(Debug, Clone, PartialEq)]
pub struct SystemStats {
    /// Requests in flight through the gateway now.
    pub in_flight: u32,
    /// What the upstream can take in flight before requests queue (the lowest class's
    /// share), when measured.
    pub capacity: Option<f64>,
    /// The last CPU reading (0 to 1).
    pub cpu: Option<f64>,
    /// The CPU threshold, if set.
    pub max_cpu: Option<f64>,
    /// How many of the lowest classes the CPU rule sheds now.
    pub cpu_level: usize,
    /// Per class, highest first: its name, and how many were shed by capacity and by
    /// CPU.
    pub shed: Vec<(String, u64, u64)>,
}

impl SystemGuard {
    pub(crate) fn new(cpu: Option<Arc<dyn CpuGauge>>) -> Self {
        Self {
            config: ArcSwapOption::empty(),
            state: Mutex::new(Protection::new(ProtectionSettings::default())),
            in_flight: AtomicU32::new(0),
            cpu,
            cpu_seq: AtomicU64::new(0),
            shed: (0..MAX_CLASSES).map(|_| Default::default()).collect(),
        }
    }

    /// The rule set's settings (none: the guard sheds nothing); what was measured stays.
    pub(crate) fn configure(&self, config: Option<&SystemProtection>) {
        match config {
            Some(c) => {
                if c.settings.max_cpu.is_some() && self.cpu.is_none() {
                    tracing::warn!(
                        "system_protection sets max_cpu, but this gateway has no CPU gauge: the CPU rule sheds nothing"
                    );
                }
                self.state.lock().set_settings(c.settings);
                self.config.store(Some(Arc::new(c.clone())));
            }
            None => {
                // Nothing carries over to a later `system_protection`: its CPU level
                // starts at zero (what was measured stays).
                self.state
                    .lock()
                    .set_settings(ProtectionSettings::default());
                self.config.store(None);
            }
        }
    }

    /// Admits a request for `path` (normalized) with `headers` at `now`: its place
    /// (`None` when protection is off or the path exempt), or why it is shed.
    pub(crate) fn admit(
        self: &Arc<Self>,
        now: Nanos,
        path: &str,
        headers: &http::HeaderMap,
    ) -> Result<Option<SystemPermit>, Shed> {
        let config = self.config.load();
        let Some(config) = config.as_deref() else {
            return Ok(None);
        };
        if config.is_exempt(path) {
            return Ok(None);
        }
        let rank = config.rank(headers);
        let in_flight = self.in_flight.load(Ordering::Acquire);
        {
            let mut state = self.state.lock();
            if let Some(gauge) = &self.cpu {
                // Each reading since the last request counts (the last one's value for
                // those missed): one class more or less per reading, as documented.
                let readings = gauge.readings();
                let seen = self.cpu_seq.swap(readings, Ordering::Relaxed);
                if readings != seen {
                    let busy = gauge.read().map(|r| r.busy);
                    let steps = readings
                        .saturating_sub(seen)
                        .clamp(1, MAX_CLASSES as u64 + 1);
                    for _ in 0..steps {
                        state.observe_cpu(busy);
                    }
                }
            }
            if let Err(why) = state.check(now, in_flight, rank) {
                let column = usize::from(why == Shed::Cpu);
                if let Some(counts) = self.shed.get(rank) {
                    counts[column].fetch_add(1, Ordering::Relaxed);
                }
                return Err(why);
            }
        }
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        Ok(Some(SystemPermit {
            owner: Arc::clone(self),
            started: now,
        }))
    }

    /// What the guard shows now at `now`; `None` while protection is off.
    pub(crate) fn stats(&self, now: Nanos) -> Option<SystemStats> {
        let config = self.config.load_full()?;
        let state = self.state.lock();
        let classes = state.settings().classes;
        let shed = (0..classes)
            .map(|rank| {
                let counts = &self.shed[rank.min(MAX_CLASSES - 1)];
                (
                    config.class_name(rank).to_string(),
                    counts[0].load(Ordering::Relaxed),
                    counts[1].load(Ordering::Relaxed),
                )
            })
            .collect();
        Some(SystemStats {
            in_flight: self.in_flight.load(Ordering::Relaxed),
            capacity: state.estimate(now),
            cpu: state.cpu(),
            max_cpu: state.settings().max_cpu,
            cpu_level: state.cpu_level(),
            shed,
        })
    }
}

/// One admitted request's place; given back when dropped.
pub(crate) struct SystemPermit {
    owner: Arc<SystemGuard>,
    started: Nanos,
}

impl SystemPermit {
    /// The request is forwarded at `now`: its latency counts from here.
    pub(crate) fn start(&mut self, now: Nanos) {
        self.started = now;
    }

    /// The upstream answered `status` at `now`: a sample for the capacity estimate,
    /// unless a server error (a gateway 502 answers at once, and is no measure of what
    /// the upstream can take).
    pub(crate) fn answered(&self, now: Nanos, status: u16) {
        if status >= 500 {
            return;
        }
        self.owner
            .state
            .lock()
            .record(now, now.saturating_sub(self.started));
    }
}

impl Drop for SystemPermit {
    fn drop(&mut self) {
        self.owner.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adaptive::ManualCpu;
    use crate::http::settings::SystemPriority;

    fn config(max_cpu: Option<f64>) -> SystemProtection {
        SystemProtection {
            settings: ProtectionSettings {
                max_cpu,
                capacity: true,
                min_in_flight: 2,
                classes: 2,
                class_step: 0.5,
            },
            priority: Some(SystemPriority {
                header: http::HeaderName::from_static("x-priority"),
                classes: vec!["high".into(), "low".into()],
                default_rank: 1,
            }),
            exempt: vec!["/healthz".into()],
            file: "a.yaml".into(),
            line: 1,
        }
    }

    #[test]
    fn a_hot_cpu_sheds_the_low_class_and_counts_it_but_not_exempt_paths() {
        let cpu = ManualCpu::new();
        let guard = Arc::new(SystemGuard::new(Some(Arc::new(cpu.clone()))));
        let headers = http::HeaderMap::new();
        assert!(matches!(guard.admit(0, "/", &headers), Ok(None)));
        guard.configure(Some(&config(Some(0.8))));
        cpu.set(Some(0.95));
        assert_eq!(guard.admit(0, "/x", &headers).err(), Some(Shed::Cpu));
        let mut high = http::HeaderMap::new();
        high.insert("x-priority", http::HeaderValue::from_static("high"));
        let permit = guard.admit(0, "/x", &high);
        assert!(matches!(permit, Ok(Some(_))));
        assert!(matches!(guard.admit(0, "/healthz", &headers), Ok(None)));
        let stats = guard.stats(0).unwrap_or_else(|| panic!("configured"));
        assert_eq!(stats.in_flight, 1);
        assert_eq!(stats.cpu_level, 1);
        assert_eq!(
            stats.shed,
            [("high".to_string(), 0, 0), ("low".to_string(), 0, 1)]
        );
        drop(permit);
        assert_eq!(guard.stats(0).map(|s| s.in_flight), Some(0));
        // A cool reading lets the low class back in.
        cpu.set(Some(0.5));
        assert!(matches!(guard.admit(0, "/x", &headers), Ok(Some(_))));
        guard.configure(None);
        assert!(guard.stats(0).is_none());
    }
}
