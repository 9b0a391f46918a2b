//! Warming the Redis store up, so that an instance that says it is ready decides in
//! Redis from its first request:
//!
//! - at start, before the listeners accept calls and before `/readyz` answers 200,
//!   every worker makes its own Redis connection on its own runtime
//!   ([`RedisStore::connect_this_runtime`]), and the scripts of every algorithm set
//!   the rules can call are loaded ([`RedisStore::script_sets`],
//!   [`RedisStore::load_scripts`]), at most `--redis-warm-up-timeout`;
//! - on a rule reload, the new rules' scripts are loaded before they are swapped in
//!   (a [`Rules::before_swap`] hook), as long at most;
//! - when Redis is not reachable in time, the instance serves anyway (each rule's
//!   failure mode answers while Redis is down), and loads in the background, every
//!   second, until it succeeds; the workers' connections keep trying on their own and
//!   are used as soon as they answer.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tollgate::rules::{RuleSet, Rules};
use tollgate::store::{Loaded, RedisStore, ScriptSet};
use tracing::{debug, info, warn};

/// How often a warm-up that failed is tried again in the background.
const RETRY_EVERY: Duration = Duration::from_secs(1);

/// Loads the scripts the rules in force need, at start, before each reload's swap and
/// in the background after a failure.
pub(crate) struct Warmer {
    store: Arc<RedisStore>,
    /// Weak: the rules hold this warmer in their hook.
    rules: Weak<Rules>,
    timeout: Duration,
    /// The runtime the loads run on (the main, multi-threaded one): a reload's hook runs
    /// on a thread of its own and waits for it.
    handle: Handle,
    /// Sets a failed warm-up could not load (a reload's, while Redis was down): the
    /// background retry loads them with the current rules' sets.
    pending: Mutex<Vec<ScriptSet>>,
    /// A background retry is running.
    retrying: AtomicBool,
}

impl Warmer {
    /// A warmer of `store` for `rules`, waiting at most `timeout` before serving or
    /// swapping rules in, with its loads on the current runtime; its hook is installed
    /// on `rules`, so that every reload loads the new sets before the swap.
    pub fn install(store: Arc<RedisStore>, rules: &Arc<Rules>, timeout: Duration) -> Arc<Self> {
        let warmer = Arc::new(Self {
            store,
            rules: Arc::downgrade(rules),
            timeout,
            handle: Handle::current(),
            pending: Mutex::new(Vec::new()),
            retrying: AtomicBool::new(false),
        });
        let hook = Arc::clone(&warmer);
        rules.before_swap(move |set| hook.before_swap(set));
        warmer
    }

    /// The start-up warm-up: loads the scripts of the rules in force while `workers`
    /// (each worker's own warm-up, see [`worker`]) completes, for at most the timeout.
    /// True when both were done in time; otherwise logs it and goes on loading in the
    /// background (the caller serves anyway).
    pub async fn start(
        self: &Arc<Self>,
        workers: impl std::future::Future<Output = usize>,
    ) -> bool {
        let started = Instant::now();
        let Some(rules) = self.rules.upgrade() else {
            return false;
        };
        let set = rules.current();
        // The load's error, kept for the timeout's warning: a load that fails (Redis
        // refused the connection) still waits for the workers, whose connections keep
        // trying until the timeout.
        let failed = Mutex::new(None::<String>);
        let load = async {
            let loaded = self.load(&set).await;
            if let (Err(e), Ok(mut f)) = (&loaded, failed.lock()) {
                *f = Some(e.to_string());
            }
            loaded
        };
        let both = async { tokio::join!(load, workers) };
        match tokio::time::timeout(self.timeout, both).await {
            Ok((Ok(loaded), connected)) => {
                info!(
                    script_sets = loaded.sets,
                    loaded_now = loaded.new,
                    functions = loaded.functions,
                    worker_connections = connected,
                    elapsed = %crate::HumanDuration(started.elapsed()),
                    "Redis warm: connections made and scripts loaded"
                );
                true
            }
            Ok((Err(e), _)) => {
                warn!(error = %e, "Redis warm-up failed: serving anyway (each rule's failure_mode answers while Redis fails); warming up in the background");
                self.retry_in_background();
                false
            }
            Err(_) => {
                let cause = failed.lock().ok().and_then(|mut f| f.take());
                let timeout = crate::HumanDuration(self.timeout);
                match cause {
                    Some(e) => {
                        warn!(timeout = %timeout, error = %e, "Redis not warm within --redis-warm-up-timeout: serving anyway (each rule's failure_mode answers while Redis is unreachable); warming up in the background")
                    }
                    None => {
                        warn!(timeout = %timeout, "Redis not warm within --redis-warm-up-timeout (no answer yet): serving anyway (each rule's failure_mode answers while Redis is unreachable); warming up in the background")
                    }
                }
                self.retry_in_background();
                false
            }
        }
    }

