//! The command line: every subcommand and flag, with its environment variable and default.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use tokio_rustls::TlsAcceptor;
use tollgate::limiter::RequestLimits;
use tollgate::store::{ChargeRejected, RedisTls};

/// Tollgate: an exact, fast rate limiter.
///
/// One binary for the rate limit service (Envoy's gRPC API and an HTTP API), the HTTP
/// gateway, and tools to validate rule files and run conformance cases.
#[derive(Debug, Parser)]
#[command(name = "tollgate", version, about, long_about)]
pub struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the rate limit service: Envoy's gRPC rate limit API, the HTTP API, metrics
    /// and admin endpoints, on the embedded in-memory store or on Redis. Rules reload when their
    /// files change, on SIGHUP and on `POST /reload`; SIGTERM drains and exits.
    Serve(ServeArgs),
    /// Check rule files (files or directories); print every problem with its file,
    /// line and column, or a one-line summary per domain. Exits non-zero on any error.
    Validate {
        /// Rule files, or directories of `*.yaml` / `*.yml` rule files.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// Let several files define the same domain (their descriptors are combined).
        #[arg(long, env = "TOLLGATE_MERGE_DOMAINS")]
        merge_domains: bool,
        /// How many `descriptors` lists deep a rule file may nest (the domain's is the
        /// first); deeper is an error with its place.
        #[arg(long, env = "TOLLGATE_MAX_RULE_DEPTH", default_value_t = tollgate::rules::DEFAULT_MAX_DEPTH,
              value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=tollgate::rules::MAX_MAX_DEPTH as u64))]
        max_rule_depth: usize,
    },
    /// Run rule-engine case files (the format of tests/cases/README.md) with a manual
    /// clock; print every failing step and `N passed, M failed` (files). Exits
    /// non-zero on any failure.
    Conformance {
        /// Directory of case files (searched recursively).
        dir: PathBuf,
        /// The store to run against: `memory`, `redis://host:port`,
        /// `redis+cluster://host:port,...` or either over TLS (each case file gets keys of its own, and the
        /// scripts take the cases' clock instead of Redis TIME).
        #[arg(long, env = "TOLLGATE_STORE", default_value = "memory")]
        store: String,
        /// TLS to a `rediss://` store.
        #[command(flatten)]
        tls: RedisTlsArgs,
    },
    /// Run the HTTP gateway: a reverse proxy in front of `--upstream` that limits by the
    /// `http` section of the rule files (routes, actions, trusted proxies, allow and deny
    /// lists, concurrency limits, shaping) and answers 429 with RateLimit headers.
    Proxy(ProxyArgs),
    /// Print the Lua script the Redis store runs for requests using these algorithms
    /// (fixed_window, sliding_window, sliding_log, token_bucket, gcra, leaky_bucket),
    /// to review it or pre-load it with `redis-cli SCRIPT LOAD`.
    RedisScript {
        /// Algorithm names, as in rule files.
        #[arg(required = true)]
        algorithms: Vec<String>,
        /// Print it as the Redis Functions library the store loads on Redis 7 and
        /// later (`redis-cli -x FUNCTION LOAD REPLACE < file`); its first line names
        /// the function (`#!lua name=...`).
        #[arg(long)]
        library: bool,
    },
    /// Run a rule's limit (or, with `--algorithms all`, its numbers under every
    /// algorithm) on a manual clock against a traffic pattern, and write report.html,
    /// report.json and timeline.csv: admitted vs offered, the most admitted in any
    /// window of one unit, Retry-After values, and decisions that differ from the exact
    /// sliding log.
    Simulate(crate::simulate::SimulateArgs),
    /// Delete from Redis the script libraries (Redis Functions) that other versions of
    /// Tollgate loaded, and print their names. Run it once every instance on that Redis
    /// runs this version (an older one still running would load its library again).
    RedisPrune {
        /// The Redis: `redis://host:port`, `redis+cluster://host:port,...` or either
        /// over TLS.
        #[arg(long, env = "TOLLGATE_STORE")]
        store: String,
        /// TLS to a `rediss://` store.
        #[command(flatten)]
        tls: RedisTlsArgs,
    },
}

