//! `adaptive-load`: closed-loop HTTP/1.1 clients against a gateway with adaptive
//! concurrency (or any URL), for `tools/bench-adaptive.sh`.
//!
//! `--clients` tasks, each on its own keep-alive connection, send GET after GET for
//! `--duration` seconds (after a non-2xx answer, each waits `--shed-pause-ms` first, 0 by
//! default: at once).
//! Answers are counted by class (2xx, 503, other; transport errors apart), and the
//! latency of the admitted (2xx) requests goes into an HdrHistogram (send to the last
//! byte of the body).
//!
//! Every `--interval-ms` (100) a timeline row is taken: the 2xx and 503 completed in that
//! slice, the gateway's adaptive limit (polled from its admin `/v1/stats` by a separate
//! task, with `--stats`) and the upstream's capacity (polled from `--capacity-url`).
//! A value that is not configured or could not be read is left empty. The timeline is
//! written as CSV to `--csv` (`t_ms,ok,shed,limit,capacity`); one JSON line sums the run
//! up on stdout.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use hdrhistogram::Histogram;
use http::{header, Request, StatusCode, Uri};
use http_body_util::{BodyExt as _, Empty};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

#[path = "../bin_main.rs"]
mod bin_main;
use bin_main::{main_with, BoxError};

/// No value: the limit or capacity is not known at this moment.
const NONE: u64 = u64::MAX;

