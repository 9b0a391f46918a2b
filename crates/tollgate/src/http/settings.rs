//! The load-shedding settings of an `http` section, read and checked:
//! a route's `adaptive_concurrency` ([`AdaptiveConcurrency`]) and the gateway's
//! `system_protection` ([`SystemProtection`]). docs/gateway.md, "Adaptive concurrency"
//! and "System protection", is the reference.
//!
//! ```yaml
//! http:
//!   system_protection:
//!     max_cpu: 85%                 # shed while the host's CPU use is above this
//!     capacity: true               # shed past max answers per second × min latency
//!     min_in_flight: 16            # ... but never below this many in flight
//!     exempt: [/healthz]           # path prefixes never shed
//!     priority: {header: x-priority, classes: [critical, default, sheddable], default_class: default}
//!   routes:
//!     - match: {path_prefix: /api/}
//!       adaptive_concurrency: {min_limit: 3, max_limit: 1000, interval: 100ms,
//!                              min_rtt_interval: 30s, min_rtt_samples: 50,
//!                              jitter: 15%, buffer: 25%, percentile: 50%, exclude: [502, 503, 504]}
//! ```

use std::time::Duration;

use serde::Deserialize;

use super::path;
use crate::adaptive::{GradientSettings, ProtectionSettings};
use crate::rules::parse_duration;

/// A route's `adaptive_concurrency`, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct AdaptiveConcurrency {
    /// The controller's settings.
    pub settings: GradientSettings,
    /// Answers with these statuses are not latency samples.
    pub exclude: Vec<u16>,
}

/// `adaptive_concurrency` as written.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawAdaptive {
    #[serde(default)]
    min_limit: Option<u32>,
    #[serde(default)]
    max_limit: Option<u32>,
    #[serde(default)]
    interval: Option<String>,
    #[serde(default)]
    min_rtt_interval: Option<String>,
    #[serde(default)]
    min_rtt_samples: Option<u32>,
    #[serde(default)]
    jitter: Option<String>,
    #[serde(default)]
    buffer: Option<String>,
    #[serde(default)]
    percentile: Option<String>,
    #[serde(default)]
    exclude: Vec<u16>,
}

/// The most a route's limit may be.
pub const MAX_ADAPTIVE_LIMIT: u32 = 1_000_000;

impl RawAdaptive {
    /// The settings, or what is wrong with them.
    pub(crate) fn check(&self) -> Result<AdaptiveConcurrency, String> {
        let d = GradientSettings::default();
        let min_limit = self.min_limit.unwrap_or(d.min_limit);
        let max_limit = self.max_limit.unwrap_or(d.max_limit.max(min_limit));
        if min_limit == 0 {
            return Err("`min_limit` must be at least 1".into());
        }
        if max_limit < min_limit || max_limit > MAX_ADAPTIVE_LIMIT {
            return Err(format!(
                "`max_limit` ({max_limit}) must be from `min_limit` ({min_limit}) to {MAX_ADAPTIVE_LIMIT}"
            ));
        }
        let interval = duration(
            "interval",
            self.interval.as_deref(),
            d.interval,
            Duration::from_millis(10)..=Duration::from_secs(60),
        )?;
        let min_rtt_interval = duration(
            "min_rtt_interval",
            self.min_rtt_interval.as_deref(),
            d.min_rtt_interval,
            interval.saturating_mul(10)..=Duration::from_secs(86_400),
        )?;
        let min_rtt_samples = self.min_rtt_samples.unwrap_or(d.min_rtt_samples);
        if !(1..=100_000).contains(&min_rtt_samples) {
            return Err(format!(
                "`min_rtt_samples` ({min_rtt_samples}) must be from 1 to 100000"
            ));
        }
        let jitter = percent("jitter", self.jitter.as_deref(), d.jitter, 0.0, 1.0)?;
        let buffer = percent("buffer", self.buffer.as_deref(), d.buffer, 0.0, 10.0)?;
        let percentile = percent(
            "percentile",
            self.percentile.as_deref(),
            d.percentile,
            0.01,
            1.0,
        )?;
        if let Some(s) = self.exclude.iter().find(|s| !(100..=599).contains(*s)) {
            return Err(format!("`exclude`: {s} is not an HTTP status"));
        }
        Ok(AdaptiveConcurrency {
            settings: GradientSettings {
                min_limit,
                max_limit,
                interval,
                min_rtt_interval,
                jitter,
                min_rtt_samples,
                buffer,
                percentile,
            },
            exclude: self.exclude.clone(),
        })
    }
}

