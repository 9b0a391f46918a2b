//! [`Rules`]: the rule set in force, swapped atomically on reload.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use super::error::ConfigErrors;
use super::load::{load, rule_files, LoadOptions};
use super::tree::RuleSet;

/// The rule set in force, and how to load the next one.
///
/// Readers call [`current`](Self::current) (a lock-free pointer load) once per request
/// and keep that set for the whole request. [`reload`](Self::reload) parses and
/// validates every file; only a set without a single error replaces the current one,
/// atomically. A failed reload leaves the old set serving and is counted, logged and
/// kept in [`last_error`](Self::last_error), once per failing set of files. Counters
/// live in the store keyed by each limit's identity, so they survive a reload that
/// changes only a rule's numbers.
///
/// Whoever serves the rules can prepare for a new set before it is swapped in
/// ([`before_swap`](Self::before_swap)): `tollgate serve` loads the Redis scripts the new
/// rules need, so that their first requests find them loaded.
///
/// Rules made by [`load_or_wait`](Self::load_or_wait) may start with no set loaded
/// (their files invalid or missing): [`is_loaded`](Self::is_loaded) says so until a
/// reload succeeds.
pub struct Rules {
    current: ArcSwap<RuleSet>,
    /// A set from the files is in force (false only while `load_or_wait`'s first load
    /// has not succeeded yet).
    loaded: AtomicBool,
    before_swap: Mutex<Vec<Arc<BeforeSwap>>>,
    paths: Vec<PathBuf>,
    options: LoadOptions,
    /// What the files looked like at the last reload; held through a reload, so that
    /// reloads (watcher, SIGHUP, `POST /reload`) run one at a time.
    seen: Mutex<Seen>,
    attempts: AtomicU64,
    successes: AtomicU64,
    failures: AtomicU64,
    last_error: Mutex<Option<ConfigErrors>>,
}

/// Digests of the rule files' names and bytes.
#[derive(Debug, Default)]
struct Seen {
    /// The files of the set in force (`None` while none is loaded).
    loaded: Option<u64>,
    /// The files of the last set that failed, if none has loaded since.
    failed: Option<u64>,
}

/// A hook run with each new, valid rule set before it replaces the one in force (see
/// [`Rules::before_swap`]).
pub type BeforeSwap = dyn Fn(&RuleSet) + Send + Sync;

/// What happened on a reload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReloadOutcome {
    /// A new rule set is in force.
    Reloaded,
    /// The files are byte for byte what is already loaded; nothing changed.
    Unchanged,
}

impl Rules {
    /// Loads the rules from `paths` (files or directories); `Err` with every problem
    /// when they are invalid or a path does not exist.
    pub fn load(paths: Vec<PathBuf>, options: LoadOptions) -> Result<Self, ConfigErrors> {
        let mut rules = Self::load_or_wait(paths, options);
        match rules.last_error.get_mut().take() {
            None => Ok(rules),
            Some(errors) => Err(errors),
        }
    }

    /// Loads the rules from `paths` as [`load`](Self::load) does, but keeps going when
    /// they are invalid (or a path does not exist): then no set is loaded
    /// ([`is_loaded`](Self::is_loaded) is false and [`current`](Self::current) is an
    /// empty set), the errors are kept in [`last_error`](Self::last_error) and counted
    /// in [`load_failures`](Self::load_failures), and the first [`reload`](Self::reload)
    /// that finds valid files loads them (the file watcher and SIGHUP call it). A
    /// service can so start with a broken rule file, say it is not ready, and serve as
    /// soon as the file is fixed, instead of exiting.
    ///
    /// A [`Limiter`](crate::limiter::Limiter) over rules not loaded decides by the
    /// empty set (every descriptor `OK`, unlimited): ask `is_loaded` before deciding,
    /// as `tollgate serve` does (it answers "no rate limit configuration loaded").
    pub fn load_or_wait(paths: Vec<PathBuf>, options: LoadOptions) -> Self {
        // Digest first: a file changed while loading makes the next reload load it.
        let digest = digest(&paths);
        let (set, seen, error) = match load(&paths, options) {
            Ok(set) => (
                set,
                Seen {
                    loaded: Some(digest),
                    failed: None,
                },
                None,
            ),
            Err(errors) => (
                RuleSet::default(),
                Seen {
                    loaded: None,
                    failed: Some(digest),
                },
                Some(errors),
            ),
        };
        let loaded = error.is_none();
        Self {
            loaded: AtomicBool::new(loaded),
            paths,
            options,
            seen: Mutex::new(seen),
            successes: AtomicU64::new(u64::from(loaded)),
            failures: AtomicU64::new(u64::from(!loaded)),
            last_error: Mutex::new(error),
            ..Self::fixed(set)
        }
    }

