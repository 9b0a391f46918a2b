//! [`SpaceSaving`]: the heaviest hitters of a stream of keys, in memory fixed whatever
//! the stream (Metwally, Agrawal and El Abbadi, "Efficient Computation of Frequent and
//! Top-k Elements in Data Streams", 2005).
//!
//! The sketch keeps at most `capacity` keys, each with a count. A key it holds has its
//! count raised; a new key, while there is room, enters with its weight; once full, a
//! new key takes the place of the key with the smallest count and inherits that count
//! (recorded as the entry's `error`, the most it may overstate). So:
//!
//! - every count overstates its key's true total by at most its `error`, and never
//!   understates it;
//! - any key whose true total exceeds `total / capacity` is held;
//! - memory is bounded by `capacity` entries of at most `max_key_bytes` bytes each:
//!   keys are truncated to that length (at a character boundary) when offered, so keys
//!   that differ only past it count as one.
//!
//! An update costs one hash of the (truncated) key and O(log capacity) moves in a
//! min-heap of the counts.
//!
//! ```
//! use tollgate::sketch::SpaceSaving;
//!
//! let mut top = SpaceSaving::new(4, 16);
//! for key in ["a", "b", "a", "c", "a", "d", "e", "b"] {
//!     top.offer(key, 1);
//! }
//! let heaviest = top.top(2);
//! assert_eq!(heaviest[0].key, "a");
//! assert_eq!(heaviest[0].count, 3);
//! assert!(top.len() <= 4);
//! ```

use hashbrown::HashTable;

/// One key the sketch holds, as [`SpaceSaving::top`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeavyHitter {
    /// The key, truncated to the sketch's `max_key_bytes`.
    pub key: String,
    /// Whether the offered key was longer than `key`.
    pub truncated: bool,
    /// Its count: at least its true total (of the truncated key), at most `error` more.
    pub count: u64,
    /// How much of `count` may belong to keys it replaced.
    pub error: u64,
}

/// A held key.
#[derive(Debug)]
struct Slot {
    /// Allocated once, with room for `max_key_bytes`: a key that takes the place of
    /// another is copied into it, so a stream of new keys allocates nothing.
    key: String,
    truncated: bool,
    hash: u64,
    count: u64,
    error: u64,
}

/// The Space-Saving heavy-hitter sketch: see the [module documentation](self).
pub struct SpaceSaving {
    capacity: usize,
    max_key_bytes: usize,
    /// The held keys; a slot keeps its place until its key is replaced.
    slots: Vec<Slot>,
    /// Slot numbers as a min-heap by count.
    heap: Vec<u32>,
    /// Each slot's place in `heap`.
    place: Vec<u32>,
    /// Slot numbers by their key's hash.
    index: HashTable<u32>,
    hasher: ahash::RandomState,
    /// The sum of the weights offered.
    total: u64,
}

impl std::fmt::Debug for SpaceSaving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpaceSaving")
            .field("capacity", &self.capacity)
            .field("max_key_bytes", &self.max_key_bytes)
            .field("len", &self.slots.len())
            .field("total", &self.total)
            .finish()
    }
}

impl SpaceSaving {
    /// A sketch holding at most `capacity` keys (at least 1) of at most `max_key_bytes`
    /// bytes each (longer keys are truncated). Nothing is allocated until keys come.
    pub fn new(capacity: usize, max_key_bytes: usize) -> Self {
        let capacity = capacity.clamp(1, u32::MAX as usize);
        Self {
            capacity,
            max_key_bytes,
            slots: Vec::new(),
            heap: Vec::new(),
            place: Vec::new(),
            index: HashTable::new(),
            hasher: ahash::RandomState::new(),
            total: 0,
        }
    }

    /// The most keys it holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Keys held now (at most [`capacity`](Self::capacity)).
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether no key was offered since it was made or [`clear`](Self::clear)ed.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The sum of the weights offered.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Bytes of key text held: at most `capacity × max_key_bytes`.
    pub fn key_bytes(&self) -> usize {
        self.slots.iter().map(|s| s.key.len()).sum()
    }

