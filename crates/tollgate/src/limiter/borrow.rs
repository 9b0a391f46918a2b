//! Borrowing from a shared pool (a limit's `borrow: {from: POOL, up_to: N}`): up to its
//! own limit a key is always admitted; between its own limit and `up_to` only while the
//! domain's pool has room; past `up_to` never. Every admission charges the pool.
//!
//! Three counters take part: the key's own limit, the key's *extra* counter (what it
//! borrowed: `up_to − requests_per_unit` per unit, the same algorithm) and the pool (one
//! counter for the domain). A request is decided in at most two store calls, each all or
//! nothing:
//!
//! 1. The request's checks, with each borrowing limit's pool checked beside it in
//!    shadow (charged only when it has room and the request passes). Admitted: done. A
//!    pool that had no room is then charged anyway, past its limit (a third call, only
//!    while the pool is spent), so that keys within their guarantee keep it spent.
//! 2. Refused only by borrowing limits' own counters: the same request again, where each
//!    such limit is replaced by its extra counter and its pool, both of which must have
//!    room. Admitted: the descriptor reports its own limit with `remaining` 0, flagged
//!    as an overage (`over_soft_limit`).
//!
//! A borrowing limit is charged only when its request is admitted, whatever its
//! `charge_rejected`. In shadow mode a borrowing limit is judged by its own limit only,
//! and charges the pool for every request. The calls share the caller's budget
//! (`check_within`): each gets what the ones before it left.

use super::plan::Plan;
use super::Limiter;
use crate::clock::Nanos;
use crate::decision::Decision;
use crate::rules::Borrow;
use crate::store::{self, rejects, ChargeRejected, Check, Store};

/// The decisions of a request's runs, and which runs were admitted by borrowing.
pub(super) struct Borrowed {
    /// One decision per run of the plan.
    pub(super) decisions: Vec<Decision>,
    /// The runs admitted past their own limit, from their pool.
    pub(super) borrowed: Vec<usize>,
}

/// What a check of the second call stands for.
#[derive(Clone, Copy)]
enum Role {
    /// Run `i`'s own check (or any run's, for one that does not borrow).
    Own(usize),
    /// A check the first call charged already (its `charge_rejected`): answered as the
    /// first call decided it.
    Charged,
    /// Run `i`'s extra counter: it borrows.
    Extra(usize),
    /// The pool of run `i`: in shadow beside its own limit (`lends: false`), or as a
    /// limit that must have room (`lends: true`).
    Pool(usize, bool),
}

/// The check of the pool `b` for a request's `check`: in shadow beside its own limit, or
/// as a limit that must have room (`lends`).
fn pool_check<'a>(check: &Check<'a>, b: &'a Borrow, lends: bool) -> Check<'a> {
    Check {
        limit: &b.pool_limit.limit,
        key: &b.pool_key,
        cost: check.cost,
        shadow: !lends,
        quota: if lends { check.quota } else { None },
        charge: ChargeRejected::None,
    }
}

/// Whether the first call left `check`'s charge in place although the request was
/// rejected: admitted under `charge_rejected: all`, or over its limit (in shadow or quota
/// mode, which did not reject the request) under `over_limit` or `all`.
fn charged_by_first(check: &Check<'_>, first: &Decision) -> bool {
    if first.allowed {
        check.charge.when_request_rejected()
    } else {
        check.charge.when_over()
    }
}

