//! [`Limiter`]: the one seam every front end calls: rules + store → decisions.
//!
//! gRPC, the HTTP API, the tower layer and the proxy all turn their input into a
//! [`RateLimitRequest`], call [`Limiter::check`], and turn the [`RateLimitResponse`]
//! into their output. None of them decides anything itself.
//!
//! ```
//! use std::sync::Arc;
//! use tollgate::clock::ManualClock;
//! use tollgate::limiter::{Code, Limiter, RateLimitRequest};
//! use tollgate::rules::{from_str, Rules};
//! use tollgate::store::MemoryStore;
//!
//! let set = from_str("auth.yaml", "domain: auth
//! descriptors:
//!   - key: login
//!     rate_limit: {unit: minute, requests_per_unit: 2, block_duration: 15m}
//! ")?;
//! let limiter = Limiter::new(Arc::new(Rules::fixed(set)), MemoryStore::new())
//!     .with_clock(Arc::new(ManualClock::new(1_700_000_000_000_000_000)));
//! let attempt = RateLimitRequest::new("auth", [vec![("login", "alice")]]);
//! assert_eq!(limiter.check_now(&attempt)?.overall, Code::Ok);
//! assert_eq!(limiter.check_now(&attempt)?.overall, Code::Ok);
//! let third = limiter.check_now(&attempt)?;
//! assert_eq!(third.overall, Code::OverLimit);
//! assert_eq!(third.statuses[0].retry_after_secs(), Some(900));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod borrow;
mod enforcement;
mod failure;
mod plan;
mod request;
mod response;

pub use enforcement::{Change, Enforcement, EnforcementState, Mode, MAX_SWITCHED_DOMAINS};
pub use plan::quota_groups;
pub use request::{Descriptor, LimitOverride, RateLimitRequest, RequestLimits};
pub use response::{Code, DescriptorStatus, MetricKey, RateLimitResponse, ReportedLimit};

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use crate::clock::{Clock, SystemClock};
use crate::rules::Rules;
use crate::store::{self, ChargeRejected, MemoryStore, Store};
use failure::FailureLog;
use plan::{override_keys, plan};

/// Why a request could not be decided.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request is malformed (answer INVALID_ARGUMENT / 400).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] store::Error),
}

/// Service-wide settings of a [`Limiter`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Settings {
    /// Global shadow mode: statuses are reported as they are, but the overall answer is OK.
    pub global_shadow_mode: bool,
    /// Every descriptor in quota mode, as if each rule said `quota_mode: true`.
    pub global_quota_mode: bool,
    /// Whether a rejected request is charged, where the rule file does not say
    /// (`charge_rejected`; `None`, all or nothing, by default).
    pub charge_rejected: ChargeRejected,
    /// How large a request may be ([`RequestLimits::default`] unless set).
    pub limits: RequestLimits,
}

/// Rules + store → decisions.
pub struct Limiter<S = MemoryStore> {
    rules: Arc<Rules>,
    store: S,
    clock: Arc<dyn Clock>,
    settings: Settings,
    fallback: MemoryStore,
    failures: FailureLog,
    enforcement: Arc<Enforcement>,
}

impl<S: Store> Limiter<S> {
    /// A limiter over `rules` and `store`, on the system clock.
    pub fn new(rules: Arc<Rules>, store: S) -> Self {
        Self {
            rules,
            store,
            clock: Arc::new(SystemClock),
            settings: Settings::default(),
            fallback: MemoryStore::new(),
            failures: FailureLog::default(),
            enforcement: Arc::default(),
        }
    }

    /// Reads the emergency switch `enforcement` (shared with whatever moves it; each
    /// limiter has a switch of its own otherwise): a domain switched to
    /// [`Mode::Shadow`] is answered OK, every decision still made and reported.
    pub fn with_enforcement(mut self, enforcement: Arc<Enforcement>) -> Self {
        self.enforcement = enforcement;
        self
    }

