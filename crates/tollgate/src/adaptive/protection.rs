//! [`Protection`]: whether the gateway as a whole sheds a request, by two rules, as
//! Sentinel's system protection has them.
//!
//! - **Capacity** (BBR-inspired): a request is shed while the requests in flight are at
//!   least what the upstream can take before they queue, [`Capacity::estimate`] (the
//!   most answers per second times the least latency, over the last second), and at
//!   least `min_in_flight` (so that a quiet gateway never sheds on a thin estimate).
//! - **CPU**: while the host's CPU use is above `max_cpu`, requests are shed.
//!
//! **Priority classes shed lowest first.** With `n` classes, ranked from the highest
//! (0) to the lowest (`n − 1`):
//! - under the capacity rule, the lowest class may fill the estimate, and each class
//!   above it `class_step` more of it (with the default 50 %: the lowest 100 %, the
//!   next 150 %, the next 200 %), so the lowest is shed first and the highest only once
//!   the queue is deeper;
//! - under the CPU rule, each CPU reading above `max_cpu` sheds one more class, from the
//!   lowest, and each reading at or below it lets one back in. Without classes (one
//!   class), a reading above the threshold sheds every request until a reading below
//!   it, as Sentinel does.
//!
//! Pure: time, in-flight counts, latencies and CPU readings come in; the gateway
//! (`http/protection.rs`) counts what is in flight and reads the CPU.

use crate::clock::Nanos;

use super::capacity::Capacity;

/// The settings of system protection.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProtectionSettings {
    /// Shed while the CPU use (0 to 1) is above this; `None`: no CPU rule.
    pub max_cpu: Option<f64>,
    /// Whether the capacity rule applies.
    pub capacity: bool,
    /// The capacity rule never sheds while fewer than this many are in flight.
    pub min_in_flight: u32,
    /// How many priority classes (at least 1).
    pub classes: usize,
    /// How much more of the estimate each class above the lowest may fill.
    pub class_step: f64,
}

impl Default for ProtectionSettings {
    fn default() -> Self {
        Self {
            max_cpu: None,
            capacity: true,
            min_in_flight: 16,
            classes: 1,
            class_step: 0.5,
        }
    }
}

/// Why a request was shed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Shed {
    /// In flight at the estimated capacity.
    Capacity,
    /// The host's CPU above the threshold.
    Cpu,
}

impl Shed {
    /// `capacity` or `cpu`, as the metrics label it.
    pub fn as_str(self) -> &'static str {
        match self {
            Shed::Capacity => "capacity",
            Shed::Cpu => "cpu",
        }
    }
}

/// The decision state; see the [module](self) docs.
#[derive(Debug, Clone)]
pub struct Protection {
    settings: ProtectionSettings,
    capacity: Capacity,
    /// How many of the lowest classes the CPU rule sheds.
    level: usize,
    cpu: Option<f64>,
}

impl Protection {
    /// Protection with `settings`, nothing measured.
    pub fn new(settings: ProtectionSettings) -> Self {
        Self {
            settings: ProtectionSettings {
                classes: settings.classes.max(1),
                ..settings
            },
            capacity: Capacity::new(),
            level: 0,
            cpu: None,
        }
    }

    /// The settings in force.
    pub fn settings(&self) -> &ProtectionSettings {
        &self.settings
    }

    /// New settings, keeping what was measured (a reload); the CPU level is bounded by
    /// the new number of classes.
    pub fn set_settings(&mut self, settings: ProtectionSettings) {
        let classes = settings.classes.max(1);
        self.settings = ProtectionSettings {
            classes,
            ..settings
        };
        self.level = self.level.min(classes);
        if settings.max_cpu.is_none() {
            self.level = 0;
        }
    }

    /// Whether a request of class `rank` (0 the highest) is admitted at `now`, with
    /// `in_flight` requests in flight before it.
    pub fn check(&self, now: Nanos, in_flight: u32, rank: usize) -> Result<(), Shed> {
        let classes = self.settings.classes;
        let rank = rank.min(classes - 1);
        if self.level > 0 && rank >= classes - self.level {
            return Err(Shed::Cpu);
        }
        if self.settings.capacity && in_flight >= self.settings.min_in_flight {
            if let Some(cap) = self.capacity_for(now, rank) {
                if f64::from(in_flight) >= cap {
                    return Err(Shed::Capacity);
                }
            }
        }
        Ok(())
    }

    /// What class `rank` may fill at `now` under the capacity rule.
    pub fn capacity_for(&self, now: Nanos, rank: usize) -> Option<f64> {
        let classes = self.settings.classes;
        let above_lowest = (classes - 1).saturating_sub(rank) as f64;
        let estimate = self.capacity.estimate(now)?;
        Some(estimate * (1.0 + self.settings.class_step * above_lowest))
    }

    /// The capacity estimate at `now` (what the lowest class may fill).
    pub fn estimate(&self, now: Nanos) -> Option<f64> {
        self.capacity.estimate(now)
    }

    /// Records an answer at `now` that took `latency`.
    pub fn record(&mut self, now: Nanos, latency: Nanos) {
        self.capacity.record(now, latency);
    }

