//! The composition root of `tollgate serve`: settings → rules → store → limiter →
//! service → gRPC and HTTP listeners, and the signals that reload and drain.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tollgate::clock::{Clock, SystemClock};
use tollgate::limiter::{Limiter, RequestLimits, Settings};
use tollgate::rules::{self, LoadOptions, Rules};
use tollgate::store::{MemoryStore, RedisTls};
use tonic::transport::ServerTlsConfig;

use crate::store::{AnyStore, StoreOptions};
use tracing::{error, info, warn};

use crate::cli::{CommonArgs, GrpcTransport, LogFormat, ServeArgs};
use crate::conn::{BodyBudget, BodyLimits, Timeouts};
use crate::metrics::Metrics;
use crate::service::Service;
use crate::warm::{self, Warmer};
use crate::workers::{stopped, HttpLimits};
use crate::{api, conn, grpc, workers};
use tollgate::headers::HeaderSettings;

/// How often the in-memory store drops states that are fresh again.
const SWEEP_EVERY: Duration = Duration::from_secs(10);
/// How often a service started without rules looks whether they have loaded.
const FOLLOW_RULES_EVERY: Duration = Duration::from_millis(100);
/// Largest request body the HTTP API buffers (the native gRPC transport's largest
/// message); a backstop under the API's own limits.
pub(crate) const HTTP_MAX_BODY: usize = 4 << 20;
/// Request-body bytes an HTTP API listener holds at once for all its unfinished
/// requests (about 60,000 rate limit requests of 1 KB); past it, a body fails (503).
pub(crate) const HTTP_BODY_BUDGET: usize = 64 << 20;
/// Request-body bytes one HTTP connection holds at once for its unfinished requests:
/// one body of the largest size and room for others (as the native gRPC transport's
/// `MAX_BUFFERED`), so that one HTTP/2 connection with many streams cannot take the
/// listener's [`HTTP_BODY_BUDGET`]; past it, a body fails (503).
pub(crate) const HTTP_CONNECTION_BODY_BUDGET: usize = HTTP_MAX_BODY + (64 << 10);

/// Runs the service until SIGTERM or SIGINT, then drains.
pub fn serve(args: ServeArgs) -> ExitCode {
    init_logging(&args.common);
    match runtime() {
        Some(rt) => rt.block_on(run(args)),
        None => ExitCode::FAILURE,
    }
}

/// The multi-threaded runtime of the acceptors, the store's background tasks (Redis
/// connections, sweeps) and the signals; requests are served by [`workers`].
pub(crate) fn runtime() -> Option<tokio::runtime::Runtime> {
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => Some(rt),
        Err(e) => {
            error!("cannot start the runtime: {e}");
            None
        }
    }
}

/// Logs to stderr, as text or JSON, filtered by `--log`.
pub(crate) fn init_logging(args: &CommonArgs) {
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only for a person at a terminal: a file, a pipe or a log collector gets
    // plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let _ = match args.log_format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// What both servers build from the common settings: the rules (watched, reloaded on
/// SIGHUP) and the limiter on the chosen store.
pub(crate) struct Core {
    pub rules: Arc<Rules>,
    pub limiter: Limiter<AnyStore>,
    pub store_name: &'static str,
    /// The TLS settings the store was opened with (the gateway's permits use them too).
    pub redis_tls: Option<RedisTls>,
    /// Keeps the file watcher alive.
    pub _watcher: Option<rules::Watcher>,
}

/// What a start does when the rules do not load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InvalidRules {
    /// Log why and exit.
    Exit,
    /// Log why and start with no rules, loading them once the files are fixed.
    Wait,
}

