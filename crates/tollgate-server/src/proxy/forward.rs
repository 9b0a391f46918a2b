//! Forwarding of admitted requests to one upstream HTTP server.
//!
//! [`Upstream`] is a [`tower::Service`] that sends an incoming request to a
//! single `http://host:port[/base-path]` upstream over pooled, kept-alive
//! HTTP/1.1 connections and streams the answer back. Bodies are streamed in
//! both directions and never buffered whole.
//!
//! What is forwarded, following RFC 9110 §7.6.1:
//!
//! - the method, the path and the query unchanged; the URI is rewritten to
//!   the upstream's scheme and authority, with the upstream's base path (if
//!   any) prefixed to the path;
//! - every end-to-end header, including `Host` exactly as the client sent it
//!   (for HTTP/2 clients, the `:authority` becomes `Host`);
//! - `X-Forwarded-For`: the client's IP (from the
//!   [`ConnectInfo<SocketAddr>`](axum::extract::ConnectInfo) request
//!   extension, when present) is appended to any existing value;
//! - `X-Forwarded-Proto: http` (`https` when the gateway serves TLS) and
//!   `X-Forwarded-Host: <original Host>` are added when the client did not send them;
//! - the response's status, end-to-end headers and body.
//!
//! What is removed, from the request and from the response: the hop-by-hop
//! headers `Connection`, `Keep-Alive`, `Proxy-Connection`, `TE`, `Trailer`,
//! `Transfer-Encoding`, `Upgrade`, `Proxy-Authenticate`,
//! `Proxy-Authorization`, and every header named in the `Connection`
//! header's value. Protocol upgrades (e.g. WebSocket) are therefore not
//! forwarded.
//!
//! Failures never surface as service errors: a connection that cannot be
//! established or that fails before the response head arrives answers
//! `502 Bad Gateway`; a connect timeout, or no response head within
//! [`ForwardSettings::response_timeout`], answers `504 Gateway Timeout`. Both
//! carry an RFC 9457 `application/problem+json` body.

use std::convert::Infallible;
use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme, Uri};
use http::{Request, Response, StatusCode, Version};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::time::Instant;
use tollgate::throttle::Throttle;

use super::headers;

/// At most one failure warning per upstream this often, with the number of failures it
/// stands for.
const FAILURE_LOG_EVERY: Duration = Duration::from_secs(1);

/// Timeouts used when talking to the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardSettings {
    /// Maximum time to establish a TCP connection to the upstream
    /// (default 2 s). Exceeding it answers `504 Gateway Timeout`.
    pub connect_timeout: Duration,
    /// Maximum time from sending the request until the upstream's response
    /// head (status and headers) arrives, connecting included (default 30 s).
    /// Exceeding it answers `504 Gateway Timeout`. The response body is not
    /// subject to this timeout.
    pub response_timeout: Duration,
    /// How long an idle pooled keep-alive connection is kept open before it
    /// is closed (default 90 s).
    pub idle_timeout: Duration,
    /// Whether clients reach the gateway over TLS: the `X-Forwarded-Proto` added
    /// upstream is then `https` (default false: `http`).
    pub client_tls: bool,
}

impl Default for ForwardSettings {
    fn default() -> Self {
        ForwardSettings {
            connect_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(90),
            client_tls: false,
        }
    }
}

/// One upstream HTTP server that requests are forwarded to.
///
/// Cheap to clone: all clones share one connection pool.
#[derive(Clone)]
pub struct Upstream {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client<HttpConnector, Body>,
    scheme: Scheme,
    authority: Authority,
    /// Base path without trailing `/`; empty when the upstream has none.
    base_path: String,
    settings: ForwardSettings,
    /// Throttles the failure log: an upstream that is down fails every request.
    log: Throttle,
}

impl fmt::Debug for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Upstream")
            .field("authority", &self.inner.authority)
            .field("base_path", &self.inner.base_path)
            .field("settings", &self.inner.settings)
            .finish()
    }
}

