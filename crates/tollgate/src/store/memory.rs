//! [`MemoryStore`]: keyed, concurrent, exact and bounded, in this process.
//!
//! ## How it is built
//! Keys are reduced to a 64-bit fingerprint, a keyed hash (`ahash`, random seed per
//! store) of the limit's id and the key bytes, and spread over a power-of-two number
//! of shards, each a `parking_lot` mutex around `hashbrown` maps from fingerprint to
//! state. One request's checks lock their shards in index order, so a request touching
//! several keys is atomic and two such requests cannot deadlock. (A ready-made
//! concurrent map such as DashMap does not offer holding several entries locked at
//! once through its safe API; that, not speed, is why the sharding is ours.)
//!
//! Fingerprints stand for keys: two keys with the same fingerprint share one counter.
//! With a random 64-bit hash that happens to a given pair with probability 2^-64
//! (about 1 in 37 million for some pair among a million live keys), an attacker who
//! does not know the seed cannot aim for it, and the effect is only ever a stricter
//! limit for the two keys, never a looser one.
//!
//! ## Memory
//! A key costs one 8-byte fingerprint and a 16-byte [`KeyState`] in a hash table
//! (about 50 bytes per key at load), a [`LogState`] for the sliding log, a 296-byte
//! [`WindowState`] for the sliding window counter, a 32-byte
//! [`WarmState`](crate::algorithm::WarmState) for a bucket with a warm-up, and 8 bytes
//! more while it is locked out. Memory stays bounded three ways:
//! - a state that has become fresh again (full bucket, ended window) is the same as no
//!   state: it is dropped whenever a shard is swept;
//! - each shard sweeps itself when it has grown to twice its size at the last sweep,
//!   and [`MemoryStore::sweep`] sweeps everything (the server calls it periodically);
//! - `max_keys` caps the total. When a shard is full of live keys, it evicts an eighth
//!   of its keys, in three tiers: first keys that have never been refused, those that
//!   will become fresh soonest first (the keys nearest to being forgotten anyway); then
//!   keys that have been refused since their state began (*limited* keys), soonest
//!   fresh first; keys in a lockout last. An evicted key starts over, so its client
//!   may get up to one more full limit (or burst) early. A flood of new keys (one
//!   request each, never refused) therefore cannot reset a client that is over its
//!   limit: to evict limited keys, an attacker must first fill the shard with keys of
//!   its own that were refused, which costs it a full limit (plus one request) per key.
//!   Evictions are counted in [`MemoryStoreStats`], limited ones apart.

use std::collections::hash_map::RandomState as StdRandomState;
use std::collections::HashSet;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam_utils::CachePadded;
use hashbrown::hash_map::Entry;
use hashbrown::HashMap;
use parking_lot::{Mutex, MutexGuard};

use super::{Check, Error, LeaseToken, Store};
use crate::algorithm::{KeyState, Limit, LogState, StateKind, WarmState, WindowState};
use crate::clock::Nanos;
use crate::decision::Decision;

/// The in-memory store. Cheap to share behind an `Arc`; every method takes `&self`.
///
/// ```
/// use std::time::Duration;
/// use tollgate::algorithm::{Algorithm, Gcra, Limit};
/// use tollgate::store::{Check, MemoryStore};
/// let store = MemoryStore::builder().max_keys(100_000).build();
/// let limit = Limit::new(Algorithm::Gcra(Gcra::new(2, Duration::from_secs(1))))?;
/// let now = 1_700_000_000_000_000_000;
/// assert!(store.check_one(now, &Check::new(&limit, "user:1", 1)).allowed);
/// assert!(store.check_one(now, &Check::new(&limit, "user:1", 1)).allowed);
/// assert!(!store.check_one(now, &Check::new(&limit, "user:1", 1)).allowed);
/// assert!(store.check_one(now, &Check::new(&limit, "user:2", 1)).allowed);
/// # Ok::<(), tollgate::algorithm::InvalidLimit>(())
/// ```
pub struct MemoryStore {
    shards: Box<[CachePadded<Mutex<Shard>>]>,
    shard_shift: u32,
    hasher: ahash::RandomState,
    max_per_shard: usize,
    evictions: AtomicU64,
    limited_evictions: AtomicU64,
    monotonic: bool,
}

