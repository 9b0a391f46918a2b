//! [`Limit`]: one algorithm with its parameters, an optional lockout and a counter identity.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Duration;

use super::{
    FixedWindow, Gcra, KeyState, LeakyBucket, Lockout, LogState, SlidingLog, SlidingWindow,
    TokenBucket, WarmState, WindowState,
};
use crate::clock::{nanos, Nanos};
use crate::decision::Decision;

/// Which algorithm a [`Limit`] runs, with its parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// See [`FixedWindow`].
    FixedWindow(FixedWindow),
    /// See [`SlidingWindow`].
    SlidingWindow(SlidingWindow),
    /// See [`SlidingLog`].
    SlidingLog(SlidingLog),
    /// See [`TokenBucket`].
    TokenBucket(TokenBucket),
    /// See [`Gcra`].
    Gcra(Gcra),
    /// See [`LeakyBucket`].
    LeakyBucket(LeakyBucket),
}

/// The shape of the per-key state an algorithm keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StateKind {
    /// A 16-byte [`KeyState`]: fixed window and the bucket algorithms.
    Key,
    /// A [`LogState`]: the sliding log.
    Log,
    /// A [`WindowState`]: the sliding window counter.
    Window,
    /// A 32-byte [`WarmState`]: a token bucket or GCRA with a warm-up.
    Warm,
}

/// A limit as stores run it: an [`Algorithm`], an optional [`Lockout`], and the
/// identity of its counters.
///
/// Two limits with the same `id` and the same key share one counter. The default id is
/// derived from the parameters; give limits that must stay apart (or that must keep
/// their counters when their numbers change, as rules do across a reload) an explicit
/// id with [`with_id`](Self::with_id).
///
/// ```
/// use std::time::Duration;
/// use tollgate::algorithm::{Algorithm, Limit, TokenBucket};
/// let limit = Limit::new(Algorithm::TokenBucket(
///     TokenBucket::new(10, Duration::from_secs(1)).with_burst(20),
/// ))?
/// .with_lockout(Duration::from_secs(60));
/// assert_eq!(limit.limit(), 10);
/// # Ok::<(), tollgate::algorithm::InvalidLimit>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    algorithm: Algorithm,
    lockout: Option<Lockout>,
    id: u64,
    consistency: Consistency,
    scope: Scope,
}

/// Where a limit is counted when instances run in several regions (a rule file's
/// `scope`). Only a store with a global store beside the regional one reads it
/// (`store::ScaleOut::with_global`, feature `redis`); elsewhere every limit is counted in
/// the one store there is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Scope {
    /// Counted in the region's own store: each region has the whole limit.
    #[default]
    Region,
    /// One limit for all regions together, leased from the global store (its
    /// [`Consistency`] is `Leased`).
    Global,
}

impl Scope {
    /// The name used in rule files: `region` or `global`.
    pub fn name(&self) -> &'static str {
        match self {
            Scope::Region => "region",
            Scope::Global => "global",
        }
    }
}

/// How instances that share a store count a limit (a rule file's `consistency`). Only a
/// store shared by several instances reads it (`store::ScaleOut`, feature `redis`);
/// one instance counting in its own memory is exact whatever it says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Consistency {
    /// Every decision is made by the shared store: one round trip each, exact.
    #[default]
    Exact,
    /// Each instance takes blocks of units (leases) from the shared store and decides
    /// locally until they are spent; together the instances never admit more than the
    /// limit. `period` is how long one lease should last at the instance's own rate.
    Leased {
        /// How long one lease should last at the instance's current rate, in ns.
        period: Nanos,
    },
    /// Each instance decides locally against the last count it read plus its own, and
    /// exchanges counts with the shared store every `interval`: over-admission is bounded
    /// by what the other instances admit within one interval.
    Synced {
        /// How often counts are exchanged with the shared store, in ns.
        interval: Nanos,
    },
}

impl Consistency {
    /// The name used in rule files: `exact`, `leased` or `synced`.
    pub fn name(&self) -> &'static str {
        match self {
            Consistency::Exact => "exact",
            Consistency::Leased { .. } => "leased",
            Consistency::Synced { .. } => "synced",
        }
    }
}

