//! [`RateLimit`]: the tower service a [`RateLimitLayer`](super::RateLimitLayer) builds.
//!
//! For each request: its path, normalized ([`path`](super::path); 400 if it cannot be);
//! 400 too for a repeated `Host` (or a missing one, when the layer requires it) and for
//! a header or query parameter that a rule reads and the request repeats; then for each `http` section (one per rule file, in file order): the client address
//! (through trusted proxies only), the deny list (403), the first matching route (none:
//! not limited), the allow list (not limited), the route's concurrency permits, then
//! one all-or-nothing [`Limiter::check_in`](crate::limiter::Limiter::check_in) of the
//! route's descriptors, by the rule set the routes came from. Sections are decided one
//! after another: when a later section rejects, what an earlier one admitted has been
//! charged (as two limiters in a row would). The request is forwarded with its
//! normalized path: the upstream serves what was matched. Rejected: 429 with `Retry-After`, `RateLimit-Policy`, `RateLimit` and
//! a problem body, or the route's fallback. Admitted: a leaky bucket in queue mode
//! delays the request (shaping), the inner service answers, and the RateLimit fields
//! are added; permits are held until the response body ends or the client goes away.
//!
//! The inner service may answer with any body (axum's, hyper's `Incoming`, tonic's);
//! the layer answers with [`axum::body::Body`].

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::ConnectInfo;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response, StatusCode, Uri};

use super::actions::{descriptor, query_repeated, RequestView};
use super::body::PermitBody;
use super::client_ip::client_ip;
use super::config::{AccessList, Action, Fallback, HttpRules};
use super::gate::Gate;
use super::path::{PathError, RequestPath};
use crate::headers::{append_to, headers, problem_body};
use crate::inflight::{InFlight, Permit};
use crate::limiter::{Code, Descriptor, RateLimitRequest, RateLimitResponse};
use crate::store::Store;

/// A service limited by a [`RateLimitLayer`](super::RateLimitLayer).
pub struct RateLimit<Svc, S, I> {
    pub(crate) inner: Svc,
    pub(crate) gate: Arc<Gate<S, I>>,
}

impl<Svc: Clone, S, I> Clone for RateLimit<Svc, S, I> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            gate: Arc::clone(&self.gate),
        }
    }
}

/// What the gate decided for a request before it reaches the inner service.
enum Verdict {
    /// Forward, after `delay`, adding `headers`, holding `permits`.
    Pass {
        delay: Duration,
        headers: Vec<(&'static str, String)>,
        permits: Vec<Permit>,
    },
    /// Answer this instead.
    Answer(Response<Body>),
}

impl<Svc, S, I, B, ResBody> tower::Service<Request<B>> for RateLimit<Svc, S, I>
where
    Svc: tower::Service<Request<B>, Response = Response<ResBody>> + Clone + Send + 'static,
    Svc::Future: Send,
    S: Store + 'static,
    I: InFlight + 'static,
    B: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<axum::BoxError>,
{
    type Response = Response<Body>;
    type Error = Svc::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Svc::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The clone that was made ready serves this call; the fresh one stays here.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let gate = Arc::clone(&self.gate);
        Box::pin(async move {
            // Decided on the head alone (the body may not be Sync, and is not read).
            let (mut parts, body) = request.into_parts();
            let path = match RequestPath::parse(parts.uri.path()) {
                Ok(path) => path,
                Err(e) => return Ok(unnormal(&e)),
            };
            let verdict = decide(&gate, &parts, &path).await;
            if !parts.uri.path().is_empty() && path.normal() != parts.uri.path() {
                match with_path(&parts.uri, path.normal()) {
                    Some(uri) => parts.uri = uri,
                    None => return Ok(unnormal(&PathError::NotAbsolute)),
                }
            }
            let request = Request::from_parts(parts, body);
            match verdict {
                Verdict::Answer(response) => Ok(response),
                Verdict::Pass {
                    delay,
                    headers,
                    permits,
                } => {
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                    let mut response = inner.call(request).await?;
                    append_to(response.headers_mut(), headers);
                    let (parts, body) = response.into_parts();
                    let body = Body::new(body);
                    if permits.is_empty() {
                        return Ok(Response::from_parts(parts, body));
                    }
                    Ok(Response::from_parts(
                        parts,
                        Body::new(PermitBody::new(body, permits)),
                    ))
                }
            }
        })
    }
}

/// The peer address axum (`into_make_service_with_connect_info`) or the caller put in
/// the request's extensions; unspecified when there is none.
fn peer(request: &Parts) -> IpAddr {
    let ext = &request.extensions;
    ext.get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip())
        .or_else(|| ext.get::<SocketAddr>().map(SocketAddr::ip))
        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
}

