//! Worker threads for the listeners of `tollgate serve` and `tollgate proxy`.
//!
//! `--workers` threads each run their own single-threaded tokio runtime. One acceptor
//! per listening address (on the main runtime) hands every new connection to the next
//! worker in turn; from then on the connection and all its requests stay on that
//! thread, as with nginx's workers: no request hops between threads, and no
//! work-stealing scheduler wakes idle threads for it (docs/benchmarks.md has the
//! CPU per request before and after).
//!
//! Round robin rather than one `SO_REUSEPORT` socket per worker: gRPC clients (Envoy)
//! hold a few long-lived HTTP/2 connections, and the kernel's hash of four connections
//! over two sockets leaves a worker idle one time in eight; turns spread them evenly.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulConnection;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, error, info, warn};

use tollgate::throttle::Throttle;

use crate::conn::{watchdog, Activity, BodyLimits, Close, Slot, Timeouts, Tracked, Watched};
// `app.rs` takes the gate from here, with the workers.
use crate::conn::Gate;

/// A connection as `grpc::native::serve` takes it: the socket and the client's address.
pub(crate) type Accepted = (std::net::TcpStream, SocketAddr);

/// A connection handed to a worker: the socket, the client's address, and its place
/// under the listener's cap, to hold until the connection closes.
pub(crate) struct Connection {
    pub stream: std::net::TcpStream,
    pub peer: SocketAddr,
    pub slot: Slot,
}

/// The worker count: `requested`, else one per CPU; at least one.
pub(crate) fn count(requested: Option<usize>) -> usize {
    requested
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
        .max(1)
}

/// What [`spawn`] returns: each worker's result, when it ends.
pub(crate) type Done = Vec<oneshot::Receiver<Result<(), String>>>;

/// Starts one thread per input, named `{name}-{i}`, each running `task(input)` to
/// completion on its own single-threaded runtime. The receivers give each task's
/// result (an error if the thread died). `None` (logged) if a thread cannot start.
pub(crate) fn spawn<T, F, Fut>(name: &str, inputs: Vec<T>, task: F) -> Option<Done>
where
    T: Send + 'static,
    F: Fn(T) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<(), String>>,
{
    let mut done = Vec::with_capacity(inputs.len());
    for (i, input) in inputs.into_iter().enumerate() {
        let (tx, rx) = oneshot::channel();
        let task = task.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("{name}-{i}"))
            .spawn(move || {
                let result = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime.block_on(task(input)),
                    Err(e) => Err(format!("cannot start a worker runtime: {e}")),
                };
                let _ = tx.send(result);
            });
        if let Err(e) = spawned {
            error!("cannot start a worker thread: {e}");
            return None;
        }
        done.push(rx);
    }
    Some(done)
}

/// Drains after the stop signal: waits up to `timeout` for `tasks` (the acceptors and
/// any other listener) and then for the workers, logs the outcome and gives the exit
/// code (a timeout exits with success, requests still in flight).
pub(crate) async fn drain(timeout: Duration, tasks: Vec<JoinHandle<()>>, done: Done) -> ExitCode {
    let all = async {
        for task in tasks {
            let _ = task.await;
        }
        join(done).await
    };
    match tokio::time::timeout(timeout, all).await {
        Ok(failed) if failed.is_empty() => {
            info!("drained; bye");
            ExitCode::SUCCESS
        }
        Ok(failed) => {
            error!(errors = %failed.join("; "), "a worker failed");
            ExitCode::FAILURE
        }
        Err(_) => {
            warn!("drain timeout: exiting with requests still in flight");
            ExitCode::SUCCESS
        }
    }
}

/// Waits for every worker's result; the errors, if any.
async fn join(done: Done) -> Vec<String> {
    let mut failed = Vec::new();
    for rx in done {
        match rx.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => failed.push(e),
            Err(_) => failed.push("a worker thread stopped".into()),
        }
    }
    failed
}

/// `n` channels to hand connections to workers: the senders for [`distribute`], the
/// receivers for the workers.
pub(crate) fn channels(
    n: usize,
) -> (
    Vec<mpsc::UnboundedSender<Connection>>,
    Vec<mpsc::UnboundedReceiver<Connection>>,
) {
    (0..n).map(|_| mpsc::unbounded_channel()).unzip()
}

