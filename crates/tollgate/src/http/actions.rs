//! Descriptors from an HTTP request: each configured [`Action`] adds one (key, value)
//! entry, as Envoy's rate limit actions do.

use std::net::IpAddr;

use http::{HeaderMap, Method};

use super::client_ip::client_key;
use super::config::{Action, HeaderMatcher, Route};
use super::path::{Form, RequestPath};

/// What actions read from a request.
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    /// The method.
    pub method: &'a Method,
    /// The normalized path (without the query).
    pub path: &'a RequestPath,
    /// The raw query string, if any.
    pub query: Option<&'a str>,
    /// The headers.
    pub headers: &'a HeaderMap,
    /// The client's address (see [`client_ip`](super::client_ip())).
    pub client: IpAddr,
    /// How many leading bits of an IPv6 client key it.
    pub ipv6_prefix: u8,
}

impl Route {
    /// Whether this route applies to the request: its path, in the route's form,
    /// starts with the prefix, and its method is listed (without regard to case; `GET`
    /// covers `HEAD`, which upstreams answer as a `GET`) or none is.
    pub fn matches(&self, req: &RequestView<'_>) -> bool {
        let prefix = self.matcher.path_prefix.as_deref().unwrap_or("/");
        let method = req.method.as_str();
        req.path.get(self.matcher.form()).starts_with(prefix)
            && (self.matcher.methods.is_empty()
                || self.matcher.methods.iter().any(|m| {
                    m.eq_ignore_ascii_case(method)
                        || (m == "GET" && method.eq_ignore_ascii_case("HEAD"))
                }))
    }
}

/// The descriptor `actions` build for `req` on a route comparing paths in `form`, or
/// `None` when one of them produces nothing (a missing header without
/// `skip_if_absent`, a header match that fails): then, as in Envoy, the descriptor is
/// not sent.
pub fn descriptor(
    actions: &[Action],
    req: &RequestView<'_>,
    form: Form,
) -> Option<Vec<(String, String)>> {
    let mut entries = Vec::with_capacity(actions.len());
    for action in actions {
        match action {
            Action::RemoteAddress {} => entries.push((
                "remote_address".to_string(),
                client_key(req.client, req.ipv6_prefix),
            )),
            Action::RequestHeaders {
                header_name,
                descriptor_key,
                skip_if_absent,
            } => match req.headers.get(header_name).and_then(|v| v.to_str().ok()) {
                Some(v) => entries.push((descriptor_key.clone(), v.to_string())),
                None if *skip_if_absent => {}
                None => return None,
            },
            Action::GenericKey {
                descriptor_value,
                descriptor_key,
            } => entries.push((
                descriptor_key
                    .clone()
                    .unwrap_or_else(|| "generic_key".to_string()),
                descriptor_value.clone(),
            )),
            Action::HeaderValueMatch {
                descriptor_value,
                descriptor_key,
                expect_match,
                headers,
            } => {
                let matched = headers.iter().all(|m| header_matches(m, req.headers));
                if matched != *expect_match {
                    return None;
                }
                entries.push((
                    descriptor_key
                        .clone()
                        .unwrap_or_else(|| "header_match".to_string()),
                    descriptor_value.clone(),
                ));
            }
            Action::Path {} => entries.push(("path".to_string(), req.path.get(form).to_string())),
            Action::Method {} => entries.push(("method".to_string(), req.method.to_string())),
            Action::QueryParameter {
                query_parameter_name,
                descriptor_key,
                skip_if_absent,
            } => match query_value(req.query, query_parameter_name) {
                Some(v) => entries.push((descriptor_key.clone(), v)),
                None if *skip_if_absent => {}
                None => return None,
            },
        }
    }
    (!entries.is_empty()).then_some(entries)
}

fn header_matches(m: &HeaderMatcher, headers: &HeaderMap) -> bool {
    let value = headers.get(&m.name).and_then(|v| v.to_str().ok());
    if let Some(present) = m.present_match {
        return value.is_some() == present;
    }
    match (value, &m.exact_match, &m.prefix_match) {
        (Some(v), Some(exact), _) => v == exact,
        (Some(v), None, Some(prefix)) => v.starts_with(prefix.as_str()),
        (Some(_), None, None) => true,
        (None, _, _) => false,
    }
}

/// The first value of `name` in a query string, percent- and `+`-decoded. (A request
/// that gives a parameter a rule reads more than once is refused before this is
/// asked: [`query_repeated`].)
fn query_value(query: Option<&str>, name: &str) -> Option<String> {
    query?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (decode(k) == name).then(|| decode(v))
    })
}

/// Whether the query string names the parameter `name` more than once (as decoded:
/// `key=a&k%65y=b` is `key` twice).
pub(crate) fn query_repeated(query: Option<&str>, name: &str) -> bool {
    query.is_some_and(|q| {
        q.split('&')
            .filter(|pair| decode(pair.split_once('=').map_or(*pair, |(k, _)| k)) == name)
            .nth(1)
            .is_some()
    })
}

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = |b: u8| (b as char).to_digit(16);
                match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                    (Some(h), Some(l)) => {
                        out.push((h * 16 + l) as u8);
                        i += 2;
                    }
                    _ => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::config::from_str;

    #[test]
    fn actions_build_envoy_style_descriptors() {
        let rules = from_str(
            "e.yaml",
            "domain: e
http:
  routes:
    - match: {path_prefix: /api/, methods: [GET]}
      rate_limits:
        - actions: [{remote_address: {}}, {method: {}}, {path: {}}]
        - actions: [{request_headers: {header_name: x-api-key, descriptor_key: api_key}}]
        - actions: [{generic_key: {descriptor_value: all}}, {query_parameter: {query_parameter_name: q, descriptor_key: q}}]
        - actions: [{header_value_match: {descriptor_value: bot, headers: [{name: user-agent, prefix_match: curl}]}}]
",
        )
        .unwrap()
        .unwrap();
        let mut headers = HeaderMap::new();
        headers.insert("user-agent", "curl/8".parse().unwrap());
        let path = RequestPath::parse("/api/x").unwrap();
        let req = RequestView {
            method: &Method::GET,
            path: &path,
            query: Some("a=1&q=caf%C3%A9+au+lait"),
            headers: &headers,
            client: "192.0.2.1".parse().unwrap(),
            ipv6_prefix: 64,
        };
        let route = &rules.routes[0];
        assert!(route.matches(&req));
        assert!(!route.matches(&RequestView {
            method: &Method::POST,
            ..req
        }));
        let d: Vec<_> = route
            .rate_limits
            .iter()
            .map(|r| descriptor(&r.actions, &req, route.matcher.form()))
            .collect();
        let pairs = |v: &[(&str, &str)]| {
            Some(
                v.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<Vec<_>>(),
            )
        };
        assert_eq!(
            d[0],
            pairs(&[
                ("remote_address", "192.0.2.1"),
                ("method", "GET"),
                ("path", "/api/x")
            ])
        );
        assert_eq!(d[1], None, "no x-api-key header: no descriptor");
        assert_eq!(
            d[2],
            pairs(&[("generic_key", "all"), ("q", "café au lait")])
        );
        assert_eq!(d[3], pairs(&[("header_match", "bot")]));
    }
}
