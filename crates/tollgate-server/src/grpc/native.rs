//! The gRPC listener on Tollgate's own HTTP/2 layer (`tollgate-h2`), the default
//! (`--grpc-transport native`; `tonic` is the alternative).
//!
//! One task per connection, on the worker that accepted it. Each turn of its loop reads
//! what the socket has, reads every complete call with [`decode::request_within`], decides it
//! with [`rls::decide_request`] (the decision tonic's service gets too), encodes each
//! answer with [`encode::response`], answers
//! all the calls that are decided at once (every call on the in-memory store; on Redis,
//! as replies come back) and writes all the answers in one system call. With 64 calls in flight on a few connections, one read and one write
//! serve many calls, where tonic/hyper/h2 woke tasks and wrote per call (the costs of
//! both: docs/benchmarks.md, The service).
//!
//! The connection's limits are [`settings`]'s (tollgate-h2's [`ServerSettings`] with the
//! defaults below, and the timers of `serve`'s flags: [`Timers`]), and all connections
//! share [`MAX_UNFINISHED_STREAMS_TOTAL`] and [`MAX_BUFFERED_TOTAL`], so that many
//! connections cannot together hold what each may alone: a connection with no call
//! open for `--grpc-idle-timeout` ([`IDLE_TIMEOUT`]) is closed gracefully, a silent one
//! is pinged after `--grpc-keepalive-interval` ([`KEEPALIVE_INTERVAL`]) and closed when
//! the PING is not answered within `--grpc-keepalive-timeout` ([`KEEPALIVE_TIMEOUT`]),
//! and one that has not sent the HTTP/2 preface within `--header-read-timeout`
//! ([`PREFACE_TIMEOUT`]) is closed. The timers are one `Sleep` per connection, moved
//! only when a deadline comes earlier (a later one is found when it fires), so the
//! loop's fast path does not touch the timer wheel.
//!
//! The calls a connection has in flight (`pending`, decided or waiting for Redis) are at
//! most [`MAX_CONCURRENT_STREAMS`], whatever the client resets: a call handed out keeps
//! its stream's place in `tollgate-h2` until it is answered (`respond`, which drops the
//! answer to a reset stream), and streams past the limit are refused (`REFUSED_STREAM`).

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Sleep;
use tollgate_h2::grpc::{Code, Status};
use tollgate_h2::{Budget, Call, ServerConn, ServerSettings, SharedLimits};
use tracing::debug;

use crate::grpc::rls::{self, Failure};
use crate::grpc::{decode, encode, health, metadata};
use crate::service::{Service, NO_RULES};
use crate::workers::{stopped, Accepted};

/// The methods served, by index: [`SHOULD_RATE_LIMIT`], [`HEALTH_CHECK`].
const METHODS: &[&str] = &[
    "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
    health::CHECK_PATH,
];
/// `ShouldRateLimit`'s index in [`METHODS`].
const SHOULD_RATE_LIMIT: usize = 0;
/// `grpc.health.v1.Health/Check`'s index in [`METHODS`].
const HEALTH_CHECK: usize = 1;
/// A read asks for at least this much room.
const READ_CHUNK: usize = 16 << 10;
/// Reading from a client pauses while this much output waits to be written to it.
const MAX_UNWRITTEN: usize = 1 << 20;
/// How long the last write before a close may take.
const LAST_WRITE: Duration = Duration::from_secs(5);
/// An output buffer larger than this is given back once it is empty.
const KEEP_OUTPUT: usize = 64 << 10;

/// A connection with no call open for this long is closed (GOAWAY, a PING round trip,
/// the final GOAWAY): Envoy opens a new one for its next call. The default of
/// `--grpc-idle-timeout`.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// A PING is sent after this long without a byte from the client (Envoy's gRPC client,
/// like every HTTP/2 client, answers it). The default of `--grpc-keepalive-interval`.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(60);
/// How long that PING may go unanswered before the connection is closed (gRPC's
/// default keepalive timeout). The default of `--grpc-keepalive-timeout`.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a new connection has to send the HTTP/2 preface and its SETTINGS. The
/// default of `--header-read-timeout`.
pub const PREFACE_TIMEOUT: Duration = Duration::from_secs(10);
/// Streams open at once on a connection (`SETTINGS_MAX_CONCURRENT_STREAMS`), counting
/// each call handed out until it is answered, even when the client has reset it: the
/// calls in flight on a connection are at most this many.
pub const MAX_CONCURRENT_STREAMS: u32 = 1024;
pub use super::limits::{MAX_BUFFERED, MAX_BUFFERED_TOTAL};
/// SETTINGS, PING, empty DATA and CONTINUATION frames a connection may send: 1,000 at
/// once, then 100 a second; past that, GOAWAY `ENHANCE_YOUR_CALM`.
pub const CONTROL_FRAMES: Budget = Budget {
    burst: 1_000,
    per_second: 100,
};
/// Calls a connection may reset before they were handed out (the rapid reset attack,
/// CVE-2023-44487): 1,000 at once, then 100 a second; past that, GOAWAY
/// `ENHANCE_YOUR_CALM`. A call reset after it was handed out (Envoy's timeout) is not
/// counted.
pub const PREMATURE_RESETS: Budget = Budget {
    burst: 1_000,
    per_second: 100,
};

