//! Leased counting (`consistency: leased`): blocks of units an instance took from the
//! shared store, spent locally, never more than the limit allows.
//!
//! A lease is taken by charging the shared store, with the limit's own exact algorithm,
//! for as many units as fit (up to the size asked): so all instances together never
//! hold more than the limit has room for. What this module adds is when a unit in hand
//! may still be spent:
//! - **fixed window**: until the window it was charged in ends (the instant the store
//!   answered as `reset_after`, counted from before the call was sent);
//! - **token bucket, GCRA, leaky bucket (meter)**: a bucket refills whether its tokens
//!   are spent or not, so a unit charged at `t0` and spent later could let a refilled
//!   bucket be spent twice. A lease whose charge left the bucket full again at `X` may
//!   spend at `t` at most `(X − t) × limit / window` of its units (the debt its charge
//!   still holds), and the rest expire. Summed over every lease of every instance, what
//!   is in hand then never exceeds what the shared bucket is short of full, so admitting
//!   from leases is admitting from the bucket itself.
//!
//! A refused lease is not asked again before a retry could pass (a window's end), nor
//! (for a bucket, whose refill waits in it) within `lease_period`; meanwhile the key is
//! refused locally.
//!
//! A lease's size follows the key's own recent rate on this instance (about
//! `lease_period` worth, or half the rest of a fixed window if less; at least the request's
//! cost, at most four times the last lease and half of what the store said was left), so
//! a hot key costs the store about one call per `lease_period` and a cold key one call
//! per decision. The request that takes a lease may spend all of it at once (the store
//! has just decided it); a bucket lease's decay starts after. Leases are spent
//! oldest first and kept apart (each with its own expiry) so that the bound above holds.
//!
//! Unspent units go back to the shared store ([`Leases::returns`], then
//! [`Store::give_back`](super::Store::give_back)) when a key goes idle here and when the
//! instance stops: a fixed window's count goes down by them while the window lasts; a
//! bucket's newest lease goes back only while nothing has charged the bucket since (a
//! lease on top of it holds the slice above), and older ones decay as before. A unit is
//! taken out of hand before it is given back, so it is never both spent here and
//! leased again elsewhere.

use std::collections::{HashMap, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::per_limit::PerLimit;
use super::LeaseToken;
use crate::algorithm::{Algorithm, Limit};
use crate::clock::Nanos;
use crate::decision::Decision;

/// How many leases an instance keeps in hand per key at most; a further lease waits
/// until one is spent or expired.
const MAX_LEASES_PER_KEY: usize = 4;

/// One block of units in hand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Which lease of its key this is (to give units back to it).
    pub seq: u64,
    /// Units not yet spent.
    pub units: u64,
    /// When its units expire: the window's end, or for a bucket the instant the charge
    /// left it full again.
    pub until: Nanos,
    /// A bucket's lease: what may be spent shrinks at the refill rate until `until`.
    pub decays: bool,
    /// When its call was sent: at that instant (the request that took it) all of it may
    /// be spent, as the store just decided it.
    pub from: Nanos,
    /// The refill rate, `limit` units per `window` (used when `decays`).
    pub limit: u64,
    /// See `limit`.
    pub window: Nanos,
    /// What the store answered with the charge, to give unspent units back with (`None`:
    /// the store cannot).
    pub token: Option<LeaseToken>,
}

impl Lease {
    /// A lease of `units` for `limit`, taken by a call sent at `sent`, whose answer said
    /// the key is fresh again `reset_after` later.
    pub fn new(limit: &Limit, seq: u64, units: u64, sent: Nanos, reset_after: Nanos) -> Self {
        Self {
            seq,
            units,
            // `reset_after` is rounded up to the nanosecond: 1 ns less is never late.
            until: sent.saturating_add(reset_after.saturating_sub(1)),
            decays: decays(limit),
            from: sent,
            limit: limit.limit(),
            window: limit.window(),
            token: None,
        }
    }

    /// Drops the units that can no longer be spent at `now` for good (a bucket's lease
    /// past the debt its charge still holds, any lease past its end), returning how many.
    /// A unit beyond the debt must never come back into reach by spending others: once
    /// over, it is gone.
    pub fn settle(&mut self, now: Nanos) -> u64 {
        let usable = self.usable(now);
        let lost = self.units - usable;
        self.units = usable;
        lost
    }

    /// The units that may be spent at `now`.
    pub fn usable(&self, now: Nanos) -> u64 {
        if now >= self.until {
            return 0;
        }
        if !self.decays || now <= self.from {
            return self.units;
        }
        let held = u128::from(self.until - now) * u128::from(self.limit) / u128::from(self.window);
        self.units.min(u64::try_from(held).unwrap_or(u64::MAX))
    }
}