/// Connections a listener holds when `--max-connections` is not set and the open-file
/// limit allows. An idle connection takes 25 to 45 KB (release build, 3,000 idle
/// connections each: HTTP/1 after a request 34 KB, HTTP/2 43 KB, native gRPC 25 KB,
/// tonic 33 KB), so a listener full of idle clients holds 250 to 430 MB; enough for
/// thousands of Envoys' long-lived gRPC connections. Under a default `ulimit -n` of
/// 1,024, [`connection_cap`] lowers it to what the descriptors hold.
pub(crate) const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// File descriptors kept out of the listeners' share of the open-file limit: Redis
/// connections, the rule watcher, each runtime's epoll, and the like.
const RESERVED_FDS: u64 = 256;

/// Each listener's connection cap: `requested` (`--max-connections`), else
/// [`DEFAULT_MAX_CONNECTIONS`] or, when the open-file limit `open_files` is lower than
/// that needs, the listeners' share of it. `fds_per_connection` is the descriptors one
/// connection on every listener takes together (`serve`: 2, one per listener; the
/// gateway: 2 for a client and its upstream connection, plus 1 with an admin
/// listener). Also what to warn about, if anything.
fn connection_cap(
    requested: Option<u32>,
    fds_per_connection: u64,
    open_files: Option<u64>,
) -> (usize, Option<String>) {
    let share = open_files.map(|limit| {
        let usable = if limit > 2 * RESERVED_FDS {
            limit - RESERVED_FDS
        } else {
            limit / 2
        };
        (
            limit,
            usize::try_from(usable / fds_per_connection.max(1))
                .unwrap_or(usize::MAX)
                .max(1),
        )
    });
    match (requested, share) {
        (Some(n), Some((limit, share))) if n as usize > share => (
            n as usize,
            Some(format!(
                "--max-connections {n}: the open-file limit (ulimit -n) is {limit}, enough for \
                 about {share} per listener; past it, accepts fail until connections close"
            )),
        ),
        (Some(n), _) => (n as usize, None),
        (None, Some((limit, share))) if share < DEFAULT_MAX_CONNECTIONS => (
            share,
            Some(format!(
                "the open-file limit (ulimit -n) is {limit}: at most {share} connections per \
                 listener (raise the limit, or set --max-connections)"
            )),
        ),
        (None, _) => (DEFAULT_MAX_CONNECTIONS, None),
    }
}

/// The soft open-file limit (`ulimit -n`), where the system says (Linux's
/// `/proc/self/limits`); `None` when unknown or unlimited.
fn open_file_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Each listener's connection cap, as [`connection_cap`] says with this process's
/// open-file limit; logs a warning when that limit is in the way.
pub(crate) fn max_connections(requested: Option<u32>, fds_per_connection: u64) -> usize {
    let (cap, warning) = connection_cap(requested, fds_per_connection, open_file_limit());
    if let Some(warning) = warning {
        warn!("{warning}");
    }
    cap
}

/// The first pause after an `accept` failure that is not the client's (out of file
/// descriptors, say); each failure in a row doubles it, up to [`ACCEPT_BACKOFF_MAX`].
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// The longest pause between two `accept` attempts that fail.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_millis(500);
/// At most one "accept failed" (and one "at the connection cap") log per listener this
/// often.
const ACCEPT_LOG_EVERY: Duration = Duration::from_secs(5);

/// Resolves when `stop` turns true.
pub(crate) async fn stopped(mut stop: watch::Receiver<bool>) {
    while !*stop.borrow() {
        if stop.changed().await.is_err() {
            return;
        }
    }
}