/// Settings of `tollgate serve`; every flag also reads a `TOLLGATE_*` variable.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Rules, store, logging and shutdown, shared with `tollgate proxy`.
    #[command(flatten)]
    pub common: CommonArgs,
    /// Address for Envoy's gRPC rate limit service.
    #[arg(long, env = "TOLLGATE_GRPC_LISTEN", default_value = "0.0.0.0:8081")]
    pub grpc_listen: SocketAddr,
    /// The gRPC listener's HTTP/2 implementation: `native` (Tollgate's own, for unary
    /// calls over h2c: answers a whole read of calls in one write) or `tonic`. Default:
    /// `native`, or `tonic` when the listener serves TLS (`--grpc-tls-cert`), which
    /// only tonic does.
    #[arg(long, env = "TOLLGATE_GRPC_TRANSPORT", value_enum)]
    pub grpc_transport: Option<GrpcTransport>,
    /// TLS on the gRPC listener.
    #[command(flatten)]
    pub grpc_tls: GrpcTlsArgs,
    /// The native gRPC transport closes a connection with no call open for this long,
    /// gracefully (GOAWAY, a PING round trip, the final GOAWAY): Envoy keeps its rate
    /// limit connection open between calls and opens a new one for its next call. (The
    /// tonic transport closes a connection silent for --idle-timeout instead.)
    #[arg(long, env = "TOLLGATE_GRPC_IDLE_TIMEOUT", default_value = "300s", value_parser = parse_timeout)]
    pub grpc_idle_timeout: Duration,
    /// The gRPC listener PINGs a client that has sent nothing for this long. Default:
    /// 60s on the native transport; on tonic 30s, or half --idle-timeout if shorter.
    /// tonic takes at most half --idle-timeout (it closes a connection silent that long).
    #[arg(long, env = "TOLLGATE_GRPC_KEEPALIVE_INTERVAL", value_parser = parse_timeout)]
    pub grpc_keepalive_interval: Option<Duration>,
    /// How long a gRPC keepalive PING may go unanswered before the connection is closed
    /// (both transports).
    #[arg(long, env = "TOLLGATE_GRPC_KEEPALIVE_TIMEOUT", default_value = "20s", value_parser = parse_timeout)]
    pub grpc_keepalive_timeout: Duration,
    /// Address for the HTTP API (`/json`, `/v1/check`) and admin endpoints.
    #[arg(long, env = "TOLLGATE_HTTP_LISTEN", default_value = "0.0.0.0:8080")]
    pub http_listen: SocketAddr,
    /// TLS on the HTTP listener.
    #[command(flatten)]
    pub http_tls: HttpTlsArgs,
    /// Address for the admin endpoints: `/rules`, `POST /reload`, `/metrics` and the
    /// health checks. Set, the HTTP listener no longer serves the first three; it keeps
    /// the health checks (`/healthcheck`, `/healthz`, `/readyz`), which existing
    /// deployments probe there. Cleartext HTTP. Unset: the HTTP listener serves them all.
    #[arg(long, env = "TOLLGATE_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// Global shadow mode: report every status, but always answer OK overall.
    #[arg(long, env = "TOLLGATE_SHADOW_MODE")]
    pub shadow_mode: bool,
    /// Most descriptors in one request; more is refused (gRPC INVALID_ARGUMENT, HTTP
    /// 400), the native gRPC decoder stopping there. Envoy sends one per `rate_limits`
    /// action list of a route: keep it above what the routes send.
    #[arg(long, env = "TOLLGATE_MAX_DESCRIPTORS", default_value_t = RequestLimits::DEFAULT_MAX_DESCRIPTORS as u64, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_descriptors: u64,
    /// Most entries in one descriptor (Envoy sends one per action); more is refused
    /// as `--max-descriptors` says.
    #[arg(long, env = "TOLLGATE_MAX_ENTRIES", default_value_t = RequestLimits::DEFAULT_MAX_ENTRIES as u64, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_entries: u64,
    /// Most bytes in an entry's key, and in its value; more is refused as
    /// `--max-descriptors` says. The default, 64 KiB, is above Envoy's own limit on a
    /// request's headers (`max_request_headers_kb`, 60 KiB), which bounds the values it
    /// takes from them.
    #[arg(long, env = "TOLLGATE_MAX_ENTRY_BYTES", default_value_t = RequestLimits::DEFAULT_MAX_ENTRY_BYTES as u64, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_entry_bytes: u64,
    /// Send the response's dynamic metadata (envoyproxy/ratelimit's
    /// `RESPONSE_DYNAMIC_METADATA`): the domain, the descriptors, and which passed, with
    /// their rules' `metadata`.
    #[arg(long, env = "TOLLGATE_RESPONSE_DYNAMIC_METADATA")]
    pub response_dynamic_metadata: bool,
    /// Add the IETF draft `RateLimit-Policy` and `RateLimit` headers.
    #[arg(long, env = "TOLLGATE_RATELIMIT_HEADERS", default_value_t = true, action = clap::ArgAction::Set)]
    pub ratelimit_headers: bool,
    /// Add envoyproxy/ratelimit's `RateLimit-Limit`, `RateLimit-Remaining` and
    /// `RateLimit-Reset` headers (its `LIMIT_RESPONSE_HEADERS_ENABLED`), for the
    /// descriptor over its limit, else the one with the least remaining.
    #[arg(long, env = "TOLLGATE_ENVOY_HEADERS")]
    pub envoy_headers: bool,
    /// Add `Retry-After` to an OVER_LIMIT answer that can pass later (envoyproxy/ratelimit
    /// sends none: `--retry-after=false`).
    #[arg(long, env = "TOLLGATE_RETRY_AFTER", default_value_t = true, action = clap::ArgAction::Set)]
    pub retry_after: bool,
    /// Send a problem detail (JSON naming the violated limits) as the `raw_body` of an
    /// OVER_LIMIT answer (envoyproxy/ratelimit sends none: `--problem-body=false`).
    #[arg(long, env = "TOLLGATE_PROBLEM_BODY", default_value_t = true, action = clap::ArgAction::Set)]
    pub problem_body: bool,
    /// Exit at start-up when the rules are invalid or a `--config` path does not exist.
    /// Without it the service starts anyway, as envoyproxy/ratelimit does: it logs
    /// every error, is not ready (`/readyz` 503, gRPC health NOT_SERVING), answers every
    /// check "no rate limit configuration loaded" (gRPC UNKNOWN, HTTP 503), and loads
    /// the rules as soon as their files are fixed.
    #[arg(long, env = "TOLLGATE_EXIT_ON_INVALID_RULES")]
    pub exit_on_invalid_rules: bool,
}