/// How long a refused bucket lease keeps its key refused here: until a retry could pass
/// and at least a lease `period`, but at most half the time the bucket of `burst`,
/// refilled `limit` per `window`, takes to fill.
fn bucket_wait(d: &Decision, period: Nanos, burst: u64, limit: u64, window: Nanos) -> Nanos {
    let fill = u128::from(burst) * u128::from(window) / u128::from(limit.max(1));
    let half = u64::try_from(fill / 2).unwrap_or(u64::MAX);
    d.retry_after.max(period).min(half.max(d.retry_after))
}

/// Whether a limit's leases shrink as its bucket refills (every algorithm but the fixed
/// window that can be leased).
fn decays(limit: &Limit) -> bool {
    !matches!(limit.algorithm(), Algorithm::FixedWindow(_))
}

/// The size of the next lease of a key: about `horizon` worth (the lease period, or
/// what is left of a fixed window if less) at the rate the key was used on this instance
/// (`demand` units in the `elapsed` since the last lease was sized), at least `cost`, at
/// most four times the `last` size asked and half of what the store said was `left`, and
/// never more than the limit.
pub fn next_size(
    cost: u64,
    last: u64,
    demand: u64,
    elapsed: Nanos,
    horizon: Nanos,
    left: Option<u64>,
    limit: u64,
) -> u64 {
    if last == 0 {
        // A key this instance has not leased before: one decision's worth, as an exact
        // store would charge it.
        return cost;
    }
    let rate = u128::from(demand) * u128::from(horizon) / u128::from(elapsed.max(1));
    let mut size = u64::try_from(rate).unwrap_or(u64::MAX);
    size = size.min(last.saturating_mul(4));
    if let Some(left) = left {
        size = size.min(left / 2);
    }
    size.min(limit).max(cost)
}

/// Units spent from a key's leases by one check, to give back if its request is
/// rejected.
#[derive(Debug, Default)]
pub struct Spent {
    /// Each lease spent from, as it was but for its token, with the units taken from it.
    pieces: Vec<Lease>,
}

/// What an instance knows of one key of one limit.
#[derive(Debug)]
struct Entry {
    limit: Limit,
    key: Box<[u8]>,
    leases: VecDeque<Lease>,
    next_seq: u64,
    /// The size of the last lease asked for (0: none yet).
    size: u64,
    /// When the key's rate was last measured (its last lease sized): `spent` and
    /// `demand` count from then. Measured from one sizing to the next, not from a lease's
    /// answer, the rate is the key's own whatever the store's round trip: counted from
    /// the call's sending, spending that waits for the answer would make a far store's
    /// leases shrink until they no longer cover the round trip.
    since: Nanos,
    /// Units spent here since then, and units refused for want of them in hand while the
    /// store may have had room ([`Local::Dry`]).
    spent: u64,
    /// Units asked for (spent, or refused while the key was refused here) since then.
    demand: u64,
    /// What the store said was left after the last lease.
    left: Option<u64>,
    /// The key is over its limit: leases are not asked for again before this.
    blocked_until: Nanos,
    /// The decision that blocked it, for the requests it turns away.
    blocked: Option<Decision>,
    /// When the key's state is fresh again, as the last lease's answer said.
    reset_at: Nanos,
    last_used: Nanos,
    /// The lease period the key was last leased with.
    period: Nanos,
    /// A lease call in flight: other requests wait for it instead of calling too.
    leasing: Option<Arc<tokio::sync::Notify>>,
    /// The size the key's rate asked for at the last lease call, before what the store
    /// said was left capped it.
    want: u64,
    /// The last lease call got less than it first asked for (or nothing): the store is
    /// short of room for this key.
    short: bool,
    /// Units of the requests waiting for the lease call in flight.
    queued: u64,
}

impl Entry {
    /// The size of this key's next lease at `now`, for a request that needs `need`
    /// units more than are in hand.
    /// Starts this key's next lease call at `now`, for a request that needs `need`
    /// units more than are in hand: the call counted as in flight, the key's rate
    /// measured anew from now. Returns the lease's size.
    /// `transit`: the store's round trip when it is far (else 0).
    fn start_lease(&mut self, need: u64, now: Nanos, period: Nanos, transit: Nanos) -> u64 {
        let (size, want) = self.next_lease(need, now, period, transit);
        self.want = want;
        self.since = now;
        self.spent = 0;
        self.demand = 0;
        self.leasing = Some(Arc::new(tokio::sync::Notify::new()));
        size
    }

