//! `slow-upstream`: an HTTP/1.1 server modelling a service with a pool of C workers, for
//! `tools/bench-adaptive.sh`.
//!
//! Every request (but `GET /capacity` and `GET /served`) takes one of C permits of a semaphore, holds it
//! for S ms, then answers 200 with a small body. The hold ends within a pacing step
//! (0.2 ms, a `timerfd` on Linux) of S: tokio's own timers round up to the next
//! millisecond and wake late, which made a 5 ms hold about 6.2 ms and the pool's
//! throughput a fifth below C/S. Up to C requests in
//! flight, each is answered in S ms; past C they queue for a permit, so latency grows
//! with concurrency while throughput stays at C/S.
//!
//! `--schedule "10s=40,20s=20"` changes C at those times after start: a larger C adds
//! permits at once; a smaller one forgets the free permits at once and the rest as
//! requests release them. `GET /capacity` answers the current C (the target, in plain
//! text); `GET /served`, how many requests it has answered (the upstream's own count of
//! its throughput, whatever client drives it).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http::{header, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, Notify, OwnedSemaphorePermit, Semaphore};

#[path = "../pacer.rs"]
mod pacer;

#[path = "../bin_main.rs"]
mod bin_main;
use bin_main::{main_with, BoxError};

#[derive(Debug, Parser)]
#[command(about = "An HTTP/1.1 upstream with C workers, each request holding one for S ms")]
struct Cli {
    /// Address to listen on; with port 0, the bound address is printed on stdout.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Workers (C): requests served at once; the rest queue.
    #[arg(long, default_value_t = 20)]
    workers: usize,
    /// Service time (S) in milliseconds: how long each request holds a worker.
    #[arg(long, default_value_t = 5.0)]
    service_ms: f64,
    /// Changes of C after start, e.g. "10s=40,20s=20" (times: 500ms, 10s, 1.5s, 1m).
    #[arg(long)]
    schedule: Option<String>,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

/// The worker pool: a semaphore whose size follows the current target C.
struct Pool {
    /// One permit per free worker.
    permits: Arc<Semaphore>,
    /// The target C and the permits still to forget when they are released.
    state: Mutex<PoolState>,
    /// The target C, for `/capacity` without the lock.
    capacity: AtomicUsize,
    /// Requests answered (not counting `/capacity` and `/served`), for `/served`.
    served: AtomicUsize,
}

/// What `Pool::resize` and `Pool::release` change together.
struct PoolState {
    /// The current target C.
    target: usize,
    /// Permits held by requests now that are to be forgotten, not returned, on release.
    debt: usize,
}

impl Pool {
    /// A pool of `workers` permits.
    fn new(workers: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(workers)),
            state: Mutex::new(PoolState {
                target: workers,
                debt: 0,
            }),
            capacity: AtomicUsize::new(workers),
            served: AtomicUsize::new(0),
        }
    }

    /// Sets C: adds permits (first cancelling any debt), or forgets the free ones and
    /// records the rest as debt, paid as requests release theirs.
    fn resize(&self, workers: usize) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if workers > state.target {
            let add = workers - state.target;
            let cancelled = add.min(state.debt);
            state.debt -= cancelled;
            self.permits.add_permits(add - cancelled);
        } else {
            let cut = state.target - workers;
            let forgotten = self.permits.forget_permits(cut);
            state.debt += cut - forgotten;
        }
        state.target = workers;
        self.capacity.store(workers, Ordering::Relaxed);
    }

    /// Gives a worker back, or forgets it if C has shrunk below what is held.
    fn release(&self, permit: OwnedSemaphorePermit) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.debt > 0 {
            state.debt -= 1;
            permit.forget();
        } else {
            drop(permit);
        }
    }
}

/// The holds in progress: each request's end time and the signal that ends its hold,
/// in order of end time (every hold lasts the same S, so arrival order is that order).
struct Holds {
    /// How long each hold lasts.
    service: Duration,
    /// End time and signal of each hold, the earliest first.
    due: Mutex<VecDeque<(Instant, oneshot::Sender<()>)>>,
    /// Wakes `release_due` when a hold comes into an empty queue (idle, it sleeps).
    first: Notify,
}

impl Holds {
    /// Waits S from now, to within one pacing step.
    async fn hold(&self) {
        let (done, wait) = oneshot::channel();
        let end = Instant::now() + self.service;
        let was_empty = {
            let mut due = self.due.lock().unwrap_or_else(|e| e.into_inner());
            due.push_back((end, done));
            due.len() == 1
        };
        if was_empty {
            self.first.notify_one();
        }
        // The sender is dropped only by `release_due`, after it has fired.
        let _ = wait.await;
    }

