//! Rate limit response headers and the problem body, from a [`RateLimitResponse`]: the
//! IETF draft fields (draft-ietf-httpapi-ratelimit-headers-10) `RateLimit-Policy` and
//! `RateLimit`, one list item per limited descriptor named by its rule; `Retry-After`
//! on OVER_LIMIT; optionally the legacy `X-RateLimit-Limit/Remaining/Reset`, and
//! envoyproxy/ratelimit's `RateLimit-Limit/Remaining/Reset` (its
//! `LIMIT_RESPONSE_HEADERS_ENABLED`).
//!
//! gRPC, the HTTP API and the gateway (`RateLimitLayer`, `tollgate proxy`) all use this one module.

use std::borrow::Cow;

use crate::limiter::{Code, DescriptorStatus, RateLimitResponse};

/// Which headers (and rejection body) to produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeaderSettings {
    /// Add `RateLimit-Policy` and `RateLimit`.
    pub draft: bool,
    /// Add `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`.
    pub legacy: bool,
    /// Add envoyproxy/ratelimit's `RateLimit-Limit`, `RateLimit-Remaining` and
    /// `RateLimit-Reset`, for the descriptor it picks (see [`envoy_pick`]).
    pub envoy: bool,
    /// Add `Retry-After` to an OVER_LIMIT answer that can pass later.
    pub retry_after: bool,
    /// Send the problem body ([`problem_body`]) with an OVER_LIMIT answer (the gRPC
    /// answer's `raw_body`).
    pub problem_body: bool,
}

impl Default for HeaderSettings {
    /// The draft headers, `Retry-After` and the problem body.
    fn default() -> Self {
        Self {
            draft: true,
            legacy: false,
            envoy: false,
            retry_after: true,
            problem_body: true,
        }
    }
}

/// The status envoyproxy/ratelimit's headers describe: the last descriptor over its
/// limit and not in quota mode, else the first with the least `remaining` among those
/// with a limit.
pub fn envoy_pick(response: &RateLimitResponse) -> Option<&DescriptorStatus> {
    let over = response
        .statuses
        .iter()
        .rev()
        .find(|s| s.limit.is_some() && s.code == Code::OverLimit && s.quota.is_none());
    over.or_else(|| {
        limited(response).map(|(_, s)| s).fold(
            None,
            |best: Option<&DescriptorStatus>, s| match best {
                Some(b) if b.remaining <= s.remaining => Some(b),
                _ => Some(s),
            },
        )
    })
}