/// Loads the rules and opens the store; logs why and returns `None` when it cannot.
/// Rules that do not load (invalid, or a path missing) are logged, then stop the start
/// or not as `invalid` says.
pub(crate) async fn core(
    args: &CommonArgs,
    shadow_mode: bool,
    invalid: InvalidRules,
) -> Option<Core> {
    let options = LoadOptions {
        merge_domains: args.merge_domains,
        max_depth: args.max_rule_depth,
    };
    let rules = Arc::new(Rules::load_or_wait(args.config.clone(), options));
    if let Some(errors) = rules.last_error() {
        for e in errors.iter() {
            error!("{e}");
        }
        match invalid {
            InvalidRules::Exit => {
                error!("the rules are invalid; not starting");
                return None;
            }
            InvalidRules::Wait => warn!(
                "the rules are invalid: starting without rules (not ready; every check is \
                 answered \"no rate limit configuration loaded\") until their files are fixed"
            ),
        }
    }
    // Kept alive for the life of the service.
    let watcher = match rules::watch(Arc::clone(&rules)) {
        Ok(w) => Some(w),
        Err(e) => {
            warn!("cannot watch the rule files ({e}); reload with SIGHUP or POST /reload");
            None
        }
    };
    if let Err(e) = rules::reload_on_sighup(Arc::clone(&rules)) {
        warn!("cannot listen for SIGHUP: {e}");
    }
    let tls = match args.redis_tls.read() {
        Ok(tls) => tls,
        Err(e) => {
            error!("cannot set up TLS to Redis: {e}");
            return None;
        }
    };
    let options = StoreOptions {
        max_keys: args.max_keys,
        deadline: args.redis_deadline,
        prefix: args.redis_prefix.clone(),
        blocked_cache: args.blocked_cache,
        caller_time: false,
        tls: tls.clone(),
        shared_connection: args.redis_shared_connection,
    };
    if args.quota_mode && args.global_store.is_some() {
        error!("--quota-mode cannot go with --global-store: a quota group is judged over the whole request, and `scope: global` limits are counted in another store than the region's");
        return None;
    }
    let store = match AnyStore::open_with_global(
        &args.store,
        args.global_store.as_deref(),
        args.global_store_deadline,
        &options,
    )
    .await
    {
        Ok(s) => s,
        Err(e) => {
            error!(store = %args.store, "cannot open the store: {e}");
            return None;
        }
    };
    if store.redis().is_some() {
        let problems = crate::store::redis_out_of_range(&rules.current());
        for p in &problems {
            error!("{p}");
        }
        if !problems.is_empty() {
            error!("some limits cannot run on Redis; not starting");
            return None;
        }
    }
    let store_name = store.name();
    let limiter = Limiter::new(Arc::clone(&rules), store)
        .with_fallback(MemoryStore::builder().max_keys(args.max_keys).build())
        .with_settings(Settings {
            global_shadow_mode: shadow_mode,
            global_quota_mode: args.quota_mode,
            charge_rejected: args.charge_rejected,
            // `tollgate proxy` builds its requests from its rules (checked against these
            // defaults when they load); `serve` sets its own (`--max-descriptors`, ...).
            limits: RequestLimits::default(),
        });
    Some(Core {
        rules,
        limiter,
        store_name,
        redis_tls: tls,
        _watcher: watcher,
    })
}

