//! Sliding window log: a timestamp per admitted request, exact over any rolling window.
//!
//! **Guarantee.** Never more than `limit` cost units admitted in any half-open interval
//! `[s, s + window)`. Rejected requests are not logged, so they count against nothing.
//!
//! **State.** [`LogState`]: 48 bytes plus 16 bytes per logged instant still inside the
//! window (requests at the same nanosecond share one entry); the queue's capacity grows
//! by doubling from 4 entries, so a key costs at most about `48 + 32 × limit` bytes
//! (docs/benchmarks.md, Library, has what a key holding one entry takes, with the map's
//! share). This is the one algorithm whose memory grows with
//! the limit; prefer [`SlidingWindow`](super::SlidingWindow) for large limits.
//!
//! **Maths.** Drop entries with `at + window <= now`; with `used` the sum of the rest,
//! a request of cost `c` passes iff `used + c <= limit`. A rejection may retry when the
//! oldest entries covering the excess have left: at `entry.at + window`.
//! `reset_after` is the time until the newest entry leaves.
//!
//! **Example** (`tests/cases/tollgate/04-sliding-log.yaml`). 2 per minute: requests at
//! 1 s and 30 s; at 50 s a third is rejected until 61 s; at 70 s one passes again.
//! ```
//! use std::time::Duration;
//! use tollgate::algorithm::{LogState, SlidingLog};
//! const S: u64 = 1_000_000_000;
//! let log = SlidingLog::new(2, Duration::from_secs(60));
//! let mut state = LogState::default();
//! assert_eq!(log.check(&mut state, S, 1).remaining, 1);
//! assert_eq!(log.check(&mut state, 30 * S, 1).remaining, 0);
//! let third = log.check(&mut state, 50 * S, 1);
//! assert_eq!((third.allowed, third.retry_after), (false, 11 * S));
//! assert!(log.check(&mut state, 70 * S, 1).allowed);
//! ```

use std::collections::VecDeque;
use std::time::Duration;

use crate::clock::{nanos, Nanos};
use crate::decision::{Decision, NEVER};

/// Sliding log parameters: `limit` per rolling `window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlidingLog {
    /// Cost units per rolling window.
    pub limit: u64,
    /// Window length in nanoseconds.
    pub window: Nanos,
}

/// Per-key state of a [`SlidingLog`]: the admitted requests still in the window.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogState {
    entries: VecDeque<(Nanos, u64)>,
    used: u64,
    expires_at: Nanos,
}

impl LogState {
    /// The instant the newest entry leaves the window (the state is fresh from then).
    pub fn expires_at(&self) -> Nanos {
        self.expires_at
    }

    /// True if no entry is inside the window at `now`.
    pub fn is_fresh(&self, now: Nanos) -> bool {
        self.expires_at <= now
    }

    /// Cost units logged (some may already be outside the window).
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Number of entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no entries are held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl SlidingLog {
    /// `limit` per rolling `window`.
    pub fn new(limit: u64, window: Duration) -> Self {
        Self {
            limit,
            window: nanos(window),
        }
    }

    /// Logs a request of `cost` at `now` whether it fits or not (`charge_rejected`): the
    /// log may then hold more than `limit`, and later requests wait for it to drain.
    pub fn charge(&self, state: &mut LogState, now: Nanos, cost: u64) {
        // The log's total stops at 2^51 (the Redis scripts' numbers stay exact).
        let most = super::fixed_window::CHARGED_MAX.max(self.limit);
        let cost = cost.min(most.saturating_sub(state.used));
        if cost == 0 {
            return;
        }
        let now = now.max(state.entries.back().map_or(0, |e| e.0));
        match state.entries.back_mut() {
            Some(last) if last.0 == now => last.1 = last.1.saturating_add(cost),
            _ => state.entries.push_back((now, cost)),
        }
        state.used = state.used.saturating_add(cost);
        state.expires_at = now.saturating_add(self.window.max(1));
    }

    /// Decides a request of `cost` at `now`, logging it if it passes.
    pub fn check(&self, state: &mut LogState, now: Nanos, cost: u64) -> Decision {
        let w = self.window.max(1);
        // Never rewind: a clock that stepped back counts as the newest entry's time.
        let now = now.max(state.entries.back().map_or(0, |e| e.0));
        while let Some(&(at, c)) = state.entries.front() {
            if at.saturating_add(w) > now {
                break;
            }
            state.entries.pop_front();
            state.used -= c;
        }
        let reset_after = state.expires_at.saturating_sub(now);
        if cost > self.limit {
            let remaining = self.limit.saturating_sub(state.used);
            return Decision::reject(self.limit, remaining, reset_after, NEVER);
        }
        if state.used + cost <= self.limit {
            if cost > 0 {
                match state.entries.back_mut() {
                    Some(last) if last.0 == now => last.1 += cost,
                    _ => state.entries.push_back((now, cost)),
                }
                state.used += cost;
                state.expires_at = now.saturating_add(w);
            }
            let reset_after = state.expires_at.saturating_sub(now);
            return Decision::allow(self.limit, self.limit - state.used, reset_after);
        }
        let mut excess = state.used + cost - self.limit;
        let mut retry = 0;
        for &(at, c) in &state.entries {
            retry = at.saturating_add(w) - now;
            excess = excess.saturating_sub(c);
            if excess == 0 {
                break;
            }
        }
        // A limit lowered by a reload can leave more in the log than the limit.
        let remaining = self.limit.saturating_sub(state.used);
        Decision::reject(self.limit, remaining, reset_after, retry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const S: u64 = 1_000_000_000;

    #[test]
    fn requests_at_the_same_instant_share_one_entry() {
        let log = SlidingLog::new(100, Duration::from_secs(1));
        let mut st = LogState::default();
        for _ in 0..50 {
            assert!(log.check(&mut st, S, 1).allowed);
        }
        assert_eq!((st.len(), st.used()), (1, 50));
    }

    #[test]
    fn retry_after_waits_for_enough_entries_to_leave() {
        let log = SlidingLog::new(3, Duration::from_secs(10));
        let mut st = LogState::default();
        for t in [1, 2, 3] {
            assert!(log.check(&mut st, t * S, 1).allowed);
        }
        let d = log.check(&mut st, 5 * S, 2);
        assert_eq!(d.retry_after, 7 * S); // the entries at 1 s and 2 s must leave: at 12 s
        assert!(!log.check(&mut st, 12 * S - 1, 2).allowed);
        assert!(log.check(&mut st, 12 * S, 2).allowed);
    }
}