    /// The reload hook: loads `set`'s scripts before it is swapped in, waiting at most
    /// the timeout (the old rules serve meanwhile). Past it, or on a failure, the new
    /// rules are swapped in anyway and their scripts loaded in the background.
    fn before_swap(self: &Arc<Self>, set: &RuleSet) {
        let sets = RedisStore::script_sets(set);
        let (tx, rx) = std::sync::mpsc::channel();
        let warmer = Arc::clone(self);
        let wanted = sets.clone();
        self.handle.spawn(async move {
            let _ = tx.send(warmer.load_sets(wanted).await);
        });
        match rx.recv_timeout(self.timeout) {
            Ok(Ok(loaded)) => info!(
                script_sets = loaded.sets,
                loaded_now = loaded.new,
                "scripts of the new rules loaded into Redis"
            ),
            Ok(Err(e)) => {
                warn!(error = %e, "cannot load the new rules' scripts into Redis; swapping them in, loading in the background");
                self.defer(sets);
            }
            Err(_) => {
                warn!(timeout = %crate::HumanDuration(self.timeout), "the new rules' scripts not loaded into Redis within --redis-warm-up-timeout; swapping them in, loading in the background");
                self.defer(sets);
            }
        }
    }

    /// Loads the scripts `set` needs, and those left pending.
    async fn load(&self, set: &RuleSet) -> Result<Loaded, tollgate::store::Error> {
        self.load_sets(RedisStore::script_sets(set)).await
    }

    /// Loads `sets` and those left pending; on success none is pending any more.
    async fn load_sets(&self, mut sets: Vec<ScriptSet>) -> Result<Loaded, tollgate::store::Error> {
        let pending = self.pending.lock().map(|p| p.clone()).unwrap_or_default();
        sets.extend(pending.iter().copied());
        sets.sort_by_key(|s| (s.names().len(), *s));
        sets.dedup();
        let loaded = self.store.load_scripts(&sets).await?;
        if let Ok(mut p) = self.pending.lock() {
            p.retain(|s| !pending.contains(s));
        }
        Ok(loaded)
    }

    /// Keeps `sets` to load in the background.
    fn defer(self: &Arc<Self>, sets: Vec<ScriptSet>) {
        if let Ok(mut p) = self.pending.lock() {
            p.extend(sets);
        }
        self.retry_in_background();
    }

    /// Tries the warm-up again every [`RETRY_EVERY`] until it succeeds (one such loop at
    /// a time), with the rules in force at each try.
    fn retry_in_background(self: &Arc<Self>) {
        if self.retrying.swap(true, Ordering::AcqRel) {
            return;
        }
        let warmer = Arc::clone(self);
        self.handle.spawn(async move {
            loop {
                tokio::time::sleep(RETRY_EVERY).await;
                let Some(rules) = warmer.rules.upgrade() else {
                    break;
                };
                match warmer.load(&rules.current()).await {
                    Ok(loaded) => {
                        info!(
                            script_sets = loaded.sets,
                            loaded_now = loaded.new,
                            "Redis answers again: scripts loaded"
                        );
                        break;
                    }
                    Err(e) => debug!(error = %e, "Redis warm-up: not yet"),
                }
            }
            warmer.retrying.store(false, Ordering::Release);
        });
    }
}

/// A worker's warm-up, run on its own runtime before it serves: makes its Redis
/// connection and waits (at most `timeout`) until it answers. True when the worker has
/// a connection of its own that answered; false when it has none (memory, a cluster,
/// TLS, `--redis-shared-connection`) or Redis did not answer in time (the connection
/// keeps trying, and is used once it answers).
pub(crate) async fn worker(store: Option<Arc<RedisStore>>, timeout: Duration) -> bool {
    let Some(store) = store else {
        return false;
    };
    tokio::time::timeout(timeout, store.connect_this_runtime())
        .await
        .unwrap_or(false)
}

/// The number of workers whose own connection answered, once all `workers` have
/// reported their warm-up ([`worker`]'s result) on `reports`.
pub(crate) async fn reported(mut reports: mpsc::UnboundedReceiver<bool>, workers: usize) -> usize {
    let mut connected = 0;
    for _ in 0..workers {
        match reports.recv().await {
            Some(up) => connected += usize::from(up),
            None => break,
        }
    }
    connected
}