#[derive(Debug, Parser)]
#[command(about = "Closed-loop clients with a timeline of the gateway's adaptive limit")]
struct Cli {
    /// The URL to GET (http only).
    #[arg(long)]
    url: String,
    /// Concurrent clients, each on its own keep-alive connection.
    #[arg(long, default_value_t = 200)]
    clients: u32,
    /// Seconds to run.
    #[arg(long, default_value_t = 30.0)]
    duration: f64,
    /// Milliseconds a client waits after a non-2xx answer before its next request (0: at
    /// once).
    #[arg(long, default_value_t = 0.0)]
    shed_pause_ms: f64,
    /// The gateway's admin `/v1/stats` URL, polled for the adaptive limit.
    #[arg(long)]
    stats: Option<String>,
    /// With --stats: the `domain` of the adaptive entry to follow (default: the first).
    #[arg(long)]
    stats_domain: Option<String>,
    /// With --stats: the `route` of the adaptive entry to follow (default: the first).
    #[arg(long)]
    stats_route: Option<String>,
    /// The upstream's `/capacity` URL, polled for its current worker count.
    #[arg(long)]
    capacity_url: Option<String>,
    /// Where to write the timeline CSV (none if absent).
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Timeline slice and polling period, in milliseconds.
    #[arg(long, default_value_t = 100)]
    interval_ms: u64,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

/// Counts of answers, over the run and in the current timeline slice.
#[derive(Debug, Default)]
struct Counts {
    /// Requests sent (those in flight at the end included).
    sent: AtomicU64,
    /// 2xx answers.
    ok: AtomicU64,
    /// 503 answers: shed by the gateway.
    shed: AtomicU64,
    /// Answers of any other status.
    other: AtomicU64,
    /// Failed connections and requests (no answer).
    errors: AtomicU64,
    /// 2xx answers in the current timeline slice.
    slice_ok: AtomicU64,
    /// 503 answers in the current timeline slice.
    slice_shed: AtomicU64,
}

/// The last polled values, as f64 bits (`NONE`: unknown).
#[derive(Debug)]
struct Polled {
    /// The gateway's adaptive limit.
    limit: AtomicU64,
    /// The upstream's C.
    capacity: AtomicU64,
}

/// Where a client connects and what it asks for.
#[derive(Debug, Clone)]
struct Target {
    /// `host:port` to connect to, also sent as `Host`.
    authority: String,
    /// The origin-form request target (path and query).
    path: Uri,
}

fn main() -> ExitCode {
    main_with("adaptive-load", |cli: &Cli| cli.threads, run)
}

/// Runs the clients, the pollers and the timeline; writes the CSV and the summary.
async fn run(cli: Cli) -> Result<(), BoxError> {
    let uri: Uri = cli.url.parse()?;
    if uri.scheme_str() != Some("http") {
        return Err(format!("--url {}: only http:// is supported", cli.url).into());
    }
    let authority = uri
        .authority()
        .ok_or_else(|| format!("--url {} has no host", cli.url))?;
    let port = authority.port_u16().unwrap_or(80);
    let target = Target {
        authority: format!("{}:{port}", authority.host()),
        path: uri.path_and_query().map_or("/", |p| p.as_str()).parse()?,
    };
    let interval = Duration::from_millis(cli.interval_ms.max(1));
    let counts = Arc::new(Counts::default());
    let polled = Arc::new(Polled {
        limit: AtomicU64::new(NONE),
        capacity: AtomicU64::new(NONE),
    });
    let poller = reqwest::Client::builder()
        .timeout(Duration::from_secs(1))
        .build()?;

    let duration = Duration::from_secs_f64(cli.duration);
    let start = Instant::now();
    let deadline = tokio::time::Instant::from_std(start + duration);
    let mut pollers = Vec::new();
    if let Some(url) = cli.stats.clone() {
        let (client, polled) = (poller.clone(), polled.clone());
        let (domain, route) = (cli.stats_domain.clone(), cli.stats_route.clone());
        pollers.push(tokio::spawn(poll(interval, deadline, move || {
            let (client, url, polled) = (client.clone(), url.clone(), polled.clone());
            let (domain, route) = (domain.clone(), route.clone());
            async move {
                let limit = read_limit(&client, &url, domain.as_deref(), route.as_deref()).await;
                polled
                    .limit
                    .store(limit.map_or(NONE, f64::to_bits), Ordering::Relaxed);
            }
        })));
    }
    if let Some(url) = cli.capacity_url.clone() {
        let (client, polled) = (poller.clone(), polled.clone());
        pollers.push(tokio::spawn(poll(interval, deadline, move || {
            let (client, url, polled) = (client.clone(), url.clone(), polled.clone());
            async move {
                let capacity = read_number(&client, &url).await;
                polled
                    .capacity
                    .store(capacity.map_or(NONE, f64::to_bits), Ordering::Relaxed);
            }
        })));
    }

    // The timeline: one row per slice, taken by its own task.
    let timeline = {
        let (counts, polled) = (counts.clone(), polled.clone());
        tokio::spawn(async move {
            let mut rows = vec!["t_ms,ok,shed,limit,capacity".to_owned()];
            let mut slice = 1u64;
            loop {
                let at = tokio::time::Instant::from_std(start + interval * slice as u32);
                if at > deadline {
                    break;
                }
                tokio::time::sleep_until(at).await;
                let ok = counts.slice_ok.swap(0, Ordering::Relaxed);
                let shed = counts.slice_shed.swap(0, Ordering::Relaxed);
                rows.push(format!(
                    "{},{ok},{shed},{},{}",
                    (interval * slice as u32).as_millis(),
                    cell(polled.limit.load(Ordering::Relaxed)),
                    cell(polled.capacity.load(Ordering::Relaxed)),
                ));
                slice += 1;
            }
            rows
        })
    };

    let shed_pause = Duration::from_secs_f64(cli.shed_pause_ms.max(0.0) / 1000.0);
    let mut tasks = Vec::new();
    for _ in 0..cli.clients {
        let (target, counts) = (target.clone(), counts.clone());
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)?;
            // Runs until the deadline; a request unfinished then is not counted.
            let _elapsed =
                tokio::time::timeout_at(deadline, client(&target, &counts, &mut hist, shed_pause))
                    .await;
            Ok::<_, BoxError>(hist)
        }));
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)?;
    for task in tasks {
        hist.add(task.await??)?;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let rows = timeline.await?;
    for poller in pollers {
        poller.await?;
    }
    if let Some(path) = &cli.csv {
        let mut text = rows.join("\n");
        text.push('\n');
        std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }

    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let (sent, ok, shed) = (get(&counts.sent), get(&counts.ok), get(&counts.shed));
    let ms = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "{{\"clients\":{},\"duration_s\":{:.2},\"sent\":{sent},\"ok\":{ok},\"shed\":{shed},\"other\":{},\"errors\":{},\"ok_per_s\":{:.1},\"shed_share\":{:.4},\"p50_ms\":{:.2},\"p90_ms\":{:.2},\"p99_ms\":{:.2},\"max_ms\":{:.2}}}",
        cli.clients,
        elapsed,
        get(&counts.other),
        get(&counts.errors),
        ok as f64 / elapsed,
        if sent > 0 { shed as f64 / sent as f64 } else { 0.0 },
        ms(0.5),
        ms(0.9),
        ms(0.99),
        hist.max() as f64 / 1000.0,
    );
    Ok(())
}

