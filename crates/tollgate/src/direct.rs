//! [`DirectLimiter`]: one limit for one implicit key, without a store: the fastest
//! in-process check, for a limit that protects one thing (a database, a downstream API).
//!
//! For GCRA, token bucket and leaky bucket (meter or queue) without a lockout, when
//! `window / limit` is a whole number of nanoseconds (and no warm-up), the state is a single atomic
//! word updated by compare-and-swap: every instant the algorithm stores is then a whole
//! nanosecond, so the [`KeyState`] deficit is always 0 and only `expires_at` needs
//! storing. Every other limit runs under a mutex. Both paths call the same pure
//! algorithm as every store, so their decisions are the same.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::algorithm::{Algorithm, Gcra, Limit};
//! use tollgate::direct::DirectLimiter;
//! let db = DirectLimiter::new(Limit::new(Algorithm::Gcra(Gcra::new(100, Duration::from_secs(1))))?);
//! let now = 1_700_000_000_000_000_000;
//! assert_eq!((0..150).filter(|_| db.check(now, 1).allowed).count(), 100);
//! assert!(db.is_lock_free());
//! # Ok::<(), tollgate::algorithm::InvalidLimit>(())
//! ```

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::algorithm::{Algorithm, KeyState, Limit, LogState, StateKind, WarmState, WindowState};
use crate::clock::Nanos;
use crate::decision::Decision;

/// One limit, one key, no store.
pub struct DirectLimiter {
    limit: Limit,
    path: Path,
}

enum Path {
    /// `expires_at` of a KeyState whose deficit is always 0.
    LockFree(AtomicU64),
    Locked(Box<Mutex<Locked>>),
}

#[derive(Default)]
struct Locked {
    key: KeyState,
    log: LogState,
    window: WindowState,
    warm: WarmState,
    blocked_until: Nanos,
}

impl DirectLimiter {
    /// A limiter for `limit`.
    pub fn new(limit: Limit) -> Self {
        let whole_interval = match limit.algorithm() {
            Algorithm::Gcra(_) | Algorithm::TokenBucket(_) | Algorithm::LeakyBucket(_) => {
                limit.limit() > 0 && limit.window() % limit.limit() == 0
            }
            _ => false,
        };
        let plain = limit.state_kind() == StateKind::Key && limit.lockout().is_none();
        let path = if whole_interval && plain {
            Path::LockFree(AtomicU64::new(0))
        } else {
            Path::Locked(Box::default())
        };
        Self { limit, path }
    }

    /// True when checks use the single-word compare-and-swap path.
    pub fn is_lock_free(&self) -> bool {
        matches!(self.path, Path::LockFree(_))
    }

    /// The limit.
    pub fn limit(&self) -> &Limit {
        &self.limit
    }

    /// Decides a request of `cost` at `now`, charging it if admitted.
    pub fn check(&self, now: Nanos, cost: u64) -> Decision {
        match &self.path {
            Path::LockFree(word) => {
                let mut current = word.load(Ordering::Acquire);
                loop {
                    let mut state = KeyState {
                        expires_at: current,
                        word: 0,
                    };
                    let decision = self.limit.check_key(&mut state, now, cost);
                    if !decision.allowed || state.expires_at == current {
                        return decision;
                    }
                    debug_assert_eq!(state.word, 0, "whole intervals keep whole instants");
                    match word.compare_exchange_weak(
                        current,
                        state.expires_at,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    ) {
                        Ok(_) => return decision,
                        Err(actual) => current = actual,
                    }
                }
            }
            Path::Locked(m) => {
                let mut s = m.lock();
                let Locked {
                    key,
                    log,
                    window,
                    warm,
                    blocked_until,
                } = &mut *s;
                let mut run = |now| match self.limit.state_kind() {
                    StateKind::Key => self.limit.check_key(key, now, cost),
                    StateKind::Log => self.limit.check_log(log, now, cost),
                    StateKind::Window => self.limit.check_window(window, now, cost),
                    StateKind::Warm => self.limit.check_warm(warm, now, cost),
                };
                match self.limit.lockout() {
                    Some(lockout) => lockout.check(blocked_until, now, self.limit.limit(), run),
                    None => run(now),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::algorithm::{FixedWindow, Gcra, TokenBucket};

    const S: u64 = 1_000_000_000;

    #[test]
    fn a_warm_up_takes_the_locked_path_and_decides_as_the_store() {
        let limit = Limit::new(Algorithm::Gcra(
            Gcra::new(10, Duration::from_secs(1))
                .with_burst(2)
                .with_warmup(Duration::from_secs(3)),
        ))
        .unwrap();
        let d = DirectLimiter::new(limit);
        assert!(
            !d.is_lock_free(),
            "a whole interval, but two numbers of state"
        );
        let store = crate::store::MemoryStore::new();
        for i in 0..600u64 {
            let now = S + i * 17_000_000;
            let cost = i % 3;
            let want = store.check_one(now, &crate::store::Check::new(&limit, "k", cost));
            assert_eq!(d.check(now, cost), want, "request {i}");
        }
    }

    #[test]
    fn a_fractional_interval_takes_the_locked_path_and_stays_exact() {
        let d = DirectLimiter::new(
            Limit::new(Algorithm::Gcra(
                Gcra::new(3, Duration::from_secs(1)).with_burst(1),
            ))
            .unwrap(),
        );
        assert!(!d.is_lock_free());
        let admitted = (0..3_000)
            .filter(|i| d.check(S + i * 1_000_000, 1).allowed)
            .count();
        assert_eq!(admitted, 9, "3 per second for 3 seconds");
    }

    #[test]
    fn the_lock_free_path_decides_like_the_store() {
        let limit = Limit::new(Algorithm::TokenBucket(
            TokenBucket::new(10, Duration::from_secs(1)).with_burst(4),
        ))
        .unwrap();
        let d = DirectLimiter::new(limit);
        assert!(d.is_lock_free());
        let mut reference = KeyState::default();
        for i in 0..500u64 {
            let now = S + i * 37_000_000;
            let cost = i % 3;
            assert_eq!(
                d.check(now, cost),
                limit.check_key(&mut reference, now, cost),
                "request {i}"
            );
        }
    }

    #[test]
    fn threads_on_a_direct_limiter_admit_exactly_the_burst() {
        for limit in [
            Limit::new(Algorithm::Gcra(Gcra::new(1000, Duration::from_secs(3600)))).unwrap(),
            Limit::new(Algorithm::FixedWindow(FixedWindow::new(
                1000,
                Duration::from_secs(3600),
            )))
            .unwrap(),
        ] {
            let d = Arc::new(DirectLimiter::new(limit));
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    let d = Arc::clone(&d);
                    std::thread::spawn(move || (0..600).filter(|_| d.check(S, 1).allowed).count())
                })
                .collect();
            let total: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
            assert_eq!(total, 1000);
        }
    }

    #[test]
    fn a_lockout_holds_on_the_locked_path() {
        let limit = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
            1,
            Duration::from_secs(60),
        )))
        .unwrap()
        .with_lockout(Duration::from_secs(300));
        let d = DirectLimiter::new(limit);
        assert!(d.check(0, 1).allowed);
        assert!(!d.check(0, 1).allowed);
        assert_eq!(d.check(120 * S, 1).retry_after, 180 * S);
    }
}