impl<S: Store> Limiter<S> {
    /// Decides `checks` (the plan's, one per run) where some runs' limits borrow.
    pub(super) async fn check_borrowing(
        &self,
        now: Nanos,
        plan: &Plan<'_>,
        checks: &[Check<'_>],
        budget: Option<std::time::Duration>,
    ) -> Result<Borrowed, store::Error> {
        let n = checks.len();
        // One budget for the whole request, however many calls it takes (one too far
        // off to reckon is none: the store's own deadline).
        let deadline = budget.and_then(|b| std::time::Instant::now().checked_add(b));
        let left = || deadline.map(|at| at.saturating_duration_since(std::time::Instant::now()));
        let lenders: Vec<(usize, &Borrow)> = plan
            .runs
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.limit.borrow.as_deref().map(|b| (i, b)))
            .collect();
        // 1. The request, the pools beside it.
        let mut first: Vec<Check<'_>> = Vec::with_capacity(n + lenders.len());
        first.extend_from_slice(checks);
        for &(i, b) in &lenders {
            first[i].charge = ChargeRejected::None;
            first.push(pool_check(&checks[i], b, false));
        }
        let mut d1 = self.decide(now, &first, left()).await?;
        if !rejects(&first, |k| d1[k].allowed) {
            let spent = lenders
                .iter()
                .enumerate()
                .filter(|&(j, &(i, _))| (d1[i].allowed || checks[i].shadow) && !d1[n + j].allowed)
                .map(|(_, &(i, b))| (i, b));
            self.charge_spent_pools(now, left(), spent, checks).await;
            d1.truncate(n);
            return Ok(Borrowed {
                decisions: d1,
                borrowed: Vec::new(),
            });
        }
        let lends = |i: usize| plan.runs[i].limit.borrow.is_some() && !checks[i].shadow;
        let refused_by_others = rejects(checks, |i| d1[i].allowed || lends(i));
        if refused_by_others {
            d1.truncate(n);
            return Ok(Borrowed {
                decisions: d1,
                borrowed: Vec::new(),
            });
        }
        // 2. Borrow where the own limit refused.
        let mut second: Vec<Check<'_>> = Vec::with_capacity(n + 2 * lenders.len());
        let mut roles: Vec<Role> = Vec::with_capacity(second.capacity());
        for (i, check) in checks.iter().enumerate() {
            match plan.runs[i].limit.borrow.as_deref() {
                Some(b) if lends(i) && !d1[i].allowed => {
                    second.push(Check {
                        limit: &b.extra.limit,
                        charge: ChargeRejected::None,
                        ..*check
                    });
                    roles.push(Role::Extra(i));
                    second.push(pool_check(check, b, true));
                    roles.push(Role::Pool(i, true));
                }
                Some(b) => {
                    second.push(Check {
                        charge: ChargeRejected::None,
                        ..*check
                    });
                    roles.push(Role::Own(i));
                    second.push(pool_check(check, b, false));
                    roles.push(Role::Pool(i, false));
                }
                None if charged_by_first(check, &d1[i]) => {
                    // Charged already: looked at without charging, answered as the first
                    // call decided it.
                    second.push(Check { cost: 0, ..*check });
                    roles.push(Role::Charged);
                }
                None => {
                    second.push(*check);
                    roles.push(Role::Own(i));
                }
            }
        }
        let d2 = self.decide(now, &second, left()).await?;
        let admitted = !rejects(&second, |k| d2[k].allowed);
        let mut decisions = d1[..n].to_vec();
        let mut borrowed = Vec::new();
        let mut spent = Vec::new();
        for (k, role) in roles.iter().enumerate() {
            match *role {
                Role::Own(i) => decisions[i] = d2[k],
                Role::Charged => {}
                Role::Extra(i) => {
                    // Its pool is the next check.
                    let (extra, pool) = (d2[k], d2[k + 1]);
                    if extra.allowed && pool.allowed {
                        decisions[i] = Decision::allow(
                            d1[i].limit,
                            0,
                            d1[i].reset_after.max(extra.reset_after),
                        );
                        if admitted {
                            borrowed.push(i);
                        }
                    } else {
                        // Over its own limit, and it cannot borrow: until either frees.
                        let wait = [extra, pool]
                            .iter()
                            .filter(|d| !d.allowed)
                            .map(|d| d.retry_after)
                            .max();
                        if let Some(wait) = wait {
                            decisions[i].retry_after = decisions[i].retry_after.min(wait);
                        }
                    }
                }
                Role::Pool(i, false)
                    if admitted && (decisions[i].allowed || checks[i].shadow) && !d2[k].allowed =>
                {
                    spent.push(i);
                }
                Role::Pool(..) => {}
            }
        }
        if admitted && !spent.is_empty() {
            let spent = spent
                .into_iter()
                .filter_map(|i| plan.runs[i].limit.borrow.as_deref().map(|b| (i, b)));
            self.charge_spent_pools(now, left(), spent, checks).await;
        }
        Ok(Borrowed {
            decisions,
            borrowed,
        })
    }

    /// Charges the pools that had no room for requests admitted within their own
    /// limits (or in shadow mode), past the pools' limits: what keys use of their
    /// guarantee is taken from the pool too. A failure is logged and counted; the request
    /// stays admitted. Skipped when the caller's budget is spent (`Some(0)`).
    async fn charge_spent_pools<'b>(
        &self,
        now: Nanos,
        budget: Option<std::time::Duration>,
        spent: impl Iterator<Item = (usize, &'b Borrow)>,
        checks: &[Check<'_>],
    ) {
        let forced: Vec<Check<'_>> = spent
            .map(|(i, b)| Check {
                limit: &b.pool_limit.limit,
                key: &b.pool_key,
                cost: checks[i].cost,
                shadow: true,
                quota: None,
                charge: ChargeRejected::All,
            })
            .collect();
        if forced.is_empty() || budget.is_some_and(|b| b.is_zero()) {
            return;
        }
        if let Err(e) = self.decide(now, &forced, budget).await {
            self.failures.record(&e);
        }
    }

    /// One store call, within `budget` if given.
    pub(super) async fn decide(
        &self,
        now: Nanos,
        checks: &[Check<'_>],
        budget: Option<std::time::Duration>,
    ) -> Result<Vec<Decision>, store::Error> {
        match budget {
            None => self.store.check(now, checks).await,
            Some(budget) => self.store.check_within(now, checks, budget).await,
        }
    }
}
