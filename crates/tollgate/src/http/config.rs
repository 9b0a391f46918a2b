//! The `http` section of a rule file: how the gateway turns an HTTP request into
//! descriptors. `tollgate serve` does not use it; [`RateLimitLayer`](super::RateLimitLayer)
//! and `tollgate proxy` read it from the same files as the rules, in the same load:
//! [`RuleSet::http`](crate::rules::RuleSet::http) holds the sections, so routes and limits
//! always change together. docs/gateway.md is the reference.
//!
//! ```yaml
//! domain: edge
//! descriptors:
//!   - key: remote_address
//!     rate_limit: {unit: minute, requests_per_unit: 60}
//! http:
//!   trusted_proxies: [10.0.0.0/8]        # whose client-address header we believe
//!   client_address_header: x-forwarded-for   # the one header read (or `forwarded`, `x-real-ip`)
//!   ipv6_prefix: 64                      # IPv6 clients are keyed by their /64
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
//!
//! A `rate_limits` item may say `cost: request_bytes` (default `cost: hits`, one per
//! request): it is then charged the request body's bytes, so that a limit in bytes per
//! unit limits bandwidth (see [`Cost`]).

use std::collections::BTreeMap;

use ipnet::IpNet;
use marked_yaml::Node;
use serde::Deserialize;

use super::path;
use super::settings::{AdaptiveConcurrency, RawAdaptive, RawProtection, SystemProtection};
use crate::rules::ConfigError;

/// The gateway settings of one rule file (one domain).
#[derive(Debug, Clone, PartialEq)]
pub struct HttpRules {
    /// The rule domain the descriptors are checked against.
    pub domain: String,
    /// Peers whose client-address header is believed.
    pub trusted_proxies: Vec<IpNet>,
    /// The one header that names the client through trusted proxies (lower case).
    pub client_address_header: http::HeaderName,
    /// IPv6 clients are keyed (the `remote_address` entry) by this many leading bits.
    pub ipv6_prefix: u8,
    /// Requests from these addresses or with these descriptor values get 403.
    pub deny: AccessList,
    /// Requests from these addresses or with these descriptor values are never limited.
    pub allow: AccessList,
    /// Routes, tried in order; the first match applies. No match: not limited.
    pub routes: Vec<Route>,
    /// The gateway's load shedding, if this section sets it (at most one section of a
    /// rule set does).
    pub system_protection: Option<SystemProtection>,
}

impl Default for HttpRules {
    fn default() -> Self {
        Self {
            domain: String::new(),
            trusted_proxies: Vec::new(),
            client_address_header: http::HeaderName::from_static(DEFAULT_CLIENT_HEADER),
            ipv6_prefix: DEFAULT_IPV6_PREFIX,
            deny: AccessList::default(),
            allow: AccessList::default(),
            routes: Vec::new(),
            system_protection: None,
        }
    }
}

/// The header read for the client's address unless `client_address_header` says.
pub const DEFAULT_CLIENT_HEADER: &str = "x-forwarded-for";

/// How many leading bits of an IPv6 client address key it unless `ipv6_prefix` says:
/// one customer's network (a /64 is what one subscriber or host is usually given).
pub const DEFAULT_IPV6_PREFIX: u8 = 64;

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
    /// Sent instead of a 429 when the route's limits reject (degrade, don't fail), and
    /// instead of a 503 when its adaptive concurrency sheds.
    #[serde(default)]
    pub fallback: Option<Fallback>,
    /// `adaptive_concurrency` as written; read into `adaptive_concurrency` when the
    /// section loads.
    #[serde(default, rename = "adaptive_concurrency")]
    pub(crate) adaptive_raw: Option<RawAdaptive>,
    /// The requests in flight to the upstream follow its latency (checked settings).
    #[serde(skip)]
    pub adaptive_concurrency: Option<AdaptiveConcurrency>,
}

