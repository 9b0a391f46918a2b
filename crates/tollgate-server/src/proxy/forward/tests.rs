//! `forward.rs`'s tests: real upstreams on loopback, real clients.

use super::*;

use std::net::SocketAddr;
use std::time::Instant;

use axum::extract::ConnectInfo;
use http::header::HeaderMap;
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
