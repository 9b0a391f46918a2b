//! Lockout: once a key is rejected, reject everything on it for a fixed time.
//!
//! **Guarantee.** From a key's first rejection at `t`, nothing on that key is admitted
//! before `t + duration`; a request at exactly `t + duration` is decided by the limit
//! again. Rejections during the lockout do not extend it. Any rejection starts it,
//! whatever its cost: a request that asked for more than the limit can ever hold locks
//! the key out as well.
//!
//! **Answers.** The rejection that starts the lockout reports what the limit has left
//! uncharged (`remaining`, as any rejection does) and the lockout's end as `reset_after`
//! (and as `retry_after`, unless its cost can never pass). While locked out, a request
//! reports `remaining` 0 and the time left as both `reset_after` and `retry_after`.
//!
//! **State.** 8 bytes per locked-out key (the end of the lockout), kept only while
//! the lockout lasts; keys never rejected cost nothing.
//!
//! **Example** (`tests/cases/tollgate/06-lockout.yaml`). 5 login attempts per minute,
//! then 15 minutes locked out.
//! ```
//! use std::time::Duration;
//! use tollgate::algorithm::{FixedWindow, KeyState, Lockout};
//! const S: u64 = 1_000_000_000;
//! let limit = FixedWindow::new(5, Duration::from_secs(60));
//! let lockout = Lockout::new(Duration::from_secs(900));
//! let (mut state, mut blocked_until) = (KeyState::default(), 0);
//! let mut attempt = |now| lockout.check(&mut blocked_until, now, limit.limit, |now| limit.check(&mut state, now, 1));
//! for _ in 0..5 { assert!(attempt(0).allowed); }
//! assert_eq!(attempt(0).reset_after, 900 * S);
//! assert_eq!(attempt(60 * S).reset_after, 840 * S);
//! assert!(!attempt(900 * S - 1).allowed);
//! assert_eq!(attempt(900 * S).remaining, 4);
//! ```

use std::time::Duration;

use crate::clock::{nanos, Nanos};
use crate::decision::Decision;

/// Lockout parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lockout {
    /// How long a key stays locked out, in nanoseconds.
    pub duration: Nanos,
}

impl Lockout {
    /// Locks out for `duration`.
    pub fn new(duration: Duration) -> Self {
        Self {
            duration: nanos(duration),
        }
    }

    /// Decides a request at `now` on a key locked out until `blocked_until` (0 = not
    /// locked): rejects while locked, otherwise asks `limit` (which decides and charges
    /// the wrapped algorithm) and starts a lockout if it rejects, whatever the cost.
    /// `limit_value` is the configured limit, reported in the decision while locked.
    pub fn check(
        &self,
        blocked_until: &mut Nanos,
        now: Nanos,
        limit_value: u64,
        limit: impl FnOnce(Nanos) -> Decision,
    ) -> Decision {
        if now < *blocked_until {
            let left = *blocked_until - now;
            return Decision::reject(limit_value, 0, left, left);
        }
        let mut decision = limit(now);
        if !decision.allowed && self.duration > 0 {
            *blocked_until = now.saturating_add(self.duration);
            decision.reset_after = self.duration;
            if !decision.can_never_pass() {
                decision.retry_after = self.duration;
            }
        }
        decision
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{FixedWindow, KeyState};
    const S: u64 = 1_000_000_000;

    #[test]
    fn a_request_above_the_capacity_starts_the_lockout_and_reports_what_is_left() {
        let limit = FixedWindow::new(5, Duration::from_secs(60));
        let lockout = Lockout::new(Duration::from_secs(60));
        let (mut state, mut until) = (KeyState::default(), 0);
        let mut ask =
            |now, cost| lockout.check(&mut until, now, 5, |now| limit.check(&mut state, now, cost));
        assert!(ask(0, 1).allowed);
        let big = ask(S, 6);
        assert!(
            big.can_never_pass(),
            "a retry of the same cost never passes"
        );
        assert_eq!((big.remaining, big.reset_after), (4, 60 * S));
        let small = ask(2 * S, 1);
        assert!(!small.allowed, "a request that would fit is locked out");
        assert_eq!(
            (small.remaining, small.reset_after, small.retry_after),
            (0, 59 * S, 59 * S)
        );
        assert!(
            ask(61 * S, 1).allowed,
            "the lockout ends a block_duration after it began"
        );
    }
}
