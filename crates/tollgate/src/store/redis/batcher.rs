//! Batchers: on a single Redis, the requests waiting when a script call returns go
//! together in the next one (up to [`MAX_BATCH`]).
//!
//! A caller on a current-thread tokio runtime (each worker of `tollgate serve`, of
//! `tollgate proxy`, a `#[tokio::test]`) gets a batcher of that runtime, with its own
//! connection, started on first use: once that connection has answered a `PING` (until
//! then the shared batcher serves), the request, its script call, the reply and the
//! answer never leave the runtime's thread, so no wake-up crosses threads on the way. The
//! price: each runtime's calls are smaller, so Redis spends more per decision when it is
//! lightly loaded; the server spends less CPU per request and Redis a little more per
//! decision (docs/benchmarks.md, "Redis", has the figures).
//!
//! Other callers (a multi-threaded runtime) share one batcher and connection, started
//! with the store; so does everyone over TLS (redis-rs reads the system's certificate
//! store on every TLS connect, which would stall a worker's thread). Batchers are kept
//! per runtime, not per thread, so a thread that moves to another runtime gets that
//! runtime's batcher. A store holds its batchers' queues: when it is dropped, each
//! batcher stops, and closes its connection, the next time its runtime runs.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::runtime::{Handle, Id, RuntimeFlavor};
use tokio::sync::{mpsc, oneshot, Notify, Semaphore};

use super::call::{invoke_all, Request};
use super::client::{self, Connection};
use super::{script, RedisTls, Shared};
use crate::store::Error;

/// Most requests in one script call.
pub(super) const MAX_BATCH: usize = 128;
// The script's index names a request's argument in two bytes (`script::dedup`).
const _: () = assert!(MAX_BATCH <= script::MAX_ARGUMENTS);
/// Requests that may wait for a batcher; beyond, a request fails at once.
const QUEUE: usize = 65_536;

/// A request waiting in a batcher's queue.
pub(super) struct Job {
    pub request: Request,
    pub reply: oneshot::Sender<Result<Vec<i64>, Error>>,
}

/// Numbers the stores, naming their per-thread batchers.
static NEXT_STORE: AtomicU64 = AtomicU64::new(0);

/// How long a thread's new connection waits between tries while Redis does not answer.
const WARM_UP_RETRY: Duration = Duration::from_millis(250);

/// A batcher of a current-thread runtime, as a thread finds it.
struct ThreadBatcher {
    /// The store's number.
    store: u64,
    /// The runtime the batcher runs on.
    runtime: Id,
    /// Weak: a store's batchers end with the store, which holds their queues.
    queue: mpsc::WeakSender<Job>,
    /// Set once its connection has answered a `PING`; until then the runtime's requests
    /// go to the shared batcher, so none waits for a connection to be made.
    ready: Arc<Ready>,
}

/// A batcher of a current-thread runtime, as its store holds it.
#[derive(Clone)]
struct RuntimeBatcher {
    queue: mpsc::Sender<Job>,
    ready: Arc<Ready>,
}

/// Whether a runtime batcher's connection has answered a `PING`, and a way to wait
/// for it ([`Batchers::connect_this_runtime`]).
#[derive(Default)]
struct Ready {
    up: AtomicBool,
    notify: Notify,
}

impl Ready {
    fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    fn set_up(&self) {
        self.up.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }

    /// Returns once the connection is up.
    async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_up() {
                return;
            }
            notified.await;
        }
    }
}

thread_local! {
    /// The batchers this thread has used (a cache of the stores' maps).
    static THREAD_QUEUES: RefCell<Vec<ThreadBatcher>> = const { RefCell::new(Vec::new()) };
}

/// A single Redis's batchers: the shared one and one per current-thread runtime.
pub(super) struct Batchers {
    shared: Arc<Shared>,
    /// The shared batcher's queue.
    queue: mpsc::Sender<Job>,
    /// Where per-thread batchers connect; `None`: every caller uses the shared one.
    per_thread: Option<(String, Option<RedisTls>)>,
    in_flight: usize,
    /// This store's number, naming its batchers in the threads' caches.
    id: u64,
    /// The current-thread runtimes' batchers (the threads' entries are weak).
    runtimes: Mutex<HashMap<Id, RuntimeBatcher>>,
}

