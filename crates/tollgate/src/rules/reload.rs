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
/// atomically. A failed reload leaves the old set serving and is counted and kept in
/// [`last_error`](Self::last_error). Counters live in the store keyed by each limit's
/// identity, so they survive a reload that changes only a rule's numbers.
///
/// Whoever serves the rules can prepare for a new set before it is swapped in
/// ([`before_swap`](Self::before_swap)): `tollgate serve` loads the Redis scripts the new
/// rules need, so that their first requests find them loaded.
pub struct Rules {
    current: ArcSwap<RuleSet>,
    before_swap: Mutex<Option<Arc<BeforeSwap>>>,
    paths: Vec<PathBuf>,
    options: LoadOptions,
    loaded_digest: AtomicU64,
    successes: AtomicU64,
    failures: AtomicU64,
    last_error: Mutex<Option<ConfigErrors>>,
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
        let set = load(&paths, options)?;
        let rules = Self::fixed(set);
        let rules = Self {
            paths,
            options,
            ..rules
        };
        rules.loaded_digest.store(rules.digest(), Ordering::Relaxed);
        Ok(rules)
    }

    /// A fixed rule set that [`reload`](Self::reload) never changes (no paths).
    pub fn fixed(set: RuleSet) -> Self {
        Self {
            current: ArcSwap::from_pointee(set),
            before_swap: Mutex::new(None),
            paths: Vec::new(),
            options: LoadOptions::default(),
            loaded_digest: AtomicU64::new(0),
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
    /// set keeps serving and the error is returned (and kept in `last_error`).
    pub fn reload(&self) -> Result<ReloadOutcome, ConfigErrors> {
        let digest = self.digest();
        if digest == self.loaded_digest.load(Ordering::Relaxed) && self.last_error.lock().is_none()
        {
            return Ok(ReloadOutcome::Unchanged);
        }
        match load(&self.paths, self.options) {
            Ok(set) => {
                let (domains, rules) = summary(&set);
                let hook = self.before_swap.lock().clone();
                if let Some(hook) = hook {
                    hook(&set);
                }
                self.current.store(Arc::new(set));
                self.loaded_digest.store(digest, Ordering::Relaxed);
                self.successes.fetch_add(1, Ordering::Relaxed);
                *self.last_error.lock() = None;
                tracing::info!(domains, rules, "rules reloaded");
                Ok(ReloadOutcome::Reloaded)
            }
            Err(errors) => {
                self.failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(errors = %errors, "rules not reloaded: the old rules keep serving");
                *self.last_error.lock() = Some(errors.clone());
                self.loaded_digest.store(digest, Ordering::Relaxed);
                Err(errors)
            }
        }
    }

    /// Successful loads so far (the first load counts).
    pub fn load_successes(&self) -> u64 {
        self.successes.load(Ordering::Relaxed)
    }

    /// Failed reloads so far.
    pub fn load_failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// The errors of the last reload, if it failed and none has succeeded since.
    pub fn last_error(&self) -> Option<ConfigErrors> {
        self.last_error.lock().clone()
    }

    /// A hash of the rule files' names and contents, to skip reloads that change nothing.
    fn digest(&self) -> u64 {
        let mut h = DefaultHasher::new();
        for file in rule_files(&self.paths, &mut Vec::new()) {
            file.hash(&mut h);
            std::fs::read(&file).unwrap_or_default().hash(&mut h);
        }
        h.finish()
    }
}

/// (domains, rules) in a set, for logs and summaries.
pub fn summary(set: &RuleSet) -> (usize, usize) {
    let domains = set.domains();
    (domains.len(), domains.iter().map(|d| d.rule_count()).sum())
}
