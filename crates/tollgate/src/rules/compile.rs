//! Compiling the drafts of one domain (several files' with merging) into its rule tree:
//! descriptors placed by key and value (a duplicate refused), failure mode,
//! `charge_rejected` and `consistency` inherited down the tree, each limit built with its
//! counter's identity and checked against its counting, and `replaces` checked against
//! the domain's limit names.

use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Duration;

use marked_yaml::Span;

use super::draft::{ConsistencyMode, DraftConsistency, DraftDomain, DraftFailure, DraftRule};
use super::error::ConfigError;
use super::spec::LimitSpec;
use super::tree::{Borrow, Domain, Glob, Level, Pool, Priority, Rule, RuleId, RuleLimit};
use super::FailureMode;
use crate::algorithm::{Consistency, Scope};
use crate::store::ChargeRejected;

/// A lease's period when the rule file gives none.
const DEFAULT_LEASE_PERIOD: Duration = Duration::from_millis(100);
/// A sync interval when the rule file gives none.
const DEFAULT_SYNC_INTERVAL: Duration = Duration::from_millis(100);

impl DraftConsistency {
    /// These settings over `parent`'s: what is given here wins.
    fn over(self, parent: DraftConsistency) -> DraftConsistency {
        DraftConsistency {
            mode: self.mode.or(parent.mode),
            lease_period: self.lease_period.or(parent.lease_period),
            sync_interval: self.sync_interval.or(parent.sync_interval),
            scope: self.scope.or(parent.scope),
        }
    }

    /// The limit's [`Consistency`] and [`Scope`]: a global limit is leased, so it cannot
    /// also be `exact` or `synced` (the error's place is its `scope`).
    fn resolve(self) -> Result<(Consistency, Scope), (Span, String)> {
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let Some((Scope::Global, span)) = self.scope else {
            return Ok((self.consistency(), Scope::Region));
        };
        match self.mode {
            None | Some(ConsistencyMode::Leased) => Ok((
                Consistency::Leased {
                    period: ns(self.lease_period.unwrap_or(DEFAULT_LEASE_PERIOD)),
                },
                Scope::Global,
            )),
            Some(other) => Err((
                span,
                format!(
                    "`scope: global` limits are leased from the global store, so they cannot be `consistency: {}`; write `consistency: leased` (or nothing) beside `scope: global`",
                    match other {
                        ConsistencyMode::Exact => "exact",
                        ConsistencyMode::Synced => "synced",
                        ConsistencyMode::Leased => "leased",
                    }
                ),
            )),
        }
    }

    /// The [`Consistency`] these settings name.
    fn consistency(self) -> Consistency {
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        match self.mode {
            None | Some(ConsistencyMode::Exact) => Consistency::Exact,
            Some(ConsistencyMode::Leased) => Consistency::Leased {
                period: ns(self.lease_period.unwrap_or(DEFAULT_LEASE_PERIOD)),
            },
            Some(ConsistencyMode::Synced) => Consistency::Synced {
                interval: ns(self.sync_interval.unwrap_or(DEFAULT_SYNC_INTERVAL)),
            },
        }
    }
}