    fn next_lease(&self, need: u64, now: Nanos, period: Nanos, transit: Nanos) -> (u64, u64) {
        let limit = &self.limit;
        // A fixed window that has turned since the last lease: what the store said was
        // left was the old window's, and the key's demand (spent, or refused while the
        // old window was full) is the rate to lease the new one at.
        let turned = matches!(limit.algorithm(), Algorithm::FixedWindow(_))
            && self.size > 0
            && now >= self.reset_at;
        // A fixed window's units expire with it: lease no more than half its rest is
        // likely to spend, so that leases shrink as the end nears and little is left in
        // hand when it comes. Windows follow each other, so a new one ends a whole number
        // of windows after the last one seen.
        let horizon = match limit.algorithm() {
            Algorithm::FixedWindow(w) if self.size > 0 => {
                let end = if now < self.reset_at {
                    self.reset_at
                } else {
                    let turns = (now - self.reset_at) / w.window.max(1) + 1;
                    self.reset_at.saturating_add(turns.saturating_mul(w.window))
                };
                period.min((end - now) / 2)
            }
            _ => period,
        };
        // A window's leases follow what the key spent within it (a window that fills
        // turns its demand away until it ends); a bucket's, and a new window's, follow
        // what it was asked for, which goes on while a refused bucket refills.
        let used = if decays(limit) || turned {
            self.demand
        } else {
            self.spent
        };
        let elapsed = now.saturating_sub(self.since);
        // The growth cap follows the size the rate asked for, not one that what was left
        // shrank (a window's last leases are small; the next window's need not be).
        let last = self.size.max(self.want);
        let left = if turned { None } else { self.left };
        // What the rate asks for: the growth cap of the next lease. From a far store,
        // over a whole period, which a window's nearing end (a short horizon) does not
        // shrink: the new window's first lease, asked for while requests are refused,
        // then need not grow back from the old window's last small ones. (From a near
        // store, over the horizon: a lease grows at most fourfold per call from what the
        // last one was sized for, whatever its rate seemed over a short while.)
        let reach = if transit > 0 { period } else { horizon };
        let want = next_size(need, last, used, elapsed, reach, None, limit.limit());
        let mut size = next_size(need, last, used, elapsed, horizon, None, limit.limit());
        if decays(limit) && last > 0 {
            // A bucket's lease is worth what its charge still holds: from the call's
            // sending (as this instance reckons it) the bucket refills, and the lease
            // shrinks with it, by a round trip's refill before it lands, and by another
            // before the next lease (asked for about when it lands) lands in turn. A far
            // store's leases carry those two on top, or a key used below the refill rate
            // would find its leases spent by refilling before its requests spend them.
            let refill = 2 * u128::from(transit) * u128::from(limit.limit())
                / u128::from(limit.window().max(1));
            size = size.saturating_add(u64::try_from(refill).unwrap_or(u64::MAX));
        }
        if let Some(left) = left {
            size = size.min(left / 2);
        }
        (size.min(limit.limit()).max(need), want)
    }
}

/// Unspent units of one lease, out of hand, to give back to the shared store
/// ([`Leases::returns`]).
#[derive(Debug, Clone)]
pub struct Return {
    /// The limit.
    pub limit: Limit,
    /// The runtime key.
    pub key: Box<[u8]>,
    /// Units to give back.
    pub units: u64,
    /// The lease's token.
    pub token: LeaseToken,
}

/// How long a key with units in hand must go unused before they go back to the shared
/// store: four lease periods, at least a second.
pub fn return_after(period: Nanos) -> Nanos {
    period.saturating_mul(4).max(1_000_000_000)
}

/// What a check may do with a key's leases at `now`.
pub enum Local {
    /// Decided from the units in hand.
    Decided(Decision, Spent),
    /// The key is over its limit (a lease was refused a moment ago).
    Blocked(Decision),
    /// Another request of this instance is taking a lease: wait for it, then try again.
    Wait(tokio::sync::futures::OwnedNotified),
    /// No unit in hand: take a lease of this size (the caller must then call
    /// [`Leases::taken`] or [`Leases::failed`]).
    Lease(u64),
    /// A hot key far from its store has nothing in hand: the request is refused at once
    /// (this decision) rather than wait a round trip. With `Some(size)`, no lease call
    /// was in flight: one of that size is now counted as in flight, for the caller to
    /// take in the background (then [`Leases::taken`] or [`Leases::failed`]).
    Dry(Decision, Option<u64>),
    /// The table is full: decide this check in the shared store.
    Exact,
}

