//! The command line: subcommands (one per protocol) and the flags they share.

use std::time::Duration;

use clap::{Args, Parser, Subcommand};

/// Load generator for `tollgate serve` (Envoy's gRPC rate limit API or the JSON
/// `/v1/check` API) and for any plain HTTP URL.
///
/// Keeps `--concurrency` requests in flight for `--duration` (or until `--requests`
/// have been sent), then prints the request counts by outcome, the achieved
/// requests per second and latency percentiles (HdrHistogram, microseconds).
/// With `--rate` it paces requests open-loop instead of sending as fast as possible.
/// With `--server-pid` it also reports the server's CPU time per request.
///
/// The report goes to stdout (text, or one JSON object with `--json`); the progress
/// bar and error messages go to stderr. Exits non-zero if the target cannot be
/// reached or if every measured request failed.
#[derive(Debug, Parser)]
#[command(name = "tollgate-load", version, about, long_about)]
pub struct Cli {
    /// The protocol to drive.
    #[command(subcommand)]
    pub mode: Mode,
}

/// The protocols, one subcommand each.
#[derive(Debug, Subcommand)]
pub enum Mode {
    /// Envoy's rate limit gRPC API
    /// (`envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`).
    ///
    /// Each request carries `--domain` and one descriptor with one entry
    /// `--key` = `u<k>`. OK and OVER_LIMIT answers are counted separately;
    /// a gRPC error status is counted as an error.
    Grpc {
        /// Address of the gRPC listener, `host:port` (or `http://host:port`).
        #[arg(long, env = "TOLLGATE_LOAD_ADDR", default_value = "127.0.0.1:8081")]
        addr: String,
        /// The HTTP/2 client: `native` (tollgate-h2: each connection's task writes all
        /// queued calls at once; cheaper, so more of the shared CPU is left to the
        /// server) or `tonic`.
        #[arg(long, env = "TOLLGATE_LOAD_TRANSPORT", value_enum, default_value_t = Transport::Native)]
        transport: Transport,
        /// Number of HTTP/2 connections to open; requests are spread over them
        /// round-robin so one connection is not the bottleneck.
        #[arg(long, env = "TOLLGATE_LOAD_CONNECTIONS", default_value_t = 4,
              value_parser = clap::value_parser!(u32).range(1..))]
        connections: u32,
        /// Connect over TLS, trusting the certificate authorities of this PEM file
        /// (with `--transport tonic`; the native client speaks cleartext only).
        #[arg(long, env = "TOLLGATE_LOAD_TLS_CA")]
        tls_ca: Option<std::path::PathBuf>,
        /// The name the server's certificate must carry, with `--tls-ca`.
        #[arg(
            long,
            env = "TOLLGATE_LOAD_TLS_SERVER_NAME",
            default_value = "localhost"
        )]
        tls_server_name: String,
        /// Keys, domain and descriptor entry key.
        #[command(flatten)]
        keys: KeyArgs,
        /// Flags shared by every mode.
        #[command(flatten)]
        common: CommonArgs,
    },
    /// Tollgate's JSON API: `POST` `{"domain":D,"descriptors":[{KEY:"u<k>"}],"hits":1}`.
    ///
    /// 200 counts as OK, 429 as over limit, 5xx and transport failures as errors,
    /// any other status as "other".
    Check {
        /// The `/v1/check` URL.
        #[arg(
            long,
            env = "TOLLGATE_LOAD_URL",
            default_value = "http://127.0.0.1:8080/v1/check"
        )]
        url: String,
        /// Keys, domain and descriptor entry key.
        #[command(flatten)]
        keys: KeyArgs,
        /// Flags shared by every mode.
        #[command(flatten)]
        common: CommonArgs,
    },
    /// Redis's ceiling for Tollgate's script: the exact `EVALSHA` a Redis store sends
    /// for a lone request (one fixed_window check, a limit never reached, Redis TIME),
    /// over `--concurrency` connections with one call in flight each, like
    /// `redis-benchmark -c N` (which cannot send the script's binary argument).
    Redis {
        /// The Redis URL.
        #[arg(
            long,
            env = "TOLLGATE_LOAD_REDIS",
            default_value = "redis://127.0.0.1:6379"
        )]
        url: String,
        /// Number of distinct keys, cycled in order.
        #[arg(long, env = "TOLLGATE_LOAD_KEYS", default_value_t = 10_000,
              value_parser = clap::value_parser!(u64).range(1..))]
        keys: u64,
        /// Flags shared by every mode.
        #[command(flatten)]
        common: CommonArgs,
    },
    /// Plain `GET` of any URL (e.g. to benchmark a proxy or an upstream).
    ///
    /// 2xx counts as OK, 429 as over limit, 5xx and transport failures as errors,
    /// any other status as "other". Every request gets the same URL.
    Http {
        /// The URL to fetch (`http://` only: this build has no TLS).
        #[arg(long, env = "TOLLGATE_LOAD_URL")]
        url: String,
        /// Flags shared by every mode.
        #[command(flatten)]
        common: CommonArgs,
    },
}

/// The gRPC client implementation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Transport {
    /// tollgate-h2's client connection.
    Native,
    /// tonic's client.
    Tonic,
}

/// Which rate limit keys the requests use.
#[derive(Debug, Clone, Args)]
pub struct KeyArgs {
    /// Number of distinct descriptor values: request number `i` (counting from 0 in
    /// each phase) uses the value `u<i mod N>`, so the keys are cycled in order.
    #[arg(long, env = "TOLLGATE_LOAD_KEYS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub keys: u64,
    /// The rate limit domain sent with every request.
    #[arg(long, env = "TOLLGATE_LOAD_DOMAIN", default_value = "bench")]
    pub domain: String,
    /// The descriptor entry key (its value is `u<k>`).
    #[arg(long, env = "TOLLGATE_LOAD_KEY", default_value = "user")]
    pub key: String,
}

