//! The gRPC listener on Tollgate's own HTTP/2 layer (`tollgate-h2`), the default
//! (`--grpc-transport native`; `tonic` is the alternative).
//!
//! One task per connection, on the worker that accepted it. Each turn of its loop reads
//! what the socket has, reads every complete call with [`decode::request`], decides it
//! with [`rls::decide_request`] (the decision tonic's service gets too), encodes each
//! answer with [`encode::response`], answers
//! all the calls that are decided at once (every call on the in-memory store; on Redis,
//! as replies come back) and writes all the answers in one system call. With 64 calls in flight on a few connections, one read and one write
//! serve many calls, where tonic/hyper/h2 woke tasks and wrote per call (callgrind:
//! 75,400 instructions per call under tonic, of which 9,000 were Tollgate's).

use std::net::SocketAddr;
use std::sync::Arc;

use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tollgate_h2::grpc::{Code, Status};
use tollgate_h2::{Call, ServerConn, ServerSettings};
use tracing::debug;

use crate::app::stopped;
use crate::grpc::rls::{self, Failure};
use crate::grpc::{decode, encode, health, metadata};
use crate::service::{Service, NO_RULES};
use crate::workers::Accepted;

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

/// Serves the gRPC connections a worker is handed until `stop`; then each connection
/// sends GOAWAY, answers the calls it has and closes, and this returns when all have.
pub async fn serve(
    mut connections: mpsc::UnboundedReceiver<Accepted>,
    service: Arc<Service>,
    stop: watch::Receiver<bool>,
) {
    let mut tasks = JoinSet::new();
    let stopping = stopped(stop.clone());
    tokio::pin!(stopping);
    loop {
        tokio::select! {
            next = connections.recv() => match next {
                Some((stream, peer)) => match TcpStream::from_std(stream) {
                    Ok(stream) => {
                        tasks.spawn(connection(stream, peer, Arc::clone(&service), stop.clone()));
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
) {
    let (mut rd, mut wr) = socket.split();
    let mut conn = ServerConn::new(ServerSettings::default(), METHODS);
    let mut input: Vec<u8> = Vec::with_capacity(READ_CHUNK);
    let mut out: Vec<u8> = Vec::new();
    let mut calls: Vec<Call> = Vec::new();
    let service = &*service;
    let mut pending = FuturesUnordered::new();
    let stopping = stopped(stop);
    tokio::pin!(stopping);
    let mut draining = false;
    loop {
        for call in calls.drain(..) {
            pending.push(handle(service, call));
        }
        // Every call decided without waiting (all of them, in memory) is answered now,
        // so that one write carries them all.
        while let Some(Some((stream, reply))) = pending.next().now_or_never() {
            respond(&mut conn, stream, reply);
        }
        out.append(conn.output());
        if let Err(e) = tollgate_h2::write_some(&mut out, |b| wr.try_write(b)) {
            debug!(%peer, "gRPC connection: write failed: {e}");
            return;
        }
        if out.is_empty() && conn.is_done() {
            return;
        }
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
                        let _ = tokio::io::AsyncWriteExt::write_all(&mut wr, &out).await;
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
        }
    }
}

fn respond(conn: &mut ServerConn, stream: u32, reply: Result<Vec<u8>, Status>) {
    match &reply {
        Ok(message) => conn.respond(stream, Ok(message)),
        Err(status) => conn.respond(stream, Err(status)),
    }
}

/// One call: a `ShouldRateLimit` ([`decode::request`], [`rls::decide_request`],
/// [`encode::response`]; `UNKNOWN` [`NO_RULES`] while no rules are loaded) or a health
/// `Check` ([`health::check_call`]).
async fn handle(service: &Service, call: Call) -> (u32, Result<Vec<u8>, Status>) {
    if call.method == HEALTH_CHECK {
        return (call.stream, health::check_call(service, &call.message));
    }
    debug_assert_eq!(call.method, SHOULD_RATE_LIMIT);
    let reply = match decode::request(&call.message) {
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
