//! [`ScaleOut`]: a store shared by several instances (Redis, Redis Cluster) with leased
//! and synced counting in front of it, so that the instances' decisions do not all
//! wait on the shared store.
//!
//! Each check goes where its limit's [`Consistency`] says:
//! - `exact`: to the shared store, one call per request (as without `ScaleOut`);
//! - `leased`: decided from units in hand (`lease.rs`); a lease is taken from the shared
//!   store when they run out. All instances together never admit more than the limit;
//! - `synced`: decided against the last count read plus this instance's own
//!   (`sync.rs`); counts are exchanged by [`ScaleOut::sync`], every `sync_interval`.
//!
//! A check is decided exactly whatever its limit says when leasing or syncing cannot
//! keep its meaning: a cost of 0, quota mode (its groups are judged over the whole
//! request), `charge_rejected` other than `none` (a rejected hit charges the shared
//! count), or a limit that cannot be leased (see [`Limit::consistency_conflict`];
//! rule files refuse those).
//!
//! A request stays all or nothing: local checks are decided first; if they reject it,
//! its exact checks are only read (cost 0); if the exact checks reject it, the local
//! ones give their units back.
//!
//! With a global store beside the regional one ([`ScaleOut::with_global`]), limits of
//! [`Scope::Global`] are leased from the global store instead (whatever their
//! consistency says), and their leases are renewed in the background once half spent,
//! so that a hot key's decisions do not wait on the distant store. Their checks that
//! must be exact go to the global store, before the regional ones: a request the global
//! store rejects only reads its regional exact checks.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::lease::{self, Leases, Spent};
use super::per_limit::LimitStats;
use super::sync::{self, Syncs};
use super::{rejects, rejects_by, ChargeRejected, Check, Error, LeaseToken, Store};
use crate::algorithm::{Consistency, Limit, Scope};
use crate::clock::{Clock, Nanos};
use crate::decision::Decision;

/// Keys each of the lease and sync tables holds at most by default; past it, new keys
/// are decided exactly.
pub const DEFAULT_MAX_KEYS: usize = 100_000;

/// A key with nothing in hand and unused this long is forgotten.
const IDLE: Nanos = 10_000_000_000;

/// Give-back calls in flight at once (one per lease).
const RETURNS_IN_FLIGHT: usize = 64;

/// How long a request waits for another request's lease call on the same key before
/// looking again.
const LEASE_WAIT: Duration = Duration::from_millis(50);

/// As [`LEASE_WAIT`], for a global key: a bound only in case the call is never answered.
const GLOBAL_LEASE_WAIT: Duration = Duration::from_secs(5);

/// A shared store with leased and synced counting in front. See the module
/// documentation.
pub struct ScaleOut<S> {
    inner: Arc<Inner<S>>,
}

impl<S> Clone for ScaleOut<S> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

struct Inner<S> {
    store: S,
    /// The store global limits are leased from, when regions share one.
    global: Option<S>,
    leases: Leases,
    syncs: Syncs,
    /// The shortest `sync_interval` of a key seen so far (ns).
    shortest_interval: AtomicU64,
    /// Calls to the global store, and those that failed.
    global_calls: AtomicU64,
    global_failures: AtomicU64,
    /// Since when the global store has been failing (ns; 0: it answers), and how long
    /// it failed before (ns).
    global_down_since: AtomicU64,
    global_down_total: AtomicU64,
    /// A decayed average of the global store's round trip (ns; 0 before the first).
    global_rtt: AtomicU64,
    /// Told the duration of every call to the global store that answered.
    on_global_call: std::sync::OnceLock<GlobalCallObserver>,
    /// Runs the renewals of global leases ahead of need, when set
    /// ([`ScaleOut::spawn_with`]); else they run on the current tokio runtime.
    spawner: std::sync::OnceLock<Spawner>,
    /// The clock the global store's round trips are timed on, when set
    /// ([`ScaleOut::time_with`]); else the monotonic clock.
    timer: std::sync::OnceLock<Timer>,
}

/// A monotonic clock in nanoseconds (see [`ScaleOut::time_with`]).
pub type Timer = Arc<dyn Fn() -> Nanos + Send + Sync>;

/// A callback told how long each call to the global store took (one that answered).
pub type GlobalCallObserver = Arc<dyn Fn(Duration) + Send + Sync>;

/// Runs a future to its end in the background (see [`ScaleOut::spawn_with`]).
pub type Spawner = Arc<dyn Fn(Pin<Box<dyn Future<Output = ()> + Send>>) + Send + Sync>;

/// A global store whose round trip (a decayed average) is at least this long is far: a
/// hot key's request is refused rather than wait for it (see [`lease::Local::Dry`]).
const FAR: Nanos = 1_000_000;

/// A global limit leased while its consistency says otherwise: the default period.
const DEFAULT_GLOBAL_PERIOD: Nanos = 100_000_000;

