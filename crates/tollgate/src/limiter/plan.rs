//! Planning a request: each descriptor's matching rule (once) and counter key, then the
//! limits to run: `unlimited` rules, a request's own limits, quota groups and the
//! limits other limits `replace`.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};

use super::{Descriptor, LimitOverride, RateLimitRequest, Settings};
use crate::rules::{Domain, FailureMode, Rule, RuleLimit};
use crate::store::{ChargeRejected, Check};

/// What the limiter will do for one request: per descriptor its match and counter
/// key, and the limits to run.
pub(super) struct Plan<'r> {
    /// Per request descriptor: the matched rule (if any) and its counter key.
    pub(super) matched: Vec<Option<(&'r Rule, Vec<u8>)>>,
    /// The limits to run, in descriptor order.
    pub(super) runs: Vec<Run<'r>>,
}

impl Plan<'_> {
    /// A run's failure mode: its rule's, or the domain's for a request's own limit.
    pub(super) fn mode(&self, run: &Run<'_>, domain: Option<&Domain>) -> FailureMode {
        match &self.matched[run.descriptor] {
            Some((rule, _)) => rule.failure_mode,
            None => domain.map(|d| d.failure_mode).unwrap_or_default(),
        }
    }
}

/// One limit to run for one descriptor.
pub(super) struct Run<'r> {
    /// The request descriptor it limits.
    pub(super) descriptor: usize,
    /// The limit: the rule's own, or one the request asked for.
    pub(super) limit: Cow<'r, RuleLimit>,
    /// What the descriptor costs.
    pub(super) cost: u64,
    /// The rule is in shadow mode.
    pub(super) shadow: bool,
    /// Its quota group, in quota mode.
    pub(super) quota: Option<u32>,
    /// Whether it is charged when rejected.
    pub(super) charge: ChargeRejected,
}

impl Plan<'_> {
    /// The store's checks of the runs (`override_keys`: the counter keys of
    /// descriptors no rule matched, see [`override_keys`]).
    pub(super) fn checks<'a>(&'a self, override_keys: &'a [Vec<u8>]) -> Vec<Check<'a>> {
        self.runs
            .iter()
            .map(|r| Check {
                limit: &r.limit.limit,
                key: match &self.matched[r.descriptor] {
                    Some((_, key)) => key,
                    None => &override_keys[r.descriptor],
                },
                cost: r.cost,
                shadow: r.shadow,
                quota: r.quota,
                charge: r.charge,
            })
            .collect()
    }
}

/// Counter keys for descriptors that no rule matched but whose request carries its own
/// limit (empty for every other descriptor: no allocation in the common case).
pub(super) fn override_keys(
    plan: &Plan<'_>,
    request: &RateLimitRequest,
    domain: Option<&Domain>,
) -> Vec<Vec<u8>> {
    if plan
        .runs
        .iter()
        .all(|r| plan.matched[r.descriptor].is_some())
    {
        return Vec::new();
    }
    request
        .descriptors
        .iter()
        .zip(&plan.matched)
        .map(|(d, m)| {
            if m.is_none() {
                values_key(domain, &d.entries)
            } else {
                Vec::new()
            }
        })
        .collect()
}

/// The quota group of each descriptor, as Envoy's service groups quota-mode descriptors:
/// those naming the same `backend_name` and `model_name_override` (one of them may be
/// missing) are one group, and any other descriptor is grouped with those of identical
/// entries. A group is named by the index of its first descriptor.
pub fn quota_groups(descriptors: &[Descriptor]) -> Vec<u32> {
    #[derive(PartialEq, Eq, Hash)]
    enum Key<'a> {
        Model(&'a str, &'a str),
        Entries(&'a [(String, String)]),
    }
    let mut first: HashMap<Key<'_>, u32> = HashMap::with_capacity(descriptors.len());
    descriptors
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let (mut backend, mut model) = ("", "");
            for (k, v) in &d.entries {
                match k.as_str() {
                    "backend_name" => backend = v,
                    "model_name_override" => model = v,
                    _ => {}
                }
            }
            let key = if backend.is_empty() && model.is_empty() {
                Key::Entries(&d.entries)
            } else {
                Key::Model(backend, model)
            };
            *first
                .entry(key)
                .or_insert(u32::try_from(i).unwrap_or(u32::MAX))
        })
        .collect()
}

