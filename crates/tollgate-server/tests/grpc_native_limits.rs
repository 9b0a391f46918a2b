//! The native gRPC transport's timers follow `serve`'s flags, against the real binary
//! over real sockets: a connection with no call open is closed after
//! `--grpc-idle-timeout` (GOAWAY, a PING round trip, the final GOAWAY), a silent one is
//! PINGed after `--grpc-keepalive-interval` and closed when the PING goes unanswered for
//! `--grpc-keepalive-timeout`, and one without the HTTP/2 preface is closed after
//! `--header-read-timeout`. (Its limits on streams are tested in `tollgate-h2`.)

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use support::{tempdir, Server};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tollgate_h2::frame::{self, flag, kind};
use tollgate_h2::hpack;

const RULES: &str = "domain: api
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 100}
";
const PATH: &[u8] = b"/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

fn rules(name: &str) -> PathBuf {
    let dir = tempdir(name);
    std::fs::write(dir.join("api.yaml"), RULES).unwrap();
    dir
}

/// The next frame (kind, flags, stream, payload), or `None` at EOF, on an error or at
/// `deadline`.
async fn read_frame(c: &mut TcpStream, deadline: Instant) -> Option<(u8, u8, u32, Vec<u8>)> {
    let deadline = tokio::time::Instant::from_std(deadline);
    let mut head = [0u8; frame::HEADER_LEN];
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

/// A client connected with the preface and an empty SETTINGS frame.
async fn connect(s: &Server) -> TcpStream {
    let mut c = TcpStream::connect(&s.grpc).await.unwrap();
    let mut start = frame::PREFACE.to_vec();
    frame::put_settings(&mut start, &[]);
    c.write_all(&start).await.unwrap();
    c
}

/// What a client sees until the server closes the connection or `deadline`: the
/// server's PINGs and GOAWAYs with when they came, and whether it closed. The client
/// acknowledges SETTINGS, and PINGs when `answer_pings`.
#[derive(Debug, Default)]
struct Seen {
    pings: Vec<Duration>,
    goaways: Vec<Duration>,
    closed: Option<Duration>,
}

async fn watch(c: &mut TcpStream, answer_pings: bool, within: Duration) -> Seen {
    let start = Instant::now();
    let deadline = start + within;
    let mut seen = Seen::default();
    loop {
        let Some((kind, flags, _, payload)) = read_frame(c, deadline).await else {
            if Instant::now() < deadline {
                seen.closed = Some(start.elapsed());
            }
            return seen;
        };
        let mut answer = Vec::new();
        match kind {
            kind::SETTINGS if flags & flag::ACK == 0 => frame::put_settings_ack(&mut answer),
            kind::PING if flags & flag::ACK == 0 => {
                seen.pings.push(start.elapsed());
                if answer_pings {
                    frame::put_ping_ack(&mut answer, &payload);
                }
            }
            kind::GOAWAY => seen.goaways.push(start.elapsed()),
            _ => {}
        }
        if !answer.is_empty() {
            // The server may have closed meanwhile.
            let _ = c.write_all(&answer).await;
        }
    }
}

#[tokio::test]
async fn the_native_transports_timers_follow_the_flags() {
    let s = Server::start(
        &rules("grpc-native-timers"),
        &[
            "--grpc-transport",
            "native",
            "--grpc-idle-timeout",
            "1s",
            "--grpc-keepalive-interval",
            "1s",
            "--grpc-keepalive-timeout",
            "1s",
            "--header-read-timeout",
            "1s",
        ],
    )
    .await;

    // No call, PINGs answered: GOAWAY after --grpc-idle-timeout, then closed.
    let mut idle = connect(&s).await;
    let seen = watch(&mut idle, true, Duration::from_secs(8)).await;
    let first = *seen.goaways.first().expect("a GOAWAY for idleness");
    assert!(
        first >= Duration::from_millis(900) && first < Duration::from_secs(4),
        "{seen:?}"
    );
    assert!(seen.closed.is_some(), "an idle connection held: {seen:?}");

    // A call open (its request unfinished), PINGs not answered: a PING after
    // --grpc-keepalive-interval, closed --grpc-keepalive-timeout later.
    let mut silent = connect(&s).await;
    let mut block = Vec::new();
    block.push(hpack::METHOD_POST);
    block.push(hpack::SCHEME_HTTP);
    hpack::put_indexed_name(&mut block, hpack::PATH, PATH);
    hpack::put_indexed_name(&mut block, hpack::CONTENT_TYPE, b"application/grpc");
    let mut headers = Vec::new();
    frame::put_headers(&mut headers, 1, &block, frame::DEFAULT_MAX_FRAME, false);
    silent.write_all(&headers).await.unwrap();
    let seen = watch(&mut silent, false, Duration::from_secs(8)).await;
    let ping = *seen.pings.first().expect("a keepalive PING");
    assert!(
        ping >= Duration::from_millis(900) && ping < Duration::from_secs(4),
        "{seen:?}"
    );
    let closed = seen.closed.expect("a silent connection held");
    assert!(closed >= ping + Duration::from_millis(900), "{seen:?}");

    // No preface: closed after --header-read-timeout.
    let mut mute = TcpStream::connect(&s.grpc).await.unwrap();
    let seen = watch(&mut mute, false, Duration::from_secs(8)).await;
    let closed = seen.closed.expect("a connection without a preface held");
    assert!(closed < Duration::from_secs(4), "{seen:?}");
}

#[tokio::test]
async fn the_native_transport_keeps_an_idle_connection_by_default() {
    // --idle-timeout is the HTTP listeners' (and tonic's silence timeout): the native
    // transport keeps a connection between calls for --grpc-idle-timeout, 5 minutes.
    let s = Server::start(
        &rules("grpc-native-default-idle"),
        &["--grpc-transport", "native", "--idle-timeout", "1s"],
    )
    .await;
    let mut idle = connect(&s).await;
    let seen = watch(&mut idle, true, Duration::from_secs(3)).await;
    assert!(seen.goaways.is_empty() && seen.closed.is_none(), "{seen:?}");
}