/// A CSV cell: the f64 whose bits are stored, or empty.
fn cell(bits: u64) -> String {
    if bits == NONE {
        String::new()
    } else {
        let v = f64::from_bits(bits);
        if v.fract() == 0.0 {
            format!("{v:.0}")
        } else {
            format!("{v:.3}")
        }
    }
}

/// Calls `once` every `interval` until `deadline` (a slow call delays the next one).
async fn poll<F, Fut>(interval: Duration, deadline: tokio::time::Instant, once: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while tokio::time::Instant::now() < deadline {
        ticker.tick().await;
        once().await;
    }
}

/// The adaptive limit from the gateway's `/v1/stats`: the entry matching `domain` and
/// `route` (each if given), else the first; `None` if absent or unreadable.
async fn read_limit(
    client: &reqwest::Client,
    url: &str,
    domain: Option<&str>,
    route: Option<&str>,
) -> Option<f64> {
    let response = client.get(url).send().await.ok()?.error_for_status().ok()?;
    let stats: serde_json::Value = serde_json::from_slice(&response.bytes().await.ok()?).ok()?;
    let matches = |entry: &&serde_json::Value, key: &str, want: Option<&str>| {
        want.is_none_or(|w| entry.get(key).and_then(|v| v.as_str()) == Some(w))
    };
    stats
        .get("adaptive")?
        .as_array()?
        .iter()
        .find(|e| matches(e, "domain", domain) && matches(e, "route", route))?
        .get("limit")?
        .as_f64()
}

/// A number answered as plain text (the upstream's `/capacity`); `None` if unreadable.
async fn read_number(client: &reqwest::Client, url: &str) -> Option<f64> {
    let response = client.get(url).send().await.ok()?.error_for_status().ok()?;
    response.text().await.ok()?.trim().parse().ok()
}

/// One client's loop: connects (again after an error), sends GET after GET, counts
/// every answer and records the 2xx latencies. Ends only when cancelled.
async fn client(target: &Target, counts: &Counts, hist: &mut Histogram<u64>, shed_pause: Duration) {
    loop {
        let mut sender = match connect(target).await {
            Ok(sender) => sender,
            Err(_) => {
                counts.errors.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        loop {
            let request = Request::get(target.path.clone())
                .header(header::HOST, target.authority.as_str())
                .body(Empty::<Bytes>::new());
            let Ok(request) = request else {
                counts.errors.fetch_add(1, Ordering::Relaxed);
                return;
            };
            if sender.ready().await.is_err() {
                break;
            }
            let sent = Instant::now();
            counts.sent.fetch_add(1, Ordering::Relaxed);
            let status = match sender.send_request(request).await {
                Ok(response) => {
                    let status = response.status();
                    if response.into_body().collect().await.is_err() {
                        None
                    } else {
                        Some(status)
                    }
                }
                Err(_) => None,
            };
            match status {
                Some(s) if s.is_success() => {
                    hist.saturating_record(sent.elapsed().as_micros().max(1) as u64);
                    counts.ok.fetch_add(1, Ordering::Relaxed);
                    counts.slice_ok.fetch_add(1, Ordering::Relaxed);
                }
                Some(StatusCode::SERVICE_UNAVAILABLE) => {
                    counts.shed.fetch_add(1, Ordering::Relaxed);
                    counts.slice_shed.fetch_add(1, Ordering::Relaxed);
                    pause(shed_pause).await;
                }
                Some(_) => {
                    counts.other.fetch_add(1, Ordering::Relaxed);
                    pause(shed_pause).await;
                }
                None => {
                    // The connection failed: count it and connect again.
                    counts.errors.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
        }
    }
}

/// Waits `pause`, if any (a client's back-off after a refusal).
async fn pause(pause: Duration) {
    if !pause.is_zero() {
        tokio::time::sleep(pause).await;
    }
}

/// A new keep-alive HTTP/1.1 connection to the target, its driver spawned.
async fn connect(target: &Target) -> Result<http1::SendRequest<Empty<Bytes>>, BoxError> {
    let stream = TcpStream::connect(target.authority.as_str()).await?;
    stream.set_nodelay(true)?;
    let (sender, connection) = http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        // Ends when the client drops its sender or the peer closes; either is normal.
        let _ = connection.await;
    });
    Ok(sender)
}
