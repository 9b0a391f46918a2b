//! [`MemoryInFlight`]: in-flight permits counted in this process.
//!
//! ## How it is built
//! A key is reduced to a 64-bit fingerprint, a keyed hash (`ahash`, random seed per
//! store) of its bytes, and its count lives in one of 16 shards, each a `parking_lot`
//! mutex around a `hashbrown` map from fingerprint to the number of permits held.
//! Taking or giving back a permit locks one shard for a lookup and an increment or a
//! decrement, nothing more.
//!
//! Two keys with the same fingerprint share one count. With a random 64-bit hash that
//! happens to a given pair with probability 2^-64, an attacker who does not know the
//! seed cannot aim for it, and the effect is only ever a stricter limit for the two
//! keys, never a looser one.
//!
//! ## Memory
//! A key has an entry only while at least one of its permits is held: the entry is
//! removed when its count returns to 0. Memory is therefore bounded by the number of
//! requests in flight at once (16 bytes per key in a hash table), not by the number of
//! keys ever seen: a client sending requests with ever new keys cannot grow the store
//! beyond the requests it keeps open, and those are what the gateway bounds anyway.
//! Nothing needs sweeping.

use std::fmt;
use std::hash::BuildHasher;
use std::sync::Arc;

use crossbeam_utils::CachePadded;
use hashbrown::hash_map::Entry;
use hashbrown::HashMap;
use parking_lot::Mutex;

use super::{InFlight, Permit};
use crate::store::Error;
use crate::store::Fingerprint;

/// Number of shards (a power of two).
const SHARDS: usize = 16;

/// In-flight permits counted in this process. Cheap to clone: clones share the counts.
///
/// ```
/// use tollgate::inflight::MemoryInFlight;
/// let inflight = MemoryInFlight::new();
/// let permit = inflight.try_acquire(b"10.0.0.1", 1).expect("nothing in flight yet");
/// assert_eq!(inflight.held(b"10.0.0.1"), 1);
/// assert!(inflight.try_acquire(b"10.0.0.1", 1).is_none());
/// drop(permit);
/// assert_eq!(inflight.held(b"10.0.0.1"), 0);
/// assert_eq!(inflight.keys(), 0); // no entry is left behind
/// ```
#[derive(Clone, Default)]
pub struct MemoryInFlight {
    shards: Arc<Shards>,
}

/// The counts, shared by the store and every permit it gave out.
struct Shards {
    hasher: ahash::RandomState,
    maps: [CachePadded<Mutex<Counts>>; SHARDS],
}

/// Permits held per fingerprint; a fingerprint with none held has no entry.
type Counts = HashMap<u64, u64, Fingerprint>;

/// One permit of a [`MemoryInFlight`]: gives it back when dropped.
pub(super) struct Held {
    shards: Arc<Shards>,
    fp: u64,
}

impl Default for Shards {
    fn default() -> Self {
        // Seeded from the OS like std's HashMap: fingerprints are unpredictable.
        let s = std::collections::hash_map::RandomState::new();
        Self {
            hasher: ahash::RandomState::with_seeds(
                s.hash_one(1u8),
                s.hash_one(2u8),
                s.hash_one(3u8),
                s.hash_one(4u8),
            ),
            maps: std::array::from_fn(|_| CachePadded::new(Mutex::new(Counts::default()))),
        }
    }
}

impl Shards {
    fn fingerprint(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    fn shard(&self, fp: u64) -> &Mutex<Counts> {
        // hashbrown uses the low bits (bucket) and the top 7 (tag); take bits below the tag.
        &self.maps[(fp >> (64 - 7 - SHARDS.trailing_zeros())) as usize % SHARDS]
    }

    fn release(&self, fp: u64) {
        let mut counts = self.shard(fp).lock();
        if let Entry::Occupied(mut e) = counts.entry(fp) {
            if *e.get() <= 1 {
                e.remove();
            } else {
                *e.get_mut() -= 1;
            }
        }
    }
}

impl MemoryInFlight {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes one permit for `key` if fewer than `max` are held, at once: the
    /// synchronous form of [`InFlight::acquire`]. `None` when all `max` are taken
    /// (always, for `max` 0).
    pub fn try_acquire(&self, key: &[u8], max: u64) -> Option<Permit> {
        let fp = self.shards.fingerprint(key);
        {
            let mut counts = self.shards.shard(fp).lock();
            match counts.entry(fp) {
                Entry::Occupied(mut e) => {
                    if *e.get() >= max {
                        return None;
                    }
                    *e.get_mut() += 1;
                }
                Entry::Vacant(e) => {
                    if max == 0 {
                        return None;
                    }
                    e.insert(1);
                }
            }
        }
        Some(Permit::memory(Held {
            shards: Arc::clone(&self.shards),
            fp,
        }))
    }

    /// Permits of `key` held now (for tests and metrics).
    pub fn held(&self, key: &[u8]) -> u64 {
        let fp = self.shards.fingerprint(key);
        self.shards.shard(fp).lock().get(&fp).copied().unwrap_or(0)
    }

