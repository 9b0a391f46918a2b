//! The load loop: `concurrency` worker tasks share a ticket counter; each takes the
//! next request number, (in open loop) waits for its scheduled time, sends it through
//! a [`Target`], and records the outcome and latency in its own HdrHistogram. The
//! histograms and counters are merged when the phase ends.
//!
//! Closed loop (no rate): latency is from the actual send to the answer.
//!
//! Open loop (`rate` R): request `i` is scheduled at `start + i/R`. If the worker
//! that takes ticket `i` is free before that moment, it sleeps until then and the
//! latency is measured from when it actually sends (tokio timers have millisecond
//! granularity, and that wake-up delay is the load generator's, not the server's).
//! If it is free only after that moment (every worker was busy: the server is behind),
//! latency is measured from the scheduled time, so the queueing delay the server
//! caused is counted (no coordinated omission).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use indicatif::ProgressBar;

use crate::cli::Stop;

/// Dispatches later than this behind schedule are counted as "late".
const LATE_THRESHOLD: Duration = Duration::from_millis(1);

/// What one request resulted in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Allowed: gRPC `OK`, HTTP 200 (check) or 2xx (http).
    Ok,
    /// Rate limited: gRPC `OVER_LIMIT` or HTTP 429.
    OverLimit,
    /// An answer that is neither: gRPC code `UNKNOWN`, or an HTTP status other than
    /// 2xx, 429 and 5xx.
    Other,
    /// Transport failure, timeout, gRPC error status or HTTP 5xx (with a description).
    Error(String),
}

/// Something requests can be sent to.
pub trait Target: Send + Sync + 'static {
    /// Sends request number `seq` (counting from 0 in each phase; used to pick the key).
    fn call(&self, seq: u64) -> impl Future<Output = Outcome> + Send;
}

/// How one phase (warm-up or measured run) is driven.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Worker tasks, i.e. maximum requests in flight.
    pub concurrency: u32,
    /// When to stop.
    pub stop: Stop,
    /// Open-loop rate in requests per second, or `None` for closed loop.
    pub rate: Option<f64>,
    /// Per-request timeout (exceeding it is an error).
    pub timeout: Duration,
}

/// Request counts by outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// [`Outcome::Ok`] answers.
    pub ok: u64,
    /// [`Outcome::OverLimit`] answers.
    pub over_limit: u64,
    /// [`Outcome::Other`] answers.
    pub other: u64,
    /// [`Outcome::Error`]s.
    pub errors: u64,
}

impl Counts {
    /// All requests.
    pub fn total(&self) -> u64 {
        self.ok + self.over_limit + self.other + self.errors
    }

    fn add(&mut self, o: &Counts) {
        self.ok += o.ok;
        self.over_limit += o.over_limit;
        self.other += o.other;
        self.errors += o.errors;
    }
}

/// The merged result of a phase.
#[derive(Debug)]
pub struct PhaseResult {
    /// Latency of every request (including failed ones), in nanoseconds.
    pub latency_ns: Histogram<u64>,
    /// Requests by outcome.
    pub counts: Counts,
    /// From the phase's start until the last request finished.
    pub elapsed: Duration,
    /// Open loop only: requests dispatched more than 1 ms behind schedule because
    /// every worker was busy (a sign that `--concurrency` is too low for the rate
    /// or the server cannot keep up).
    pub late: u64,
    /// The first error seen, to show the user what went wrong.
    pub first_error: Option<String>,
}

/// The moment request `seq` is due, as an offset from the phase's start, at `rate`
/// requests per second.
pub fn scheduled_offset(seq: u64, rate: f64) -> Duration {
    // Saturates instead of panicking on absurd values (the stop check then ends the run).
    Duration::try_from_secs_f64(seq as f64 / rate).unwrap_or(Duration::MAX)
}

/// Whether request `seq`, due at `offset` (open loop) or being started at `offset`
/// (closed loop), still belongs in the phase.
pub fn within(stop: Stop, seq: u64, offset: Duration) -> bool {
    match stop {
        Stop::Requests(n) => seq < n,
        Stop::Duration(d) => offset < d,
    }
}