    /// A new CPU reading (0 to 1), or `None` when the CPU cannot be read (the rule then
    /// sheds nothing): one class more or less shed.
    pub fn observe_cpu(&mut self, cpu: Option<f64>) {
        self.cpu = cpu;
        match (cpu, self.settings.max_cpu) {
            (Some(cpu), Some(max)) if cpu > max => {
                self.level = (self.level + 1).min(self.settings.classes);
            }
            (Some(_), Some(_)) => self.level = self.level.saturating_sub(1),
            _ => self.level = 0,
        }
    }

    /// The last CPU reading.
    pub fn cpu(&self) -> Option<f64> {
        self.cpu
    }

    /// How many of the lowest classes the CPU rule sheds now.
    pub fn cpu_level(&self) -> usize {
        self.level
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;

    /// Protection whose estimate is 20 (2,000 answers a second of 10 ms).
    fn loaded(settings: ProtectionSettings) -> (Protection, Nanos) {
        let mut p = Protection::new(settings);
        let t0 = 1_000_000 * MS;
        for i in 0..200 {
            p.record(t0 + i * MS / 2, 10 * MS);
        }
        let now = t0 + 150 * MS;
        assert_eq!(p.estimate(now), Some(20.0));
        (p, now)
    }

    #[test]
    fn capacity_sheds_at_the_estimate_but_never_below_the_floor() {
        let (p, now) = loaded(ProtectionSettings {
            min_in_flight: 4,
            ..ProtectionSettings::default()
        });
        assert_eq!(p.check(now, 19, 0), Ok(()));
        assert_eq!(p.check(now, 20, 0), Err(Shed::Capacity));
        let (p, now) = loaded(ProtectionSettings {
            min_in_flight: 30,
            ..ProtectionSettings::default()
        });
        assert_eq!(p.check(now, 29, 0), Ok(()));
        assert_eq!(p.check(now, 30, 0), Err(Shed::Capacity));
        // Nothing measured yet: nothing shed.
        let fresh = Protection::new(ProtectionSettings::default());
        assert_eq!(fresh.check(now, 10_000, 0), Ok(()));
    }

    #[test]
    fn lower_classes_are_shed_first_under_the_capacity_rule() {
        let (p, now) = loaded(ProtectionSettings {
            min_in_flight: 1,
            classes: 3,
            ..ProtectionSettings::default()
        });
        // Ranks 0 (critical), 1, 2 (sheddable) may fill 40, 30 and 20.
        assert_eq!(p.check(now, 25, 2), Err(Shed::Capacity));
        assert_eq!(p.check(now, 25, 1), Ok(()));
        assert_eq!(p.check(now, 35, 1), Err(Shed::Capacity));
        assert_eq!(p.check(now, 35, 0), Ok(()));
        assert_eq!(p.check(now, 40, 0), Err(Shed::Capacity));
    }

    #[test]
    fn each_hot_cpu_reading_sheds_one_more_class_from_the_lowest() {
        let mut p = Protection::new(ProtectionSettings {
            max_cpu: Some(0.8),
            capacity: false,
            classes: 3,
            ..ProtectionSettings::default()
        });
        let now = 0;
        let admitted = |p: &Protection| {
            (0..3)
                .map(|r| p.check(now, 0, r).is_ok())
                .collect::<Vec<_>>()
        };
        assert_eq!(admitted(&p), [true, true, true]);
        p.observe_cpu(Some(0.95));
        assert_eq!(admitted(&p), [true, true, false]);
        assert_eq!(p.check(now, 0, 2), Err(Shed::Cpu));
        p.observe_cpu(Some(0.9));
        assert_eq!(admitted(&p), [true, false, false]);
        p.observe_cpu(Some(0.9));
        p.observe_cpu(Some(0.9));
        assert_eq!(admitted(&p), [false, false, false]);
        p.observe_cpu(Some(0.5));
        assert_eq!(admitted(&p), [true, false, false]);
        // An unreadable CPU sheds nothing.
        p.observe_cpu(None);
        assert_eq!(admitted(&p), [true, true, true]);
    }

    #[test]
    fn without_classes_a_hot_reading_sheds_everything_until_a_cool_one() {
        let mut p = Protection::new(ProtectionSettings {
            max_cpu: Some(0.8),
            capacity: false,
            ..ProtectionSettings::default()
        });
        p.observe_cpu(Some(0.81));
        assert_eq!(p.check(0, 0, 0), Err(Shed::Cpu));
        p.observe_cpu(Some(0.8));
        assert_eq!(p.check(0, 0, 0), Ok(()));
    }

    #[test]
    fn new_settings_keep_the_estimate_and_bound_the_level() {
        let (mut p, now) = loaded(ProtectionSettings {
            max_cpu: Some(0.5),
            classes: 3,
            ..ProtectionSettings::default()
        });
        for _ in 0..3 {
            p.observe_cpu(Some(0.9));
        }
        assert_eq!(p.cpu_level(), 3);
        p.set_settings(ProtectionSettings {
            max_cpu: Some(0.5),
            classes: 2,
            ..ProtectionSettings::default()
        });
        assert_eq!(p.cpu_level(), 2);
        assert_eq!(p.estimate(now), Some(20.0));
        p.set_settings(ProtectionSettings::default());
        assert_eq!(p.cpu_level(), 0);
    }
}
