//! Synced counting (`consistency: synced`): each instance decides locally against the
//! last count it read from the shared store plus what it admitted since, and exchanges
//! counts with the store every `sync_interval`.
//!
//! A key's first decision on an instance is made by the shared store (it reads the key's
//! count); from then on the instance admits while `pending + in flight + cost` fits in
//! what the store last said was left (a bucket's refill since then added). Every
//! interval, one call per instance pushes every dirty key's pending units (charged
//! whether they fit or not: they were admitted already) and reads each key's new room.
//! Over-admission is bounded by what the other instances admit within one interval
//! (and, at a fixed window's start, until each instance's first push of that window).
//! A key the store has not answered for in [`stale_after`] its interval (five intervals,
//! at least a second: the store is down or unreachable) is decided by the store again,
//! hence by the rule's failure mode while it stays down; its pending units are pushed
//! when it answers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::lease::fingerprint;
use super::scale_out::PerLimit;
use crate::algorithm::{Algorithm, Limit};
use crate::clock::Nanos;
use crate::decision::Decision;

/// What an instance knows of one key.
#[derive(Debug)]
struct Entry {
    limit: Limit,
    key: Box<[u8]>,
    interval: Nanos,
    /// The room the store last reported (after every push it had seen).
    seen: u64,
    /// When it reported it (the instant the call was sent).
    seen_at: Nanos,
    /// When the key's window ends (fixed window), or when the bucket is full again.
    reset_at: Nanos,
    /// Units admitted here and not yet pushed.
    pending: u64,
    /// Units pushed, their answer not yet in.
    in_flight: u64,
    /// The room should be read at the next push even with nothing to push.
    stale: bool,
    /// When this key was last pushed or read.
    pushed_at: Nanos,
    /// When the store last answered for this key (the instant the call was sent).
    synced_at: Nanos,
    last_used: Nanos,
}

impl Entry {
    /// The room at `now`: what the store said, a bucket's refill since added, a fixed
    /// window's whole limit once its window is over.
    fn room(&mut self, now: Nanos) -> u64 {
        let limit = self.limit.limit();
        match self.limit.algorithm() {
            Algorithm::FixedWindow(w) => {
                if now >= self.reset_at {
                    // A new window: what was counted belongs to the old one.
                    let windows = (now - self.reset_at) / w.window + 1;
                    self.reset_at = self
                        .reset_at
                        .saturating_add(windows.saturating_mul(w.window));
                    self.seen = limit;
                    self.seen_at = now;
                    self.pending = 0;
                    self.stale = true;
                }
                self.seen
            }
            a => {
                let burst = match a {
                    Algorithm::TokenBucket(b) => b.burst,
                    Algorithm::Gcra(b) => b.burst,
                    Algorithm::LeakyBucket(b) => b.burst,
                    _ => limit,
                };
                let refill = u128::from(now.saturating_sub(self.seen_at)) * u128::from(limit)
                    / u128::from(self.limit.window().max(1));
                let refill = u64::try_from(refill).unwrap_or(u64::MAX);
                self.seen.saturating_add(refill).min(burst)
            }
        }
    }
}

/// How long without an answer from the store a key's count is still decided on
/// locally: five intervals, at least a second.
pub fn stale_after(interval: Nanos) -> Nanos {
    interval.saturating_mul(5).max(1_000_000_000)
}

/// One key's units to push, taken by [`Syncs::due`].
#[derive(Debug, Clone)]
pub struct Push {
    fp: u64,
    /// The limit.
    pub limit: Limit,
    /// The runtime key.
    pub key: Box<[u8]>,
    /// Units admitted here since the last push (0: only read the room).
    pub units: u64,
}

/// Counters of synced counting.
#[derive(Debug, Default)]
pub struct SyncCounters {
    /// Sync calls made (each pushes every due key).
    pub calls: AtomicU64,
    /// Sync calls that failed (their units are pushed again next time).
    pub failures: AtomicU64,
    /// Units pushed.
    pub units: AtomicU64,
    /// Checks decided locally.
    pub local: AtomicU64,
    /// When the last sync call succeeded (ns since the epoch; 0: never).
    pub last_success: AtomicU64,
}

/// Every synced key of this instance.
pub struct Syncs {
    shards: Box<[Mutex<HashMap<u64, Entry>>]>,
    per_shard: usize,
    /// The counters.
    pub counters: SyncCounters,
    /// The counters per limit.
    pub(crate) per_limit: PerLimit,
}

/// What a synced check may do at `now`.
pub enum Local {
    /// Decided here.
    Decided(Decision),
    /// Decide it in the shared store, then [`Syncs::seed`] the key from the answer.
    Seed,
    /// The table is full: decide it in the shared store, as `exact`.
    Exact,
}

impl Syncs {
    /// A table of at most about `max_keys` keys.
    pub fn new(max_keys: usize) -> Self {
        let n = 16;
        Self {
            shards: (0..n).map(|_| Mutex::new(HashMap::new())).collect(),
            per_shard: (max_keys / n).max(1),
            counters: SyncCounters::default(),
            per_limit: PerLimit::default(),
        }
    }

    fn shard(&self, fp: u64) -> &Mutex<HashMap<u64, Entry>> {
        &self.shards[(fp as usize) % self.shards.len()]
    }

