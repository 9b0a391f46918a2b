//! The composition root of `tollgate proxy`: rules and store (as `serve` builds them) →
//! [`RateLimitLayer`] over the [`Upstream`] forwarder → one HTTP listener.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tollgate::http::RateLimitLayer;
use tollgate::inflight::{InFlight, MemoryInFlight, Permit, RedisInFlight};
use tollgate::store;
use tower::Layer;
use tracing::{error, info, warn};

use super::forward::{ForwardSettings, Upstream};
use crate::app::{core, init_logging, runtime, shutdown_signal, stopped, Core};
use crate::cli::ProxyArgs;

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
    let listener = match TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(e) => {
            error!(addr = %args.listen, "cannot listen: {e}");
            return ExitCode::FAILURE;
        }
    };
    let addr = listener.local_addr().map_or(args.listen, |a| a);
    let app = axum::Router::new().fallback_service(layer.layer(upstream.clone()));
    let (stop_tx, stop_rx) = watch::channel(false);
    let server = tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(stopped(stop_rx))
        .await
    });
    info!(listen = %addr, upstream = %upstream.authority(), store = store_name, "tollgate proxy serving");
    shutdown_signal().await;
    info!(timeout = ?args.common.drain_timeout, "draining: finishing in-flight requests");
    let _ = stop_tx.send(true);
    match tokio::time::timeout(args.common.drain_timeout, server).await {
        Ok(Ok(Ok(()))) => {
            info!("drained; bye");
            ExitCode::SUCCESS
        }
        Ok(other) => {
            error!(result = ?other.map(|r| r.map_err(|e| e.to_string())), "the listener failed");
            ExitCode::FAILURE
        }
        Err(_) => {
            warn!("drain timeout: exiting with requests still in flight");
            ExitCode::SUCCESS
        }
    }
}