async fn run(args: ServeArgs) -> ExitCode {
    let transport = match args.transport() {
        Ok(transport) => transport,
        Err(e) => {
            error!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let http_tls = match args.http_tls.acceptor() {
        Ok(tls) => tls,
        Err(e) => {
            error!("cannot serve HTTP over TLS: {e}");
            return ExitCode::FAILURE;
        }
    };
    let grpc_tls = match grpc::tls::server_config(&args.grpc_tls) {
        Ok(tls) => tls,
        Err(e) => {
            error!("cannot serve gRPC over TLS: {e}");
            return ExitCode::FAILURE;
        }
    };
    let admin_access = match api::AdminAccess::from_args(&args.common.admin) {
        Ok(access) => access,
        Err(e) => {
            error!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let invalid = if args.exit_on_invalid_rules {
        InvalidRules::Exit
    } else {
        InvalidRules::Wait
    };
    let Some(core) = core(&args.common, args.shadow_mode, invalid).await else {
        return ExitCode::FAILURE;
    };
    let Core {
        rules,
        limiter,
        store_name,
        _watcher,
        ..
    } = core;
    // How large a request may be: the limiter refuses beyond, and the native gRPC
    // decoder (which reads the limiter's settings) stops there.
    let limits = args.request_limits();
    let settings = Settings {
        limits,
        ..*limiter.settings()
    };
    let limiter = limiter.with_settings(settings);
    let headers = HeaderSettings {
        draft: args.ratelimit_headers,
        legacy: args.common.legacy_headers,
        envoy: args.envoy_headers,
        retry_after: args.retry_after,
        problem_body: args.problem_body,
    };
    let metrics = Metrics::for_store(
        args.common.near_limit_ratio,
        args.common.region.as_deref(),
        limiter.store(),
    );
    let service = Arc::new(
        Service::new(Arc::new(limiter), Arc::new(metrics), headers)
            .with_dynamic_metadata(args.response_dynamic_metadata),
    );
    // On Redis: reloads load the new rules' scripts before the swap, and the start
    // waits (bounded) for the workers' connections and the scripts (see warm.rs).
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

    let (grpc_listener, http_listener) = match (
        TcpListener::bind(args.grpc_listen).await,
        TcpListener::bind(args.http_listen).await,
    ) {
        (Ok(g), Ok(h)) => (g, h),
        (Err(e), _) => {
            error!(addr = %args.grpc_listen, "cannot listen for gRPC: {e}");
            return ExitCode::FAILURE;
        }
        (_, Err(e)) => {
            error!(addr = %args.http_listen, "cannot listen for HTTP: {e}");
            return ExitCode::FAILURE;
        }
    };
    let grpc_addr = grpc_listener.local_addr().map_or(args.grpc_listen, |a| a);
    let http_addr = http_listener.local_addr().map_or(args.http_listen, |a| a);
    let admin_listener = match bind_admin(args.admin_listen).await {
        Ok(listener) => listener,
        Err(code) => return code,
    };
    let admin_addr = admin_listener.as_ref().and_then(|l| l.local_addr().ok());
    admin_access.warn_if_open(admin_addr.unwrap_or(http_addr));
    service.allow_switch(
        admin_access.token_required(),
        admin_addr.unwrap_or(http_addr),
    );
    // Without --admin-listen, the HTTP listener serves every admin endpoint.
    let http_admin = admin_listener.is_none().then(|| admin_access.clone());

    // Each worker serves its share of the gRPC and of the HTTP connections.
    let count = workers::count(args.common.workers);
    let (stop_tx, stop_rx) = watch::channel(false);
    let (grpc_senders, grpc_receivers) = workers::channels(count);
    let (http_senders, http_receivers) = workers::channels(count);
    let inputs = grpc_receivers.into_iter().zip(http_receivers).collect();
    let tls = grpc_tls.is_some();
    let listeners = 2 + u64::from(admin_listener.is_some());
    let max_connections = workers::max_connections(args.common.max_connections, listeners);
    let timeouts = timeouts(&args.common);
    let grpc_timers = grpc_timers(&args, timeouts);
    let http_limits = api_limits(timeouts);
    let (warmed_tx, warmed_rx) = mpsc::unbounded_channel();
    let Some(done) = workers::spawn("tollgate-serve", inputs, {
        let (service, stop) = (Arc::clone(&service), stop_rx.clone());
        move |(grpc, http)| {
            let listeners = Listeners {
                transport,
                grpc_tls: grpc_tls.clone(),
                http_tls: http_tls.clone(),
                http_admin: http_admin.clone(),
                timeouts,
                grpc_timers,
                http_limits: http_limits.clone(),
            };
            let (service, stop) = (Arc::clone(&service), stop.clone());
            let (redis, warmed) = (redis.clone(), warmed_tx.clone());
            async move {
                // This worker's own Redis connection, made before it is handed calls.
                let _ = warmed.send(warm::worker(redis, warm_up_timeout).await);
                serve_worker(service, listeners, grpc, http, stop).await
            }
        }
    }) else {
        return ExitCode::FAILURE;
    };
    if let Some(warmer) = &warmer {
        // Before the acceptors start (connections wait in the listen backlog meanwhile)
        // and before /readyz says ready.
        warmer.start(warm::reported(warmed_rx, count)).await;
    }
    if let Some(warmer) = &global_warmer {
        warmer.start(std::future::ready(0)).await;
    }
    let sweeper = tokio::spawn(sweep(Arc::clone(&service), stop_rx.clone()));
    let switch = tokio::spawn(crate::enforcement::follow(
        Arc::clone(&service),
        stop_rx.clone(),
    ));
    let ticker = tokio::spawn(crate::dashboard::tick(
        Arc::clone(&service),
        stop_rx.clone(),
    ));
    let maintainer = crate::store::Maintainer::start(service.limiter.store());
    // Started without rules: the health watchers hear when they load.
    let follower = (!rules.is_loaded())
        .then(|| tokio::spawn(follow_rules(Arc::clone(&service), stop_rx.clone())));
    let gate = |name| conn::Gate::new(name, max_connections, service.metrics.listener(name));
    let admin = admin_listener.map(|listener| {
        let router = api::admin_router(Arc::clone(&service), &admin_access);
        serve_admin(listener, router, stop_rx.clone(), gate("admin"), timeouts)
    });
    let mut acceptors = vec![
        tokio::spawn(workers::distribute(
            grpc_listener,
            grpc_senders,
            stop_rx.clone(),
            gate("grpc"),
        )),
        tokio::spawn(workers::distribute(
            http_listener,
            http_senders,
            stop_rx,
            gate("http"),
        )),
    ];
    acceptors.extend(admin.into_iter().flatten());

    let set = rules.current();
    let (domains, rule_count) = rules::summary(&set);
    service.set_ready(true);
    info!(grpc = %grpc_addr, grpc_transport = %transport.name(), grpc_tls = tls, grpc_mutual_tls = args.grpc_tls.grpc_tls_client_ca.is_some(), http = %http_addr, http_tls = args.http_tls.http_tls_cert.is_some(), rules_loaded = rules.is_loaded(), domains, rules = rule_count, store = store_name, workers = count, "tollgate serving");

    info!(admin = %admin_addr.map_or_else(|| "the HTTP listener".to_owned(), |a| a.to_string()), admin_token = admin_access.token_required(), metrics_require_token = args.common.admin.metrics_require_token, "admin endpoints");

    shutdown_signal().await;
    info!(timeout = %crate::HumanDuration(args.common.drain_timeout), "draining: finishing in-flight calls");
    service.drain();
    let _ = stop_tx.send(true);
    sweeper.abort();
    switch.abort();
    ticker.abort();
    if let Some(follower) = follower {
        follower.abort();
    }
    let code = workers::drain(args.common.drain_timeout, acceptors, done).await;
    if let Some(maintainer) = maintainer {
        maintainer.stop().await;
    }
    code
}

/// How a worker serves its two listeners' connections.
struct Listeners {
    /// The gRPC listener's HTTP/2 implementation.
    transport: GrpcTransport,
    /// TLS on the gRPC listener (tonic only).
    grpc_tls: Option<ServerTlsConfig>,
    /// TLS on the HTTP listener.
    http_tls: Option<TlsAcceptor>,
    /// Who may call the admin endpoints on the HTTP listener; `None` when
    /// `--admin-listen` serves them (the HTTP listener keeps the health checks).
    http_admin: Option<api::AdminAccess>,
    /// The connection timeouts of both listeners.
    timeouts: Timeouts,
    /// The gRPC listener's timers and keepalive.
    grpc_timers: GrpcTimers,
    /// What the HTTP listener holds its connections and request bodies to.
    http_limits: HttpLimits,
}

/// The connection timeouts the flags set.
pub(crate) fn timeouts(args: &CommonArgs) -> Timeouts {
    Timeouts {
        header_read: args.header_read_timeout,
        idle: args.idle_timeout,
    }
}

/// The gRPC listener's timers, as the flags set them for each transport.
#[derive(Debug, Clone, Copy)]
struct GrpcTimers {
    /// The native transport's: `--header-read-timeout` for the preface,
    /// `--grpc-idle-timeout`, `--grpc-keepalive-interval` and `--grpc-keepalive-timeout`.
    native: grpc::native::Timers,
    /// tonic's keepalive PING interval: `--grpc-keepalive-interval`, at most half the
    /// idle timeout (tonic's connections are closed when silent for that long), or by
    /// default [`workers::grpc_keepalive`]'s.
    tonic_keepalive_interval: Duration,
    /// How long a keepalive PING may go unanswered, on both transports
    /// (`--grpc-keepalive-timeout`).
    keepalive_timeout: Duration,
}

/// The gRPC listener's timers the flags set.
fn grpc_timers(args: &ServeArgs, timeouts: Timeouts) -> GrpcTimers {
    let interval = args.grpc_keepalive_interval;
    GrpcTimers {
        native: grpc::native::Timers {
            preface: timeouts.header_read,
            idle: args.grpc_idle_timeout,
            keepalive_interval: interval.unwrap_or(grpc::native::KEEPALIVE_INTERVAL),
            keepalive_timeout: args.grpc_keepalive_timeout,
        },
        tonic_keepalive_interval: interval.map_or_else(
            || workers::grpc_keepalive(timeouts.idle),
            |i| i.min(timeouts.idle / 2),
        ),
        keepalive_timeout: args.grpc_keepalive_timeout,
    }
}

/// The limits of a listener whose handlers buffer request bodies (`serve`'s HTTP API,
/// the admin endpoints): [`HTTP_MAX_BODY`] each, [`HTTP_CONNECTION_BODY_BUDGET`] per
/// connection, [`HTTP_BODY_BUDGET`] together.
pub(crate) fn api_limits(timeouts: Timeouts) -> HttpLimits {
    HttpLimits {
        timeouts,
        bodies: BodyLimits {
            max: Some(HTTP_MAX_BODY),
            per_connection: Some(HTTP_CONNECTION_BODY_BUDGET),
            budget: Some(Arc::new(BodyBudget::new(HTTP_BODY_BUDGET))),
        },
    }
}

/// One worker of `tollgate serve`: the gRPC server and the HTTP API on the connections
/// the acceptors hand it, as `listeners` says, until `stop`; then both drain.
async fn serve_worker(
    service: Arc<Service>,
    listeners: Listeners,
    grpc: mpsc::UnboundedReceiver<workers::Connection>,
    http: mpsc::UnboundedReceiver<workers::Connection>,
    stop: watch::Receiver<bool>,
) -> Result<(), String> {
    let router = api::router(Arc::clone(&service), listeners.http_admin.as_ref());
    let http = workers::serve_http(
        http,
        router,
        listeners.http_tls,
        stop.clone(),
        listeners.http_limits,
    );
    match listeners.transport {
        GrpcTransport::Native => {
            let settings = grpc::native::settings_with(listeners.grpc_timers.native);
            tokio::join!(serve_native(grpc, service, stop, settings), http);
            Ok(())
        }
        GrpcTransport::Tonic => {
            let mut server = tonic_server(&listeners.timeouts, &listeners.grpc_timers);
            if let Some(tls) = listeners.grpc_tls {
                // Checked at start-up (grpc::tls::server_config).
                server = server
                    .tls_config(tls)
                    .map_err(|e| format!("gRPC TLS: {e}"))?;
            }
            let native = grpc::native::settings();
            let grpc = server
                .add_service(
                    grpc::rls::server(Arc::clone(&service))
                        .max_decoding_message_size(native.max_message),
                )
                .add_service(grpc::health::server(service))
                .serve_with_incoming_shutdown(
                    workers::incoming(grpc, listeners.timeouts),
                    stopped(stop),
                );
            let (grpc, ()) = tokio::join!(grpc, http);
            grpc.map_err(|e| format!("gRPC: {e}"))
        }
    }
}

/// Binds `--admin-listen`, if set (`Ok(None)` when not); logs why it cannot and returns
/// the exit code.
pub(crate) async fn bind_admin(at: Option<SocketAddr>) -> Result<Option<TcpListener>, ExitCode> {
    let Some(at) = at else {
        return Ok(None);
    };
    match TcpListener::bind(at).await {
        Ok(listener) => Ok(Some(listener)),
        Err(e) => {
            error!(addr = %at, "cannot listen for the admin endpoints: {e}");
            Err(ExitCode::FAILURE)
        }
    }
}

/// Serves `router` (the admin endpoints) on `listener`, in cleartext on the calling
/// runtime, through the same acceptor and limits as the other listeners (`gate`'s
/// connection cap, the header-read and idle timeouts, the body limits), until `stop`;
/// then lets the open requests finish. Returns the acceptor's and the server's tasks.
pub(crate) fn serve_admin(
    listener: TcpListener,
    router: axum::Router,
    stop: watch::Receiver<bool>,
    gate: conn::Gate,
    timeouts: Timeouts,
) -> [JoinHandle<()>; 2] {
    let (senders, mut receivers) = workers::channels(1);
    let connections = receivers.pop();
    let served = tokio::spawn({
        let stop = stop.clone();
        async move {
            if let Some(connections) = connections {
                workers::serve_http(connections, router, None, stop, api_limits(timeouts)).await;
            }
        }
    });
    let acceptor = tokio::spawn(workers::distribute(listener, senders, stop, gate));
    [acceptor, served]
}

/// tonic's server as [`tonic_server`] builds it: with the layer that holds request
/// messages to their budgets.
type TonicServer = tonic::transport::Server<
    tower::layer::util::Stack<conn::grpc_bodies::BudgetLayer, tower::layer::util::Identity>,
>;

/// tonic's server with the native transport's limits (`tollgate_h2::ServerSettings`:
/// streams per connection, header list, connection window; the protocol's default
/// stream window and frame size, which the native transport keeps; the bytes of
/// unfinished request messages per connection and in all, through
/// [`conn::grpc_bodies`]), a bound on the streams it resets for the client's protocol
/// errors, keepalive PINGs ([`GrpcTimers`]), and each call bounded by the idle timeout
/// (a call whose message stalls is cancelled; `Watch` streams are not cut, their call
/// is answered at once).
fn tonic_server(timeouts: &Timeouts, timers: &GrpcTimers) -> TonicServer {
    let native = grpc::native::settings();
    tonic::transport::Server::builder()
        .max_concurrent_streams(native.max_concurrent_streams)
        .http2_max_header_list_size(u32::try_from(native.max_header_list).unwrap_or(u32::MAX))
        .initial_connection_window_size(native.connection_window)
        .initial_stream_window_size(GRPC_STREAM_WINDOW)
        .max_frame_size(GRPC_MAX_FRAME_SIZE)
        .http2_max_pending_accept_reset_streams(Some(GRPC_MAX_PENDING_ACCEPT_RESET_STREAMS))
        .http2_max_local_error_reset_streams(Some(GRPC_MAX_LOCAL_ERROR_RESET_STREAMS))
        .http2_keepalive_interval(Some(timers.tonic_keepalive_interval))
        .http2_keepalive_timeout(Some(timers.keepalive_timeout))
        .timeout(timeouts.idle)
        // The acceptor sets TCP_NODELAY on every connection (this applies to tonic's
        // own listener only); said anyway.
        .tcp_nodelay(true)
        .layer(conn::grpc_bodies::BudgetLayer::new())
}

/// tonic's stream window: HTTP/2's default, as the native transport's (a rate limit
/// request is well under 1 KB).
const GRPC_STREAM_WINDOW: u32 = 65_535;
/// tonic's largest frame: HTTP/2's default, as the native transport's.
const GRPC_MAX_FRAME_SIZE: u32 = 16_384;
/// Streams a gRPC client may open and reset before tonic accepts them (h2's default;
/// the "rapid reset" attack).
const GRPC_MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 20;
/// Streams tonic may reset for a client's protocol errors (invalid headers or frames)
/// before it sends GOAWAY `ENHANCE_YOUR_CALM`: h2's own default, which tonic turns off
/// unless it is set (a client could otherwise make it reset streams without end).
const GRPC_MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1024;

/// The native gRPC transport on a worker's connections, each held to `settings`:
/// `grpc::native::serve` for each connection alone, so that the connection's slot
/// under the listener's cap is held until it ends (`serve` returns once its one
/// connection has closed). Returns when the acceptor has stopped and every connection
/// has ended.
async fn serve_native(
    mut connections: mpsc::UnboundedReceiver<workers::Connection>,
    service: Arc<Service>,
    stop: watch::Receiver<bool>,
    settings: tollgate_h2::ServerSettings,
) {
    // Each connection's task holds a sender; `recv` answers `None` once all have ended.
    let (running, mut all_ended) = mpsc::channel::<()>(1);
    let stopping = stopped(stop.clone());
    tokio::pin!(stopping);
    loop {
        let connection = tokio::select! {
            next = connections.recv() => match next {
                Some(c) => c,
                None => break,
            },
            () = &mut stopping => break,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send((connection.stream, connection.peer));
        drop(tx);
        let (service, stop, held) = (
            Arc::clone(&service),
            stop.clone(),
            (connection.slot, running.clone()),
        );
        tokio::spawn(async move {
            grpc::native::serve(rx, service, stop, settings).await;
            drop(held);
        });
    }
    drop((connections, running));
    let _ = all_ended.recv().await;
}

/// For a service started without valid rules: until they load, looks every
/// [`FOLLOW_RULES_EVERY`] whether they have, and then tells the service's readiness
/// watchers (the gRPC health `Watch` streams). The rules load on another thread (the
/// file watcher, SIGHUP); `/readyz` and health `Check` read them directly.
async fn follow_rules(service: Arc<Service>, stop: watch::Receiver<bool>) {
    while !service.rules_loaded() && !*stop.borrow() {
        tokio::time::sleep(FOLLOW_RULES_EVERY).await;
    }
    if service.rules_loaded() {
        service.refresh();
        info!("the rules are loaded: deciding");
    }
}

/// Drops fresh states from the store every [`SWEEP_EVERY`].
pub(crate) async fn sweep(service: Arc<Service>, stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(SWEEP_EVERY);
    while !*stop.borrow() {
        tick.tick().await;
        let now = SystemClock.now();
        let mut dropped = service.limiter.fallback().sweep(now);
        if let Some(memory) = service.limiter.store().memory() {
            dropped += memory.sweep(now);
        }
        if dropped > 0 {
            tracing::debug!(dropped, "swept fresh keys");
        }
    }
}

/// SIGTERM or Ctrl-C.
pub(crate) async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
