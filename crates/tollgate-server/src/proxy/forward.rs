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
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use bytes::{BufMut, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme, Uri};
use http::{Request, Response, StatusCode, Version};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

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
    log: FailureLog,
}

/// At most one warning per second, with the number of failures it stands for.
#[derive(Default)]
struct FailureLog {
    /// The second (since `start`) of the last warning.
    last: std::sync::atomic::AtomicU64,
    /// Failures since the last warning.
    pending: std::sync::atomic::AtomicU64,
    start: std::sync::OnceLock<std::time::Instant>,
}

impl FailureLog {
    /// How many failures the caller's warning should report (including this one), or
    /// `None` when a warning went out less than a second ago.
    fn admit(&self) -> Option<u64> {
        use std::sync::atomic::Ordering::Relaxed;
        self.pending.fetch_add(1, Relaxed);
        let start = self.start.get_or_init(std::time::Instant::now);
        let second = start.elapsed().as_secs() + 1;
        let last = self.last.load(Relaxed);
        if last == second
            || self
                .last
                .compare_exchange(last, second, Relaxed, Relaxed)
                .is_err()
        {
            return None;
        }
        Some(self.pending.swap(0, Relaxed).max(1))
    }
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
                log: FailureLog::default(),
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
        // RFC 9112 §3.2: an HTTP/1.1 request carries exactly one Host (a repeated one is
        // refused before the decision, by the rate limit layer).
        if req.version() == http::Version::HTTP_11 && !req.headers().contains_key(header::HOST) {
            let detail = "an HTTP/1.1 request carries exactly one Host header";
            return problem(StatusCode::BAD_REQUEST, detail);
        }
        let req = match inner.prepare(req) {
            Ok(req) => req,
            Err(detail) => {
                if let Some(failures) = inner.log.admit() {
                    tracing::warn!(upstream = %inner.authority, error = %detail, failures, "cannot forward request");
                }
                return problem(StatusCode::BAD_GATEWAY, &detail);
            }
        };
        let sent = tokio::time::timeout(inner.settings.response_timeout, inner.client.request(req));
        match sent.await {
            Ok(Ok(resp)) => {
                let (mut parts, body) = resp.into_parts();
                strip_hop_by_hop(&mut parts.headers);
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
                                "connecting to upstream {} timed out after {:?}",
                                inner.authority, inner.settings.connect_timeout
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
                if let Some(failures) = inner.log.admit() {
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
                    "upstream {} sent no response within {:?}",
                    inner.authority, inner.settings.response_timeout
                );
                if let Some(failures) = inner.log.admit() {
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

        // The Host as the client sent it; HTTP/2 clients send `:authority`.
        let original_host = parts.headers.get(header::HOST).cloned().or_else(|| {
            parts
                .uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });

        strip_hop_by_hop(&mut parts.headers);

        if let Some(host) = &original_host {
            if !parts.headers.contains_key(header::HOST) {
                parts.headers.insert(header::HOST, host.clone());
            }
        }

        if let Some(ConnectInfo(addr)) = parts.extensions.get::<ConnectInfo<SocketAddr>>() {
            append_forwarded_for(&mut parts.headers, *addr);
        }
        if !parts.headers.contains_key(X_FORWARDED_PROTO) {
            parts
                .headers
                .insert(X_FORWARDED_PROTO, HeaderValue::from_static(self.scheme()));
        }
        if let Some(host) = original_host {
            if !parts.headers.contains_key(X_FORWARDED_HOST) {
                parts.headers.insert(X_FORWARDED_HOST, host);
            }
        }

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

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Hop-by-hop headers that are never forwarded (RFC 9110 §7.6.1), in
/// addition to the ones named in `Connection`.
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
];

/// Removes the hop-by-hop headers and every header named by `Connection`.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
        .collect();
    // One pass over the few names a message has, rather than a hashed lookup for each
    // of the nine (this runs twice per forwarded request).
    let listed: Vec<HeaderName> = headers
        .keys()
        .filter(|name| HOP_BY_HOP.contains(name))
        .cloned()
        .collect();
    for name in named.into_iter().chain(listed) {
        headers.remove(name);
    }
}

/// Appends `addr`'s IP to `X-Forwarded-For`, joining all existing values
/// into one with `", "`.
fn append_forwarded_for(headers: &mut HeaderMap, addr: SocketAddr) {
    let ip = addr.ip().to_canonical().to_string();
    let mut value = BytesMut::new();
    for existing in headers.get_all(&X_FORWARDED_FOR) {
        let existing = trim_ascii(existing.as_bytes());
        if existing.is_empty() {
            continue;
        }
        if !value.is_empty() {
            value.put_slice(b", ");
        }
        value.put_slice(existing);
    }
    if !value.is_empty() {
        value.put_slice(b", ");
    }
    value.put_slice(ip.as_bytes());
    match HeaderValue::from_maybe_shared(value.freeze()) {
        Ok(joined) => {
            headers.insert(X_FORWARDED_FOR, joined);
        }
        Err(_) => {
            // Cannot happen for values that came from a valid header map,
            // but never drop the client's address.
            if let Ok(ip) = HeaderValue::from_str(&ip) {
                headers.append(X_FORWARDED_FOR, ip);
            }
        }
    }
}

fn trim_ascii(mut bytes: &[u8]) -> &[u8] {
    while let [first, rest @ ..] = bytes {
        if first.is_ascii_whitespace() {
            bytes = rest;
        } else {
            break;
        }
    }
    while let [rest @ .., last] = bytes {
        if last.is_ascii_whitespace() {
            bytes = rest;
        } else {
            break;
        }
    }
    bytes
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
mod tests {
    #[test]
    fn a_failing_upstream_is_logged_at_most_once_a_second_with_a_count() {
        let log = FailureLog::default();
        assert_eq!(log.admit(), Some(1));
        let quiet = (0..1_000).filter(|_| log.admit().is_some()).count();
        assert_eq!(quiet, 0, "no warning within the same second");
        std::thread::sleep(std::time::Duration::from_millis(1_100));
        assert_eq!(
            log.admit(),
            Some(1_001),
            "the next one counts what was held back"
        );
    }

    use super::*;

    use std::time::Instant;

    use http_body_util::BodyExt;
    use hyper::body::{Body as HttpBody, Frame, SizeHint};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio::sync::mpsc;
    use tower::ServiceExt;

    /// What the test upstream saw.
    #[derive(Debug)]
    struct Seen {
        method: http::Method,
        uri: Uri,
        headers: HeaderMap,
        body: Bytes,
    }

    /// An axum upstream that reports each request and answers `201` with
    /// `x-reply: ok` and body `reply-body`.
    async fn echo_upstream() -> (SocketAddr, mpsc::UnboundedReceiver<Seen>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let app = axum::Router::new().fallback(move |req: Request<Body>| {
            let tx = tx.clone();
            async move {
                let (parts, body) = req.into_parts();
                let body = body.collect().await.unwrap().to_bytes();
                tx.send(Seen {
                    method: parts.method,
                    uri: parts.uri,
                    headers: parts.headers,
                    body,
                })
                .unwrap();
                Response::builder()
                    .status(StatusCode::CREATED)
                    .header("x-reply", "ok")
                    .body(Body::from("reply-body"))
                    .unwrap()
            }
        });
        (serve(app).await, rx)
    }

    async fn serve(app: axum::Router) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
            .unwrap();
        });
        addr
    }