impl ServeArgs {
    /// How large a request may be: `--max-descriptors`, `--max-entries`,
    /// `--max-entry-bytes`.
    pub fn request_limits(&self) -> RequestLimits {
        RequestLimits {
            max_descriptors: usize::try_from(self.max_descriptors).unwrap_or(usize::MAX),
            max_entries: usize::try_from(self.max_entries).unwrap_or(usize::MAX),
            max_entry_bytes: usize::try_from(self.max_entry_bytes).unwrap_or(usize::MAX),
        }
    }

    /// The gRPC transport these flags ask for: `--grpc-transport`, else `tonic` with
    /// TLS and `native` without; `Err` when TLS is asked of the native transport.
    pub fn transport(&self) -> Result<GrpcTransport, String> {
        match (self.grpc_transport, self.grpc_tls.grpc_tls_cert.is_some()) {
            (Some(GrpcTransport::Native), true) => Err(
                "--grpc-transport native serves cleartext HTTP/2 only; TLS on the gRPC listener \
                 (--grpc-tls-cert) needs --grpc-transport tonic, the default with TLS"
                    .into(),
            ),
            (Some(transport), _) => Ok(transport),
            (None, true) => Ok(GrpcTransport::Tonic),
            (None, false) => Ok(GrpcTransport::Native),
        }
    }
}

/// TLS on `tollgate serve`'s gRPC listener, as envoyproxy/ratelimit's
/// `GRPC_SERVER_USE_TLS`, `GRPC_SERVER_TLS_CERT`, `GRPC_SERVER_TLS_KEY` and
/// `GRPC_CLIENT_TLS_CACERT`. The files are read once, at start-up.
#[derive(Debug, Clone, Args)]
pub struct GrpcTlsArgs {
    /// PEM file of the gRPC listener's certificate chain (with --grpc-tls-key): the
    /// listener then serves TLS only (through tonic).
    #[arg(long, env = "TOLLGATE_GRPC_TLS_CERT", requires = "grpc_tls_key")]
    pub grpc_tls_cert: Option<PathBuf>,
    /// PEM file of that certificate's private key.
    #[arg(long, env = "TOLLGATE_GRPC_TLS_KEY", requires = "grpc_tls_cert")]
    pub grpc_tls_key: Option<PathBuf>,
    /// PEM file of the certificate authorities whose client certificates the gRPC
    /// listener accepts: every client must then present one (mutual TLS).
    #[arg(long, env = "TOLLGATE_GRPC_TLS_CLIENT_CA", requires = "grpc_tls_cert")]
    pub grpc_tls_client_ca: Option<PathBuf>,
}