/// Accepts connections on `listener` until `stop` and hands them to `workers` in turn
/// (with `TCP_NODELAY` set). Dropping the senders at the end tells the workers that no
/// more connections come.
///
/// At most `gate`'s cap of connections are open at once: at the cap this stops
/// accepting until one closes, so that the clients connected go on being served and
/// new ones wait in the kernel's listen backlog (as nginx does at `worker_connections`;
/// closing them at once instead would cost an accept and a close each, and only make
/// them retry). An `accept` that fails for want of resources (out of file
/// descriptors) is retried after a pause that doubles up to [`ACCEPT_BACKOFF_MAX`],
/// logged at most once per [`ACCEPT_LOG_EVERY`] with the number of failures.
pub(crate) async fn distribute(
    listener: TcpListener,
    workers: Vec<mpsc::UnboundedSender<Connection>>,
    stop: watch::Receiver<bool>,
    gate: Gate,
) {
    let stopping = stopped(stop);
    tokio::pin!(stopping);
    let mut next = 0usize;
    let mut backoff = ACCEPT_BACKOFF_MIN;
    let (failures, full) = (
        Throttle::new(ACCEPT_LOG_EVERY),
        Throttle::new(ACCEPT_LOG_EVERY),
    );
    loop {
        let slot = match gate.try_slot() {
            Some(slot) => slot,
            None => {
                gate.metrics().capped.inc();
                if let Some(times) = full.hit(Instant::now().into_std()) {
                    warn!(
                        listener = gate.name(),
                        times, "at the connection cap (--max-connections): not accepting until a connection closes"
                    );
                }
                tokio::select! {
                    slot = gate.next_slot() => match slot {
                        Some(slot) => slot,
                        None => break,
                    },
                    () = &mut stopping => break,
                }
            }
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => {
                    backoff = ACCEPT_BACKOFF_MIN;
                    a
                }
                Err(e) if client_gone(&e) => continue,
                Err(e) => {
                    gate.metrics().accept_errors.inc();
                    if let Some(failures) = failures.hit(Instant::now().into_std()) {
                        let pause = crate::HumanDuration(backoff);
                        error!(listener = gate.name(), failures, "accept failed: {e}; retrying in {pause} and less often while it fails");
                    }
                    tokio::select! {
                        () = tokio::time::sleep(backoff) => {}
                        () = &mut stopping => break,
                    }
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                    continue;
                }
            },
            () = &mut stopping => break,
        };
        let _ = stream.set_nodelay(true);
        let stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                debug!(%peer, "cannot hand over a connection: {e}");
                continue;
            }
        };
        if workers.is_empty() {
            break;
        }
        // A worker that has stopped drops its receiver; its turn passes to the next.
        let mut item = Connection { stream, peer, slot };
        for _ in 0..workers.len() {
            let worker = &workers[next % workers.len()];
            next = next.wrapping_add(1);
            match worker.send(item) {
                Ok(()) => break,
                Err(mpsc::error::SendError(back)) => item = back,
            }
        }
    }
}

/// Whether an `accept` error is the client's (it gave up before the accept): skipped.
fn client_gone(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    )
}

/// How often an HTTP/2 server PINGs a connection that has sent nothing (a client that
/// does not answer within [`HTTP2_KEEPALIVE_TIMEOUT`] is gone: closed).
const HTTP2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// How long an HTTP/2 keepalive PING may wait for its answer.
pub(crate) const HTTP2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// The keepalive PING interval of the gRPC listener: [`HTTP2_KEEPALIVE_INTERVAL`], or
/// half the idle timeout when that is shorter, so that a client that answers is never
/// silent for the idle timeout ([`Watched`] closes one that is).
pub(crate) fn grpc_keepalive(idle: Duration) -> Duration {
    HTTP2_KEEPALIVE_INTERVAL.min(idle / 2)
}

/// A worker's gRPC connections as tonic takes them ([`Watched`]: each holds its slot
/// under the listener's cap until it closes, and is closed without a preface or when
/// the client goes silent), until the acceptor stops.
pub(crate) fn incoming(
    mut connections: mpsc::UnboundedReceiver<Connection>,
    timeouts: Timeouts,
) -> impl futures_util::Stream<Item = std::io::Result<Watched>> {
    futures_util::stream::poll_fn(move |cx| {
        connections.poll_recv(cx).map(|next| {
            next.map(|c| TcpStream::from_std(c.stream).map(|s| Watched::new(s, c.slot, timeouts)))
        })
    })
}