impl Batchers {
    /// Starts the shared batcher on `conn`. `per_thread`: the URL and TLS settings with
    /// which current-thread runtimes open their own connections, or `None` for none (a
    /// TLS URL counts as none: see the module documentation).
    pub fn start(
        shared: Arc<Shared>,
        conn: Connection,
        in_flight: usize,
        per_thread: Option<(String, Option<RedisTls>)>,
    ) -> Self {
        let (queue, rx) = mpsc::channel(QUEUE);
        tokio::spawn(batcher(rx, Arc::clone(&shared), conn, in_flight));
        Self {
            shared,
            queue,
            per_thread: per_thread.filter(|(url, _)| !client::is_tls_url(url)),
            in_flight,
            id: NEXT_STORE.fetch_add(1, Ordering::Relaxed),
            runtimes: Mutex::new(HashMap::new()),
        }
    }

    /// Hands `request` to this thread's batcher, or to the shared one, and waits for its
    /// answers.
    pub async fn send(&self, request: Request) -> Result<Vec<i64>, Error> {
        let queue = self.thread_queue().unwrap_or_else(|| self.queue.clone());
        let (reply, answer) = oneshot::channel();
        queue
            .try_send(Job { request, reply })
            .map_err(|_| Error::backend("too many requests wait for Redis"))?;
        answer
            .await
            .map_err(|_| Error::backend("the Redis batcher stopped"))?
    }

    /// The queue of this runtime's batcher when the caller runs on a current-thread
    /// runtime and that batcher's connection is up; `None` otherwise (the shared batcher
    /// serves). The first call on a runtime starts its batcher, which connects first.
    fn thread_queue(&self) -> Option<mpsc::Sender<Job>> {
        let (url, tls) = self.per_thread.as_ref()?;
        let handle = Handle::try_current().ok()?;
        if handle.runtime_flavor() != RuntimeFlavor::CurrentThread {
            return None;
        }
        let runtime = handle.id();
        let cached = THREAD_QUEUES.with(|q| {
            q.borrow()
                .iter()
                .find(|b| b.store == self.id && b.runtime == runtime)
                .and_then(|b| Some((b.queue.upgrade()?, b.ready.is_up())))
        });
        if let Some((tx, ready)) = cached.filter(|(tx, _)| !tx.is_closed()) {
            return ready.then_some(tx);
        }
        let batcher = self.runtime_batcher(&handle, url, tls.as_ref())?;
        batcher.ready.is_up().then_some(batcher.queue)
    }

    /// Starts this runtime's batcher and connection if the caller runs on a
    /// current-thread runtime (and connections are per runtime), and waits until that
    /// connection has answered a `PING`, so that the runtime's first requests use it
    /// rather than the shared one. False when the runtime has none (the shared batcher
    /// serves it). While Redis does not answer this waits (the connection tries again
    /// every 250 ms): bound it with a timeout.
    pub async fn connect_this_runtime(&self) -> bool {
        let Some((url, tls)) = self.per_thread.as_ref() else {
            return false;
        };
        let Ok(handle) = Handle::try_current() else {
            return false;
        };
        if handle.runtime_flavor() != RuntimeFlavor::CurrentThread {
            return false;
        }
        let Some(batcher) = self.runtime_batcher(&handle, url, tls.as_ref()) else {
            return false;
        };
        batcher.ready.wait().await;
        true
    }

    /// This current-thread runtime's batcher, started if it has none, and remembered in
    /// this thread's cache.
    fn runtime_batcher(
        &self,
        handle: &Handle,
        url: &str,
        tls: Option<&RedisTls>,
    ) -> Option<RuntimeBatcher> {
        let runtime = handle.id();
        let mut runtimes = self.runtimes.lock().ok()?;
        // Batchers whose runtime has ended.
        runtimes.retain(|_, b| !b.queue.is_closed());
        let batcher = match runtimes.get(&runtime) {
            Some(b) => b.clone(),
            None => {
                let b = self.start_runtime_batcher(handle, url, tls)?;
                runtimes.insert(runtime, b.clone());
                b
            }
        };
        drop(runtimes);
        THREAD_QUEUES.with(|q| {
            let mut q = q.borrow_mut();
            q.retain(|b| {
                !(b.store == self.id && b.runtime == runtime) && b.queue.strong_count() > 0
            });
            q.push(ThreadBatcher {
                store: self.id,
                runtime,
                queue: batcher.queue.downgrade(),
                ready: batcher.ready.clone(),
            });
        });
        Some(batcher)
    }

