//! Sliding window counter: the current window's count plus the previous window's count
//! weighted by how much of it the rolling window still covers.
//!
//! **Guarantee.** Never more than `limit` admitted in one aligned window (the estimate
//! is never below the current count), hence never more than `2 × limit` in any rolling
//! window of length `window`. That worst case needs the previous window's requests
//! bunched at its very end; for evenly spread traffic the estimate is close to exact,
//! and unlike the fixed window a client cannot simply burst `limit` on each side of a
//! boundary: right after the boundary the previous count still weighs almost fully.
//!
//! **State.** 16 bytes ([`KeyState`]): the current window's end + one window, and the
//! previous and current counts (32 bits each, so `limit <= 2^32 - 1`).
//!
//! **Maths.** With `start = now - now % window` and `elapsed = now - start`:
//! `estimate = current + floor(previous × (window - elapsed) / window)`. A request of
//! cost `c` passes iff `estimate + c <= limit`; then `current += c`.
//! `remaining = limit - estimate - c`; `reset_after` is the time to the window's end.
//!
//! **Example** (`shared/cases/tollgate/03-sliding-window.yaml`). 7 per minute, 5 in the
//! previous minute, 3 so far in this one: 18 s in (30 % of the way), the estimate is
//! `3 + floor(5 × 0.7) = 6`, so one more passes and the next does not.
//! ```
//! use std::time::Duration;
//! use tollgate::algorithm::{KeyState, SlidingWindow};
//! const S: u64 = 1_000_000_000;
//! let sw = SlidingWindow::new(7, Duration::from_secs(60));
//! let mut state = KeyState::default();
//! let t0 = 1_699_920_000 * S;
//! for _ in 0..5 { assert!(sw.check(&mut state, t0 + 30 * S, 1).allowed); }
//! for _ in 0..3 { assert!(sw.check(&mut state, t0 + 70 * S, 1).allowed); }
//! let d = sw.check(&mut state, t0 + 78 * S, 1);
//! assert_eq!((d.allowed, d.remaining), (true, 0));
//! assert!(!sw.check(&mut state, t0 + 78 * S, 1).allowed);
//! ```

use std::time::Duration;

use super::KeyState;
use crate::clock::{nanos, Nanos};
use crate::decision::{Decision, NEVER};

/// Sliding-window-counter parameters: `limit` per rolling `window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlidingWindow {
    /// Requests (cost units) per window; at most `u32::MAX`.
    pub limit: u64,
    /// Window length in nanoseconds.
    pub window: Nanos,
}

impl SlidingWindow {
    /// `limit` per `window`.
    pub fn new(limit: u64, window: Duration) -> Self {
        Self {
            limit,
            window: nanos(window),
        }
    }

    /// Decides a request of `cost` at `now`, charging `state` if it passes.
    pub fn check(&self, state: &mut KeyState, now: Nanos, cost: u64) -> Decision {
        let w = self.window.max(1);
        let limit = self.limit.min(u64::from(u32::MAX));
        let (end, previous, current) = self.counts(state, now, w);
        let start = end - w;
        // A clock that stepped back before the stored window counts as its start.
        let elapsed = now.saturating_sub(start).min(w);
        let weighted = weigh(previous, w - elapsed, w);
        let estimate = current + weighted;
        let reset_after = end.saturating_sub(now);
        if estimate.saturating_add(cost) <= limit {
            if cost > 0 {
                *state = KeyState {
                    expires_at: end.saturating_add(w),
                    word: (previous << 32) | (current + cost),
                };
            }
            return Decision::allow(limit, limit - estimate - cost, reset_after);
        }
        let remaining = limit.saturating_sub(estimate);
        if cost > limit {
            return Decision::reject(limit, remaining, reset_after, NEVER);
        }
        // When would `current + floor(previous × (w - e) / w) + cost <= limit` first hold?
        let retry = match (limit - cost).checked_sub(current) {
            Some(room) => first_elapsed_fitting(previous, room, w).saturating_sub(elapsed),
            // Not in this window: in the next one, `current` becomes the previous count.
            None => (w - elapsed) + first_elapsed_fitting(current, limit - cost, w),
        };
        Decision::reject(limit, remaining, reset_after, retry)
    }

    /// (end of the current window, previous count, current count) at `now`.
    fn counts(&self, state: &KeyState, now: Nanos, w: Nanos) -> (Nanos, u64, u64) {
        let aligned_end = (now - now % w).saturating_add(w);
        if state.expires_at <= now || state.expires_at < w {
            return (aligned_end, 0, 0);
        }
        let stored_end = state.expires_at - w;
        let (previous, current) = (state.word >> 32, state.word & u64::from(u32::MAX));
        if stored_end >= aligned_end {
            (stored_end, previous, current)
        } else if stored_end + w == aligned_end {
            (aligned_end, current, 0)
        } else {
            (aligned_end, 0, 0)
        }
    }
}

/// `floor(count × part / w)`.
fn weigh(count: u64, part: Nanos, w: Nanos) -> u64 {
    (count as u128 * part as u128 / w as u128) as u64
}

/// The smallest elapsed time `e` in `[0, w]` with `floor(count × (w - e) / w) <= room`.
fn first_elapsed_fitting(count: u64, room: u64, w: Nanos) -> Nanos {
    // floor(count (w - e) / w) <= room  <=>  count (w - e) < (room + 1) w
    let lhs = count as u128 * w as u128;
    let rhs = (room as u128 + 1) * w as u128;
    if lhs < rhs {
        return 0;
    }
    // e > (count w - (room + 1) w) / count
    let e = ((lhs - rhs) / count as u128) as u64 + 1;
    e.min(w)
}

#[cfg(test)]
mod tests {
    use super::*;
    const S: u64 = 1_000_000_000;

    #[test]
    fn retry_after_lands_exactly_where_the_request_first_fits() {
        let sw = SlidingWindow::new(7, Duration::from_secs(60));
        let mut st = KeyState::default();
        for _ in 0..7 {
            assert!(sw.check(&mut st, 30 * S, 1).allowed);
        }
        let now = 61 * S;
        // 1 + floor(7 × 59/60) = 7: the first passes, the second does not.
        assert!(sw.check(&mut st, now, 1).allowed);
        let d = sw.check(&mut st, now, 1);
        assert!(!d.allowed);
        let mut probe = st;
        assert!(!sw.check(&mut probe, now + d.retry_after - 1, 1).allowed);
        assert!(sw.check(&mut st, now + d.retry_after, 1).allowed);
    }

    #[test]
    fn retry_after_can_reach_into_the_next_window() {
        let sw = SlidingWindow::new(4, Duration::from_secs(10));
        let mut st = KeyState::default();
        for _ in 0..4 {
            assert!(sw.check(&mut st, 11 * S, 1).allowed);
        }
        let d = sw.check(&mut st, 12 * S, 2);
        assert!(!d.allowed);
        let mut probe = st;
        assert!(!sw.check(&mut probe, 12 * S + d.retry_after - 1, 2).allowed);
        assert!(sw.check(&mut st, 12 * S + d.retry_after, 2).allowed);
        assert!(d.retry_after > 8 * S);
    }

    #[test]
    fn counts_older_than_one_window_are_forgotten() {
        let sw = SlidingWindow::new(2, Duration::from_secs(10));
        let mut st = KeyState::default();
        assert!(sw.check(&mut st, 5 * S, 2).allowed);
        assert!(!sw.check(&mut st, 15 * S, 2).allowed);
        assert!(sw.check(&mut st, 25 * S, 2).allowed);
    }
}
