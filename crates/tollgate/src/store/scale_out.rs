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

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::lease::{self, Leases, Spent};
use super::per_limit::LimitStats;
use super::sync::{self, Syncs};
use super::{rejects, rejects_by, ChargeRejected, Check, Error, Store};
use crate::algorithm::{Consistency, Limit};
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
    leases: Leases,
    syncs: Syncs,
    /// The shortest `sync_interval` of a key seen so far (ns).
    shortest_interval: AtomicU64,
}

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
}

/// Where a check is decided.
#[derive(Debug, Clone, Copy)]
enum Route {
    Exact,
    Leased(Nanos),
    Synced(Nanos),
}

fn route(c: &Check<'_>) -> Route {
    if c.cost == 0
        || c.quota.is_some()
        || c.charge != ChargeRejected::None
        || c.limit.consistency_conflict().is_some()
    {
        return Route::Exact;
    }
    match c.limit.consistency() {
        Consistency::Exact => Route::Exact,
        Consistency::Leased { period } => Route::Leased(period.max(1)),
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

impl Drop for LeaseCall<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.leases.failed(self.limit, self.key);
        }
    }
}

impl<S: Store> ScaleOut<S> {
    /// Leased and synced counting in front of `store`, each keeping at most
    /// [`DEFAULT_MAX_KEYS`] keys.
    pub fn new(store: S) -> Self {
        Self::with_max_keys(store, DEFAULT_MAX_KEYS)
    }

    /// As [`new`](Self::new), each table keeping at most about `max_keys` keys.
    pub fn with_max_keys(store: S, max_keys: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                store,
                leases: Leases::new(max_keys),
                syncs: Syncs::new(max_keys),
                shortest_interval: AtomicU64::new(u64::MAX),
            }),
        }
    }

    /// The shared store.
    pub fn store(&self) -> &S {
        &self.inner.store
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
            sync_calls: get(&s.calls),
            sync_failures: get(&s.failures),
            units_synced: get(&s.units),
            synced_local: get(&s.local),
            last_sync: get(&s.last_success),
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
        let store = &self.inner.store;
        let given: Vec<u64> = futures_util::stream::iter(returns)
            .map(|r: lease::Return| async move {
                let check = Check::new(&r.limit, &*r.key, r.units);
                match store.give_back(now, check, &r.token).await {
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
        for _ in 0..4 {
            let size = match leases.spend(c.limit, c.key, c.cost, now, period) {
                lease::Local::Decided(d, spent) => return Ok(Some((d, Some(spent)))),
                lease::Local::Blocked(d) => return Ok(Some((d, None))),
                lease::Local::Exact => return Ok(None),
                lease::Local::Wait(answered) => {
                    let _ = tokio::time::timeout(LEASE_WAIT, answered).await;
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
                let (d, token) = if asked > c.cost {
                    self.inner.store.lease(now, ask, budget).await?
                } else {
                    (self.inner_check(now, &[ask], budget).await?[0], None)
                };
                if d.allowed {
                    leases.taken(c.limit, c.key, asked, asked, &d, now, period, token);
                    call.answered = true;
                    break;
                }
                let fair = (d.remaining / 2).max(c.cost);
                if d.remaining >= c.cost && fair < asked {
                    asked = fair;
                    continue;
                }
                // No room for this request: refused, as the store would refuse it.
                leases.taken(c.limit, c.key, asked, 0, &d, now, period, None);
                call.answered = true;
                return Ok(Some((d, None)));
            }
            // Granted (or, after three smaller asks that others beat, not: the requests
            // waiting for it then look again, and this one too).
            drop(call);
        }
        Ok(None)
    }

    async fn decide(
        &self,
        now: Nanos,
        checks: &[Check<'_>],
        budget: Option<Duration>,
    ) -> Result<Vec<Decision>, Error> {
        // The default (every check exact) costs no allocation on its way to the store.
        if checks.iter().all(|c| matches!(route(c), Route::Exact)) {
            return self.inner_check(now, checks, budget).await;
        }
        let routes: Vec<Route> = checks.iter().map(route).collect();
        let mut decided: Vec<Option<Decision>> = vec![None; checks.len()];
        let mut undo = Vec::new();
        let mut exact = Vec::new();
        let mut seeds = Vec::new();
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
            let subset: Vec<Check<'_>> = exact
                .iter()
                .map(|&i| {
                    let mut c = checks[i];
                    if rejected {
                        c.cost = 0;
                    }
                    c
                })
                .collect();
            match self.inner_check(now, &subset, budget).await {
                Ok(answers) => {
                    for (&i, d) in exact.iter().zip(answers) {
                        decided[i] = Some(d);
                    }
                }
                Err(e) => {
                    self.give_back(checks, &undo);
                    return Err(e);
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
        }
        Ok(decisions)
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

impl<S: Store> Store for ScaleOut<S> {
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
