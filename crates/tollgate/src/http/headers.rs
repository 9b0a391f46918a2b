//! Rate limit response headers and the problem body, from a [`RateLimitResponse`]: the
//! IETF draft fields (draft-ietf-httpapi-ratelimit-headers-10) `RateLimit-Policy` and
//! `RateLimit`, one list item per limited descriptor named by its rule; `Retry-After`
//! on OVER_LIMIT; optionally the legacy `X-RateLimit-Limit/Remaining/Reset`.
//!
//! gRPC, the HTTP API and the gateway (`RateLimitLayer`, `tollgate proxy`) all use this one module.

use crate::limiter::{Code, DescriptorStatus, RateLimitResponse};
use serde_json::json;

/// Which headers to produce.
#[derive(Debug, Clone, Copy)]
pub struct HeaderSettings {
    /// Add `RateLimit-Policy` and `RateLimit`.
    pub draft: bool,
    /// Add `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`.
    pub legacy: bool,
}

/// Writes the policy name of a status as a structured-field String: the limit's `name`,
/// else the rule path, else `limit<i>`; printable ASCII only, `\\` and `"` escaped.
fn push_policy_name(out: &mut String, i: usize, s: &DescriptorStatus) {
    use std::fmt::Write as _;
    out.push('"');
    let name = s.limit.as_ref().and_then(|l| l.name.as_deref());
    match name.or(s.metric.as_ref().map(|m| &*m.path)) {
        Some(raw) => {
            for c in raw.chars() {
                match c {
                    '"' | '\\' => {
                        out.push('\\');
                        out.push(c);
                    }
                    ' '..='~' => out.push(c),
                    _ => {}
                }
            }
        }
        None => {
            let _ = write!(out, "limit{i}");
        }
    }
    out.push('"');
}

/// The policy name as plain text (printable ASCII), for the JSON problem body, which
/// does its own escaping.
fn policy_name(i: usize, s: &DescriptorStatus) -> String {
    let name = s.limit.as_ref().and_then(|l| l.name.as_deref());
    match name.or(s.metric.as_ref().map(|m| &*m.path)) {
        Some(raw) => raw.chars().filter(|c| (' '..='~').contains(c)).collect(),
        None => format!("limit{i}"),
    }
}

/// The statuses that carry a limit, with their index.
fn limited(response: &RateLimitResponse) -> impl Iterator<Item = (usize, &DescriptorStatus)> {
    response
        .statuses
        .iter()
        .enumerate()
        .filter(|(_, s)| s.limit.is_some())
}

/// The response headers for `response`, as (name, value) pairs.
pub fn headers(
    response: &RateLimitResponse,
    settings: HeaderSettings,
) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    if settings.draft {
        use std::fmt::Write as _;
        let (mut policies, mut states) = (String::with_capacity(64), String::with_capacity(64));
        for (i, s) in limited(response) {
            let Some(l) = &s.limit else { continue };
            if !policies.is_empty() {
                policies.push_str(", ");
                states.push_str(", ");
            }
            push_policy_name(&mut policies, i, s);
            let _ = write!(
                policies,
                ";q={};w={}",
                l.requests_per_unit,
                l.unit.seconds()
            );
            push_policy_name(&mut states, i, s);
            let _ = write!(states, ";r={};t={}", s.remaining, s.reset_after_secs());
        }
        if !policies.is_empty() {
            out.push(("RateLimit-Policy", policies));
            out.push(("RateLimit", states));
        }
    }
    if response.overall == Code::OverLimit {
        // The longest wait among the descriptors over their limit.
        let retry = response
            .statuses
            .iter()
            .filter(|s| s.code == Code::OverLimit)
            .filter_map(DescriptorStatus::retry_after_secs)
            .max();
        if let Some(secs) = retry {
            out.push(("Retry-After", secs.max(1).to_string()));
        }
    }
    if settings.legacy {
        // The most restrictive descriptor: over the limit first, then least remaining.
        let tightest = limited(response)
            .map(|(_, s)| s)
            .min_by_key(|s| (s.code != Code::OverLimit, s.remaining));
        if let Some(s) = tightest {
            if let Some(l) = &s.limit {
                out.push(("X-RateLimit-Limit", l.requests_per_unit.to_string()));
                out.push(("X-RateLimit-Remaining", s.remaining.to_string()));
                out.push(("X-RateLimit-Reset", s.reset_after_secs().to_string()));
            }
        }
    }
    out
}