/// `uri` with its path replaced by `path` (the query kept).
fn with_path(uri: &Uri, path: &str) -> Option<Uri> {
    let path_and_query = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_string(),
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(path_and_query.parse().ok()?);
    Uri::from_parts(parts).ok()
}

fn unnormal(e: &PathError) -> Response<Body> {
    problem(
        StatusCode::BAD_REQUEST,
        "Bad Request",
        &format!("the request path cannot be normalized: {e}"),
    )
}

async fn decide<S: Store, I: InFlight>(
    gate: &Gate<S, I>,
    request: &Parts,
    path: &RequestPath,
) -> Verdict {
    let snapshot = gate.snapshot();
    let sections = snapshot.sections();
    if let Some(why) = ambiguous(request, sections, gate.require_host) {
        return Verdict::Answer(problem(StatusCode::BAD_REQUEST, "Bad Request", &why));
    }
    let peer = peer(request);
    let (mut delay, mut out_headers, mut permits) = (Duration::ZERO, Vec::new(), Vec::new());
    for section in sections {
        let client = client_ip(
            peer,
            &request.headers,
            &section.client_address_header,
            &section.trusted_proxies,
        );
        let view = RequestView {
            method: &request.method,
            path,
            query: request.uri.query(),
            headers: &request.headers,
            client,
            ipv6_prefix: section.ipv6_prefix,
        };
        if listed(&section.deny, &view, section) {
            return Verdict::Answer(forbidden());
        }
        let Some(route) = section.routes.iter().find(|r| r.matches(&view)) else {
            continue;
        };
        if listed(&section.allow, &view, section) {
            continue;
        }
        let form = route.matcher.form();
        for limit in &route.max_in_flight {
            let Some(entries) = descriptor(&limit.actions, &view, form) else {
                continue;
            };
            let key = inflight_key(&section.domain, &entries);
            match gate.inflight.acquire(&key, limit.limit).await {
                Ok(Some(permit)) => permits.push(permit),
                Ok(None) => return Verdict::Answer(too_many_in_flight(limit.limit)),
                Err(e) => {
                    // Concurrency limits fail open: the rate limits still apply.
                    tracing::warn!(error = %e, "in-flight permits unavailable; admitting");
                }
            }
        }
        let descriptors: Vec<Descriptor> = route
            .rate_limits
            .iter()
            .filter_map(|r| descriptor(&r.actions, &view, form))
            .map(|entries| Descriptor {
                entries,
                ..Descriptor::default()
            })
            .collect();
        if descriptors.is_empty() {
            continue;
        }
        let check = RateLimitRequest {
            domain: section.domain.clone(),
            descriptors,
            hits_addend: 1,
        };
        let started = gate.observer.as_ref().map(|_| Instant::now());
        let response = match gate.limiter.check_in(&snapshot.set, &check, None).await {
            Ok(r) => {
                if let (Some(observer), Some(started)) = (&gate.observer, started) {
                    observer.decided(&check, &r, started.elapsed());
                }
                r
            }
            // The routes are checked against the limiter's caps when they load, so a
            // refusal is for what the client sent: a header, path or query value
            // longer than a descriptor value may be. Refused here, not let through.
            Err(crate::limiter::Error::InvalidRequest(why)) => {
                tracing::debug!(%why, "the limiter refused the request's descriptors");
                return Verdict::Answer(problem(StatusCode::BAD_REQUEST, "Bad Request", &why));
            }
            Err(e) => {
                tracing::warn!(error = %e, "the gateway built a request the limiter refused");
                return Verdict::Answer(problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "Internal Server Error",
                    "the gateway could not check this request",
                ));
            }
        };
        let fields = headers(&response, gate.headers);
        if response.overall == Code::OverLimit {
            return Verdict::Answer(match &route.fallback {
                Some(f) => fallback(f, fields),
                None => over_limit(&response, fields),
            });
        }
        delay = delay.max(Duration::from_nanos(
            response.statuses.iter().map(|s| s.delay).max().unwrap_or(0),
        ));
        out_headers.extend(fields);
    }
    Verdict::Pass {
        delay,
        headers: out_headers,
        permits,
    }
}