/// Writes the policy name of a status as a structured-field String: the limit's `name`,
/// else the rule path, else `limit<i>`; printable ASCII only, `\\` and `"` escaped.
fn push_policy_name(out: &mut String, i: usize, s: &DescriptorStatus) {
    use std::fmt::Write as _;
    out.push('"');
    let name = s.limit.as_ref().and_then(|l| l.name.as_deref());
    match name.or(s.metric.as_ref().map(|m| &*m.path)) {
        Some(raw)
            if raw
                .bytes()
                .all(|b| matches!(b, b' '..=b'~') && b != b'"' && b != b'\\') =>
        {
            out.push_str(raw);
        }
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
        let (mut policies, mut states) = (String::with_capacity(64), String::with_capacity(64));
        for (i, s) in limited(response) {
            let Some(l) = &s.limit else { continue };
            if !policies.is_empty() {
                policies.push_str(", ");
                states.push_str(", ");
            }
            push_policy_name(&mut policies, i, s);
            policies.push_str(";q=");
            push_u64(&mut policies, l.requests_per_unit);
            policies.push_str(";w=");
            push_u64(&mut policies, l.unit.seconds());
            push_policy_name(&mut states, i, s);
            states.push_str(";r=");
            push_u64(&mut states, s.remaining);
            states.push_str(";t=");
            push_u64(&mut states, s.reset_after_secs());
        }
        if !policies.is_empty() {
            out.push(("RateLimit-Policy", policies));
            out.push(("RateLimit", states));
        }
    }
    if settings.envoy {
        if let Some(s) = envoy_pick(response) {
            if let Some(l) = &s.limit {
                out.push(("RateLimit-Limit", number(l.requests_per_unit)));
                out.push(("RateLimit-Remaining", number(s.remaining)));
                out.push(("RateLimit-Reset", number(s.reset_after_secs())));
            }
        }
    }
    if settings.retry_after && response.overall == Code::OverLimit {
        // The longest wait among the descriptors over their limit.
        let retry = response
            .statuses
            .iter()
            .filter(|s| s.code == Code::OverLimit)
            .filter_map(DescriptorStatus::retry_after_secs)
            .max();
        if let Some(secs) = retry {
            out.push(("Retry-After", number(secs.max(1))));
        }
    }
    if settings.legacy {
        // The most restrictive descriptor: over the limit first, then least remaining.
        let tightest = limited(response)
            .map(|(_, s)| s)
            .min_by_key(|s| (s.code != Code::OverLimit, s.remaining));
        if let Some(s) = tightest {
            if let Some(l) = &s.limit {
                out.push(("X-RateLimit-Limit", number(l.requests_per_unit)));
                out.push(("X-RateLimit-Remaining", number(s.remaining)));
                out.push(("X-RateLimit-Reset", number(s.reset_after_secs())));
            }
        }
    }
    out
}

/// Appends `fields` (as [`headers`] returns them) to an HTTP header map; the strings
/// become the header values without a copy. Values that are not valid header values
/// (none that [`headers`] makes) are skipped.
pub fn append_to(map: &mut http::HeaderMap, fields: Vec<(&'static str, String)>) {
    for (name, value) in fields {
        if let Ok(v) = http::HeaderValue::try_from(value) {
            map.append(header_name(name), v);
        }
    }
}

/// The header name of a field [`headers`] makes (constants: no parsing per request).
fn header_name(name: &'static str) -> http::HeaderName {
    use http::HeaderName;
    const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
    const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
    const LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
    const REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
    const RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
    const ENVOY_LIMIT: HeaderName = HeaderName::from_static("ratelimit-limit");
    const ENVOY_REMAINING: HeaderName = HeaderName::from_static("ratelimit-remaining");
    const ENVOY_RESET: HeaderName = HeaderName::from_static("ratelimit-reset");
    const OTHER: HeaderName = HeaderName::from_static("x-tollgate");
    match name {
        "RateLimit-Policy" => RATELIMIT_POLICY,
        "RateLimit" => RATELIMIT,
        "Retry-After" => http::header::RETRY_AFTER,
        "X-RateLimit-Limit" => LIMIT,
        "X-RateLimit-Remaining" => REMAINING,
        "X-RateLimit-Reset" => RESET,
        "RateLimit-Limit" => ENVOY_LIMIT,
        "RateLimit-Remaining" => ENVOY_REMAINING,
        "RateLimit-Reset" => ENVOY_RESET,
        _ => OTHER,
    }
}

/// An RFC 9457 problem detail naming the violated policies, for OVER_LIMIT answers:
/// `type`, `title`, `status`, `detail` and `violated_policies` (each with `policy`,
/// `limit`, `window_seconds`, `retry_after_seconds`; `null` where unknown).
///
/// Written by hand rather than through `serde_json::Value`: this is on every 429 and
/// the generic map cost more than the rest of the rejection (callgrind).
pub fn problem_body(response: &RateLimitResponse) -> Vec<u8> {
    let violated = || {
        response
            .statuses
            .iter()
            .enumerate()
            .filter(|(_, s)| s.code == Code::OverLimit)
    };
    let mut out = String::with_capacity(256);
    out.push_str(
        "{\"type\":\"https://tollgate.dev/problems/rate-limited\",\
         \"title\":\"Too Many Requests\",\"status\":429,\"detail\":\"rate limit exceeded: ",
    );
    for (n, (i, s)) in violated().enumerate() {
        if n > 0 {
            out.push_str(", ");
        }
        push_json_escaped(&mut out, &policy_name(i, s));
    }
    out.push_str("\",\"violated_policies\":[");
    for (n, (i, s)) in violated().enumerate() {
        if n > 0 {
            out.push(',');
        }
        out.push_str("{\"policy\":\"");
        push_json_escaped(&mut out, &policy_name(i, s));
        out.push_str("\",\"limit\":");
        push_json_number(&mut out, s.limit.as_ref().map(|l| l.requests_per_unit));
        out.push_str(",\"window_seconds\":");
        push_json_number(&mut out, s.limit.as_ref().map(|l| l.unit.seconds()));
        out.push_str(",\"retry_after_seconds\":");
        push_json_number(&mut out, s.retry_after_secs());
        out.push('}');
    }
    out.push_str("]}");
    out.into_bytes()
}

/// The policy name (the limit's `name`, else the rule path, else `limit<i>`) as
/// printable ASCII, for the problem body.
fn policy_name(i: usize, s: &DescriptorStatus) -> Cow<'_, str> {
    let name = s.limit.as_ref().and_then(|l| l.name.as_deref());
    match name.or(s.metric.as_ref().map(|m| &*m.path)) {
        Some(raw) if raw.bytes().all(|b| (b' '..=b'~').contains(&b)) => Cow::Borrowed(raw),
        Some(raw) => Cow::Owned(raw.chars().filter(|c| (' '..='~').contains(c)).collect()),
        None => Cow::Owned(format!("limit{i}")),
    }
}

