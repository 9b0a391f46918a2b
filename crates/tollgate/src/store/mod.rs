//! Stores: where per-key state lives, and the one thing they add to the algorithms,
//! atomicity.
//!
//! A [`Store`] runs the pure [`algorithm`](crate::algorithm) functions on the state of
//! each key of a request so that concurrent requests never lose an update, and so that
//! a request is all-or-nothing: if any of its checks is rejected, none is charged.
//! [`MemoryStore`] is the embedded default; it also has a synchronous fast path for
//! in-process callers ([`MemoryStore::check_one`]).

#[cfg(feature = "redis")]
mod blocked;
#[cfg(feature = "redis")]
pub mod lease;
mod memory;
#[cfg(feature = "redis")]
mod per_limit;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "redis")]
mod scale_out;
#[cfg(feature = "redis")]
pub mod sync;

use std::future::Future;

pub(crate) use memory::Fingerprint;
pub use memory::{MemoryStore, MemoryStoreBuilder, MemoryStoreStats};
#[cfg(feature = "redis")]
pub use per_limit::LimitStats;
#[cfg(feature = "redis")]
pub use redis::{
    script_library, script_source, Loaded, RedisStore, RedisStoreBuilder, RedisStoreStats,
    RedisTls, ScriptCall, ScriptNameError, ScriptSet, TimeSource, SCRIPT_ALGORITHMS,
};
#[cfg(feature = "redis")]
pub use scale_out::{
    GlobalCallObserver, ScaleOut, ScaleOutStats, Spawner, Timer, DEFAULT_MAX_KEYS,
};

use crate::algorithm::Limit;
use crate::clock::Nanos;
use crate::decision::Decision;

/// One limit to check for one key, with the request's cost.
#[derive(Debug, Clone, Copy)]
pub struct Check<'a> {
    /// The limit (its id and the key select the counter).
    pub limit: &'a Limit,
    /// The runtime key, e.g. `user:123` or a descriptor's values.
    pub key: &'a [u8],
    /// What the request costs: hits, bytes, ... 0 checks without charging.
    pub cost: u64,
    /// Shadow mode: decided and charged like any check, but its rejection does not
    /// reject the request (nor undo the other checks).
    pub shadow: bool,
    /// Quota mode (Envoy's `quota_mode`), with the check's quota group: a group is over
    /// when one of its checks is rejected, and the request is rejected by its quota-mode
    /// checks only when every group is over (see [`rejects`]).
    pub quota: Option<u32>,
    /// Whether it is charged when it is not admitted, or its request is rejected.
    pub charge: ChargeRejected,
}

/// When a check is charged although it was not admitted, or its request was rejected
/// (the rule file's `charge_rejected`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum ChargeRejected {
    /// Charged only when it is admitted and so is the whole request: all or nothing.
    #[default]
    None,
    /// As `None`, but charged anyway when it is over its limit (Envoy's service with
    /// `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=true`).
    OverLimit,
    /// Always charged, admitted or not, whatever the rest of the request (Envoy's
    /// service's default).
    All,
}

impl ChargeRejected {
    /// The name used in rule files and flags: `none`, `over_limit`, `all`.
    pub fn name(self) -> &'static str {
        match self {
            ChargeRejected::None => "none",
            ChargeRejected::OverLimit => "over_limit",
            ChargeRejected::All => "all",
        }
    }

    /// The mode a rule file or flag names.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "none" => Some(ChargeRejected::None),
            "over_limit" => Some(ChargeRejected::OverLimit),
            "all" => Some(ChargeRejected::All),
            _ => None,
        }
    }

    /// Whether a check in this mode is charged although it was not admitted itself.
    pub fn when_over(self) -> bool {
        self != ChargeRejected::None
    }

    /// Whether a check in this mode that was admitted keeps its charge when its request
    /// is rejected.
    pub fn when_request_rejected(self) -> bool {
        self == ChargeRejected::All
    }
}