/// Builds a [`MemoryStore`].
#[derive(Debug, Clone)]
pub struct MemoryStoreBuilder {
    max_keys: usize,
    shards: usize,
    monotonic: bool,
}

/// Counters describing a [`MemoryStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryStoreStats {
    /// Keys with state (including states not yet swept after becoming fresh).
    pub keys: usize,
    /// Keys evicted because a shard was full of live keys.
    pub evictions: u64,
    /// Of those, keys that had been refused (over their limit) since their state began:
    /// each may have given its client up to one more full limit. Evicted only when a
    /// shard holds nothing else to evict.
    pub limited_evictions: u64,
}

#[derive(Default)]
struct Shard {
    keys: HashMap<u64, KeyState, Fingerprint>,
    logs: HashMap<u64, LogState, Fingerprint>,
    /// Boxed: the table's spare capacity then costs a pointer per slot, not a state.
    windows: HashMap<u64, Box<WindowState>, Fingerprint>,
    /// Token buckets and GCRAs with a warm-up.
    warms: HashMap<u64, WarmState, Fingerprint>,
    blocks: HashMap<u64, Nanos, Fingerprint>,
    /// Keys refused since their state began (limited): evicted after all others. Each
    /// has a state in `keys`, `logs`, `windows` or `warms`; it leaves this set with that state.
    limited: hashbrown::HashSet<u64, Fingerprint>,
    sweep_at: usize,
    /// The latest "now" a decision in this shard was made at (see `monotonic`).
    latest: Nanos,
}

/// What the store needs of every kind of per-key state.
trait State: Default {
    fn is_fresh(&self, now: Nanos) -> bool;
    /// When the state becomes fresh again.
    fn expires_at(&self) -> Nanos;
}

impl State for KeyState {
    fn is_fresh(&self, now: Nanos) -> bool {
        KeyState::is_fresh(self, now)
    }
    fn expires_at(&self) -> Nanos {
        self.expires_at
    }
}

impl State for LogState {
    fn is_fresh(&self, now: Nanos) -> bool {
        LogState::is_fresh(self, now)
    }
    fn expires_at(&self) -> Nanos {
        LogState::expires_at(self)
    }
}

impl State for WarmState {
    fn is_fresh(&self, now: Nanos) -> bool {
        WarmState::is_fresh(self, now)
    }
    fn expires_at(&self) -> Nanos {
        WarmState::expires_at(self)
    }
}

impl State for Box<WindowState> {
    fn is_fresh(&self, now: Nanos) -> bool {
        WindowState::is_fresh(self, now)
    }
    fn expires_at(&self) -> Nanos {
        self.as_ref().expires_at
    }
}

/// Fingerprints are already uniform hashes; the tables use them as they are (also
/// used by `inflight::memory`).
pub(crate) type Fingerprint = BuildHasherDefault<IdentityHasher>;

/// The hasher behind [`Fingerprint`]: a `u64` hashes to itself.
#[derive(Default)]
pub(crate) struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u64 fingerprints are hashed; fold anything else in for completeness.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

const MIN_SWEEP: usize = 1024;

impl Default for MemoryStore {
    fn default() -> Self {
        Self::builder().build()
    }
}

impl MemoryStore {
    /// A store with the default settings (at most 10,000,000 keys).
    pub fn new() -> Self {
        Self::default()
    }