/// Counters of leased counting.
#[derive(Debug, Default)]
pub struct LeaseCounters {
    /// Leases granted (some units).
    pub taken: AtomicU64,
    /// Units granted by leases.
    pub units: AtomicU64,
    /// Units that expired unspent (a window ended, a bucket refilled past them, the key
    /// went idle): the cause of under-admission.
    pub expired: AtomicU64,
    /// Lease calls the store refused for want of room.
    pub refused: AtomicU64,
    /// Unspent units given back to the store (a key gone idle, the instance stopping).
    pub returned: AtomicU64,
    /// Checks decided from units in hand.
    pub local: AtomicU64,
    /// Checks of a hot key far from its store refused at once with nothing in hand
    /// ([`Local::Dry`]).
    pub dry: AtomicU64,
}

/// Every key's leases on this instance, in shards.
pub struct Leases {
    shards: Box<[Mutex<HashMap<u64, Entry>>]>,
    per_shard: usize,
    /// The counters.
    pub counters: LeaseCounters,
    /// The counters per limit.
    pub(crate) per_limit: PerLimit,
}

impl Leases {
    /// A table of at most about `max_keys` keys.
    pub fn new(max_keys: usize) -> Self {
        let n = 16;
        Self {
            shards: (0..n).map(|_| Mutex::new(HashMap::new())).collect(),
            per_shard: (max_keys / n).max(1),
            counters: LeaseCounters::default(),
            per_limit: PerLimit::default(),
        }
    }

    fn shard(&self, fp: u64) -> &Mutex<HashMap<u64, Entry>> {
        &self.shards[(fp as usize) % self.shards.len()]
    }

    /// What `cost` of `key` under `limit` (leased every `period`) may do at `now`.
    /// `far`: the store is a round trip of that long away and too far to wait for, so a
    /// hot key (see [`Local::Dry`]) with nothing in hand is refused at once.
    pub fn spend(
        &self,
        limit: &Limit,
        key: &[u8],
        cost: u64,
        now: Nanos,
        period: Nanos,
        far: Option<Nanos>,
    ) -> Local {
        let fp = fingerprint(limit, key);
        let mut shard = self.shard(fp).lock();
        if !shard.contains_key(&fp) && shard.len() >= self.per_shard {
            return Local::Exact;
        }
        let e = shard.entry(fp).or_insert_with(|| Entry {
            limit: *limit,
            key: key.into(),
            leases: VecDeque::new(),
            next_seq: 0,
            size: 0,
            since: now,
            spent: 0,
            demand: 0,
            left: None,
            blocked_until: 0,
            blocked: None,
            reset_at: now,
            last_used: now,
            period,
            leasing: None,
            want: 0,
            short: false,
            queued: 0,
        });
        if e.limit != *limit || *e.key != *key {
            // Two keys with one fingerprint: the later is decided exactly.
            return Local::Exact;
        }
        e.last_used = now;
        e.period = period;
        let expired = drop_spent(&mut e.leases, now);
        self.expired(limit.id(), expired);
        let usable: u64 = e.leases.iter().map(|l| l.usable(now)).sum();
        if usable >= cost {
            let mut spent = Spent::default();
            let mut need = cost;
            for l in e.leases.iter_mut() {
                if need == 0 {
                    break;
                }
                let take = l.usable(now).min(need);
                if take > 0 {
                    l.units -= take;
                    need -= take;
                    spent.pieces.push(Lease {
                        units: take,
                        token: None,
                        ..*l
                    });
                }
            }
            e.spent = e.spent.saturating_add(cost);
            e.demand = e.demand.saturating_add(cost);
            self.counters.local.fetch_add(1, Ordering::Relaxed);
            let in_hand: u64 = e.leases.iter().map(|l| l.usable(now)).sum();
            let remaining = e
                .left
                .unwrap_or(0)
                .saturating_add(in_hand)
                .min(limit.limit());
            let d = Decision::allow(limit.limit(), remaining, e.reset_at.saturating_sub(now));
            return Local::Decided(d, spent);
        }
        if now < e.blocked_until {
            e.demand = e.demand.saturating_add(cost);
            if let Some(mut d) = e.blocked {
                d.retry_after = d.retry_after.min(e.blocked_until - now).max(1);
                d.reset_after = e.reset_at.saturating_sub(now);
                return Local::Blocked(d);
            }
        }
        if e.blocked.take().is_some() {
            // What was left when the key was refused says nothing of what is left now.
            e.left = None;
        }
        // A hot key (leased more than one unit at a time) far from its store: waiting a
        // round trip for units would cost its request more than the decision itself.
        // Its lease is renewed ahead of need, so finding nothing in hand means its
        // demand outran the lease, or the store is short of room: refused here, its
        // demand counted so that the next lease covers it.
        if let Some(rtt) = far.filter(|_| e.size.max(e.want) >= 2 && cost <= limit.limit()) {
            e.demand = e.demand.saturating_add(cost);
            e.spent = e.spent.saturating_add(cost);
            self.counters.dry.fetch_add(1, Ordering::Relaxed);
            let window = match limit.algorithm() {
                Algorithm::FixedWindow(w) => Some(w.window.max(1)),
                _ => None,
            };
            // A fixed window that ended (as this instance reckons it) moments ago: the
            // store's may not have ended yet when a call sent now reaches it (the end was
            // reckoned from when the last call was sent, the store's clock read about
            // half a round trip later). A call that arrived before it would lease the old
            // window's last moments and need another round trip: it is sent an eighth of
            // a round trip later.
            let turning = window.is_some() && e.size > 0 && now >= e.reset_at;
            let reset = match window {
                Some(w) if turning => w - (now - e.reset_at) % w,
                _ => e.reset_at.saturating_sub(now),
            };
            let d = Decision::reject(limit.limit(), usable, reset, rtt.max(1));
            if e.leasing.is_some()
                || e.leases.len() >= MAX_LEASES_PER_KEY
                || (turning && now < e.reset_at.saturating_add(rtt / 8))
            {
                return Local::Dry(d, None);
            }
            let size = e.start_lease(cost.saturating_sub(usable), now, period, rtt);
            return Local::Dry(d, Some(size));
        }
        if let Some(n) = &e.leasing {
            // Counted among the waiters until it looks again ([`Leases::unqueue`]), so
            // that the next lease covers it.
            e.queued = e.queued.saturating_add(cost);
            // Made under the lock: the lease's answer, which wakes it, takes the lock too.
            return Local::Wait(Arc::clone(n).notified_owned());
        }
        if e.leases.len() >= MAX_LEASES_PER_KEY {
            return Local::Exact;
        }
        // Enough for this request and for the requests waiting for the call in flight,
        // which find nothing in hand after it.
        let need = cost
            .saturating_sub(usable)
            .saturating_add(e.queued.min(limit.limit()));
        Local::Lease(e.start_lease(need, now, period, far.unwrap_or(0)))
    }