/// TLS on `tollgate serve`'s HTTP listener (the API and the admin endpoints).
#[derive(Debug, Clone, Args)]
pub struct HttpTlsArgs {
    /// PEM file of the HTTP listener's certificate chain (with --http-tls-key): the
    /// listener then serves HTTPS only (HTTP/1.1, and HTTP/2 by ALPN).
    #[arg(long, env = "TOLLGATE_HTTP_TLS_CERT", requires = "http_tls_key")]
    pub http_tls_cert: Option<PathBuf>,
    /// PEM file of that certificate's private key.
    #[arg(long, env = "TOLLGATE_HTTP_TLS_KEY", requires = "http_tls_cert")]
    pub http_tls_key: Option<PathBuf>,
    /// PEM file of the certificate authorities whose client certificates the HTTP
    /// listener accepts: every client must then present one (mutual TLS).
    #[arg(long, env = "TOLLGATE_HTTP_TLS_CLIENT_CA", requires = "http_tls_cert")]
    pub http_tls_client_ca: Option<PathBuf>,
}

impl HttpTlsArgs {
    /// The listener's TLS acceptor (`None` without a certificate), or which file is
    /// wrong and how.
    pub fn acceptor(&self) -> Result<Option<TlsAcceptor>, String> {
        listener_tls(
            ("--http-tls-cert", self.http_tls_cert.as_deref()),
            ("--http-tls-key", self.http_tls_key.as_deref()),
            ("--http-tls-client-ca", self.http_tls_client_ca.as_deref()),
        )
    }
}

/// TLS on `tollgate proxy`'s listener (the gateway; not the admin listener).
#[derive(Debug, Clone, Args)]
pub struct ProxyTlsArgs {
    /// PEM file of the gateway's certificate chain (with --tls-key): the gateway then
    /// serves HTTPS only (HTTP/1.1, and HTTP/2 by ALPN), and tells the upstream so
    /// (`X-Forwarded-Proto: https`).
    #[arg(long, env = "TOLLGATE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM file of that certificate's private key.
    #[arg(long, env = "TOLLGATE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM file of the certificate authorities whose client certificates the gateway
    /// accepts: every client must then present one (mutual TLS).
    #[arg(long, env = "TOLLGATE_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
}

impl ProxyTlsArgs {
    /// The gateway's TLS acceptor (`None` without a certificate), or which file is
    /// wrong and how.
    pub fn acceptor(&self) -> Result<Option<TlsAcceptor>, String> {
        listener_tls(
            ("--tls-cert", self.tls_cert.as_deref()),
            ("--tls-key", self.tls_key.as_deref()),
            ("--tls-client-ca", self.tls_client_ca.as_deref()),
        )
    }
}

/// A listener's TLS acceptor from its flags (name, file), `None` without a certificate.
fn listener_tls(
    cert: (&str, Option<&Path>),
    key: (&str, Option<&Path>),
    client_ca: (&str, Option<&Path>),
) -> Result<Option<TlsAcceptor>, String> {
    let (Some(cert_file), Some(key_file)) = (cert.1, key.1) else {
        return Ok(None);
    };
    let ca = client_ca.1.map(|file| (client_ca.0, file));
    crate::tls::acceptor((cert.0, cert_file), (key.0, key_file), ca).map(Some)
}

