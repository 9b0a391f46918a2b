//! `cost: request_bytes` end to end: a real upstream on loopback, the `tollgate proxy`
//! binary in front of it, real HTTP requests. A 10 KB-per-minute limit per API key:
//! uploads with a Content-Length admitted until the bytes run out, then 429; one larger
//! than the whole limit 413; a chunked upload charged as it streams and refused
//! mid-body with 429, the upstream seeing its request aborted; the metrics counting it.
//! On the in-memory store and on a real Redis.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

#[path = "../../tollgate/tests/support/redis_server.rs"]
mod redis_server;
mod support;

use std::time::{Duration, Instant};

use redis_server::RedisServer;
use reqwest::{Client, StatusCode};
use support::upstream::{start_upstream, wait_for_200, Upload, Upstream};
use support::{tempdir, Proxy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const UPLOADS: &str = r#"domain: uploads
descriptors:
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 10000, name: upload_bytes}
  - key: calls
    rate_limit: {unit: minute, requests_per_unit: 1000, name: calls}
http:
  routes:
    - match: {path_prefix: /upload}
      rate_limits:
        # 10,000 bytes of request bodies per minute per API key.
        - actions: [{request_headers: {header_name: x-api-key, descriptor_key: api_key}}]
          cost: request_bytes
        # And every upload, whatever its size, counts one call.
        - actions: [{generic_key: {descriptor_key: calls, descriptor_value: all}}]
"#;

async fn gateway(name: &str, extra: &[&str]) -> (Upstream, Proxy) {
    // The tests count against per-minute limits from here on.
    support::minute::away_from_a_minute_boundary(10);
    let (up, addr) = start_upstream().await;
    let dir = tempdir(name);
    std::fs::write(dir.join("uploads.yaml"), UPLOADS).unwrap();
    let proxy = Proxy::start(&dir, &format!("http://{addr}"), extra).await;
    (up, proxy)
}

async fn upload(c: &Client, proxy: &Proxy, key: &str, bytes: usize) -> reqwest::Response {
    c.post(format!("{}/upload", proxy.url))
        .header("x-api-key", key)
        .body(vec![b'x'; bytes])
        .send()
        .await
        .unwrap()
}

