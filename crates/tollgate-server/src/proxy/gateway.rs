//! The composition root of `tollgate proxy`: rules and store (as `serve` builds them) →
//! [`RateLimitLayer`] over the [`Upstream`] forwarder → `--workers` threads, each with
//! its own single-threaded runtime, `SO_REUSEPORT` listener and upstream pool (the
//! limiter, its store and the permits are shared by all).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::watch;
use tollgate::http::RateLimitLayer;
use tollgate::inflight::{InFlight, MemoryInFlight, Permit, RedisInFlight};
use tollgate::store;
use tower::Layer;
use tracing::{error, info, warn};

use super::forward::{ForwardSettings, Upstream};
use crate::app::{core, init_logging, runtime, shutdown_signal, stopped, Core};
use crate::cli::ProxyArgs;
use crate::store::AnyStore;

/// Runs the gateway until SIGTERM or SIGINT, then drains.
pub fn run(args: ProxyArgs) -> ExitCode {
    init_logging(&args.common);
    match runtime() {
        Some(rt) => rt.block_on(serve(args)),
        None => ExitCode::FAILURE,
    }
}

/// Concurrency permits where the counters are: in memory, or leases in Redis.
enum AnyInFlight {
    Memory(MemoryInFlight),
    Redis(Box<RedisInFlight>),
}

impl InFlight for AnyInFlight {
    async fn acquire(&self, key: &[u8], max: u64) -> Result<Option<Permit>, store::Error> {
        match self {
            AnyInFlight::Memory(m) => m.acquire(key, max).await,
            AnyInFlight::Redis(r) => r.acquire(key, max).await,
        }
    }
}

async fn serve(args: ProxyArgs) -> ExitCode {
    let Some(core) = core(&args.common, false).await else {
        return ExitCode::FAILURE;
    };
    let Core {
        limiter,
        store_name,
        _watcher,
        ..
    } = core;
    let settings = ForwardSettings {
        connect_timeout: args.connect_timeout,
        response_timeout: args.upstream_timeout,
        ..ForwardSettings::default()
    };
    let upstream = match Upstream::new(&args.upstream, settings) {
        Ok(u) => u,
        Err(e) => {
            error!(upstream = %args.upstream, "cannot use the upstream: {e}");
            return ExitCode::FAILURE;
        }
    };
    let inflight = if args.common.store.starts_with("redis://") {
        match RedisInFlight::builder(args.common.store.clone())
            .prefix(format!("{}:inflight", args.common.redis_prefix))
            .lease(args.permit_lease)
            .deadline(args.common.redis_deadline)
            .connect()
            .await
        {
            Ok(r) => AnyInFlight::Redis(Box::new(r)),
            Err(e) => {
                error!("cannot open the Redis permits: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        if args.common.store != "memory" {
            warn!("concurrency permits stay in this instance's memory on a Redis Cluster");
        }
        AnyInFlight::Memory(MemoryInFlight::new())
    };
    let layer = match RateLimitLayer::new(Arc::new(limiter)) {
        Ok(l) => l
            .with_inflight(inflight)
            .with_legacy_headers(args.common.legacy_headers),
        Err(errors) => {
            for e in errors.iter() {
                error!("{e}");
            }
            error!("the http sections are invalid; not starting");
            return ExitCode::FAILURE;
        }
    };
    let workers = args
        .workers
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
        .max(1);
    let (listeners, addr) = match listeners(args.listen, workers) {
        Ok(l) => l,
        Err(e) => {
            error!(addr = %args.listen, "cannot listen: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut done = Vec::with_capacity(workers);
    for (i, listener) in listeners.into_iter().enumerate() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        done.push(rx);
        let worker = Worker {
            listener,
            layer: layer.clone(),
            upstream: args.upstream.clone(),
            settings,
            stop: stop_rx.clone(),
        };
        let spawned = std::thread::Builder::new()
            .name(format!("tollgate-proxy-{i}"))
            .spawn(move || {
                let _ = tx.send(worker.run());
            });
        if let Err(e) = spawned {
            error!("cannot start a worker thread: {e}");
            return ExitCode::FAILURE;
        }
    }
    info!(listen = %addr, upstream = %upstream.authority(), store = store_name, workers, "tollgate proxy serving");
    shutdown_signal().await;
    info!(timeout = ?args.common.drain_timeout, "draining: finishing in-flight requests");
    let _ = stop_tx.send(true);
    let all = async {
        let mut results = Vec::with_capacity(done.len());
        for rx in done {
            results.push(rx.await);
        }
        results
    };
    match tokio::time::timeout(args.common.drain_timeout, all).await {
        Ok(results) => {
            let failed: Vec<String> = results
                .into_iter()
                .filter_map(|r| match r {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => Some(e),
                    Err(_) => Some("a worker thread stopped".into()),
                })
                .collect();
            if failed.is_empty() {
                info!("drained; bye");
                ExitCode::SUCCESS
            } else {
                error!(errors = ?failed, "a listener failed");
                ExitCode::FAILURE
            }
        }
        Err(_) => {
            warn!("drain timeout: exiting with requests still in flight");
            ExitCode::SUCCESS
        }
    }
}

/// `workers` listening sockets on one address (`SO_REUSEPORT`: the kernel spreads
/// connections over them), and the address they got.
fn listeners(
    addr: SocketAddr,
    workers: usize,
) -> std::io::Result<(Vec<std::net::TcpListener>, SocketAddr)> {
    let mut out = Vec::with_capacity(workers);
    let mut bound = addr;
    for _ in 0..workers {
        let socket = if bound.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        #[cfg(unix)]
        socket.set_reuseport(true)?;
        socket.set_nodelay(true)?;
        socket.bind(bound)?;
        let listener = socket.listen(1024)?;
        // A port 0 becomes the port the first socket got; the others share it.
        bound = listener.local_addr()?;
        out.push(listener.into_std()?);
        #[cfg(not(unix))]
        break;
    }
    Ok((out, bound))
}

/// One thread of the gateway: its own single-threaded runtime, listener and upstream
/// connection pool, so a request never hops between threads (as nginx's workers).
struct Worker {
    listener: std::net::TcpListener,
    layer: RateLimitLayer<AnyStore, AnyInFlight>,
    upstream: String,
    settings: ForwardSettings,
    stop: watch::Receiver<bool>,
}

impl Worker {
    fn run(self) -> Result<(), String> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start a worker runtime: {e}"))?;
        runtime.block_on(async move {
            let listener = TcpListener::from_std(self.listener).map_err(|e| e.to_string())?;
            let upstream = Upstream::new(&self.upstream, self.settings)?;
            let app = axum::Router::new().fallback_service(self.layer.layer(upstream));
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .with_graceful_shutdown(stopped(self.stop))
            .await
            .map_err(|e| e.to_string())
        })
    }
}