/// The gateway's `system_protection`, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct SystemProtection {
    /// The rules' settings.
    pub settings: ProtectionSettings,
    /// How a request names its class, if classes are used.
    pub priority: Option<SystemPriority>,
    /// Normalized path prefixes never shed (health checks).
    pub exempt: Vec<String>,
    /// The file that set it, for a second one's error.
    pub file: String,
    /// The line where it was set.
    pub line: usize,
}

/// The priority classes of system protection.
#[derive(Debug, Clone, PartialEq)]
pub struct SystemPriority {
    /// The header that names a request's class.
    pub header: http::HeaderName,
    /// The classes, highest first.
    pub classes: Vec<String>,
    /// The rank (index in `classes`) of a request that names none, or an unknown one.
    pub default_rank: usize,
}

impl SystemProtection {
    /// The rank (0 the highest) of a request with `headers`.
    pub fn rank(&self, headers: &http::HeaderMap) -> usize {
        let Some(p) = &self.priority else {
            return 0;
        };
        headers
            .get(&p.header)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| p.classes.iter().position(|c| c == v.trim()))
            .unwrap_or(p.default_rank)
    }

    /// The name of the class of rank `rank`; `all` without classes.
    pub fn class_name(&self, rank: usize) -> &str {
        self.priority
            .as_ref()
            .and_then(|p| p.classes.get(rank))
            .map_or("all", String::as_str)
    }

    /// Whether `path` (normalized) is never shed.
    pub fn is_exempt(&self, path: &str) -> bool {
        self.exempt.iter().any(|p| path.starts_with(p.as_str()))
    }
}

/// `system_protection` as written.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawProtection {
    #[serde(default)]
    max_cpu: Option<String>,
    #[serde(default)]
    capacity: Option<bool>,
    #[serde(default)]
    min_in_flight: Option<u32>,
    #[serde(default)]
    class_step: Option<String>,
    #[serde(default)]
    exempt: Vec<String>,
    #[serde(default)]
    priority: Option<RawPriority>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPriority {
    header: String,
    classes: Vec<String>,
    #[serde(default)]
    default_class: Option<String>,
}

/// The most priority classes.
pub const MAX_CLASSES: usize = 64;

impl RawProtection {
    /// The settings, or what is wrong with them; set in `file` at `line`.
    pub(crate) fn check(&self, file: &str, line: usize) -> Result<SystemProtection, String> {
        let d = ProtectionSettings::default();
        let max_cpu = match &self.max_cpu {
            None => None,
            // At 100 % the use could never pass it.
            Some(text) => Some(percent("max_cpu", Some(text), 0.0, 0.01, 0.99)?),
        };
        let capacity = self.capacity.unwrap_or(true);
        if max_cpu.is_none() && !capacity {
            return Err(
                "sheds nothing: set `max_cpu`, or leave `capacity` on (the default)".into(),
            );
        }
        let class_step = percent(
            "class_step",
            self.class_step.as_deref(),
            d.class_step,
            0.0,
            10.0,
        )?;
        let priority = match &self.priority {
            None => None,
            Some(p) => Some(priority(p)?),
        };
        let mut exempt = Vec::new();
        for prefix in &self.exempt {
            if !prefix.starts_with('/') {
                return Err(format!("`exempt`: `{prefix}` does not start with `/`"));
            }
            let normal =
                path::normalize(prefix).map_err(|e| format!("`exempt`: `{prefix}`: {e}"))?;
            exempt.push(normal);
        }
        Ok(SystemProtection {
            settings: ProtectionSettings {
                max_cpu,
                capacity,
                min_in_flight: self.min_in_flight.unwrap_or(d.min_in_flight),
                classes: priority.as_ref().map_or(1, |p| p.classes.len()),
                class_step,
            },
            priority,
            exempt,
            file: file.to_string(),
            line,
        })
    }
}

