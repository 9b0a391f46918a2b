//! The answer: per descriptor the status of the limit that decided
//! ([`DescriptorStatus`]), and the request's overall code, built from the plan's
//! decisions (the limit that rejected, else the one with the least remaining).

use std::borrow::Cow;
use std::sync::Arc;

use super::plan::{Plan, Run};
use super::{Limiter, RateLimitRequest};
use crate::clock::{Nanos, NANOS_PER_SEC};
use crate::decision::{Decision, NEVER};
use crate::rules::{Domain, FailureMode, Metadata, Rule, Unit};

/// OK or over the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// The request may proceed.
    Ok,
    /// The request is over a limit.
    OverLimit,
}

/// The answer to a [`RateLimitRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimitResponse {
    /// OVER_LIMIT when any enforced descriptor is over its limit (and global shadow mode is off).
    pub overall: Code,
    /// One status per request descriptor, in request order.
    pub statuses: Vec<DescriptorStatus>,
    /// The store's failure, when it failed and the failure modes decided instead:
    /// `timeout`, `error` or `circuit_open`.
    pub store_failure: Option<&'static str>,
}

/// The limit reported for a descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportedLimit {
    /// The limit's name (`name:` in the rule file), if any.
    pub name: Option<String>,
    /// Requests per unit, as configured (without any soft overage).
    pub requests_per_unit: u64,
    /// The unit.
    pub unit: Unit,
}

/// Where a status came from, for metrics: the domain and the rule path, plus the
/// runtime values when the rule asks for detailed metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricKey {
    /// The domain.
    pub domain: Arc<str>,
    /// `key_value.subkey`-style path of the rule (with runtime values for
    /// `detailed_metric` / `value_to_metric`).
    pub path: Arc<str>,
}

/// The decision for one request descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescriptorStatus {
    /// OK or OVER_LIMIT (a shadow-mode rule always reports OK).
    pub code: Code,
    /// The limit that decided, `None` when no rule limits the descriptor.
    pub limit: Option<ReportedLimit>,
    /// Units left (uncharged, when the request as a whole was rejected); 4294967295
    /// for an `unlimited` rule; 0 when no rule applies.
    pub remaining: u64,
    /// Until the limit is fully replenished (window end, full bucket, lockout end).
    pub reset_after: Nanos,
    /// For OVER_LIMIT, until a request of the same cost could pass ([`NEVER`] if never).
    pub retry_after: Nanos,
    /// Queue mode: how long to hold the request before forwarding it.
    pub delay: Nanos,
    /// Soft throttling: admitted, but over `requests_per_unit` (within `overage_percent`).
    pub over_soft_limit: bool,
    /// Overdraft: admitted into debt by a token bucket or GCRA with an `overdraft`
    /// (its bucket was empty; `remaining` is 0).
    pub overdraft: bool,
    /// The rule is in shadow mode: it would have rejected, if `would_reject`.
    pub shadow: bool,
    /// A shadow-mode rule that is over its limit.
    pub would_reject: bool,
    /// Metric identity, `None` when no rule matched.
    pub metric: Option<MetricKey>,
    /// Rejected by the store's local cache of blocked keys, without a round trip.
    pub from_cache: bool,
    /// Set when the store failed and this status comes from the rule's failure mode.
    pub failure_mode: Option<FailureMode>,
    /// Quota mode, with the descriptor's quota group: over its limit, this descriptor
    /// alone does not make the request OVER_LIMIT; every quota group having a
    /// descriptor over its limit does (see [`quota_groups`](super::quota_groups)).
    pub quota: Option<u32>,
    /// The matched rule's `metadata`, for the response's dynamic metadata: set when the
    /// rule's own limit was checked (not for `unlimited`, a rule without a limit, or a
    /// request's own limit, as Envoy's service does).
    pub metadata: Option<Arc<Metadata>>,
}

impl DescriptorStatus {
    fn unlimited_by_rules() -> Self {
        Self {
            code: Code::Ok,
            limit: None,
            remaining: 0,
            reset_after: 0,
            retry_after: 0,
            delay: 0,
            over_soft_limit: false,
            overdraft: false,
            shadow: false,
            would_reject: false,
            metric: None,
            from_cache: false,
            failure_mode: None,
            quota: None,
            metadata: None,
        }
    }

    /// `retry_after` in whole seconds, rounded up; `None` when OK or never.
    pub fn retry_after_secs(&self) -> Option<u64> {
        (self.code == Code::OverLimit && self.retry_after != NEVER)
            .then(|| self.retry_after.div_ceil(NANOS_PER_SEC))
    }

    /// `reset_after` in whole seconds, rounded up.
    pub fn reset_after_secs(&self) -> u64 {
        self.reset_after.div_ceil(NANOS_PER_SEC)
    }
}

