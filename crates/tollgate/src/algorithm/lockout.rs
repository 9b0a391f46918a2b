//! Lockout: once a key is rejected, reject everything on it for a fixed time.
//!
//! **Guarantee.** From a key's first rejection at `t`, nothing on that key is admitted
//! before `t + duration`; a request at exactly `t + duration` is decided by the limit
//! again. Rejections during the lockout do not extend it. A request that can never
//! pass (its cost exceeds the limit's capacity) does not start a lockout.
//!
//! **State.** 8 bytes per locked-out key (the end of the lockout), kept only while
//! the lockout lasts; keys never rejected cost nothing.
//!
//! **Example** (`shared/cases/tollgate/06-lockout.yaml`). 5 login attempts per minute,
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
    /// the wrapped algorithm) and starts a lockout if it rejects. `limit_value` is the
    /// configured limit, reported in the decision while locked.
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
        if !decision.allowed && !decision.can_never_pass() && self.duration > 0 {
            *blocked_until = now.saturating_add(self.duration);
            decision.remaining = 0;
            decision.reset_after = self.duration;
            decision.retry_after = self.duration;
        }
        decision
    }
}
