//! Rate limit response headers and the problem body, from a [`RateLimitResponse`]: the
//! IETF draft fields (draft-ietf-httpapi-ratelimit-headers-10) `RateLimit-Policy` and
//! `RateLimit`, one list item per policy (see below); `Retry-After` on OVER_LIMIT;
//! optionally the legacy `X-RateLimit-Limit/Remaining/Reset`, and envoyproxy/ratelimit's
//! `RateLimit-Limit/Remaining/Reset` (its `LIMIT_RESPONSE_HEADERS_ENABLED`); and
//! `Tollgate-Overdraft` when a bucket admitted the request into debt (its `overdraft`),
//! and `Tollgate-Overage` when a limit admitted it past its `requests_per_unit` (soft
//! throttling's `overage_percent`, or borrowed from a pool): each a structured-field list
//! of the policies that did, named as in `RateLimit-Policy`.
//!
//! A policy is a distinct (name, quota, window): the limited descriptors that share
//! all three (one rule's limit, for several values of its key, say) make one item, and
//! its `RateLimit` item reports the least `remaining` and the longest reset among them:
//! what the next request of the same shape can count on, and how long it may wait for
//! all of them to be full again. The problem body lists each violated policy once too.
//! Neither grows without bound: each draft field is at most [`MAX_FIELD_BYTES`] and the
//! problem body's policies at most [`MAX_PROBLEM_POLICY_BYTES`]; past that, the most
//! restrictive items that fit are kept (over the limit first, then the least remaining,
//! then the longest reset; in the body, the longest wait first), in their order.
//!
//! gRPC, the HTTP API and the gateway (`RateLimitLayer`, `tollgate proxy`) all use this one
//! module. It needs no HTTP stack; `append_to` (feature `tower`) puts the fields in an
//! `http::HeaderMap`.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;

use crate::limiter::{Code, DescriptorStatus, RateLimitResponse};

/// Most bytes in the value of `RateLimit-Policy`, and in that of `RateLimit` (4 KiB).
///
/// About a hundred items of a typical size, far more than distinct policies a request
/// has; the two fields together stay well within the smallest limits on a whole
/// response head that clients and proxies commonly apply (16 KiB in Node.js, 60 KiB in
/// Envoy), and far under curl's (100 KiB) and Python's (64 KiB) limit on one line.
pub const MAX_FIELD_BYTES: usize = 4096;

/// Most bytes of the violated policies in the problem body (4 KiB): the names in its
/// `detail`, and the items of `violated_policies`, each counted. The body is then at
/// most about 8.5 KiB.
pub const MAX_PROBLEM_POLICY_BYTES: usize = 4096;

/// Past this many policies, [`Policies`] finds one through a map rather than a scan.
const SCAN: usize = 8;

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

/// One item of the draft fields: a distinct (name, quota, window) and the state of its
/// descriptors.
struct Policy {
    /// Its `RateLimit-Policy` item (`"name";q=Q;w=W`), in [`Policies::text`].
    at: Range<usize>,
    /// The length of its name (the quoted string the item starts with).
    name_len: usize,
    /// The least `remaining` of its descriptors.
    remaining: u64,
    /// The longest reset of its descriptors, in seconds.
    reset: u64,
    /// One of its descriptors is over its limit.
    over: bool,
}

/// The policies of a response, in the order of their first descriptor; linear in the
/// descriptors (a scan while there are few, a map after).
struct Policies {
    /// The `RateLimit-Policy` items, joined by `", "`: the field's value.
    text: String,
    items: Vec<Policy>,
    /// Item text → index, once there are more than [`SCAN`] items.
    index: Option<HashMap<String, usize>>,
}