/// Works out which limits to run: matching (once per descriptor), `unlimited`,
/// overrides and `replaces`. `switched`: the domain is in shadow by the emergency
/// switch, so every limit run is, as a `shadow_mode` rule's would be.
pub(super) fn plan<'r>(
    domain: Option<&'r Domain>,
    request: &RateLimitRequest,
    settings: Settings,
    switched: bool,
) -> Plan<'r> {
    let mut plan = Plan {
        matched: Vec::with_capacity(request.descriptors.len()),
        runs: Vec::new(),
    };
    let Some(domain) = domain else {
        plan.matched.resize_with(request.descriptors.len(), || None);
        return plan;
    };
    let default_cost = request.hits_addend.max(1);
    let mut groups: Option<Vec<u32>> = None;
    for (i, d) in request.descriptors.iter().enumerate() {
        let cost = d.hits_addend.unwrap_or(default_cost);
        let rule = match without_priority(domain, &d.entries) {
            None => {
                let rule = domain.find(&d.entries).map(|m| m.rule);
                plan.matched
                    .push(rule.map(|r| (r, counter_key(domain, r, &d.entries))));
                rule
            }
            Some(kept) => {
                let rule = domain.find(&kept).map(|m| m.rule);
                plan.matched
                    .push(rule.map(|r| (r, counter_key(domain, r, &kept))));
                rule
            }
        };
        let shadow = switched || rule.is_some_and(|r| r.shadow_mode);
        let quota = (settings.global_quota_mode || rule.is_some_and(|r| r.quota_mode))
            .then(|| groups.get_or_insert_with(|| quota_groups(&request.descriptors))[i]);
        let charge = rule
            .and_then(|r| r.charge_rejected)
            .or(domain.charge_rejected)
            .unwrap_or(settings.charge_rejected);
        match (rule, d.limit) {
            (Some(r), _) if r.unlimited => {}
            (Some(r), Some(o)) => {
                let first = r
                    .limits
                    .first()
                    .and_then(|l| l.with_override(o.requests_per_unit, o.unit));
                if let Some(limit) = first {
                    plan.runs.push(Run {
                        descriptor: i,
                        limit: Cow::Owned(limit),
                        cost,
                        shadow,
                        quota,
                        charge,
                    });
                }
            }
            (Some(r), None) => {
                for l in &r.limits {
                    plan.runs.push(Run {
                        descriptor: i,
                        limit: Cow::Borrowed(l.for_class(class_of(l, &d.entries))),
                        cost,
                        shadow,
                        // A limit that borrows is never in quota mode (`--quota-mode`
                        // included): it is admitted by its own limit or by its pool.
                        quota: if l.borrow.is_some() { None } else { quota },
                        charge,
                    });
                }
            }
            // Envoy's service applies a request's own limit even where no rule matches.
            (None, Some(o)) => {
                if let Some(limit) = override_limit(domain, d, o) {
                    plan.runs.push(Run {
                        descriptor: i,
                        limit: Cow::Owned(limit),
                        cost,
                        shadow: switched,
                        quota,
                        charge,
                    });
                }
            }
            (None, None) => {}
        }
    }
    if plan.runs.iter().any(|r| !r.limit.replaces.is_empty()) {
        // A set: every run looks its name up (a list made this quadratic in descriptors).
        let replaced: HashSet<&str> = plan
            .runs
            .iter()
            .flat_map(|r| r.limit.replaces.iter().map(String::as_str))
            .collect();
        let dropped: Vec<bool> = plan
            .runs
            .iter()
            .map(|r| {
                r.limit
                    .name
                    .as_deref()
                    .is_some_and(|n| replaced.contains(n))
            })
            .collect();
        let mut dropped = dropped.into_iter();
        plan.runs.retain(|_| !dropped.next().unwrap_or(false));
    }
    plan
}

