//! What a hostile (or broken) client can hold, against the real binary over real
//! sockets: slowloris headers and idle keep-alive connections are closed
//! (`--header-read-timeout`, `--idle-timeout`), a listener stops accepting at
//! `--max-connections` and serves the next client once one leaves, the tonic
//! transport refuses streams past the native transport's `MAX_CONCURRENT_STREAMS`
//! while keeping a quiet client that answers its PINGs, one HTTP/2 connection cannot
//! hold more than its share of unfinished request bodies (HTTP listener: 503; tonic:
//! `RESOURCE_EXHAUSTED`) while another connection is served, the gateway cuts an
//! upload that stalls, `serve --admin-listen` is held to the same limits, and an
//! acceptor out of file descriptors neither spins nor floods the log.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

#[path = "../../tollgate/tests/support/redis_server.rs"]
mod redis_server;
mod support;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use support::{tempdir, Proxy, Server};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const RULES: &str = "domain: api
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 100}
";

fn rules(name: &str) -> PathBuf {
    let dir = tempdir(name);
    std::fs::write(dir.join("api.yaml"), RULES).unwrap();
    dir
}

/// Whether the server sends an HTTP/2 frame (its SETTINGS, on a connection it serves)
/// on `c` within `within`.
async fn served(c: &mut TcpStream, within: Duration) -> bool {
    read_frame(c, Instant::now() + within).await.is_some()
}

/// `host:port` of the server's HTTP listener.
fn http_addr(s: &Server) -> &str {
    s.http.trim_start_matches("http://")
}

/// Whether the server closes `stream` (EOF or reset) within `within`; what it sends
/// meanwhile is read and dropped.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// A keep-alive `GET path` on `stream`; the response's status code (the response is
/// read whole: the bodies here are short and sent with it).
async fn get(stream: &mut TcpStream, path: &str) -> u16 {
    let request = format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut buf = [0u8; 8192];
    let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
        .await
        .expect("an answer")
        .unwrap();
    let head = String::from_utf8_lossy(&buf[..n]).into_owned();
    head.split(' ').nth(1).unwrap_or("0").parse().unwrap_or(0)
}

