//! Compiling the drafts of one domain (several files' with merging) into its rule tree:
//! descriptors placed by key and value (a duplicate refused), failure mode,
//! `charge_rejected` and `consistency` inherited down the tree, each limit built with its
//! counter's identity and checked against its counting, and `replaces` checked against
//! the domain's limit names.

use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Duration;

use marked_yaml::Span;

use super::draft::{ConsistencyMode, DraftConsistency, DraftDomain, DraftRule};
use super::error::ConfigError;
use super::spec::LimitSpec;
use super::tree::{Domain, Glob, Level, Rule, RuleId, RuleLimit};
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
    };
    let mut root = Level::default();
    let failure_mode = drafts.iter().find_map(|d| d.failure).unwrap_or_default();
    let charge_rejected = drafts.iter().find_map(|d| d.charge);
    for draft in drafts {
        let file = draft.file;
        let inherited = (
            draft.failure.unwrap_or_default(),
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
        ..
    } = c;
    for (file, missing, span) in replaces {
        if !names.contains(&missing) {
            let (line, column) = span.start().map_or((0, 0), |m| (m.line(), m.column()));
            errors.push(ConfigError {
                file,
                line,
                column,
                message: format!("`replaces` names `{missing}`, but no rate limit in domain `{name}` has that name"),
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
}

impl Compiler<'_> {
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
            let failure_mode = d.failure.unwrap_or(inherited.0);
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
                let id = counter_id(self.domain, &stat_path, index, l.spec);
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
                        let (line, column) =
                            l.span.start().map_or((0, 0), |m| (m.line(), m.column()));
                        self.errors.push(ConfigError {
                            file: file.to_string(),
                            line,
                            column,
                            message: format!(
                                "`consistency: {}` cannot count this {} limit: {why}; give it `consistency: exact` (on its descriptor)",
                                limit.consistency().name(),
                                limit.algorithm().name(),
                            ),
                        });
                        continue;
                    }
                }
                match built {
                    Ok((limit, fallback)) => limits.push(RuleLimit {
                        name: l.name,
                        requests_per_unit: l.requests_per_unit,
                        unit: l.unit,
                        replaces: l.replaces.into_iter().map(|r| r.0).collect(),
                        overage_percent: l.spec.overage_percent,
                        limit,
                        fallback,
                        spec: l.spec,
                        divisor,
                    }),
                    Err(e) => {
                        let (line, column) =
                            l.span.start().map_or((0, 0), |m| (m.line(), m.column()));
                        self.errors.push(ConfigError {
                            file: file.to_string(),
                            line,
                            column,
                            message: e.to_string(),
                        });
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

/// A counter's identity: the domain, the rule's place in the tree, which of its limits,
/// and the algorithm (a new algorithm cannot read the old one's state). The numbers are
/// left out on purpose: a reload that only changes them keeps the counters.
fn counter_id(domain: &str, stat_path: &str, index: usize, spec: LimitSpec) -> u64 {
    let mut h = DefaultHasher::new();
    (domain, stat_path, index, spec.algorithm, spec.queue).hash(&mut h);
    h.finish()
}
