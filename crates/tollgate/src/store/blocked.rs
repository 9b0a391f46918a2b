//! The blocked-key cache: keys a remote store said are over their limit until a known
//! instant are answered here, without a round trip, until then.
//!
//! A rejection's `retry_after` is the earliest the same request could pass if nobody
//! else were charged meanwhile; other instances can only push it later. So rejecting
//! locally until then never admits less than the store would have (for a request of
//! the same or a larger cost). Entries are keyed by a fingerprint of the limit (its id
//! and its numbers, so a reload that changes a limit does not keep stale entries) and
//! the key, and the cache holds at most `capacity` entries: when full, expired entries
//! are dropped and, if none has expired, the new entry is not cached. A full shard is
//! swept only once its earliest entry has expired (and at most every 10 ms), so a
//! flood of new rejected keys cannot make every request scan it.

use std::hash::{BuildHasher, Hash, Hasher};

use hashbrown::HashMap;
use parking_lot::Mutex;

use crate::clock::Nanos;
use crate::decision::Decision;
use crate::store::Check;

const SHARDS: usize = 16;

/// A bounded map from (limit, key) to "rejected until".
pub(crate) struct BlockedCache {
    shards: Box<[Mutex<Shard>]>,
    per_shard: usize,
    hasher: ahash::RandomState,
}

#[derive(Default)]
struct Shard {
    entries: HashMap<u64, Entry>,
    /// When a full shard may be swept again: its earliest expiry, at least 10 ms after
    /// the last sweep.
    next_sweep: Nanos,
}

/// Least time between two sweeps of a full shard.
const SWEEP_GAP: Nanos = 10_000_000;

#[derive(Debug, Clone, Copy)]
struct Entry {
    until: Nanos,
    cost: u64,
    reset_at: Nanos,
    limit: u64,
}

impl BlockedCache {
    pub fn new(capacity: usize) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            per_shard: capacity.div_ceil(SHARDS).max(1),
            hasher: ahash::RandomState::new(),
        }
    }

    fn fingerprint(&self, check: &Check<'_>) -> u64 {
        let mut h = self.hasher.build_hasher();
        check.limit.id().hash(&mut h);
        check.limit.algorithm().hash(&mut h);
        check.limit.lockout().hash(&mut h);
        check.key.hash(&mut h);
        h.finish()
    }

    fn shard(&self, fp: u64) -> &Mutex<Shard> {
        &self.shards[(fp as usize) % SHARDS]
    }

    /// The local rejection for `check` at `now`, if its key is known to be blocked.
    pub fn lookup(&self, check: &Check<'_>, now: Nanos) -> Option<Decision> {
        if !cacheable(check) || check.cost == 0 {
            return None;
        }
        let fp = self.fingerprint(check);
        let mut shard = self.shard(fp).lock();
        let e = *shard.entries.get(&fp)?;
        if e.until <= now {
            shard.entries.remove(&fp);
            return None;
        }
        if check.cost < e.cost {
            return None;
        }
        let mut d = Decision::reject(e.limit, 0, e.reset_at.saturating_sub(now), e.until - now);
        d.from_cache = true;
        Some(d)
    }

    /// Remembers a rejection the store decided at `now`.
    pub fn remember(&self, check: &Check<'_>, d: &Decision, now: Nanos) {
        if d.allowed || !cacheable(check) || d.can_never_pass() || d.retry_after == 0 {
            return;
        }
        let fp = self.fingerprint(check);
        let entry = Entry {
            until: now.saturating_add(d.retry_after),
            cost: check.cost,
            reset_at: now.saturating_add(d.reset_after),
            limit: d.limit,
        };
        let mut shard = self.shard(fp).lock();
        if shard.entries.len() >= self.per_shard && !shard.entries.contains_key(&fp) {
            if now < shard.next_sweep {
                return;
            }
            shard.entries.retain(|_, e| e.until > now);
            let earliest = shard.entries.values().map(|e| e.until).min();
            shard.next_sweep = earliest.unwrap_or(0).max(now.saturating_add(SWEEP_GAP));
            if shard.entries.len() >= self.per_shard {
                return;
            }
        }
        shard.entries.insert(fp, entry);
    }

    /// Entries held (live or not yet swept).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().entries.len()).sum()
    }
}

/// Whether a check's rejection may be answered from the cache: not one in shadow or quota
/// mode (its rejection alone does not reject the request), nor one that must be charged
/// when rejected (`charge_rejected`: only Redis can charge it).
fn cacheable(check: &Check<'_>) -> bool {
    !check.shadow && check.quota.is_none() && check.charge == super::ChargeRejected::None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{Algorithm, FixedWindow, Limit};
    use std::time::Duration;

    #[test]
    fn a_rejection_is_answered_locally_until_its_retry_time_and_the_cache_stays_bounded() {
        let limit = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
            1,
            Duration::from_secs(1),
        )))
        .unwrap();
        let cache = BlockedCache::new(32);
        let check = Check::new(&limit, "k", 1);
        let d = Decision::reject(1, 0, 500, 500);
        cache.remember(&check, &d, 1_000);
        let hit = cache.lookup(&check, 1_200).unwrap();
        assert!(hit.from_cache && !hit.allowed);
        assert_eq!(hit.retry_after, 300);
        assert!(
            cache.lookup(&check, 1_500).is_none(),
            "free again at the retry time"
        );
        assert!(cache.lookup(&check.in_shadow(), 1_200).is_none());
        for i in 0..10_000u32 {
            let key = i.to_string();
            cache.remember(&Check::new(&limit, &key, 1), &d, 1_000);
        }
        assert!(cache.len() <= 32);
        // Once entries expire (and the sweep gap has passed), new ones are cached.
        let later = 1_000 + 500 + SWEEP_GAP;
        let fresh = Check::new(&limit, "fresh", 1);
        cache.remember(&fresh, &d, later);
        assert!(cache.lookup(&fresh, later + 1).is_some());
    }
}