/// Compiles drafts of one domain (several with merging) into a [`Domain`], reporting
/// duplicates and dangling `replaces` through `errors`.
pub(crate) fn compile(drafts: Vec<DraftDomain>, errors: &mut Vec<ConfigError>) -> Option<Domain> {
    let name = drafts.first()?.name.clone();
    let files: Vec<String> = drafts.iter().map(|d| d.file.clone()).collect();
    let mut c = Compiler {
        domain: &name,
        rules: Vec::new(),
        errors,
        names: HashSet::new(),
        replaces: Vec::new(),
        scope_errors: HashSet::new(),
        pools: Vec::new(),
    };
    let mut root = Level::default();
    let failure_mode = drafts
        .iter()
        .find(|d| d.failure.mode.is_some())
        .map_or(FailureMode::default(), |d| {
            c.failure_over(&d.file, d.failure, FailureMode::default())
        });
    // Pools first: a limit in one file may borrow from a pool another file of the
    // domain defines.
    let mut drafts = drafts;
    for draft in &mut drafts {
        for pool in std::mem::take(&mut draft.pools) {
            c.pool(&draft.file, pool, failure_mode);
        }
    }
    let charge_rejected = drafts.iter().find_map(|d| d.charge);
    for draft in drafts {
        let file = draft.file;
        let inherited = (
            c.failure_over(&file, draft.failure, FailureMode::default()),
            draft.charge,
            draft.consistency,
        );
        c.level(&file, &mut root, draft.descriptors, None, "", inherited);
    }
    let Compiler {
        rules,
        errors,
        names,
        replaces,
        pools,
        ..
    } = c;
    for (file, missing, span) in replaces {
        if !names.contains(&missing) {
            errors.push(ConfigError::at(
                file,
                &span,
                format!("`replaces` names `{missing}`, but no rate limit in domain `{name}` has that name"),
            ));
        }
    }
    let mut priority_keys: Vec<String> = rules
        .iter()
        .flat_map(|r| r.limits.iter())
        .filter_map(|l| l.priority.as_ref().map(|p| p.from.clone()))
        .collect();
    priority_keys.sort_unstable();
    priority_keys.dedup();
    // A key that names a class is left out of matching: a rule on it would never match.
    for rule in &rules {
        if priority_keys.contains(&rule.key) {
            let (file, line) = match rule.origin.rsplit_once(':') {
                Some((f, l)) => (f.to_string(), l.parse().unwrap_or(0)),
                None => (rule.origin.clone(), 0),
            };
            errors.push(ConfigError {
                file,
                line,
                column: 0,
                message: format!(
                    "a descriptor on key `{}` would never match: in domain `{name}` that key names a request's priority class (`priority.from`), and is left out of matching",
                    rule.key
                ),
            });
        }
    }
    Some(Domain {
        name: name.into(),
        files,
        failure_mode,
        charge_rejected,
        rules,
        root,
        priority_keys,
        pools,
    })
}

struct Compiler<'a> {
    domain: &'a str,
    rules: Vec<Rule>,
    errors: &'a mut Vec<ConfigError>,
    names: HashSet<String>,
    replaces: Vec<(String, String, Span)>,
    /// Places of `scope` errors already reported.
    scope_errors: HashSet<(usize, usize)>,
    /// The domain's pools, from every file.
    pools: Vec<Pool>,
}