    /// Configures a store.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            max_keys: 10_000_000,
            shards: 64,
            monotonic: true,
        }
    }

    /// Decides one check at `now` and charges it if admitted: the synchronous fast path.
    pub fn check_one(&self, now: Nanos, check: &Check<'_>) -> Decision {
        let fp = self.fingerprint(check);
        let mut shard = self.shards[self.shard_of(fp)].lock();
        let now = self.effective_now(&mut shard, now);
        let mut d = self.decide(&mut shard, fp, check, now);
        if !d.allowed && check.charge.when_over() {
            self.force(&mut shard, fp, check, now);
            d.remaining = 0;
        }
        d
    }

    /// Charges a lease (leased counting: one check, decided as [`check_one`](Self::check_one)
    /// decides it) and answers with the decision the key's state after the charge, the
    /// token that [`give_back_one`](Self::give_back_one) takes. No token for a rejection or
    /// an algorithm with another state.
    pub fn lease_one(&self, now: Nanos, check: &Check<'_>) -> (Decision, Option<LeaseToken>) {
        let fp = self.fingerprint(check);
        let mut shard = self.shards[self.shard_of(fp)].lock();
        let now = self.effective_now(&mut shard, now);
        let d = self.decide(&mut shard, fp, check, now);
        if !d.allowed || check.cost == 0 || check.charge != super::ChargeRejected::None {
            return (d, None);
        }
        let token = shard.keys.get(&fp).map(|st| {
            let mut bytes = Vec::with_capacity(16);
            bytes.extend_from_slice(&st.expires_at.to_le_bytes());
            bytes.extend_from_slice(&st.word.to_le_bytes());
            LeaseToken(bytes.into())
        });
        (d, token)
    }

    /// Gives back `check.cost` unspent units of the lease that answered `token`, at `now`
    /// (see [`Limit::give_back_key`](crate::algorithm::Limit::give_back_key)); answers
    /// the key decided again with cost 0.
    pub fn give_back_one(&self, now: Nanos, check: &Check<'_>, token: &LeaseToken) -> Decision {
        let fp = self.fingerprint(check);
        let mut shard = self.shards[self.shard_of(fp)].lock();
        let now = self.effective_now(&mut shard, now);
        let charged = match <[u8; 16]>::try_from(&*token.0) {
            Ok(b) => {
                let (at, word) = b.split_at(8);
                KeyState {
                    expires_at: u64::from_le_bytes(at.try_into().unwrap_or_default()),
                    word: u64::from_le_bytes(word.try_into().unwrap_or_default()),
                }
            }
            Err(_) => KeyState::default(),
        };
        if let Some(st) = shard.keys.get_mut(&fp) {
            if let Some(back) = check.limit.give_back_key(st, &charged, now, check.cost) {
                *st = back;
            }
        }
        self.decide(&mut shard, fp, &Check { cost: 0, ..*check }, now)
    }

    /// `now`, or with `monotonic`, no earlier than any decision already made in the
    /// shard: a request whose clock read went stale while it waited (descheduled
    /// between reading the clock and taking the lock) is decided at the latest time
    /// seen, not rejected by the requests that overtook it. That time still lies
    /// between the request's clock read and the moment it is decided.
    fn effective_now(&self, shard: &mut Shard, now: Nanos) -> Nanos {
        if !self.monotonic {
            return now;
        }
        let now = now.max(shard.latest);
        shard.latest = now;
        now
    }

    /// Decides every check of one request at `now`, all-or-nothing (see [`Store::check`]).
    pub fn check_all(&self, now: Nanos, checks: &[Check<'_>]) -> Vec<Decision> {
        if let [one] = checks {
            return vec![self.check_one(now, one)];
        }
        let fps: Vec<u64> = checks.iter().map(|c| self.fingerprint(c)).collect();
        let mut order: Vec<usize> = fps.iter().map(|&fp| self.shard_of(fp)).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> =
            order.iter().map(|&i| (i, self.shards[i].lock())).collect();
        let mut now = now;
        for (_, g) in guards.iter_mut() {
            now = self.effective_now(g, now);
        }
        for (_, g) in guards.iter_mut() {
            g.latest = g.latest.max(now);
        }
        let mut undo: Vec<Undo> = Vec::with_capacity(checks.len());
        // The states saved, as a set: looking each check up in `undo` itself made a
        // request quadratic in its checks. A few checks are looked up in `undo` (a set
        // costs more to build than they do to scan).
        let few = checks.len() <= FEW_CHECKS;
        let mut saved: HashSet<(u64, StateKind)> = if few {
            HashSet::new()
        } else {
            HashSet::with_capacity(checks.len())
        };
        let mut decisions = Vec::with_capacity(checks.len());
        for (check, &fp) in checks.iter().zip(&fps) {
            let shard = guard_for(&mut guards, self.shard_of(fp));
            let kind = check.limit.state_kind();
            let first = if few {
                !undo.iter().any(|u| u.fp == fp && u.kind() == kind)
            } else {
                saved.insert((fp, kind))
            };
            if first {
                undo.push(Undo::save(shard, fp, kind));
            }
            decisions.push(self.decide(shard, fp, check, now));
        }
        let rejected = super::rejects(checks, |i| decisions[i].allowed);
        if rejected {
            // Put back every state the admitted checks charged. Lockouts live apart
            // and stay: a rejected check keeps the lockout it started.
            for u in undo.into_iter().rev() {
                let shard = guard_for(&mut guards, self.shard_of(u.fp));
                u.restore(shard);
            }
            // An admitted check that keeps its charge in a rejected request
            // (`charge_rejected: all`) is charged again.
            for ((check, &fp), d) in checks.iter().zip(&fps).zip(decisions.iter_mut()) {
                if d.allowed && check.charge.when_request_rejected() {
                    let shard = guard_for(&mut guards, self.shard_of(fp));
                    *d = self.decide(shard, fp, check, now);
                }
            }
        }
        // The checks not admitted that are charged anyway (`charge_rejected`).
        for ((check, &fp), d) in checks.iter().zip(&fps).zip(decisions.iter_mut()) {
            if !d.allowed && check.charge.when_over() {
                let shard = guard_for(&mut guards, self.shard_of(fp));
                self.force(shard, fp, check, now);
                d.remaining = 0;
            }
        }
        if rejected {
            // The admitted checks report their keys as they are now: uncharged, or with
            // the charges that stay.
            for ((check, &fp), d) in checks.iter().zip(&fps).zip(decisions.iter_mut()) {
                if d.allowed {
                    let shard = guard_for(&mut guards, self.shard_of(fp));
                    *d = self.decide(shard, fp, &Check { cost: 0, ..*check }, now);
                }
            }
        }
        decisions
    }

    /// Charges a check that was not admitted (`charge_rejected`), past its limit.
    fn force(&self, shard: &mut Shard, fp: u64, check: &Check<'_>, now: Nanos) {
        if check.cost == 0 {
            return;
        }
        let (limit, cost) = (check.limit, check.cost);
        match limit.state_kind() {
            StateKind::Key => self.run_on(
                shard,
                |s| &mut s.keys,
                fp,
                now,
                |st| {
                    limit.charge_key(st, now, cost);
                    Decision::default()
                },
            ),
            StateKind::Log => self.run_on(
                shard,
                |s| &mut s.logs,
                fp,
                now,
                |st| {
                    limit.charge_log(st, now, cost);
                    Decision::default()
                },
            ),
            StateKind::Window => self.run_on(
                shard,
                |s| &mut s.windows,
                fp,
                now,
                |st| {
                    limit.charge_window(st, now, cost);
                    Decision::default()
                },
            ),
            StateKind::Warm => self.run_on(
                shard,
                |s| &mut s.warms,
                fp,
                now,
                |st| {
                    limit.charge_warm(st, now, cost);
                    Decision::default()
                },
            ),
        };
    }

    /// Drops every state that is fresh again at `now` (and ended lockouts). Returns how
    /// many keys were dropped.
    pub fn sweep(&self, now: Nanos) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let mut shard = s.lock();
                let before = shard.len();
                shard.drop_fresh(now);
                before - shard.len()
            })
            .sum()
    }

    /// Current key count and eviction total.
    pub fn stats(&self) -> MemoryStoreStats {
        MemoryStoreStats {
            keys: self.shards.iter().map(|s| s.lock().len()).sum(),
            evictions: self.evictions.load(Ordering::Relaxed),
            limited_evictions: self.limited_evictions.load(Ordering::Relaxed),
        }
    }

    fn fingerprint(&self, check: &Check<'_>) -> u64 {
        let mut h = self.hasher.build_hasher();
        h.write_u64(check.limit.id());
        h.write(check.key);
        h.finish()
    }

    fn shard_of(&self, fp: u64) -> usize {
        // hashbrown uses the low bits (bucket) and the top 7 (tag); take bits below the tag.
        (fp << 7).checked_shr(self.shard_shift).unwrap_or(0) as usize
    }

    fn decide(&self, shard: &mut Shard, fp: u64, check: &Check<'_>, now: Nanos) -> Decision {
        let limit = check.limit;
        match limit.lockout() {
            None => self.run(shard, fp, limit, now, check.cost),
            Some(lockout) => {
                let mut until = shard.blocks.get(&fp).copied().unwrap_or(0);
                let d = lockout.check(&mut until, now, limit.limit(), |now| {
                    self.run(shard, fp, limit, now, check.cost)
                });
                if until > now {
                    if shard.blocks.insert(fp, until).is_none() {
                        self.make_room(shard, now, fp);
                    }
                } else if until != 0 {
                    shard.blocks.remove(&fp);
                }
                d
            }
        }
    }

    fn run(&self, shard: &mut Shard, fp: u64, limit: &Limit, now: Nanos, cost: u64) -> Decision {
        match limit.state_kind() {
            StateKind::Key => self.run_on(
                shard,
                |s| &mut s.keys,
                fp,
                now,
                |st| limit.check_key(st, now, cost),
            ),
            StateKind::Log => self.run_on(
                shard,
                |s| &mut s.logs,
                fp,
                now,
                |st| limit.check_log(st, now, cost),
            ),
            StateKind::Window => self.run_on(
                shard,
                |s| &mut s.windows,
                fp,
                now,
                |st| limit.check_window(st, now, cost),
            ),
            StateKind::Warm => self.run_on(
                shard,
                |s| &mut s.warms,
                fp,
                now,
                |st| limit.check_warm(st, now, cost),
            ),
        }
    }

    /// Runs `check` on `fp`'s state in the map `map` selects; a state that is still
    /// fresh afterwards (a rejection, a check without cost) is not inserted.
    fn run_on<S: State>(
        &self,
        shard: &mut Shard,
        map: fn(&mut Shard) -> &mut HashMap<u64, S, Fingerprint>,
        fp: u64,
        now: Nanos,
        check: impl FnOnce(&mut S) -> Decision,
    ) -> Decision {
        let d = match map(shard).entry(fp) {
            Entry::Occupied(mut e) => check(e.get_mut()),
            Entry::Vacant(e) => {
                let mut state = S::default();
                let d = check(&mut state);
                if state.is_fresh(now) {
                    // Nothing kept, so nothing to protect (a cost above the burst).
                    return d;
                }
                e.insert(state);
                self.make_room(shard, now, fp);
                d
            }
        };
        // A refused key is worth more than any other to keep (see the module's Memory).
        if !d.allowed && map(shard).contains_key(&fp) {
            shard.limited.insert(fp);
        }
        d
    }

    /// Called after the key `added` was added to `shard`: sweeps it when it has doubled
    /// since the last sweep, and evicts (never `added`) when it is over its share of
    /// `max_keys`.
    fn make_room(&self, shard: &mut Shard, now: Nanos, added: u64) {
        let len = shard.len();
        if len < shard.sweep_at && len <= self.max_per_shard {
            return;
        }
        shard.drop_fresh(now);
        if shard.len() > self.max_per_shard {
            let (evicted, limited) = shard.evict(
                shard.len() - self.max_per_shard + self.max_per_shard / 8,
                added,
            );
            self.evictions.fetch_add(evicted as u64, Ordering::Relaxed);
            if limited > 0 {
                self.limited_evictions
                    .fetch_add(limited as u64, Ordering::Relaxed);
            }
        }
        shard.sweep_at = (shard.len() * 2).max(MIN_SWEEP);
    }
}

