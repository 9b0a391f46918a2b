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
//! A `cost: request_bytes` entry is charged the body's declared length in that one
//! check (declared more than its limit could ever admit: 413); a body streamed
//! without a length is checked without a charge there, then charged as it arrives
//! (`bandwidth.rs`): once a charge is refused the body stops, the request sent on is
//! aborted, and the client gets 429 unless a response has begun.
//!
//! The inner service receives the request with an [`axum::body::Body`] (any request
//! body is boxed into one; axum routers and `tollgate proxy`'s forwarder take it) and
//! may answer with any body (axum's, hyper's `Incoming`, tonic's); the layer answers
//! with [`axum::body::Body`].

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
use super::bandwidth::{Meter, MeteredBody};
use super::body::{Held, PermitBody};
use super::client_ip::client_ip;
use super::config::{AccessList, Action, Cost, Fallback, HttpRules};
use super::gate::Gate;
use super::path::{PathError, RequestPath};
use crate::adaptive::Shed;
use crate::headers::{append_to, headers, problem_body};
use crate::inflight::InFlight;
use crate::limiter::{Code, Descriptor, RateLimitRequest, RateLimitResponse};
use crate::rules::RuleSet;
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
    /// Forward, after `delay`, adding `headers`, holding `held` (permits and places);
    /// charge the body's bytes as it streams to the `request_bytes` descriptors of
    /// `meters` (one request per section), by the rule set `set`.
    Pass {
        delay: Duration,
        headers: Vec<(&'static str, String)>,
        held: Held,
        meters: Vec<RateLimitRequest>,
        set: Arc<RuleSet>,
    },
    /// Answer this instead.
    Answer(Response<Body>),
}

impl<Svc, S, I, B, ResBody> tower::Service<Request<B>> for RateLimit<Svc, S, I>
where
    Svc: tower::Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    Svc::Future: Send,
    S: Store + 'static,
    I: InFlight + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
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
            // Decided on the head alone (the body may not be Sync, and is not read),
            // and the body's declared length.
            let (mut parts, body) = request.into_parts();
            let length = http_body::Body::size_hint(&body).exact();
            let body = Body::new(body);
            let path = match RequestPath::parse(parts.uri.path()) {
                Ok(path) => path,
                Err(e) => return Ok(unnormal(&e)),
            };
            let verdict = decide(&gate, &parts, &path, length).await;
            if !parts.uri.path().is_empty() && path.normal() != parts.uri.path() {
                match with_path(&parts.uri, path.normal()) {
                    Some(uri) => parts.uri = uri,
                    None => return Ok(unnormal(&PathError::NotAbsolute)),
                }
            }
            match verdict {
                Verdict::Answer(response) => Ok(response),
                Verdict::Pass {
                    delay,
                    headers,
                    held,
                    meters,
                    set,
                } => {
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                    let shedding = Arc::clone(&gate.shedding);
                    let mut held = held;
                    held.forwarded(shedding.now());
                    let answered = move |response: &Response<ResBody>| {
                        held.answered(shedding.now(), response.status().as_u16())
                    };
                    if meters.is_empty() {
                        let request = Request::from_parts(parts, body);
                        let response = inner.call(request).await?;
                        let held = answered(&response);
                        return Ok(answer(response, headers, held));
                    }
                    let (refused, mut refusal) = tokio::sync::oneshot::channel();
                    let meter = Meter {
                        limiter: Arc::clone(&gate.limiter),
                        set,
                        charges: meters,
                        observer: gate.observer.clone(),
                        headers: gate.headers,
                        refused,
                    };
                    let body = Body::new(MeteredBody::new(body, meter));
                    let mut call = std::pin::pin!(inner.call(Request::from_parts(parts, body)));
                    // A refused charge answers the client if the upstream has not yet;
                    // the request sent upstream is dropped (aborted) with the call.
                    let waiting = async {
                        match (&mut refusal).await {
                            Ok(refused) => refused,
                            // The body ended (or was dropped) without a refusal.
                            Err(_) => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        refused = waiting => Ok(refused),
                        response = &mut call => match refusal.try_recv() {
                            Ok(refused) => Ok(refused),
                            Err(_) => {
                                let response = response?;
                                let held = answered(&response);
                                Ok(answer(response, headers, held))
                            }
                        },
                    }
                }
            }
        })
    }
}