/// How long a client has to finish its TLS handshake before its connection is closed.
pub(crate) const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Streams an HTTP/2 client of an HTTP listener may have open at once (hyper's default).
const HTTP2_MAX_CONCURRENT_STREAMS: u32 = 200;
/// Largest header list an HTTP/2 client of an HTTP listener may send (hyper's default).
const HTTP2_MAX_HEADER_LIST_SIZE: u32 = 16 << 10;
/// Streams an HTTP/2 client may open and reset before the server has accepted them,
/// before its connection is closed (h2's default; the "rapid reset" attack).
const HTTP2_MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 20;
/// How long a connection that is closed as idle has to close properly (an HTTP/2
/// GOAWAY and its answer) before it is dropped.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// What the HTTP listeners hold their connections to.
#[derive(Clone)]
pub(crate) struct HttpLimits {
    /// The connection timeouts.
    pub timeouts: Timeouts,
    /// Request bodies: a size limit and a listener-wide budget where handlers buffer
    /// them (`serve`'s HTTP API); none for the gateway, which streams them.
    pub bodies: BodyLimits,
}

/// hyper's connection builder for the HTTP listeners, every limit set: HTTP/1 header
/// read timeout; HTTP/2 streams, header list, pending resets and keepalive PINGs.
fn http_builder(timeouts: &Timeouts) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(timeouts.header_read);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(HTTP2_MAX_CONCURRENT_STREAMS)
        .max_header_list_size(HTTP2_MAX_HEADER_LIST_SIZE)
        .max_pending_accept_reset_streams(HTTP2_MAX_PENDING_ACCEPT_RESET_STREAMS)
        .keep_alive_interval(HTTP2_KEEPALIVE_INTERVAL)
        .keep_alive_timeout(HTTP2_KEEPALIVE_TIMEOUT);
    builder
}

/// Serves HTTP/1.1 and HTTP/2 (prior knowledge, or by ALPN over TLS) on the
/// connections a worker is handed, with `service`, until `stop` or the acceptor ends;
/// then lets the open connections finish their requests (idle keep-alive connections
/// are closed at once). With `tls`, every connection first completes a TLS handshake
/// (within [`TLS_HANDSHAKE_TIMEOUT`], in its own task) or is closed. The client's
/// address is in each request's extensions as `ConnectInfo<SocketAddr>`.
///
/// Each connection is held to `limits` (see [`crate::conn`]): closed by its
/// [`watchdog`] when no request comes within the header-read timeout of the accept, or
/// none for the idle timeout after (an HTTP/1 connection waiting for its next
/// request's headers is closed by hyper at the header-read timeout, if that is
/// sooner); its request bodies cut when they pause for the idle timeout, and held to
/// the body limits. Most of their cost is hyper's header-read timer, set again for each
/// request (measured in docs/benchmarks.md).
///
/// hyper directly, not `axum::serve`: it takes the connections from the channel, and
/// the gateway has no routes (axum's router was a visible share of a 429, callgrind).
pub(crate) async fn serve_http<S>(
    mut connections: mpsc::UnboundedReceiver<Connection>,
    service: S,
    tls: Option<TlsAcceptor>,
    stop: watch::Receiver<bool>,
    limits: HttpLimits,
) where
    S: tower::Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + Unpin
        + 'static,
    S::Future: Send + Unpin + 'static,
{
    let builder = http_builder(&limits.timeouts);
    // Each connection's task holds a sender; `recv` answers `None` once all have ended.
    let (running, mut all_ended) = mpsc::channel::<()>(1);
    let stopping = stopped(stop.clone());
    tokio::pin!(stopping);
    loop {
        let Connection { stream, peer, slot } = tokio::select! {
            next = connections.recv() => match next {
                Some(c) => c,
                None => break,
            },
            () = &mut stopping => break,
        };
        let stream = match TcpStream::from_std(stream) {
            Ok(s) => s,
            Err(e) => {
                debug!(%peer, "cannot serve a connection: {e}");
                continue;
            }
        };
        let activity = Arc::new(Activity::default());
        let service = Tracked::new(
            service.clone(),
            peer,
            Arc::clone(&activity),
            limits.timeouts.idle,
            limits.bodies.clone(),
        );
        let (builder, tls, stop) = (builder.clone(), tls.clone(), stop.clone());
        let (timeouts, running) = (limits.timeouts, running.clone());
        tokio::spawn(async move {
            let _held = (slot, running);
            let Some(tls) = tls else {
                let serving = builder.serve_connection(TokioIo::new(stream), service);
                return watch_connection(serving, activity, timeouts, stop, peer).await;
            };
            let stream = match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, tls.accept(stream)).await
            {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => {
                    debug!(%peer, "TLS handshake failed: {e}");
                    return;
                }
                Err(_) => {
                    debug!(%peer, "TLS handshake not done within {TLS_HANDSHAKE_TIMEOUT:?}");
                    return;
                }
            };
            let serving = builder.serve_connection(TokioIo::new(stream), service);
            watch_connection(serving, activity, timeouts, stop, peer).await;
        });
    }
    drop((connections, running));
    let _ = all_ended.recv().await;
}