fn override_limit(domain: &Domain, d: &Descriptor, o: LimitOverride) -> Option<RuleLimit> {
    // A counter per descriptor and unit, as Envoy's service keys them.
    let mut h = DefaultHasher::new();
    (
        &*domain.name,
        "override",
        d.entries
            .iter()
            .map(|e| &e.0)
            .filter(|k| !names_class(domain, k))
            .collect::<Vec<_>>(),
        o.unit,
    )
        .hash(&mut h);
    RuleLimit::fixed_window(o.requests_per_unit, o.unit, h.finish(), domain.failure_mode)
}

/// A descriptor entry: key and value.
type Entry = (String, String);

/// A descriptor's entries without those that name a priority class in `domain`
/// (`priority.from`); `None` when the domain has no priority classes or the descriptor
/// names none (its entries are used as they are).
fn without_priority<'e>(domain: &Domain, entries: &'e [Entry]) -> Option<Vec<(&'e str, &'e str)>> {
    if domain.priority_keys.is_empty() || !entries.iter().any(|(k, _)| names_class(domain, k)) {
        return None;
    }
    Some(
        entries
            .iter()
            .filter(|(k, _)| !names_class(domain, k))
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect(),
    )
}

/// The class a descriptor's `entries` name for `limit` (the value of its
/// `priority.from` entry; the last, if several).
fn class_of<'e>(limit: &RuleLimit, entries: &'e [Entry]) -> Option<&'e str> {
    let from = &limit.priority.as_ref()?.from;
    entries
        .iter()
        .rev()
        .find(|(k, _)| k == from)
        .map(|(_, v)| v.as_str())
}

/// The counter key: the runtime values, each length-prefixed (so no value can be
/// confused with another split differently); below a `share_threshold` wildcard, the
/// pattern instead of the value.
fn counter_key<K, V: AsRef<str>>(domain: &Domain, rule: &Rule, entries: &[(K, V)]) -> Vec<u8> {
    let mut key = Vec::with_capacity(entries.iter().map(|e| e.1.as_ref().len() + 5).sum());
    if !rule.shares {
        for (_, value) in entries {
            key.push(0);
            push_part(&mut key, value.as_ref());
        }
        return key;
    }
    let mut chain = vec![rule];
    while let Some(parent) = domain.parent(chain[chain.len() - 1]) {
        chain.push(parent);
    }
    chain.reverse();
    for (level, (_, value)) in entries.iter().enumerate() {
        match chain.get(level) {
            Some(r) if r.share_threshold => {
                key.push(1);
                push_part(&mut key, r.value.as_deref().unwrap_or(""));
            }
            _ => {
                key.push(0);
                push_part(&mut key, value.as_ref());
            }
        }
    }
    key
}

/// The counter key of a request's own limit: its entries' keys and values, but for
/// those that name a priority class (a client varying its class gets no fresh counter).
fn values_key(domain: Option<&Domain>, entries: &[(String, String)]) -> Vec<u8> {
    let mut key = Vec::new();
    for (k, v) in entries {
        if domain.is_some_and(|d| names_class(d, k)) {
            continue;
        }
        push_part(&mut key, k);
        push_part(&mut key, v);
    }
    key
}

/// Whether entry key `k` names a priority class in `domain`.
fn names_class(domain: &Domain, k: &str) -> bool {
    domain.priority_keys.iter().any(|p| p == k)
}

fn push_part(key: &mut Vec<u8>, part: &str) {
    key.extend_from_slice(&(part.len() as u32).to_le_bytes());
    key.extend_from_slice(part.as_bytes());
}