    /// Decides `cost` of `key` under `limit` at `now` from what this instance knows.
    pub fn decide(&self, limit: &Limit, key: &[u8], cost: u64, now: Nanos) -> Local {
        let fp = fingerprint(limit, key);
        let mut shard = self.shard(fp).lock();
        let Some(e) = shard.get_mut(&fp) else {
            return if shard.len() >= self.per_shard {
                Local::Exact
            } else {
                Local::Seed
            };
        };
        if e.limit != *limit || *e.key != *key {
            return Local::Exact;
        }
        e.last_used = now;
        if now.saturating_sub(e.synced_at) > stale_after(e.interval) {
            // The store has not answered for this key for a while: what this instance
            // knows is too old to decide on; the store decides (and when it cannot, the
            // rule's failure mode), and the next push reads it again.
            e.stale = true;
            return Local::Exact;
        }
        let room = e.room(now);
        let used = e.pending.saturating_add(e.in_flight);
        let reset = e.reset_at.saturating_sub(now);
        self.counters.local.fetch_add(1, Ordering::Relaxed);
        if used.saturating_add(cost) <= room {
            e.pending += cost;
            let left = room - used - cost;
            return Local::Decided(Decision::allow(limit.limit(), left, reset));
        }
        // Over, as far as this instance knows: read the room again at the next push.
        e.stale = true;
        let retry = match limit.algorithm() {
            Algorithm::FixedWindow(_) => reset,
            _ => e.interval,
        };
        Local::Decided(Decision::reject(
            limit.limit(),
            room.saturating_sub(used),
            reset,
            retry.max(1),
        ))
    }

    /// Takes back `cost` a check admitted here, its request being rejected.
    pub fn give_back(&self, limit: &Limit, key: &[u8], cost: u64) {
        let fp = fingerprint(limit, key);
        if let Some(e) = self.shard(fp).lock().get_mut(&fp) {
            e.pending = e.pending.saturating_sub(cost);
        }
    }

    /// Starts counting `key` here from the shared store's decision `d` of a call sent at
    /// `sent` (which charged the store itself when it admitted).
    pub fn seed(&self, limit: &Limit, key: &[u8], d: &Decision, sent: Nanos, interval: Nanos) {
        let fp = fingerprint(limit, key);
        let mut shard = self.shard(fp).lock();
        if shard.len() >= self.per_shard {
            return;
        }
        shard.entry(fp).or_insert_with(|| Entry {
            limit: *limit,
            key: key.into(),
            interval,
            seen: d.remaining,
            seen_at: sent,
            reset_at: sent.saturating_add(d.reset_after),
            pending: 0,
            in_flight: 0,
            stale: false,
            pushed_at: sent,
            synced_at: sent,
            last_used: sent,
        });
    }

    /// The keys due for a push at `now` (pending units, or a room to read again, and
    /// their interval passed); their pending units move in flight. `all`: every key
    /// with anything to push, due or not (a flush before stopping).
    pub fn due(&self, now: Nanos, all: bool) -> Vec<Push> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            for (&fp, e) in shard.lock().iter_mut() {
                let wanted = e.pending > 0 || (e.stale && !all);
                let time = all || now.saturating_sub(e.pushed_at) >= e.interval;
                if !wanted || !time || e.in_flight > 0 {
                    continue;
                }
                e.in_flight = e.pending;
                e.pending = 0;
                e.pushed_at = now;
                out.push(Push {
                    fp,
                    limit: e.limit,
                    key: e.key.clone(),
                    units: e.in_flight,
                });
            }
        }
        out
    }

    /// The store answered `d` to a push sent at `sent`: the key's room is what it said.
    pub fn settled(&self, push: &Push, d: &Decision, sent: Nanos) {
        let mut shard = self.shard(push.fp).lock();
        let Some(e) = shard.get_mut(&push.fp) else {
            return;
        };
        // A charge that did not fit is made anyway: the room after it is what was left
        // before it, less the charge.
        e.seen = if d.allowed {
            d.remaining
        } else {
            d.remaining.saturating_sub(push.units)
        };
        e.seen_at = sent;
        e.reset_at = sent.saturating_add(d.reset_after);
        e.in_flight = 0;
        e.stale = false;
        e.synced_at = sent;
        self.counters.units.fetch_add(push.units, Ordering::Relaxed);
        if push.units > 0 {
            self.per_limit
                .add(push.limit.id(), |s| s.units_synced += push.units);
        }
    }

    /// A push failed: its units are pushed again next time.
    pub fn unsettled(&self, push: &Push) {
        if let Some(e) = self.shard(push.fp).lock().get_mut(&push.fp) {
            e.pending += e.in_flight;
            e.in_flight = 0;
            e.pushed_at = 0;
        }
    }

    /// Forgets keys with nothing to push that were not used for `idle`. Returns how many
    /// are kept.
    pub fn sweep(&self, now: Nanos, idle: Nanos) -> usize {
        let mut kept = 0;
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            shard.retain(|_, e| {
                e.pending > 0 || e.in_flight > 0 || now.saturating_sub(e.last_used) < idle
            });
            kept += shard.len();
        }
        kept
    }

    /// Units admitted here and not yet settled with the store, over every key.
    pub fn unsettled_units(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| {
                s.lock()
                    .values()
                    .map(|e| e.pending + e.in_flight)
                    .sum::<u64>()
            })
            .sum()
    }
}