impl Policies {
    fn of(response: &RateLimitResponse) -> Self {
        let mut p = Policies {
            text: String::with_capacity(64),
            items: Vec::new(),
            index: None,
        };
        let mut item = String::with_capacity(64);
        for (i, s) in limited(response) {
            let Some(l) = &s.limit else { continue };
            item.clear();
            push_policy_name(&mut item, i, s);
            let name_len = item.len();
            item.push_str(";q=");
            push_u64(&mut item, l.requests_per_unit);
            item.push_str(";w=");
            push_u64(&mut item, l.unit.seconds());
            let (remaining, reset, over) =
                (s.remaining, s.reset_after_secs(), s.code == Code::OverLimit);
            let found = match &p.index {
                Some(map) => map.get(item.as_str()).copied(),
                None => p.items.iter().position(|it| p.text[it.at.clone()] == *item),
            };
            if let Some(k) = found {
                let it = &mut p.items[k];
                it.remaining = it.remaining.min(remaining);
                it.reset = it.reset.max(reset);
                it.over |= over;
                continue;
            }
            if !p.text.is_empty() {
                p.text.push_str(", ");
            }
            let start = p.text.len();
            p.text.push_str(&item);
            p.items.push(Policy {
                at: start..p.text.len(),
                name_len,
                remaining,
                reset,
                over,
            });
            match &mut p.index {
                Some(map) => {
                    map.insert(item.clone(), p.items.len() - 1);
                }
                None if p.items.len() > SCAN => {
                    let text = &p.text;
                    p.index = Some(
                        p.items
                            .iter()
                            .enumerate()
                            .map(|(k, it)| (text[it.at.clone()].to_string(), k))
                            .collect(),
                    );
                }
                None => {}
            }
        }
        p
    }

    /// Writes item `it`'s `RateLimit` item: `"name";r=R;t=T`.
    fn push_state(&self, out: &mut String, it: &Policy) {
        out.push_str(&self.text[it.at.start..it.at.start + it.name_len]);
        out.push_str(";r=");
        push_u64(out, it.remaining);
        out.push_str(";t=");
        push_u64(out, it.reset);
    }

    /// The two draft fields' values, each at most [`MAX_FIELD_BYTES`] (none when there
    /// is no item, or none fits).
    fn fields(self) -> Option<(String, String)> {
        if self.items.is_empty() {
            return None;
        }
        let mut states = String::with_capacity(self.text.len());
        for it in &self.items {
            if !states.is_empty() {
                states.push_str(", ");
            }
            self.push_state(&mut states, it);
        }
        if self.text.len() <= MAX_FIELD_BYTES && states.len() <= MAX_FIELD_BYTES {
            return Some((self.text, states));
        }
        // Too long: the most restrictive items that fit, kept in their order.
        let state_items: Vec<String> = self
            .items
            .iter()
            .map(|it| {
                let mut out = String::new();
                self.push_state(&mut out, it);
                out
            })
            .collect();
        let mut order: Vec<usize> = (0..self.items.len()).collect();
        order.sort_by_key(|&k| {
            let it = &self.items[k];
            (!it.over, it.remaining, std::cmp::Reverse(it.reset))
        });
        let mut keep = vec![false; self.items.len()];
        let (mut policy_len, mut state_len) = (0, 0);
        for k in order {
            let sep = if policy_len == 0 { 0 } else { 2 };
            let (p, s) = (self.items[k].at.len() + sep, state_items[k].len() + sep);
            if policy_len + p <= MAX_FIELD_BYTES && state_len + s <= MAX_FIELD_BYTES {
                keep[k] = true;
                policy_len += p;
                state_len += s;
            }
        }
        let (mut policies, mut states) = (String::new(), String::new());
        for (k, it) in self.items.iter().enumerate().filter(|(k, _)| keep[*k]) {
            if !policies.is_empty() {
                policies.push_str(", ");
                states.push_str(", ");
            }
            policies.push_str(&self.text[it.at.clone()]);
            states.push_str(&state_items[k]);
        }
        let kept = keep.iter().filter(|k| **k).count();
        tracing::debug!(
            kept,
            left_out = self.items.len() - kept,
            max = MAX_FIELD_BYTES,
            "the RateLimit-Policy and RateLimit fields keep the most restrictive policies that fit"
        );
        (!policies.is_empty()).then_some((policies, states))
    }
}