/// Why a [`Limit`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidLimit {
    /// The window (unit) is zero.
    #[error("the window must be longer than zero")]
    ZeroWindow,
    /// The sliding window counter keeps 32-bit counts.
    #[error("a sliding_window limit must be at most 4294967295 per window, got {0}")]
    SlidingWindowTooLarge(u64),
    /// A warm-up on a bucket that may go into debt: the two are not combined.
    #[error("a `warmup` cannot be combined with an `overdraft`: a key warming up admits at its cold rate, a debt admits beyond the bucket")]
    WarmupWithOverdraft,
    /// A warm-up too long for the rate: its stored permits would not stay exact.
    #[error("a warm-up of {warmup_ms} ms is too long for {limit} per {window_ms} ms with a burst of {burst}: the stored permits of a cold key (warm-up × rate) would not stay exact; shorten `warmup`")]
    WarmupTooLong {
        /// The warm-up, in ms.
        warmup_ms: u64,
        /// The rate's count.
        limit: u64,
        /// The rate's window, in ms.
        window_ms: u64,
        /// The bucket's burst.
        burst: u64,
    },
}

impl Limit {
    /// A limit running `algorithm`, with no lockout and an id derived from the parameters.
    pub fn new(algorithm: Algorithm) -> Result<Self, InvalidLimit> {
        if algorithm.window() == 0 {
            return Err(InvalidLimit::ZeroWindow);
        }
        if let Algorithm::SlidingWindow(s) = algorithm {
            if s.limit > u64::from(u32::MAX) {
                return Err(InvalidLimit::SlidingWindowTooLarge(s.limit));
            }
        }
        if let Some((limit, window, burst, overdraft, warmup)) = algorithm.warm_parts() {
            if overdraft > 0 {
                return Err(InvalidLimit::WarmupWithOverdraft);
            }
            if super::bucket::warm_tick(limit, window, burst, warmup).is_none() {
                return Err(InvalidLimit::WarmupTooLong {
                    warmup_ms: warmup / 1_000_000,
                    limit,
                    window_ms: window / 1_000_000,
                    burst,
                });
            }
        }
        let mut h = DefaultHasher::new();
        algorithm.hash(&mut h);
        Ok(Self {
            algorithm,
            lockout: None,
            id: h.finish(),
            consistency: Consistency::Exact,
            scope: Scope::Region,
        })
    }

    /// Counts the limit as `consistency` says on a shared store (see [`Consistency`]).
    pub fn with_consistency(mut self, consistency: Consistency) -> Self {
        self.consistency = consistency;
        self
    }

    /// How instances sharing a store count this limit.
    pub fn consistency(&self) -> Consistency {
        self.consistency
    }

    /// Counts the limit where `scope` says when regions share a global store (see
    /// [`Scope`]). A global limit should be leased ([`Consistency::Leased`]); one that
    /// is not is leased anyway with the default period when a global store is there.
    pub fn with_scope(mut self, scope: Scope) -> Self {
        self.scope = scope;
        self
    }

    /// Where this limit is counted when regions share a global store.
    pub fn scope(&self) -> Scope {
        self.scope
    }