/// Path prefix and methods, both optional, and how the path is compared.
///
/// The prefix is compared with the request's normalized path (see
/// the [`super::path`] module): percent-encoded unreserved characters decoded, dot segments
/// resolved, repeated slashes merged. By default the comparison also ignores ASCII
/// case and `;` parameters in path segments (`/API;v=1/items` is `/api/items`), so that
/// an upstream that ignores them cannot be reached around the route.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteMatch {
    /// The normalized path starts with this (default `/`).
    #[serde(default)]
    pub path_prefix: Option<String>,
    /// Method names, compared without regard to case; `GET` also matches `HEAD`.
    /// Empty: every method.
    #[serde(default)]
    pub methods: Vec<String>,
    /// Compare the path's case exactly (default: ASCII case is ignored).
    #[serde(default)]
    pub case_sensitive: bool,
    /// Compare `;` parameters of path segments as part of the path (default: they are
    /// left out of the comparison).
    #[serde(default)]
    pub keep_path_parameters: bool,
}

impl RouteMatch {
    /// The form of the path this route compares (and the `path` action reads).
    pub fn form(&self) -> path::Form {
        path::Form {
            case_sensitive: self.case_sensitive,
            keep_parameters: self.keep_path_parameters,
        }
    }
}

/// The actions that build one descriptor, and what a request costs it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitActions {
    /// Each action adds one (key, value) entry, in order.
    pub actions: Vec<Action>,
    /// What a request charges this descriptor (default: one hit).
    #[serde(default)]
    pub cost: Cost,
}

/// What a request charges one `rate_limits` descriptor: `cost: hits` (the default) or
/// `cost: request_bytes`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cost {
    /// One unit per request.
    #[default]
    Hits,
    /// One unit per byte of the request body: its declared length, charged in the
    /// decision, or, for a body streamed without one, charged as it arrives.
    RequestBytes,
}

/// A concurrency limit on the descriptor its actions build.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InFlightLimit {
    /// Each action adds one (key, value) entry, in order.
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
    /// `("remote_address", client IP)`; an IPv6 client by its network (`ipv6_prefix`).
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
    /// `("path", the path as the route compares it)`.
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Section {
    #[serde(default)]
    trusted_proxies: Vec<IpNet>,
    #[serde(default)]
    client_address_header: Option<String>,
    #[serde(default)]
    ipv6_prefix: Option<u8>,
    #[serde(default)]
    deny: AccessList,
    #[serde(default)]
    allow: AccessList,
    #[serde(default)]
    routes: Vec<Route>,
    #[serde(default)]
    system_protection: Option<RawProtection>,
}

/// Reads the `http` sections of the rule files `paths` names, as
/// [`rules::load`](crate::rules::load) does (it is that load): every problem in the files,
/// their rules or their sections, names its file, line and column.
pub fn load(
    paths: &[impl AsRef<std::path::Path>],
    options: crate::rules::LoadOptions,
) -> Result<Vec<HttpRules>, crate::rules::ConfigErrors> {
    crate::rules::load(paths, options).map(|set| set.http().to_vec())
}

/// Reads the `http` section of one rule file's text (`None` when it has none); the
/// whole file is read, as [`rules::from_str`](crate::rules::from_str) reads it.
pub fn from_str(file: &str, text: &str) -> Result<Option<HttpRules>, crate::rules::ConfigErrors> {
    crate::rules::from_str(file, text).map(|set| set.http().first().cloned())
}

