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