/// Counters of a [`ScaleOut`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScaleOutStats {
    /// Leases granted.
    pub leases_taken: u64,
    /// Units granted by leases.
    pub units_leased: u64,
    /// Leased units that expired unspent (under-admission's cause).
    pub units_expired: u64,
    /// Unspent leased units given back to the shared store (keys gone idle, stopping).
    pub units_returned: u64,
    /// Lease calls refused for want of room.
    pub leases_refused: u64,
    /// Leased checks decided from units in hand.
    pub leased_local: u64,
    /// Leased checks of a hot global key refused at once, with nothing in hand, rather
    /// than wait for the distant global store.
    pub leased_dry: u64,
    /// Sync calls made.
    pub sync_calls: u64,
    /// Sync calls that failed.
    pub sync_failures: u64,
    /// Units pushed by sync calls.
    pub units_synced: u64,
    /// Synced checks decided locally.
    pub synced_local: u64,
    /// When the last sync call succeeded (ns since the epoch; 0: never).
    pub last_sync: Nanos,
    /// Calls to the global store (leases, give-backs, exact checks of global limits).
    pub global_calls: u64,
    /// Of those, the calls that failed.
    pub global_failures: u64,
    /// How long the global store has failed, in all, until the last call (ns): from a
    /// call that failed to the next one that answered.
    pub global_down: Nanos,
}

/// Where a check is decided.
#[derive(Debug, Clone, Copy)]
enum Route {
    Exact,
    Leased(Nanos),
    Synced(Nanos),
}

/// Where check `c` is decided; `global`: a global store is there, so a global limit is
/// leased from it.
fn route(c: &Check<'_>, global: bool) -> Route {
    if c.cost == 0
        || c.quota.is_some()
        || c.charge != ChargeRejected::None
        || c.limit.consistency_conflict().is_some()
    {
        return Route::Exact;
    }
    match c.limit.consistency() {
        Consistency::Leased { period } => Route::Leased(period.max(1)),
        // A global limit that says another consistency is leased all the same, if a
        // lease can keep its meaning.
        _ if global
            && c.limit.scope() == Scope::Global
            && c.limit
                .with_consistency(Consistency::Leased {
                    period: DEFAULT_GLOBAL_PERIOD,
                })
                .consistency_conflict()
                .is_none() =>
        {
            Route::Leased(DEFAULT_GLOBAL_PERIOD)
        }
        Consistency::Exact => Route::Exact,
        Consistency::Synced { interval } => Route::Synced(interval.max(1)),
    }
}

/// What to give back when a request is rejected after a local check admitted it.
enum Undo {
    Lease(usize, Spent),
    Sync(usize),
}

/// Marks a lease call as over when dropped (a request cancelled mid-call included), so
/// that the requests waiting for it look again.
struct LeaseCall<'a> {
    leases: &'a Leases,
    limit: &'a Limit,
    key: &'a [u8],
    answered: bool,
}

/// A request waiting for a lease call, counted among its waiters (so that the next lease
/// covers it) until dropped.
struct Queued<'a> {
    leases: &'a Leases,
    limit: &'a Limit,
    key: &'a [u8],
    cost: u64,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.leases.unqueue(self.limit, self.key, self.cost);
    }
}

impl Drop for LeaseCall<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.leases.failed(self.limit, self.key);
        }
    }
}

