//! A real upstream for gateway tests: records each request's path, arrival and
//! X-Forwarded-For; `/stream` sends a chunk every 20 ms until the client goes away;
//! `/hang` never answers; `/upload` reads the request body to its end and records how
//! many bytes came and whether the body ended or failed (an aborted upload).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What the upstream saw of one request: path, arrival, X-Forwarded-For.
pub type Arrival = (String, Instant, Option<String>);

/// What the upstream read of one `/upload` body: its bytes, and whether it ended
/// (false: the body failed, e.g. the gateway aborted the request).
pub type Upload = (u64, bool);

#[derive(Clone, Default)]
pub struct Upstream {
    pub arrivals: Arc<Mutex<Vec<Arrival>>>,
    pub uploads: Arc<Mutex<Vec<Upload>>>,
}

impl Upstream {
    /// The paths of the requests that reached the upstream, in order.
    pub fn paths(&self) -> Vec<String> {
        self.arrivals
            .lock()
            .unwrap()
            .iter()
            .map(|a| a.0.clone())
            .collect()
    }
}

pub async fn upstream_handler(State(up): State<Upstream>, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let xff = req
        .headers()
        .get("x-forwarded-for")
        .map(|v| v.to_str().unwrap().to_string());
    up.arrivals
        .lock()
        .unwrap()
        .push((path.clone(), Instant::now(), xff.clone()));
    if path.starts_with("/stream") {
        let chunks = futures_util::stream::unfold(0u64, |n| async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            Some((Ok::<_, std::io::Error>(format!("chunk {n}\n")), n + 1))
        });
        return Response::new(Body::from_stream(chunks));
    }
    if path.starts_with("/upload") {
        use http_body_util::BodyExt;
        let mut body = req.into_body();
        let (mut bytes, mut ended) = (0u64, true);
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => bytes += frame.data_ref().map_or(0, |d| d.len() as u64),
                Err(_) => {
                    ended = false;
                    break;
                }
            }
        }
        up.uploads.lock().unwrap().push((bytes, ended));
        return Response::new(Body::from(format!("upstream read {bytes} bytes")));
    }
    if path.starts_with("/hang") {
        tokio::time::sleep(Duration::from_secs(60)).await;
    }
    Response::new(Body::from(format!("upstream saw {path}")))
}

pub async fn start_upstream() -> (Upstream, SocketAddr) {
    let up = Upstream::default();
    let app = axum::Router::new()
        .fallback(upstream_handler)
        .with_state(up.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (up, addr)
}

/// Sends a raw GET and returns the status line's code and the open stream.
pub async fn raw_get(addr: &str, path: &str) -> (u16, tokio::net::TcpStream) {
    raw_request(addr, &format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n")).await
}

/// Sends `request` (raw HTTP/1.1, written as given) on a new connection and returns
/// the status line's code and the open stream.
pub async fn raw_request(addr: &str, request: &str) -> (u16, tokio::net::TcpStream) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 1024];
    let n = s.read(&mut buf).await.unwrap();
    let head = String::from_utf8_lossy(&buf[..n]).to_string();
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, s)
}

/// Sends `GET path` to `addr` every 50 ms until it answers 200; panics with `what`
/// after 5 s (e.g. a concurrency permit that is never given back).
pub async fn wait_for_200(addr: &str, path: &str, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (code, _) = raw_get(addr, path).await;
        if code == 200 {
            return;
        }
        assert!(Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
