//! The compiled rule tree and Envoy's matching: by depth; exact value, then wildcard
//! (file order, first match), then bare key.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use super::Unit;
use crate::algorithm::Limit;

/// Index of a [`Rule`] within its [`Domain`].
pub type RuleId = usize;

/// A validated, compiled set of rules: every domain, ready to match.
#[derive(Debug, Default)]
pub struct RuleSet {
    pub(crate) domains: HashMap<String, Arc<Domain>, ahash::RandomState>,
    pub(crate) files: Vec<PathBuf>,
    pub(crate) loaded_at: Option<SystemTime>,
    /// The files' gateway sections, in file order.
    #[cfg(feature = "tower")]
    pub(crate) http: Vec<crate::http::HttpRules>,
}

impl RuleSet {
    /// The domain called `name`.
    pub fn domain(&self, name: &str) -> Option<&Arc<Domain>> {
        self.domains.get(name)
    }

    /// Every domain, in name order.
    pub fn domains(&self) -> Vec<&Arc<Domain>> {
        let mut all: Vec<_> = self.domains.values().collect();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        all
    }

    /// The files the set was loaded from.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// When the set was loaded (None for a set built from a string).
    pub fn loaded_at(&self) -> Option<SystemTime> {
        self.loaded_at
    }

    /// The files' `http` sections (the gateway's routes), in file order: read in the
    /// same load as the rules, so that they change together.
    #[cfg(feature = "tower")]
    pub fn http(&self) -> &[crate::http::HttpRules] {
        &self.http
    }
}

/// One domain's rule tree.
#[derive(Debug)]
pub struct Domain {
    /// The domain name.
    pub name: Arc<str>,
    /// The files that define it (more than one only when merging is on).
    pub files: Vec<String>,
    /// The domain's failure mode (top-level `failure_mode`), for limits that match no rule.
    pub failure_mode: super::FailureMode,
    /// The domain's `charge_rejected` (top level), for limits that match no rule; `None`
    /// when the file does not say (the limiter's default applies).
    pub charge_rejected: Option<crate::store::ChargeRejected>,
    pub(crate) rules: Vec<Rule>,
    pub(crate) root: Level,
    /// The descriptor keys that name a request's priority class in some limit of this
    /// domain (`priority.from`): left out of matching and of counter keys.
    pub(crate) priority_keys: Vec<String>,
    /// The pools its limits may borrow from (`pools:`), in file order.
    pub pools: Vec<Pool>,
}

/// One descriptor of a rule file.
#[derive(Debug)]
pub struct Rule {
    /// The descriptor key.
    pub key: String,
    /// The descriptor value; `None` for a bare-key rule. May hold `*` wildcards.
    pub value: Option<String>,
    /// True when `value` holds a `*`.
    pub wildcard: bool,
    /// The file and line the descriptor starts at, for messages.
    pub origin: String,
    /// The descriptor path used in metric names: `key_value.subkey` as Envoy names it.
    pub stat_path: Arc<str>,
    /// This rule or one of its ancestors has `share_threshold`.
    pub(crate) shares: bool,
    /// The limits (one for `rate_limit`, several for `rate_limits`, none for an allow-list entry).
    pub limits: Vec<RuleLimit>,
    /// `unlimited: true`: answered OK, never counted.
    pub unlimited: bool,
    /// Evaluated, counted and reported, never rejects.
    pub shadow_mode: bool,
    /// Metrics carry the runtime values of the request, not only the rule path.
    pub detailed_metric: bool,
    /// Metrics carry this level's runtime value.
    pub value_to_metric: bool,
    /// All values matching this wildcard share one counter.
    pub share_threshold: bool,
    /// Quota mode: over its limit, the rule alone does not make the request OVER_LIMIT
    /// (see [`Check::quota`](crate::store::Check)).
    pub quota_mode: bool,
    /// What its limits answer when the store fails (own, inherited, or the domain's).
    pub failure_mode: super::FailureMode,
    /// Whether its limits charge a rejected request (own, inherited, or the domain's);
    /// `None` when the file does not say (the limiter's default applies).
    pub charge_rejected: Option<crate::store::ChargeRejected>,
    /// The descriptor's `metadata`, sent back with the response's dynamic metadata when
    /// the descriptor passes.
    pub metadata: Option<Arc<super::Metadata>>,
    pub(crate) parent: Option<RuleId>,
    pub(crate) children: Level,
}

/// One limit of a rule, as configured and as the store runs it.
#[derive(Debug, Clone)]
pub struct RuleLimit {
    /// The limit's `name`, if it has one (used by `replaces` and in headers).
    pub name: Option<String>,
    /// `requests_per_unit` as configured.
    pub requests_per_unit: u64,
    /// The unit.
    pub unit: Unit,
    /// Names of the limits this one replaces.
    pub replaces: Vec<String>,
    /// Soft throttling: admit up to this many percent over `requests_per_unit`.
    pub overage_percent: u64,
    /// What the store runs: the algorithm with the overage added, the lockout, the id.
    pub limit: Limit,
    /// What the in-memory store runs in its place under `failure_mode: local_fallback`:
    /// the same limit with its numbers divided by the divisor.
    pub fallback: Limit,
    pub(crate) spec: super::spec::LimitSpec,
    pub(crate) divisor: u64,
    /// Priority classes sharing this limit (`priority`), if it has them.
    pub priority: Option<Box<Priority>>,
    /// Borrowing from a pool of the domain (`borrow`), if the limit may.
    pub borrow: Option<Box<Borrow>>,
}