/// The `http` section `node` of the file `file` whose domain is `domain` (`None` when
/// it is empty). The rule reader calls this for the file's `http` key.
pub(crate) fn from_node(
    file: &str,
    domain: &str,
    node: &Node,
) -> Result<Option<HttpRules>, ConfigError> {
    if node
        .as_scalar()
        .is_some_and(|s| matches!(s.as_str().trim(), "" | "~" | "null"))
    {
        return Ok(None);
    }
    let at = |span: &marked_yaml::Span, message: String| {
        let (line, column) = span.start().map_or((0, 0), |m| (m.line(), m.column()));
        ConfigError {
            file: file.to_string(),
            line,
            column,
            message,
        }
    };
    let section: Section = marked_yaml::from_node(node).map_err(|e| {
        let (line, column) = e.start_mark().map_or((0, 0), |m| (m.line(), m.column()));
        let message = match e.path() {
            Some(path) => format!("http.{path}: {}", *e),
            None => format!("in the `http` section: {}", *e),
        };
        ConfigError {
            file: file.to_string(),
            line,
            column,
            message,
        }
    })?;
    let route_nodes = node
        .as_mapping()
        .and_then(|m| m.get_sequence("routes"))
        .map(|s| s.iter().map(|n| *n.span()).collect::<Vec<_>>())
        .unwrap_or_default();
    let route_span = |i: usize| route_nodes.get(i).copied().unwrap_or(*node.span());
    // A route's field's place, else the route's.
    let route_field = |i: usize, name: &str| {
        node.as_mapping()
            .and_then(|m| m.get_sequence("routes"))
            .and_then(|s| s.get(i))
            .and_then(|r| r.as_mapping())
            .and_then(|r| r.get_node(name))
            .map_or(route_span(i), |n| *n.span())
    };
    let section_field = |name: &str| {
        node.as_mapping()
            .and_then(|m| m.get_node(name))
            .map_or(*node.span(), |n| *n.span())
    };
    let client_address_header = match section.client_address_header.as_deref() {
        None => http::HeaderName::from_static(DEFAULT_CLIENT_HEADER),
        Some(name) => http::HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| {
            at(
                &section_field("client_address_header"),
                format!("http.client_address_header: `{name}` is not a valid header name"),
            )
        })?,
    };
    let ipv6_prefix = section.ipv6_prefix.unwrap_or(DEFAULT_IPV6_PREFIX);
    if ipv6_prefix > 128 {
        return Err(at(
            &section_field("ipv6_prefix"),
            format!("http.ipv6_prefix: {ipv6_prefix} is more than the 128 bits of an IPv6 address"),
        ));
    }
    let mut routes = section.routes;
    // A route's rate limits are one request to the limiter: within its default caps.
    let caps = crate::limiter::RequestLimits::default();
    for (i, route) in routes.iter_mut().enumerate() {
        let place = |message: String| at(&route_span(i), message);
        for m in &mut route.matcher.methods {
            *m = m.trim().to_ascii_uppercase();
            if m.is_empty() || http::Method::from_bytes(m.as_bytes()).is_err() {
                return Err(place(format!(
                    "http.routes[{i}].match: `{m}` is not an HTTP method"
                )));
            }
        }
        let form = route.matcher.form();
        if let Some(prefix) = &mut route.matcher.path_prefix {
            *prefix = route_prefix(prefix, form)
                .map_err(|why| place(format!("http.routes[{i}].match.path_prefix: {why}")))?;
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
        if let Some(raw) = route.adaptive_raw.take() {
            let span = route_field(i, "adaptive_concurrency");
            route.adaptive_concurrency = Some(raw.check().map_err(|why| {
                at(
                    &span,
                    format!("http.routes[{i}].adaptive_concurrency: {why}"),
                )
            })?);
        }
    }
    let system_protection = match &section.system_protection {
        None => None,
        Some(raw) => {
            let span = section_field("system_protection");
            let line = span.start().map_or(0, |m| m.line());
            Some(
                raw.check(file, line)
                    .map_err(|why| at(&span, format!("http.system_protection: {why}")))?,
            )
        }
    };
    Ok(Some(HttpRules {
        domain: domain.to_string(),
        trusted_proxies: section.trusted_proxies,
        client_address_header,
        ipv6_prefix,
        deny: section.deny,
        allow: section.allow,
        routes,
        system_protection,
    }))
}