    /// Counts `weight` for `key` (truncated to `max_key_bytes`).
    pub fn offer(&mut self, key: &str, weight: u64) {
        let (key, truncated) = truncate(key, self.max_key_bytes);
        self.total = self.total.saturating_add(weight);
        let hash = self.hasher.hash_one(key);
        let slots = &self.slots;
        if let Some(&slot) = self.index.find(hash, |&s| &*slots[s as usize].key == key) {
            let s = &mut self.slots[slot as usize];
            s.count = s.count.saturating_add(weight);
            s.truncated |= truncated;
            self.sift_down(self.place[slot as usize] as usize);
            return;
        }
        if self.slots.len() < self.capacity {
            let slot = self.slots.len() as u32;
            let mut text = String::with_capacity(self.max_key_bytes);
            text.push_str(key);
            self.slots.push(Slot {
                key: text,
                truncated,
                hash,
                count: weight,
                error: 0,
            });
            self.place.push(self.heap.len() as u32);
            self.heap.push(slot);
            let slots = &self.slots;
            self.index
                .insert_unique(hash, slot, |&s| slots[s as usize].hash);
            self.sift_up(self.heap.len() - 1);
            return;
        }
        // Full: the key with the smallest count gives its place to this one.
        let slot = self.heap[0];
        let old_hash = self.slots[slot as usize].hash;
        if let Ok(entry) = self.index.find_entry(old_hash, |&s| s == slot) {
            entry.remove();
        }
        let s = &mut self.slots[slot as usize];
        let min = s.count;
        s.key.clear();
        s.key.push_str(key);
        s.truncated = truncated;
        s.hash = hash;
        s.error = min;
        s.count = min.saturating_add(weight);
        let slots = &self.slots;
        self.index
            .insert_unique(hash, slot, |&s| slots[s as usize].hash);
        self.sift_down(0);
    }

    /// The `n` keys with the highest counts, highest first.
    pub fn top(&self, n: usize) -> Vec<HeavyHitter> {
        let mut held: Vec<&Slot> = self.slots.iter().collect();
        held.sort_unstable_by(|a, b| b.count.cmp(&a.count).then_with(|| a.key.cmp(&b.key)));
        held.into_iter()
            .take(n)
            .map(|s| HeavyHitter {
                key: s.key.to_string(),
                truncated: s.truncated,
                count: s.count,
                error: s.error,
            })
            .collect()
    }

    /// Forgets every key, keeping the memory.
    pub fn clear(&mut self) {
        self.slots.clear();
        self.heap.clear();
        self.place.clear();
        self.index.clear();
        self.total = 0;
    }

    fn count_at(&self, at: usize) -> u64 {
        self.slots[self.heap[at] as usize].count
    }

    fn swap(&mut self, a: usize, b: usize) {
        self.heap.swap(a, b);
        self.place[self.heap[a] as usize] = a as u32;
        self.place[self.heap[b] as usize] = b as u32;
    }

    fn sift_up(&mut self, mut at: usize) {
        while at > 0 {
            let parent = (at - 1) / 2;
            if self.count_at(parent) <= self.count_at(at) {
                break;
            }
            self.swap(parent, at);
            at = parent;
        }
    }

    fn sift_down(&mut self, mut at: usize) {
        let len = self.heap.len();
        loop {
            let (left, right) = (2 * at + 1, 2 * at + 2);
            let mut least = at;
            if left < len && self.count_at(left) < self.count_at(least) {
                least = left;
            }
            if right < len && self.count_at(right) < self.count_at(least) {
                least = right;
            }
            if least == at {
                return;
            }
            self.swap(at, least);
            at = least;
        }
    }
}

