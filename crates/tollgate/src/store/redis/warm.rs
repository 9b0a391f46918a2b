//! Warming a store up before it serves: which script sets a rule set can call, loading
//! them into Redis, and telling a failure of Redis from a load or a first connection in
//! progress (which the circuit breaker must not count).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::client::Connection;
use super::functions::{functions_unusable, give_up_functions, library_refused};
use super::script::Encoded;
use super::{Shared, SCRIPT_ALGORITHMS};
use crate::algorithm::Limit;
use crate::rules::RuleSet;
use crate::store::Error;

/// A set of algorithms whose script one call runs: the store calls the script of the
/// algorithms of every check in the call (see [`RedisStore::script_sets`](super::RedisStore::script_sets)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScriptSet(u8);

impl ScriptSet {
    /// The set of the algorithms of `limits` (empty for none, or for limits the
    /// scripts cannot compute, which the store refuses without calling Redis).
    pub fn of<'a>(limits: impl IntoIterator<Item = &'a Limit>) -> Self {
        let mask = limits
            .into_iter()
            .filter_map(|l| Encoded::new(l).ok())
            .fold(0u8, |m, e| m | 1 << (e.alg - 1));
        Self(mask)
    }

    /// The algorithms' names, as rule files write them, in the scripts' order.
    pub fn names(&self) -> Vec<&'static str> {
        SCRIPT_ALGORITHMS
            .iter()
            .enumerate()
            .filter(|(i, _)| self.0 & (1 << i) != 0)
            .map(|(_, n)| *n)
            .collect()
    }

    /// True for the set of no algorithm.
    pub fn is_empty(&self) -> bool {
        self.0 == 0
    }

    /// The algorithm codes' bits, as `script.rs` numbers them.
    pub(super) fn mask(self) -> u8 {
        self.0
    }
}

/// Every non-empty subset of the algorithms `set`'s limits use, fewest algorithms first.
/// See [`RedisStore::script_sets`](super::RedisStore::script_sets) for why every subset.
pub(super) fn script_sets(set: &RuleSet) -> Vec<ScriptSet> {
    let used = ScriptSet::of(
        set.domains()
            .into_iter()
            .flat_map(|d| d.rules())
            .flat_map(|r| &r.limits)
            .map(|l| &l.limit),
    )
    .0;
    let mut sets: Vec<ScriptSet> = (1..64u8)
        .filter(|m| m & !used == 0)
        .map(ScriptSet)
        .collect();
    sets.sort_by_key(|s| (s.0.count_ones(), s.0));
    sets
}

/// What [`RedisStore::load_scripts`](super::RedisStore::load_scripts) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Loaded {
    /// Script sets loaded, or found already loaded.
    pub sets: usize,
    /// Of those, the ones this call loaded (the others were in Redis already).
    pub new: usize,
    /// True when they are function libraries (`FCALL`), false for `EVALSHA` scripts.
    pub functions: bool,
}

/// Script loads and first connections in progress. A request that misses its deadline
/// while one is in progress (or that waited across one) was held up by the load or the
/// connection, not failed by Redis: it does not feed the circuit breaker.
#[derive(Debug, Default)]
pub(super) struct Warming {
    /// How many are in progress.
    active: AtomicUsize,
    /// Moves on when one starts and when one ends.
    epoch: AtomicU64,
}

/// One load or first connection in progress, until dropped.
pub(super) struct InProgress<'a>(&'a Warming);

impl Warming {
    /// Marks a load or a first connection in progress until the guard is dropped.
    pub fn begin(&self) -> InProgress<'_> {
        self.active.fetch_add(1, Ordering::AcqRel);
        self.epoch.fetch_add(1, Ordering::AcqRel);
        InProgress(self)
    }

    /// The epoch, read before a request is sent.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Whether a load or first connection was in progress at some time since `epoch`
    /// was read (or is now).
    pub fn overlapped(&self, epoch: u64) -> bool {
        self.active.load(Ordering::Acquire) > 0 || self.epoch.load(Ordering::Acquire) != epoch
    }
}

