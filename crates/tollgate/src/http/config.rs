//! The `http` section of a rule file: how the gateway turns an HTTP request into
//! descriptors. `tollgate serve` ignores it; [`RateLimitLayer`](super::RateLimitLayer)
//! and `tollgate proxy` read it from the same files as the rules.
//!
//! ```yaml
//! domain: edge
//! descriptors:
//!   - key: remote_address
//!     rate_limit: {unit: minute, requests_per_unit: 60}
//! http:
//!   trusted_proxies: [10.0.0.0/8]        # whose X-Forwarded-For / Forwarded we believe
//!   deny:  {cidrs: [192.0.2.0/24], values: {api_key: [revoked-key]}}   # 403
//!   allow: {cidrs: [10.1.0.0/16]}                                      # never limited
//!   routes:                              # the first matching route applies
//!     - match: {path_prefix: /api/, methods: [GET, POST]}
//!       rate_limits:                     # one descriptor per item
//!         - actions: [{remote_address: {}}]
//!       max_in_flight:                   # concurrency limits, one descriptor per item
//!         - actions: [{request_headers: {header_name: x-api-key, descriptor_key: api_key}}]
//!           limit: 4
//!       fallback: {status: 200, content_type: application/json, body: '{"items":[]}'}
//! ```
//!
//! Actions follow Envoy's vocabulary: `remote_address`, `request_headers`
//! (`header_name`, `descriptor_key`, `skip_if_absent`), `generic_key`
//! (`descriptor_value`, `descriptor_key`), `header_value_match` (`descriptor_value`,
//! `descriptor_key`, `expect_match`, `headers: [{name, exact_match | prefix_match |
//! present_match}]`), plus Tollgate's `path`, `method` and `query_parameter`
//! (`query_parameter_name`, `descriptor_key`, `skip_if_absent`). As in Envoy, a descriptor
//! one of whose actions produces nothing is not sent.

use std::collections::BTreeMap;
use std::path::Path;

use ipnet::IpNet;
use serde::Deserialize;

use crate::rules::{ConfigError, ConfigErrors};

/// The gateway settings of one rule file (one domain).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HttpRules {
    /// The rule domain the descriptors are checked against.
    pub domain: String,
    /// Peers whose `X-Forwarded-For` / `Forwarded` headers are believed.
    pub trusted_proxies: Vec<IpNet>,
    /// Requests from these addresses or with these descriptor values get 403.
    pub deny: AccessList,
    /// Requests from these addresses or with these descriptor values are never limited.
    pub allow: AccessList,
    /// Routes, tried in order; the first match applies. No match: not limited.
    pub routes: Vec<Route>,
}

/// Addresses and descriptor values.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessList {
    /// Client address ranges.
    #[serde(default)]
    pub cidrs: Vec<IpNet>,
    /// Descriptor key → values (compared with the entries the route's actions build).
    #[serde(default)]
    pub values: BTreeMap<String, Vec<String>>,
}

impl AccessList {
    /// True when nothing is listed.
    pub fn is_empty(&self) -> bool {
        self.cidrs.is_empty() && self.values.is_empty()
    }
}

/// One route.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// Which requests it applies to.
    #[serde(rename = "match", default)]
    pub matcher: RouteMatch,
    /// One descriptor per item, all checked in one all-or-nothing request.
    #[serde(default)]
    pub rate_limits: Vec<RateLimitActions>,
    /// Concurrency limits: one descriptor per item, at most `limit` in flight each.
    #[serde(default)]
    pub max_in_flight: Vec<InFlightLimit>,
    /// Sent instead of a 429 when the route's limits reject (degrade, don't fail).
    #[serde(default)]
    pub fallback: Option<Fallback>,
}

/// Path prefix and methods; both optional.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteMatch {
    /// The path starts with this (default `/`).
    #[serde(default)]
    pub path_prefix: Option<String>,
    /// Upper-case method names; empty: every method.
    #[serde(default)]
    pub methods: Vec<String>,
}

/// The actions that build one descriptor.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitActions {
    /// Each action adds one (key, value) entry, in order.
    #[serde(with = "serde_norway::with::singleton_map_recursive")]
    pub actions: Vec<Action>,
}

/// A concurrency limit on the descriptor its actions build.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InFlightLimit {
    /// Each action adds one (key, value) entry, in order.
    #[serde(with = "serde_norway::with::singleton_map_recursive")]
    pub actions: Vec<Action>,
    /// Requests in flight at once per descriptor value.
    pub limit: u64,
}

/// A configured answer for rejected requests.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fallback {
    /// Status code (default 200).
    #[serde(default = "ok_status")]
    pub status: u16,
    /// `Content-Type` (default `text/plain; charset=utf-8`).
    #[serde(default)]
    pub content_type: Option<String>,
    /// The body.
    #[serde(default)]
    pub body: String,
}

fn ok_status() -> u16 {
    200
}