/// Settings `tollgate serve` and `tollgate proxy` share.
#[derive(Debug, Clone, Args)]
pub struct CommonArgs {
    /// Rule files or directories of `*.yaml` / `*.yml` rule files (repeatable).
    #[arg(long, env = "TOLLGATE_CONFIG", required = true, value_delimiter = ',')]
    pub config: Vec<PathBuf>,
    /// Where counters live: `memory` (embedded, per instance), `redis://host:port[/db]`
    /// (shared by every instance on that Redis), `redis+unix:///path/to/redis.sock` (a
    /// Redis on this host, through its Unix socket) or `redis+cluster://host:port,host:port`.
    #[arg(long, env = "TOLLGATE_STORE", default_value = "memory")]
    pub store: String,
    /// Deadline of each Redis call; past it, each rule's `failure_mode` answers. A gRPC
    /// call's `grpc-timeout` (Envoy sends its rate limit timeout) shortens it to four
    /// fifths of that timeout, so that the rule answers before the caller gives up (not
    /// below half the deadline: an impatient caller still gets Redis's decision).
    #[arg(long, env = "TOLLGATE_REDIS_DEADLINE", default_value = "20ms", value_parser = parse_duration)]
    pub redis_deadline: Duration,
    /// This instance's region, for multi-region deployments: every metric carries it as
    /// a `region` label.
    #[arg(long, env = "TOLLGATE_REGION")]
    pub region: Option<String>,
    /// The store shared by every region (`redis://`, `rediss://`, `redis+unix://` or
    /// `redis+cluster://`, with the same TLS settings as `--store`): limits with
    /// `scope: global` are leased from it, the others stay in `--store` (the region's
    /// Redis). Needs a Redis `--store`. Without it, `scope` changes nothing.
    #[arg(long, env = "TOLLGATE_GLOBAL_STORE")]
    pub global_store: Option<String>,
    /// Deadline of each call to `--global-store` (leases of global limits, mostly taken
    /// ahead of need in the background); past it, the rule's `failure_mode` answers a
    /// request that needed it. Longer than `--redis-deadline`, as the global store is
    /// usually in another region.
    #[arg(long, env = "TOLLGATE_GLOBAL_STORE_DEADLINE", default_value = "500ms", value_parser = parse_duration)]
    pub global_store_deadline: Duration,
    /// Prefix of every Redis key.
    #[arg(long, env = "TOLLGATE_REDIS_PREFIX", default_value = "tollgate")]
    pub redis_prefix: String,
    /// TLS to a `rediss://` store.
    #[command(flatten)]
    pub redis_tls: RedisTlsArgs,
    /// With a Redis store, how long the start-up warm-up may take: every worker's Redis
    /// connection made and the scripts of every algorithm set the rules use loaded
    /// before the listeners accept calls and `/readyz` answers 200. A Redis that is not
    /// warm by then does not stop the start: the service serves (each rule's
    /// `failure_mode` answers while Redis is unreachable), and goes on warming up in the
    /// background. A rule reload waits as long for the new rules' scripts before it
    /// swaps them in.
    #[arg(long, env = "TOLLGATE_REDIS_WARM_UP_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub redis_warm_up_timeout: Duration,
    /// Keys over their limit are answered locally until their retry time, up to this
    /// many keys (0 turns the blocked-key cache off).
    #[arg(long, env = "TOLLGATE_BLOCKED_CACHE", default_value_t = 100_000)]
    pub blocked_cache: usize,
    /// Send every worker's requests to a single Redis over one shared connection,
    /// instead of one connection per worker (the default). Shared: larger script calls,
    /// so less Redis CPU per decision when Redis is lightly loaded; per worker: less
    /// CPU here and lower latency, since a request never leaves its worker's thread.
    /// Over TLS (`rediss://`) the workers always share one connection.
    #[arg(long, env = "TOLLGATE_REDIS_SHARED_CONNECTION")]
    pub redis_shared_connection: bool,
    /// Most keys the in-memory store (and the local fallback store used while Redis is
    /// down) holds before evicting: keys never refused first, nearest to fresh first;
    /// keys over their limit only when nothing else is left.
    #[arg(long, env = "TOLLGATE_MAX_KEYS", default_value_t = 10_000_000)]
    pub max_keys: usize,
    /// Let several rule files define the same domain.
    #[arg(long, env = "TOLLGATE_MERGE_DOMAINS")]
    pub merge_domains: bool,
    /// How many `descriptors` lists deep a rule file may nest (the domain's is the
    /// first, at most 100); deeper is an error with its place, and the old rules keep
    /// serving.
    #[arg(long, env = "TOLLGATE_MAX_RULE_DEPTH", default_value_t = tollgate::rules::DEFAULT_MAX_DEPTH,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=tollgate::rules::MAX_MAX_DEPTH as u64))]
    pub max_rule_depth: usize,
    /// Whether a rejected request is charged, where the rule files do not say
    /// (`charge_rejected`): `none` (all or nothing), `over_limit` (the descriptors over
    /// their limit are charged anyway: envoyproxy/ratelimit with
    /// `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=true`), `all` (every descriptor is
    /// charged: envoyproxy/ratelimit's default).
    #[arg(long, env = "TOLLGATE_CHARGE_REJECTED", default_value = "none", value_parser = parse_charge_rejected)]
    pub charge_rejected: ChargeRejected,
    /// Every descriptor in quota mode, as if each rule said `quota_mode: true`: the
    /// request is OVER_LIMIT only when every descriptor is over its limit.
    #[arg(long, env = "TOLLGATE_QUOTA_MODE")]
    pub quota_mode: bool,
    /// Also add the legacy `X-RateLimit-Limit`, `-Remaining` and `-Reset` headers.
    #[arg(long, env = "TOLLGATE_LEGACY_HEADERS")]
    pub legacy_headers: bool,
    /// Log format.
    #[arg(long, env = "TOLLGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Log filter (tracing's `RUST_LOG` syntax), e.g. `info` or `tollgate=debug`.
    #[arg(long, env = "TOLLGATE_LOG", default_value = "info")]
    pub log: String,
    /// How long SIGTERM waits for in-flight calls before exiting anyway.
    #[arg(long, env = "TOLLGATE_DRAIN_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// Worker threads serving the connections, each with its own single-threaded
    /// runtime; new connections go to them in turn (and the gateway's upstream
    /// connections are per worker). Default: one per CPU.
    #[arg(long, env = "TOLLGATE_WORKERS")]
    pub workers: Option<usize>,
    /// Connections each listener holds open at once; at the cap it stops accepting
    /// (new clients wait in the kernel's listen backlog) until one closes. Default:
    /// 10,000, or less when the open-file limit (`ulimit -n`) cannot hold that many: the
    /// listeners then share the limit less 256 descriptors kept for Redis, the
    /// upstream and the process.
    #[arg(long, env = "TOLLGATE_MAX_CONNECTIONS", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: Option<u32>,
    /// How long a connection may sit with no request before it is closed (HTTP/2 with a
    /// GOAWAY); also the longest pause in a request body and in a response being sent.
    /// gRPC connections that answer keepalive PINGs are never idle.
    #[arg(long, env = "TOLLGATE_IDLE_TIMEOUT", default_value = "60s", value_parser = parse_timeout)]
    pub idle_timeout: Duration,
    /// Time a client has to send a request's headers (HTTP/1: each request's; every
    /// connection: its first request, or the HTTP/2 preface) before its connection is
    /// closed.
    #[arg(long, env = "TOLLGATE_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = parse_timeout)]
    pub header_read_timeout: Duration,
    /// Share of a limit used from which hits count as `near_limit` in metrics.
    #[arg(long, env = "TOLLGATE_NEAR_LIMIT_RATIO", default_value_t = 0.8)]
    pub near_limit_ratio: f64,
    /// Who may call the admin endpoints.
    #[command(flatten)]
    pub admin: AdminArgs,
}