/// The inner service's `response` with the RateLimit fields added, holding `held`
/// until its body ends.
fn answer<ResBody>(
    mut response: Response<ResBody>,
    headers: Vec<(&'static str, String)>,
    held: Held,
) -> Response<Body>
where
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<axum::BoxError>,
{
    append_to(response.headers_mut(), headers);
    let (parts, body) = response.into_parts();
    let body = Body::new(body);
    if held.is_empty() {
        return Response::from_parts(parts, body);
    }
    Response::from_parts(parts, Body::new(PermitBody::new(body, held)))
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
    length: Option<u64>,
) -> Verdict {
    let snapshot = gate.snapshot();
    let sections = snapshot.sections();
    if let Some(why) = ambiguous(request, sections, gate.require_host) {
        return Verdict::Answer(problem(StatusCode::BAD_REQUEST, "Bad Request", &why));
    }
    let shedding = &gate.shedding;
    let bound = shedding.bind(&snapshot, || {
        Arc::ptr_eq(&snapshot.set, &gate.limiter.rules().current())
    });
    let mut held = Held::default();
    match shedding
        .guard()
        .admit(shedding.now(), path.normal(), &request.headers)
    {
        Ok(place) => held.system = place,
        Err(why) => return Verdict::Answer(shed_by_system(why)),
    }
    let peer = peer(request);
    let (mut delay, mut out_headers) = (Duration::ZERO, Vec::new());
    let mut meters = Vec::new();
    for (s, section) in sections.iter().enumerate() {
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
        let Some(r) = section.routes.iter().position(|r| r.matches(&view)) else {
            continue;
        };
        let route = &section.routes[r];
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
                Ok(Some(permit)) => held.permits.push(permit),
                // The emergency switch: a domain in shadow is let through its
                // concurrency caps too.
                Ok(None) if gate.limiter.enforcement().is_shadow(&section.domain) => {
                    tracing::debug!(domain = %section.domain, "over its in-flight cap, let through: the domain is in shadow (emergency switch)");
                }
                Ok(None) => return Verdict::Answer(too_many_in_flight(limit.limit)),
                Err(e) => {
                    // Concurrency limits fail open: the rate limits still apply.
                    tracing::warn!(error = %e, "in-flight permits unavailable; admitting");
                }
            }
        }
        // The route's adaptive concurrency: a place, else 503 (or the fallback). Taken
        // before the rate limits, so that a request shed here is not charged.
        if let Some(route_limit) = bound.route(s, r) {
            match route_limit.try_acquire(shedding.now()) {
                Some(place) => held.adaptive.push(place),
                None if gate.limiter.enforcement().is_shadow(&section.domain) => {
                    tracing::debug!(domain = %section.domain, "over its adaptive concurrency limit, let through: the domain is in shadow (emergency switch)");
                }
                None => {
                    route_limit.shed();
                    return Verdict::Answer(match &route.fallback {
                        Some(f) => fallback(f, Vec::new()),
                        None => shed_by_route(),
                    });
                }
            }
        }
        // A `request_bytes` entry costs the declared length; a streamed body is checked
        // here without a charge (refused if the key is over already) and charged as it
        // arrives.
        let (mut descriptors, mut by_bytes) = (Vec::new(), Vec::new());
        for r in &route.rate_limits {
            let Some(entries) = descriptor(&r.actions, &view, form) else {
                continue;
            };
            let hits_addend = match r.cost {
                Cost::Hits => None,
                Cost::RequestBytes => Some(length.unwrap_or(0)),
            };
            if r.cost == Cost::RequestBytes && length.is_none() {
                by_bytes.push(Descriptor {
                    entries: entries.clone(),
                    ..Descriptor::default()
                });
            }
            descriptors.push((
                r.cost,
                Descriptor {
                    entries,
                    hits_addend,
                    ..Descriptor::default()
                },
            ));
        }
        if descriptors.is_empty() {
            continue;
        }
        let costs: Vec<Cost> = descriptors.iter().map(|d| d.0).collect();
        let descriptors = descriptors.into_iter().map(|d| d.1).collect();
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
            // A declared length more than a byte limit could ever admit: no retry helps.
            let too_large = response.statuses.iter().zip(&costs).any(|(s, c)| {
                *c == Cost::RequestBytes
                    && s.code == Code::OverLimit
                    && s.retry_after == crate::decision::NEVER
            });
            if too_large {
                return Verdict::Answer(payload_too_large(length.unwrap_or(0), fields));
            }
            return Verdict::Answer(match &route.fallback {
                Some(f) => fallback(f, fields),
                None => over_limit(&response, fields),
            });
        }
        delay = delay.max(Duration::from_nanos(
            response.statuses.iter().map(|s| s.delay).max().unwrap_or(0),
        ));
        out_headers.extend(fields);
        if !by_bytes.is_empty() {
            meters.push(RateLimitRequest {
                domain: section.domain.clone(),
                descriptors: by_bytes,
                hits_addend: 1,
            });
        }
    }
    Verdict::Pass {
        delay,
        headers: out_headers,
        held,
        meters,
        set: Arc::clone(&snapshot.set),
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

/// 413: the declared body (`length` bytes) is larger than a `request_bytes` limit
/// could ever admit; the RateLimit fields say which, no `Retry-After`.
fn payload_too_large(length: u64, fields: Vec<(&'static str, String)>) -> Response<Body> {
    let mut response = problem(
        StatusCode::PAYLOAD_TOO_LARGE,
        "Payload Too Large",
        &format!(
            "the request body ({length} bytes) is larger than its rate limit admits in a window"
        ),
    );
    let fields = fields
        .into_iter()
        .filter(|(name, _)| !name.eq_ignore_ascii_case("retry-after"));
    append_to(response.headers_mut(), fields.collect());
    response
}

pub(super) fn over_limit(
    response: &RateLimitResponse,
    fields: Vec<(&'static str, String)>,
) -> Response<Body> {
    json_response(
        StatusCode::TOO_MANY_REQUESTS,
        problem_body(response),
        fields,
    )
}

pub(super) fn problem(status: StatusCode, title: &str, detail: &str) -> Response<Body> {
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

/// 503 with `Retry-After: 1`: the gateway sheds load.
fn unavailable(detail: &str) -> Response<Body> {
    let mut r = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "Service Unavailable",
        detail,
    );
    r.headers_mut()
        .insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
    r
}

fn shed_by_route() -> Response<Body> {
    unavailable(
        "the upstream is at its adaptive concurrency limit: its latency shows it is queueing",
    )
}

fn shed_by_system(why: Shed) -> Response<Body> {
    unavailable(match why {
        Shed::Capacity => "the gateway is shedding load: more requests are in flight than the upstream can answer without queueing",
        Shed::Cpu => "the gateway is shedding load: the host's CPU is above its threshold",
    })
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