/// Runs one phase against `target`, updating `progress` (position: finished requests
/// for a request count, elapsed milliseconds for a duration).
pub async fn run<T: Target>(
    target: Arc<T>,
    plan: Plan,
    progress: ProgressBar,
) -> Result<PhaseResult, String> {
    let shared = Arc::new(Shared {
        next: AtomicU64::new(0),
        done: AtomicU64::new(0),
        start: Instant::now(),
    });
    let ticker = tokio::spawn(tick(Arc::clone(&shared), plan.stop, progress.clone()));

    let mut workers = Vec::with_capacity(plan.concurrency as usize);
    for _ in 0..plan.concurrency {
        workers.push(tokio::spawn(worker(
            Arc::clone(&target),
            Arc::clone(&shared),
            plan,
        )));
    }

    let mut merged = WorkerResult::new()?;
    for w in workers {
        let r = w.await.map_err(|e| format!("a load worker failed: {e}"))?;
        merged.merge(r?)?;
    }
    let elapsed = shared.start.elapsed();
    ticker.abort();
    progress.finish_and_clear();

    Ok(PhaseResult {
        latency_ns: merged.hist,
        counts: merged.counts,
        elapsed,
        late: merged.late,
        first_error: merged.first_error.map(|(_, e)| e),
    })
}

/// State shared by the workers of a phase.
struct Shared {
    /// The next request number to hand out.
    next: AtomicU64,
    /// Finished requests (for the progress bar).
    done: AtomicU64,
    /// When the phase started.
    start: Instant,
}

/// What one worker collected.
struct WorkerResult {
    hist: Histogram<u64>,
    counts: Counts,
    late: u64,
    first_error: Option<(Instant, String)>,
}

impl WorkerResult {
    fn new() -> Result<Self, String> {
        Ok(Self {
            // Auto-resizing, 3 significant digits.
            hist: Histogram::new(3).map_err(|e| format!("cannot create histogram: {e}"))?,
            counts: Counts::default(),
            late: 0,
            first_error: None,
        })
    }

    fn merge(&mut self, o: WorkerResult) -> Result<(), String> {
        self.hist
            .add(&o.hist)
            .map_err(|e| format!("cannot merge histograms: {e}"))?;
        self.counts.add(&o.counts);
        self.late += o.late;
        self.first_error = match (self.first_error.take(), o.first_error) {
            (Some(a), Some(b)) => Some(if b.0 < a.0 { b } else { a }),
            (a, b) => a.or(b),
        };
        Ok(())
    }
}

async fn worker<T: Target>(
    target: Arc<T>,
    shared: Arc<Shared>,
    plan: Plan,
) -> Result<WorkerResult, String> {
    let mut res = WorkerResult::new()?;
    loop {
        let seq = shared.next.fetch_add(1, Ordering::Relaxed);
        let start = match plan.rate {
            None => {
                let now = Instant::now();
                if !within(plan.stop, seq, now.duration_since(shared.start)) {
                    break;
                }
                now
            }
            Some(rate) => {
                let offset = scheduled_offset(seq, rate);
                if !within(plan.stop, seq, offset) {
                    break;
                }
                let Some(due) = shared.start.checked_add(offset) else {
                    break;
                };
                let now = Instant::now();
                if due > now {
                    tokio::time::sleep_until(due.into()).await;
                    Instant::now()
                } else {
                    if now.duration_since(due) > LATE_THRESHOLD {
                        res.late += 1;
                    }
                    due
                }
            }
        };
        let outcome = match tokio::time::timeout(plan.timeout, target.call(seq)).await {
            Ok(o) => o,
            Err(_) => Outcome::Error(format!("timed out after {:?}", plan.timeout)),
        };
        let end = Instant::now();
        let ns = u64::try_from(end.duration_since(start).as_nanos()).unwrap_or(u64::MAX);
        // `record` grows the (auto-resizing) histogram; `saturating_record` would clamp.
        if res.hist.record(ns).is_err() {
            res.hist.saturating_record(ns);
        }
        match outcome {
            Outcome::Ok => res.counts.ok += 1,
            Outcome::OverLimit => res.counts.over_limit += 1,
            Outcome::Other => res.counts.other += 1,
            Outcome::Error(e) => {
                res.counts.errors += 1;
                if res.first_error.is_none() {
                    res.first_error = Some((end, e));
                }
            }
        }
        shared.done.fetch_add(1, Ordering::Relaxed);
    }
    Ok(res)
}

