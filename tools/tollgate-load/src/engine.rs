//! The load loop. Closed loop (no rate): `concurrency` worker tasks share a ticket
//! counter; each takes the next request number, sends it through a [`Target`], and
//! records the outcome and latency (from the actual send to the answer) in its own
//! HdrHistogram. The histograms and counters are merged when the phase ends.
//!
//! Open loop (`rate` R): request `i` is scheduled at `start + i/R`. There is one
//! dispatcher task per runtime thread, each with its own [`Ticker`] (a timer that
//! wakes it every [`crate::pacer::STEP`]); whenever woken (by its ticker or by an answer) it
//! claims the next due request numbers, each with a slot of the `concurrency` limit
//! (both shared by all dispatchers), and keeps its calls in flight in one task, so a
//! step costs one wake-up per dispatcher rather than one per request.
//! Latency is always measured from the request's scheduled time: when the in-flight
//! limit was reached (the server is behind), the queueing delay the server caused is counted
//! (no coordinated omission), and the ticker's own step (up to [`crate::pacer::STEP`]) is
//! counted too, so the figure errs on the high side.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt as _};
use hdrhistogram::Histogram;
use indicatif::ProgressBar;
use tokio::task::JoinSet;

use crate::cli::Stop;
use crate::pacer::Ticker;

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
    /// Maximum requests in flight (closed loop: one worker task each).
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
    /// Open loop only: requests dispatched more than 1 ms behind schedule, mostly
    /// because the in-flight limit was reached (a sign that `--concurrency` is too low
    /// for the rate or the server cannot keep up), or because a dispatcher was not run
    /// for a millisecond (an overloaded machine).
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
    let tasks = match plan.rate {
        None => plan.concurrency,
        // One dispatcher per runtime thread, each with at least one request in flight.
        Some(_) => (tokio::runtime::Handle::current().metrics().num_workers() as u32)
            .clamp(1, plan.concurrency.max(1)),
    };
    // The open loop's timers, made before anything is started (making one can fail).
    let tickers = match plan.rate {
        None => Vec::new(),
        Some(_) => (0..tasks)
            .map(|_| Ticker::new())
            .collect::<Result<Vec<_>, _>>()?,
    };
    let shared = Arc::new(Shared {
        next: AtomicU64::new(0),
        done: AtomicU64::new(0),
        start: Instant::now(),
    });
    let progress_task = tokio::spawn(tick(Arc::clone(&shared), plan.stop, progress.clone()));

    // Dropped (on an early return too), the set aborts the tasks still running.
    let mut set = JoinSet::new();
    match plan.rate {
        None => {
            for _ in 0..tasks {
                set.spawn(worker(Arc::clone(&target), Arc::clone(&shared), plan));
            }
        }
        Some(rate) => {
            let open = Arc::new(OpenLoop {
                rate,
                total: scheduled_requests(plan.stop, rate),
                limit: u64::from(plan.concurrency),
                in_flight: AtomicU64::new(0),
            });
            for ticker in tickers {
                set.spawn(dispatcher(
                    Arc::clone(&target),
                    Arc::clone(&shared),
                    Arc::clone(&open),
                    plan.timeout,
                    ticker,
                ));
            }
        }
    }

    let mut merged = WorkerResult::new()?;
    while let Some(r) = set.join_next().await {
        let r = r.map_err(|e| format!("a load task failed: {e}"))?;
        merged.merge(r?)?;
    }
    let elapsed = shared.start.elapsed();
    progress_task.abort();
    progress.finish_and_clear();

    Ok(PhaseResult {
        latency_ns: merged.hist,
        counts: merged.counts,
        elapsed,
        late: merged.late,
        first_error: merged.first_error.map(|(_, e)| e),
    })
}

/// State shared by the tasks of a phase.
struct Shared {
    /// The next request number to hand out.
    next: AtomicU64,
    /// Finished requests (for the progress bar).
    done: AtomicU64,
    /// When the phase started.
    start: Instant,
}

/// How many requests an open-loop phase schedules at `rate`.
fn scheduled_requests(stop: Stop, rate: f64) -> u64 {
    match stop {
        Stop::Requests(n) => n,
        Stop::Duration(d) => {
            // ceil(d * rate), then nudged so that it agrees with `within` exactly.
            let mut n = (d.as_secs_f64() * rate).ceil().min(u64::MAX as f64 / 2.0) as u64;
            while n > 0 && !within(stop, n - 1, scheduled_offset(n - 1, rate)) {
                n -= 1;
            }
            while within(stop, n, scheduled_offset(n, rate)) {
                n += 1;
            }
            n
        }
    }
}

/// What the open loop's dispatchers share besides [`Shared`].
struct OpenLoop {
    /// Requests per second.
    rate: f64,
    /// Requests scheduled in the phase.
    total: u64,
    /// The in-flight limit (`--concurrency`), over all dispatchers.
    limit: u64,
    /// Requests in flight, over all dispatchers.
    in_flight: AtomicU64,
}

