//! When the store fails: each check decided by its rule's failure mode (`fail_open`,
//! `fail_closed`, or the local fallback store), and the failure logged without
//! flooding.

use super::plan::Plan;
use super::Limiter;
use crate::clock::{Clock, Nanos, NANOS_PER_SEC};
use crate::decision::Decision;
use crate::rules::{Domain, FailureMode};
use crate::store::{self, Check};

impl<S> Limiter<S> {
    /// Decisions by each check's failure mode, when the store failed.
    pub(super) fn fail(
        &self,
        now: Nanos,
        domain: Option<&Domain>,
        plan: &Plan<'_>,
        checks: &[Check<'_>],
    ) -> Vec<Decision> {
        let modes: Vec<FailureMode> = plan.runs.iter().map(|r| plan.mode(r, domain)).collect();
        let closed = modes
            .iter()
            .zip(checks)
            .any(|(m, c)| *m == FailureMode::FailClosed && !c.shadow);
        // The fallback store decides the local_fallback checks together (all or
        // nothing among them); if a fail_closed check rejects the request anyway,
        // they are only looked at.
        let local: Vec<usize> = (0..checks.len())
            .filter(|&i| matches!(modes[i], FailureMode::LocalFallback { .. }))
            .collect();
        let local_checks: Vec<Check<'_>> = local
            .iter()
            .map(|&i| Check {
                limit: &plan.runs[i].limit.fallback,
                cost: if closed { 0 } else { checks[i].cost },
                ..checks[i]
            })
            .collect();
        let mut local_decisions = self.fallback.check_all(now, &local_checks).into_iter();
        modes
            .iter()
            .zip(checks)
            .map(|(mode, c)| match mode {
                FailureMode::FailOpen => Decision::allow(c.limit.limit(), c.limit.limit(), 0),
                FailureMode::FailClosed => Decision::reject(c.limit.limit(), 0, 0, NANOS_PER_SEC),
                FailureMode::LocalFallback { .. } => local_decisions
                    .next()
                    .unwrap_or_else(|| Decision::allow(c.limit.limit(), c.limit.limit(), 0)),
            })
            .collect()
    }
}

/// Logs store failures without flooding: the first at once, then at most one line
/// per ten seconds with the number of failures in between.
#[derive(Default)]
pub(super) struct FailureLog {
    last: std::sync::atomic::AtomicU64,
    quiet: std::sync::atomic::AtomicU64,
}

impl FailureLog {
    const EVERY: u64 = 10 * NANOS_PER_SEC;

    pub(super) fn record(&self, e: &store::Error) {
        use std::sync::atomic::Ordering::Relaxed;
        let now = crate::clock::SystemClock.now();
        let last = self.last.load(Relaxed);
        if now.saturating_sub(last) >= Self::EVERY
            && self
                .last
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_ok()
        {
            let suppressed = self.quiet.swap(0, Relaxed);
            tracing::warn!(error = %e, suppressed, "the store failed; answering by each rule's failure_mode");
        } else {
            self.quiet.fetch_add(1, Relaxed);
        }
    }
}