#[tokio::test]
async fn slowloris_headers_are_closed_after_the_header_read_timeout() {
    let s = Server::start(
        &rules("slowloris"),
        &["--header-read-timeout", "1s", "--idle-timeout", "60s"],
    )
    .await;
    // A partial header line, then nothing.
    let mut stalled = TcpStream::connect(http_addr(&s)).await.unwrap();
    stalled
        .write_all(b"POST /v1/check HTTP/1.1\r\nhost: x\r\nx-slow: ")
        .await
        .unwrap();
    // A header dripped a byte every 200 ms: each byte is progress, but the headers
    // never end.
    let mut dripping = TcpStream::connect(http_addr(&s)).await.unwrap();
    dripping
        .write_all(b"GET /healthz HTTP/1.1\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    let mut drip_closed = false;
    while started.elapsed() < Duration::from_secs(6) {
        if dripping.write_all(b"x").await.is_err()
            || closed_within(&mut dripping, Duration::from_millis(200)).await
        {
            drip_closed = true;
            break;
        }
    }
    assert!(drip_closed, "a dripping header was held for 6 s");
    assert!(
        closed_within(&mut stalled, Duration::from_secs(5)).await,
        "a stalled header was held"
    );
    // A second request's headers get the same bound on a kept-alive connection.
    let mut kept = TcpStream::connect(http_addr(&s)).await.unwrap();
    assert_eq!(get(&mut kept, "/healthz").await, 200);
    kept.write_all(b"GET /healthz HTTP/1.1\r\nho")
        .await
        .unwrap();
    assert!(closed_within(&mut kept, Duration::from_secs(5)).await);
    // And a client that sends nothing at all.
    let mut silent = TcpStream::connect(http_addr(&s)).await.unwrap();
    assert!(closed_within(&mut silent, Duration::from_secs(5)).await);
    // The service is fine.
    let mut fresh = TcpStream::connect(http_addr(&s)).await.unwrap();
    assert_eq!(get(&mut fresh, "/healthz").await, 200);
}

#[tokio::test]
async fn the_admin_listener_is_held_to_the_same_timeouts_and_cap() {
    let admin = format!("127.0.0.1:{}", support::free_port());
    let s = Server::start(
        &rules("admin-listener"),
        &[
            "--admin-listen",
            &admin,
            "--header-read-timeout",
            "1s",
            "--max-connections",
            "2",
        ],
    )
    .await;
    // Headers that never end are closed at the header-read timeout.
    let mut stalled = TcpStream::connect(&admin).await.unwrap();
    stalled
        .write_all(b"GET /rules HTTP/1.1\r\nhost: x\r\nx-slow: ")
        .await
        .unwrap();
    assert!(
        closed_within(&mut stalled, Duration::from_secs(5)).await,
        "the admin listener held a stalled header"
    );
    // At the cap, the next client waits until one leaves.
    let mut first = TcpStream::connect(&admin).await.unwrap();
    assert_eq!(get(&mut first, "/healthz").await, 200);
    let mut second = TcpStream::connect(&admin).await.unwrap();
    assert_eq!(get(&mut second, "/healthz").await, 200);
    let mut third = TcpStream::connect(&admin).await.unwrap();
    third
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    let waited = tokio::time::timeout(Duration::from_millis(500), third.read(&mut buf)).await;
    assert!(
        waited.is_err(),
        "a third connection was served past --max-connections 2"
    );
    drop(first);
    let n = tokio::time::timeout(Duration::from_secs(5), third.read(&mut buf))
        .await
        .expect("served once a connection left")
        .unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    drop(s);
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() {
    let s = Server::start(
        &rules("idle"),
        &["--idle-timeout", "1s", "--header-read-timeout", "30s"],
    )
    .await;
    // Requests every 300 ms for 3 s: kept open (the timeout is for idleness).
    let mut busy = TcpStream::connect(http_addr(&s)).await.unwrap();
    for _ in 0..10 {
        assert_eq!(get(&mut busy, "/healthz").await, 200);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Then idle: closed.
    assert!(closed_within(&mut busy, Duration::from_secs(5)).await);
    // HTTP/2 with prior knowledge: one request, then idle (answering whatever the
    // server asks): closed with a GOAWAY.
    let mut h2 = TcpStream::connect(http_addr(&s)).await.unwrap();
    h2.write_all(PREFACE).await.unwrap();
    h2.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
    let get = header_block(&[
        (":method", "GET"),
        (":scheme", "http"),
        (":path", "/healthz"),
        (":authority", "x"),
    ]);
    h2.write_all(&frame(HEADERS, END_HEADERS | END_STREAM, 1, &get))
        .await
        .unwrap();
    let (mut answered, mut goaway) = (false, false);
    let deadline = Instant::now() + Duration::from_secs(5);
    while let Some((kind, flags, stream, payload)) = read_frame(&mut h2, deadline).await {
        match kind {
            SETTINGS if flags & ACK == 0 => {
                h2.write_all(&frame(SETTINGS, ACK, 0, &[])).await.unwrap();
            }
            PING if flags & ACK == 0 => {
                h2.write_all(&frame(PING, ACK, 0, &payload)).await.unwrap();
            }
            HEADERS if stream == 1 => answered = true,
            GOAWAY => goaway = true,
            _ => {}
        }
    }
    assert!(answered, "the request was not answered");
    assert!(goaway, "no GOAWAY before the close");
    assert!(
        Instant::now() < deadline,
        "an idle HTTP/2 connection was held"
    );
}

#[tokio::test]
async fn at_max_connections_the_next_client_waits_until_one_leaves() {
    let s = Server::start(&rules("cap-http"), &["--max-connections", "4"]).await;
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut c = TcpStream::connect(http_addr(&s)).await.unwrap();
        assert_eq!(get(&mut c, "/healthz").await, 200);
        held.push(c);
    }
    // The fifth connects (the kernel's backlog) but is not served.
    let mut fifth = TcpStream::connect(http_addr(&s)).await.unwrap();
    fifth
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 4096];
    let early = tokio::time::timeout(Duration::from_secs(1), fifth.read(&mut buf)).await;
    assert!(early.is_err(), "a fifth connection was served: {early:?}");
    // The clients already connected still are.
    for c in &mut held {
        assert_eq!(get(c, "/healthz").await, 200);
    }
    // One leaves: the fifth is served.
    drop(held.pop());
    let n = tokio::time::timeout(Duration::from_secs(5), fifth.read(&mut buf))
        .await
        .expect("served once a connection closed")
        .unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
}

#[tokio::test]
async fn the_grpc_listener_is_capped_on_both_transports_and_counted() {
    for transport in ["native", "tonic"] {
        let s = Server::start(
            &rules(&format!("cap-grpc-{transport}")),
            &["--max-connections", "4", "--grpc-transport", transport],
        )
        .await;
        // The server's SETTINGS come first on an HTTP/2 connection it serves.
        let open = || async {
            let mut c = TcpStream::connect(&s.grpc).await.unwrap();
            c.write_all(PREFACE).await.unwrap();
            c.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
            c
        };
        let mut held = Vec::new();
        for _ in 0..4 {
            let mut c = open().await;
            assert!(served(&mut c, Duration::from_secs(5)).await, "{transport}");
            held.push(c);
        }
        let mut fifth = open().await;
        assert!(
            !served(&mut fifth, Duration::from_secs(1)).await,
            "{transport}: a fifth connection was served"
        );
        assert_eq!(
            s.metric("tollgate_connections{listener=\"grpc\"}").await,
            Some(4),
            "{transport}"
        );
        assert!(
            s.metric("tollgate_connections_capped_total{listener=\"grpc\"}")
                .await
                .is_some_and(|n| n >= 1),
            "{transport}"
        );
        drop(held.pop());
        assert!(
            served(&mut fifth, Duration::from_secs(5)).await,
            "{transport}: the fifth was not served once a connection closed"
        );
    }
}

#[tokio::test]
async fn tonic_refuses_streams_past_the_native_transports_limit() {
    // `tollgate_h2::ServerSettings::default().max_concurrent_streams`.
    const MAX_STREAMS: u32 = 1024;
    let s = Server::start(&rules("tonic-streams"), &["--grpc-transport", "tonic"]).await;
    let mut c = TcpStream::connect(&s.grpc).await.unwrap();
    c.write_all(PREFACE).await.unwrap();
    c.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
    // Acknowledge the server's SETTINGS (its stream limit applies from then on), and
    // wait until it has seen that: a PING's answer comes after.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut advertised = None;
    loop {
        let (kind, flags, _, payload) = read_frame(&mut c, deadline).await.expect("SETTINGS");
        if kind == SETTINGS && flags & ACK == 0 {
            advertised = settings_value(&payload, 0x3);
            c.write_all(&frame(SETTINGS, ACK, 0, &[])).await.unwrap();
            c.write_all(&frame(PING, 0, 0, b"12345678")).await.unwrap();
        }
        if kind == PING && flags & ACK != 0 {
            break;
        }
    }
    // 1,100 calls whose message never comes: each stream stays open.
    let opened = MAX_STREAMS + 76;
    let block = request_headers();
    let mut out = Vec::new();
    for i in 0..opened {
        out.extend(frame(HEADERS, END_HEADERS, 2 * i + 1, &block));
    }
    c.write_all(&out).await.unwrap();
    let mut refused = 0;
    let deadline = Instant::now() + Duration::from_secs(5);
    while let Some((kind, _, stream, payload)) = read_frame(&mut c, deadline).await {
        if kind == RST_STREAM && payload == [0, 0, 0, 7] {
            refused += 1;
            assert!(stream > 2 * MAX_STREAMS, "stream {stream} refused");
        }
        if refused == opened - MAX_STREAMS {
            break;
        }
    }
    assert_eq!(refused, opened - MAX_STREAMS, "REFUSED_STREAM resets");
    assert_eq!(
        advertised,
        Some(MAX_STREAMS),
        "SETTINGS_MAX_CONCURRENT_STREAMS"
    );
}

#[tokio::test]
async fn a_quiet_grpc_client_that_answers_pings_is_kept_and_a_silent_one_is_not() {
    let s = Server::start(
        &rules("grpc-idle"),
        &["--grpc-transport", "tonic", "--idle-timeout", "1s"],
    )
    .await;
    // Makes no call for 3 s, answering the server's PINGs: still open.
    let mut quiet = TcpStream::connect(&s.grpc).await.unwrap();
    quiet.write_all(PREFACE).await.unwrap();
    quiet.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut pings = 0;
    while let Some((kind, flags, _, payload)) = read_frame(&mut quiet, deadline).await {
        match kind {
            SETTINGS if flags & ACK == 0 => {
                quiet
                    .write_all(&frame(SETTINGS, ACK, 0, &[]))
                    .await
                    .unwrap();
            }
            PING if flags & ACK == 0 => {
                pings += 1;
                quiet
                    .write_all(&frame(PING, ACK, 0, &payload))
                    .await
                    .unwrap();
            }
            GOAWAY => panic!("a client answering PINGs was sent away"),
            _ => {}
        }
    }
    assert!(Instant::now() >= deadline, "closed while answering PINGs");
    assert!(pings >= 2, "{pings} PINGs in 3 s");
    // Sends its preface, then never answers: closed.
    let mut silent = TcpStream::connect(&s.grpc).await.unwrap();
    silent.write_all(PREFACE).await.unwrap();
    silent.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
    assert!(closed_within(&mut silent, Duration::from_secs(5)).await);
}

/// Bytes of unfinished request bodies one connection may hold, on the HTTP listener
/// (`app::HTTP_CONNECTION_BODY_BUDGET`) and on the tonic transport (the native
/// transport's `MAX_BUFFERED`): one 4 MiB body and 64 KiB.
const CONNECTION_BODY_BUDGET: usize = (4 << 20) + (64 << 10);
/// What each unfinished body below sends of its declared length: under the HTTP
/// API's 1 MiB body limit; five of them are past [`CONNECTION_BODY_BUDGET`], four are
/// not.
const PARTIAL_BODY: usize = 900_000;
const _: () =
    assert!(4 * PARTIAL_BODY < CONNECTION_BODY_BUDGET && 5 * PARTIAL_BODY > CONNECTION_BODY_BUDGET);

#[tokio::test]
async fn one_http2_connection_cannot_hold_more_than_its_share_of_unfinished_bodies() {
    let s = Server::start(&rules("http-conn-bodies"), &["--idle-timeout", "60s"]).await;
    let mut c = RawH2::open(http_addr(&s)).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let post = header_block(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/v1/check"),
        (":authority", "x"),
        ("content-type", "application/json"),
        ("content-length", "1000000"),
    ]);
    // Five bodies of 1,000,000 bytes, each sent up to 900,000 and never finished: the
    // first four fit the connection's share, the fifth does not.
    let streams = [1, 3, 5, 7, 9];
    for stream in streams {
        c.start(stream, &post, false).await;
        c.send(stream, &vec![b' '; PARTIAL_BODY], deadline).await;
    }
    assert!(
        c.wait(deadline, |c| c.finished(9)).await,
        "the fifth unfinished body on one connection was held ({} bytes in all)",
        streams.len() * PARTIAL_BODY
    );
    let refused = &c.answers[&9];
    assert_eq!(refused.field(":status"), Some("503"), "{refused:?}");
    let text = String::from_utf8_lossy(&refused.data);
    assert!(
        text.contains("too many unfinished request bodies"),
        "{text}"
    );
    for stream in &streams[..4] {
        assert!(!c.answered(*stream), "stream {stream} was answered");
    }
    // Another connection is served meanwhile, an unfinished body of its own open too.
    let mut other = RawH2::open(http_addr(&s)).await;
    other.start(1, &post, false).await;
    other.send(1, &vec![b' '; PARTIAL_BODY], deadline).await;
    let answer = reqwest::Client::new()
        .post(format!("{}/v1/check", s.http))
        .json(&serde_json::json!({"domain": "api", "descriptors": [{"user": "alice"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    // And so is the first, for a body that fits.
    let small = br#"{"domain": "api", "descriptors": [{"user": "bob"}]}"#;
    let post_small = header_block(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/v1/check"),
        (":authority", "x"),
        ("content-type", "application/json"),
    ]);
    c.start(11, &post_small, false).await;
    c.send(11, small, deadline).await;
    c.end(11).await;
    assert!(c.wait(deadline, |c| c.finished(11)).await);
    assert_eq!(c.answers[&11].field(":status"), Some("200"));
}

#[tokio::test]
async fn one_tonic_connection_cannot_hold_more_than_its_share_of_unfinished_messages() {
    let s = Server::start(
        &rules("tonic-conn-bodies"),
        &["--grpc-transport", "tonic", "--idle-timeout", "60s"],
    )
    .await;
    let c = RawH2::open(&s.grpc).await;
    let other = RawH2::open(&s.grpc).await;
    unfinished_messages_past_the_connections_share(c, other).await;
}

#[tokio::test]
async fn one_tonic_connection_over_tls_cannot_hold_more_than_its_share_of_unfinished_messages() {
    let files = redis_server::TlsFiles::generate("conn-bodies");
    let path = |file: &str| files.path(file).to_string_lossy().into_owned();
    let (cert, key) = (path("server.pem"), path("server.key"));
    let s = Server::start(
        &rules("tonic-tls-conn-bodies"),
        &[
            "--grpc-tls-cert",
            &cert,
            "--grpc-tls-key",
            &key,
            "--idle-timeout",
            "60s",
        ],
    )
    .await;
    let c = RawH2::open_tls(&s.grpc, &files.read("ca.pem")).await;
    let other = RawH2::open_tls(&s.grpc, &files.read("ca.pem")).await;
    unfinished_messages_past_the_connections_share(c, other).await;
}

/// On `c`, five calls whose message says 1,000,000 bytes and sends 900,000 of them:
/// the fifth is answered `RESOURCE_EXHAUSTED`, the first four are held, and a call on
/// `other` (another connection to the same listener) is answered.
async fn unfinished_messages_past_the_connections_share(mut c: RawH2, mut other: RawH2) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut message = vec![0u8];
    message.extend(1_000_000u32.to_be_bytes());
    message.extend(vec![0u8; PARTIAL_BODY]);
    let streams = [1, 3, 5, 7, 9];
    for stream in streams {
        c.start(stream, &request_headers(), false).await;
        c.send(stream, &message, deadline).await;
    }
    assert!(
        c.wait(deadline, |c| c.finished(9)).await,
        "the fifth unfinished message on one connection was held ({} bytes in all)",
        streams.len() * message.len()
    );
    let refused = &c.answers[&9];
    assert_eq!(refused.field("grpc-status"), Some("8"), "{refused:?}");
    assert!(
        refused
            .field("grpc-message")
            .is_some_and(|m| m.contains("too%20many%20unfinished")),
        "{refused:?}"
    );
    for stream in &streams[..4] {
        assert!(!c.answered(*stream), "stream {stream} was answered");
    }
    // Another connection is served meanwhile: a health check (an empty message).
    let health = header_block(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/grpc.health.v1.Health/Check"),
        (":authority", "tollgate"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]);
    other.start(1, &health, false).await;
    other.send(1, &[0, 0, 0, 0, 0], deadline).await;
    other.end(1).await;
    assert!(other.wait(deadline, |c| c.finished(1)).await);
    let answer = &other.answers[&1];
    assert_eq!(answer.field("grpc-status"), Some("0"), "{answer:?}");
}

#[tokio::test]
async fn the_gateway_cuts_an_upload_that_stalls() {
    // An upstream that reads what it is sent and never answers.
    let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = upstream.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut c, _)) = upstream.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                while matches!(c.read(&mut buf).await, Ok(1..)) {}
            });
        }
    });
    let dir = tempdir("proxy-stall");
    std::fs::write(dir.join("edge.yaml"), "domain: edge\ndescriptors: []\n").unwrap();
    let proxy = Proxy::start(
        &dir,
        &format!("http://{upstream_addr}"),
        &["--idle-timeout", "1s", "--upstream-timeout", "60s"],
    )
    .await;
    let mut c = TcpStream::connect(&proxy.addr).await.unwrap();
    c.write_all(b"POST /upload HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n")
        .await
        .unwrap();
    c.write_all(&[b'x'; 1000]).await.unwrap();
    // Then nothing: the gateway gives up on the body (502) and the connection.
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(6);
    while let Ok(Ok(n @ 1..)) = tokio::time::timeout_at(deadline, c.read(&mut buf)).await {
        answer.extend_from_slice(&buf[..n]);
    }
    assert!(
        tokio::time::Instant::now() < deadline,
        "a stalled upload was held: {}",
        String::from_utf8_lossy(&answer)
    );
    assert!(
        String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 502"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn out_of_file_descriptors_the_acceptor_backs_off_and_logs_a_count() {
    let dir = rules("emfile");
    let log = dir.join("log");
    // A low open-file limit, and a cap above it (asked for: not lowered to fit).
    let s = start_with_ulimit(
        64,
        &dir,
        &["--max-connections", "1000", "--workers", "1"],
        &log,
    )
    .await;
    let mut held = Vec::new();
    for _ in 0..100 {
        if let Ok(c) = TcpStream::connect(http_addr(&s)).await {
            held.push(c);
        }
    }
    // Out of descriptors for 3 s: one "accept failed" line with a count, and the
    // acceptor pauses between tries instead of spinning.
    let cpu = || {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", s.child.id())).unwrap();
        let fields: Vec<&str> = stat
            .rsplit(')')
            .next()
            .unwrap()
            .split_whitespace()
            .collect();
        fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = cpu();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let ticks = cpu() - before;
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("accept failed"))
        .collect();
    assert!(!lines.is_empty(), "{text}");
    assert!(lines.len() <= 2, "{}", lines.join("\n"));
    assert!(lines[0].contains("failures"), "{}", lines[0]);
    // 300 ticks of CPU would be a core spinning for the 3 s.
    assert!(ticks < 60, "{ticks} ticks of CPU in 3 s out of descriptors");
    // Descriptors back: new clients are served.
    held.clear();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut c = TcpStream::connect(http_addr(&s)).await.unwrap();
        c.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 1024];
        if let Ok(Ok(n @ 1..)) =
            tokio::time::timeout(Duration::from_millis(500), c.read(&mut buf)).await
        {
            assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not serving once descriptors came back"
        );
    }
}