/// A limit's `borrow`: past its own limit, a key may go on up to `up_to` while the
/// domain's pool has room (see `limiter/borrow.rs`).
#[derive(Debug, Clone)]
pub struct Borrow {
    /// The pool's name.
    pub pool: String,
    /// How far past its own limit a key may go, in all: `up_to` per unit.
    pub up_to: u64,
    /// The key's counter of what it borrowed: `up_to − requests_per_unit` per unit, the
    /// same algorithm as the limit, its own identity.
    pub extra: RuleLimit,
    /// The pool's limit: one counter for the whole domain, every borrowing key's
    /// admissions charged to it.
    pub pool_limit: RuleLimit,
    /// The pool counter's key.
    pub pool_key: Vec<u8>,
}

/// A pool of the domain (`pools:`), that limits may borrow from.
#[derive(Debug, Clone)]
pub struct Pool {
    /// The pool's name.
    pub name: String,
    /// Its limit: one counter for the whole domain.
    pub limit: RuleLimit,
}

/// A limit shared by priority classes (`priority`): every class charges the same counter,
/// and a request of a class is admitted only while the counter, after it, stays within
/// the class's share of the limit.
#[derive(Debug, Clone)]
pub struct Priority {
    /// The descriptor key whose value names a request's class; that entry is left out of
    /// matching and of the counter key.
    pub from: String,
    /// Each class and the limit it runs: the same counter (the same id), a window's
    /// limit or a bucket's burst cut to the class's share.
    pub classes: Vec<(String, RuleLimit)>,
    /// Index into `classes` of the class of a request that names none, or an unknown one.
    pub default: usize,
}

impl RuleLimit {
    /// The limit a request of `class` (the value of its `priority.from` entry, if it
    /// has one) runs: its class's, or this one when the limit has no classes.
    pub fn for_class(&self, class: Option<&str>) -> &RuleLimit {
        let Some(p) = &self.priority else {
            return self;
        };
        let chosen = class
            .and_then(|c| p.classes.iter().find(|(name, _)| name == c))
            .or_else(|| p.classes.get(p.default));
        chosen.map_or(self, |(_, limit)| limit)
    }

    /// The limit's numbers replaced by a request's override, keeping its algorithm and
    /// extensions, and its counter when the override keeps its unit (another unit counts
    /// on a counter of its own, per descriptor and unit, as Envoy's service counts).
    pub fn with_override(&self, requests_per_unit: u64, unit: Unit) -> Option<RuleLimit> {
        // Envoy's service keys a counter by descriptor and window: an override in the
        // rule's own unit counts on the rule's counter, one in another unit on its own.
        // A warm-up keeps how warm a key is in units of its rate: other numbers count
        // on a counter of their own.
        let warm = !self.spec.warmup.is_zero() && requests_per_unit != self.requests_per_unit;
        let id = if unit == self.unit && !warm {
            self.limit.id()
        } else {
            let mut h = std::hash::DefaultHasher::new();
            std::hash::Hash::hash(&(self.limit.id(), "unit", unit), &mut h);
            if warm {
                std::hash::Hash::hash(&requests_per_unit, &mut h);
            }
            std::hash::Hasher::finish(&h)
        };
        let limit = self.spec.build(requests_per_unit, unit, id).ok()?;
        let fallback = self
            .spec
            .build_divided(requests_per_unit, unit, id, self.divisor)
            .ok()?;
        // A request's own numbers stand alone: no borrowing past them.
        Some(RuleLimit {
            requests_per_unit,
            unit,
            limit,
            fallback,
            borrow: None,
            ..self.clone()
        })
    }

    /// A plain epoch-aligned fixed window with counter identity `id`.
    pub(crate) fn fixed_window(
        requests_per_unit: u64,
        unit: Unit,
        id: u64,
        failure_mode: super::FailureMode,
    ) -> Option<RuleLimit> {
        let spec = super::spec::LimitSpec::default();
        let divisor = match failure_mode {
            super::FailureMode::LocalFallback { divisor, .. } => divisor,
            _ => 1,
        };
        Some(RuleLimit {
            name: None,
            requests_per_unit,
            unit,
            replaces: Vec::new(),
            overage_percent: 0,
            limit: spec.build(requests_per_unit, unit, id).ok()?,
            fallback: spec
                .build_divided(requests_per_unit, unit, id, divisor)
                .ok()?,
            spec,
            divisor,
            priority: None,
            borrow: None,
        })
    }

    /// The effective limit the store enforces (`requests_per_unit` plus the overage).
    pub fn hard_limit(&self) -> u64 {
        self.limit.limit()
    }
}