/// Streams whose request has not ended, on all native gRPC connections together (about
/// 200 bytes each); past it, new ones are refused (`REFUSED_STREAM`).
pub const MAX_UNFINISHED_STREAMS_TOTAL: usize = 65_536;

/// The limits all native gRPC connections of the process share.
fn shared_limits() -> Arc<SharedLimits> {
    static SHARED: OnceLock<Arc<SharedLimits>> = OnceLock::new();
    Arc::clone(
        SHARED.get_or_init(|| SharedLimits::new(MAX_UNFINISHED_STREAMS_TOTAL, MAX_BUFFERED_TOTAL)),
    )
}

/// The timers of a native gRPC connection, which `serve`'s flags set (the defaults:
/// the constants above).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timers {
    /// How long a new connection has to send the HTTP/2 preface and its SETTINGS
    /// (`--header-read-timeout`).
    pub preface: Duration,
    /// A connection with no call open for this long is closed gracefully
    /// (`--grpc-idle-timeout`).
    pub idle: Duration,
    /// A PING after this long without a byte from the client
    /// (`--grpc-keepalive-interval`).
    pub keepalive_interval: Duration,
    /// How long that PING may go unanswered (`--grpc-keepalive-timeout`).
    pub keepalive_timeout: Duration,
}

impl Default for Timers {
    fn default() -> Self {
        Self {
            preface: PREFACE_TIMEOUT,
            idle: IDLE_TIMEOUT,
            keepalive_interval: KEEPALIVE_INTERVAL,
            keepalive_timeout: KEEPALIVE_TIMEOUT,
        }
    }
}

/// The limits of each native gRPC connection, with the default [`Timers`].
pub fn settings() -> ServerSettings {
    settings_with(Timers::default())
}

/// The limits of each native gRPC connection, with `timers`.
pub fn settings_with(timers: Timers) -> ServerSettings {
    ServerSettings {
        max_concurrent_streams: MAX_CONCURRENT_STREAMS,
        max_buffered: MAX_BUFFERED,
        preface_timeout: timers.preface,
        idle_timeout: Some(timers.idle),
        keepalive_interval: Some(timers.keepalive_interval),
        keepalive_timeout: timers.keepalive_timeout,
        control_frames: CONTROL_FRAMES,
        premature_resets: PREMATURE_RESETS,
        ..ServerSettings::default()
    }
}