/// Why `request` cannot be decided on, if it cannot: its `Host` is repeated, or missing
/// from an HTTP/1.1 request when the gate requires it (RFC 9112 §3.2 says 400 to both;
/// a missing one is refused only when asked, since requests made in-process, as in
/// tests, often have none), or a header or query parameter that a rule reads comes
/// more than once, so that a deny list or a limit could meet one value and the
/// upstream act on the other. Refused before any limit is charged.
fn ambiguous(request: &Parts, sections: &[HttpRules], require_host: bool) -> Option<String> {
    let hosts = request.headers.get_all(http::header::HOST).iter().count();
    if hosts > 1 || (hosts == 0 && require_host && request.version == http::Version::HTTP_11) {
        return Some("an HTTP/1.1 request carries exactly one Host header".to_string());
    }
    let repeated = |name: &str| request.headers.get_all(name).iter().nth(1).is_some();
    let refuse = |name: &str| {
        Some(format!(
            "the header `{name}` comes more than once, and the gateway's rules read it: send it once"
        ))
    };
    for route in sections.iter().flat_map(|s| &s.routes) {
        let lists = route.rate_limits.iter().map(|l| &l.actions);
        for action in lists
            .chain(route.max_in_flight.iter().map(|m| &m.actions))
            .flatten()
        {
            match action {
                Action::RequestHeaders { header_name, .. } if repeated(header_name) => {
                    return refuse(header_name);
                }
                Action::HeaderValueMatch { headers, .. } => {
                    if let Some(m) = headers.iter().find(|m| repeated(&m.name)) {
                        return refuse(&m.name);
                    }
                }
                Action::QueryParameter {
                    query_parameter_name,
                    ..
                } if query_repeated(request.uri.query(), query_parameter_name) => {
                    return Some(format!(
                        "the query parameter `{query_parameter_name}` comes more than once, and the gateway's rules read it: send it once"
                    ));
                }
                _ => {}
            }
        }
    }
    None
}

/// Whether the client address or a value the route's actions would build is listed.
fn listed(list: &AccessList, view: &RequestView<'_>, section: &HttpRules) -> bool {
    if list.is_empty() {
        return false;
    }
    if list.cidrs.iter().any(|n| n.contains(&view.client)) {
        return true;
    }
    if list.values.is_empty() {
        return false;
    }
    section
        .routes
        .iter()
        .filter(|r| r.matches(view))
        .flat_map(|r| {
            let form = r.matcher.form();
            r.rate_limits
                .iter()
                .map(|l| &l.actions)
                .chain(r.max_in_flight.iter().map(|m| &m.actions))
                .map(move |actions| (actions, form))
        })
        .filter_map(|(actions, form)| descriptor(actions, view, form))
        .flatten()
        .any(|(k, v)| list.values.get(&k).is_some_and(|vs| vs.contains(&v)))
}

/// The permit key of a descriptor: domain and entries, each length-prefixed so that no
/// value can make two descriptors collide.
fn inflight_key(domain: &str, entries: &[(String, String)]) -> Vec<u8> {
    let mut key = Vec::with_capacity(64);
    for part in std::iter::once(domain).chain(entries.iter().flat_map(|(k, v)| [&**k, &**v])) {
        key.extend_from_slice(&(part.len() as u32).to_be_bytes());
        key.extend_from_slice(part.as_bytes());
    }
    key
}

fn json_response(
    status: StatusCode,
    body: Vec<u8>,
    fields: Vec<(&'static str, String)>,
) -> Response<Body> {
    let mut response = Response::new(Body::from(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    append_to(response.headers_mut(), fields);
    response
}

fn over_limit(response: &RateLimitResponse, fields: Vec<(&'static str, String)>) -> Response<Body> {
    json_response(
        StatusCode::TOO_MANY_REQUESTS,
        problem_body(response),
        fields,
    )
}

fn problem(status: StatusCode, title: &str, detail: &str) -> Response<Body> {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    json_response(status, body.to_string().into_bytes(), Vec::new())
}

fn forbidden() -> Response<Body> {
    problem(
        StatusCode::FORBIDDEN,
        "Forbidden",
        "the client or its key is on the gateway's deny list",
    )
}

fn too_many_in_flight(limit: u64) -> Response<Body> {
    let mut r = problem(
        StatusCode::TOO_MANY_REQUESTS,
        "Too Many Requests",
        &format!("at most {limit} requests may be in flight at once for this client"),
    );
    r.headers_mut()
        .insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
    r
}

fn fallback(f: &Fallback, fields: Vec<(&'static str, String)>) -> Response<Body> {
    let mut response = Response::new(Body::from(f.body.clone()));
    *response.status_mut() = StatusCode::from_u16(f.status).unwrap_or(StatusCode::OK);
    let content_type = f
        .content_type
        .as_deref()
        .and_then(|c| HeaderValue::from_str(c).ok())
        .unwrap_or(HeaderValue::from_static("text/plain; charset=utf-8"));
    response
        .headers_mut()
        .insert(http::header::CONTENT_TYPE, content_type);
    append_to(response.headers_mut(), fields);
    response
}