    /// Keys with at least one permit held now: the entries the store keeps.
    pub fn keys(&self) -> usize {
        self.shards.maps.iter().map(|m| m.lock().len()).sum()
    }
}

impl InFlight for MemoryInFlight {
    fn acquire<'a>(
        &'a self,
        key: &'a [u8],
        max: u64,
    ) -> impl std::future::Future<Output = Result<Option<Permit>, Error>> + Send + 'a {
        std::future::ready(Ok(self.try_acquire(key, max)))
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.shards.release(self.fp);
    }
}

impl fmt::Debug for Held {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryPermit")
            .field("fingerprint", &format_args!("{:016x}", self.fp))
            .finish()
    }
}

impl fmt::Debug for MemoryInFlight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryInFlight")
            .field("keys", &self.keys())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Barrier;

    use super::*;

    #[test]
    fn up_to_max_then_refused_and_a_drop_frees_one() {
        let inflight = MemoryInFlight::new();
        let mut permits: Vec<Permit> = (0..3)
            .map(|i| {
                inflight
                    .try_acquire(b"k", 3)
                    .unwrap_or_else(|| panic!("permit {i} of 3"))
            })
            .collect();
        assert_eq!(inflight.held(b"k"), 3);
        assert!(inflight.try_acquire(b"k", 3).is_none());
        assert_eq!(inflight.held(b"k"), 3, "a refusal takes nothing");
        // Another key is not affected.
        let other = inflight.try_acquire(b"other", 3);
        assert!(other.is_some());
        permits.pop();
        assert_eq!(inflight.held(b"k"), 2);
        permits.push(inflight.try_acquire(b"k", 3).expect("one was freed"));
        assert!(inflight.try_acquire(b"k", 3).is_none());
        // A lower max for the same key refuses while as many are held.
        assert!(inflight.try_acquire(b"k", 2).is_none());
        drop(permits);
        drop(other);
        assert_eq!(inflight.held(b"k"), 0);
        assert_eq!(inflight.keys(), 0);
    }

    #[test]
    fn max_zero_refuses_and_keeps_nothing() {
        let inflight = MemoryInFlight::new();
        assert!(inflight.try_acquire(b"k", 0).is_none());
        assert_eq!(inflight.keys(), 0);
    }

    #[test]
    fn clones_share_their_counts() {
        let a = MemoryInFlight::new();
        let b = a.clone();
        let permit = a.try_acquire(b"k", 1);
        assert!(permit.is_some());
        assert!(b.try_acquire(b"k", 1).is_none());
        drop(a);
        drop(permit); // outlives the store it came from
        assert_eq!(b.keys(), 0);
    }

    #[test]
    fn the_trait_future_is_ready() {
        let inflight = MemoryInFlight::new();
        let fut = inflight.acquire(b"k", 1);
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        let mut fut = std::pin::pin!(fut);
        match fut.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(Ok(Some(_))) => {}
            other => panic!("expected a permit at once, got {other:?}"),
        }
        assert_eq!(inflight.keys(), 0);
    }

    #[test]
    fn threads_on_many_keys_never_exceed_max() {
        const THREADS: usize = 8;
        const KEYS: usize = 5;
        const ROUNDS: usize = 2_000;
        const MAX: u64 = 3;
        let inflight = MemoryInFlight::new();
        let barrier = Barrier::new(THREADS);
        // Permits each test thread believes are held per key, and the peaks seen.
        let holding: [AtomicU64; KEYS] = std::array::from_fn(|_| AtomicU64::new(0));
        let peak_locked = AtomicU64::new(0);
        let peak_holding = AtomicU64::new(0);
        let admitted = AtomicU64::new(0);
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let (inflight, barrier, holding) = (&inflight, &barrier, &holding);
                let (peak_locked, peak_holding, admitted) =
                    (&peak_locked, &peak_holding, &admitted);
                s.spawn(move || {
                    barrier.wait();
                    let mut kept: Vec<Permit> = Vec::new();
                    for round in 0..ROUNDS {
                        let k = (t + round) % KEYS;
                        let key = format!("key-{k}");
                        if let Some(permit) = inflight.try_acquire(key.as_bytes(), MAX) {
                            admitted.fetch_add(1, Ordering::Relaxed);
                            // The count as the store holds it, read under its lock.
                            peak_locked.fetch_max(inflight.held(key.as_bytes()), Ordering::SeqCst);
                            let now = holding[k].fetch_add(1, Ordering::SeqCst) + 1;
                            peak_holding.fetch_max(now, Ordering::SeqCst);
                            if round % 3 == 0 {
                                std::thread::yield_now();
                            }
                            holding[k].fetch_sub(1, Ordering::SeqCst);
                            // Sometimes keep a permit a little longer, across keys.
                            if round % 7 == 0 {
                                kept.push(permit);
                            }
                        }
                        if kept.len() > 2 {
                            drop(kept.remove(0));
                        }
                    }
                });
            }
        });
        assert!(admitted.load(Ordering::Relaxed) > 0);
        let locked = peak_locked.load(Ordering::SeqCst);
        let held = peak_holding.load(Ordering::SeqCst);
        assert!((1..=MAX).contains(&locked), "peak under the lock: {locked}");
        assert!((1..=MAX).contains(&held), "peak held: {held}");
        for k in 0..KEYS {
            assert_eq!(inflight.held(format!("key-{k}").as_bytes()), 0);
        }
        assert_eq!(inflight.keys(), 0, "every entry is gone with its permits");
    }
}