    /// Whether to take `key`'s next lease now, ahead of need (a global limit, whose
    /// store is far): once less than half of the last lease is left in hand, no lease
    /// call is in flight and the key is not refused. Returns its size, the call then
    /// counted as in flight (the caller must call [`Leases::taken`] or
    /// [`Leases::failed`]). A key leased one unit at a time (a cold key) is not renewed
    /// ahead: its next request may never come.
    /// `transit`: the store's round trip when it is far (else 0).
    pub fn renew_ahead(
        &self,
        limit: &Limit,
        key: &[u8],
        now: Nanos,
        period: Nanos,
        transit: Nanos,
    ) -> Option<u64> {
        let fp = fingerprint(limit, key);
        let mut shard = self.shard(fp).lock();
        let e = shard.get_mut(&fp)?;
        if e.limit != *limit
            || *e.key != *key
            || e.leasing.is_some()
            || e.size < 2
            // A lease taken by this very request says nothing of the key's rate yet.
            || now <= e.since
            || now < e.blocked_until
            || e.leases.len() >= MAX_LEASES_PER_KEY
        {
            return None;
        }
        let usable: u64 = e.leases.iter().map(|l| l.usable(now)).sum();
        if usable.saturating_mul(2) >= e.size {
            return None;
        }
        Some(e.start_lease(1, now, period, transit))
    }

    /// A request that waited for `key`'s lease call (its `cost` counted by
    /// [`Leases::spend`]) is no longer waiting.
    pub fn unqueue(&self, limit: &Limit, key: &[u8], cost: u64) {
        let fp = fingerprint(limit, key);
        if let Some(e) = self.shard(fp).lock().get_mut(&fp) {
            e.queued = e.queued.saturating_sub(cost);
        }
    }

    /// Records whether the last lease call of `key` got less than it first asked for.
    pub fn set_short(&self, limit: &Limit, key: &[u8], short: bool) {
        let fp = fingerprint(limit, key);
        if let Some(e) = self.shard(fp).lock().get_mut(&fp) {
            e.short = short;
        }
    }

    /// A refusal for a request that waited for a lease call of `key` and still finds no
    /// unit in hand, when that call got less than it asked for: the store had no more
    /// room for this instance then, so the request is refused here rather than queued
    /// behind another call. `None`: it may ask again.
    pub fn short_refusal(
        &self,
        limit: &Limit,
        key: &[u8],
        now: Nanos,
        period: Nanos,
    ) -> Option<Decision> {
        let fp = fingerprint(limit, key);
        let shard = self.shard(fp).lock();
        let e = shard.get(&fp)?;
        if e.limit != *limit || *e.key != *key || !e.short {
            return None;
        }
        let reset = e.reset_at.saturating_sub(now);
        let retry = match limit.algorithm() {
            Algorithm::FixedWindow(_) => period.min(reset),
            _ => period,
        };
        Some(Decision::reject(limit.limit(), 0, reset, retry.max(1)))
    }

