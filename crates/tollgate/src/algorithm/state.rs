//! [`KeyState`]: the 16-byte per-key state of the fixed window and the bucket algorithms
//! (the arithmetic on the buckets' exact instant is `bucket.rs`'s).

use crate::clock::Nanos;

/// Per-key state: when the key is fresh again, and one algorithm-specific word.
///
/// `expires_at` has the same meaning for every algorithm: from that instant on the
/// state is equivalent to [`KeyState::default()`] (a key never seen), so a store may
/// drop it. `word` is the algorithm's own:
///
/// - fixed window: `expires_at` = end of the counted window, `word` = its count;
/// - token bucket, GCRA, leaky bucket: an exact instant `x` (when the bucket is full,
///   the theoretical arrival time, when the bucket is empty) kept as a rational number
///   of nanoseconds with denominator `limit`: `expires_at = ceil(x)` and
///   `word = (ceil(x) - x) × limit`, the "deficit". Scaled by `limit`, every instant
///   and every increment (`window` per unit of cost) is an integer, so nothing is
///   rounded away: 100 per second called every 5 ms admits exactly 100 per second.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct KeyState {
    /// The instant from which this state is the same as a fresh one.
    pub expires_at: Nanos,
    /// Algorithm-specific payload (see the type's documentation).
    pub word: u64,
}

impl KeyState {
    /// True if the state is back to fresh at `now`.
    pub fn is_fresh(&self, now: Nanos) -> bool {
        self.expires_at <= now
    }
}

/// Per-key state of a token bucket or GCRA with a warm-up (`warmup`; see
/// `docs/algorithms.md`, "Warm-up"): the bucket's exact instant and how warm the key is,
/// in 32 bytes.
///
/// Kept as the exact instant `fresh` from which the key is fresh again (its bucket full
/// and the key fully cold: the same as [`WarmState::default()`], so a store may drop it)
/// and `used`, how far from fully cold the key was at its bucket's instant, in the
/// buckets' scaled units (`window` per unit of cost). The bucket's instant is
/// `fresh − (2 × window + used) / limit`; two stable intervals past it (the grace) the
/// key cools by `limit` scaled units per ns, so at `now` it is
/// `min(used, fresh × limit − now × limit)` from fully cold (never below 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct WarmState {
    /// The exact instant from which the state is the same as a fresh one, in the
    /// buckets' form ([`KeyState`]: `expires_at` its ceiling, `word` the deficit).
    pub fresh: KeyState,
    /// How far from fully cold the key is at its bucket's instant, scaled by `window`
    /// per unit (0: fully cold).
    pub used: u128,
}

impl WarmState {
    /// True if the state is back to fresh (full and fully cold) at `now`.
    pub fn is_fresh(&self, now: Nanos) -> bool {
        self.fresh.is_fresh(now)
    }

    /// The instant from which the state is the same as a fresh one.
    pub fn expires_at(&self) -> Nanos {
        self.fresh.expires_at
    }
}