impl OpenLoop {
    /// Takes a slot of the in-flight limit, if one is free.
    fn take_slot(&self) -> bool {
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.limit).then_some(n + 1)
            })
            .is_ok()
    }

    fn free_slot(&self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    /// Claims the next request number if it is due `elapsed` into the phase, with the
    /// moment it was due as an offset.
    fn claim_due(&self, next: &AtomicU64, elapsed: Duration) -> Option<(u64, Duration)> {
        let mut offset = Duration::ZERO;
        let seq = next
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |seq| {
                offset = scheduled_offset(seq, self.rate);
                (seq < self.total && offset <= elapsed).then_some(seq + 1)
            })
            .ok()?;
        Some((seq, offset))
    }

    /// Whether every scheduled request has been claimed.
    fn all_claimed(&self, next: &AtomicU64) -> bool {
        next.load(Ordering::Acquire) >= self.total
    }
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

    /// Counts one answered (or failed) request that was due, or started, at `start`.
    fn record(
        &mut self,
        outcome: Result<Outcome, tokio::time::error::Elapsed>,
        start: Instant,
        timeout: Duration,
    ) {
        let outcome =
            outcome.unwrap_or_else(|_| Outcome::Error(format!("timed out after {timeout:?}")));
        let end = Instant::now();
        let ns = u64::try_from(end.duration_since(start).as_nanos()).unwrap_or(u64::MAX);
        // `record` grows the (auto-resizing) histogram; `saturating_record` would clamp.
        if self.hist.record(ns).is_err() {
            self.hist.saturating_record(ns);
        }
        match outcome {
            Outcome::Ok => self.counts.ok += 1,
            Outcome::OverLimit => self.counts.over_limit += 1,
            Outcome::Other => self.counts.other += 1,
            Outcome::Error(e) => {
                self.counts.errors += 1;
                if self.first_error.is_none() {
                    self.first_error = Some((end, e));
                }
            }
        }
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

/// A closed-loop worker: sends the next request as soon as its last one is answered.
async fn worker<T: Target>(
    target: Arc<T>,
    shared: Arc<Shared>,
    plan: Plan,
) -> Result<WorkerResult, String> {
    let mut res = WorkerResult::new()?;
    loop {
        let seq = shared.next.fetch_add(1, Ordering::Relaxed);
        let start = Instant::now();
        if !within(plan.stop, seq, start.duration_since(shared.start)) {
            break;
        }
        let outcome = tokio::time::timeout(plan.timeout, target.call(seq)).await;
        res.record(outcome, start, plan.timeout);
        shared.done.fetch_add(1, Ordering::Relaxed);
    }
    Ok(res)
}

/// An open-loop dispatcher: whenever woken (by its ticker or by an answer), claims each
/// request that has come due while a slot of the in-flight limit is free, sends it,
/// and records the answers, all in one task.
async fn dispatcher<T: Target>(
    target: Arc<T>,
    shared: Arc<Shared>,
    open: Arc<OpenLoop>,
    timeout: Duration,
    mut ticker: Ticker,
) -> Result<WorkerResult, String> {
    let mut res = WorkerResult::new()?;
    let mut in_flight = FuturesUnordered::new();
    loop {
        let now = Instant::now();
        let elapsed = now.saturating_duration_since(shared.start);
        while open.take_slot() {
            let Some((seq, offset)) = open.claim_due(&shared.next, elapsed) else {
                open.free_slot();
                break;
            };
            let Some(due) = shared.start.checked_add(offset) else {
                open.free_slot();
                break;
            };
            if now.saturating_duration_since(due) > LATE_THRESHOLD {
                res.late += 1;
            }
            let call = tokio::time::timeout(timeout, target.call(seq));
            in_flight.push(async move { (call.await, due) });
        }
        let claimed = open.all_claimed(&shared.next);
        if claimed && in_flight.is_empty() {
            break;
        }
        tokio::select! {
            biased;
            Some((outcome, due)) = in_flight.next(), if !in_flight.is_empty() => {
                open.free_slot();
                res.record(outcome, due, timeout);
                shared.done.fetch_add(1, Ordering::Relaxed);
            }
            tick = ticker.tick(), if !claimed => tick?,
        }
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
    fn the_pacer_releases_exactly_the_scheduled_requests() {
        let ten_s = Stop::Duration(Duration::from_secs(10));
        assert_eq!(scheduled_requests(ten_s, 1000.0), 10_000);
        assert_eq!(
            scheduled_requests(Stop::Duration(Duration::from_secs(2)), 2.5),
            5
        );
        assert_eq!(scheduled_requests(Stop::Requests(7), 1e6), 7);
        // A rate that does not divide the duration: the count `within` gives.
        let odd = Stop::Duration(Duration::from_millis(1001));
        let n = (0u64..10_000)
            .take_while(|&i| within(odd, i, scheduled_offset(i, 333.0)))
            .count() as u64;
        assert_eq!(scheduled_requests(odd, 333.0), n);
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

    /// Answers after `delay`, counting the calls in flight and every request number.
    struct Slow {
        delay: Duration,
        in_flight: AtomicU64,
        peak: AtomicU64,
        seen: std::sync::Mutex<Vec<u64>>,
    }

    impl Slow {
        fn new(delay: Duration) -> Self {
            Self {
                delay,
                in_flight: AtomicU64::new(0),
                peak: AtomicU64::new(0),
                seen: std::sync::Mutex::new(Vec::new()),
            }
        }
    }

    impl Target for Slow {
        async fn call(&self, seq: u64) -> Outcome {
            let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            self.peak.fetch_max(now, Ordering::SeqCst);
            if let Ok(mut seen) = self.seen.lock() {
                seen.push(seq);
            }
            tokio::time::sleep(self.delay).await;
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            Outcome::Ok
        }
    }

    /// The open loop on two runtime threads (two dispatchers): every scheduled request
    /// is sent exactly once, and never more than `concurrency` at a time.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn open_loop_sends_each_request_once_within_the_concurrency() -> Result<(), String> {
        let target = Arc::new(Slow::new(Duration::from_millis(3)));
        let plan = Plan {
            concurrency: 5,
            stop: Stop::Duration(Duration::from_millis(300)),
            rate: Some(1000.0),
            timeout: Duration::from_secs(5),
        };
        let r = run(Arc::clone(&target), plan, ProgressBar::hidden()).await?;
        assert_eq!(r.counts.ok, 300);
        let mut seen = target.seen.lock().map_err(|e| e.to_string())?.clone();
        seen.sort_unstable();
        assert_eq!(seen, (0..300).collect::<Vec<u64>>());
        let peak = target.peak.load(Ordering::SeqCst);
        assert!((1..=5).contains(&peak), "{peak} in flight");
        Ok(())
    }

    /// 40 requests at 400/s to a server that answers in 20 ms, `concurrency` at a time.
    async fn slow_open_loop(concurrency: u32) -> Result<(Arc<Slow>, PhaseResult), String> {
        let target = Arc::new(Slow::new(Duration::from_millis(20)));
        let plan = Plan {
            concurrency,
            stop: Stop::Requests(40),
            rate: Some(400.0),
            timeout: Duration::from_secs(5),
        };
        let r = run(Arc::clone(&target), plan, ProgressBar::hidden()).await?;
        assert_eq!(r.counts.ok, 40);
        Ok((target, r))
    }

    /// More runtime threads than slots (three dispatchers sharing three slots) and a
    /// server slower than the rate: every slot is used, never more, and each request
    /// is sent exactly once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn dispatchers_share_one_in_flight_limit() -> Result<(), String> {
        let (target, r) = slow_open_loop(3).await?;
        let mut seen = target.seen.lock().map_err(|e| e.to_string())?.clone();
        seen.sort_unstable();
        assert_eq!(seen, (0..40).collect::<Vec<u64>>());
        assert_eq!(target.peak.load(Ordering::SeqCst), 3);
        assert!(r.late >= 20, "{} late", r.late);
        Ok(())
    }

    /// A server slower than the rate: requests wait for a free slot, are counted late,
    /// and their latency counts from when they were due, not from when they were sent.
    #[tokio::test]
    async fn open_loop_counts_the_wait_for_a_free_slot() -> Result<(), String> {
        let (target, r) = slow_open_loop(2).await?;
        assert!(target.peak.load(Ordering::SeqCst) <= 2);
        // Two at a time, 20 ms each: the last is sent at least 380 ms after the start,
        // though due at 97.5 ms.
        assert!(r.late >= 30, "{} late", r.late);
        assert!(
            r.latency_ns.max() >= 250_000_000,
            "max latency {} ns",
            r.latency_ns.max()
        );
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
        // The last request is due at 495 ms: not sent in a burst, not dawdling (the
        // upper bound only catches a pacer far too slow; `late` catches the rest).
        assert!(r.elapsed >= Duration::from_millis(495), "{:?}", r.elapsed);
        assert!(r.elapsed < Duration::from_secs(2), "{:?}", r.elapsed);
        // Nothing here is slow, so nothing should be sent a millisecond behind
        // schedule, but a busy machine (another test burning CPU beside this one) can
        // hold a thread back that long now and then. A pacer that falls behind stays
        // behind: at half the rate, 99 of the 100 would be late.
        assert!(r.late <= 60, "{} requests late", r.late);
        Ok(())
    }
}
