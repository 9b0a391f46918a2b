//! `bench-callers`: many concurrent callers of one rate-limited URL, each looping
//! "send a GET until it succeeds, then the next one", to measure what a caller's retry
//! policy costs the server and gives the caller (used by `tools/bench-client.sh`).
//!
//! - `--mode immediate`: a 429 (or 503) is retried at once.
//! - `--mode crate`: through `tollgate-client`'s `RetryLayer` (its default backoff and
//!   retry budget) with the pre-check on, keyed by the API key header, waiting up to 5 s
//!   for a reset. When the layer gives up (retries, time or budget spent, or the
//!   pre-check's wait would be too long) the caller calls it again.
//!
//! Both go over the same hyper-util client (keep-alive, one connection per caller at
//! most); every request that reaches the wire is counted. It prints one line of JSON:
//! requests sent, 429s, 2xx, goodput (2xx per second of the run) and the time from a
//! logical request's first send to its success (p50, p99, max).

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::{Parser, ValueEnum};
use hdrhistogram::Histogram;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt as _, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollgate_client::{Precheck, RetryLayer, WhenExhausted};
use tower::{Layer as _, Service, ServiceExt as _};

#[path = "../bin_main.rs"]
mod bin_main;
use bin_main::{main_with, BoxError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Retry a 429 at once.
    Immediate,
    /// Retry through tollgate-client's RetryLayer with the pre-check.
    Crate,
}

#[derive(Debug, Parser)]
#[command(about = "Concurrent callers of a rate-limited URL: immediate retries or tollgate-client")]
struct Cli {
    /// The URL to GET (http only).
    #[arg(long)]
    url: String,
    /// How callers answer a 429.
    #[arg(long, value_enum)]
    mode: Mode,
    /// Concurrent callers.
    #[arg(long, default_value_t = 50)]
    callers: u32,
    /// Seconds to run.
    #[arg(long, default_value_t = 20.0)]
    duration: f64,
    /// The header carrying the API key.
    #[arg(long, default_value = "x-api-key")]
    key_header: String,
    /// The API key every caller sends.
    #[arg(long, default_value = "bench-key")]
    api_key: String,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
}

/// Counts of what went over the wire.
#[derive(Debug, Default)]
struct Counts {
    sent: AtomicU64,
    ok: AtomicU64,
    rejected: AtomicU64,
    other: AtomicU64,
    errors: AtomicU64,
    gave_up: AtomicU64,
}

fn main() -> ExitCode {
    main_with("bench-callers", |cli: &Cli| cli.threads, run)
}

async fn run(cli: Cli) -> Result<(), BoxError> {
    let uri: http::Uri = cli.url.parse()?;
    let key_header = HeaderName::try_from(cli.key_header.as_str())?;
    let key_value = HeaderValue::try_from(cli.api_key.as_str())?;
    let counts = Arc::new(Counts::default());
    let client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(cli.callers as usize)
        .build_http::<Empty<Bytes>>();
    // The wire: every request sent is counted, and each response body read in full
    // (so the connection goes back to the pool whoever drops the response).
    let wire = {
        let counts = counts.clone();
        tower::service_fn(move |req: Request<Empty<Bytes>>| {
            let client = client.clone();
            let counts = counts.clone();
            async move {
                counts.sent.fetch_add(1, Ordering::Relaxed);
                let response = client.request(req).await.inspect_err(|_| {
                    counts.errors.fetch_add(1, Ordering::Relaxed);
                })?;
                let (parts, body) = response.into_parts();
                let body = body.collect().await?.to_bytes();
                let counter = match parts.status {
                    s if s.is_success() => &counts.ok,
                    StatusCode::TOO_MANY_REQUESTS => &counts.rejected,
                    _ => &counts.other,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                Ok::<_, BoxError>(Response::from_parts(parts, body))
            }
        })
    };
    let precheck = Arc::new(
        Precheck::new(WhenExhausted::Wait {
            max: Duration::from_secs(5),
        })
        .key_by_header(key_header.clone()),
    );
    let layer = RetryLayer::new().precheck(precheck);
    let retrying = layer.layer(wire.clone());

    let duration = Duration::from_secs_f64(cli.duration);
    let start = Instant::now();
    let deadline = tokio::time::Instant::from_std(start + duration);
    let mut tasks = Vec::new();
    for _ in 0..cli.callers {
        let request = {
            let key_header = key_header.clone();
            let key_value = key_value.clone();
            let uri = uri.clone();
            move || {
                Request::get(uri.clone())
                    .header(key_header.clone(), key_value.clone())
                    .body(Empty::<Bytes>::new())
            }
        };
        let mode = cli.mode;
        let counts = counts.clone();
        let mut wire = wire.clone();
        let mut retrying = retrying.clone();
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)?;
            let caller = async {
                loop {
                    let first = Instant::now();
                    loop {
                        let status = match mode {
                            Mode::Immediate => wire.ready().await?.call(request()?).await?.status(),
                            Mode::Crate => match retrying
                                .ready()
                                .await
                                .map_err(|e| e.to_string())?
                                .call(request()?)
                                .await
                            {
                                Ok(response) => response.status(),
                                Err(tollgate_client::Error::Exhausted(_)) => {
                                    StatusCode::TOO_MANY_REQUESTS
                                }
                                Err(tollgate_client::Error::Service(e)) => return Err(e),
                            },
                        };
                        if status.is_success() {
                            let us = first.elapsed().as_micros().max(1) as u64;
                            hist.saturating_record(us);
                            break;
                        }
                        if mode == Mode::Crate {
                            // The layer gave up on this one; the caller asks again.
                            counts.gave_up.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            };
            // Runs until the deadline; a logical request unfinished then is not counted
            // in the times (its sends are counted).
            let result: Result<Result<std::convert::Infallible, BoxError>, _> =
                tokio::time::timeout_at(deadline, caller).await;
            match result {
                Err(_elapsed) => Ok::<_, BoxError>(hist),
                Ok(Err(e)) => Err(e),
                Ok(Ok(never)) => match never {},
            }
        }));
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)?;
    for task in tasks {
        hist.add(task.await??)?;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let ok = get(&counts.ok);
    let ms = |us: u64| us as f64 / 1000.0;
    println!(
        "{{\"mode\":\"{}\",\"callers\":{},\"duration_s\":{:.2},\"sent\":{},\"ok\":{},\"rejected\":{},\"other\":{},\"errors\":{},\"gave_up\":{},\"goodput\":{:.1},\"successes\":{},\"p50_ms\":{:.1},\"p99_ms\":{:.1},\"max_ms\":{:.1}}}",
        match cli.mode {
            Mode::Immediate => "immediate",
            Mode::Crate => "crate",
        },
        cli.callers,
        elapsed,
        get(&counts.sent),
        ok,
        get(&counts.rejected),
        get(&counts.other),
        get(&counts.errors),
        get(&counts.gave_up),
        ok as f64 / elapsed,
        hist.len(),
        ms(hist.value_at_quantile(0.5)),
        ms(hist.value_at_quantile(0.99)),
        ms(hist.max()),
    );
    Ok(())
}