/// The response headers for `response`, as (name, value) pairs.
pub fn headers(
    response: &RateLimitResponse,
    settings: HeaderSettings,
) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    if settings.draft {
        if let Some((policies, states)) = Policies::of(response).fields() {
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
    if let Some(names) = flagged_field(response, |s| s.overdraft) {
        out.push(("Tollgate-Overdraft", names));
    }
    if let Some(names) = flagged_field(response, |s| s.over_soft_limit) {
        out.push(("Tollgate-Overage", names));
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

/// The value of `Tollgate-Overdraft` or `Tollgate-Overage`: the names of the policies
/// whose statuses are `flagged` (admitted into debt, or past their limit), each once, as
/// a structured-field list of strings, at most [`MAX_FIELD_BYTES`] (the first that fit);
/// `None` when no descriptor is.
fn flagged_field(
    response: &RateLimitResponse,
    flagged: impl Fn(&DescriptorStatus) -> bool,
) -> Option<String> {
    let mut out = String::new();
    let mut name = String::new();
    for (i, s) in limited(response).filter(|(_, s)| flagged(s)) {
        name.clear();
        push_policy_name(&mut name, i, s);
        let seen = out.split(", ").any(|n| n == name);
        if seen || out.len() + 2 + name.len() > MAX_FIELD_BYTES {
            continue;
        }
        if !out.is_empty() {
            out.push_str(", ");
        }
        out.push_str(&name);
    }
    (!out.is_empty()).then_some(out)
}

/// Appends `fields` (as [`headers`] returns them) to an HTTP header map; the strings
/// become the header values without a copy. Values that are not valid header values
/// (none that [`headers`] makes) are skipped.
#[cfg(feature = "tower")]
pub fn append_to(map: &mut http::HeaderMap, fields: Vec<(&'static str, String)>) {
    for (name, value) in fields {
        if let Ok(v) = http::HeaderValue::try_from(value) {
            map.append(header_name(name), v);
        }
    }
}

/// The header name of a field [`headers`] makes (constants: no parsing per request).
#[cfg(feature = "tower")]
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
    const OVERDRAFT: HeaderName = HeaderName::from_static("tollgate-overdraft");
    const OVERAGE: HeaderName = HeaderName::from_static("tollgate-overage");
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
        "Tollgate-Overdraft" => OVERDRAFT,
        "Tollgate-Overage" => OVERAGE,
        _ => OTHER,
    }
}

/// What makes a violated policy: its name, limit and window.
type ViolatedKey<'r> = (Cow<'r, str>, Option<u64>, Option<u64>);

/// A violated policy of the problem body: a distinct (name, limit, window).
struct Violated<'r> {
    name: Cow<'r, str>,
    limit: Option<u64>,
    window: Option<u64>,
    /// The longest wait of its descriptors; `None`: never.
    retry: Option<u64>,
}