    fn upstream(addr: SocketAddr, path: &str) -> Upstream {
        Upstream::new(&format!("http://{addr}{path}"), ForwardSettings::default()).unwrap()
    }

    /// A body producing `chunks` chunks of `chunk` bytes each, one at a time.
    struct Chunked {
        left: usize,
        chunk: usize,
    }

    impl HttpBody for Chunked {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            if self.left == 0 {
                return Poll::Ready(None);
            }
            self.left -= 1;
            let byte = (self.left % 251) as u8;
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![byte; self.chunk])))))
        }

        fn size_hint(&self) -> SizeHint {
            SizeHint::default()
        }
    }

    async fn problem_of(resp: Response<Body>) -> (StatusCode, serde_json::Value) {
        let status = resp.status();
        assert_eq!(
            resp.headers().get(header::CONTENT_TYPE).unwrap(),
            "application/problem+json"
        );
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&body).unwrap())
    }

    #[tokio::test]
    async fn forward_passes_request_and_response_through() {
        let (up_addr, mut seen) = echo_upstream().await;
        let proxy = serve(axum::Router::new().fallback_service(upstream(up_addr, ""))).await;

        let resp = reqwest::Client::new()
            .put(format!("http://{proxy}/a/b%20c?x=1&y=two"))
            .header("x-custom", "value-1")
            .body("request-body")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::CREATED);
        assert_eq!(resp.headers()["x-reply"], "ok");
        assert_eq!(resp.text().await.unwrap(), "reply-body");

        let seen = seen.recv().await.unwrap();
        assert_eq!(seen.method, http::Method::PUT);
        assert_eq!(seen.uri.path(), "/a/b%20c");
        assert_eq!(seen.uri.query(), Some("x=1&y=two"));
        assert_eq!(seen.body, "request-body");
        assert_eq!(seen.headers["x-custom"], "value-1");
        // Host is passed through as the client sent it.
        let client_host = proxy.to_string();
        assert_eq!(seen.headers[header::HOST], client_host.as_str());
        assert_eq!(seen.headers["x-forwarded-host"], client_host.as_str());
        assert_eq!(seen.headers["x-forwarded-proto"], "http");
        assert_eq!(seen.headers["x-forwarded-for"], "127.0.0.1");
    }

    #[tokio::test]
    async fn forward_prefixes_base_path() {
        let (up_addr, mut seen) = echo_upstream().await;
        let svc = upstream(up_addr, "/base/");
        let req = Request::get("/items?id=7")
            .header(header::HOST, "example.test")
            .header("x-forwarded-proto", "https")
            .body(Body::empty())
            .unwrap();
        let resp = svc.oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::CREATED);
        let seen = seen.recv().await.unwrap();
        assert_eq!(seen.uri.path(), "/base/items");
        assert_eq!(seen.uri.query(), Some("id=7"));
        assert_eq!(seen.headers[header::HOST], "example.test");
        // Existing X-Forwarded-Proto is kept; no ConnectInfo: no XFF.
        assert_eq!(seen.headers["x-forwarded-proto"], "https");
        assert!(!seen.headers.contains_key("x-forwarded-for"));
    }

    /// Reads a request head (up to the blank line) from `stream`.
    async fn read_head(stream: &mut tokio::net::TcpStream) -> String {
        let mut buf = Vec::new();
        let mut byte = [0u8; 1024];
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = stream.read(&mut byte).await.unwrap();
            assert!(n > 0, "upstream connection closed before head");
            buf.extend_from_slice(&byte[..n]);
        }
        String::from_utf8(buf).unwrap()
    }

    fn header_names(head: &str) -> Vec<String> {
        head.lines()
            .skip(1)
            .filter_map(|l| l.split_once(':'))
            .map(|(n, _)| n.trim().to_ascii_lowercase())
            .collect()
    }

    #[tokio::test]
    async fn forward_strips_hop_by_hop_headers_both_ways() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (head_tx, mut head_rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let head = read_head(&mut stream).await;
            head_tx.send(head).unwrap();
            stream
                .write_all(
                    b"HTTP/1.1 200 OK\r\n\
                      Connection: x-bar, keep-alive\r\n\
                      Keep-Alive: timeout=5\r\n\
                      X-Bar: secret\r\n\
                      Proxy-Authenticate: Basic\r\n\
                      Proxy-Connection: keep-alive\r\n\
                      Upgrade: h2c\r\n\
                      Trailer: x-checksum\r\n\
                      X-End-To-End: kept\r\n\
                      Transfer-Encoding: chunked\r\n\
                      \r\n\
                      5\r\nhello\r\n0\r\n\r\n",
                )
                .await
                .unwrap();
            // Keep the connection open until the client is done.
            let mut rest = Vec::new();
            let _ = stream.read_to_end(&mut rest).await;
        });

        let req = Request::post("/hop")
            .header(header::HOST, "client.test")
            .header(header::CONNECTION, "x-foo, keep-alive")
            .header("x-foo", "must-go")
            .header("keep-alive", "timeout=5")
            .header("proxy-connection", "keep-alive")
            .header(header::TE, "trailers")
            .header(header::TRAILER, "x-checksum")
            .header(header::UPGRADE, "websocket")
            .header(header::PROXY_AUTHORIZATION, "Basic Zm9vOmJhcg==")
            .header("x-keep", "yes")
            .body(Body::from("abc"))
            .unwrap();
        let resp = upstream(addr, "").oneshot(req).await.unwrap();

        let head = head_rx.recv().await.unwrap();
        let names = header_names(&head);
        for gone in [
            "connection",
            "x-foo",
            "keep-alive",
            "proxy-connection",
            "te",
            "trailer",
            "upgrade",
            "proxy-authorization",
            "transfer-encoding",
        ] {
            assert!(!names.iter().any(|n| n == gone), "{gone} forwarded: {head}");
        }
        assert!(names.iter().any(|n| n == "x-keep"), "{head}");
        assert!(head.starts_with("POST /hop HTTP/1.1\r\n"), "{head}");

        assert_eq!(resp.status(), StatusCode::OK);
        for gone in [
            "connection",
            "keep-alive",
            "x-bar",
            "proxy-authenticate",
            "proxy-connection",
            "upgrade",
            "trailer",
            "transfer-encoding",
        ] {
            assert!(
                !resp.headers().contains_key(gone),
                "{gone} returned: {:?}",
                resp.headers()
            );
        }
        assert_eq!(resp.headers()["x-end-to-end"], "kept");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "hello");
    }

    #[tokio::test]
    async fn forward_appends_client_ip_to_x_forwarded_for() {
        let (up_addr, mut seen) = echo_upstream().await;
        let client: SocketAddr = "203.0.113.7:5555".parse().unwrap();
        let mut req = Request::get("/")
            .header(header::HOST, "client.test")
            .header("x-forwarded-for", "198.51.100.1")
            .header("x-forwarded-for", "198.51.100.2")
            .body(Body::empty())
            .unwrap();
        req.extensions_mut().insert(ConnectInfo(client));
        let resp = upstream(up_addr, "").oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::CREATED);
        let seen = seen.recv().await.unwrap();
        let xff: Vec<_> = seen.headers.get_all("x-forwarded-for").iter().collect();
        assert_eq!(xff, ["198.51.100.1, 198.51.100.2, 203.0.113.7"]);
    }

    #[tokio::test]
    async fn forward_streams_large_bodies() {
        const CHUNK: usize = 64 * 1024;
        const CHUNKS: usize = 128; // 8 MiB
        let app = axum::Router::new()
            .route(
                "/download",
                axum::routing::get(|| async {
                    Body::new(Chunked {
                        left: CHUNKS,
                        chunk: CHUNK,
                    })
                }),
            )
            .route(
                "/upload",
                axum::routing::post(|body: Body| async move {
                    let mut body = body;
                    let mut total = 0usize;
                    while let Some(frame) = body.frame().await {
                        if let Ok(data) = frame.unwrap().into_data() {
                            total += data.len();
                        }
                    }
                    total.to_string()
                }),
            );
        let addr = serve(app).await;
        let svc = upstream(addr, "");

        // Download: count and check the bytes frame by frame.
        let req = Request::get("/download")
            .header("host", "client.example")
            .body(Body::empty())
            .unwrap();
        let resp = svc.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let mut body = resp.into_body();
        let mut total = 0usize;
        let mut frames = 0usize;
        while let Some(frame) = body.frame().await {
            let data = frame.unwrap().into_data().unwrap();
            frames += 1;
            // Chunk k (in sending order) is filled with `(CHUNKS - 1 - k) % 251`.
            for (i, &b) in data.iter().enumerate() {
                let k = (total + i) / CHUNK;
                assert_eq!(b, ((CHUNKS - 1 - k) % 251) as u8, "byte {}", total + i);
            }
            total += data.len();
        }
        assert_eq!(total, CHUNK * CHUNKS);
        assert!(frames > 1, "body arrived in a single frame");

        // Upload: a streamed request body of unknown length.
        let req = Request::post("/upload")
            .header("host", "client.example")
            .body(Body::new(Chunked {
                left: CHUNKS,
                chunk: CHUNK,
            }))
            .unwrap();
        let resp = svc.oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, (CHUNK * CHUNKS).to_string());
    }

    #[tokio::test]
    async fn forward_nothing_listening_is_502() {
        let addr = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap()
        };
        let req = Request::get("/")
            .header("host", "client.example")
            .body(Body::empty())
            .unwrap();
        let resp = upstream(addr, "").oneshot(req).await.unwrap();
        let (status, problem) = problem_of(resp).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY);
        assert_eq!(problem["type"], "about:blank");
        assert_eq!(problem["title"], "Bad Gateway");
        assert_eq!(problem["status"], 502);
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.contains(&addr.to_string()), "{detail}");
    }

    #[tokio::test]
    async fn forward_upstream_reset_before_head_is_502() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let _ = read_head(&mut stream).await;
            drop(stream);
        });
        let req = Request::get("/")
            .header("host", "client.example")
            .body(Body::empty())
            .unwrap();
        let resp = upstream(addr, "").oneshot(req).await.unwrap();
        let (status, problem) = problem_of(resp).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY);
        assert_eq!(problem["status"], 502);
    }

    #[tokio::test]
    async fn forward_silent_upstream_is_504() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            while let Ok(n) = stream.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_secs(30)).await;
        });
        let settings = ForwardSettings {
            response_timeout: Duration::from_millis(200),
            ..ForwardSettings::default()
        };
        let svc = Upstream::new(&format!("http://{addr}"), settings).unwrap();
        let started = Instant::now();
        let req = Request::get("/")
            .header("host", "client.example")
            .body(Body::empty())
            .unwrap();
        let resp = svc.oneshot(req).await.unwrap();
        let (status, problem) = problem_of(resp).await;
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(problem["title"], "Gateway Timeout");
        assert_eq!(problem["status"], 504);
    }

    #[test]
    fn forward_upstream_url_validation() {
        let s = ForwardSettings::default();
        assert!(Upstream::new("https://example.test", s)
            .unwrap_err()
            .contains("only http://"));
        assert!(Upstream::new("example.test:80", s).is_err());
        assert!(Upstream::new("http://example.test/x?q=1", s).is_err());
        assert!(Upstream::new("not a url", s).is_err());
        let up = Upstream::new("http://example.test:8080/api/", s).unwrap();
        assert_eq!(up.authority(), "example.test:8080");
        let uri = up
            .inner
            .upstream_uri(&"/v1/x?y=1".parse().unwrap())
            .unwrap();
        assert_eq!(uri, "http://example.test:8080/api/v1/x?y=1");
    }
}