/// Updates the progress bar ten times a second until aborted.
async fn tick(shared: Arc<Shared>, stop: Stop, progress: ProgressBar) {
    let mut interval = tokio::time::interval(Duration::from_millis(100));
    loop {
        interval.tick().await;
        let done = shared.done.load(Ordering::Relaxed);
        let elapsed = shared.start.elapsed();
        match stop {
            Stop::Requests(_) => progress.set_position(done),
            Stop::Duration(_) => {
                progress.set_position(u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX))
            }
        }
        let secs = elapsed.as_secs_f64();
        if secs > 0.0 {
            progress.set_message(format!("{done} requests, {:.0}/s", done as f64 / secs));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pacing_schedule() {
        assert_eq!(scheduled_offset(0, 1000.0), Duration::ZERO);
        assert_eq!(scheduled_offset(1, 1000.0), Duration::from_millis(1));
        assert_eq!(scheduled_offset(2500, 1000.0), Duration::from_millis(2500));
        assert_eq!(scheduled_offset(3, 4.0), Duration::from_millis(750));
        // A 10 s run at 1000/s schedules exactly 10,000 requests (0..=9999).
        let stop = Stop::Duration(Duration::from_secs(10));
        let n = (0u64..20_000)
            .take_while(|&i| within(stop, i, scheduled_offset(i, 1000.0)))
            .count();
        assert_eq!(n, 10_000);
        // Fractional rates work too: 2.5/s for 2 s is 5 requests.
        let stop = Stop::Duration(Duration::from_secs(2));
        let n = (0u64..100)
            .take_while(|&i| within(stop, i, scheduled_offset(i, 2.5)))
            .count();
        assert_eq!(n, 5);
    }

    #[test]
    fn request_count_stop() {
        let stop = Stop::Requests(3);
        assert!(within(stop, 2, Duration::from_secs(1000)));
        assert!(!within(stop, 3, Duration::ZERO));
    }

    struct Fake;

    impl Target for Fake {
        async fn call(&self, seq: u64) -> Outcome {
            match seq % 4 {
                0 | 1 => Outcome::Ok,
                2 => Outcome::OverLimit,
                _ => Outcome::Error(format!("boom {seq}")),
            }
        }
    }

    #[tokio::test]
    async fn counts_a_fixed_number_of_requests() -> Result<(), String> {
        let plan = Plan {
            concurrency: 8,
            stop: Stop::Requests(1000),
            rate: None,
            timeout: Duration::from_secs(5),
        };
        let r = run(Arc::new(Fake), plan, ProgressBar::hidden()).await?;
        assert_eq!(
            r.counts,
            Counts {
                ok: 500,
                over_limit: 250,
                other: 0,
                errors: 250
            }
        );
        assert_eq!(r.latency_ns.len(), 1000);
        assert!(r.latency_ns.max() > 0);
        assert!(r.first_error.is_some_and(|e| e.starts_with("boom ")));
        Ok(())
    }

    #[tokio::test]
    async fn open_loop_keeps_the_rate() -> Result<(), String> {
        let plan = Plan {
            concurrency: 4,
            stop: Stop::Duration(Duration::from_millis(500)),
            rate: Some(200.0),
            timeout: Duration::from_secs(5),
        };
        let r = run(Arc::new(Fake), plan, ProgressBar::hidden()).await?;
        assert_eq!(r.counts.total(), 100);
        // The last request is due at 495 ms.
        assert!(r.elapsed >= Duration::from_millis(495), "{:?}", r.elapsed);
        assert_eq!(r.late, 0);
        Ok(())
    }
}