/// The uploads the upstream has recorded, once there are `n` (within 5 s).
async fn uploads(up: &Upstream, n: usize) -> Vec<Upload> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let seen = up.uploads.lock().unwrap().clone();
        if seen.len() >= n || Instant::now() > deadline {
            return seen;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends a chunked `POST /upload` for `key` on a raw connection, `chunks` of `size`
/// bytes with a pause after each (so each is charged alone), and returns the answer's
/// head and the number of chunks written before the answer came or the gateway stopped
/// reading.
async fn chunked_upload(addr: &str, key: &str, chunks: usize, size: usize) -> (String, usize) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /upload HTTP/1.1\r\nhost: t\r\nx-api-key: {key}\r\ntransfer-encoding: chunked\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let (mut read, mut write) = s.into_split();
    let writer = tokio::spawn(async move {
        let mut sent = 0;
        for _ in 0..chunks {
            let chunk = format!("{size:x}\r\n{}\r\n", "x".repeat(size));
            if write.write_all(chunk.as_bytes()).await.is_err() {
                break;
            }
            sent += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = write.write_all(b"0\r\n\r\n").await;
        // Kept open until the answer is read.
        (sent, write)
    });
    let mut answer = Vec::new();
    let mut buf = vec![0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(10);
    while !String::from_utf8_lossy(&answer).contains("\r\n\r\n") {
        let n = tokio::time::timeout_at(deadline.into(), read.read(&mut buf))
            .await
            .expect("an answer within 10 s")
            .unwrap();
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&buf[..n]);
    }
    let (sent, _write) = writer.await.unwrap();
    (String::from_utf8_lossy(&answer).to_string(), sent)
}

fn status_of(head: &str) -> u16 {
    head.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn declared_lengths_are_charged_up_front_and_one_past_the_whole_limit_is_413() {
    declared_lengths("bytes-declared", &[]).await;
}

#[tokio::test]
async fn declared_lengths_are_charged_up_front_on_redis() {
    let redis = RedisServer::start();
    declared_lengths("bytes-declared-redis", &["--store", &redis.url()]).await;
}

#[tokio::test]
async fn a_streamed_body_is_charged_as_it_arrives_and_refused_mid_stream() {
    streamed("bytes-streamed", &[]).await;
}

#[tokio::test]
async fn a_streamed_body_is_charged_as_it_arrives_on_redis() {
    let redis = RedisServer::start();
    streamed("bytes-streamed-redis", &["--store", &redis.url()]).await;
}

/// Uploads with a Content-Length, on the store `extra` names (memory by default).
async fn declared_lengths(name: &str, extra: &[&str]) {
    let (up, proxy) = gateway(name, extra).await;
    let c = Client::new();
    for left in [6000, 2000] {
        let r = upload(&c, &proxy, "alice", 4000).await;
        assert_eq!(r.status(), StatusCode::OK);
        let rl = r.headers()["ratelimit"].to_str().unwrap().to_string();
        assert!(
            rl.contains(&format!("\"upload_bytes\";r={left};t=")),
            "{rl}"
        );
        assert_eq!(r.text().await.unwrap(), "upstream read 4000 bytes");
    }
    // 4,000 more do not fit in the 2,000 left: refused before the body is read.
    let r = upload(&c, &proxy, "alice", 4000).await;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(r.headers().contains_key("retry-after"));
    assert!(r.headers()["ratelimit"]
        .to_str()
        .unwrap()
        .contains("\"upload_bytes\";r=2000;"));
    // What is left still passes; then nothing does.
    assert_eq!(upload(&c, &proxy, "alice", 2000).await.status(), 200);
    assert_eq!(upload(&c, &proxy, "alice", 1).await.status(), 429);
    // Another key has its own bytes; an empty body costs none of them.
    assert_eq!(upload(&c, &proxy, "bob", 0).await.status(), 200);
    // A body larger than the whole limit can never pass: 413, no Retry-After.
    let r = upload(&c, &proxy, "bob", 10_001).await;
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(!r.headers().contains_key("retry-after"));
    assert!(r.headers().contains_key("ratelimit-policy"));
    // Exactly the limit fits.
    assert_eq!(upload(&c, &proxy, "bob", 10_000).await.status(), 200);
    assert_eq!(
        uploads(&up, 5).await,
        [
            (4000, true),
            (4000, true),
            (2000, true),
            (0, true),
            (10_000, true)
        ],
        "no refused body went upstream"
    );
}

/// Chunked uploads charged as they stream, on the store `extra` names.
async fn streamed(name: &str, extra: &[&str]) {
    let admin = format!("127.0.0.1:{}", support::free_port());
    let mut args = vec!["--admin-listen", admin.as_str()];
    args.extend_from_slice(extra);
    let (up, proxy) = gateway(name, &args).await;
    wait_for_200(&admin, "/readyz", "the admin listener").await;
    // 3 × 1,000 bytes fit: forwarded whole, and charged.
    let (head, sent) = chunked_upload(&proxy.addr, "carol", 3, 1000).await;
    assert_eq!((status_of(&head), sent), (200, 3), "{head}");
    assert_eq!(uploads(&up, 1).await, [(3000, true)]);
    let c = Client::new();
    assert_eq!(upload(&c, &proxy, "carol", 7001).await.status(), 429);

    // 4 × 4,000 bytes do not: the third chunk is refused (2,000 left), the upstream
    // request aborted after the 8,000 bytes charged, and the client answered 429.
    let (head, _) = chunked_upload(&proxy.addr, "dave", 4, 4000).await;
    assert_eq!(status_of(&head), 429, "{head}");
    let lower = head.to_ascii_lowercase();
    assert!(lower.contains("\r\nretry-after: "), "{head}");
    assert!(
        lower.contains("\r\nratelimit: \"upload_bytes\";r=2000;"),
        "{head}"
    );
    let seen = uploads(&up, 2).await;
    assert_eq!(seen.get(1), Some(&(8000, false)), "{seen:?}");
    // The 8,000 bytes forwarded stay charged.
    assert_eq!(upload(&c, &proxy, "dave", 2001).await.status(), 429);
    assert_eq!(upload(&c, &proxy, "dave", 2000).await.status(), 200);

    // Bytes are the limit's units: the refused 4,000 count as over the limit.
    let metrics = c
        .get(format!("http://{admin}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let over = "tollgate_over_limit_total{domain=\"uploads\",descriptor=\"api_key\"} ";
    let counted = metrics
        .lines()
        .find_map(|l| l.strip_prefix(over))
        .and_then(|n| n.parse::<u64>().ok());
    // carol's 7,001 and dave's 4,000 (mid-stream) and 2,001.
    assert_eq!(counted, Some(7001 + 4000 + 2001), "{metrics}");
}