impl Drop for InProgress<'_> {
    fn drop(&mut self) {
        self.0.epoch.fetch_add(1, Ordering::AcqRel);
        self.0.active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Makes sure Redis answers on `conn` (a `PING`, which also makes a lazy connection),
/// then loads the script of each of `sets`: as a function library while the store uses
/// functions (`FUNCTION LOAD`; one already there is kept), then calls one of them with
/// no request (`FCALL` is refused by an ACL that allows `FUNCTION LOAD`), else as
/// `EVALSHA` scripts (`SCRIPT LOAD`). A Redis that cannot take or call the libraries
/// turns the store to `EVALSHA`, as a call would, and gets the scripts. The `PING` is not
/// a load in progress: a Redis that does not answer it fails here, and its failures
/// count as usual.
pub(super) async fn load(
    shared: &Shared,
    conn: &Connection,
    sets: &[ScriptSet],
) -> Result<Loaded, Error> {
    let backend = |e| shared.failed(e);
    let mut conn = conn.clone();
    redis::cmd("PING")
        .query_async::<redis::Value>(&mut conn)
        .await
        .map_err(backend)?;
    let _loading = shared.warming.begin();
    let sets: Vec<ScriptSet> = sets.iter().copied().filter(|s| !s.is_empty()).collect();
    let mut new = 0;
    if shared.functions.load(Ordering::Relaxed) {
        match load_libraries(shared, &mut conn, &sets).await {
            Ok(n) => new = n,
            Err(e) if functions_unusable(&e) || library_refused(&e) => {
                give_up_functions(shared, &e);
            }
            Err(e) => return Err(backend(e)),
        }
    }
    if !shared.functions.load(Ordering::Relaxed) {
        // SCRIPT LOAD of a script Redis has is cheap: it finds it by its SHA-1.
        for set in &sets {
            let built = shared.scripts.get(set.mask());
            built.script.load_async(&mut conn).await.map_err(backend)?;
        }
        new = sets.len();
    }
    Ok(Loaded {
        sets: sets.len(),
        new,
        functions: shared.functions.load(Ordering::Relaxed),
    })
}

/// Loads the libraries of `sets` and calls the first with an empty batch (no key, no
/// request: the script answers nothing and touches nothing), so that a Redis whose ACL
/// allows `FUNCTION LOAD` but not `FCALL` is found now rather than by the first request.
/// How many libraries were loaded now.
async fn load_libraries(
    shared: &Shared,
    conn: &mut Connection,
    sets: &[ScriptSet],
) -> redis::RedisResult<usize> {
    let mut new = 0;
    for set in sets {
        new += usize::from(load_library(conn, &shared.scripts.get(set.mask()).library).await?);
    }
    if let Some(first) = sets.first() {
        redis::cmd("FCALL")
            .arg(&shared.scripts.get(first.mask()).function)
            .arg(0)
            .arg(shared.slack_ms)
            .arg(0)
            .arg("")
            .query_async::<redis::Value>(&mut *conn)
            .await?;
    }
    Ok(new)
}

/// `FUNCTION LOAD library`; true when it was loaded now, false when Redis had it. On a
/// cluster a library one master has may be missing from another, so there it is loaded
/// with `REPLACE` (sent to every master) after such an answer.
async fn load_library(conn: &mut Connection, library: &str) -> redis::RedisResult<bool> {
    let first = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(library)
        .query_async::<redis::Value>(&mut *conn)
        .await;
    match first {
        Ok(_) => Ok(true),
        Err(e) if already_exists(e.code(), e.detail()) => {
            if matches!(conn, Connection::Cluster(_)) {
                redis::cmd("FUNCTION")
                    .arg("LOAD")
                    .arg("REPLACE")
                    .arg(library)
                    .query_async::<redis::Value>(&mut *conn)
                    .await?;
            }
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// Whether `FUNCTION LOAD` answered that the library is loaded already (Redis checks
/// the name before it compiles the code, so asking costs Redis little).
fn already_exists(code: Option<&str>, detail: Option<&str>) -> bool {
    code == Some("ERR")
        && detail.is_some_and(|d| d.starts_with("Library") && d.ends_with("already exists"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_subset_of_the_algorithms_in_use_fewest_first() {
        let set = crate::rules::from_str(
            "r.yaml",
            "domain: a\ndescriptors:\n  - key: k\n    rate_limits:\n      - {unit: minute, requests_per_unit: 5, algorithm: gcra}\n      - {unit: hour, requests_per_unit: 50}\n  - key: j\n    rate_limit: {unit: minute, requests_per_unit: 5, algorithm: sliding_log}\n",
        )
        .unwrap();
        let names: Vec<Vec<&str>> = script_sets(&set).iter().map(ScriptSet::names).collect();
        assert_eq!(
            names,
            [
                vec!["fixed_window"],
                vec!["sliding_log"],
                vec!["gcra"],
                vec!["fixed_window", "sliding_log"],
                vec!["fixed_window", "gcra"],
                vec!["sliding_log", "gcra"],
                vec!["fixed_window", "sliding_log", "gcra"],
            ]
        );
        let all = crate::rules::from_str("r.yaml", "domain: a\ndescriptors: []\n").unwrap();
        assert!(script_sets(&all).is_empty());
    }

    #[test]
    fn a_wait_across_a_load_is_not_a_failure_of_redis() {
        let w = Warming::default();
        let before = w.epoch();
        assert!(!w.overlapped(before), "nothing in progress");
        let load = w.begin();
        assert!(w.overlapped(before), "in progress");
        assert!(w.overlapped(w.epoch()), "sent during it");
        drop(load);
        assert!(w.overlapped(before), "it began and ended during the wait");
        assert!(!w.overlapped(w.epoch()), "sent after it");
    }

    #[test]
    fn an_existing_library_is_told_from_other_errors() {
        assert!(already_exists(
            Some("ERR"),
            Some("Library 'tollgate_ab' already exists")
        ));
        assert!(!already_exists(
            Some("ERR"),
            Some("Error registering functions")
        ));
        assert!(!already_exists(Some("NOPERM"), Some("already exists")));
    }
}