    /// Why this limit cannot be counted as its [`Consistency`] says, if it cannot:
    /// leases and synced counts need a limit whose room is one number (the fixed
    /// window, and the token bucket, GCRA and leaky bucket as meters), no lockout (it
    /// is started by one shared rejection), no queue (its delay is decided on the
    /// shared state), no overdraft (each admission into debt is decided and flagged
    /// on the shared state) and no warm-up (each admission's cost depends on how warm
    /// the key is on the shared state).
    pub fn consistency_conflict(&self) -> Option<&'static str> {
        if self.consistency == Consistency::Exact {
            return None;
        }
        match self.algorithm {
            Algorithm::SlidingLog(_) => Some("a sliding_log keeps each request's instant, which a count taken elsewhere cannot keep"),
            Algorithm::SlidingWindow(_) => Some("a sliding_window weighs counts by when they were made, which a count taken elsewhere cannot keep"),
            Algorithm::LeakyBucket(b) if b.mode == super::LeakyMode::Queue => {
                Some("a queue's delay is decided on the shared state, request by request")
            }
            _ if self.lockout.is_some() => {
                Some("a lockout (`block_duration`) starts on one shared rejection")
            }
            Algorithm::TokenBucket(super::TokenBucket { overdraft, .. })
            | Algorithm::Gcra(super::Gcra { overdraft, .. })
                if overdraft > 0 =>
            {
                Some("an `overdraft` is a debt decided and flagged on the shared state, admission by admission, which units taken ahead cannot keep")
            }
            Algorithm::TokenBucket(super::TokenBucket { warmup, .. })
            | Algorithm::Gcra(super::Gcra { warmup, .. })
                if warmup > 0 =>
            {
                Some("a `warmup` slows each admission by how warm the key is on the shared state, which units taken ahead cannot keep")
            }
            _ => None,
        }
    }

    /// Locks a key out for `duration` from its first rejection (see [`Lockout`]).
    /// A zero duration means no lockout.
    pub fn with_lockout(mut self, duration: Duration) -> Self {
        let duration = nanos(duration);
        self.lockout = (duration > 0).then_some(Lockout { duration });
        self
    }

    /// Sets the counter identity (see the type's documentation).
    pub fn with_id(mut self, id: u64) -> Self {
        self.id = id;
        self
    }

    /// The counter identity.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The algorithm and its parameters.
    pub fn algorithm(&self) -> &Algorithm {
        &self.algorithm
    }

    /// The lockout, if any.
    pub fn lockout(&self) -> Option<Lockout> {
        self.lockout
    }

    /// The configured number of requests (cost units) per window.
    pub fn limit(&self) -> u64 {
        self.algorithm.limit()
    }

    /// The window, in nanoseconds.
    pub fn window(&self) -> Nanos {
        self.algorithm.window()
    }

    /// Charges `cost` at `now` to a [`KeyState`] whether it fits or not (the rule file's
    /// `charge_rejected`); nothing for the sliding log and window (see
    /// [`charge_log`](Self::charge_log), [`charge_window`](Self::charge_window)).
    pub fn charge_key(&self, state: &mut KeyState, now: Nanos, cost: u64) {
        match &self.algorithm {
            Algorithm::FixedWindow(a) => a.charge(state, now, cost),
            Algorithm::TokenBucket(a) => a.charge(state, now, cost),
            Algorithm::Gcra(a) => a.charge(state, now, cost),
            Algorithm::LeakyBucket(a) => a.charge(state, now, cost),
            Algorithm::SlidingLog(_) | Algorithm::SlidingWindow(_) => {}
        }
    }

    /// Gives back `units` of a lease (leased counting) whose charge left the key's state
    /// at `charged`, the state being `state` at `now`: the state without those units, or
    /// `None` when nothing may change (the fixed window has turned, a bucket was charged
    /// since, or the algorithm keeps another state).
    pub fn give_back_key(
        &self,
        state: &KeyState,
        charged: &KeyState,
        now: Nanos,
        units: u64,
    ) -> Option<KeyState> {
        match &self.algorithm {
            Algorithm::FixedWindow(a) => a.give_back(state, charged, now, units),
            Algorithm::TokenBucket(a) => a.give_back(state, charged, now, units),
            Algorithm::Gcra(a) => a.give_back(state, charged, now, units),
            Algorithm::LeakyBucket(a) => a.give_back(state, charged, now, units),
            Algorithm::SlidingLog(_) | Algorithm::SlidingWindow(_) => None,
        }
    }

    /// Charges `cost` at `now` to a sliding log's state whether it fits or not.
    pub fn charge_log(&self, state: &mut LogState, now: Nanos, cost: u64) {
        if let Algorithm::SlidingLog(a) = &self.algorithm {
            a.charge(state, now, cost);
        }
    }

    /// Charges `cost` at `now` to a [`WarmState`] (a token bucket or GCRA with a warm-up)
    /// whether it fits or not.
    pub fn charge_warm(&self, state: &mut WarmState, now: Nanos, cost: u64) {
        match &self.algorithm {
            Algorithm::TokenBucket(a) => a.charge_warm(state, now, cost),
            Algorithm::Gcra(a) => a.charge_warm(state, now, cost),
            _ => {}
        }
    }

    /// Charges `cost` at `now` to a sliding window's state whether it fits or not.
    pub fn charge_window(&self, state: &mut WindowState, now: Nanos, cost: u64) {
        if let Algorithm::SlidingWindow(a) = &self.algorithm {
            a.charge(state, now, cost);
        }
    }

    /// The shape of the per-key state the algorithm keeps.
    pub fn state_kind(&self) -> StateKind {
        match self.algorithm {
            Algorithm::SlidingLog(_) => StateKind::Log,
            Algorithm::SlidingWindow(_) => StateKind::Window,
            Algorithm::TokenBucket(TokenBucket { warmup, .. })
            | Algorithm::Gcra(Gcra { warmup, .. })
                if warmup > 0 =>
            {
                StateKind::Warm
            }
            _ => StateKind::Key,
        }
    }

    /// True when the algorithm keeps a [`LogState`] rather than a [`KeyState`].
    pub fn uses_log(&self) -> bool {
        self.state_kind() == StateKind::Log
    }

    /// Runs the algorithm on a [`KeyState`]. The sliding log and the sliding window keep
    /// other states: for them this rejects as [`NEVER`](crate::decision::NEVER); use
    /// [`check_log`](Self::check_log) or [`check_window`](Self::check_window). A bucket
    /// with a warm-up ([`StateKind::Warm`]) is decided here without it: use
    /// [`check_warm`](Self::check_warm).
    pub fn check_key(&self, state: &mut KeyState, now: Nanos, cost: u64) -> Decision {
        match &self.algorithm {
            Algorithm::FixedWindow(a) => a.check(state, now, cost),
            Algorithm::TokenBucket(a) => a.check(state, now, cost),
            Algorithm::Gcra(a) => a.check(state, now, cost),
            Algorithm::LeakyBucket(a) => a.check(state, now, cost),
            other => Decision::reject(other.limit(), 0, 0, crate::decision::NEVER),
        }
    }

    /// Runs a sliding log on its [`LogState`]; for any other algorithm this rejects as
    /// [`NEVER`](crate::decision::NEVER).
    pub fn check_log(&self, state: &mut LogState, now: Nanos, cost: u64) -> Decision {
        match &self.algorithm {
            Algorithm::SlidingLog(a) => a.check(state, now, cost),
            other => Decision::reject(other.limit(), 0, 0, crate::decision::NEVER),
        }
    }

    /// Runs a token bucket or GCRA with its warm-up on a [`WarmState`]; for any other
    /// algorithm this rejects as [`NEVER`](crate::decision::NEVER).
    pub fn check_warm(&self, state: &mut WarmState, now: Nanos, cost: u64) -> Decision {
        match &self.algorithm {
            Algorithm::TokenBucket(a) => a.check_warm(state, now, cost),
            Algorithm::Gcra(a) => a.check_warm(state, now, cost),
            other => Decision::reject(other.limit(), 0, 0, crate::decision::NEVER),
        }
    }

    /// Runs a sliding window counter on its [`WindowState`]; for any other algorithm this
    /// rejects as [`NEVER`](crate::decision::NEVER).
    pub fn check_window(&self, state: &mut WindowState, now: Nanos, cost: u64) -> Decision {
        match &self.algorithm {
            Algorithm::SlidingWindow(a) => a.check(state, now, cost),
            other => Decision::reject(other.limit(), 0, 0, crate::decision::NEVER),
        }
    }
}