/// `key` cut to at most `max` bytes at a character boundary, and whether it was cut.
fn truncate(key: &str, max: usize) -> (&str, bool) {
    if key.len() <= max {
        return (key, false);
    }
    let mut end = max;
    while !key.is_char_boundary(end) {
        end -= 1;
    }
    (&key[..end], true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// The heap property and the index agree with the slots.
    fn consistent(s: &SpaceSaving) {
        assert_eq!(s.heap.len(), s.slots.len());
        for (at, &slot) in s.heap.iter().enumerate() {
            assert_eq!(s.place[slot as usize] as usize, at);
            if at > 0 {
                assert!(s.count_at((at - 1) / 2) <= s.count_at(at));
            }
        }
        for slot in &s.slots {
            let found = s
                .index
                .find(slot.hash, |&i| s.slots[i as usize].key == slot.key);
            assert!(found.is_some());
        }
    }

    /// A deterministic generator (xorshift), so the tests need no dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        /// Uniform in [0, 1).
        fn unit(&mut self) -> f64 {
            (self.next() >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    #[test]
    fn a_million_distinct_keys_stay_within_the_capacity() {
        let mut s = SpaceSaving::new(64, 32);
        for i in 0..1_000_000u64 {
            s.offer(&format!("{i:x}-client-{:040}", i), 1);
            if i % 100_000 == 0 {
                consistent(&s);
            }
        }
        assert_eq!(s.len(), 64);
        assert_eq!(s.slots.capacity(), 64);
        assert!(s.key_bytes() <= 64 * 32);
        assert!(s.index.capacity() < 256);
        assert_eq!(s.total(), 1_000_000);
        consistent(&s);
        // Each count bounds its key's true count (1) from above, within its error.
        for h in s.top(64) {
            assert!(h.truncated && h.key.len() <= 32);
            assert!(h.count >= 1 && h.count - h.error <= 1);
        }
    }

    #[test]
    fn the_true_top_ten_of_a_skewed_stream_is_found() {
        // Zipf(1.1) over 100,000 keys, 1,000,000 draws, by inverse transform.
        let n = 100_000usize;
        let weights: Vec<f64> = (1..=n).map(|r| 1.0 / (r as f64).powf(1.1)).collect();
        let sum: f64 = weights.iter().sum();
        let mut cumulative = Vec::with_capacity(n);
        let mut acc = 0.0;
        for w in &weights {
            acc += w / sum;
            cumulative.push(acc);
        }
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let mut truth: HashMap<String, u64> = HashMap::new();
        let mut s = SpaceSaving::new(100, 64);
        for _ in 0..1_000_000 {
            let u = rng.unit();
            let rank = cumulative.partition_point(|&c| c < u).min(n - 1);
            // Scatter the ranks over the key space so that order says nothing.
            let key = format!(
                "user-{:016x}",
                (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            );
            *truth.entry(key.clone()).or_default() += 1;
            s.offer(&key, 1);
        }
        consistent(&s);
        let mut true_top: Vec<(&String, &u64)> = truth.iter().collect();
        true_top.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
        let true_top: Vec<&str> = true_top.iter().take(10).map(|(k, _)| k.as_str()).collect();
        let found: Vec<String> = s.top(10).into_iter().map(|h| h.key).collect();
        let mut a: Vec<&str> = true_top.clone();
        let mut b: Vec<&str> = found.iter().map(String::as_str).collect();
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b, "the sketch's top 10 is the true top 10");
        for h in s.top(10) {
            let t = truth[&h.key];
            assert!(h.count >= t && h.count - h.error <= t, "{h:?} true {t}");
        }
    }

    #[test]
    fn weights_and_truncation() {
        let mut s = SpaceSaving::new(2, 4);
        s.offer("abcdef", 5);
        s.offer("abcdXYZ", 2);
        // "é" is 2 bytes, "€" 3: 4 bytes cut inside the first "€".
        s.offer("é€€", 1);
        let top = s.top(5);
        assert_eq!(top.len(), 2);
        assert_eq!(top[0].key, "abcd");
        assert_eq!(top[0].count, 7);
        assert!(top[0].truncated);
        assert_eq!(top[1].key, "é");
        s.offer("new", 1);
        let top = s.top(5);
        assert_eq!(top[1].key, "new");
        assert_eq!((top[1].count, top[1].error), (2, 1));
        s.clear();
        assert!(s.is_empty() && s.total() == 0);
    }
}
