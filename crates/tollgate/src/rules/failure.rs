//! [`FailureMode`]: what a rule answers when its store (Redis) is slow or down.

/// What the limiter answers for a rule's limits when the store fails (times out,
/// errors, or its circuit breaker is open).
///
/// Set per domain (top-level `failure_mode`) or per descriptor (inherited by the
/// descriptors nested in it):
///
/// ```yaml
/// domain: api
/// failure_mode: local_fallback      # fail_open (default), fail_closed, local_fallback
/// local_fallback_divisor: 4         # 4 instances share the limit while Redis is down
/// regions: 2                        # and 2 regions share a `scope: global` limit
/// descriptors:
///   - key: login
///     failure_mode: fail_closed
///     rate_limit: {unit: minute, requests_per_unit: 5}
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum FailureMode {
    /// Admit (the default): the store's failure never blocks traffic.
    #[default]
    FailOpen,
    /// Reject, with a `retry_after` of one second.
    FailClosed,
    /// Decide with this instance's in-memory store under the same rules, each limit
    /// divided by `divisor` (the number of instances sharing it; at least 1 per
    /// window is kept for a non-zero limit).
    LocalFallback {
        /// How many instances share the limit while the store is down.
        divisor: u64,
        /// How many regions share a `scope: global` limit while the global store is
        /// unreachable: such a limit is divided by `divisor × regions`.
        regions: u64,
    },
}

impl FailureMode {
    /// The name used in rule files and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            FailureMode::FailOpen => "fail_open",
            FailureMode::FailClosed => "fail_closed",
            FailureMode::LocalFallback { .. } => "local_fallback",
        }
    }
}