impl Shard {
    fn len(&self) -> usize {
        self.keys.len()
            + self.logs.len()
            + self.windows.len()
            + self.warms.len()
            + self.blocks.len()
    }

    fn drop_fresh(&mut self, now: Nanos) {
        self.keys.retain(|_, s| !s.is_fresh(now));
        self.logs.retain(|_, s| !s.is_fresh(now));
        self.windows.retain(|_, s| !s.is_fresh(now));
        self.warms.retain(|_, s| !s.is_fresh(now));
        self.blocks.retain(|_, &mut until| until > now);
        self.forget_limited_without_state();
    }

    /// Keeps `limited` to the keys that still have a state.
    fn forget_limited_without_state(&mut self) {
        let (keys, logs, windows, warms) = (&self.keys, &self.logs, &self.windows, &self.warms);
        self.limited.retain(|fp| {
            keys.contains_key(fp)
                || logs.contains_key(fp)
                || windows.contains_key(fp)
                || warms.contains_key(fp)
        });
    }

    /// Evicts at least `n` keys: keys never refused first, then limited keys, each
    /// tier those that become fresh soonest first; lockouts last; never `added`, the key
    /// whose arrival made the room short (it would start over at its next request).
    /// Returns how many keys were evicted and how many of them were limited.
    fn evict(&mut self, n: usize, added: u64) -> (usize, usize) {
        let before = self.len();
        let mut left = n;
        for limited in [false, true] {
            if left == 0 {
                break;
            }
            let mut candidates: Vec<(Nanos, u64, StateKind)> = Vec::new();
            let tier = |fp: &u64| *fp != added && self.limited.contains(fp) == limited;
            candidates.extend(
                self.keys
                    .iter()
                    .filter(|(fp, _)| tier(fp))
                    .map(|(&fp, s)| (State::expires_at(s), fp, StateKind::Key)),
            );
            candidates.extend(
                self.logs
                    .iter()
                    .filter(|(fp, _)| tier(fp))
                    .map(|(&fp, s)| (State::expires_at(s), fp, StateKind::Log)),
            );
            candidates.extend(
                self.windows
                    .iter()
                    .filter(|(fp, _)| tier(fp))
                    .map(|(&fp, s)| (State::expires_at(s), fp, StateKind::Window)),
            );
            candidates.extend(
                self.warms
                    .iter()
                    .filter(|(fp, _)| tier(fp))
                    .map(|(&fp, s)| (State::expires_at(s), fp, StateKind::Warm)),
            );
            if left < candidates.len() {
                candidates.select_nth_unstable_by_key(left, |c| c.0);
                candidates.truncate(left);
            }
            for (_, fp, kind) in &candidates {
                match kind {
                    StateKind::Key => self.keys.remove(fp).map(|_| ()),
                    StateKind::Log => self.logs.remove(fp).map(|_| ()),
                    StateKind::Window => self.windows.remove(fp).map(|_| ()),
                    StateKind::Warm => self.warms.remove(fp).map(|_| ()),
                };
            }
            left -= candidates.len();
        }
        let evicted_limited = {
            let had = self.limited.len();
            self.forget_limited_without_state();
            had - self.limited.len()
        };
        if left > 0 {
            let mut ends: Vec<Nanos> = self.blocks.values().copied().collect();
            if left < ends.len() {
                let (_, &mut cut, _) = ends.select_nth_unstable(left);
                self.blocks.retain(|_, &mut until| until >= cut);
            } else {
                self.blocks.clear();
            }
        }
        (before - self.len(), evicted_limited)
    }
}