/// The rules at one nesting level, by key.
#[derive(Debug, Default)]
pub(crate) struct Level {
    pub(crate) keys: HashMap<String, KeyRules, ahash::RandomState>,
}

#[derive(Debug, Default)]
pub(crate) struct KeyRules {
    pub(crate) exact: HashMap<String, RuleId, ahash::RandomState>,
    pub(crate) wildcards: Vec<(Glob, RuleId)>,
    pub(crate) bare: Option<RuleId>,
}

/// The result of matching one request descriptor.
#[derive(Debug, Clone, Copy)]
pub struct Match<'a> {
    /// The rule at the descriptor's depth.
    pub rule: &'a Rule,
    /// The domain it belongs to.
    pub domain: &'a Domain,
}

impl Domain {
    /// Finds the rule for a descriptor's entries, as Envoy's service does: level by
    /// level, an exact value first, then the first wildcard (in file order) that
    /// matches, then the bare key; an empty value goes straight to the bare key. `None`
    /// when some level has no rule, or a level short of the last has no children.
    pub fn find<'a, K, V>(&'a self, entries: &[(K, V)]) -> Option<Match<'a>>
    where
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut level = &self.root;
        let last = entries.len().checked_sub(1)?;
        for (i, (key, value)) in entries.iter().enumerate() {
            let rules = level.keys.get(key.as_ref())?;
            let value = value.as_ref();
            let id = if value.is_empty() {
                rules.bare
            } else {
                rules
                    .exact
                    .get(value)
                    .copied()
                    .or_else(|| {
                        rules
                            .wildcards
                            .iter()
                            .find(|(g, _)| g.matches(value))
                            .map(|w| w.1)
                    })
                    .or(rules.bare)
            }?;
            let rule = &self.rules[id];
            if i == last {
                return Some(Match { rule, domain: self });
            }
            if rule.children.keys.is_empty() {
                return None;
            }
            level = &rule.children;
        }
        None
    }

    /// The rule that holds `rule` as a child.
    pub fn parent(&self, rule: &Rule) -> Option<&Rule> {
        rule.parent.map(|p| &self.rules[p])
    }

    /// Number of descriptors (rules) in the domain.
    pub fn rule_count(&self) -> usize {
        self.rules.len()
    }

    /// Number of limits in the domain.
    pub fn limit_count(&self) -> usize {
        self.rules.iter().map(|r| r.limits.len()).sum()
    }

    /// Every rule, in file order.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }
}

/// A value pattern: `*` matches zero or more characters, anywhere, any number of times.
#[derive(Debug, Clone)]
pub(crate) struct Glob {
    parts: Vec<Box<[u8]>>,
    /// The shortest text that can match: the parts' total length.
    min_len: usize,
}

impl Glob {
    pub(crate) fn new(pattern: &str) -> Self {
        let parts: Vec<Box<[u8]>> = pattern.split('*').map(|p| p.as_bytes().into()).collect();
        let min_len = parts.iter().map(|p| p.len()).sum();
        Self { parts, min_len }
    }

    pub(crate) fn matches(&self, text: &str) -> bool {
        let text = text.as_bytes();
        if text.len() < self.min_len {
            return false;
        }
        let (first, rest) = match self.parts.split_first() {
            Some(x) => x,
            None => return text.is_empty(),
        };
        if !starts_with(text, first) {
            return false;
        }
        let mut tail = &text[first.len()..];
        let Some((last, middle)) = rest.split_last() else {
            return tail.is_empty(); // no `*` at all
        };
        for part in middle {
            match find(tail, part) {
                Some(at) => tail = &tail[at + part.len()..],
                None => return false,
            }
        }
        tail.len() >= last.len() && starts_with(&tail[tail.len() - last.len()..], last)
    }
}

/// Byte-wise prefix test, inlined: the parts are short, and a `memcmp` call costs more.
fn starts_with(text: &[u8], prefix: &[u8]) -> bool {
    text.len() >= prefix.len() && text.iter().zip(prefix).all(|(a, b)| a == b)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() {
        return Some(0);
    }
    haystack
        .windows(needle.len())
        .position(|w| starts_with(w, needle))
}

#[cfg(test)]
mod tests {
    use super::Glob;

    #[test]
    fn stars_match_any_run_of_characters_anywhere() {
        let cases = [
            ("foo*", "foo", true),
            ("foo*", "foobar", true),
            ("foo*", "xfoo", false),
            ("bar*b", "barb", true),
            ("bar*b", "bar123b", true),
            ("bar*b", "bar", false),
            ("bar*b", "xbarb", false),
            ("*", "", true),
            ("a*b*c", "abc", true),
            ("a*b*c", "a-b-b-c", true),
            ("a*b*c", "acb", false),
            ("*mid*", "has mid inside", true),
            ("ab*ba", "aba", false),
        ];
        for (pattern, text, expected) in cases {
            assert_eq!(
                Glob::new(pattern).matches(text),
                expected,
                "{pattern} ~ {text}"
            );
        }
    }
}