fn priority(p: &RawPriority) -> Result<SystemPriority, String> {
    const WHAT: &str = "`priority` must be `{header: <header>, classes: [<highest>, ..., <lowest>], default_class: <class>}`";
    let header = http::HeaderName::from_bytes(p.header.trim().as_bytes()).map_err(|_| {
        format!(
            "`priority.header`: `{}` is not a valid header name",
            p.header
        )
    })?;
    if p.classes.is_empty() || p.classes.len() > MAX_CLASSES {
        return Err(format!("{WHAT}: from 1 to {MAX_CLASSES} classes"));
    }
    for (i, c) in p.classes.iter().enumerate() {
        if c.trim().is_empty() {
            return Err(format!("{WHAT}: a class name is empty"));
        }
        if p.classes[..i].contains(c) {
            return Err(format!("`priority.classes`: `{c}` is named twice"));
        }
    }
    let default_rank = match &p.default_class {
        // A request that names no class is of the lowest.
        None => p.classes.len() - 1,
        Some(d) => p.classes.iter().position(|c| c == d).ok_or_else(|| {
            format!(
                "`priority.default_class: {d}` is not one of the classes ({})",
                p.classes.join(", ")
            )
        })?,
    };
    Ok(SystemPriority {
        header,
        classes: p.classes.clone(),
        default_rank,
    })
}

/// A duration setting: `text` read, else `default`; within `range`.
fn duration(
    name: &str,
    text: Option<&str>,
    default: Duration,
    range: std::ops::RangeInclusive<Duration>,
) -> Result<Duration, String> {
    let Some(text) = text else {
        return Ok(default);
    };
    let value = parse_duration(text).ok_or_else(|| {
        format!("`{name}: {text}` is not a duration (`100ms`, `30s`, `5m`, `1h`)")
    })?;
    if !range.contains(&value) {
        return Err(format!(
            "`{name}: {text}` must be from {:?} to {:?}",
            range.start(),
            range.end()
        ));
    }
    Ok(value)
}

/// A percentage setting (`25%`) as a share (0.25): `text` read, else `default`; from
/// `lo` to `hi`.
fn percent(name: &str, text: Option<&str>, default: f64, lo: f64, hi: f64) -> Result<f64, String> {
    let Some(text) = text else {
        return Ok(default);
    };
    let share = text
        .trim()
        .strip_suffix('%')
        .and_then(|n| n.trim().parse::<f64>().ok())
        .filter(|n| n.is_finite())
        .map(|n| n / 100.0)
        .ok_or_else(|| format!("`{name}: {text}` is not a percentage (`25%`)"))?;
    if !(lo..=hi).contains(&share) {
        return Err(format!(
            "`{name}: {text}` must be from {}% to {}%",
            lo * 100.0,
            hi * 100.0
        ));
    }
    Ok(share)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentages_and_durations_are_read_within_their_ranges() {
        assert_eq!(percent("b", Some("25%"), 0.0, 0.0, 1.0), Ok(0.25));
        assert_eq!(percent("b", Some(" 12.5 % "), 0.0, 0.0, 1.0), Ok(0.125));
        assert_eq!(percent("b", None, 0.3, 0.0, 1.0), Ok(0.3));
        assert!(percent("b", Some("25"), 0.0, 0.0, 1.0).is_err());
        assert!(percent("b", Some("NaN%"), 0.0, 0.0, 1.0).is_err());
        assert!(percent("b", Some("101%"), 0.0, 0.0, 1.0).is_err());
        let range = Duration::from_millis(10)..=Duration::from_secs(60);
        assert_eq!(
            duration("i", Some("250ms"), Duration::ZERO, range.clone()),
            Ok(Duration::from_millis(250))
        );
        assert!(duration("i", Some("5ms"), Duration::ZERO, range.clone()).is_err());
        assert!(duration("i", Some("fast"), Duration::ZERO, range).is_err());
    }

    #[test]
    fn classes_rank_requests_by_header() {
        let raw = RawProtection {
            priority: Some(RawPriority {
                header: "X-Priority".into(),
                classes: vec!["critical".into(), "default".into(), "sheddable".into()],
                default_class: Some("default".into()),
            }),
            ..RawProtection::default()
        };
        let p = raw.check("a.yaml", 3).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(p.settings.classes, 3);
        let mut h = http::HeaderMap::new();
        assert_eq!(p.rank(&h), 1);
        h.insert("x-priority", http::HeaderValue::from_static("sheddable"));
        assert_eq!(p.rank(&h), 2);
        assert_eq!(p.class_name(2), "sheddable");
        h.insert("x-priority", http::HeaderValue::from_static("vip"));
        assert_eq!(p.rank(&h), 1);
    }
}