    /// A lease call sent at `sent` for `asked` units answered `d` (charged with `units`,
    /// or refused when `units` is 0) and `token`: the units go in hand, or the key is
    /// blocked until a retry could pass (at most one `period`). Wakes the requests that
    /// waited.
    #[allow(clippy::too_many_arguments)]
    pub fn taken(
        &self,
        limit: &Limit,
        key: &[u8],
        asked: u64,
        units: u64,
        d: &Decision,
        sent: Nanos,
        period: Nanos,
        token: Option<LeaseToken>,
    ) {
        let fp = fingerprint(limit, key);
        let mut shard = self.shard(fp).lock();
        let Some(e) = shard.get_mut(&fp) else { return };
        if let Some(n) = e.leasing.take() {
            n.notify_waiters();
        }
        e.reset_at = sent.saturating_add(d.reset_after);
        if units == 0 {
            self.counters.refused.fetch_add(1, Ordering::Relaxed);
            self.per_limit.add(limit.id(), |s| s.leases_refused += 1);
            // Not asked again for a while. A bucket refused now refills for the whole
            // fleet, and what it refills waits in it (it is far from full): asking once a
            // period loses nothing and keeps a saturated key at about a call per instance
            // per period. A window's units come back only when it ends (leases are never
            // given back, and a rule change makes another limit): not before then.
            let wait = match limit.algorithm() {
                // Never so long that the bucket could fill meanwhile (its refill past
                // full would be lost): at most half the time it takes to fill.
                Algorithm::TokenBucket(b) => bucket_wait(d, period, b.burst, b.limit, b.window),
                Algorithm::Gcra(b) => bucket_wait(d, period, b.burst, b.limit, b.window),
                Algorithm::LeakyBucket(b) => bucket_wait(d, period, b.burst, b.limit, b.window),
                _ => d.retry_after,
            };
            if !d.can_never_pass() {
                // (A cost past the whole limit is refused alone, not the key.)
                e.blocked_until = sent.saturating_add(wait.max(1));
                e.blocked = Some(*d);
            }
            e.left = Some(d.remaining);
            return;
        }
        self.counters.taken.fetch_add(1, Ordering::Relaxed);
        self.counters.units.fetch_add(units, Ordering::Relaxed);
        self.per_limit.add(limit.id(), |s| {
            s.leases += 1;
            s.units_leased += units;
        });
        let seq = e.next_seq;
        e.next_seq += 1;
        let mut lease = Lease::new(limit, seq, units, sent, d.reset_after);
        lease.token = token;
        e.leases.push_back(lease);
        e.size = asked;
        e.left = Some(d.remaining);
        e.blocked_until = 0;
        e.blocked = None;
    }

    /// A lease call failed: the requests that waited for it try again themselves.
    pub fn failed(&self, limit: &Limit, key: &[u8]) {
        let fp = fingerprint(limit, key);
        let mut shard = self.shard(fp).lock();
        if let Some(n) = shard.get_mut(&fp).and_then(|e| e.leasing.take()) {
            n.notify_waiters();
        }
    }

    /// Gives back what a check spent, its request being rejected.
    pub fn give_back(&self, limit: &Limit, key: &[u8], spent: &Spent) {
        let fp = fingerprint(limit, key);
        let mut shard = self.shard(fp).lock();
        let Some(e) = shard.get_mut(&fp) else { return };
        for piece in &spent.pieces {
            if let Some(l) = e.leases.iter_mut().find(|l| l.seq == piece.seq) {
                l.units += piece.units;
                continue;
            }
            // The lease left the table while the request was deciding its other checks
            // (another request spent its last units, or what was left of it went back to
            // the store): the units come back as a lease of their own, with its expiry
            // and in its place, but no token (they are spent here or expire). Dropped,
            // they were lost: neither spent nor given back, and the store counted them
            // until they expired there (a global check whose request waited for the
            // region's store lost them often).
            let at = e
                .leases
                .iter()
                .position(|l| l.seq > piece.seq)
                .unwrap_or(e.leases.len());
            e.leases.insert(at, piece.clone());
        }
    }