impl Algorithm {
    /// A token bucket's or GCRA's `(limit, window, burst, overdraft, warmup)` when it
    /// has a warm-up.
    pub(crate) fn warm_parts(&self) -> Option<(u64, Nanos, u64, u64, Nanos)> {
        match *self {
            Algorithm::TokenBucket(TokenBucket {
                limit,
                window,
                burst,
                overdraft,
                warmup,
            })
            | Algorithm::Gcra(Gcra {
                limit,
                window,
                burst,
                overdraft,
                warmup,
            }) if warmup > 0 => Some((limit, window, burst, overdraft, warmup)),
            _ => None,
        }
    }

    /// The warm-up period in ns of a token bucket or GCRA (0: none, and for the others).
    pub fn warmup(&self) -> Nanos {
        self.warm_parts().map_or(0, |p| p.4)
    }

    /// The configured number of requests (cost units) per window.
    pub fn limit(&self) -> u64 {
        match self {
            Algorithm::FixedWindow(a) => a.limit,
            Algorithm::SlidingWindow(a) => a.limit,
            Algorithm::SlidingLog(a) => a.limit,
            Algorithm::TokenBucket(a) => a.limit,
            Algorithm::Gcra(a) => a.limit,
            Algorithm::LeakyBucket(a) => a.limit,
        }
    }

    /// The window, in nanoseconds.
    pub fn window(&self) -> Nanos {
        match self {
            Algorithm::FixedWindow(a) => a.window,
            Algorithm::SlidingWindow(a) => a.window,
            Algorithm::SlidingLog(a) => a.window,
            Algorithm::TokenBucket(a) => a.window,
            Algorithm::Gcra(a) => a.window,
            Algorithm::LeakyBucket(a) => a.window,
        }
    }

    /// The name used in rule files (`fixed_window`, `gcra`, ...), one of [`NAMES`].
    pub fn name(&self) -> &'static str {
        match self {
            Algorithm::FixedWindow(_) => "fixed_window",
            Algorithm::SlidingWindow(_) => "sliding_window",
            Algorithm::SlidingLog(_) => "sliding_log",
            Algorithm::TokenBucket(_) => "token_bucket",
            Algorithm::Gcra(_) => "gcra",
            Algorithm::LeakyBucket(_) => "leaky_bucket",
        }
    }
}