/// Serves the gRPC connections a worker is handed, each held to `settings` (see
/// [`settings_with`]), until `stop`; then each connection sends GOAWAY, answers the
/// calls it has and closes, and this returns when all have.
pub async fn serve(
    mut connections: mpsc::UnboundedReceiver<Accepted>,
    service: Arc<Service>,
    stop: watch::Receiver<bool>,
    settings: ServerSettings,
) {
    let mut tasks = JoinSet::new();
    let stopping = stopped(stop.clone());
    tokio::pin!(stopping);
    loop {
        tokio::select! {
            next = connections.recv() => match next {
                Some((stream, peer)) => match TcpStream::from_std(stream) {
                    Ok(stream) => {
                        tasks.spawn(connection(
                            stream,
                            peer,
                            Arc::clone(&service),
                            stop.clone(),
                            settings,
                        ));
                    }
                    Err(e) => debug!(%peer, "cannot serve a connection: {e}"),
                },
                None => break,
            },
            () = &mut stopping => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    drop(connections);
    while tasks.join_next().await.is_some() {}
}

/// One connection, until the client leaves, a protocol error, or the drain ends.
async fn connection(
    mut socket: TcpStream,
    peer: SocketAddr,
    service: Arc<Service>,
    stop: watch::Receiver<bool>,
    settings: ServerSettings,
) {
    let (mut rd, mut wr) = socket.split();
    let mut conn = ServerConn::with_shared(settings, METHODS, shared_limits());
    let mut input: Vec<u8> = Vec::with_capacity(READ_CHUNK);
    let mut out: Vec<u8> = Vec::new();
    let mut calls: Vec<Call> = Vec::new();
    let service = &*service;
    let mut pending = FuturesUnordered::new();
    let stopping = stopped(stop);
    tokio::pin!(stopping);
    let mut draining = false;
    // The connection's timers: `armed` is when `timer` fires, `None` once it has.
    let mut armed = conn.deadline();
    let timer = tokio::time::sleep_until(tokio_instant(armed));
    tokio::pin!(timer);
    loop {
        for call in calls.drain(..) {
            pending.push(handle(service, call));
        }
        // Every call decided without waiting (all of them, in memory) is answered now,
        // so that one write carries them all.
        while let Some(Some((stream, reply))) = pending.next().now_or_never() {
            respond(&mut conn, stream, reply);
        }
        if out.is_empty() {
            // Usually all was written last time: take the new output's buffer rather
            // than copy it.
            std::mem::swap(&mut out, conn.output());
        } else {
            out.append(conn.output());
        }
        if let Err(e) = tollgate_h2::write_some(&mut out, |b| wr.try_write(b)) {
            debug!(%peer, "gRPC connection: write failed: {e}");
            return;
        }
        if out.is_empty() {
            if conn.is_done() {
                return;
            }
            if out.capacity() > KEEP_OUTPUT {
                out = Vec::new();
            }
        }
        rearm(&conn, &mut armed, timer.as_mut());
        if input.capacity() - input.len() < READ_CHUNK / 4 {
            input.reserve(READ_CHUNK);
        }
        let reading = out.len() < MAX_UNWRITTEN;
        tokio::select! {
            read = rd.read_buf(&mut input), if reading => match read {
                Ok(0) => return,
                Ok(_) => match conn.receive(&input, &mut calls) {
                    Ok(used) => {
                        input.drain(..used);
                    }
                    Err(e) => {
                        debug!(%peer, "gRPC connection: {e}");
                        out.append(conn.output());
                        write_last(&mut wr, &out).await;
                        return;
                    }
                },
                Err(e) => {
                    debug!(%peer, "gRPC connection: read failed: {e}");
                    return;
                }
            },
            Some((stream, reply)) = pending.next(), if !pending.is_empty() => {
                respond(&mut conn, stream, reply);
            }
            written = wr.writable(), if !out.is_empty() => {
                if let Err(e) = written {
                    debug!(%peer, "gRPC connection: {e}");
                    return;
                }
            }
            () = &mut stopping, if !draining => {
                draining = true;
                conn.shutdown();
            }
            () = &mut timer, if armed.is_some() => {
                armed = None;
                if !on_timer(&mut conn, &mut out, peer) {
                    write_last(&mut wr, &out).await;
                    return;
                }
            }
        }
    }
}

/// Moves the timer earlier when the connection's next deadline is before the one it is
/// set for (a later deadline is found when the timer fires).
fn rearm(conn: &ServerConn, armed: &mut Option<Instant>, timer: std::pin::Pin<&mut Sleep>) {
    if let Some(at) = conn.deadline() {
        if armed.is_none_or(|a| at < a) {
            *armed = Some(at);
            timer.reset(tokio_instant(*armed));
        }
    }
}

/// Runs the connection's timers; `false` when it must close (its last words in `out`).
#[cold]
fn on_timer(conn: &mut ServerConn, out: &mut Vec<u8>, peer: SocketAddr) -> bool {
    match conn.tick(Instant::now()) {
        Ok(()) => true,
        Err(e) => {
            debug!(%peer, "gRPC connection: {e}");
            out.append(conn.output());
            false
        }
    }
}

/// Writes what is left (a GOAWAY last) before the connection closes, for at most
/// [`LAST_WRITE`]: a peer that reads nothing (a dead one) does not hold the task.
async fn write_last(wr: &mut (impl tokio::io::AsyncWrite + Unpin), out: &[u8]) {
    let write = tokio::io::AsyncWriteExt::write_all(wr, out);
    let _ = tokio::time::timeout(LAST_WRITE, write).await;
}

/// `at` for tokio's timer; `None` (no timer due) is a day away.
fn tokio_instant(at: Option<Instant>) -> tokio::time::Instant {
    at.map(tokio::time::Instant::from_std)
        .unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(86_400))
}

fn respond(conn: &mut ServerConn, stream: u32, reply: Result<Vec<u8>, Status>) {
    match &reply {
        Ok(message) => conn.respond(stream, Ok(message)),
        Err(status) => conn.respond(stream, Err(status)),
    }
}

/// One call: a `ShouldRateLimit` ([`decode::request_within`], [`rls::decide_request`],
/// [`encode::response`]; `UNKNOWN` [`NO_RULES`] while no rules are loaded) or a health
/// `Check` ([`health::check_call`]).
async fn handle(service: &Service, call: Call) -> (u32, Result<Vec<u8>, Status>) {
    if call.method == HEALTH_CHECK {
        return (call.stream, health::check_call(service, &call.message));
    }
    debug_assert_eq!(call.method, SHOULD_RATE_LIMIT);
    let reply = match decode::request_within(&call.message, &service.limiter.settings().limits) {
        Err(why) => {
            service.metrics.invalid_request();
            Err(Status::new(Code::InvalidArgument, why.to_string()))
        }
        Ok(_) if !service.rules_loaded() => Err(Status::new(Code::Unknown, NO_RULES)),
        Ok(request) => match rls::decide_request(service, &request, call.timeout).await {
            Ok(response) => {
                let mut bytes = encode::response(&response, service.headers);
                if service.dynamic_metadata {
                    // Field 6, `dynamic_metadata` (fields may come in any order).
                    let m = metadata::dynamic_metadata(&request, &response);
                    metadata::write_struct(&mut bytes, 6, &m);
                }
                Ok(bytes)
            }
            Err(Failure::InvalidArgument(why)) => Err(Status::new(Code::InvalidArgument, why)),
            Err(Failure::Unavailable(why)) => Err(Status::new(Code::Unavailable, why)),
            Err(Failure::NoRules) => Err(Status::new(Code::Unknown, NO_RULES)),
        },
    };
    (call.stream, reply)
}