    /// Takes out of hand the unspent units that can go back to the shared store at `now`:
    /// of every key (`all`: the instance is stopping), or of the keys unused for
    /// [`return_after`] their lease period with no lease call in flight. A fixed window's every lease with units left; a bucket's newest lease
    /// only (the store takes it back only if nothing charged the bucket since; the
    /// older ones sit below it and decay as they would).
    pub fn returns(&self, now: Nanos, all: bool) -> Vec<Return> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            for e in shard.values_mut() {
                if !all
                    && (e.leasing.is_some()
                        || now.saturating_sub(e.last_used) < return_after(e.period))
                {
                    continue;
                }
                let expired = drop_spent(&mut e.leases, now);
                self.expired(e.limit.id(), expired);
                let newest = e.leases.len().saturating_sub(1);
                let bucket = decays(&e.limit);
                for (i, l) in e.leases.iter_mut().enumerate() {
                    if bucket && i != newest {
                        continue;
                    }
                    let Some(token) = l.token.take() else {
                        continue;
                    };
                    let units = l.usable(now);
                    if units == 0 {
                        continue;
                    }
                    l.units -= units;
                    out.push(Return {
                        limit: e.limit,
                        key: e.key.clone(),
                        units,
                        token,
                    });
                }
                e.leases.retain(|l| l.units > 0);
            }
        }
        out
    }

    /// Counts `units` of limit `id` given back to the store.
    pub fn returned(&self, id: u64, units: u64) {
        self.counters.returned.fetch_add(units, Ordering::Relaxed);
        self.per_limit.add(id, |s| s.units_returned += units);
    }

    /// Forgets keys not used for `idle` whose leases are spent or expired, counting
    /// what expired unspent. Returns how many keys are kept.
    pub fn sweep(&self, now: Nanos, idle: Nanos) -> usize {
        let mut kept = 0;
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            shard.retain(|_, e| {
                let expired = drop_spent(&mut e.leases, now);
                self.expired(e.limit.id(), expired);
                e.leasing.is_some()
                    || !e.leases.is_empty()
                    || now.saturating_sub(e.last_used) < idle
                    || now < e.blocked_until
            });
            kept += shard.len();
        }
        kept
    }

    /// Counts `units` of limit `id` that expired unspent.
    fn expired(&self, id: u64, units: u64) {
        if units > 0 {
            self.counters.expired.fetch_add(units, Ordering::Relaxed);
            self.per_limit.add(id, |s| s.units_expired += units);
        }
    }

    /// Units in hand at `now`, over every key (for tests and metrics).
    pub fn in_hand(&self, now: Nanos) -> u64 {
        self.shards
            .iter()
            .map(|s| {
                s.lock()
                    .values()
                    .flat_map(|e| e.leases.iter())
                    .map(|l| l.usable(now))
                    .sum::<u64>()
            })
            .sum()
    }
}

/// Settles every lease at `now` (see [`Lease::settle`]) and drops those left empty,
/// returning the units that expired unspent.
fn drop_spent(leases: &mut VecDeque<Lease>, now: Nanos) -> u64 {
    let mut expired = 0;
    leases.retain_mut(|l| {
        expired += l.settle(now);
        l.units > 0
    });
    expired
}