/// Appends `s` as the inside of a JSON string (RFC 8259 escapes).
fn push_json_escaped(out: &mut String, s: &str) {
    if !s.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\') {
        out.push_str(s);
        return;
    }
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                use std::fmt::Write as _;
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
}

/// Appends a JSON number, or `null`.
fn push_json_number(out: &mut String, n: Option<u64>) {
    match n {
        Some(n) => push_u64(out, n),
        None => out.push_str("null"),
    }
}

/// `n` in decimal, as a header value.
fn number(n: u64) -> String {
    let mut out = String::with_capacity(20);
    push_u64(&mut out, n);
    out
}

/// Appends `n` in decimal (what `Display` writes, without the formatting machinery:
/// the numbers of every header and body go through here).
fn push_u64(out: &mut String, n: u64) {
    out.push_str(itoa::Buffer::new().format(n));
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
            quota: None,
            metadata: None,
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
                legacy: true,
                ..HeaderSettings::default()
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
    fn the_problem_body_is_json_naming_every_violated_policy() {
        let mut unnamed = status(None, Code::OverLimit, 0, 50, 50);
        unnamed.metric = None;
        let r = RateLimitResponse {
            overall: Code::OverLimit,
            store_failure: None,
            statuses: vec![
                status(Some("per_user"), Code::Ok, 4, 30, 0),
                status(Some("a\"b\\c\u{e9}"), Code::OverLimit, 0, 50, 7),
                unnamed,
            ],
        };
        let body: serde_json::Value = serde_json::from_slice(&problem_body(&r)).expect("JSON");
        assert_eq!(
            body,
            serde_json::json!({
                "type": "https://tollgate.dev/problems/rate-limited",
                "title": "Too Many Requests",
                "status": 429,
                "detail": "rate limit exceeded: a\"b\\c, limit2",
                "violated_policies": [
                    {"policy": "a\"b\\c", "limit": 10, "window_seconds": 60, "retry_after_seconds": 7},
                    {"policy": "limit2", "limit": 10, "window_seconds": 60, "retry_after_seconds": 50},
                ],
            })
        );
    }

    proptest::proptest! {
        #[test]
        fn push_u64_writes_what_display_writes(n: u64) {
            let mut out = String::from("x");
            push_u64(&mut out, n);
            proptest::prop_assert_eq!(out, format!("x{n}"));
        }
    }

    #[test]
    fn json_escapes_cover_control_characters() {
        let mut out = String::new();
        push_json_escaped(&mut out, "a\u{1}\n\"\\z");
        let back: String = serde_json::from_str(&format!("\"{out}\"")).expect("JSON string");
        assert_eq!(back, "a\u{1}\n\"\\z");
    }

    #[test]
    fn names_are_escaped_as_structured_field_strings() {
        let r = RateLimitResponse {
            overall: Code::Ok,
            store_failure: None,
            statuses: vec![status(Some("a\"b\\c\u{e9}"), Code::Ok, 1, 1, 0)],
        };
        let h = headers(&r, HeaderSettings::default());
        assert_eq!(h[0].1, "\"a\\\"b\\\\c\";q=10;w=60");
    }

    /// envoyproxy/ratelimit's `LIMIT_RESPONSE_HEADERS_ENABLED` answer: its three headers
    /// only, for the descriptor it picks; nothing else when the rest is off.
    #[test]
    fn envoy_headers_describe_the_descriptor_envoys_service_picks() {
        let envoy_only = HeaderSettings {
            draft: false,
            legacy: false,
            envoy: true,
            retry_after: false,
            problem_body: false,
        };
        let fields = |statuses: Vec<DescriptorStatus>| {
            let overall = if statuses.iter().any(|s| s.code == Code::OverLimit) {
                Code::OverLimit
            } else {
                Code::Ok
            };
            let r = RateLimitResponse {
                overall,
                store_failure: None,
                statuses,
            };
            headers(&r, envoy_only)
        };
        let triple = |limit: &str, remaining: &str, reset: &str| {
            vec![
                ("RateLimit-Limit", limit.to_string()),
                ("RateLimit-Remaining", remaining.to_string()),
                ("RateLimit-Reset", reset.to_string()),
            ]
        };
        // The first of the least remaining.
        let mut other = status(None, Code::Ok, 2, 7, 0);
        other.limit.as_mut().unwrap().requests_per_unit = 20;
        assert_eq!(
            fields(vec![
                status(None, Code::Ok, 5, 30, 0),
                other.clone(),
                status(None, Code::Ok, 2, 9, 0),
            ]),
            triple("20", "2", "7")
        );
        // An over descriptor wins, the last one; one in quota mode does not.
        let mut quota = status(None, Code::OverLimit, 0, 11, 11);
        quota.quota = Some(0);
        assert_eq!(
            fields(vec![
                status(None, Code::OverLimit, 3, 40, 40),
                status(None, Code::OverLimit, 1, 50, 50),
                quota.clone(),
            ]),
            triple("10", "1", "50")
        );
        assert_eq!(
            fields(vec![status(None, Code::Ok, 4, 20, 0), quota]),
            triple("10", "0", "11")
        );
        // No descriptor with a limit: no headers.
        let mut none = status(None, Code::Ok, 0, 0, 0);
        none.limit = None;
        assert_eq!(fields(vec![none]), vec![]);
    }

    #[test]
    fn retry_after_can_be_left_out() {
        let r = RateLimitResponse {
            overall: Code::OverLimit,
            store_failure: None,
            statuses: vec![status(None, Code::OverLimit, 0, 50, 50)],
        };
        let with = headers(&r, HeaderSettings::default());
        assert!(with.iter().any(|(n, v)| *n == "Retry-After" && v == "50"));
        let without = headers(
            &r,
            HeaderSettings {
                retry_after: false,
                ..HeaderSettings::default()
            },
        );
        assert!(without.iter().all(|(n, _)| *n != "Retry-After"));
        assert_eq!(without.len(), 2, "the draft headers stay: {without:?}");
    }
}