/// Runs one HTTP connection until it ends; closes it (gracefully: HTTP/2 sends GOAWAY)
/// when its [`watchdog`] says: at `stop`, or idle (then dropped if it has not closed
/// within [`CLOSE_GRACE`]).
async fn watch_connection<C>(
    connection: C,
    activity: Arc<Activity>,
    timeouts: Timeouts,
    stop: watch::Receiver<bool>,
    peer: SocketAddr,
) where
    C: GracefulConnection,
    C::Error: std::fmt::Display,
{
    let (close_tx, close_rx) = oneshot::channel();
    tokio::spawn(watchdog(activity, timeouts, stopped(stop), close_tx));
    tokio::pin!(connection);
    let close = tokio::select! {
        biased;
        ended = connection.as_mut() => {
            if let Err(e) = ended {
                debug!(%peer, "connection ended: {e}");
            }
            return;
        }
        close = close_rx => close,
    };
    connection.as_mut().graceful_shutdown();
    let ended = match close {
        Ok(Close::Idle) => {
            debug!(%peer, "closing an idle connection");
            tokio::time::timeout(CLOSE_GRACE, connection).await.ok()
        }
        // The drain: bounded by --drain-timeout, for the requests in flight.
        Ok(Close::Drain) | Err(_) => Some(connection.await),
    };
    if let Some(Err(e)) = ended {
        debug!(%peer, "connection ended: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conn::BodyBudget;
    use crate::metrics::ListenerMetrics;
    use axum::extract::ConnectInfo;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn test_gate(max: usize) -> Gate {
        Gate::new("test", max, ListenerMetrics::default())
    }

    fn limits(header_read_ms: u64, idle_ms: u64, bodies: BodyLimits) -> HttpLimits {
        HttpLimits {
            timeouts: Timeouts {
                header_read: Duration::from_millis(header_read_ms),
                idle: Duration::from_millis(idle_ms),
            },
            bodies,
        }
    }

    /// Which worker (thread) answered: its name.
    fn whoami() -> impl tower::Service<
        Request<Body>,
        Response = Response<Body>,
        Error = Infallible,
        Future = std::future::Ready<Result<Response<Body>, Infallible>>,
    > + Clone {
        tower::service_fn(|request: Request<Body>| {
            let peer = request
                .extensions()
                .get::<ConnectInfo<SocketAddr>>()
                .map(|c| c.0.ip().to_string())
                .unwrap_or_default();
            let thread = std::thread::current().name().unwrap_or("?").to_string();
            std::future::ready(Ok(Response::new(Body::from(format!("{thread} {peer}")))))
        })
    }

    async fn get(addr: SocketAddr) -> String {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut out = String::new();
        s.read_to_string(&mut out).await.expect("read");
        out.rsplit("\r\n\r\n")
            .next()
            .unwrap_or_default()
            .to_string()
    }

    #[tokio::test]
    async fn connections_go_to_the_workers_in_turn_and_stop_drains() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop_tx, stop_rx) = watch::channel(false);
        let (senders, receivers) = channels(2);
        let done = spawn("test-worker", receivers, {
            let stop = stop_rx.clone();
            move |rx| {
                let stop = stop.clone();
                async move {
                    let limits = limits(10_000, 10_000, BodyLimits::default());
                    serve_http(rx, whoami(), None, stop, limits).await;
                    Ok(())
                }
            }
        })
        .expect("the workers start");
        let acceptor = tokio::spawn(distribute(listener, senders, stop_rx, test_gate(100)));
        let mut answers = Vec::new();
        for _ in 0..4 {
            answers.push(get(addr).await);
        }
        assert_eq!(
            answers,
            [
                "test-worker-0 127.0.0.1",
                "test-worker-1 127.0.0.1",
                "test-worker-0 127.0.0.1",
                "test-worker-1 127.0.0.1"
            ]
        );
        stop_tx.send(true).expect("stop");
        tokio::time::timeout(Duration::from_secs(5), acceptor)
            .await
            .expect("the acceptor stops")
            .expect("join");
        let failed = tokio::time::timeout(Duration::from_secs(5), join(done))
            .await
            .expect("the workers stop");
        assert!(failed.is_empty(), "{failed:?}");
        assert!(TcpStream::connect(addr).await.is_err(), "still listening");
    }

    #[test]
    fn the_default_cap_fits_the_open_file_limit() {
        // Plenty of descriptors: the default.
        assert_eq!(
            connection_cap(None, 2, Some(1 << 20)),
            (DEFAULT_MAX_CONNECTIONS, None)
        );
        assert_eq!(
            connection_cap(None, 2, None),
            (DEFAULT_MAX_CONNECTIONS, None)
        );
        // `ulimit -n 1024`: `serve`'s two listeners share 1024 - 256.
        let (cap, warning) = connection_cap(None, 2, Some(1024));
        assert_eq!(cap, 384);
        assert!(warning.is_some_and(|w| w.contains("1024")));
        // The gateway with its admin listener: a client, its upstream, an admin client.
        assert_eq!(connection_cap(None, 3, Some(1024)).0, 256);
        // A tiny limit still leaves some.
        assert_eq!(connection_cap(None, 2, Some(100)).0, 25);
        // Asked for: kept, with a warning when the limit cannot hold it.
        assert_eq!(connection_cap(Some(4), 2, Some(1024)), (4, None));
        let (cap, warning) = connection_cap(Some(5_000), 2, Some(1024));
        assert_eq!(cap, 5_000);
        assert!(warning.is_some_and(|w| w.contains("about 384 per listener")));
    }

    /// Whether `stream` is closed by the server (EOF or reset) within `within`.
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

    /// A one-worker HTTP listener with `service` and `limits`, at most `max`
    /// connections; its address and the stop signal.
    async fn listen<S>(
        service: S,
        limits: HttpLimits,
        max: usize,
    ) -> (SocketAddr, watch::Sender<bool>)
    where
        S: tower::Service<Request<Body>, Response = Response<Body>, Error = Infallible>
            + Clone
            + Send
            + Unpin
            + 'static,
        S::Future: Send + Unpin + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop_tx, stop_rx) = watch::channel(false);
        let (senders, mut receivers) = channels(1);
        let rx = receivers.pop().expect("one");
        tokio::spawn(serve_http(rx, service, None, stop_rx.clone(), limits));
        tokio::spawn(distribute(listener, senders, stop_rx, test_gate(max)));
        (addr, stop_tx)
    }

    #[tokio::test]
    async fn silent_and_idle_connections_are_closed_and_busy_ones_are_not() {
        let (addr, _stop) = listen(whoami(), limits(300, 600, BodyLimits::default()), 100).await;
        // Connects and sends nothing: closed after the header-read timeout.
        let mut silent = TcpStream::connect(addr).await.expect("connect");
        assert!(closed_within(&mut silent, Duration::from_secs(5)).await);
        // One request, then idle: open through the header-read timeout, closed after
        // the idle timeout (or hyper's header-read timer, if sooner).
        let mut idle = TcpStream::connect(addr).await.expect("connect");
        idle.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("write");
        let mut buf = [0u8; 1024];
        assert!(idle.read(&mut buf).await.expect("read") > 0);
        assert!(closed_within(&mut idle, Duration::from_secs(5)).await);
        // Requests more often than the idle timeout: kept open.
        let mut busy = TcpStream::connect(addr).await.expect("connect");
        for _ in 0..6 {
            busy.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .expect("write");
            assert!(
                busy.read(&mut buf).await.expect("read") > 0,
                "closed while busy"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // HTTP/2 with prior knowledge, answering the server: its PINGs do not count
        // as requests, the connection is closed (GOAWAY, then EOF).
        let mut h2 = TcpStream::connect(addr).await.expect("connect");
        h2.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
            .await
            .expect("preface");
        assert!(closed_within(&mut h2, Duration::from_secs(5)).await);
    }

    /// A boxed response future.
    type Answer =
        std::pin::Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    /// Buffers the request body and answers its length, or the error.
    fn buffering() -> impl tower::Service<
        Request<Body>,
        Response = Response<Body>,
        Error = Infallible,
        Future = Answer,
    > + Clone {
        tower::service_fn(|request: Request<Body>| {
            Box::pin(async move {
                let answer = match axum::body::to_bytes(request.into_body(), usize::MAX).await {
                    Ok(body) => format!("read {}", body.len()),
                    Err(e) => format!("failed: {}", crate::error_chain(&e)),
                };
                Ok::<_, Infallible>(Response::new(Body::from(answer)))
            }) as Answer
        })
    }

    async fn response(stream: &mut TcpStream) -> String {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(Ok(n @ 1..)) =
            tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await
        {
            out.extend_from_slice(&buf[..n]);
            if out.windows(4).any(|w| w == b"\r\n\r\n") && !out.ends_with(b"\r\n\r\n") {
                break;
            }
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    #[tokio::test]
    async fn a_body_that_stalls_is_cut_and_bodies_share_the_budget() {
        let budget = Arc::new(BodyBudget::new(1_000));
        let bodies = BodyLimits {
            max: Some(800),
            per_connection: None,
            budget: Some(Arc::clone(&budget)),
        };
        let (addr, _stop) = listen(buffering(), limits(5_000, 400, bodies), 100).await;
        let post =
            |len: usize| format!("POST / HTTP/1.1\r\nhost: x\r\ncontent-length: {len}\r\n\r\n");
        // Half a body, then nothing: cut after the idle timeout.
        let mut stalled = TcpStream::connect(addr).await.expect("connect");
        stalled
            .write_all(format!("{}{}", post(700), "x".repeat(600)).as_bytes())
            .await
            .expect("write");
        // Meanwhile the 600 bytes it holds leave 400 of the budget: a second body of
        // 500 fails, one of 300 passes.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut over = TcpStream::connect(addr).await.expect("connect");
        over.write_all(format!("{}{}", post(500), "y".repeat(500)).as_bytes())
            .await
            .expect("write");
        let answer = response(&mut over).await;
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(answer.contains("too many request bodies"), "{answer}");
        let mut fits = TcpStream::connect(addr).await.expect("connect");
        fits.write_all(format!("{}{}", post(300), "z".repeat(300)).as_bytes())
            .await
            .expect("write");
        let answer = response(&mut fits).await;
        assert!(answer.ends_with("read 300"), "{answer}");
        let answer = response(&mut stalled).await;
        assert!(answer.contains("sent nothing for 400ms"), "{answer}");
        // Every body dropped: the budget is whole again.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(budget.used(), 0);
        // Past the size limit: `LengthLimitError` (axum's 413).
        let mut large = TcpStream::connect(addr).await.expect("connect");
        large
            .write_all(format!("{}{}", post(900), "w".repeat(900)).as_bytes())
            .await
            .expect("write");
        let answer = response(&mut large).await;
        assert!(answer.contains("length limit exceeded"), "{answer}");
    }

    #[tokio::test]
    async fn at_the_cap_new_connections_wait_until_one_closes() {
        let (addr, _stop) =
            listen(whoami(), limits(10_000, 10_000, BodyLimits::default()), 2).await;
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut s = TcpStream::connect(addr).await.expect("connect");
            s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .expect("write");
            assert!(s.read(&mut [0u8; 1024]).await.expect("read") > 0);
            held.push(s);
        }
        // The third is in the backlog: connected, not answered.
        let mut third = TcpStream::connect(addr).await.expect("connect");
        third
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut buf = [0u8; 1024];
        assert!(
            tokio::time::timeout(Duration::from_millis(300), third.read(&mut buf))
                .await
                .is_err(),
            "served past the cap"
        );
        drop(held.pop());
        let n = tokio::time::timeout(Duration::from_secs(5), third.read(&mut buf))
            .await
            .expect("served once a connection closed")
            .expect("read");
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    }

    #[tokio::test]
    async fn a_grpc_connection_without_a_preface_or_gone_silent_is_closed() {
        let timeouts = Timeouts {
            header_read: Duration::from_millis(200),
            idle: Duration::from_millis(400),
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let gate = test_gate(10);
        let accept = || async {
            let (stream, _) = listener.accept().await.expect("accept");
            Watched::new(stream, gate.try_slot().expect("a slot"), timeouts)
        };
        // Nothing sent: the read fails after the header-read timeout.
        let _client = TcpStream::connect(addr).await.expect("connect");
        let mut server = accept().await;
        let started = Instant::now();
        let e = server.read(&mut [0u8; 64]).await.expect_err("timed out");
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(150));
        drop(server);
        // The preface, then bytes more often than the idle timeout: kept; then
        // silence: closed.
        let mut client = TcpStream::connect(addr).await.expect("connect");
        let mut server = accept().await;
        client.write_all(&[b'P'; 24]).await.expect("write");
        let mut buf = [0u8; 64];
        assert_eq!(server.read(&mut buf).await.expect("read"), 24);
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            client.write_all(b"ping").await.expect("write");
            assert_eq!(server.read(&mut buf).await.expect("read"), 4);
        }
        let e = server.read(&mut buf).await.expect_err("timed out");
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        // The slots came back as the connections were dropped.
        drop(server);
        assert_eq!(gate.available(), 10);
    }
}