impl Upstream {
    /// Creates an upstream from a URL of the form `http://host:port[/base-path]`.
    ///
    /// The port defaults to 80. Only the `http` scheme is supported; a URL
    /// with another scheme, without a host, with user info, or with a query
    /// is rejected with a description of the problem.
    ///
    /// Construction starts no task and opens no connection; requests must be
    /// sent from within a Tokio runtime.
    pub fn new(url: &str, settings: ForwardSettings) -> Result<Upstream, String> {
        let uri: Uri = url
            .parse()
            .map_err(|e| format!("invalid upstream URL {url:?}: {e}"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => {
                return Err(format!(
                "unsupported upstream URL scheme {other:?} in {url:?}: only http:// is supported"
            ))
            }
            None => return Err(format!("upstream URL {url:?} must start with http://")),
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("upstream URL {url:?} has no host"))?;
        if authority.host().is_empty() {
            return Err(format!("upstream URL {url:?} has no host"));
        }
        if authority.as_str().contains('@') {
            return Err(format!(
                "upstream URL {url:?} must not contain user information"
            ));
        }
        if uri.query().is_some() {
            return Err(format!("upstream URL {url:?} must not contain a query"));
        }
        let base_path = uri.path().trim_end_matches('/').to_owned();

        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(settings.connect_timeout));
        connector.set_nodelay(true);
        connector.enforce_http(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(settings.idle_timeout)
            .pool_timer(TokioTimer::new())
            .build(connector);

        Ok(Upstream {
            inner: Arc::new(Inner {
                client,
                scheme: Scheme::HTTP,
                authority,
                base_path,
                settings,
                log: Throttle::new(FAILURE_LOG_EVERY),
            }),
        })
    }

    /// The upstream's `host:port` authority, as given to [`Upstream::new`].
    pub fn authority(&self) -> &str {
        self.inner.authority.as_str()
    }

    /// Forwards one request and returns the upstream's response, or a
    /// `502`/`504` problem response when the upstream could not answer.
    async fn forward(self, req: Request<Body>) -> Response<Body> {
        let inner = &self.inner;
        // RFC 9112 §3.2: an HTTP/1.1 request carries exactly one Host. The rate limit
        // layer refuses a missing or repeated one before the decision; this is for a
        // forwarder used without it.
        if req.version() == http::Version::HTTP_11 && !req.headers().contains_key(header::HOST) {
            let detail = "an HTTP/1.1 request carries exactly one Host header";
            return problem(StatusCode::BAD_REQUEST, detail);
        }
        let req = match inner.prepare(req) {
            Ok(req) => req,
            Err(detail) => {
                if let Some(failures) = inner.log.hit(Instant::now().into_std()) {
                    tracing::warn!(upstream = %inner.authority, error = %detail, failures, "cannot forward request");
                }
                return problem(StatusCode::BAD_GATEWAY, &detail);
            }
        };
        let sent = tokio::time::timeout(inner.settings.response_timeout, inner.client.request(req));
        match sent.await {
            Ok(Ok(resp)) => {
                let (mut parts, body) = resp.into_parts();
                headers::from_upstream(&mut parts.headers);
                parts.version = Version::HTTP_11;
                Response::from_parts(parts, Body::new(body))
            }
            Ok(Err(err)) => {
                let chain = crate::error_chain(&err);
                let (status, detail) = if err.is_connect() {
                    if has_io_kind(&err, io::ErrorKind::TimedOut) {
                        (
                            StatusCode::GATEWAY_TIMEOUT,
                            format!(
                                "connecting to upstream {} timed out after {}",
                                inner.authority,
                                crate::HumanDuration(inner.settings.connect_timeout)
                            ),
                        )
                    } else if has_io_kind(&err, io::ErrorKind::ConnectionRefused) {
                        (
                            StatusCode::BAD_GATEWAY,
                            format!("upstream {} refused the connection", inner.authority),
                        )
                    } else {
                        (
                            StatusCode::BAD_GATEWAY,
                            format!("could not connect to upstream {}", inner.authority),
                        )
                    }
                } else {
                    (
                        StatusCode::BAD_GATEWAY,
                        format!(
                            "upstream {} failed before sending a response",
                            inner.authority
                        ),
                    )
                };
                if let Some(failures) = inner.log.hit(Instant::now().into_std()) {
                    tracing::warn!(
                        upstream = %inner.authority,
                        status = status.as_u16(),
                        error = %chain,
                        failures,
                        "upstream request failed (failures: since the last warning, at most one a second)"
                    );
                }
                problem(status, &detail)
            }
            Err(_elapsed) => {
                let detail = format!(
                    "upstream {} sent no response within {}",
                    inner.authority,
                    crate::HumanDuration(inner.settings.response_timeout)
                );
                if let Some(failures) = inner.log.hit(Instant::now().into_std()) {
                    tracing::warn!(
                        upstream = %inner.authority,
                        status = 504,
                        error = "response timeout",
                        failures,
                        "upstream request failed (failures: since the last warning, at most one a second)"
                    );
                }
                problem(StatusCode::GATEWAY_TIMEOUT, &detail)
            }
        }
    }
}

impl Inner {
    /// The scheme clients used to reach the gateway.
    fn scheme(&self) -> &'static str {
        if self.settings.client_tls {
            "https"
        } else {
            "http"
        }
    }

    /// Rewrites a client request into the request sent upstream.
    fn prepare(&self, req: Request<Body>) -> Result<Request<Body>, String> {
        let (mut parts, body) = req.into_parts();
        headers::to_upstream(&mut parts, self.scheme());
        parts.uri = self.upstream_uri(&parts.uri)?;
        parts.version = Version::HTTP_11;
        Ok(Request::from_parts(parts, body))
    }

    /// The upstream URI for a client request URI: upstream scheme and
    /// authority, base path prefixed, original path and query kept.
    fn upstream_uri(&self, original: &Uri) -> Result<Uri, String> {
        let path_and_query = original.path_and_query().map_or("/", PathAndQuery::as_str);
        let path_and_query = if self.base_path.is_empty() {
            PathAndQuery::try_from(path_and_query)
        } else if path_and_query.starts_with('/') {
            PathAndQuery::try_from(format!("{}{path_and_query}", self.base_path))
        } else {
            PathAndQuery::try_from(format!("{}/{path_and_query}", self.base_path))
        }
        .map_err(|e| format!("invalid request path: {e}"))?;
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(path_and_query)
            .build()
            .map_err(|e| format!("invalid upstream request URI: {e}"))
    }
}

impl tower::Service<Request<Body>> for Upstream {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.forward(req).await) })
    }
}

/// Whether any error in `err`'s source chain is an I/O error of `kind`.
fn has_io_kind(err: &(dyn StdError + 'static), kind: io::ErrorKind) -> bool {
    let mut current = Some(err);
    while let Some(e) = current {
        if e.downcast_ref::<io::Error>()
            .is_some_and(|io| io.kind() == kind)
        {
            return true;
        }
        current = e.source();
    }
    false
}

/// An RFC 9457 problem response.
fn problem(status: StatusCode, detail: &str) -> Response<Body> {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or("Error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut resp = Response::new(Body::from(Bytes::from(body.to_string())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    resp
}

#[cfg(test)]
mod tests;