/// Appends `fields` (as [`headers`] returns them) to an HTTP header map. Values that
/// are not valid header values (none that [`headers`] makes) are skipped.
pub fn append_to(map: &mut http::HeaderMap, fields: &[(&'static str, String)]) {
    for (name, value) in fields {
        if let Ok(v) = http::HeaderValue::from_str(value) {
            map.append(http::HeaderName::from_static(lower_case(name)), v);
        }
    }
}

/// `HeaderName::from_static` wants lower case; the names here are fixed.
fn lower_case(name: &'static str) -> &'static str {
    match name {
        "RateLimit-Policy" => "ratelimit-policy",
        "RateLimit" => "ratelimit",
        "Retry-After" => "retry-after",
        "X-RateLimit-Limit" => "x-ratelimit-limit",
        "X-RateLimit-Remaining" => "x-ratelimit-remaining",
        "X-RateLimit-Reset" => "x-ratelimit-reset",
        _ => "x-tollgate",
    }
}

/// An RFC 9457 problem detail naming the violated policies, for OVER_LIMIT answers.
pub fn problem_body(response: &RateLimitResponse) -> Vec<u8> {
    let violated: Vec<serde_json::Value> = response
        .statuses
        .iter()
        .enumerate()
        .filter(|(_, s)| s.code == Code::OverLimit)
        .map(|(i, s)| {
            json!({
                "policy": policy_name(i, s),
                "limit": s.limit.as_ref().map(|l| l.requests_per_unit),
                "window_seconds": s.limit.as_ref().map(|l| l.unit.seconds()),
                "retry_after_seconds": s.retry_after_secs(),
            })
        })
        .collect();
    let names: Vec<String> = violated
        .iter()
        .filter_map(|v| v["policy"].as_str().map(str::to_string))
        .collect();
    let body = json!({
        "type": "https://tollgate.dev/problems/rate-limited",
        "title": "Too Many Requests",
        "status": 429,
        "detail": format!("rate limit exceeded: {}", names.join(", ")),
        "violated_policies": violated,
    });
    body.to_string().into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{MetricKey, ReportedLimit};
    use crate::rules::Unit;

    fn status(
        name: Option<&str>,
        code: Code,
        remaining: u64,
        reset_s: u64,
        retry_s: u64,
    ) -> DescriptorStatus {
        DescriptorStatus {
            code,
            limit: Some(ReportedLimit {
                name: name.map(str::to_string),
                requests_per_unit: 10,
                unit: Unit::Minute,
            }),
            remaining,
            reset_after: reset_s * 1_000_000_000,
            retry_after: retry_s * 1_000_000_000,
            delay: 0,
            over_soft_limit: false,
            shadow: false,
            would_reject: false,
            metric: Some(MetricKey {
                domain: "d".into(),
                path: "user".into(),
            }),
            from_cache: false,
            failure_mode: None,
        }
    }

    #[test]
    fn every_limited_descriptor_gets_a_list_item_named_by_its_rule() {
        let r = RateLimitResponse {
            overall: Code::OverLimit,
            store_failure: None,
            statuses: vec![
                status(Some("per_user"), Code::Ok, 4, 30, 0),
                status(None, Code::OverLimit, 0, 50, 50),
            ],
        };
        let h = headers(
            &r,
            HeaderSettings {
                draft: true,
                legacy: true,
            },
        );
        assert_eq!(
            h,
            [
                (
                    "RateLimit-Policy",
                    "\"per_user\";q=10;w=60, \"user\";q=10;w=60".to_string()
                ),
                (
                    "RateLimit",
                    "\"per_user\";r=4;t=30, \"user\";r=0;t=50".to_string()
                ),
                ("Retry-After", "50".to_string()),
                ("X-RateLimit-Limit", "10".to_string()),
                ("X-RateLimit-Remaining", "0".to_string()),
                ("X-RateLimit-Reset", "50".to_string()),
            ]
        );
    }

    #[test]
    fn names_are_escaped_as_structured_field_strings() {
        let r = RateLimitResponse {
            overall: Code::Ok,
            store_failure: None,
            statuses: vec![status(Some("a\"b\\c\u{e9}"), Code::Ok, 1, 1, 0)],
        };
        let h = headers(
            &r,
            HeaderSettings {
                draft: true,
                legacy: false,
            },
        );
        assert_eq!(h[0].1, "\"a\\\"b\\\\c\";q=10;w=60");
    }
}