impl<S> Limiter<S> {
    /// The response to `request` from its plan's `decisions` (`failed`: the store failed, and
    /// they come from the failure modes, under this domain).
    pub(super) fn respond(
        &self,
        request: &RateLimitRequest,
        domain: Option<&Domain>,
        plan: &Plan<'_>,
        decisions: &[Decision],
        failed: Option<Option<&Domain>>,
    ) -> RateLimitResponse {
        // Per descriptor: the limit that rejected, else the one with the least remaining.
        let mut chosen: Vec<Option<(&Run<'_>, Decision)>> = vec![None; request.descriptors.len()];
        for (run, d) in plan.runs.iter().zip(decisions) {
            let slot = &mut chosen[run.descriptor];
            let better = match slot {
                None => true,
                Some((_, best)) => {
                    (!d.allowed && best.allowed)
                        || (d.allowed == best.allowed && d.remaining < best.remaining)
                }
            };
            if better {
                *slot = Some((run, *d));
            }
        }
        let statuses: Vec<DescriptorStatus> = chosen
            .into_iter()
            .enumerate()
            .map(|(i, choice)| {
                let entries = &request.descriptors[i].entries;
                let rule = plan.matched[i].as_ref().map(|m| m.0);
                match choice {
                    Some((run, d)) => {
                        let mut status = decided_status(run, &d, rule, entries, domain);
                        if let Some(domain) = failed {
                            status.failure_mode = Some(plan.mode(run, domain));
                        }
                        status
                    }
                    None => static_status(domain, rule, entries),
                }
            })
            .collect();
        // Quota-mode descriptors over their limit reject the request only when every
        // quota group has one (the stores' rule: `store::rejects`).
        let over = crate::store::rejects_by(
            statuses
                .iter()
                .map(|s| (false, s.quota, s.code == Code::Ok)),
        );
        RateLimitResponse {
            overall: if over && !self.settings.global_shadow_mode {
                Code::OverLimit
            } else {
                Code::Ok
            },
            statuses,
            store_failure: None,
        }
    }
}

/// The status of a descriptor that no limit was run for.
fn static_status(
    domain: Option<&Domain>,
    rule: Option<&Rule>,
    entries: &[(String, String)],
) -> DescriptorStatus {
    let mut status = DescriptorStatus::unlimited_by_rules();
    if let (Some(domain), Some(rule)) = (domain, rule) {
        status.metric = Some(metric_key(domain, rule, entries));
        if rule.unlimited {
            status.remaining = u64::from(u32::MAX);
        }
    }
    status
}

fn decided_status(
    run: &Run<'_>,
    d: &Decision,
    rule: Option<&Rule>,
    entries: &[(String, String)],
    domain: Option<&Domain>,
) -> DescriptorStatus {
    let l = &*run.limit;
    // Soft throttling: the store enforces requests_per_unit plus the overage; report
    // remaining against requests_per_unit and flag the overage.
    let overage = l.hard_limit().saturating_sub(l.requests_per_unit);
    let over = !d.allowed && !run.shadow;
    DescriptorStatus {
        code: if over { Code::OverLimit } else { Code::Ok },
        limit: Some(ReportedLimit {
            name: l.name.clone(),
            requests_per_unit: l.requests_per_unit,
            unit: l.unit,
        }),
        // A rejection that charges anyway reports nothing left, as Envoy's service does.
        remaining: if over && run.charge.when_over() {
            0
        } else {
            d.remaining.saturating_sub(overage)
        },
        reset_after: d.reset_after,
        retry_after: if d.allowed { 0 } else { d.retry_after },
        delay: d.delay,
        over_soft_limit: d.allowed && overage > 0 && d.remaining < overage,
        overdraft: d.allowed && d.overdraft,
        shadow: run.shadow,
        would_reject: run.shadow && !d.allowed,
        from_cache: d.from_cache,
        failure_mode: None,
        quota: run.quota,
        // The rule's own limit carries its metadata; a request's own limit has none.
        metadata: match run.limit {
            Cow::Borrowed(_) => rule.and_then(|r| r.metadata.clone()),
            Cow::Owned(_) => None,
        },
        metric: match (domain, rule) {
            (Some(dom), Some(rule)) => Some(metric_key(dom, rule, entries)),
            (Some(dom), None) => Some(MetricKey {
                domain: Arc::clone(&dom.name),
                path: override_path(entries).into(),
            }),
            _ => None,
        },
    }
}

fn metric_key(domain: &Domain, rule: &Rule, entries: &[(String, String)]) -> MetricKey {
    let path: Arc<str> = if rule.detailed_metric {
        entries
            .iter()
            .map(|(k, v)| format!("{k}_{v}"))
            .collect::<Vec<_>>()
            .join(".")
            .into()
    } else if rule.value_to_metric {
        let mut parts: Vec<&str> = rule.stat_path.split('.').collect();
        let runtime = entries.last().map(|(k, v)| format!("{k}_{v}"));
        if let (Some(slot), Some(rt)) = (parts.last_mut(), runtime.as_deref()) {
            *slot = rt;
        }
        parts.join(".").into()
    } else {
        Arc::clone(&rule.stat_path)
    };
    MetricKey {
        domain: Arc::clone(&domain.name),
        path,
    }
}

fn override_path(entries: &[(String, String)]) -> String {
    entries
        .iter()
        .map(|(k, _)| k.as_str())
        .collect::<Vec<_>>()
        .join(".")
}