fn guard_for<'g, 's>(
    guards: &'g mut [(usize, MutexGuard<'s, Shard>)],
    index: usize,
) -> &'g mut Shard {
    let at = guards
        .binary_search_by_key(&index, |(i, _)| *i)
        .unwrap_or_else(|_| unreachable!("every shard of the request is locked"));
    &mut guards[at].1
}

/// Up to this many checks, a request finds the states it saved already by scanning them.
const FEW_CHECKS: usize = 8;

/// The state of one key before a multi-check request touched it.
struct Undo {
    fp: u64,
    saved: Saved,
}

/// A key's state as it was, of the kind its limit keeps (`None`: there was none).
enum Saved {
    Key(Option<KeyState>),
    Log(Option<LogState>),
    Window(Option<Box<WindowState>>),
    Warm(Option<WarmState>),
}

impl Undo {
    /// The kind of state saved.
    fn kind(&self) -> StateKind {
        match self.saved {
            Saved::Key(_) => StateKind::Key,
            Saved::Log(_) => StateKind::Log,
            Saved::Window(_) => StateKind::Window,
            Saved::Warm(_) => StateKind::Warm,
        }
    }

    fn save(shard: &Shard, fp: u64, kind: StateKind) -> Self {
        let saved = match kind {
            StateKind::Key => Saved::Key(shard.keys.get(&fp).copied()),
            StateKind::Log => Saved::Log(shard.logs.get(&fp).cloned()),
            StateKind::Window => Saved::Window(shard.windows.get(&fp).cloned()),
            StateKind::Warm => Saved::Warm(shard.warms.get(&fp).copied()),
        };
        Self { fp, saved }
    }