impl Compiler<'_> {
    /// Builds a pool of the domain: one counter (its id from the domain and the pool's
    /// name), counted exactly, under the domain's failure mode.
    fn pool(&mut self, file: &str, draft: super::draft::DraftPool, failure_mode: FailureMode) {
        if self.pools.iter().any(|p| p.name == draft.name) {
            self.errors.push(ConfigError::at(
                file,
                &draft.span,
                format!(
                    "duplicate pool `{}`: domain `{}` already has a pool of that name",
                    draft.name, self.domain
                ),
            ));
            return;
        }
        let l = draft.limit;
        let divisor = match failure_mode {
            FailureMode::LocalFallback { divisor, .. } => divisor,
            _ => 1,
        };
        let mut h = DefaultHasher::new();
        (
            self.domain,
            "pool",
            &draft.name,
            l.spec.algorithm,
            l.spec.queue,
        )
            .hash(&mut h);
        let id = h.finish();
        let built = l
            .spec
            .build(l.requests_per_unit, l.unit, id)
            .and_then(|limit| {
                Ok((
                    limit,
                    l.spec
                        .build_divided(l.requests_per_unit, l.unit, id, divisor)?,
                ))
            });
        match built {
            Ok((limit, fallback)) => self.pools.push(Pool {
                name: draft.name,
                limit: RuleLimit {
                    name: None,
                    requests_per_unit: l.requests_per_unit,
                    unit: l.unit,
                    replaces: Vec::new(),
                    overage_percent: 0,
                    limit,
                    fallback,
                    spec: l.spec,
                    divisor,
                    priority: None,
                    borrow: None,
                },
            }),
            Err(e) => self.errors.push(ConfigError::at(
                file,
                &l.span,
                format!("pool `{}`: {e}", draft.name),
            )),
        }
    }

    /// The borrowing of `limit` (of a rule in quota mode or not) from the pool `b`
    /// names, or why it cannot borrow.
    fn borrow(
        &self,
        limit: &RuleLimit,
        b: &super::draft::DraftBorrow,
        quota_mode: bool,
    ) -> Result<Borrow, (Span, String)> {
        let Some(pool) = self.pools.iter().find(|p| p.name == b.from) else {
            let known: Vec<&str> = self.pools.iter().map(|p| p.name.as_str()).collect();
            return Err((
                b.from_span,
                format!(
                    "`borrow.from: {}`: domain `{}` has no pool of that name ({})",
                    b.from,
                    self.domain,
                    if known.is_empty() {
                        "it has no `pools` at all".to_string()
                    } else {
                        format!("its pools: {}", known.join(", "))
                    }
                ),
            ));
        };
        let refuse = |why: &str| Err((b.span, format!("`borrow` {why}")));
        if limit.limit.consistency() != Consistency::Exact || limit.limit.scope() == Scope::Global {
            return refuse(&format!(
                "needs a limit counted exactly (`consistency: exact`, `scope: region`): this one is `consistency: {}`, `scope: {}`",
                limit.limit.consistency().name(),
                limit.limit.scope().name()
            ));
        }
        if quota_mode {
            return refuse("cannot go with `quota_mode`: a borrowing key is admitted by its own limit or by the pool, and quota groups would judge that over the whole request");
        }
        if !limit.spec.block.is_zero() {
            return refuse("cannot be combined with `block_duration`: a lockout started at the key's own limit would stop it borrowing");
        }
        if limit.priority.is_some() {
            return refuse("cannot be combined with `priority` on the same limit");
        }
        if limit.overage_percent > 0 {
            return refuse("cannot be combined with `overage_percent`: both admit past the limit; say how far with `up_to`");
        }
        // What a key borrowed: `up_to − requests_per_unit` per unit, on a counter of its
        // own, with the limit's algorithm (a bucket holding as much).
        let mut spec = limit.spec;
        spec.burst = None;
        spec.overdraft = 0;
        spec.warmup = std::time::Duration::ZERO;
        let extra_rpu = b.up_to - limit.requests_per_unit;
        let mut h = DefaultHasher::new();
        (limit.limit.id(), "borrowed").hash(&mut h);
        let id = h.finish();
        let built = spec.build(extra_rpu, limit.unit, id).and_then(|l| {
            Ok((
                l,
                spec.build_divided(extra_rpu, limit.unit, id, limit.divisor)?,
            ))
        });
        let (extra_limit, fallback) = built.map_err(|e| (b.span, format!("`borrow`: {e}")))?;
        let mut pool_key = b"\0pool\0".to_vec();
        pool_key.extend_from_slice(pool.name.as_bytes());
        Ok(Borrow {
            pool: pool.name.clone(),
            up_to: b.up_to,
            extra: RuleLimit {
                requests_per_unit: extra_rpu,
                limit: extra_limit,
                fallback,
                spec,
                priority: None,
                borrow: None,
                ..limit.clone()
            },
            pool_limit: pool.limit.clone(),
            pool_key,
        })
    }

    /// The failure mode that `own` settings (of a domain or descriptor in `file`) make
    /// of `parent`'s: a `local_fallback` keeps the divisor and regions from above unless
    /// it gives its own; a divisor or regions without `local_fallback` (here or above)
    /// is an error with its place.
    fn failure_over(&mut self, file: &str, own: DraftFailure, parent: FailureMode) -> FailureMode {
        let mode = own.mode.unwrap_or(parent);
        let FailureMode::LocalFallback { .. } = mode else {
            for (name, given) in [
                ("local_fallback_divisor", own.divisor),
                ("regions", own.regions),
            ] {
                if let Some((_, span)) = given {
                    let (line, column) = span.start().map_or((0, 0), |m| (m.line(), m.column()));
                    if self.scope_errors.insert((line, column)) {
                        self.errors.push(ConfigError {
                            file: file.to_string(),
                            line,
                            column,
                            message: format!(
                                "`{name}` needs `failure_mode: local_fallback` beside it or above it"
                            ),
                        });
                    }
                }
            }
            return mode;
        };
        // What a `local_fallback` above said holds here unless this level says otherwise.
        let (divisor, regions) = match parent {
            FailureMode::LocalFallback { divisor, regions } => (divisor, regions),
            _ => (1, 1),
        };
        FailureMode::LocalFallback {
            divisor: own.divisor.map_or(divisor, |(v, _)| v),
            regions: own.regions.map_or(regions, |(v, _)| v),
        }
    }

    fn level(
        &mut self,
        file: &str,
        level: &mut Level,
        drafts: Vec<DraftRule>,
        parent: Option<RuleId>,
        path: &str,
        inherited: (FailureMode, Option<ChargeRejected>, DraftConsistency),
    ) {
        for d in drafts {
            let failure_mode = self.failure_over(file, d.failure, inherited.0);
            let charge_rejected = d.charge.or(inherited.1);
            let consistency = d.consistency.over(inherited.2);
            let (counting, scope) = match consistency.resolve() {
                Ok(resolved) => resolved,
                Err((span, message)) => {
                    // Reported once for its place, whichever descriptors inherit it.
                    let (line, column) = span.start().map_or((0, 0), |m| (m.line(), m.column()));
                    if self.scope_errors.insert((line, column)) {
                        self.errors.push(ConfigError {
                            file: file.to_string(),
                            line,
                            column,
                            message,
                        });
                    }
                    (Consistency::Exact, Scope::Region)
                }
            };
            if d.quota_mode && scope == Scope::Global && !d.limits.is_empty() {
                // Quota groups are judged over the whole request, which two stores cannot
                // do atomically.
                self.errors.push(ConfigError::at(
                    file,
                    &d.span,
                    "`quota_mode` cannot go with `scope: global`: a quota group is judged over the whole request, and a global limit is counted in another store than the region's",
                ));
            }
            // A global limit in fallback is shared by every instance of every region.
            let divisor = match failure_mode {
                FailureMode::LocalFallback { divisor, regions } if scope == Scope::Global => {
                    divisor.saturating_mul(regions)
                }
                FailureMode::LocalFallback { divisor, .. } => divisor,
                _ => 1,
            };
            let segment = match &d.value {
                Some(v) => format!("{}_{}", d.key, v),
                None => d.key.clone(),
            };
            let stat_path = if path.is_empty() {
                segment
            } else {
                format!("{path}.{segment}")
            };
            let id = self.rules.len();
            let slot = level.keys.entry(d.key.clone()).or_default();
            let duplicate = match &d.value {
                None => slot.bare.replace(id).is_some(),
                Some(v) if v.contains('*') => {
                    let dup = slot
                        .wildcards
                        .iter()
                        .any(|(_, other)| self.rules[*other].value.as_deref() == Some(v));
                    if !dup {
                        slot.wildcards.push((Glob::new(v), id));
                    }
                    dup
                }
                Some(v) => slot.exact.insert(v.clone(), id).is_some(),
            };
            if duplicate {
                let (line, column) = d.span.start().map_or((0, 0), |m| (m.line(), m.column()));
                let what = match &d.value {
                    Some(v) => format!("key `{}` with value `{v}`", d.key),
                    None => format!("key `{}` with no value", d.key),
                };
                self.errors.push(ConfigError {
                    file: file.to_string(),
                    line,
                    column,
                    message: format!("duplicate descriptor: {what} is already defined at this level of domain `{}`", self.domain),
                });
                continue;
            }
            let mut limits = Vec::new();
            for (index, mut l) in d.limits.into_iter().enumerate() {
                l.spec.consistency = counting;
                l.spec.scope = scope;
                if let Some(n) = &l.name {
                    self.names.insert(n.clone());
                }
                for (name, span) in &l.replaces {
                    self.replaces.push((file.to_string(), name.clone(), *span));
                }
                let id = counter_id(
                    self.domain,
                    &stat_path,
                    index,
                    l.spec,
                    (l.requests_per_unit, l.unit),
                );
                let built = l
                    .spec
                    .build(l.requests_per_unit, l.unit, id)
                    .and_then(|limit| {
                        let fallback =
                            l.spec
                                .build_divided(l.requests_per_unit, l.unit, id, divisor)?;
                        Ok((limit, fallback))
                    });
                if let Ok((limit, _)) = &built {
                    if let Some(why) = limit.consistency_conflict() {
                        self.errors.push(ConfigError::at(
                            file,
                            &l.span,
                            format!(
                                "`consistency: {}` cannot count this {} limit: {why}; give it `consistency: exact` (on its descriptor)",
                                limit.consistency().name(),
                                limit.algorithm().name(),
                            ),
                        ));
                        continue;
                    }
                }
                match built {
                    Ok((limit, fallback)) => {
                        let mut rule_limit = RuleLimit {
                            name: l.name,
                            requests_per_unit: l.requests_per_unit,
                            unit: l.unit,
                            replaces: l.replaces.into_iter().map(|r| r.0).collect(),
                            overage_percent: l.spec.overage_percent,
                            limit,
                            fallback,
                            spec: l.spec,
                            divisor,
                            priority: None,
                            borrow: None,
                        };
                        if let Some(p) = l.priority {
                            match priority_classes(&rule_limit, &p) {
                                Ok(priority) => rule_limit.priority = Some(Box::new(priority)),
                                Err(message) => {
                                    self.errors.push(ConfigError::at(file, &p.span, message));
                                    continue;
                                }
                            }
                        }
                        if let Some(b) = &l.borrow {
                            match self.borrow(&rule_limit, b, d.quota_mode) {
                                Ok(borrow) => rule_limit.borrow = Some(Box::new(borrow)),
                                Err((span, message)) => {
                                    self.errors.push(ConfigError::at(file, &span, message));
                                    continue;
                                }
                            }
                        }
                        limits.push(rule_limit);
                    }
                    Err(e) => {
                        self.errors
                            .push(ConfigError::at(file, &l.span, e.to_string()));
                    }
                }
            }
            self.rules.push(Rule {
                key: d.key,
                wildcard: d.value.as_deref().is_some_and(|v| v.contains('*')),
                value: d.value,
                origin: d.origin,
                stat_path: stat_path.as_str().into(),
                shares: d.share_threshold || parent.is_some_and(|p| self.rules[p].shares),
                limits,
                unlimited: d.unlimited,
                shadow_mode: d.shadow_mode,
                detailed_metric: d.detailed_metric,
                value_to_metric: d.value_to_metric,
                share_threshold: d.share_threshold,
                quota_mode: d.quota_mode,
                failure_mode,
                charge_rejected,
                metadata: d.metadata.map(std::sync::Arc::new),
                parent,
                children: Level::default(),
            });
            let mut children = Level::default();
            self.level(
                file,
                &mut children,
                d.children,
                Some(id),
                &stat_path,
                (failure_mode, charge_rejected, consistency),
            );
            self.rules[id].children = children;
        }
    }
}

