//! The composition root of `tollgate proxy`: rules and store (as `serve` builds them) →
//! [`RateLimitLayer`] over the [`Upstream`] forwarder → `--workers` threads (see
//! [`crate::workers`]), each with its own single-threaded runtime, its share of the
//! connections and its own upstream pool (the limiter, its store and the permits are
//! shared by all).

use std::process::ExitCode;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tollgate::headers::HeaderSettings;
use tollgate::http::{DecisionObserver, RateLimitLayer};
use tollgate::inflight::{InFlight, MemoryInFlight, Permit, RedisInFlight};
use tollgate::store;
use tower::Layer;
use tracing::{error, info, warn};

use super::forward::{ForwardSettings, Upstream};
use crate::api::{admin_router, AdminAccess};
use crate::app::{
    bind_admin, core, init_logging, runtime, serve_admin, shutdown_signal, sweep, timeouts, Core,
    InvalidRules,
};
use crate::cli::ProxyArgs;
use crate::conn::{BodyLimits, Gate};
use crate::metrics::Metrics;
use crate::service::Service;
use crate::warm::{self, Warmer};
use crate::workers::{self, HttpLimits};

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
    let admin_access = match AdminAccess::from_args(&args.common.admin) {
        Ok(access) => access,
        Err(e) => {
            error!("{e}");
            return ExitCode::FAILURE;
        }
    };
    // A gateway without rules has no safe answer (forwarding would drop every limit and
    // deny list, refusing would stop the API): invalid rules stop its start.
    let Some(core) = core(&args.common, false, InvalidRules::Exit).await else {
        return ExitCode::FAILURE;
    };
    let Core {
        rules,
        limiter,
        store_name,
        redis_tls,
        _watcher,
        ..
    } = core;
    let tls = match args.tls.acceptor() {
        Ok(tls) => tls,
        Err(e) => {
            error!("cannot serve TLS: {e}");
            return ExitCode::FAILURE;
        }
    };
    let settings = ForwardSettings {
        connect_timeout: args.connect_timeout,
        response_timeout: args.upstream_timeout,
        client_tls: tls.is_some(),
        ..ForwardSettings::default()
    };
    let upstream = match Upstream::new(&args.upstream, settings) {
        Ok(u) => u,
        Err(e) => {
            error!(upstream = %args.upstream, "cannot use the upstream: {e}");
            return ExitCode::FAILURE;
        }
    };
    let store = &args.common.store;
    let inflight = if tollgate::store::redis::is_single_url(store) {
        let mut builder = RedisInFlight::builder(store.clone())
            .prefix(format!("{}:inflight", args.common.redis_prefix))
            .lease(args.permit_lease)
            .deadline(args.common.redis_deadline);
        if let Some(tls) = redis_tls {
            builder = builder.tls(tls);
        }
        match builder.connect().await {
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
    // The admin endpoints (metrics, health, rules, reload) see the same limiter and the
    // metrics the layer records into.
    let metrics = Metrics::for_store(
        args.common.near_limit_ratio,
        args.common.region.as_deref(),
        limiter.store(),
    );
    let service = Arc::new(Service::new(
        Arc::new(limiter),
        Arc::new(metrics),
        HeaderSettings {
            legacy: args.common.legacy_headers,
            ..HeaderSettings::default()
        },
    ));
    // On Redis, as `serve` does: reloads load the new rules' scripts before the swap,
    // and the start waits (bounded) for the workers' connections and the scripts.
    let redis = service.limiter.store().redis().cloned();
    let warm_up_timeout = args.common.redis_warm_up_timeout;
    let warmer = redis
        .clone()
        .map(|store| Warmer::install(store, &rules, warm_up_timeout));
    // The global store (`--global-store`) is warmed the same way: its first lease would
    // otherwise load the scripts, one more round trip to a distant store.
    let global_warmer = service
        .limiter
        .store()
        .global_redis()
        .cloned()
        .map(|store| Warmer::install(store, &rules, warm_up_timeout));
    // The routes come with the rules (one load, one swap): a file whose `http` section
    // is invalid did not load, and the start stopped above.
    // A request without Host is refused before the decision, so it charges no limit.
    let layer = RateLimitLayer::new(Arc::clone(&service.limiter))
        .with_inflight(inflight)
        .with_legacy_headers(args.common.legacy_headers)
        .with_host_required(true);
    // Metrics cost a little per decision; only kept when someone can read them.
    let layer = if args.admin_listen.is_some() {
        layer.with_observer(Arc::clone(&service.metrics) as Arc<dyn DecisionObserver>)
    } else {
        layer
    };
    // The host's CPU use, for `system_protection`'s `max_cpu` (one reading a second).
    let layer = match tollgate::adaptive::ProcStat::start(std::time::Duration::from_secs(1)) {
        Ok(cpu) => layer.with_cpu_gauge(Arc::new(cpu)),
        Err(e) => {
            warn!(
                "cannot start reading the CPU use; system_protection's max_cpu sheds nothing: {e}"
            );
            layer
        }
    };
    service.metrics.know_shedding(layer.shedding());
    if layer.route_count() == 0 {
        warn!("no rule file has an `http` section with routes: the gateway limits nothing and forwards every request (`serve` reads the same files without one)");
    }
    let count = workers::count(args.common.workers);
    let listener = match TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(e) => {
            error!(addr = %args.listen, "cannot listen: {e}");
            return ExitCode::FAILURE;
        }
    };
    let addr = listener.local_addr().map_or(args.listen, |a| a);
    let admin = match bind_admin(args.admin_listen).await {
        Ok(listener) => listener,
        Err(code) => return code,
    };
    // Each client connection may hold an upstream connection too: two descriptors.
    let fds_per_connection = 2 + u64::from(admin.is_some());
    let max_connections = workers::max_connections(args.common.max_connections, fds_per_connection);
    let timeouts = timeouts(&args.common);
    // Bodies stream to the upstream: no size limit or budget, only the idle timeout
    // on a body that stalls.
    let limits = HttpLimits {
        timeouts,
        bodies: BodyLimits::default(),
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    let (senders, receivers) = workers::channels(count);
    let (warmed_tx, warmed_rx) = mpsc::unbounded_channel();
    let Some(done) = workers::spawn("tollgate-proxy", receivers, {
        let (layer, upstream, stop) = (layer.clone(), args.upstream.clone(), stop_rx.clone());
        let (tls, limits) = (tls.clone(), limits.clone());
        move |connections| {
            let (layer, upstream, stop) = (layer.clone(), upstream.clone(), stop.clone());
            let (tls, limits) = (tls.clone(), limits.clone());
            let (redis, warmed) = (redis.clone(), warmed_tx.clone());
            async move {
                // This worker's own Redis connection, made before it is handed requests.
                let _ = warmed.send(warm::worker(redis, warm_up_timeout).await);
                // Each worker has its own upstream connection pool.
                let upstream = Upstream::new(&upstream, settings)?;
                workers::serve_http(connections, layer.layer(upstream), tls, stop, limits).await;
                Ok(())
            }
        }
    }) else {
        return ExitCode::FAILURE;
    };
    let sweeper = tokio::spawn(sweep(Arc::clone(&service), stop_rx.clone()));
    let switch = tokio::spawn(crate::enforcement::follow(
        Arc::clone(&service),
        stop_rx.clone(),
    ));
    // The dashboard's history, only kept when someone can read it (as the metrics).
    let ticker = args.admin_listen.is_some().then(|| {
        tokio::spawn(crate::dashboard::tick(
            Arc::clone(&service),
            stop_rx.clone(),
        ))
    });
    let maintainer = crate::store::Maintainer::start(service.limiter.store());
    let admin_addr = admin.as_ref().and_then(|l| l.local_addr().ok());
    if let Some(addr) = admin_addr {
        service.allow_switch(admin_access.token_required(), addr);
    }
    match admin_addr {
        Some(addr) => admin_access.warn_if_open(addr),
        None if admin_access.token_required() => {
            warn!("an admin token (--admin-token, --admin-token-file) has no use without --admin-listen: the gateway then serves no admin endpoints");
        }
        None => {}
    }
    let gate = |name| Gate::new(name, max_connections, service.metrics.listener(name));
    // The admin endpoints: on this runtime, through the same acceptor and limits.
    let admin = admin.map(|listener| {
        let router = admin_router(Arc::clone(&service), &admin_access);
        serve_admin(listener, router, stop_rx.clone(), gate("admin"), timeouts)
    });
    if let Some(warmer) = &warmer {
        warmer.start(warm::reported(warmed_rx, count)).await;
    }
    if let Some(warmer) = &global_warmer {
        warmer.start(std::future::ready(0)).await;
    }
    let acceptor = tokio::spawn(workers::distribute(
        listener,
        senders,
        stop_rx,
        gate("proxy"),
    ));
    service.set_ready(true);
    info!(listen = %addr, tls = tls.is_some(), mutual_tls = args.tls.tls_client_ca.is_some(), admin = %admin_addr.map_or_else(|| "off".to_string(), |a| a.to_string()), upstream = %upstream.authority(), store = store_name, workers = count, "tollgate proxy serving");
    shutdown_signal().await;
    info!(timeout = %crate::HumanDuration(args.common.drain_timeout), "draining: finishing in-flight requests");
    service.drain();
    let _ = stop_tx.send(true);
    sweeper.abort();
    switch.abort();
    if let Some(ticker) = ticker {
        ticker.abort();
    }
    let mut tasks = vec![acceptor];
    tasks.extend(admin.into_iter().flatten());
    let code = workers::drain(args.common.drain_timeout, tasks, done).await;
    if let Some(maintainer) = maintainer {
        maintainer.stop().await;
    }
    code
}