/// Whether a request whose checks were decided so (`allowed(i)` for check `i`) is
/// rejected: when a check in neither shadow nor quota mode was, or when it has quota-mode
/// checks and every quota group among them has a rejected check not in shadow mode.
pub fn rejects(checks: &[Check<'_>], allowed: impl Fn(usize) -> bool) -> bool {
    rejects_by(
        checks
            .iter()
            .enumerate()
            .map(|(i, c)| (c.shadow, c.quota, allowed(i))),
    )
}

/// [`rejects`] for checks given as (shadow mode, quota group, admitted).
pub fn rejects_by(checks: impl IntoIterator<Item = (bool, Option<u32>, bool)>) -> bool {
    // Whether it is over, per quota group: a map, so that the work stays linear in the
    // checks however many groups there are; none of this allocates unless the request
    // has quota-mode checks. A check in shadow mode counts as admitted (its status says
    // OK), so a quota group with one is not over by it.
    let mut groups: std::collections::HashMap<u32, bool> = std::collections::HashMap::new();
    for (shadow, quota, allowed) in checks {
        let over = !allowed && !shadow;
        match quota {
            Some(group) => *groups.entry(group).or_insert(false) |= over,
            None if over => return true,
            None => {}
        }
    }
    !groups.is_empty() && groups.values().all(|&over| over)
}

impl<'a> Check<'a> {
    /// A check of `limit` for `key` costing `cost`.
    pub fn new(limit: &'a Limit, key: &'a (impl AsRef<[u8]> + ?Sized), cost: u64) -> Self {
        Self {
            limit,
            key: key.as_ref(),
            cost,
            shadow: false,
            quota: None,
            charge: ChargeRejected::None,
        }
    }

    /// The same check in shadow mode (see [`Check::shadow`](Self#structfield.shadow)).
    pub fn in_shadow(mut self) -> Self {
        self.shadow = true;
        self
    }

    /// The same check in quota mode, in quota group `group` (see
    /// [`Check::quota`](Self#structfield.quota)).
    pub fn in_quota(mut self, group: u32) -> Self {
        self.quota = Some(group);
        self
    }

    /// The same check, charged as `charge` says when it or its request is rejected.
    pub fn charging(mut self, charge: ChargeRejected) -> Self {
        self.charge = charge;
        self
    }
}

/// What a store could not do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The backend did not answer within its deadline.
    #[error("the store did not answer within {0:?}")]
    Timeout(std::time::Duration),
    /// The backend answered with an error or could not be reached.
    #[error("the store failed: {message}")]
    Backend {
        /// What failed, in words. Where the backend's own error is the cause, its text is
        /// part of it (a connection Redis refused names the address), so that the message
        /// alone says what happened.
        message: String,
        /// The backend's own error (a `redis::RedisError`), when it came from one.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    },
    /// The backend failed repeatedly; calls are refused until a probe succeeds.
    #[error("the store's circuit breaker is open after repeated failures")]
    CircuitOpen,
}

impl Error {
    /// A short, fixed name for metrics: `timeout`, `error` or `circuit_open`.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Timeout(_) => "timeout",
            Error::Backend { .. } => "error",
            Error::CircuitOpen => "circuit_open",
        }
    }

    /// A backend failure that `message` describes.
    pub fn backend(message: impl Into<String>) -> Self {
        Error::Backend {
            message: message.into(),
            source: None,
        }
    }

    /// A backend failure caused by the backend's own error `source`; `message` says what
    /// failed (see [`Error::Backend`]).
    pub fn backend_caused_by(
        message: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Error::Backend {
            message: message.into(),
            source: Some(Box::new(source)),
        }
    }
}

/// Keeps per-key state and runs the algorithms on it atomically.
pub trait Store: Send + Sync {
    /// Decides every check of one request at `now`, atomically: either the request is
    /// admitted ([`rejects`] says no) and every admitted check is charged, or none is
    /// charged (lockouts started by a rejected check still start) — except as each check's
    /// [`ChargeRejected`] says: a check not admitted is charged anyway under `over_limit`
    /// and `all`, and an admitted one keeps its charge in a rejected request under `all`.
    /// Decisions come back in the order of `checks`; when the request is rejected, a check
    /// whose own limit had room (and that was not charged) still says `allowed`, with the
    /// remaining it has uncharged. A store with a time source of its own that several
    /// instances share may use it instead of `now`.
    fn check<'a>(
        &'a self,
        now: Nanos,
        checks: &'a [Check<'a>],
    ) -> impl Future<Output = Result<Vec<Decision>, Error>> + Send + 'a;

    /// As [`Store::check`], for a caller that waits at most `budget` for the answer: a
    /// store that may wait (Redis) answers [`Error::Timeout`] once the budget or its own
    /// deadline has passed, whichever comes first, and counts it as a missed deadline; a
    /// budget under half its deadline is not honoured (an impatient caller must not get
    /// the failure mode's answer instead of a decision). A store that never waits (in
    /// memory, the default here) ignores it.
    fn check_within<'a>(
        &'a self,
        now: Nanos,
        checks: &'a [Check<'a>],
        budget: std::time::Duration,
    ) -> impl Future<Output = Result<Vec<Decision>, Error>> + Send + 'a {
        let _ = budget;
        self.check(now, checks)
    }

    /// Charges one check as [`Store::check`] does (within `budget` when given), for a
    /// lease of leased counting, and answers besides the decision a token from which
    /// [`Store::give_back`] can return unspent units of the charge. A store that cannot
    /// give back answers no token (the default).
    fn lease<'a>(
        &'a self,
        now: Nanos,
        check: Check<'a>,
        budget: Option<std::time::Duration>,
    ) -> impl Future<Output = Result<(Decision, Option<LeaseToken>), Error>> + Send + 'a {
        async move {
            let checks = [check];
            let decisions = match budget {
                Some(b) => self.check_within(now, &checks, b).await?,
                None => self.check(now, &checks).await?,
            };
            let d = decisions
                .first()
                .copied()
                .ok_or_else(|| Error::backend("the store answered no decision to a lease"))?;
            Ok((d, None))
        }
    }

    /// Gives back `check.cost` units of the lease whose charge answered `token`, at `now`:
    /// unspent units, so that other instances may lease them. A fixed window counts
    /// down while it is the window charged; a bucket only while nothing has changed it
    /// since the lease (see each algorithm's `give_back`): otherwise nothing changes, and
    /// the units expire as they would have. Never admits more than keeping them would.
    /// The default does nothing.
    fn give_back<'a>(
        &'a self,
        now: Nanos,
        check: Check<'a>,
        token: &'a LeaseToken,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a {
        let _ = (now, check, token);
        std::future::ready(Ok(()))
    }
}

