//! Worker threads for the listeners of `tollgate serve` and `tollgate proxy`.
//!
//! `--workers` threads each run their own single-threaded tokio runtime. One acceptor
//! per listening address (on the main runtime) hands every new connection to the next
//! worker in turn; from then on the connection and all its requests stay on that
//! thread, as with nginx's workers. On this 2-core machine that took a forwarded
//! request from 40–48 µs to 29–36 µs of CPU: no request hops between threads, and no
//! work-stealing scheduler wakes idle threads for it.
//!
//! Round robin rather than one `SO_REUSEPORT` socket per worker: gRPC clients (Envoy)
//! hold a few long-lived HTTP/2 connections, and the kernel's hash of four connections
//! over two sockets leaves a worker idle one time in eight; turns spread them evenly.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, error, info, warn};

use crate::app::stopped;

/// A connection handed to a worker: the socket and the client's address.
pub(crate) type Accepted = (std::net::TcpStream, SocketAddr);

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
            error!(errors = ?failed, "a worker failed");
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
    Vec<mpsc::UnboundedSender<Accepted>>,
    Vec<mpsc::UnboundedReceiver<Accepted>>,
) {
    (0..n).map(|_| mpsc::unbounded_channel()).unzip()
}

/// Accepts connections on `listener` until `stop` and hands them to `workers` in turn
/// (with `TCP_NODELAY` set). Dropping the senders at the end tells the workers that no
/// more connections come.
pub(crate) async fn distribute(
    listener: TcpListener,
    workers: Vec<mpsc::UnboundedSender<Accepted>>,
    stop: watch::Receiver<bool>,
) {
    let stopping = stopped(stop);
    tokio::pin!(stopping);
    let mut next = 0usize;
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    accept_failed(e).await;
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
        let mut item = (stream, peer);
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

/// An `accept` error: per-connection ones (the client gave up) are skipped; others
/// (out of file descriptors) are logged and retried after a pause, as axum does.
async fn accept_failed(e: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    error!("accept failed: {e}; retrying in 1 s");
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
}

/// A worker's connections as tokio sockets on its own runtime, until the acceptor
/// stops; for servers that take a stream of connections (tonic).
pub(crate) fn incoming(
    mut connections: mpsc::UnboundedReceiver<Accepted>,
) -> impl futures_util::Stream<Item = std::io::Result<TcpStream>> {
    futures_util::stream::poll_fn(move |cx| {
        connections
            .poll_recv(cx)
            .map(|next| next.map(|(stream, _)| TcpStream::from_std(stream)))
    })
}

/// How long a client has to finish its TLS handshake before its connection is closed.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves HTTP/1.1 and HTTP/2 (prior knowledge, or by ALPN over TLS) on the
/// connections a worker is handed, with `service`, until `stop` or the acceptor ends;
/// then lets the open connections finish their requests (idle keep-alive connections
/// are closed at once). With `tls`, every connection first completes a TLS handshake
/// (within [`TLS_HANDSHAKE_TIMEOUT`], in its own task) or is closed. The client's
/// address is in each request's extensions as `ConnectInfo<SocketAddr>`.
///
/// hyper directly, not `axum::serve`: it takes the connections from the channel, and
/// the gateway has no routes (axum's router was a visible share of a 429, callgrind).
pub(crate) async fn serve_http<S>(
    mut connections: mpsc::UnboundedReceiver<Accepted>,
    service: S,
    tls: Option<TlsAcceptor>,
    stop: watch::Receiver<bool>,
) where
    S: tower::Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let builder = auto::Builder::new(TokioExecutor::new());
    let graceful = GracefulShutdown::new();
    let stopping = stopped(stop);
    tokio::pin!(stopping);
    loop {
        let (stream, peer) = tokio::select! {
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
        let service = tower::ServiceBuilder::new()
            .map_request(move |request: Request<Incoming>| {
                let mut request = request.map(Body::new);
                request.extensions_mut().insert(ConnectInfo(peer));
                request
            })
            .service(service.clone());
        let Some(tls) = &tls else {
            let connection = builder
                .serve_connection(TokioIo::new(stream), TowerToHyperService::new(service))
                .into_owned();
            let connection = graceful.watch(connection);
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    debug!(%peer, "connection ended: {e}");
                }
            });
            continue;
        };
        let (tls, builder, watcher) = (tls.clone(), builder.clone(), graceful.watcher());
        tokio::spawn(async move {
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
            let connection = builder
                .serve_connection(TokioIo::new(stream), TowerToHyperService::new(service))
                .into_owned();
            if let Err(e) = watcher.watch(connection).await {
                debug!(%peer, "connection ended: {e}");
            }
        });
    }
    drop(connections);
    graceful.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
                    serve_http(rx, whoami(), None, stop).await;
                    Ok(())
                }
            }
        })
        .expect("the workers start");
        let acceptor = tokio::spawn(distribute(listener, senders, stop_rx));
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
}