/// The classes of `limit`'s `priority`: each the same counter (the same id) with a
/// window's limit, or a bucket's burst, cut to its share (rounded down; a bucket's rate
/// stays). Refused: a limit not counted exactly (each instance's leases or counts cannot
/// keep one counter's classes apart), and a lockout (one key for every class).
fn priority_classes(
    limit: &RuleLimit,
    p: &super::draft::DraftPriority,
) -> Result<Priority, String> {
    if limit.limit.consistency() != crate::algorithm::Consistency::Exact
        || limit.limit.scope() == crate::algorithm::Scope::Global
    {
        let scope = if limit.limit.scope() == crate::algorithm::Scope::Global {
            "global"
        } else {
            "region"
        };
        return Err(format!(
            "`priority` needs a limit counted exactly (`consistency: exact`, `scope: region`): this one is `consistency: {}`, `scope: {scope}`",
            limit.limit.consistency().name()
        ));
    }
    if !limit.spec.block.is_zero() {
        return Err("`priority` cannot be combined with `block_duration`: the classes share one counter and one lockout, so a refusal of the lowest class would lock out every class".to_string());
    }
    let id = limit.limit.id();
    let mut classes = Vec::with_capacity(p.classes.len());
    for (name, percent) in &p.classes {
        let share = |n: u64| u64::try_from(u128::from(n) * u128::from(*percent) / 100).unwrap_or(n);
        let mut spec = limit.spec;
        let rpu = if spec.algorithm.is_bucket() {
            spec.burst = Some(share(spec.burst.unwrap_or(limit.requests_per_unit)));
            limit.requests_per_unit
        } else {
            share(limit.requests_per_unit)
        };
        let built = spec
            .build(rpu, limit.unit, id)
            .and_then(|l| Ok((l, spec.build_divided(rpu, limit.unit, id, limit.divisor)?)));
        let (class_limit, fallback) =
            built.map_err(|e| format!("priority class `{name}` ({percent}% of the limit): {e}"))?;
        classes.push((
            name.clone(),
            RuleLimit {
                requests_per_unit: rpu,
                limit: class_limit,
                fallback,
                spec,
                priority: None,
                borrow: None,
                ..limit.clone()
            },
        ));
    }
    Ok(Priority {
        from: p.from.clone(),
        classes,
        default: p.default,
    })
}

/// A counter's identity: the domain, the rule's place in the tree, which of its limits,
/// and the algorithm (a new algorithm cannot read the old one's state). The numbers are
/// left out on purpose: a reload that only changes them keeps the counters. But for a
/// limit with a warm-up (`warm_numbers`: its `requests_per_unit` and unit): how warm a
/// key is, is kept in units of its rate, so changing the numbers, or adding or removing
/// the warm-up, starts its keys afresh (cold) rather than misread them.
fn counter_id(
    domain: &str,
    stat_path: &str,
    index: usize,
    spec: LimitSpec,
    warm_numbers: (u64, super::Unit),
) -> u64 {
    let mut h = DefaultHasher::new();
    (domain, stat_path, index, spec.algorithm, spec.queue).hash(&mut h);
    if !spec.warmup.is_zero() {
        (spec.warmup, spec.burst, warm_numbers).hash(&mut h);
    }
    h.finish()
}