impl<S: Store + 'static> ScaleOut<S> {
    /// Leased and synced counting in front of `store`, each keeping at most
    /// [`DEFAULT_MAX_KEYS`] keys.
    pub fn new(store: S) -> Self {
        Self::with_max_keys(store, DEFAULT_MAX_KEYS)
    }

    /// As [`new`](Self::new), each table keeping at most about `max_keys` keys.
    pub fn with_max_keys(store: S, max_keys: usize) -> Self {
        Self::build(store, None, max_keys)
    }

    /// Leased and synced counting in front of a region's `store`, with limits of
    /// [`Scope::Global`] leased from `global`, shared by every region's instances; each
    /// table keeping at most about `max_keys` keys.
    pub fn with_global(store: S, global: S, max_keys: usize) -> Self {
        Self::build(store, Some(global), max_keys)
    }

    /// Has `f` told how long each call to the global store took (one that answered).
    /// Only the first observer set is kept; returns whether this one was.
    pub fn observe_global_calls(&self, f: GlobalCallObserver) -> bool {
        self.inner.on_global_call.set(f).is_ok()
    }

    /// Has `f` run the renewals of global leases ahead of need (each a future to run to
    /// its end in the background) instead of the tokio runtime current when a request
    /// triggers one: an executor of one's own, a simulation's. Only the first spawner
    /// set is kept; returns whether this one was.
    pub fn spawn_with(&self, f: Spawner) -> bool {
        self.inner.spawner.set(f).is_ok()
    }

    /// Has the global store's round trips timed on `f` (a monotonic clock in
    /// nanoseconds, a simulation's) instead of the monotonic clock: how far the store is
    /// decides whether a hot key's request may wait for it. Only the first timer set is
    /// kept; returns whether this one was.
    pub fn time_with(&self, f: Timer) -> bool {
        self.inner.timer.set(f).is_ok()
    }

    /// Nanoseconds since `start` (an instant of the same clock: [`Self::time_with`]'s,
    /// else the monotonic clock since it was first read here).
    fn elapsed(&self, start: Nanos) -> Nanos {
        self.tick().saturating_sub(start)
    }

    /// The clock round trips are timed on.
    fn tick(&self) -> Nanos {
        match self.inner.timer.get() {
            Some(f) => f(),
            None => {
                static BASE: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
                let base = BASE.get_or_init(std::time::Instant::now);
                u64::try_from(base.elapsed().as_nanos()).unwrap_or(u64::MAX)
            }
        }
    }

    fn build(store: S, global: Option<S>, max_keys: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                store,
                global,
                leases: Leases::new(max_keys),
                syncs: Syncs::new(max_keys),
                shortest_interval: AtomicU64::new(u64::MAX),
                global_calls: AtomicU64::new(0),
                global_failures: AtomicU64::new(0),
                global_down_since: AtomicU64::new(0),
                global_down_total: AtomicU64::new(0),
                global_rtt: AtomicU64::new(0),
                on_global_call: std::sync::OnceLock::new(),
                spawner: std::sync::OnceLock::new(),
                timer: std::sync::OnceLock::new(),
            }),
        }
    }

    /// The shared store (the region's, with a global store beside it).
    pub fn store(&self) -> &S {
        &self.inner.store
    }

    /// The global store, when regions share one.
    pub fn global_store(&self) -> Option<&S> {
        self.inner.global.as_ref()
    }

    /// Whether `limit` is counted in the global store.
    fn is_global(&self, limit: &Limit) -> bool {
        self.inner.global.is_some() && limit.scope() == Scope::Global
    }

    /// The store `limit` is counted in.
    fn store_of(&self, limit: &Limit) -> &S {
        match &self.inner.global {
            Some(g) if limit.scope() == Scope::Global => g,
            _ => &self.inner.store,
        }
    }

    /// Runs `call` (to the store of `limit`), timing it and counting its outcome when it
    /// goes to the global store.
    async fn call<T>(
        &self,
        limit: &Limit,
        now: Nanos,
        call: impl Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        if !self.is_global(limit) {
            return call.await;
        }
        let inner = &self.inner;
        inner.global_calls.fetch_add(1, Ordering::Relaxed);
        let started = self.tick();
        let result = call.await;
        match &result {
            Ok(_) => {
                // A call sent before the spell began says nothing of its end.
                let since = inner.global_down_since.load(Ordering::Relaxed);
                if since > 0
                    && now >= since
                    && inner
                        .global_down_since
                        .compare_exchange(since, 0, Ordering::Relaxed, Ordering::Relaxed)
                        .is_ok()
                {
                    inner
                        .global_down_total
                        .fetch_add(now - since, Ordering::Relaxed);
                }
                let ns = self.elapsed(started);
                let took = Duration::from_nanos(ns);
                let old = inner.global_rtt.load(Ordering::Relaxed);
                let avg = if old == 0 { ns } else { old - old / 8 + ns / 8 };
                inner.global_rtt.store(avg, Ordering::Relaxed);
                if let Some(f) = inner.on_global_call.get() {
                    f(took);
                }
            }
            Err(_) => {
                inner.global_failures.fetch_add(1, Ordering::Relaxed);
                let _ = inner.global_down_since.compare_exchange(
                    0,
                    now.max(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
        }
        result
    }

    /// About half a round trip to the store of `limit`: the global store's, measured;
    /// nothing for the region's.
    fn half_trip(&self, limit: &Limit) -> Nanos {
        if self.is_global(limit) {
            self.inner.global_rtt.load(Ordering::Relaxed) / 2
        } else {
            0
        }
    }

    /// How long the global store has failed in all until `now` (ns), the current spell
    /// included.
    pub fn global_down(&self, now: Nanos) -> Nanos {
        let since = self.inner.global_down_since.load(Ordering::Relaxed);
        let current = if since > 0 {
            now.saturating_sub(since)
        } else {
            0
        };
        self.inner
            .global_down_total
            .load(Ordering::Relaxed)
            .saturating_add(current)
    }

    /// The counters.
    pub fn stats(&self) -> ScaleOutStats {
        let l = &self.inner.leases.counters;
        let s = &self.inner.syncs.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ScaleOutStats {
            leases_taken: get(&l.taken),
            units_leased: get(&l.units),
            units_expired: get(&l.expired),
            units_returned: get(&l.returned),
            leases_refused: get(&l.refused),
            leased_local: get(&l.local),
            leased_dry: get(&l.dry),
            sync_calls: get(&s.calls),
            sync_failures: get(&s.failures),
            units_synced: get(&s.units),
            synced_local: get(&s.local),
            last_sync: get(&s.last_success),
            global_calls: get(&self.inner.global_calls),
            global_failures: get(&self.inner.global_failures),
            global_down: get(&self.inner.global_down_total),
        }
    }

    /// Each limit's counters, by limit id ([`Limit::id`]: a rule file's limit keeps its
    /// id across reloads that change only its numbers).
    pub fn per_limit(&self) -> Vec<(u64, LimitStats)> {
        let mut all: std::collections::HashMap<u64, LimitStats> =
            self.inner.leases.per_limit.snapshot().into_iter().collect();
        for (id, s) in self.inner.syncs.per_limit.snapshot() {
            let t = all.entry(id).or_default();
            t.units_synced += s.units_synced;
            t.sync_calls += s.sync_calls;
            t.sync_failures += s.sync_failures;
        }
        all.into_iter().collect()
    }

    /// Each synced limit's lag at `now`, by limit id: the age of the oldest count one of
    /// its keys in use (decided here within the last two sync intervals) is decided on,
    /// from the sync call (or store decision) that read it. Only limits with a key in
    /// use are listed.
    pub fn sync_lag(&self, now: Nanos) -> Vec<(u64, Nanos)> {
        self.inner.syncs.lag(now)
    }

    /// Leased units in hand at `now`, over every key.
    pub fn units_in_hand(&self, now: Nanos) -> u64 {
        self.inner.leases.in_hand(now)
    }

    /// Units admitted by synced checks and not yet settled with the shared store.
    pub fn units_unsynced(&self) -> u64 {
        self.inner.syncs.unsettled_units()
    }

    /// Pushes the synced keys due at `now` (their `sync_interval` passed since their
    /// last push) and reads their counts back, in one request to the shared store.
    /// Returns how many keys it pushed.
    pub async fn sync(&self, now: Nanos) -> Result<usize, Error> {
        self.push(now, false).await
    }

    /// Pushes every synced key's pending units at once (before stopping).
    pub async fn flush(&self, now: Nanos) -> Result<usize, Error> {
        self.push(now, true).await
    }

    async fn push(&self, now: Nanos, all: bool) -> Result<usize, Error> {
        let syncs = &self.inner.syncs;
        let pushes = syncs.due(now, all);
        if pushes.is_empty() {
            return Ok(0);
        }
        // Shadow checks charged whatever they decide: admitted units are pushed even
        // past the limit, and one key over does not hold back the others.
        let checks: Vec<Check<'_>> = pushes
            .iter()
            .map(|p| {
                Check::new(&p.limit, &*p.key, p.units)
                    .in_shadow()
                    .charging(ChargeRejected::All)
            })
            .collect();
        syncs.counters.calls.fetch_add(1, Ordering::Relaxed);
        // The limits whose keys this call carries, each counted once.
        let mut limits: Vec<u64> = pushes.iter().map(|p| p.limit.id()).collect();
        limits.sort_unstable();
        limits.dedup();
        for &id in &limits {
            syncs.per_limit.add(id, |s| s.sync_calls += 1);
        }
        match self.inner.store.check(now, &checks).await {
            Ok(decisions) if decisions.len() == pushes.len() => {
                for (p, d) in pushes.iter().zip(&decisions) {
                    syncs.settled(p, d, now);
                }
                syncs.counters.last_success.store(now, Ordering::Relaxed);
                Ok(pushes.len())
            }
            Ok(decisions) => {
                self.unsettle(&pushes);
                Err(Error::backend(format!(
                    "the store answered {} decisions to a sync of {} keys",
                    decisions.len(),
                    pushes.len()
                )))
            }
            Err(e) => {
                self.unsettle(&pushes);
                Err(e)
            }
        }
    }

    fn unsettle(&self, pushes: &[sync::Push]) {
        let syncs = &self.inner.syncs;
        syncs.counters.failures.fetch_add(1, Ordering::Relaxed);
        let mut limits: Vec<u64> = pushes.iter().map(|p| p.limit.id()).collect();
        limits.sort_unstable();
        limits.dedup();
        for id in limits {
            syncs.per_limit.add(id, |s| s.sync_failures += 1);
        }
        for p in pushes {
            syncs.unsettled(p);
        }
    }

    /// Forgets keys idle for a while (counting leased units that expired unspent).
    pub fn sweep(&self, now: Nanos) {
        self.inner.leases.sweep(now, IDLE);
        self.inner.syncs.sweep(now, IDLE);
    }

    /// Gives unspent leased units back to the shared store at `now`: of the keys unused
    /// for [`lease::return_after`] their lease period, or (`all`) of every key, before
    /// stopping. Units go out of hand first; a call that fails loses them (they expire in
    /// the store as they would have). Returns the units given back.
    pub async fn give_back_leases(&self, now: Nanos, all: bool) -> u64 {
        use futures_util::StreamExt;
        let leases = &self.inner.leases;
        let returns = leases.returns(now, all);
        if returns.is_empty() {
            return 0;
        }
        let given: Vec<u64> = futures_util::stream::iter(returns)
            .map(|r: lease::Return| async move {
                let check = Check::new(&r.limit, &*r.key, r.units);
                let store = self.store_of(&r.limit);
                match self
                    .call(&r.limit, now, store.give_back(now, check, &r.token))
                    .await
                {
                    Ok(()) => {
                        leases.returned(r.limit.id(), r.units);
                        r.units
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "unspent leased units could not be given back; they expire in the store");
                        0
                    }
                }
            })
            .buffer_unordered(RETURNS_IN_FLIGHT)
            .collect()
            .await;
        given.iter().sum()
    }

    /// Runs synced counting's exchanges, the give-back of idle keys' leased units and the
    /// tables' sweeps on `clock` until `stop` completes, then pushes what is pending and
    /// gives back every unspent leased unit (at most `flush_within`). Spawn it once per
    /// `ScaleOut`.
    pub async fn maintain<C: Clock>(
        &self,
        clock: C,
        stop: impl Future<Output = ()>,
        flush_within: Duration,
    ) {
        tokio::pin!(stop);
        let mut last_sweep = clock.now();
        loop {
            let shortest = self.inner.shortest_interval.load(Ordering::Relaxed);
            let tick = Duration::from_nanos((shortest / 4).clamp(1_000_000, 250_000_000));
            let stopped = tokio::select! {
                () = &mut stop => true,
                () = tokio::time::sleep(tick) => false,
            };
            if stopped {
                break;
            }
            let now = clock.now();
            if let Err(e) = self.sync(now).await {
                tracing::warn!(error = %e, "synced counts could not be exchanged with the store; they are sent again at the next interval");
            }
            if now.saturating_sub(last_sweep) >= 1_000_000_000 {
                self.give_back_leases(now, false).await;
                self.sweep(now);
                last_sweep = now;
            }
        }
        let now = clock.now();
        let flush = async { tokio::join!(self.flush(now), self.give_back_leases(now, true)) };
        match tokio::time::timeout(flush_within, flush).await {
            Ok((synced, returned)) => {
                match synced {
                    Ok(n) if n > 0 => tracing::info!(keys = n, "synced counts sent to the store before stopping"),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "synced counts could not be sent to the store before stopping"),
                }
                if returned > 0 {
                    tracing::info!(units = returned, "unspent leased units given back to the store before stopping");
                }
            }
            Err(_) => tracing::warn!("synced counts and leased units were not all sent to the store before stopping: it did not answer in time"),
        }
    }

    async fn inner_check(
        &self,
        now: Nanos,
        checks: &[Check<'_>],
        budget: Option<Duration>,
    ) -> Result<Vec<Decision>, Error> {
        match budget {
            Some(b) => self.inner.store.check_within(now, checks, b).await,
            None => self.inner.store.check(now, checks).await,
        }
    }

    /// Decides a leased check from units in hand, taking a lease when they run out:
    /// the decision and what it spent; `None` when it must be decided exactly.
    async fn leased(
        &self,
        now: Nanos,
        c: &Check<'_>,
        period: Nanos,
        budget: Option<Duration>,
    ) -> Result<Option<(Decision, Option<Spent>)>, Error> {
        let leases = &self.inner.leases;
        // A global key's lease lasts at least three of the global store's round trips,
        // so that the half of it left when the next is asked for covers that call.
        let period = if self.is_global(c.limit) {
            period.max(
                self.inner
                    .global_rtt
                    .load(Ordering::Relaxed)
                    .saturating_mul(3),
            )
        } else {
            period
        };
        let global = self.is_global(c.limit);
        // A global store farther than a decision can wait for: a hot key's request is
        // not kept waiting for its units (while the store answers; while it fails, the
        // requests that need a lease ask for it themselves, and get the failure mode).
        let rtt = self.inner.global_rtt.load(Ordering::Relaxed);
        let far =
            (global && rtt >= FAR && self.inner.global_down_since.load(Ordering::Relaxed) == 0)
                .then_some(rtt);
        let mut waited = false;
        for turn in 0..5 {
            let local = leases.spend(c.limit, c.key, c.cost, now, period, far);
            // A global key's request that waited for a lease call which got less than
            // it asked for, and finds nothing in hand: the store is out of room for this
            // instance; refused here, not queued behind another distant call.
            if global && waited && matches!(local, lease::Local::Wait(_) | lease::Local::Lease(_)) {
                if let Some(d) = leases.short_refusal(c.limit, c.key, now, period) {
                    if matches!(local, lease::Local::Lease(_)) {
                        leases.failed(c.limit, c.key);
                    }
                    return Ok(Some((d, None)));
                }
            }
            let size = match local {
                lease::Local::Decided(d, spent) => {
                    if self.is_global(c.limit) {
                        self.renew_ahead(c, now, period, far.unwrap_or(0));
                    }
                    return Ok(Some((d, Some(spent))));
                }
                lease::Local::Blocked(d) => return Ok(Some((d, None))),
                lease::Local::Dry(d, lease) => {
                    if let Some(size) = lease {
                        self.lease_behind(c, size, now, period);
                    }
                    return Ok(Some((d, None)));
                }
                lease::Local::Exact => return Ok(None),
                // A fifth turn only spends what the fourth put in hand. (With four, a
                // lease this request took on its last turn was left in hand while the
                // request went to the store exactly: charged twice, and for a global
                // limit not undone when a regional check then rejected the request.)
                lease::Local::Wait(_) if turn == 4 => break,
                lease::Local::Lease(_) if turn == 4 => {
                    leases.failed(c.limit, c.key);
                    break;
                }
                lease::Local::Wait(answered) => {
                    // Counted among the call's waiters until this request looks again,
                    // or is dropped while it waits.
                    let _queued = Queued {
                        leases,
                        limit: c.limit,
                        key: c.key,
                        cost: c.cost,
                    };
                    // While the global store fails, one request per key probes it; the
                    // others get the failure mode at once instead of waiting out its
                    // deadline one after another.
                    if self.is_global(c.limit)
                        && self.inner.global_down_since.load(Ordering::Relaxed) > 0
                    {
                        return Err(Error::backend(
                            "the global store is failing (another request of this key is asking it for a lease)",
                        ));
                    }
                    // A global store is far: its lease call (bounded by its own deadline,
                    // and which always wakes the waiters) is waited for as long as it takes,
                    // rather than each waiter calling it too.
                    let wait = if self.is_global(c.limit) {
                        GLOBAL_LEASE_WAIT
                    } else {
                        LEASE_WAIT
                    };
                    let _ = tokio::time::timeout(wait, answered).await;
                    waited = true;
                    continue;
                }
                lease::Local::Lease(size) => size,
            };
            let mut call = LeaseCall {
                leases,
                limit: c.limit,
                key: c.key,
                answered: false,
            };
            let mut asked = size;
            // A lease is a charge of the shared store by the limit's own algorithm; one
            // that does not fit is asked again smaller, for half of what is left.
            for _ in 0..3 {
                let ask = Check::new(c.limit, c.key, asked);
                // A lease of the request's cost alone is spent at once: nothing of it can
                // go back, and the store may batch it with other requests (a lease that
                // answers a token is a call of its own on Redis).
                let store = self.store_of(c.limit);
                let (d, token) = if asked > c.cost {
                    self.call(c.limit, now, store.lease(now, ask, budget))
                        .await?
                } else {
                    let d = self
                        .call(c.limit, now, within(store, now, &[ask], budget))
                        .await?;
                    (d[0], None)
                };
                if d.allowed {
                    leases.taken(c.limit, c.key, asked, asked, &d, now, period, token);
                    leases.set_short(c.limit, c.key, asked < size);
                    call.answered = true;
                    break;
                }
                let fair = (d.remaining / 2).max(c.cost);
                if d.remaining >= c.cost && fair < asked {
                    asked = fair;
                    continue;
                }
                // No room for this request: refused, as the store would refuse it.
                // (A refusal is timed from its arrival at the store, about half a round
                // trip after it was sent: a key blocked until a retry could pass is not
                // asked again before the window it was refused in has ended there.)
                let at = now.saturating_add(self.half_trip(c.limit));
                leases.taken(c.limit, c.key, asked, 0, &d, at, period, None);
                leases.set_short(c.limit, c.key, true);
                call.answered = true;
                return Ok(Some((d, None)));
            }
            // Granted (or, after three smaller asks that others beat, not: the requests
            // waiting for it then look again, and this one too).
            drop(call);
        }
        Ok(None)
    }

    /// Once half of a global key's last lease is spent, takes the next one in the
    /// background, so that its decisions do not wait on the global store.
    fn renew_ahead(&self, c: &Check<'_>, now: Nanos, period: Nanos, transit: Nanos) {
        // While the global store fails, requests that need a lease ask for it themselves.
        if self.inner.global_down_since.load(Ordering::Relaxed) > 0 {
            return;
        }
        let leases = &self.inner.leases;
        let Some(size) = leases.renew_ahead(c.limit, c.key, now, period, transit) else {
            return;
        };
        self.lease_behind(c, size, now, period);
    }

    /// Takes a lease of `size` units of `c`'s key in the background, its call already
    /// counted as in flight.
    fn lease_behind(&self, c: &Check<'_>, size: u64, now: Nanos, period: Nanos) {
        // Made before the task: a task dropped before it ran still marks the call over.
        let call = Renewal {
            this: self.clone(),
            limit: *c.limit,
            key: c.key.into(),
            answered: false,
        };
        let renewal = async move { call.run(size, now, period).await };
        self.spawn(Box::pin(renewal));
    }

    /// Runs `task` in the background: with the spawner set by [`Self::spawn_with`], else
    /// on the current tokio runtime. Without either it is dropped.
    fn spawn(&self, task: Pin<Box<dyn Future<Output = ()> + Send>>) {
        if let Some(spawn) = self.inner.spawner.get() {
            spawn(task);
        } else if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(task);
        }
    }
}