/// Every algorithm's name in rule files, in one fixed order: the Redis scripts' codes
/// and the simulator's report follow it.
pub const NAMES: [&str; 6] = [
    "fixed_window",
    "sliding_window",
    "sliding_log",
    "token_bucket",
    "gcra",
    "leaky_bucket",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zero_window_is_rejected() {
        let err = Limit::new(Algorithm::FixedWindow(FixedWindow::new(1, Duration::ZERO)));
        assert_eq!(err, Err(InvalidLimit::ZeroWindow));
    }

    #[test]
    fn a_sliding_window_above_u32_is_rejected() {
        let a = SlidingWindow::new(1 << 33, Duration::from_secs(1));
        assert!(matches!(
            Limit::new(Algorithm::SlidingWindow(a)),
            Err(InvalidLimit::SlidingWindowTooLarge(_))
        ));
    }

    #[test]
    fn an_overdraft_cannot_be_leased_or_synced() {
        let tb = TokenBucket::new(10, Duration::from_secs(1)).with_overdraft(3);
        let exact = Limit::new(Algorithm::TokenBucket(tb)).unwrap();
        assert_eq!(exact.consistency_conflict(), None);
        for c in [
            Consistency::Leased { period: 1 },
            Consistency::Synced { interval: 1 },
        ] {
            assert!(exact.with_consistency(c).consistency_conflict().is_some());
            let g = Gcra::new(10, Duration::from_secs(1)).with_overdraft(1);
            let g = Limit::new(Algorithm::Gcra(g)).unwrap().with_consistency(c);
            assert!(g.consistency_conflict().is_some());
            let plain = Limit::new(Algorithm::TokenBucket(tb.with_overdraft(0))).unwrap();
            assert_eq!(plain.with_consistency(c).consistency_conflict(), None);
        }
    }

    #[test]
    fn an_overdraft_is_part_of_the_default_id() {
        let a = Limit::new(Algorithm::Gcra(Gcra::new(10, Duration::from_secs(1)))).unwrap();
        let b = Gcra::new(10, Duration::from_secs(1)).with_overdraft(2);
        let b = Limit::new(Algorithm::Gcra(b)).unwrap();
        assert_ne!(a.id(), b.id());
    }

    #[test]
    fn a_warm_up_keeps_its_own_state_and_id_and_is_refused_where_it_cannot_be_kept() {
        let plain = Gcra::new(10, Duration::from_secs(1));
        let warm = plain.with_warmup(Duration::from_secs(30));
        let (a, b) = (
            Limit::new(Algorithm::Gcra(plain)).unwrap(),
            Limit::new(Algorithm::Gcra(warm)).unwrap(),
        );
        assert_ne!(a.id(), b.id());
        assert_eq!(
            (a.state_kind(), b.state_kind()),
            (StateKind::Key, StateKind::Warm)
        );
        assert_eq!(b.algorithm().warmup(), 30_000_000_000);
        for c in [
            Consistency::Leased { period: 1 },
            Consistency::Synced { interval: 1 },
        ] {
            assert!(b.with_consistency(c).consistency_conflict().is_some());
        }
        let tb = TokenBucket::new(10, Duration::from_secs(1)).with_warmup(Duration::from_secs(1));
        assert_eq!(
            Limit::new(Algorithm::TokenBucket(tb.with_overdraft(1))),
            Err(InvalidLimit::WarmupWithOverdraft)
        );
        // 2^33 per second warming up over a day: its stored permits pass every tick's range.
        let fast = TokenBucket::new(1 << 33, Duration::from_secs(1))
            .with_warmup(Duration::from_nanos(86_399_999_999_999));
        assert!(matches!(
            Limit::new(Algorithm::TokenBucket(fast)),
            Err(InvalidLimit::WarmupTooLong { .. })
        ));
    }

    #[test]
    fn limits_with_other_numbers_get_other_ids() {
        let a = Limit::new(Algorithm::Gcra(Gcra::new(10, Duration::from_secs(1)))).unwrap();
        let b = Limit::new(Algorithm::Gcra(Gcra::new(11, Duration::from_secs(1)))).unwrap();
        assert_ne!(a.id(), b.id());
        assert_eq!(b.with_id(a.id()).id(), a.id());
    }
}