/// A key's place in the tables of leased and synced keys: its limit (id and numbers)
/// and its bytes.
pub(crate) fn fingerprint(limit: &Limit, key: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    limit.id().hash(&mut h);
    limit.algorithm().hash(&mut h);
    key.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{FixedWindow, TokenBucket};
    use std::time::Duration;

    const MS: Nanos = 1_000_000;

    #[test]
    fn a_window_lease_holds_until_the_window_ends() {
        let limit = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
            100,
            Duration::from_secs(1),
        )))
        .unwrap();
        let l = Lease::new(&limit, 0, 10, 1_000, 500 * MS);
        assert_eq!(l.usable(1_000), 10);
        assert_eq!(l.usable(1_000 + 499 * MS), 10);
        assert_eq!(l.usable(1_000 + 500 * MS), 0);
    }

    #[test]
    fn a_bucket_lease_shrinks_with_the_debt_its_charge_still_holds() {
        // 1000 per second: one unit per ms.
        let limit = Limit::new(Algorithm::TokenBucket(TokenBucket::new(
            1_000,
            Duration::from_secs(1),
        )))
        .unwrap();
        // The charge left the bucket full again 10 ms later (an answer rounded up to
        // the nanosecond, so 1 ns less): just under 10 units of debt, all ten usable at
        // the instant the lease was taken (the store has just decided them).
        let mut l = Lease::new(&limit, 0, 10, 0, 10 * MS);
        assert_eq!(l.usable(0), 10);
        assert_eq!(l.usable(1), 9);
        assert_eq!(l.usable(4 * MS), 5);
        assert_eq!(l.usable(10 * MS), 0);
        // Full again far later (others' debt before ours): all ten stay until then.
        let far = Lease::new(&limit, 0, 10, 0, 500 * MS);
        assert_eq!(far.usable(489 * MS), 10);
        assert_eq!(far.usable(495 * MS), 4);
        // Units past the debt are gone for good: spending others never brings them back.
        assert_eq!(l.settle(4 * MS), 5);
        l.units -= 3;
        assert_eq!(l.usable(4 * MS), 2);
    }

    /// Spends `cost` at `now` from what is in hand, expecting a local decision.
    fn spend_in_hand(leases: &Leases, limit: &Limit, now: Nanos) {
        let local = leases.spend(limit, b"k", 1, now, 100 * MS, None);
        assert!(matches!(local, Local::Decided(d, _) if d.allowed));
    }

    #[test]
    fn a_far_buckets_lease_carries_two_round_trips_of_refill() {
        // 1000 per second: one unit per ms. Round trips of 80 ms.
        let limit = Limit::new(Algorithm::TokenBucket(TokenBucket::new(
            1_000,
            Duration::from_secs(1),
        )))
        .unwrap();
        let rtt = 80 * MS;
        let ask = |far: Option<Nanos>| {
            let leases = Leases::new(100);
            assert!(matches!(
                leases.spend(&limit, b"k", 1, 0, 100 * MS, far),
                Local::Lease(1)
            ));
            let d = Decision::allow(1_000, 999, MS);
            leases.taken(&limit, b"k", 1, 1, &d, 0, 100 * MS, None);
            spend_in_hand(&leases, &limit, 0);
            match leases.spend(&limit, b"k", 1, 10 * MS, 100 * MS, far) {
                Local::Lease(size) => size,
                _ => panic!("no lease asked for"),
            }
        };
        // Near: four times the last lease at most. Far: besides, the 160 units the
        // bucket refills in two round trips (at most half of the 999 left).
        assert_eq!(ask(None), 4);
        assert_eq!(ask(Some(rtt)), 164);
    }

    #[test]
    fn a_far_windows_first_lease_after_it_turns_waits_an_eighth_of_a_round_trip() {
        let limit = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
            1_000,
            Duration::from_secs(1),
        )))
        .unwrap();
        let (period, rtt) = (100 * MS, 80 * MS);
        let leases = Leases::new(100);
        // A first lease of one unit, then one of four: the key is hot. The window ends
        // 500 ms after the first call was sent, as this instance reckons it.
        assert!(matches!(
            leases.spend(&limit, b"k", 1, 0, period, None),
            Local::Lease(1)
        ));
        leases.taken(
            &limit,
            b"k",
            1,
            1,
            &Decision::allow(1_000, 999, 500 * MS),
            0,
            period,
            None,
        );
        spend_in_hand(&leases, &limit, 0);
        assert!(matches!(
            leases.spend(&limit, b"k", 1, MS, period, None),
            Local::Lease(4)
        ));
        let d = Decision::allow(1_000, 995, 499 * MS);
        leases.taken(&limit, b"k", 4, 4, &d, MS, period, None);
        for _ in 0..4 {
            spend_in_hand(&leases, &limit, 2 * MS);
        }
        // Nothing in hand: refused at once, and the next lease asked for in the
        // background.
        match leases.spend(&limit, b"k", 1, 3 * MS, period, Some(rtt)) {
            Local::Dry(d, Some(_)) => assert!(!d.allowed && d.reset_after == 497 * MS),
            _ => panic!("a hot far key waited"),
        }
        leases.failed(&limit, b"k");
        // The window has ended here: refused, the next window's lease not asked for
        // until an eighth of a round trip (10 ms) later, when a call sent reaches a
        // store whose window has ended too.
        match leases.spend(&limit, b"k", 1, 501 * MS, period, Some(rtt)) {
            Local::Dry(d, None) => assert_eq!(d.reset_after, 999 * MS),
            _ => panic!("the next window's lease was asked for at once"),
        }
        assert!(matches!(
            leases.spend(&limit, b"k", 1, 510 * MS, period, Some(rtt)),
            Local::Dry(_, Some(_))
        ));
        assert_eq!(leases.counters.dry.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn lease_sizes_follow_the_rate_within_their_bounds() {
        let ms = MS;
        // First lease: the cost.
        assert_eq!(next_size(1, 0, 0, 0, 100 * ms, None, 1_000), 1);
        // 10 units spent in 10 ms: 100 per 100 ms, but at most 4x the last (1).
        assert_eq!(next_size(1, 1, 10, 10 * ms, 100 * ms, None, 1_000), 4);
        assert_eq!(next_size(1, 50, 10, 10 * ms, 100 * ms, None, 1_000), 100);
        // Half of what is left, at least the cost; never past the limit.
        assert_eq!(next_size(1, 50, 10, 10 * ms, 100 * ms, Some(60), 1_000), 30);
        assert_eq!(next_size(3, 50, 10, 10 * ms, 100 * ms, Some(1), 1_000), 3);
        assert_eq!(next_size(1, 500, 1_000, ms, 100 * ms, None, 80), 80);
    }
}