/// Flags shared by every mode: how much load, for how long, and what to report.
#[derive(Debug, Clone, Args)]
pub struct CommonArgs {
    /// Most requests in flight at once (closed loop: one worker task each; open loop:
    /// the limit every dispatcher's calls count against).
    #[arg(short, long, env = "TOLLGATE_LOAD_CONCURRENCY", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub concurrency: u32,
    /// How long to measure, e.g. `10s`, `500ms`, `2m` (default 10s unless
    /// `--requests` is given).
    #[arg(short, long, env = "TOLLGATE_LOAD_DURATION", value_parser = parse_duration,
          conflicts_with = "requests")]
    pub duration: Option<Duration>,
    /// Measure exactly this many requests instead of running for a duration.
    #[arg(short = 'n', long, env = "TOLLGATE_LOAD_REQUESTS",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub requests: Option<u64>,
    /// Total requests per second, paced open-loop (request `i` is scheduled at
    /// `start + i/R`; one dispatcher task per runtime thread wakes on its own 200 us
    /// timer (a Linux timerfd) and sends its share of the due requests). Latency is
    /// then measured from each request's scheduled start, so time spent waiting for a
    /// free slot (`--concurrency` already in flight) counts (no coordinated omission),
    /// and so does the timer's step. Without `--rate` the run is closed-loop: each
    /// worker sends its next request as soon as the previous one is answered.
    #[arg(short, long, env = "TOLLGATE_LOAD_RATE", value_parser = parse_rate)]
    pub rate: Option<f64>,
    /// Unmeasured warm-up before the run (same load), e.g. `1s`; `0s` for none.
    #[arg(long, env = "TOLLGATE_LOAD_WARMUP", value_parser = parse_duration,
          default_value = "1s")]
    pub warmup: Duration,
    /// Per-request timeout (also used for connecting); a request that takes longer
    /// counts as an error.
    #[arg(long, env = "TOLLGATE_LOAD_TIMEOUT", value_parser = parse_duration,
          default_value = "10s")]
    pub timeout: Duration,
    /// PID of the server process: its CPU time (all threads) is read from /proc
    /// before and after the measured run and reported per request.
    #[arg(long, env = "TOLLGATE_LOAD_SERVER_PID")]
    pub server_pid: Option<u32>,
    /// Tokio worker threads for the load generator (default: one per CPU). With 1, the
    /// whole load generator runs on one thread (tokio's current-thread runtime), so no
    /// wake-up ever passes from one thread to another: the least CPU per request, for
    /// open-loop runs that share the machine with the server.
    #[arg(long, env = "TOLLGATE_LOAD_THREADS",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub threads: Option<u32>,
    /// Print the final report as one JSON object (on stdout).
    #[arg(long)]
    pub json: bool,
    /// No progress bar (it is also hidden when stderr is not a terminal).
    #[arg(short, long)]
    pub quiet: bool,
}

impl CommonArgs {
    /// When the measured run stops: the request count if given, else the duration
    /// (10 s by default).
    pub fn stop(&self) -> Stop {
        match (self.requests, self.duration) {
            (Some(n), _) => Stop::Requests(n),
            (None, Some(d)) => Stop::Duration(d),
            (None, None) => Stop::Duration(Duration::from_secs(10)),
        }
    }
}

/// When a phase of the run ends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Stop {
    /// No new request is started (closed loop) or scheduled (open loop) after this
    /// long; requests in flight are awaited.
    Duration(Duration),
    /// Exactly this many requests are sent.
    Requests(u64),
}

/// Parses `10s`, `500ms`, `250us`/`250µs`, `2m`, `1h`, or a bare number of
/// seconds; fractions are allowed (`1.5s`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("invalid duration `{s}`: expected e.g. 10s, 500ms, 2m"))?;
    let secs_per_unit = match unit.trim() {
        "" | "s" | "sec" | "secs" => 1.0,
        "ms" => 1e-3,
        "us" | "µs" => 1e-6,
        "ns" => 1e-9,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        other => {
            return Err(format!(
                "invalid duration unit `{other}` in `{s}`: use h, m, s, ms, us or ns"
            ))
        }
    };
    Duration::try_from_secs_f64(value * secs_per_unit)
        .map_err(|e| format!("invalid duration `{s}`: {e}"))
}

/// Parses a positive, finite request rate (requests per second).
fn parse_rate(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(format!(
            "invalid rate `{s}`: expected a positive number of requests per second"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("250us"), Ok(Duration::from_micros(250)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("10 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn rates() {
        assert_eq!(parse_rate("2500"), Ok(2500.0));
        assert_eq!(parse_rate("0.5"), Ok(0.5));
        assert!(parse_rate("0").is_err());
        assert!(parse_rate("-3").is_err());
        assert!(parse_rate("inf").is_err());
    }

    #[test]
    fn stop_defaults_to_ten_seconds() {
        let cli = Cli::try_parse_from(["tollgate-load", "http", "--url", "http://x/"]);
        let Ok(Cli {
            mode: Mode::Http { common, .. },
        }) = cli
        else {
            panic!("parse failed: {cli:?}");
        };
        assert_eq!(common.stop(), Stop::Duration(Duration::from_secs(10)));
        assert_eq!(common.concurrency, 64);
    }

    #[test]
    fn requests_and_duration_conflict() {
        let cli = Cli::try_parse_from([
            "tollgate-load",
            "grpc",
            "--requests",
            "5",
            "--duration",
            "1s",
        ]);
        assert!(cli.is_err());
    }
}