/// The admin token, on `serve`'s admin endpoints (HTTP or admin listener) and on the
/// gateway's `--admin-listen`. Read once at start-up.
#[derive(Debug, Clone, Args)]
pub struct AdminArgs {
    /// Require `Authorization: Bearer TOKEN` on the admin endpoints (`/rules`,
    /// `POST /reload`, and `/metrics` with --metrics-require-token; the health checks
    /// stay open). A flag's value shows in the process list: prefer the variable or
    /// --admin-token-file.
    #[arg(
        long,
        env = "TOLLGATE_ADMIN_TOKEN",
        hide_env_values = true,
        conflicts_with = "admin_token_file"
    )]
    pub admin_token: Option<Secret>,
    /// --admin-token, read from this file once at start-up (trailing newline dropped);
    /// a file that cannot be read or is empty stops the start.
    #[arg(long, env = "TOLLGATE_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// Require the admin token on `/metrics` too (open by default, for Prometheus
    /// scrapers).
    #[arg(long, env = "TOLLGATE_METRICS_REQUIRE_TOKEN")]
    pub metrics_require_token: bool,
}

/// A flag's secret value: `Debug` does not print it.
#[derive(Clone)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;

    /// Never fails: checked at start-up, so that no parse error prints the value.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.to_owned()))
    }
}