    /// A fixed rule set that [`reload`](Self::reload) never changes (no paths).
    pub fn fixed(set: RuleSet) -> Self {
        Self {
            current: ArcSwap::from_pointee(set),
            loaded: AtomicBool::new(true),
            before_swap: Mutex::new(Vec::new()),
            paths: Vec::new(),
            options: LoadOptions::default(),
            seen: Mutex::new(Seen::default()),
            attempts: AtomicU64::new(0),
            successes: AtomicU64::new(1),
            failures: AtomicU64::new(0),
            last_error: Mutex::new(None),
        }
    }

    /// The rule set in force (an empty one while none [`is_loaded`](Self::is_loaded)).
    pub fn current(&self) -> Arc<RuleSet> {
        self.current.load_full()
    }

    /// Whether a rule set from the files is in force: always, except for rules made by
    /// [`load_or_wait`](Self::load_or_wait) whose files have not loaded yet.
    pub fn is_loaded(&self) -> bool {
        self.loaded.load(Ordering::Acquire)
    }

    /// Runs `hook` with every new rule set that [`reload`](Self::reload) loads and
    /// validates, before that set replaces the one in force (a reload that fails or
    /// finds the files unchanged does not call it). The hook runs on the thread that
    /// calls `reload` (the file watcher's, the SIGHUP thread, `POST /reload`'s) and may
    /// block it: the old set serves until the hook returns. For example, a store can
    /// prepare what the new limits need (the server loads the Redis scripts of their
    /// algorithms), so that the first requests under the new rules find it ready.
    /// Several hooks run in the order they were added (the server adds one per Redis
    /// store: the region's and the global one).
    pub fn before_swap(&self, hook: impl Fn(&RuleSet) + Send + Sync + 'static) {
        self.before_swap.lock().push(Arc::new(hook));
    }