/// A lease taken ahead of need, in the background: marked over when dropped unanswered
/// (the task failed, or was dropped before it ran), so that requests waiting for it do
/// not wait in vain.
struct Renewal<S: Store + 'static> {
    this: ScaleOut<S>,
    limit: Limit,
    key: Box<[u8]>,
    answered: bool,
}

impl<S: Store + 'static> Drop for Renewal<S> {
    fn drop(&mut self) {
        if !self.answered {
            self.this.inner.leases.failed(&self.limit, &self.key);
        }
    }
}

impl<S: Store + 'static> Renewal<S> {
    /// Takes a lease of `size` units ahead of need (see [`ScaleOut::renew_ahead`]).
    async fn run(mut self, size: u64, now: Nanos, period: Nanos) {
        let (this, limit) = (self.this.clone(), self.limit);
        let key: &[u8] = &self.key.clone();
        let leases = &this.inner.leases;
        let store = this.store_of(&limit);
        let mut asked = size;
        for _ in 0..3 {
            let ask = Check::new(&limit, key, asked);
            match this.call(&limit, now, store.lease(now, ask, None)).await {
                Ok((d, token)) if d.allowed => {
                    leases.taken(&limit, key, asked, asked, &d, now, period, token);
                    leases.set_short(&limit, key, asked < size);
                    self.answered = true;
                    return;
                }
                Ok((d, _)) => {
                    // Less than asked is left: half of it (the last unit too).
                    let fair = (d.remaining / 2).max(d.remaining.min(1));
                    if fair >= 1 && fair < asked {
                        asked = fair;
                        continue;
                    }
                    // No room: the units in hand are still spent; no lease is asked
                    // for again before a retry could pass.
                    let at = now.saturating_add(this.half_trip(&limit));
                    leases.taken(&limit, key, asked, 0, &d, at, period, None);
                    leases.set_short(&limit, key, true);
                    self.answered = true;
                    return;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "a lease ahead of need could not be taken from the global store");
                    return;
                }
            }
        }
    }
}