/// One descriptor entry's source, in Envoy's vocabulary.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Action {
    /// `("remote_address", client IP)`.
    RemoteAddress {},
    /// `(descriptor_key, header value)`; absent header: no descriptor unless skipped.
    RequestHeaders {
        /// The header.
        header_name: String,
        /// The entry's key.
        descriptor_key: String,
        /// Leave the entry out (instead of the whole descriptor) when absent.
        #[serde(default)]
        skip_if_absent: bool,
    },
    /// A fixed entry: `(descriptor_key or "generic_key", descriptor_value)`.
    GenericKey {
        /// The value.
        descriptor_value: String,
        /// The key (default `generic_key`).
        #[serde(default)]
        descriptor_key: Option<String>,
    },
    /// `(descriptor_key or "header_match", descriptor_value)` when the headers match
    /// (or, with `expect_match: false`, when they do not).
    HeaderValueMatch {
        /// The value.
        descriptor_value: String,
        /// The key (default `header_match`).
        #[serde(default)]
        descriptor_key: Option<String>,
        /// Whether the headers must match (default true).
        #[serde(default = "yes")]
        expect_match: bool,
        /// Every matcher must hold.
        headers: Vec<HeaderMatcher>,
    },
    /// `("path", request path)`.
    Path {},
    /// `("method", request method)`.
    Method {},
    /// `(descriptor_key, query parameter value)`.
    QueryParameter {
        /// The parameter.
        query_parameter_name: String,
        /// The entry's key.
        descriptor_key: String,
        /// Leave the entry out when absent.
        #[serde(default)]
        skip_if_absent: bool,
    },
}

fn yes() -> bool {
    true
}

/// A condition on one header.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderMatcher {
    /// The header.
    pub name: String,
    /// The value equals this.
    #[serde(default)]
    pub exact_match: Option<String>,
    /// The value starts with this.
    #[serde(default)]
    pub prefix_match: Option<String>,
    /// The header is present (true) or absent (false).
    #[serde(default)]
    pub present_match: Option<bool>,
}