/// An RFC 9457 problem detail naming the violated policies, for OVER_LIMIT answers:
/// `type`, `title`, `status`, `detail` and `violated_policies` (each with `policy`,
/// `limit`, `window_seconds`, `retry_after_seconds`; `null` where unknown or never).
/// Each policy (name, limit, window) is listed once, with the longest wait among its
/// descriptors; past [`MAX_PROBLEM_POLICY_BYTES`], the policies with the longest waits
/// that fit are kept, and `omitted_policies` says how many were left out.
///
/// Written by hand rather than through `serde_json::Value`: this is on every 429 and
/// the generic map cost more than the rest of the rejection (callgrind).
pub fn problem_body(response: &RateLimitResponse) -> Vec<u8> {
    let mut violated: Vec<Violated<'_>> = Vec::new();
    let mut index: HashMap<ViolatedKey<'_>, usize> = HashMap::new();
    for (i, s) in response
        .statuses
        .iter()
        .enumerate()
        .filter(|(_, s)| s.code == Code::OverLimit)
    {
        let name = policy_name(i, s);
        let limit = s.limit.as_ref().map(|l| l.requests_per_unit);
        let window = s.limit.as_ref().map(|l| l.unit.seconds());
        let retry = s.retry_after_secs();
        // A scan while there are few (no map), a map after: linear in the descriptors.
        let found = if violated.len() <= SCAN {
            violated
                .iter()
                .position(|v| v.limit == limit && v.window == window && v.name == name)
        } else {
            if index.is_empty() {
                index = violated
                    .iter()
                    .enumerate()
                    .map(|(k, v)| ((v.name.clone(), v.limit, v.window), k))
                    .collect();
            }
            index.get(&(name.clone(), limit, window)).copied()
        };
        match found {
            Some(k) => {
                let v = &mut violated[k];
                v.retry = v.retry.zip(retry).map(|(a, b)| a.max(b));
            }
            None => {
                if violated.len() > SCAN {
                    index.insert((name.clone(), limit, window), violated.len());
                }
                violated.push(Violated {
                    name,
                    limit,
                    window,
                    retry,
                });
            }
        }
    }
    // Each policy's share of the budget: its name in `detail`, and its item.
    let items: Vec<(String, String)> = violated
        .iter()
        .map(|v| {
            let mut name = String::new();
            push_json_escaped(&mut name, &v.name);
            let mut item = String::with_capacity(name.len() + 80);
            item.push_str("{\"policy\":\"");
            item.push_str(&name);
            item.push_str("\",\"limit\":");
            push_json_number(&mut item, v.limit);
            item.push_str(",\"window_seconds\":");
            push_json_number(&mut item, v.window);
            item.push_str(",\"retry_after_seconds\":");
            push_json_number(&mut item, v.retry);
            item.push('}');
            (name, item)
        })
        .collect();
    let cost = |k: usize| items[k].0.len() + items[k].1.len() + 3;
    let mut keep = vec![true; items.len()];
    if (0..items.len()).map(cost).sum::<usize>() > MAX_PROBLEM_POLICY_BYTES {
        // The longest waits first (never before any number).
        let mut order: Vec<usize> = (0..items.len()).collect();
        order.sort_by_key(|&k| std::cmp::Reverse(violated[k].retry.unwrap_or(u64::MAX)));
        let mut used = 0;
        for k in order {
            keep[k] = used + cost(k) <= MAX_PROBLEM_POLICY_BYTES;
            if keep[k] {
                used += cost(k);
            }
        }
    }
    let kept = || items.iter().zip(&keep).filter(|(_, k)| **k).map(|(i, _)| i);
    let omitted = keep.iter().filter(|k| !**k).count();
    let mut out = String::with_capacity(256);
    out.push_str(
        "{\"type\":\"https://tollgate.dev/problems/rate-limited\",\
         \"title\":\"Too Many Requests\",\"status\":429,\"detail\":\"rate limit exceeded: ",
    );
    for (n, (name, _)) in kept().enumerate() {
        if n > 0 {
            out.push_str(", ");
        }
        out.push_str(name);
    }
    out.push_str("\",\"violated_policies\":[");
    for (n, (_, item)) in kept().enumerate() {
        if n > 0 {
            out.push(',');
        }
        out.push_str(item);
    }
    out.push(']');
    if omitted > 0 {
        out.push_str(",\"omitted_policies\":");
        push_u64(&mut out, omitted as u64);
    }
    out.push('}');
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
            overdraft: false,
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
    fn an_overdraft_names_its_policies_once() {
        let mut a = status(Some("per_user"), Code::Ok, 0, 30, 0);
        a.overdraft = true;
        let mut b = status(Some("per\"ip"), Code::Ok, 0, 30, 0);
        b.overdraft = true;
        let r = RateLimitResponse {
            overall: Code::Ok,
            store_failure: None,
            statuses: vec![a.clone(), status(Some("calm"), Code::Ok, 3, 30, 0), b, a],
        };
        let h = headers(&r, HeaderSettings::default());
        assert_eq!(
            h.last(),
            Some(&(
                "Tollgate-Overdraft",
                "\"per_user\", \"per\\\"ip\"".to_string()
            ))
        );
        let calm = RateLimitResponse {
            overall: Code::Ok,
            store_failure: None,
            statuses: vec![status(Some("calm"), Code::Ok, 3, 30, 0)],
        };
        let h = headers(&calm, HeaderSettings::default());
        assert!(h.iter().all(|(n, _)| *n != "Tollgate-Overdraft"));
    }

    #[test]
    fn an_overage_names_its_policies_apart_from_overdrafts() {
        let mut borrowed = status(Some("per_tenant"), Code::Ok, 0, 30, 0);
        borrowed.over_soft_limit = true;
        let mut debt = status(Some("per_ip"), Code::Ok, 0, 30, 0);
        debt.overdraft = true;
        let r = RateLimitResponse {
            overall: Code::Ok,
            store_failure: None,
            statuses: vec![borrowed, debt],
        };
        let h = headers(&r, HeaderSettings::default());
        let field = |name: &str| h.iter().find(|(n, _)| *n == name).map(|(_, v)| v.clone());
        assert_eq!(field("Tollgate-Overage").as_deref(), Some("\"per_tenant\""));
        assert_eq!(field("Tollgate-Overdraft").as_deref(), Some("\"per_ip\""));
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

    /// Descriptors of one limit (one rule, many values of its key) make one policy,
    /// reporting the least remaining and the longest reset; the problem body lists it
    /// once, with the longest wait.
    #[test]
    fn descriptors_of_one_limit_make_one_policy() {
        let mut statuses: Vec<DescriptorStatus> = (0..1_000u64)
            .map(|i| status(Some("per_user"), Code::Ok, 5 + i % 7, 10 + i % 13, 0))
            .collect();
        statuses[500] = status(Some("per_user"), Code::OverLimit, 0, 40, 33);
        statuses[600] = status(Some("per_user"), Code::OverLimit, 0, 20, 44);
        // Another quota under the same name is another policy.
        let mut other = status(Some("per_user"), Code::Ok, 3, 5, 0);
        other.limit.as_mut().unwrap().requests_per_unit = 99;
        statuses.push(other);
        let r = RateLimitResponse {
            overall: Code::OverLimit,
            store_failure: None,
            statuses,
        };
        let h = headers(&r, HeaderSettings::default());
        assert_eq!(
            h[..2],
            [
                (
                    "RateLimit-Policy",
                    "\"per_user\";q=10;w=60, \"per_user\";q=99;w=60".to_string()
                ),
                (
                    "RateLimit",
                    "\"per_user\";r=0;t=40, \"per_user\";r=3;t=5".to_string()
                ),
            ]
        );
        let body: serde_json::Value = serde_json::from_slice(&problem_body(&r)).expect("JSON");
        assert_eq!(
            body["violated_policies"],
            serde_json::json!([
                {"policy": "per_user", "limit": 10, "window_seconds": 60, "retry_after_seconds": 44},
            ])
        );
        assert_eq!(body["detail"], "rate limit exceeded: per_user");
    }

    /// Past [`SCAN`] policies, the map finds them: 100 policies of 50 descriptors each,
    /// interleaved, still make 100 items, in the order of their first descriptor.
    #[test]
    fn many_policies_are_each_found_again() {
        let statuses: Vec<DescriptorStatus> = (0..5_000u64)
            .map(|i| status(Some(&format!("p{}", i % 100)), Code::Ok, i / 100, 1, 0))
            .collect();
        let r = RateLimitResponse {
            overall: Code::Ok,
            store_failure: None,
            statuses,
        };
        let h = headers(&r, HeaderSettings::default());
        let items: Vec<&str> = h[1].1.split(", ").collect();
        assert_eq!(items.len(), 100);
        assert_eq!(items[0], "\"p0\";r=0;t=1");
        assert_eq!(items[99], "\"p99\";r=0;t=1");
    }

    /// However many distinct policies, each draft field stays within
    /// [`MAX_FIELD_BYTES`], keeping the most restrictive (over the limit, then least
    /// remaining) in their order; the problem body keeps the longest waits within its
    /// budget and says how many it left out.
    #[test]
    fn headers_and_body_stay_bounded() {
        let n = 100_000u64;
        let statuses: Vec<DescriptorStatus> = (0..n)
            .map(|i| {
                let name = format!("policy-{i:06}");
                match i {
                    77_777 => status(Some(&name), Code::OverLimit, 0, 9, 9),
                    88_888 => status(Some(&name), Code::OverLimit, 0, 900, 900),
                    _ => status(Some(&name), Code::Ok, 1 + i % 1_000, 60, 0),
                }
            })
            .collect();
        let r = RateLimitResponse {
            overall: Code::OverLimit,
            store_failure: None,
            statuses,
        };
        let h = headers(&r, HeaderSettings::default());
        let (policy, state) = (&h[0].1, &h[1].1);
        assert!(policy.len() <= MAX_FIELD_BYTES && state.len() <= MAX_FIELD_BYTES);
        assert!(
            policy.len() > MAX_FIELD_BYTES - 40,
            "room left: {}",
            policy.len()
        );
        let items: Vec<&str> = state.split(", ").collect();
        // The two over the limit, then those with 1 remaining, in descriptor order.
        assert_eq!(items[0], "\"policy-000000\";r=1;t=60");
        assert!(items.contains(&"\"policy-077777\";r=0;t=9"));
        assert!(items.contains(&"\"policy-088888\";r=0;t=900"));
        // Every one with 1 left (100 of them) is kept, then some of those with 2.
        assert_eq!(items.iter().filter(|i| i.contains(";r=1;")).count(), 100);
        assert!(items
            .iter()
            .all(|i| [";r=0;", ";r=1;", ";r=2;"].iter().any(|r| i.contains(r))));
        let policies: Vec<&str> = policy.split(", ").collect();
        assert_eq!(policies.len(), items.len());
        assert_eq!(policies[0], "\"policy-000000\";q=10;w=60");

        let violated: Vec<DescriptorStatus> = (0..n)
            .map(|i| {
                status(
                    Some(&format!("policy-{i:06}")),
                    Code::OverLimit,
                    0,
                    1,
                    1 + i % 500,
                )
            })
            .collect();
        let r = RateLimitResponse {
            overall: Code::OverLimit,
            store_failure: None,
            statuses: violated,
        };
        let bytes = problem_body(&r);
        assert!(
            bytes.len() < 2 * MAX_PROBLEM_POLICY_BYTES,
            "{} bytes",
            bytes.len()
        );
        let body: serde_json::Value = serde_json::from_slice(&bytes).expect("JSON");
        let kept = body["violated_policies"].as_array().expect("a list");
        assert!(!kept.is_empty());
        assert!(kept.iter().all(|p| p["retry_after_seconds"] == 500));
        assert_eq!(body["omitted_policies"], n - kept.len() as u64);
    }

    /// A single name too long for the field leaves the draft fields out, not cut.
    #[test]
    fn an_item_too_long_for_a_field_is_left_out() {
        let r = RateLimitResponse {
            overall: Code::Ok,
            store_failure: None,
            statuses: vec![
                status(Some(&"x".repeat(MAX_FIELD_BYTES)), Code::Ok, 0, 1, 0),
                status(Some("short"), Code::Ok, 5, 1, 0),
            ],
        };
        let h = headers(&r, HeaderSettings::default());
        assert_eq!(
            h[0],
            ("RateLimit-Policy", "\"short\";q=10;w=60".to_string())
        );
        let alone = RateLimitResponse {
            statuses: vec![r.statuses[0].clone()],
            ..r
        };
        assert_eq!(headers(&alone, HeaderSettings::default()), vec![]);
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
