//! [`KeyState`]: the 16-byte per-key state of the fixed window and the bucket algorithms.

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

    /// The exact instant stored by the bucket algorithms, multiplied by `rate`.
    pub(crate) fn scaled_instant(&self, rate: u64) -> u128 {
        (self.expires_at as u128 * rate as u128).saturating_sub(self.word as u128)
    }

    /// Stores the exact instant `scaled / rate` (the algorithms use [`advanced`](Self::advanced),
    /// which avoids the u128 division; this is its reference in tests).
    /// An instant beyond `u64::MAX` nanoseconds is clamped there.
    #[cfg(test)]
    pub(crate) fn from_scaled_instant(scaled: u128, rate: u64) -> Self {
        let rate = rate.max(1) as u128;
        let ceil = scaled.div_ceil(rate);
        match u64::try_from(ceil) {
            Ok(expires_at) => Self {
                expires_at,
                // (ceil × rate − scaled) < rate ≤ u64::MAX
                word: (ceil * rate - scaled) as u64,
            },
            Err(_) => Self {
                expires_at: u64::MAX,
                word: 0,
            },
        }
    }
}

impl KeyState {
    /// The exact instant `max(stored, now)`, as a `KeyState`.
    pub(crate) fn at_least(&self, now: Nanos, rate: u64) -> KeyState {
        if self.scaled_instant(rate) >= now as u128 * rate as u128 {
            *self
        } else {
            KeyState {
                expires_at: now,
                word: 0,
            }
        }
    }

    /// The instant after a charge the bucket could not hold (`charge_rejected`):
    /// `max(stored, now) + delta / rate`, but at most `now + 2 × capacity / rate` (a bucket
    /// owes at most one bucket, and the scripts' arithmetic stays exact).
    pub(crate) fn charged(&self, now: Nanos, rate: u64, delta: u128, capacity: u128) -> KeyState {
        let charged = self.at_least(now, rate).advanced(delta, rate);
        let most = KeyState {
            expires_at: now,
            word: 0,
        }
        .advanced(2 * capacity, rate);
        if charged.scaled_instant(rate) > most.scaled_instant(rate) {
            most
        } else {
            charged
        }
    }

    /// This exact instant moved later by `delta / rate` ns, without dividing the whole
    /// (u128) instant: only `delta`, which is small, is divided.
    pub(crate) fn advanced(&self, delta: u128, rate: u64) -> KeyState {
        let rate = rate.max(1);
        let word = self.word as u128;
        if delta < word {
            // Still before the same whole nanosecond.
            return KeyState {
                expires_at: self.expires_at,
                word: (word - delta) as u64,
            };
        }
        let x = delta - word;
        let whole = div_ceil(x, rate);
        KeyState {
            expires_at: self.expires_at.saturating_add(whole),
            word: (whole as u128 * rate as u128 - x) as u64,
        }
    }
}

/// `ceil(n / d)` as nanoseconds, saturating at `u64::MAX`.
pub(crate) fn ceil_div_nanos(n: u128, d: u64) -> Nanos {
    div_ceil(n, d)
}

/// `n / d` rounded down, saturating at `u64::MAX`; u64 division when `n` fits.
pub(crate) fn floor_div(n: u128, d: u64) -> u64 {
    let d = d.max(1);
    match u64::try_from(n) {
        Ok(n) => n / d,
        Err(_) => u64::try_from(n / d as u128).unwrap_or(u64::MAX),
    }
}

/// `ceil(n / d)`, saturating at `u64::MAX`; u64 division when `n` fits.
fn div_ceil(n: u128, d: u64) -> u64 {
    let d = d.max(1);
    match u64::try_from(n) {
        Ok(n) => n.div_ceil(d),
        Err(_) => u64::try_from(n.div_ceil(d as u128)).unwrap_or(u64::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaled_instants_round_trip_exactly() {
        for (scaled, rate) in [
            (0u128, 3u64),
            (10, 3),
            (11, 3),
            (12, 3),
            (7, 1),
            (1 << 70, 1_000_003),
        ] {
            let s = KeyState::from_scaled_instant(scaled, rate);
            assert_eq!(s.scaled_instant(rate), scaled, "{scaled}/{rate}");
            assert!(s.word < rate);
        }
    }

    #[test]
    fn advancing_matches_dividing_the_whole_instant() {
        for (start, delta, rate) in [
            (1_000u128 * 7 + 3, 5u128, 7u64),
            (70, 0, 7),
            (70, 1, 7),
            (71, 6, 7),
            (0, 1 << 40, 3),
            (99, 1, 1_000_000_007),
        ] {
            let s = KeyState::from_scaled_instant(start, rate);
            assert_eq!(
                s.advanced(delta, rate),
                KeyState::from_scaled_instant(start + delta, rate),
                "{start}+{delta} /{rate}"
            );
        }
    }

    #[test]
    fn an_instant_past_u64_saturates() {
        let s = KeyState::from_scaled_instant(u128::MAX, 2);
        assert_eq!(s.expires_at, u64::MAX);
    }
}