impl<S: Store + 'static> ScaleOut<S> {
    async fn decide(
        &self,
        now: Nanos,
        checks: &[Check<'_>],
        budget: Option<Duration>,
    ) -> Result<Vec<Decision>, Error> {
        let global = self.inner.global.is_some();
        // The default (every check exact) costs no allocation on its way to the store.
        if checks
            .iter()
            .all(|c| matches!(route(c, global), Route::Exact) && !self.is_global(c.limit))
        {
            return self.inner_check(now, checks, budget).await;
        }
        let routes: Vec<Route> = checks.iter().map(|c| route(c, global)).collect();
        let mut decided: Vec<Option<Decision>> = vec![None; checks.len()];
        let mut undo = Vec::new();
        let mut exact = Vec::new();
        let mut seeds = Vec::new();
        // Charges made in the global store that a rejection of the request takes back.
        let mut far_charges: Vec<(usize, LeaseToken)> = Vec::new();
        for (i, (c, r)) in checks.iter().zip(&routes).enumerate() {
            match *r {
                Route::Exact => exact.push(i),
                Route::Leased(period) => match self.leased(now, c, period, budget).await {
                    Ok(Some((d, spent))) => {
                        decided[i] = Some(d);
                        if let Some(spent) = spent {
                            undo.push(Undo::Lease(i, spent));
                        }
                    }
                    Ok(None) => exact.push(i),
                    Err(e) => {
                        self.give_back(checks, &undo);
                        return Err(e);
                    }
                },
                Route::Synced(interval) => {
                    match self.inner.syncs.decide(c.limit, c.key, c.cost, now) {
                        sync::Local::Decided(d) => {
                            if d.allowed {
                                undo.push(Undo::Sync(i));
                            }
                            decided[i] = Some(d);
                        }
                        sync::Local::Seed => {
                            self.inner
                                .shortest_interval
                                .fetch_min(interval, Ordering::Relaxed);
                            exact.push(i);
                            seeds.push((i, interval));
                        }
                        sync::Local::Exact => exact.push(i),
                    }
                }
            }
        }
        if !exact.is_empty() {
            // Rejected already by a local check: the exact checks are only read.
            let rejected = rejects_by(
                checks
                    .iter()
                    .zip(&decided)
                    .filter_map(|(c, d)| d.map(|d| (c.shadow, c.quota, d.allowed))),
            );
            // The global limits' exact checks go first, to the global store; when they
            // reject the request, the regional ones are only read.
            let (far, near): (Vec<usize>, Vec<usize>) = exact
                .iter()
                .partition(|&&i| self.is_global(checks[i].limit));
            let mut rejected = rejected;
            for (part, is_far) in [(far, true), (near, false)] {
                if part.is_empty() {
                    continue;
                }
                let subset: Vec<Check<'_>> = part
                    .iter()
                    .map(|&i| {
                        let mut c = checks[i];
                        if rejected {
                            c.cost = 0;
                        }
                        c
                    })
                    .collect();
                let answered = if is_far {
                    self.far_exact(now, &part, &subset, budget, &mut far_charges)
                        .await
                } else {
                    self.inner_check(now, &subset, budget).await
                };
                match answered {
                    Ok(answers) => {
                        for (&i, d) in part.iter().zip(answers) {
                            decided[i] = Some(d);
                        }
                    }
                    Err(e) => {
                        self.give_back(checks, &undo);
                        self.refund_far(now, checks, &far_charges);
                        return Err(e);
                    }
                }
                if is_far {
                    rejected = rejected
                        || rejects_by(part.iter().filter_map(|&i| {
                            // (Quota groups are judged over the whole request, below.)
                            let c = &checks[i];
                            decided[i]
                                .filter(|_| c.quota.is_none())
                                .map(|d| (c.shadow, None, d.allowed))
                        }));
                }
            }
            // What the store charged each seed: nothing when the request was rejected
            // (by a local check, then its exact checks were only read, or by the store).
            let request_rejected =
                rejected || rejects(checks, |i| decided[i].is_some_and(|d| d.allowed));
            for (i, interval) in seeds {
                if let Some(d) = &decided[i] {
                    let charged = if request_rejected || !d.allowed {
                        0
                    } else {
                        checks[i].cost
                    };
                    self.inner.syncs.seed(
                        checks[i].limit,
                        checks[i].key,
                        d,
                        charged,
                        now,
                        interval,
                    );
                }
            }
        }
        let mut decisions: Vec<Decision> =
            decided.into_iter().map(Option::unwrap_or_default).collect();
        if rejects(checks, |i| decisions[i].allowed) {
            for u in &undo {
                let i = match u {
                    Undo::Lease(i, _) | Undo::Sync(i) => *i,
                };
                decisions[i].remaining = decisions[i].remaining.saturating_add(checks[i].cost);
            }
            self.give_back(checks, &undo);
            let taken: Vec<(usize, LeaseToken)> = far_charges
                .into_iter()
                .filter(|(i, _)| checks[*i].charge != ChargeRejected::All)
                .collect();
            self.refund_far(now, checks, &taken);
        }
        Ok(decisions)
    }

    /// Decides the exact checks of global limits (`part`, indexes into the request's
    /// checks, and `subset`, those checks as they are to be charged) in the global
    /// store. Each that charges a plain count is taken as a lease of its cost, whose
    /// token `charges` keeps, so that the charge can be given back if the request is
    /// rejected after all (by a regional limit); the rest (reads, quota groups) go in
    /// one call.
    async fn far_exact(
        &self,
        now: Nanos,
        part: &[usize],
        subset: &[Check<'_>],
        budget: Option<Duration>,
        charges: &mut Vec<(usize, LeaseToken)>,
    ) -> Result<Vec<Decision>, Error> {
        let global = self.store_of(subset[0].limit);
        let (single, batch): (Vec<usize>, Vec<usize>) = (0..subset.len()).partition(|&j| {
            let c = &subset[j];
            c.cost > 0 && c.quota.is_none() && c.charge != ChargeRejected::All
        });
        let mut answers = vec![Decision::default(); subset.len()];
        if !batch.is_empty() {
            let checks: Vec<Check<'_>> = batch.iter().map(|&j| subset[j]).collect();
            let decided = self
                .call(subset[0].limit, now, within(global, now, &checks, budget))
                .await?;
            for (&j, d) in batch.iter().zip(decided) {
                answers[j] = d;
            }
        }
        for j in single {
            let c = subset[j];
            // Charged as a lease (only if admitted); an `over_limit` check the store
            // rejects is then charged anyway, as it would have been.
            let plain = Check {
                charge: ChargeRejected::None,
                ..c
            };
            // (On an error, the caller gives back the charges made so far.)
            let (mut d, token) = self
                .call(c.limit, now, global.lease(now, plain, budget))
                .await?;
            if let (true, Some(token)) = (d.allowed, token) {
                charges.push((part[j], token));
            }
            if !d.allowed && c.charge == ChargeRejected::OverLimit {
                d = self
                    .call(c.limit, now, within(global, now, &[c], budget))
                    .await?[0];
            }
            answers[j] = d;
        }
        Ok(answers)
    }

    /// Gives back to the global store, in the background, the charges of a request that
    /// was rejected after they were made.
    fn refund_far(&self, now: Nanos, checks: &[Check<'_>], charges: &[(usize, LeaseToken)]) {
        if charges.is_empty() {
            return;
        }
        let refunds: Vec<(Limit, Box<[u8]>, u64, LeaseToken)> = charges
            .iter()
            .map(|(i, token)| {
                let c = &checks[*i];
                (*c.limit, c.key.into(), c.cost, token.clone())
            })
            .collect();
        for (limit, _, cost, _) in &refunds {
            self.inner
                .leases
                .per_limit
                .add(limit.id(), |s| s.units_refunded += cost);
        }
        let this = self.clone();
        self.spawn(Box::pin(async move {
            for (limit, key, cost, token) in &refunds {
                let store = this.store_of(limit);
                let check = Check::new(limit, &**key, *cost);
                if let Err(e) = this.call(limit, now, store.give_back(now, check, token)).await {
                    tracing::debug!(error = %e, "a rejected request's charge could not be given back to the global store; it expires");
                }
            }
        }));
    }

    fn give_back(&self, checks: &[Check<'_>], undo: &[Undo]) {
        for u in undo {
            match u {
                Undo::Lease(i, spent) => {
                    let c = &checks[*i];
                    self.inner.leases.give_back(c.limit, c.key, spent);
                }
                Undo::Sync(i) => {
                    let c = &checks[*i];
                    self.inner.syncs.give_back(c.limit, c.key, c.cost);
                }
            }
        }
    }
}

/// `checks` decided by `store` at `now`, within `budget` if one is given.
async fn within<S: Store>(
    store: &S,
    now: Nanos,
    checks: &[Check<'_>],
    budget: Option<Duration>,
) -> Result<Vec<Decision>, Error> {
    match budget {
        Some(b) => store.check_within(now, checks, b).await,
        None => store.check(now, checks).await,
    }
}

impl<S: Store + 'static> Store for ScaleOut<S> {
    async fn check(&self, now: Nanos, checks: &[Check<'_>]) -> Result<Vec<Decision>, Error> {
        self.decide(now, checks, None).await
    }

    async fn check_within(
        &self,
        now: Nanos,
        checks: &[Check<'_>],
        budget: Duration,
    ) -> Result<Vec<Decision>, Error> {
        self.decide(now, checks, Some(budget)).await
    }
}