/// A route's `path_prefix` in the form its requests' paths are compared in.
fn route_prefix(prefix: &str, form: path::Form) -> Result<String, String> {
    if !prefix.starts_with('/') {
        return Err(format!("`{prefix}` does not start with `/`"));
    }
    if !form.keep_parameters && prefix.contains(';') {
        return Err(format!(
            "`{prefix}` has a `;`, but `;` parameters are left out of the comparison unless the \
             route sets `keep_path_parameters: true`"
        ));
    }
    let normal = path::normalize(prefix).map_err(|e| format!("`{prefix}`: {e}"))?;
    // A prefix ending in `/` keeps it (normalizing keeps a trailing slash).
    Ok(path::RequestPath::from_normal(normal).get(form).to_string())
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

    /// The one problem `text` has.
    fn error(file: &str, text: &str) -> ConfigError {
        let mut all = from_str(file, text).unwrap_err().0;
        assert_eq!(all.len(), 1, "{all:?}");
        all.remove(0)
    }

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
        assert!(from_str("x.yaml", "domain: x\nhttp:\n").unwrap().is_none());
        assert!(from_str("x.yaml", "domain: x\nhttp: ~\n")
            .unwrap()
            .is_none());
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
        let e = error("edge.yaml", text);
        assert_eq!((e.file.as_str(), e.line), ("edge.yaml", 6), "{e}");
        assert!(e.message.contains("remote_adress"), "{e}");
        let bad_cidr = "domain: e\nhttp:\n  trusted_proxies: [10.0.0.0/33]\n";
        let e = error("e.yaml", bad_cidr);
        assert_eq!(e.line, 3, "{e}");
        let bad_header = "domain: e\nhttp:\n  routes:\n    - rate_limits:\n        - actions: [{request_headers: {header_name: 'a b', descriptor_key: k}}]\n";
        let e = error("e.yaml", bad_header);
        assert!(e.message.contains("not a valid header name"), "{e}");
    }

    #[test]
    fn cost_is_hits_or_request_bytes_and_a_bad_one_is_placed() {
        let route = |cost: &str| {
            format!(
                "domain: e\nhttp:\n  routes:\n    - rate_limits:\n        - actions: [{{method: {{}}}}]\n{cost}        - actions: [{{path: {{}}}}]\n"
            )
        };
        let r = from_str("e.yaml", &route("          cost: request_bytes\n"))
            .unwrap()
            .unwrap();
        let costs: Vec<Cost> = r.routes[0].rate_limits.iter().map(|l| l.cost).collect();
        assert_eq!(costs, [Cost::RequestBytes, Cost::Hits]);
        let r = from_str("e.yaml", &route("          cost: hits\n"))
            .unwrap()
            .unwrap();
        assert_eq!(r.routes[0].rate_limits[0].cost, Cost::Hits);
        let e = error("e.yaml", &route("          cost: bytes\n"));
        assert_eq!((e.file.as_str(), e.line), ("e.yaml", 6), "{e}");
        assert!(e.message.contains("cost"), "{e}");
        assert!(e.message.contains("request_bytes"), "{e}");
    }

    #[test]
    fn adaptive_concurrency_is_read_and_bad_settings_are_placed() {
        let route = |settings: &str| {
            format!(
                "domain: e\nhttp:\n  routes:\n    - match: {{path_prefix: /a/}}\n    - match: {{path_prefix: /b/}}\n      adaptive_concurrency: {settings}\n"
            )
        };
        let r = from_str(
            "e.yaml",
            &route("{min_limit: 5, max_limit: 50, interval: 250ms, buffer: 10%, exclude: [502]}"),
        )
        .unwrap()
        .unwrap();
        assert_eq!(r.routes[0].adaptive_concurrency, None);
        let a = r.routes[1].adaptive_concurrency.clone().unwrap();
        assert_eq!((a.settings.min_limit, a.settings.max_limit), (5, 50));
        assert_eq!(a.settings.interval, std::time::Duration::from_millis(250));
        assert_eq!(a.settings.buffer, 0.1);
        assert_eq!(a.settings.percentile, 0.5);
        assert_eq!(a.exclude, [502]);
        for (settings, says) in [
            ("{min_limit: 0}", "`min_limit` must be at least 1"),
            (
                "{min_limit: 10, max_limit: 5}",
                "`max_limit` (5) must be from `min_limit` (10)",
            ),
            ("{interval: soon}", "`interval: soon` is not a duration"),
            ("{interval: 1ms}", "`interval: 1ms` must be from"),
            (
                "{min_rtt_interval: 10ms, interval: 1s}",
                "`min_rtt_interval: 10ms` must be from",
            ),
            ("{buffer: 25}", "`buffer: 25` is not a percentage"),
            ("{percentile: 0%}", "`percentile: 0%` must be from"),
            ("{exclude: [99]}", "`exclude`: 99 is not an HTTP status"),
            (
                "{min_rtt_samples: 0}",
                "`min_rtt_samples` (0) must be from 1",
            ),
        ] {
            let e = error("e.yaml", &route(settings));
            assert_eq!((e.file.as_str(), e.line), ("e.yaml", 6), "{e}");
            assert!(
                e.message
                    .starts_with("http.routes[1].adaptive_concurrency: "),
                "{e}"
            );
            assert!(e.message.contains(says), "{settings}: {e}");
        }
        let e = error("e.yaml", &route("{limit: 4}"));
        assert_eq!(e.line, 6, "{e}");
        assert!(e.message.contains("limit"), "{e}");
    }

    #[test]
    fn system_protection_is_read_and_bad_settings_are_placed() {
        let section = |settings: &str| {
            format!("domain: e\nhttp:\n  routes: []\n  system_protection: {settings}\n")
        };
        let r = from_str(
            "e.yaml",
            &section("{max_cpu: 85%, exempt: [/healthz], priority: {header: x-priority, classes: [gold, bronze]}}"),
        )
        .unwrap()
        .unwrap();
        let p = r.system_protection.unwrap();
        assert_eq!(p.settings.max_cpu, Some(0.85));
        assert!(p.settings.capacity);
        assert_eq!(p.settings.classes, 2);
        assert_eq!((p.file.as_str(), p.line), ("e.yaml", 4));
        // A request naming no class is of the lowest when no default is given.
        assert_eq!(p.rank(&http::HeaderMap::new()), 1);
        assert!(p.is_exempt("/healthz/deep"));
        for (settings, says) in [
            ("{max_cpu: 0%}", "`max_cpu: 0%` must be from 1% to 99%"),
            ("{max_cpu: 100%}", "`max_cpu: 100%` must be from 1% to 99%"),
            ("{capacity: false}", "sheds nothing"),
            ("{exempt: [healthz]}", "does not start with `/`"),
            (
                "{priority: {header: 'a b', classes: [x]}}",
                "not a valid header name",
            ),
            (
                "{priority: {header: p, classes: []}}",
                "from 1 to 64 classes",
            ),
            (
                "{priority: {header: p, classes: [x, x]}}",
                "`x` is named twice",
            ),
            (
                "{priority: {header: p, classes: [x], default_class: y}}",
                "`priority.default_class: y` is not one of the classes (x)",
            ),
            ("{max_cpus: 80%}", "max_cpus"),
        ] {
            let e = error("e.yaml", &section(settings));
            assert_eq!((e.file.as_str(), e.line), ("e.yaml", 4), "{e}");
            assert!(e.message.contains(says), "{settings}: {e}");
        }
    }

    #[test]
    fn only_one_file_sets_system_protection() {
        let file = |d: &str| format!("domain: {d}\nhttp:\n  system_protection: {{max_cpu: 90%}}\n");
        let dir = std::env::temp_dir().join(format!("tollgate-sysprot-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a.yaml"), file("a")).unwrap();
        std::fs::write(dir.join("b.yaml"), file("b")).unwrap();
        let errors = load(&[&dir], crate::rules::LoadOptions::default())
            .unwrap_err()
            .0;
        assert_eq!(errors.len(), 1, "{errors:?}");
        let e = &errors[0];
        assert!(e.file.ends_with("b.yaml") && e.line == 3, "{e}");
        assert!(e.message.contains("a.yaml:3"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
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
        let e = error("e.yaml", &route(65, 1));
        assert_eq!(
            e.message,
            "http.routes[0]: at most 64 `rate_limits` (the descriptors of one request)"
        );
        let e = error("e.yaml", &route(2, 33));
        assert_eq!(
            e.message,
            "http.routes[0].rate_limits[0]: at most 32 `actions` (the entries of one descriptor)"
        );
    }
}