/// The certificates of a TLS connection to Redis.
#[derive(Debug, Clone, Args)]
pub struct RedisTlsArgs {
    /// PEM file of the certificate authorities to trust for a `rediss://` store
    /// (default: the system's roots).
    #[arg(long, env = "TOLLGATE_REDIS_CA_CERT")]
    pub redis_ca_cert: Option<PathBuf>,
    /// PEM file of the client certificate to present to a Redis with
    /// `tls-auth-clients yes` (with --redis-client-key).
    #[arg(
        long,
        env = "TOLLGATE_REDIS_CLIENT_CERT",
        requires = "redis_client_key"
    )]
    pub redis_client_cert: Option<PathBuf>,
    /// PEM file of that client certificate's private key.
    #[arg(
        long,
        env = "TOLLGATE_REDIS_CLIENT_KEY",
        requires = "redis_client_cert"
    )]
    pub redis_client_key: Option<PathBuf>,
}

impl RedisTlsArgs {
    /// The TLS settings these flags give (`None` when none is set), or which file
    /// could not be read.
    pub fn read(&self) -> Result<Option<RedisTls>, String> {
        let read = |path: &PathBuf| {
            std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
        };
        let ca_pem = self.redis_ca_cert.as_ref().map(read).transpose()?;
        let client_pem = match (&self.redis_client_cert, &self.redis_client_key) {
            (Some(cert), Some(key)) => Some((read(cert)?, read(key)?)),
            _ => None,
        };
        if ca_pem.is_none() && client_pem.is_none() {
            return Ok(None);
        }
        Ok(Some(RedisTls { ca_pem, client_pem }))
    }
}

/// Settings of `tollgate proxy`; every flag also reads a `TOLLGATE_*` variable.
#[derive(Debug, Clone, Args)]
pub struct ProxyArgs {
    /// Rules, store, logging and shutdown, shared with `tollgate serve`.
    #[command(flatten)]
    pub common: CommonArgs,
    /// Address the gateway listens on.
    #[arg(long, env = "TOLLGATE_PROXY_LISTEN", default_value = "0.0.0.0:8000")]
    pub listen: SocketAddr,
    /// The API every admitted request goes to: `http://host:port[/base-path]`.
    #[arg(long, env = "TOLLGATE_UPSTREAM")]
    pub upstream: String,
    /// Time to connect to the upstream; past it, 504.
    #[arg(long, env = "TOLLGATE_UPSTREAM_CONNECT_TIMEOUT", default_value = "2s", value_parser = parse_duration)]
    pub connect_timeout: Duration,
    /// Time for the upstream to send its response head; past it, 504.
    #[arg(long, env = "TOLLGATE_UPSTREAM_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub upstream_timeout: Duration,
    /// Lease of a concurrency permit kept in Redis (renewed while the request runs; a
    /// crashed instance's permits come back after it).
    #[arg(long, env = "TOLLGATE_PERMIT_LEASE", default_value = "30s", value_parser = parse_duration)]
    pub permit_lease: Duration,
    /// TLS on the gateway's listener.
    #[command(flatten)]
    pub tls: ProxyTlsArgs,
    /// Address for the admin endpoints (`/metrics`, `/healthz`, `/readyz`,
    /// `/healthcheck`, `/rules`, `POST /reload`); none when not set.
    #[arg(long, env = "TOLLGATE_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
}

/// Which HTTP/2 implementation serves gRPC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GrpcTransport {
    /// `tollgate-h2`: unary calls on cleartext HTTP/2, batched per read and write.
    Native,
    /// tonic (hyper and h2).
    Tonic,
}

impl GrpcTransport {
    /// The name the flag takes (`native`, `tonic`), for logs.
    pub fn name(self) -> &'static str {
        match self {
            GrpcTransport::Native => "native",
            GrpcTransport::Tonic => "tonic",
        }
    }
}

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = n
        .parse()
        .map_err(|_| format!("`{s}` is not a duration like 10s or 500ms"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" | "" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        _ => Err(format!("`{s}` is not a duration like 10s or 500ms")),
    }
}

/// A connection timeout: a duration above zero.
fn parse_timeout(s: &str) -> Result<Duration, String> {
    match parse_duration(s)? {
        d if d.is_zero() => Err(format!("`{s}`: the timeout must be above zero")),
        d => Ok(d),
    }
}

/// `--charge-rejected`: `none`, `over_limit` or `all`.
fn parse_charge_rejected(text: &str) -> Result<ChargeRejected, String> {
    ChargeRejected::from_name(text)
        .ok_or_else(|| format!("`{text}` is not none, over_limit or all"))
}