/// What a store answers with a lease's charge ([`Store::lease`]) so that
/// [`Store::give_back`] can return unspent units of it later: opaque bytes (Redis's
/// receipt of the key before and after the charge; the in-memory store's state after
/// it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseToken(pub(crate) Box<[u8]>);

impl<S: Store + ?Sized> Store for std::sync::Arc<S> {
    fn check<'a>(
        &'a self,
        now: Nanos,
        checks: &'a [Check<'a>],
    ) -> impl Future<Output = Result<Vec<Decision>, Error>> + Send + 'a {
        (**self).check(now, checks)
    }

    fn check_within<'a>(
        &'a self,
        now: Nanos,
        checks: &'a [Check<'a>],
        budget: std::time::Duration,
    ) -> impl Future<Output = Result<Vec<Decision>, Error>> + Send + 'a {
        (**self).check_within(now, checks, budget)
    }

    fn lease<'a>(
        &'a self,
        now: Nanos,
        check: Check<'a>,
        budget: Option<std::time::Duration>,
    ) -> impl Future<Output = Result<(Decision, Option<LeaseToken>), Error>> + Send + 'a {
        (**self).lease(now, check, budget)
    }

    fn give_back<'a>(
        &'a self,
        now: Nanos,
        check: Check<'a>,
        token: &'a LeaseToken,
    ) -> impl Future<Output = Result<(), Error>> + Send + 'a {
        (**self).give_back(now, check, token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{Algorithm, FixedWindow};
    use std::time::Duration;

    /// `rejects` for checks given as (shadow, quota group), decided `allowed`.
    fn rejected(checks: &[(bool, Option<u32>)], allowed: &[bool]) -> bool {
        let limit = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
            1,
            Duration::from_secs(1),
        )))
        .expect("a valid limit");
        let checks: Vec<Check<'_>> = checks
            .iter()
            .map(|&(shadow, quota)| Check {
                shadow,
                quota,
                ..Check::new(&limit, "k", 1)
            })
            .collect();
        rejects(&checks, |i| allowed[i])
    }

    #[test]
    fn a_plain_rejection_rejects_and_a_shadow_one_does_not() {
        assert!(rejected(&[(false, None), (false, None)], &[true, false]));
        assert!(!rejected(&[(false, None), (true, None)], &[true, false]));
        assert!(!rejected(&[], &[]));
    }

    #[test]
    fn quota_checks_reject_only_when_every_group_is_over() {
        let q = |g| (false, Some(g));
        // Groups 0 and 1: one over, one not.
        assert!(!rejected(&[q(0), q(1)], &[false, true]));
        assert!(rejected(&[q(0), q(1)], &[false, false]));
        // One check over makes its group over, whatever the group's others say.
        assert!(rejected(&[q(0), q(0), q(1)], &[true, false, false]));
        assert!(!rejected(&[q(0), q(0), q(1)], &[true, false, true]));
        // A quota check in shadow mode counts as admitted: its group is not over.
        assert!(!rejected(&[q(0), (true, Some(1))], &[false, false]));
        assert!(rejected(&[q(0), (true, Some(0))], &[false, false]));
        // A plain rejection rejects whatever the quota groups say.
        assert!(rejected(&[q(0), (false, None)], &[true, false]));
    }
}