/// The part of a rule file this module reads.
#[derive(Deserialize)]
struct File {
    #[serde(default)]
    domain: String,
    #[serde(default)]
    http: Option<Section>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Section {
    #[serde(default)]
    trusted_proxies: Vec<IpNet>,
    #[serde(default)]
    deny: AccessList,
    #[serde(default)]
    allow: AccessList,
    #[serde(default)]
    routes: Vec<Route>,
}

/// Reads the `http` sections of the rule files `paths` names (files, or directories
/// of `*.yaml` / `*.yml`, as [`rules::load`](crate::rules::load) reads them). Files
/// without one are skipped. Every problem names its file, line and column.
pub fn load(paths: &[impl AsRef<Path>]) -> Result<Vec<HttpRules>, ConfigErrors> {
    let mut errors = Vec::new();
    let files = crate::rules::rule_files(paths, &mut errors);
    let mut out = Vec::new();
    for file in files {
        let name = file.display().to_string();
        match std::fs::read_to_string(&file) {
            Ok(text) => match from_str(&name, &text) {
                Ok(Some(rules)) => out.push(rules),
                Ok(None) => {}
                Err(e) => errors.push(e),
            },
            Err(e) => errors.push(ConfigError {
                file: name,
                line: 0,
                column: 0,
                message: format!("cannot read the file: {e}"),
            }),
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(ConfigErrors(errors))
    }
}

/// Reads the `http` section of one rule file's text (`None` when it has none). A text
/// that is not YAML a rule file may use fails with the error that
/// [`rules::load`](crate::rules::load) reports for it, word for word.
pub fn from_str(file: &str, text: &str) -> Result<Option<HttpRules>, ConfigError> {
    // Word for word, so that a caller reading both (`tollgate validate`) can tell it is
    // one problem, not two.
    if let Some(e) = crate::rules::yaml_error(file, text) {
        return Err(e);
    }
    let parsed: File = serde_norway::from_str(crate::rules::without_bom(text)).map_err(|e| {
        let (line, column) = e.location().map_or((0, 0), |l| (l.line(), l.column()));
        ConfigError {
            file: file.to_string(),
            line,
            column,
            message: format!("in the `http` section: {e}"),
        }
    })?;
    let Some(section) = parsed.http else {
        return Ok(None);
    };
    let place = |message: String| ConfigError {
        file: file.to_string(),
        line: 0,
        column: 0,
        message,
    };
    let mut routes = section.routes;
    // A route's rate limits are one request to the limiter: within its default caps.
    let caps = crate::limiter::RequestLimits::default();
    for (i, route) in routes.iter_mut().enumerate() {
        for m in &mut route.matcher.methods {
            *m = m.to_ascii_uppercase();
        }
        if route.rate_limits.len() > caps.max_descriptors {
            return Err(place(format!(
                "http.routes[{i}]: at most {} `rate_limits` (the descriptors of one request)",
                caps.max_descriptors
            )));
        }
        if let Some(k) = route
            .rate_limits
            .iter()
            .position(|r| r.actions.len() > caps.max_entries)
        {
            return Err(place(format!(
                "http.routes[{i}].rate_limits[{k}]: at most {} `actions` (the entries of one \
                 descriptor)",
                caps.max_entries
            )));
        }
        let actions = route
            .rate_limits
            .iter()
            .map(|r| &r.actions)
            .chain(route.max_in_flight.iter().map(|m| &m.actions));
        for list in actions {
            if list.is_empty() {
                return Err(place(format!("http.routes[{i}]: `actions` is empty")));
            }
            for a in list {
                validate(a).map_err(|m| place(format!("http.routes[{i}]: {m}")))?;
            }
        }
        if let Some(f) = &route.fallback {
            if http::StatusCode::from_u16(f.status).is_err() {
                return Err(place(format!(
                    "http.routes[{i}].fallback: {} is not an HTTP status",
                    f.status
                )));
            }
        }
    }
    Ok(Some(HttpRules {
        domain: parsed.domain,
        trusted_proxies: section.trusted_proxies,
        deny: section.deny,
        allow: section.allow,
        routes,
    }))
}

fn validate(action: &Action) -> Result<(), String> {
    let header = |name: &str| {
        http::HeaderName::from_bytes(name.as_bytes())
            .map(|_| ())
            .map_err(|_| format!("`{name}` is not a valid header name"))
    };
    let key = |k: &str| {
        if k.is_empty() {
            Err("`descriptor_key` is empty".to_string())
        } else {
            Ok(())
        }
    };
    match action {
        Action::RequestHeaders {
            header_name,
            descriptor_key,
            ..
        } => {
            header(header_name)?;
            key(descriptor_key)
        }
        Action::HeaderValueMatch { headers, .. } => {
            for h in headers {
                header(&h.name)?;
            }
            Ok(())
        }
        Action::QueryParameter { descriptor_key, .. } => key(descriptor_key),
        Action::GenericKey { descriptor_key, .. } => key(descriptor_key.as_deref().unwrap_or("g")),
        Action::RemoteAddress {} | Action::Path {} | Action::Method {} => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_issue_example_reads_and_a_file_without_http_has_none() {
        let text = "domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 60}
http:
  trusted_proxies: [10.0.0.0/8]
  routes:
    - match: {path_prefix: /api/, methods: [get, POST]}
      rate_limits:
        - actions: [{remote_address: {}}]
        - actions: [{request_headers: {header_name: x-api-key, descriptor_key: api_key}}]
";
        let r = from_str("edge.yaml", text).unwrap().unwrap();
        assert_eq!(r.domain, "edge");
        assert_eq!(r.trusted_proxies, ["10.0.0.0/8".parse::<IpNet>().unwrap()]);
        assert_eq!(r.routes[0].matcher.methods, ["GET", "POST"]);
        assert_eq!(r.routes[0].rate_limits[1].actions.len(), 1);
        assert!(from_str("x.yaml", "domain: x\n").unwrap().is_none());
    }

    #[test]
    fn a_mistake_names_the_file_line_and_problem() {
        let text = "domain: edge
http:
  routes:
    - match: {path_prefix: /api/}
      rate_limits:
        - actions: [{remote_adress: {}}]
";
        let e = from_str("edge.yaml", text).unwrap_err();
        assert_eq!((e.file.as_str(), e.line), ("edge.yaml", 6));
        assert!(e.message.contains("remote_adress"), "{e}");
        let bad_cidr = "domain: e\nhttp:\n  trusted_proxies: [10.0.0.0/33]\n";
        let e = from_str("e.yaml", bad_cidr).unwrap_err();
        assert_eq!(e.line, 3, "{e}");
        let bad_header = "domain: e\nhttp:\n  routes:\n    - rate_limits:\n        - actions: [{request_headers: {header_name: 'a b', descriptor_key: k}}]\n";
        let e = from_str("e.yaml", bad_header).unwrap_err();
        assert!(e.message.contains("not a valid header name"), "{e}");
    }

    /// A route whose request the limiter would refuse (past its default caps) is
    /// refused when the file loads, not on every request.
    #[test]
    fn routes_within_the_limiters_caps() {
        let route = |descriptors: usize, actions: usize| {
            let list = vec!["{method: {}}"; actions].join(", ");
            let items = format!("        - actions: [{list}]\n").repeat(descriptors);
            format!("domain: e\nhttp:\n  routes:\n    - rate_limits:\n{items}")
        };
        assert!(from_str("e.yaml", &route(64, 32)).is_ok());
        let e = from_str("e.yaml", &route(65, 1)).unwrap_err();
        assert_eq!(
            e.message,
            "http.routes[0]: at most 64 `rate_limits` (the descriptors of one request)"
        );
        let e = from_str("e.yaml", &route(2, 33)).unwrap_err();
        assert_eq!(
            e.message,
            "http.routes[0].rate_limits[0]: at most 32 `actions` (the entries of one descriptor)"
        );
    }
}
