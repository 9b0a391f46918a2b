//! When the store fails: each check decided by its rule's failure mode (`fail_open`,
//! `fail_closed`, or the local fallback store), and the failure logged without
//! flooding.

use std::time::{Duration, Instant};

use super::plan::Plan;
use super::Limiter;
use crate::clock::{Nanos, NANOS_PER_SEC};
use crate::decision::Decision;
use crate::rules::{Domain, FailureMode};
use crate::store::{self, Check};
use crate::throttle::Throttle;

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
/// per ten seconds with the number of failures in between (`suppressed`).
pub(super) struct FailureLog(Throttle);

impl Default for FailureLog {
    fn default() -> Self {
        Self(Throttle::new(Self::EVERY))
    }
}

impl FailureLog {
    const EVERY: Duration = Duration::from_secs(10);

    pub(super) fn record(&self, e: &store::Error) {
        if let Some(failures) = self.0.hit(Instant::now()) {
            let suppressed = failures - 1;
            tracing::warn!(error = %e, suppressed, "the store failed; answering by each rule's failure_mode");
        }
    }
}
