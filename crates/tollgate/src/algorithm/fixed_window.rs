//! Fixed window: a counter per epoch-aligned window, as Envoy's rate limit service counts.
//!
//! **Guarantee.** Never more than `limit` admitted in one aligned window
//! `[k × window, (k + 1) × window)`. Two adjacent windows can each be used in full, so
//! a client can get up to `2 × limit` through in a span of just over one window
//! straddling the boundary (the price of 16 bytes of state and Envoy compatibility).
//!
//! **State.** 16 bytes ([`KeyState`]): the end of the counted window and its count.
//!
//! **Maths.** `start = now - now % window`, `end = start + window`. A request of cost
//! `c` passes iff `count + c <= limit`; then `count += c`. `remaining = limit - count`,
//! `reset_after = end - now`; a rejection may retry at `end` (if `c <= limit`).
//!
//! **Example.** 3 per minute; the third request 59 s into the minute leaves 0, the
//! fourth is rejected until the next minute starts, 1 s later.
//! ```
//! use std::time::Duration;
//! use tollgate::algorithm::{FixedWindow, KeyState};
//! const S: u64 = 1_000_000_000;
//! let fw = FixedWindow::new(3, Duration::from_secs(60));
//! let mut state = KeyState::default();
//! let t0 = 1_699_920_000 * S; // a whole minute
//! assert!(fw.check(&mut state, t0, 1).allowed);
//! assert!(fw.check(&mut state, t0 + 59 * S, 1).allowed);
//! let third = fw.check(&mut state, t0 + 59 * S, 1);
//! assert_eq!((third.allowed, third.remaining), (true, 0));
//! let fourth = fw.check(&mut state, t0 + 59 * S, 1);
//! assert_eq!((fourth.allowed, fourth.retry_after), (false, S));
//! assert_eq!(fw.check(&mut state, t0 + 60 * S, 1).remaining, 2);
//! ```

use std::time::Duration;

use super::KeyState;
use crate::clock::{nanos, Nanos};
use crate::decision::{Decision, NEVER};

/// Where charges past the limit stop counting (the Redis scripts' numbers stay exact).
pub(crate) const CHARGED_MAX: u64 = 1 << 51;

/// Fixed-window parameters: `limit` per `window`, windows aligned to the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FixedWindow {
    /// Requests (cost units) per window.
    pub limit: u64,
    /// Window length in nanoseconds.
    pub window: Nanos,
}

impl FixedWindow {
    /// `limit` per `window`.
    pub fn new(limit: u64, window: Duration) -> Self {
        Self {
            limit,
            window: nanos(window),
        }
    }

    /// Charges `cost` at `now` whether it fits or not (`charge_rejected`): the window's
    /// count may then pass `limit` (up to 2^51), and nothing more passes until the window
    /// ends.
    pub fn charge(&self, state: &mut KeyState, now: Nanos, cost: u64) {
        if cost == 0 {
            return;
        }
        let window = self.window.max(1);
        let (end, count) = if state.expires_at > now {
            (state.expires_at, state.word)
        } else {
            ((now - now % window).saturating_add(window), 0)
        };
        *state = KeyState {
            expires_at: end,
            word: count.saturating_add(cost).min(CHARGED_MAX.max(self.limit)),
        };
    }

    /// Gives back `units` of a lease whose charge left the state at `charged`, at `now`
    /// (leased counting): the count goes down by them while the stored window is still
    /// the one charged and has not ended (others' charges since change nothing: the
    /// units given back were charged and never spent). `None`: nothing to change.
    pub fn give_back(
        &self,
        state: &KeyState,
        charged: &KeyState,
        now: Nanos,
        units: u64,
    ) -> Option<KeyState> {
        if units == 0 || state.expires_at != charged.expires_at || state.is_fresh(now) {
            return None;
        }
        Some(KeyState {
            expires_at: state.expires_at,
            word: state.word.saturating_sub(units),
        })
    }

    /// Decides a request of `cost` at `now`, charging `state` if it passes.
    pub fn check(&self, state: &mut KeyState, now: Nanos, cost: u64) -> Decision {
        let window = self.window.max(1);
        // The stored window is used while it lasts; a clock that stepped back keeps it.
        let (end, count) = if state.expires_at > now {
            (state.expires_at, state.word)
        } else {
            ((now - now % window).saturating_add(window), 0)
        };
        let reset_after = end - now;
        match count.checked_add(cost).filter(|&c| c <= self.limit) {
            Some(new_count) => {
                if cost > 0 {
                    *state = KeyState {
                        expires_at: end,
                        word: new_count,
                    };
                }
                Decision::allow(self.limit, self.limit - new_count, reset_after)
            }
            None => {
                let retry = if cost > self.limit {
                    NEVER
                } else {
                    reset_after
                };
                let remaining = self.limit.saturating_sub(count);
                Decision::reject(self.limit, remaining, reset_after, retry)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const S: u64 = 1_000_000_000;

    #[test]
    fn windows_are_aligned_to_the_epoch() {
        let fw = FixedWindow::new(1, Duration::from_secs(60));
        let mut st = KeyState::default();
        let d = fw.check(&mut st, 1_699_920_000 * S + 45 * S, 1);
        assert_eq!(d.reset_after, 15 * S);
        assert!(!fw.check(&mut st, 1_699_920_000 * S + 59 * S, 1).allowed);
        assert!(fw.check(&mut st, 1_699_920_000 * S + 60 * S, 1).allowed);
    }

    #[test]
    fn a_cost_above_the_limit_can_never_pass() {
        let fw = FixedWindow::new(5, Duration::from_secs(1));
        let mut st = KeyState::default();
        let d = fw.check(&mut st, S, 6);
        assert!(d.can_never_pass());
        assert_eq!(st, KeyState::default());
    }

    #[test]
    fn a_zero_limit_rejects_everything_but_a_check_only_request() {
        let fw = FixedWindow::new(0, Duration::from_secs(1));
        let mut st = KeyState::default();
        assert!(fw.check(&mut st, S, 1).can_never_pass());
        assert!(fw.check(&mut st, S, 0).allowed);
    }

    #[test]
    fn a_clock_stepping_back_does_not_reopen_the_window() {
        let fw = FixedWindow::new(1, Duration::from_secs(60));
        let mut st = KeyState::default();
        assert!(fw.check(&mut st, 120 * S, 1).allowed);
        assert!(!fw.check(&mut st, 100 * S, 1).allowed);
    }
}