    fn restore(self, shard: &mut Shard) {
        fn put<S>(map: &mut HashMap<u64, S, Fingerprint>, fp: u64, state: Option<S>) {
            match state {
                Some(s) => map.insert(fp, s),
                None => map.remove(&fp),
            };
        }
        match self.saved {
            Saved::Key(s) => put(&mut shard.keys, self.fp, s),
            Saved::Log(s) => put(&mut shard.logs, self.fp, s),
            Saved::Window(s) => put(&mut shard.windows, self.fp, s),
            Saved::Warm(s) => put(&mut shard.warms, self.fp, s),
        }
    }
}

impl MemoryStoreBuilder {
    /// The most keys the store holds before it evicts (default 10,000,000; at least
    /// one per shard).
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// Number of shards, rounded up to a power of two between 1 and 128 (default 64).
    /// More shards mean less contention between threads on different keys.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards;
        self
    }

    /// Whether time may only move forward within a shard (default on): each decision
    /// is made at `max(now, the latest now already used in its shard)`, so that
    /// concurrent requests whose clock reads arrive out of order are not rejected by
    /// a tight limit (a bucket's tolerance can be microseconds). Off: every decision is
    /// made at exactly the `now` passed, as differential tests that replay a trace
    /// with a clock stepping back need.
    pub fn monotonic(mut self, monotonic: bool) -> Self {
        self.monotonic = monotonic;
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        let shards = self.shards.clamp(1, 128).next_power_of_two();
        let bits = shards.trailing_zeros();
        MemoryStore {
            shards: (0..shards)
                .map(|_| CachePadded::new(Mutex::new(Shard::default())))
                .collect(),
            shard_shift: 64 - bits,
            hasher: {
                // Seeded from the OS like std's HashMap: fingerprints are unpredictable.
                let s = StdRandomState::new();
                ahash::RandomState::with_seeds(
                    s.hash_one(1u8),
                    s.hash_one(2u8),
                    s.hash_one(3u8),
                    s.hash_one(4u8),
                )
            },
            max_per_shard: self.max_keys.div_ceil(shards).max(1),
            evictions: AtomicU64::new(0),
            limited_evictions: AtomicU64::new(0),
            monotonic: self.monotonic,
        }
    }
}

impl Store for MemoryStore {
    fn check<'a>(
        &'a self,
        now: Nanos,
        checks: &'a [Check<'a>],
    ) -> impl std::future::Future<Output = Result<Vec<Decision>, Error>> + Send + 'a {
        std::future::ready(Ok(self.check_all(now, checks)))
    }

    fn lease<'a>(
        &'a self,
        now: Nanos,
        check: Check<'a>,
        _budget: Option<std::time::Duration>,
    ) -> impl std::future::Future<Output = Result<(Decision, Option<LeaseToken>), Error>> + Send + 'a
    {
        std::future::ready(Ok(self.lease_one(now, &check)))
    }

    fn give_back<'a>(
        &'a self,
        now: Nanos,
        check: Check<'a>,
        token: &'a LeaseToken,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send + 'a {
        self.give_back_one(now, &check, token);
        std::future::ready(Ok(()))
    }
}