    /// Starts a batcher on `handle`'s runtime with a connection of its own, which it
    /// connects before it is used.
    fn start_runtime_batcher(
        &self,
        handle: &Handle,
        url: &str,
        tls: Option<&RedisTls>,
    ) -> Option<RuntimeBatcher> {
        let mut conn = match client::single(url, tls) {
            Ok(conn) => Connection::Single(conn),
            Err(e) => {
                tracing::warn!(error = %e, "cannot open a Redis connection for this runtime; using the shared one");
                return None;
            }
        };
        let (queue, rx) = mpsc::channel(QUEUE);
        let ready = Arc::new(Ready::default());
        let (shared, in_flight, up) = (Arc::clone(&self.shared), self.in_flight, ready.clone());
        handle.spawn(async move {
            if warm_up(&mut conn, &up, &rx).await {
                batcher(rx, shared, conn, in_flight).await;
            }
        });
        Some(RuntimeBatcher { queue, ready })
    }
}

/// Connects `conn` (a `PING`), trying again every [`WARM_UP_RETRY`] while Redis does not
/// answer, then sets `ready`. False if the store went away first (`queue` closed).
async fn warm_up(conn: &mut Connection, ready: &Ready, queue: &mpsc::Receiver<Job>) -> bool {
    loop {
        if redis::cmd("PING")
            .query_async::<redis::Value>(&mut *conn)
            .await
            .is_ok()
        {
            ready.set_up();
            return true;
        }
        if queue.is_closed() {
            return false;
        }
        tokio::time::sleep(WARM_UP_RETRY).await;
        if queue.is_closed() {
            return false;
        }
    }
}

/// Sends the requests in `queue` in batches, `in_flight` script calls at a time on
/// `conn`, until every sender is gone.
async fn batcher(
    mut queue: mpsc::Receiver<Job>,
    shared: Arc<Shared>,
    conn: Connection,
    in_flight: usize,
) {
    let slots = Arc::new(Semaphore::new(in_flight.max(1)));
    while let Some(first) = queue.recv().await {
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        // A request whose caller gave up (its deadline passed) is not sent: it was
        // answered by the failure policy and must not be charged now.
        let mut jobs: Vec<Job> = Vec::with_capacity(8);
        if !first.reply.is_closed() {
            jobs.push(first);
        }
        while jobs.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(job) if job.reply.is_closed() => {}
                Ok(job) => jobs.push(job),
                Err(_) => break,
            }
        }
        if jobs.is_empty() {
            continue;
        }
        if in_flight <= 1 {
            // One call at a time: make it here, without a task of its own.
            run_batch(&shared, &conn, jobs).await;
            drop(slot);
            continue;
        }
        let shared = Arc::clone(&shared);
        let conn = conn.clone();
        tokio::spawn(async move {
            run_batch(&shared, &conn, jobs).await;
            drop(slot);
        });
    }
}

/// One script call for a batch; every job gets its share of the answer (or the error).
async fn run_batch(shared: &Shared, conn: &Connection, jobs: Vec<Job>) {
    let requests: Vec<&Request> = jobs.iter().map(|j| &j.request).collect();
    match invoke_all(shared, conn, &requests).await {
        Ok(values) => {
            let mut rest = values.as_slice();
            for job in jobs {
                let n = (job.request.checks * 5).min(rest.len());
                let (mine, others) = rest.split_at(n);
                rest = others;
                let _ = job.reply.send(Ok(mine.to_vec()));
            }
        }
        Err(e) => {
            for job in jobs {
                let _ = job.reply.send(Err(again(&e)));
            }
        }
    }
}

/// The failure of a batch's call, for each request of the batch: the same message, and
/// the same Redis error as its source.
fn again(e: &Error) -> Error {
    match e {
        Error::Timeout(after) => Error::Timeout(*after),
        Error::CircuitOpen => Error::CircuitOpen,
        Error::Backend { message, source } => {
            match source
                .as_deref()
                .and_then(|s| s.downcast_ref::<redis::RedisError>())
            {
                Some(redis) => Error::backend_caused_by(message.clone(), redis.clone()),
                None => Error::backend(message.clone()),
            }
        }
    }
}