    /// The paths the rules are loaded from.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// Reads the files again and swaps in the new set if it is valid. On error the old
    /// set keeps serving and the errors are returned (and kept in `last_error`). Call it
    /// on a thread made by [`reload_thread`], whose stack is known to suffice.
    ///
    /// Files byte for byte those of the set in force: [`ReloadOutcome::Unchanged`].
    /// Files byte for byte those that failed last time: the kept errors again, neither
    /// counted nor logged a second time (a set that fails is reported once, however
    /// often it is asked for). Anything else is parsed and validated.
    pub fn reload(&self) -> Result<ReloadOutcome, ConfigErrors> {
        if self.paths.is_empty() {
            return Ok(ReloadOutcome::Unchanged);
        }
        let mut seen = self.seen.lock();
        self.attempts.fetch_add(1, Ordering::Relaxed);
        let digest = digest(&self.paths);
        if Some(digest) == seen.loaded {
            seen.failed = None;
            if self.last_error.lock().take().is_some() {
                tracing::info!("the rule files are back to the rules in force");
            }
            return Ok(ReloadOutcome::Unchanged);
        }
        if seen.failed == Some(digest) {
            if let Some(errors) = self.last_error() {
                tracing::debug!("rules still not reloaded: the files have not changed");
                return Err(errors);
            }
        }
        match load(&self.paths, self.options) {
            Ok(set) => {
                let (domains, rules) = summary(&set);
                let hooks = self.before_swap.lock().clone();
                for hook in hooks {
                    hook(&set);
                }
                self.current.store(Arc::new(set));
                let first = !self.loaded.swap(true, Ordering::AcqRel);
                *seen = Seen {
                    loaded: Some(digest),
                    failed: None,
                };
                self.successes.fetch_add(1, Ordering::Relaxed);
                *self.last_error.lock() = None;
                if first {
                    tracing::info!(domains, rules, "rules loaded: the first valid rules");
                } else {
                    tracing::info!(domains, rules, "rules reloaded");
                }
                Ok(ReloadOutcome::Reloaded)
            }
            Err(errors) => {
                self.failures.fetch_add(1, Ordering::Relaxed);
                if self.is_loaded() {
                    tracing::error!(errors = %errors, "rules not reloaded: the old rules keep serving");
                } else {
                    tracing::error!(errors = %errors, "rules not loaded: still no rules in force");
                }
                *self.last_error.lock() = Some(errors.clone());
                seen.failed = Some(digest);
                Err(errors)
            }
        }
    }

    /// Reloads asked for so far (by the file watcher, SIGHUP or a caller), whatever
    /// their outcome; each reads every rule file. Rules whose files do not change are
    /// asked for none by the watcher.
    pub fn reload_attempts(&self) -> u64 {
        self.attempts.load(Ordering::Relaxed)
    }

    /// Successful loads so far (the first load counts, when it succeeded).
    pub fn load_successes(&self) -> u64 {
        self.successes.load(Ordering::Relaxed)
    }

    /// Failed loads so far (a failed first load of [`load_or_wait`](Self::load_or_wait)
    /// included): each failing set of files counts once.
    pub fn load_failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// The errors of the last reload, if it failed and none has succeeded since.
    pub fn last_error(&self) -> Option<ConfigErrors> {
        self.last_error.lock().clone()
    }
}

/// A hash of the rule files' names and contents, to skip reloads that change nothing.
/// A file that cannot be read counts as empty (the load reports why). Whether each
/// path exists counts too: a missing directory that appears empty is a change.
fn digest(paths: &[PathBuf]) -> u64 {
    let mut h = DefaultHasher::new();
    for path in paths {
        (path.exists(), path.is_dir()).hash(&mut h);
    }
    for file in rule_files(paths, &mut Vec::new()) {
        file.hash(&mut h);
        std::fs::read(&file).unwrap_or_default().hash(&mut h);
    }
    h.finish()
}

/// The stack of every thread that reads rule files: the file watcher's, the SIGHUP
/// thread's and `tollgate serve`'s `POST /reload`. The depth caps keep reading a file
/// within 2 MiB; this is twice that, and set explicitly, so that neither a platform's
/// default nor `RUST_MIN_STACK` (which lowers the default of every thread that does not
/// set its own, tokio's included) can make a deep file overflow a reload's stack.
pub const RELOAD_STACK_SIZE: usize = 4 << 20;

/// A thread builder named `name` with a [`RELOAD_STACK_SIZE`] stack: spawn whatever
/// calls [`Rules::reload`] (or loads rule files) on it, rather than on a thread whose
/// stack is not known (a tokio worker, a `spawn_blocking` task).
pub fn reload_thread(name: &str) -> std::thread::Builder {
    std::thread::Builder::new()
        .name(name.to_string())
        .stack_size(RELOAD_STACK_SIZE)
}

/// (domains, rules) in a set, for logs and summaries.
pub fn summary(set: &RuleSet) -> (usize, usize) {
    let domains = set.domains();
    (domains.len(), domains.iter().map(|d| d.rule_count()).sum())
}