/// `tollgate serve` on `rules` under `ulimit -n files`, its log in `log`, once it
/// answers `/readyz`.
#[cfg(target_os = "linux")]
async fn start_with_ulimit(
    files: u32,
    rules: &std::path::Path,
    args: &[&str],
    log: &std::path::Path,
) -> Server {
    let grpc = format!("127.0.0.1:{}", support::free_port());
    let http = format!("127.0.0.1:{}", support::free_port());
    let child = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -n {files} && exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_tollgate"))
        .args(["serve", "--config", rules.to_str().unwrap()])
        .args(["--grpc-listen", &grpc, "--http-listen", &http])
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let server = Server {
        child,
        http: format!("http://{http}"),
        grpc,
        rules: rules.to_path_buf(),
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Ok(mut c) = TcpStream::connect(&http).await {
            if get(&mut c, "/readyz").await == 200 {
                return server;
            }
        }
        assert!(
            Instant::now() < deadline,
            "not ready: {}",
            std::fs::read_to_string(log).unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// HTTP/2 frames, by hand: what a client that does not play by the rules sends.

/// What the server sent on one stream.
#[derive(Debug, Default)]
struct Answer {
    /// The decoded header fields of every header block (response headers, trailers).
    fields: Vec<(String, String)>,
    data: Vec<u8>,
    /// The RST_STREAM error code, if reset.
    reset: Option<u32>,
    /// Whether the server ended the stream (END_STREAM, or a reset).
    ended: bool,
}

impl Answer {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A raw HTTP/2 client connection that keeps to flow control (so that it can send
/// large bodies) and notes what the server answers on each stream.
struct RawH2 {
    c: Box<dyn Io>,
    decoder: tollgate_h2::hpack::Decoder,
    /// What the server lets us send on the connection, and on each stream.
    conn_window: i64,
    initial_window: i64,
    windows: HashMap<u32, i64>,
    answers: HashMap<u32, Answer>,
}

impl RawH2 {
    /// Connects, sends the preface and empty SETTINGS, and reads the server's SETTINGS.
    async fn open(addr: &str) -> Self {
        Self::over(Box::new(TcpStream::connect(addr).await.unwrap())).await
    }

    /// As [`open`](Self::open), over TLS (ALPN `h2`) to a server for `localhost` whose
    /// CA is `ca` (PEM).
    async fn open_tls(addr: &str, ca: &[u8]) -> Self {
        use tokio_rustls::rustls::pki_types::pem::PemObject;
        use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
        let mut roots = tokio_rustls::rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca) {
            roots.add(cert.unwrap()).unwrap();
        }
        let provider = tokio_rustls::rustls::crypto::ring::default_provider();
        let mut config = tokio_rustls::rustls::ClientConfig::builder_with_provider(provider.into())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"h2".to_vec()];
        let tcp = TcpStream::connect(addr).await.unwrap();
        let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await
            .unwrap();
        Self::over(Box::new(tls)).await
    }

    async fn over(mut c: Box<dyn Io>) -> Self {
        c.write_all(PREFACE).await.unwrap();
        c.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
        let mut h2 = Self {
            c,
            decoder: tollgate_h2::hpack::Decoder::new(4096),
            conn_window: 65_535,
            initial_window: 65_535,
            windows: HashMap::new(),
            answers: HashMap::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        // Our SETTINGS acknowledged: the server's came before.
        let mut acked = false;
        while !acked {
            let (kind, flags) = h2.handle(deadline).await.expect("the server's SETTINGS");
            acked = kind == SETTINGS && flags & ACK != 0;
        }
        h2
    }

    /// Reads one frame and acts on it; its kind and flags, `None` at EOF or `deadline`.
    async fn handle(&mut self, deadline: Instant) -> Option<(u8, u8)> {
        let (kind, flags, stream, payload) = read_frame(&mut self.c, deadline).await?;
        match kind {
            SETTINGS if flags & ACK == 0 => {
                for p in payload.chunks_exact(6) {
                    if u16::from_be_bytes([p[0], p[1]]) == 0x4 {
                        let new = i64::from(u32::from_be_bytes([p[2], p[3], p[4], p[5]]));
                        for w in self.windows.values_mut() {
                            *w += new - self.initial_window;
                        }
                        self.initial_window = new;
                    }
                }
                self.c.write_all(&frame(SETTINGS, ACK, 0, &[])).await.ok()?;
            }
            PING if flags & ACK == 0 => {
                self.c
                    .write_all(&frame(PING, ACK, 0, &payload))
                    .await
                    .ok()?;
            }
            WINDOW_UPDATE => {
                let n = i64::from(
                    u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]])
                        & 0x7fff_ffff,
                );
                if stream == 0 {
                    self.conn_window += n;
                } else if let Some(w) = self.windows.get_mut(&stream) {
                    *w += n;
                }
            }
            HEADERS => {
                let answer = self.answers.entry(stream).or_default();
                answer.ended |= flags & END_STREAM != 0;
                self.decoder
                    .decode(&payload, |n, v| {
                        answer.fields.push((
                            String::from_utf8_lossy(n).into_owned(),
                            String::from_utf8_lossy(v).into_owned(),
                        ));
                    })
                    .unwrap();
            }
            DATA => {
                let answer = self.answers.entry(stream).or_default();
                answer.data.extend(&payload);
                answer.ended |= flags & END_STREAM != 0;
            }
            RST_STREAM => {
                let answer = self.answers.entry(stream).or_default();
                answer.reset = Some(u32::from_be_bytes([
                    payload[0], payload[1], payload[2], payload[3],
                ]));
                answer.ended = true;
            }
            _ => {}
        }
        Some((kind, flags))
    }

    /// Whether the server has answered (or reset) `stream`.
    fn answered(&self, stream: u32) -> bool {
        self.answers
            .get(&stream)
            .is_some_and(|a| !a.fields.is_empty() || a.reset.is_some())
    }

    /// Whether the server has ended `stream` (its answer is whole).
    fn finished(&self, stream: u32) -> bool {
        self.answers.get(&stream).is_some_and(|a| a.ended)
    }

    /// Opens `stream` with the header block `block`.
    async fn start(&mut self, stream: u32, block: &[u8], end: bool) {
        let flags = END_HEADERS | if end { END_STREAM } else { 0 };
        self.c
            .write_all(&frame(HEADERS, flags, stream, block))
            .await
            .unwrap();
        self.windows.insert(stream, self.initial_window);
    }

    /// Sends `body` on `stream` as flow control allows, without ending it; stops early
    /// when the server answers the stream, or at `deadline`.
    async fn send(&mut self, stream: u32, mut body: &[u8], deadline: Instant) {
        while !body.is_empty() && !self.answered(stream) {
            let window = self.conn_window.min(self.windows[&stream]);
            let n = usize::try_from(window)
                .unwrap_or(0)
                .min(16_384)
                .min(body.len());
            if n == 0 {
                if self.handle(deadline).await.is_none() {
                    return;
                }
                continue;
            }
            self.c
                .write_all(&frame(DATA, 0, stream, &body[..n]))
                .await
                .unwrap();
            self.conn_window -= n as i64;
            *self.windows.get_mut(&stream).unwrap() -= n as i64;
            body = &body[n..];
        }
    }

    /// Ends `stream` (an empty DATA frame with END_STREAM).
    async fn end(&mut self, stream: u32) {
        self.c
            .write_all(&frame(DATA, END_STREAM, stream, &[]))
            .await
            .unwrap();
    }

    /// Handles frames until `done` says so (`true`), or `deadline` or EOF (`false`).
    async fn wait(&mut self, deadline: Instant, done: impl Fn(&Self) -> bool) -> bool {
        while !done(self) {
            if self.handle(deadline).await.is_none() {
                return false;
            }
        }
        true
    }
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const ACK: u8 = 0x1;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut out = vec![len[1], len[2], len[3], kind, flags];
    out.extend(stream.to_be_bytes());
    out.extend(payload);
    out
}

/// A client's end of a connection, in cleartext or TLS.
trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// The next frame (kind, flags, stream, payload), or `None` at EOF, on an error or at
/// `deadline`.
async fn read_frame<C: tokio::io::AsyncRead + Unpin + ?Sized>(
    c: &mut C,
    deadline: Instant,
) -> Option<(u8, u8, u32, Vec<u8>)> {
    let deadline = tokio::time::Instant::from_std(deadline);
    let mut head = [0u8; 9];
    tokio::time::timeout_at(deadline, c.read_exact(&mut head))
        .await
        .ok()?
        .ok()?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let mut payload = vec![0u8; len];
    tokio::time::timeout_at(deadline, c.read_exact(&mut payload))
        .await
        .ok()?
        .ok()?;
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    Some((head[3], head[4], stream, payload))
}

/// The value of SETTINGS parameter `id` in a SETTINGS payload.
fn settings_value(payload: &[u8], id: u16) -> Option<u32> {
    payload.chunks_exact(6).find_map(|p| {
        (u16::from_be_bytes([p[0], p[1]]) == id)
            .then(|| u32::from_be_bytes([p[2], p[3], p[4], p[5]]))
    })
}

/// A `ShouldRateLimit` call's header block.
fn request_headers() -> Vec<u8> {
    header_block(&[
        (":method", "POST"),
        (":scheme", "http"),
        (
            ":path",
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        ),
        (":authority", "tollgate"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ])
}

/// A header block of HPACK literals: no indexing, no Huffman.
fn header_block(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut block = Vec::new();
    for (name, value) in fields {
        block.push(0);
        block.push(u8::try_from(name.len()).unwrap());
        block.extend(name.as_bytes());
        block.push(u8::try_from(value.len()).unwrap());
        block.extend(value.as_bytes());
    }
    block
}