    /// Every pacing step, ends the holds whose time has come; with none, sleeps until
    /// one comes (so an idle upstream takes no CPU).
    async fn release_due(&self) -> Result<(), BoxError> {
        let mut ticker = pacer::Ticker::new()?;
        loop {
            let idle = self
                .due
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty();
            if idle {
                self.first.notified().await;
            }
            ticker.tick().await?;
            let now = Instant::now();
            let mut due = self.due.lock().unwrap_or_else(|e| e.into_inner());
            while due.front().is_some_and(|(end, _)| *end <= now) {
                if let Some((_, done)) = due.pop_front() {
                    // A request whose client went away no longer waits.
                    let _ = done.send(());
                }
            }
        }
    }
}

/// Parses "500ms", "10s", "1.5s", "1m" (a bare number is seconds).
fn parse_duration(text: &str) -> Result<Duration, BoxError> {
    let text = text.trim();
    let (number, scale) = if let Some(n) = text.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('m') {
        (n, 60.0)
    } else {
        (text, 1.0)
    };
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("bad duration {text:?}"))?;
    Duration::try_from_secs_f64(value * scale).map_err(|_| format!("bad duration {text:?}").into())
}

/// Parses "10s=40,20s=20" into (time after start, C), sorted by time.
fn parse_schedule(text: &str) -> Result<Vec<(Duration, usize)>, BoxError> {
    let mut steps = Vec::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (at, workers) = item
            .split_once('=')
            .ok_or_else(|| format!("schedule item {item:?} is not TIME=WORKERS"))?;
        let workers: usize = workers
            .trim()
            .parse()
            .map_err(|_| format!("schedule item {item:?}: bad worker count"))?;
        steps.push((parse_duration(at)?, workers));
    }
    steps.sort_by_key(|(at, _)| *at);
    Ok(steps)
}

fn main() -> ExitCode {
    main_with("slow-upstream", |cli: &Cli| cli.threads, run)
}

/// Binds, starts the schedule and serves until killed.
async fn run(cli: Cli) -> Result<(), BoxError> {
    let schedule = match &cli.schedule {
        Some(s) => parse_schedule(s)?,
        None => Vec::new(),
    };
    let service = Duration::try_from_secs_f64(cli.service_ms / 1000.0)
        .map_err(|_| format!("bad --service-ms {}", cli.service_ms))?;
    let listener = TcpListener::bind(cli.listen).await?;
    if cli.listen.port() == 0 {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        writeln!(out, "{}", listener.local_addr()?)?;
        out.flush()?;
    }
    let pool = Arc::new(Pool::new(cli.workers));
    let holds = Arc::new(Holds {
        service,
        due: Mutex::new(VecDeque::new()),
        first: Notify::new(),
    });
    {
        let holds = holds.clone();
        tokio::spawn(async move {
            if let Err(e) = holds.release_due().await {
                eprintln!("slow-upstream: {e}");
                std::process::exit(1);
            }
        });
    }
    let start = tokio::time::Instant::now();
    {
        let pool = pool.clone();
        tokio::spawn(async move {
            for (at, workers) in schedule {
                tokio::time::sleep_until(start + at).await;
                pool.resize(workers);
            }
        });
    }
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors and the like: wait, do not spin.
                eprintln!("slow-upstream: accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        // Small answers on a keep-alive connection: no Nagle delay.
        let _ = stream.set_nodelay(true);
        let (pool, holds) = (pool.clone(), holds.clone());
        tokio::spawn(async move {
            let handler = service_fn(move |req| handle(req, pool.clone(), holds.clone()));
            // A client that goes away mid-request is no error worth reporting.
            let _ = http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), handler)
                .await;
        });
    }
}

/// `GET /capacity`: the current C; `GET /served`: how many requests were answered;
/// anything else: a worker held for S, then 200.
async fn handle(
    req: Request<Incoming>,
    pool: Arc<Pool>,
    holds: Arc<Holds>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let body = if req.uri().path() == "/capacity" {
        Bytes::from(format!("{}\n", pool.capacity.load(Ordering::Relaxed)))
    } else if req.uri().path() == "/served" {
        Bytes::from(format!("{}\n", pool.served.load(Ordering::Relaxed)))
    } else {
        match pool.permits.clone().acquire_owned().await {
            Ok(permit) => {
                holds.hold().await;
                pool.release(permit);
                pool.served.fetch_add(1, Ordering::Relaxed);
                Bytes::from_static(b"ok\n")
            }
            // The semaphore is never closed; answer as a failed service would.
            Err(_closed) => return Ok(plain(StatusCode::SERVICE_UNAVAILABLE, "closed\n".into())),
        }
    };
    Ok(plain(StatusCode::OK, body))
}

/// A plain-text response.
fn plain(status: StatusCode, body: Bytes) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain"),
    );
    response
}
