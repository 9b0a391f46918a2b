//! [`Rules`]: the rule set in force, swapped atomically on reload.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
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
pub struct Rules {
    current: ArcSwap<RuleSet>,
    before_swap: Mutex<Option<Arc<BeforeSwap>>>,
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
    /// The files of the set in force.
    loaded: u64,
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
    /// Loads the rules from `paths` (files or directories).
    pub fn load(paths: Vec<PathBuf>, options: LoadOptions) -> Result<Self, ConfigErrors> {
        // Digest first: a file changed while loading makes the next reload load it.
        let loaded = digest(&paths);
        let set = load(&paths, options)?;
        let rules = Self::fixed(set);
        Ok(Self {
            paths,
            options,
            seen: Mutex::new(Seen {
                loaded,
                failed: None,
            }),
            ..rules
        })
    }

    /// A fixed rule set that [`reload`](Self::reload) never changes (no paths).
    pub fn fixed(set: RuleSet) -> Self {
        Self {
            current: ArcSwap::from_pointee(set),
            before_swap: Mutex::new(None),
            paths: Vec::new(),
            options: LoadOptions::default(),
            seen: Mutex::new(Seen::default()),
            attempts: AtomicU64::new(0),
            successes: AtomicU64::new(1),
            failures: AtomicU64::new(0),
            last_error: Mutex::new(None),
        }
    }

    /// The rule set in force.
    pub fn current(&self) -> Arc<RuleSet> {
        self.current.load_full()
    }

    /// Runs `hook` with every new rule set that [`reload`](Self::reload) loads and
    /// validates, before that set replaces the one in force (a reload that fails or
    /// finds the files unchanged does not call it). The hook runs on the thread that
    /// calls `reload` (the file watcher's, the SIGHUP thread, a blocking task) and may
    /// block it: the old set serves until the hook returns. For example, a store can
    /// prepare what the new limits need (the server loads the Redis scripts of their
    /// algorithms), so that the first requests under the new rules find it ready. One
    /// hook at a time: setting another replaces it.
    pub fn before_swap(&self, hook: impl Fn(&RuleSet) + Send + Sync + 'static) {
        *self.before_swap.lock() = Some(Arc::new(hook));
    }

    /// The paths the rules are loaded from.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// Reads the files again and swaps in the new set if it is valid. On error the old
    /// set keeps serving and the errors are returned (and kept in `last_error`).
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
        if digest == seen.loaded {
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
                let hook = self.before_swap.lock().clone();
                if let Some(hook) = hook {
                    hook(&set);
                }
                self.current.store(Arc::new(set));
                *seen = Seen {
                    loaded: digest,
                    failed: None,
                };
                self.successes.fetch_add(1, Ordering::Relaxed);
                *self.last_error.lock() = None;
                tracing::info!(domains, rules, "rules reloaded");
                Ok(ReloadOutcome::Reloaded)
            }
            Err(errors) => {
                self.failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(errors = %errors, "rules not reloaded: the old rules keep serving");
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

    /// Successful loads so far (the first load counts).
    pub fn load_successes(&self) -> u64 {
        self.successes.load(Ordering::Relaxed)
    }

    /// Failed reloads so far: each failing set of files counts once.
    pub fn load_failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// The errors of the last reload, if it failed and none has succeeded since.
    pub fn last_error(&self) -> Option<ConfigErrors> {
        self.last_error.lock().clone()
    }
}

/// A hash of the rule files' names and contents, to skip reloads that change nothing.
/// A file that cannot be read counts as empty (the load reports why).
fn digest(paths: &[PathBuf]) -> u64 {
    let mut h = DefaultHasher::new();
    for file in rule_files(paths, &mut Vec::new()) {
        file.hash(&mut h);
        std::fs::read(&file).unwrap_or_default().hash(&mut h);
    }
    h.finish()
}

/// (domains, rules) in a set, for logs and summaries.
pub fn summary(set: &RuleSet) -> (usize, usize) {
    let domains = set.domains();
    (domains.len(), domains.iter().map(|d| d.rule_count()).sum())
}