    /// The emergency switch this limiter reads.
    pub fn enforcement(&self) -> &Arc<Enforcement> {
        &self.enforcement
    }

    /// The in-memory store that decides `local_fallback` limits while the store fails
    /// (a default one otherwise; give one with a `max_keys` bound for production).
    pub fn with_fallback(mut self, fallback: MemoryStore) -> Self {
        self.fallback = fallback;
        self
    }

    /// The local fallback store (to sweep it, or read its size).
    pub fn fallback(&self) -> &MemoryStore {
        &self.fallback
    }

    /// Uses `clock` for `now` (a [`ManualClock`](crate::clock::ManualClock) in tests).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Sets the service-wide settings.
    pub fn with_settings(mut self, settings: Settings) -> Self {
        self.settings = settings;
        self
    }

    /// The service-wide settings.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The rules this limiter reads.
    pub fn rules(&self) -> &Arc<Rules> {
        &self.rules
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Decides a request.
    pub async fn check(&self, request: &RateLimitRequest) -> Result<RateLimitResponse, Error> {
        self.check_within(request, None).await
    }

    /// Decides a request for a caller that waits at most `budget` (a gRPC client's
    /// `grpc-timeout`, say): a store that may wait answers by then, and if it could not,
    /// each rule's `failure_mode` does ([`Store::check_within`]), so that the caller gets
    /// the rule's answer rather than its own timeout. `None`: the store's own deadline.
    pub async fn check_within(
        &self,
        request: &RateLimitRequest,
        budget: Option<std::time::Duration>,
    ) -> Result<RateLimitResponse, Error> {
        self.check_in(&self.rules.current(), request, budget).await
    }

    /// Decides a request by the rules of `set` (a snapshot of [`rules`](Self::rules)
    /// the caller already holds, e.g. the one its gateway routes came from) rather than
    /// the current one: what the caller matched and what is checked cannot come from
    /// two reloads.
    pub async fn check_in(
        &self,
        set: &crate::rules::RuleSet,
        request: &RateLimitRequest,
        budget: Option<std::time::Duration>,
    ) -> Result<RateLimitResponse, Error> {
        request.validate(&self.settings.limits)?;
        let domain = set.domain(&request.domain).map(Arc::as_ref);
        let switched = self.enforcement.is_shadow(&request.domain);
        let plan = plan(domain, request, self.settings, switched);
        let override_keys = override_keys(&plan, request, domain);
        let checks = plan.checks(&override_keys);
        if checks.is_empty() {
            return Ok(self.respond(request, domain, &plan, &[], None));
        }
        let now = self.clock.now();
        let decided = if plan.runs.iter().any(|r| r.limit.borrow.is_some()) {
            self.check_borrowing(now, &plan, &checks, budget)
                .await
                .map(|b| (b.decisions, b.borrowed))
        } else {
            self.decide(now, &checks, budget)
                .await
                .map(|d| (d, Vec::new()))
        };
        match decided {
            Ok((decisions, borrowed)) => {
                let mut response = self.respond(request, domain, &plan, &decisions, None);
                // Admitted past its own limit, from its pool: flagged as an overage.
                for i in borrowed {
                    let status = &mut response.statuses[plan.runs[i].descriptor];
                    status.over_soft_limit |= status.code == Code::Ok;
                }
                Ok(response)
            }
            Err(e) => {
                self.failures.record(&e);
                let decisions = self.fail(now, domain, &plan, &checks);
                let mut response = self.respond(request, domain, &plan, &decisions, Some(domain));
                response.store_failure = Some(e.kind());
                Ok(response)
            }
        }
    }
}

impl Limiter<MemoryStore> {
    /// Decides a request synchronously on the in-memory store (the in-process fast path).
    ///
    /// The same code as [`check`](Self::check): the memory store never waits, so its
    /// future is ready at the first poll.
    pub fn check_now(&self, request: &RateLimitRequest) -> Result<RateLimitResponse, Error> {
        let mut decision = std::pin::pin!(self.check(request));
        match decision
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
        {
            Poll::Ready(result) => result,
            Poll::Pending => Err(Error::Store(store::Error::backend(
                "the in-memory store waited, which it never does",
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::rules::from_str;

    fn limiter(rules: &str, limits: RequestLimits) -> Limiter<MemoryStore> {
        let set = from_str("rules.yaml", rules).expect("valid rules");
        Limiter::new(Arc::new(Rules::fixed(set)), MemoryStore::new())
            .with_clock(Arc::new(ManualClock::new(1_700_000_000_000_000_000)))
            .with_settings(Settings {
                limits,
                ..Settings::default()
            })
    }

    /// `n` descriptors `[("user", "u<i>"), ...]` of `entries` entries each.
    fn request(n: usize, entries: usize) -> RateLimitRequest {
        RateLimitRequest::new(
            "d",
            (0..n).map(|i| {
                (0..entries)
                    .map(|j| {
                        (
                            if j == 0 {
                                "user".to_string()
                            } else {
                                format!("k{j}")
                            },
                            format!("u{i}"),
                        )
                    })
                    .collect::<Vec<_>>()
            }),
        )
    }

    fn refusal(r: Result<(), Error>) -> String {
        match r {
            Err(Error::InvalidRequest(why)) => why,
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn requests_over_the_caps_are_refused_naming_the_cap() {
        let limits = RequestLimits::default();
        assert!(request(64, 32).validate(&limits).is_ok());
        assert_eq!(
            refusal(request(65, 1).validate(&limits)),
            "a request may carry at most 64 descriptors (--max-descriptors)"
        );
        assert_eq!(
            refusal(request(1, 33).validate(&limits)),
            "descriptor 0: a descriptor may carry at most 32 entries (--max-entries)"
        );
        let mut long = request(2, 1);
        long.descriptors[1].entries[0].1 = "x".repeat(1 << 20);
        assert_eq!(
            refusal(long.validate(&limits)),
            "descriptor 1, entry 0: the value is 1048576 bytes; a key or value may be at most \
             65536 bytes (--max-entry-bytes)"
        );
        long.descriptors[1].entries[0] = ("k".repeat(65_537), String::new());
        assert!(refusal(long.validate(&limits)).starts_with("descriptor 1, entry 0: the key is"));
        long.descriptors[1].entries[0].0 = "k".repeat(65_536);
        assert!(long.validate(&limits).is_ok());
        // The first size over a limit, in the order a decoder reads: descriptor 1's
        // 33rd entry comes before the 65th descriptor.
        let mut both = request(65, 1);
        both.descriptors[1].entries = request(1, 33).descriptors.remove(0).entries;
        assert_eq!(
            refusal(both.validate(&limits)),
            "descriptor 1: a descriptor may carry at most 32 entries (--max-entries)"
        );
    }

    /// A domain in shadow by the emergency switch is decided and charged as before, and
    /// answered OK with its statuses flagged; other domains are still enforced; a
    /// request's own limit (no rule) is shadowed too.
    #[test]
    fn a_domain_switched_to_shadow_is_decided_and_answered_ok() {
        let rules = "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1}\n";
        let switch = Arc::new(Enforcement::default());
        let l = limiter(rules, RequestLimits::default()).with_enforcement(Arc::clone(&switch));
        let one = RateLimitRequest::new("d", [vec![("user", "a")]]);
        assert_eq!(l.check_now(&one).unwrap().overall, Code::Ok);
        assert_eq!(l.check_now(&one).unwrap().overall, Code::OverLimit);
        switch.set("d", Mode::Shadow, "test", 1).unwrap();
        let shadowed = l.check_now(&one).unwrap();
        assert_eq!(shadowed.overall, Code::Ok);
        let s = &shadowed.statuses[0];
        assert!(s.shadow && s.would_reject && s.code == Code::Ok);
        assert_eq!(s.remaining, 0);
        // Another user of `d` still spends its limit, and is flagged when over.
        let fresh = RateLimitRequest::new("d", [vec![("user", "b")]]);
        assert!(!l.check_now(&fresh).unwrap().statuses[0].would_reject);
        assert!(l.check_now(&fresh).unwrap().statuses[0].would_reject);
        // A request's own limit, where no rule matches, is shadowed too.
        let mut own = RateLimitRequest::new("d", [vec![("path", "/x")]]);
        own.descriptors[0].limit = Some(LimitOverride {
            requests_per_unit: 0,
            unit: crate::rules::Unit::Minute,
        });
        assert_eq!(l.check_now(&own).unwrap().overall, Code::Ok);
        // Another domain is still enforced.
        let e = limiter(
            &rules.replace("domain: d", "domain: e"),
            RequestLimits::default(),
        )
        .with_enforcement(Arc::clone(&switch));
        let in_e = RateLimitRequest::new("e", [vec![("user", "a")]]);
        e.check_now(&in_e).unwrap();
        assert_eq!(e.check_now(&in_e).unwrap().overall, Code::OverLimit);
        switch.set("*", Mode::Enforce, "test", 3).unwrap();
        assert_eq!(l.check_now(&one).unwrap().overall, Code::OverLimit);
        assert_eq!(l.check_now(&own).unwrap().overall, Code::OverLimit);
    }

    /// The limiter refuses by its own settings, whatever the front end.
    #[test]
    fn the_limiter_checks_its_own_caps() {
        let rules = "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";
        let small = limiter(
            rules,
            RequestLimits {
                max_descriptors: 2,
                max_entries: 2,
                max_entry_bytes: 8,
            },
        );
        assert!(small.check_now(&request(2, 2)).is_ok());
        let Err(Error::InvalidRequest(why)) = small.check_now(&request(3, 1)) else {
            panic!("three descriptors passed a limit of two");
        };
        assert_eq!(
            why,
            "a request may carry at most 2 descriptors (--max-descriptors)"
        );
        assert!(small.check_now(&request(1, 3)).is_err());
        let default = limiter(rules, RequestLimits::default());
        assert!(default.check_now(&request(64, 1)).is_ok());
        assert!(default.check_now(&request(65, 1)).is_err());
    }

    /// Per-request work is linear in the descriptors: a request of 20,000 descriptors
    /// (with the caps raised), each in a quota group of its own, with limits that
    /// `replace` others, over a store that must undo every charge, completes, with the
    /// right answer. The steps that looked each descriptor up in a list of the others
    /// (the quota groups, the `replaces` names, the store's undo log) made such a
    /// request cost minutes; now it costs tens of milliseconds.
    #[test]
    fn a_request_far_past_the_caps_is_decided_in_linear_work() {
        let rules = "
domain: d
descriptors:
  - key: user
    quota_mode: true
    rate_limits:
      - {unit: minute, requests_per_unit: 1, name: per_user, replaces: [{name: spare}]}
      - {unit: hour, requests_per_unit: 9, name: spare}
";
        let n = 20_000;
        let big = limiter(
            rules,
            RequestLimits {
                max_descriptors: n,
                ..RequestLimits::default()
            },
        );
        let first = big.check_now(&request(n, 1)).expect("decided");
        assert_eq!(first.overall, Code::Ok);
        assert_eq!(first.statuses.len(), n);
        assert!(first.statuses.iter().all(|s| s.remaining == 0
            && s.limit.as_ref().and_then(|l| l.name.as_deref()) == Some("per_user")));
        // Every group over: rejected, and every charge undone but the ones now over.
        let again = big.check_now(&request(n, 1)).expect("decided");
        assert_eq!(again.overall, Code::OverLimit);
        assert_eq!(quota_groups(&request(n, 1).descriptors).len(), n);
    }
}
