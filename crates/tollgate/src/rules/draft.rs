//! The rule file's shape: what a domain, a descriptor and a rate limit may say, read key
//! by key from the file's YAML nodes ([`read`](super::read)) into drafts, so that every
//! problem is reported with its line and column, not only the first. The drafts keep
//! what the file says; [`compile`](super::compile) turns them into the rule tree.

use std::time::Duration;

use marked_yaml::types::{MarkedMappingNode, MarkedScalarNode};
use marked_yaml::{Node, Span};

use super::error::ConfigError;
use super::metadata::Metadata;
use super::read::{is_null, Reader};
use super::spec::{bucket_out_of_range, AlgorithmName, LimitSpec, ALGORITHMS};
use super::{FailureMode, Unit};
use crate::algorithm::Scope;
use crate::store::ChargeRejected;

/// Reads one file's drafts, collecting every error.
pub(crate) struct DraftReader<'a> {
    yaml: Reader<'a>,
    /// How many `descriptors` lists deep the reading is, and how deep they may go.
    depth: usize,
    max_depth: usize,
}

impl<'a> DraftReader<'a> {
    /// A reader that refuses `descriptors` lists nested more than `max_depth` deep.
    pub(crate) fn with_max_depth(file: &'a str, max_depth: usize) -> Self {
        Self {
            yaml: Reader::new(file),
            depth: 0,
            max_depth,
        }
    }

    pub(crate) fn into_errors(self) -> Vec<ConfigError> {
        self.yaml.into_errors()
    }

    /// Parses a whole file into a draft domain (`None` when it could not be read at all).
    pub(crate) fn read(&mut self, text: &str) -> Option<DraftDomain> {
        let root = self.yaml.read(text)?;
        let Some(top) = root.as_mapping() else {
            self.yaml.error(
                root.span(),
                "a rule file must be a mapping with `domain` and `descriptors`",
            );
            return None;
        };
        self.yaml.check_keys(
            top,
            &[
                "domain",
                "descriptors",
                "http",
                "failure_mode",
                "local_fallback_divisor",
                "regions",
                "charge_rejected",
                "consistency",
                "lease_period",
                "sync_interval",
                "scope",
                "pools",
            ],
            "the top level",
        );
        let failure = self.failure_mode(top);
        let consistency = self.consistency(top);
        let charge = self.charge_rejected(top);
        let domain = match top
            .get_scalar("domain")
            .map(|s| s.as_str().trim().to_string())
        {
            Some(d) if !d.is_empty() => Some(d),
            Some(_) => {
                let span = top.get_node("domain").map_or(*top.span(), |n| *n.span());
                self.yaml
                    .error(&span, "`domain` is empty: every rule file names its domain");
                None
            }
            None => {
                if let Some(n) = top.get_node("domain") {
                    self.yaml.error(n.span(), "`domain` must be a string");
                } else {
                    self.yaml.error(
                        top.span(),
                        "the file has no `domain`: every rule file names its domain",
                    );
                }
                None
            }
        };
        let descriptors = match top.get_node("descriptors") {
            None => Vec::new(),
            Some(n) => self.descriptors(n),
        };
        let pools = match top.get_node("pools") {
            None => Vec::new(),
            Some(n) => self.pools(n),
        };
        #[cfg(feature = "tower")]
        let http = match (top.get_node("http"), &domain) {
            (Some(node), Some(name)) => {
                crate::http::config::from_node(self.yaml.file(), name, node).unwrap_or_else(|e| {
                    self.yaml.push(e);
                    None
                })
            }
            _ => None,
        };
        Some(DraftDomain {
            #[cfg(feature = "tower")]
            http,
            name: domain?,
            file: self.yaml.file().to_string(),
            span: top.get_node("domain").map_or(*top.span(), |n| *n.span()),
            failure,
            charge,
            consistency,
            descriptors,
            pools,
        })
    }

    /// `pools: [{name: NAME, rate_limit: {...}}, ...]`: limits that a domain's keys may
    /// borrow from (`borrow`). A pool's rate limit has numbers and an algorithm, nothing
    /// that belongs to one key's limit.
    fn pools(&mut self, node: &Node) -> Vec<DraftPool> {
        if node.as_scalar().is_some_and(is_null) {
            return Vec::new();
        }
        let Some(seq) = node.as_sequence() else {
            self.yaml.error(
                node.span(),
                "`pools` must be a list of `{name: <pool>, rate_limit: {unit: ..., requests_per_unit: ...}}`",
            );
            return Vec::new();
        };
        let mut pools: Vec<DraftPool> = Vec::new();
        for item in seq.iter() {
            let Some(map) = item.as_mapping() else {
                self.yaml.error(
                    item.span(),
                    "a pool must be a mapping with `name` and `rate_limit`",
                );
                continue;
            };
            self.yaml.check_keys(map, &["name", "rate_limit"], "a pool");
            let name = match map.get_scalar("name").map(|s| s.as_str().trim()) {
                Some(n) if !n.is_empty() => Some(n.to_string()),
                _ => {
                    self.yaml.error(
                        map.get_node("name").map_or(map.span(), |n| n.span()),
                        "a pool needs a `name`, which limits name in `borrow: {from: <name>, ...}`",
                    );
                    None
                }
            };
            if let Some(n) = &name {
                if pools.iter().any(|p| &p.name == n) {
                    self.yaml.error(
                        map.get_node("name").map_or(map.span(), |n| n.span()),
                        format!("duplicate pool `{n}`: a pool's name is unique in its file"),
                    );
                    continue;
                }
            }
            let limit = match map.get_node("rate_limit") {
                None => {
                    self.yaml.error(
                        map.span(),
                        "a pool needs a `rate_limit` (`unit`, `requests_per_unit`, optionally `algorithm` and `burst`)",
                    );
                    None
                }
                Some(n) => match self.rate_limit(n, false) {
                    Some(DraftLimit::Limited(l)) => Some(l),
                    _ => None,
                },
            };
            let (Some(name), Some(limit)) = (name, limit) else {
                continue;
            };
            let own_only = [
                ("name", limit.name.is_some()),
                ("replaces", !limit.replaces.is_empty()),
                ("priority", limit.priority.is_some()),
                ("borrow", limit.borrow.is_some()),
                ("block_duration", !limit.spec.block.is_zero()),
                ("overage_percent", limit.spec.overage_percent > 0),
            ];
            if let Some((field, _)) = own_only.iter().find(|(_, given)| *given) {
                self.yaml.error(
                    &limit.span,
                    format!("pool `{name}`: a pool's rate limit cannot have `{field}`: that belongs to one key's limit, and a pool is shared by every key that borrows from it"),
                );
                continue;
            }
            pools.push(DraftPool {
                span: *map.span(),
                name,
                limit,
            });
        }
        pools
    }

    fn descriptors(&mut self, node: &Node) -> Vec<DraftRule> {
        // `descriptors:` with nothing after it (YAML's null) is an empty list, as in
        // Envoy's service: a domain (or descriptor) with no rules below it.
        if node.as_scalar().is_some_and(is_null) {
            return Vec::new();
        }
        let Some(seq) = node.as_sequence() else {
            self.yaml.error(node.span(), "`descriptors` must be a list");
            return Vec::new();
        };
        // The reading, the rule tree and its compilation all recurse once per level:
        // bounded here, so that no file can exhaust a thread's stack.
        if self.depth >= self.max_depth {
            let max = self.max_depth;
            self.yaml.error(
                node.span(),
                format!("descriptors nest more than {max} levels deep (the rule files' limit)"),
            );
            return Vec::new();
        }
        self.depth += 1;
        let rules = seq
            .iter()
            .filter_map(|item| self.descriptor(item))
            .collect();
        self.depth -= 1;
        rules
    }

    fn descriptor(&mut self, node: &Node) -> Option<DraftRule> {
        let Some(map) = node.as_mapping() else {
            self.yaml.error(
                node.span(),
                "a descriptor must be a mapping with at least `key`",
            );
            return None;
        };
        self.yaml.check_keys(
            map,
            &[
                "key",
                "value",
                "rate_limit",
                "rate_limits",
                "shadow_mode",
                "detailed_metric",
                "value_to_metric",
                "share_threshold",
                "quota_mode",
                "metadata",
                "descriptors",
                "failure_mode",
                "local_fallback_divisor",
                "regions",
                "charge_rejected",
                "consistency",
                "lease_period",
                "sync_interval",
                "scope",
            ],
            "a descriptor",
        );
        let failure = self.failure_mode(map);
        let consistency = self.consistency(map);
        let charge = self.charge_rejected(map);
        let metadata = match map.get_node("metadata") {
            Some(n) if !n.as_scalar().is_some_and(is_null) => {
                if n.as_mapping().is_none() {
                    self.yaml.error(n.span(), "`metadata` must be a mapping");
                }
                Some(Metadata::from_node(n))
            }
            _ => None,
        };
        let key = match map.get_node("key") {
            None => {
                self.yaml
                    .error(&Reader::start(map), "a descriptor needs a `key`");
                None
            }
            Some(n) => match n.as_scalar() {
                Some(s) if !s.as_str().is_empty() => Some(s.as_str().to_string()),
                Some(s) => {
                    self.yaml.error(s.span(), "a descriptor's `key` is empty");
                    None
                }
                None => {
                    self.yaml
                        .error(n.span(), "a descriptor's `key` must be a string");
                    None
                }
            },
        };
        let value = match map.get_node("value") {
            None => None,
            Some(n) => match n.as_scalar() {
                Some(s) if !s.as_str().is_empty() => Some(s.as_str().to_string()),
                Some(_) => None, // an empty value is the bare key, as in Envoy's service
                None => {
                    self.yaml
                        .error(n.span(), "a descriptor's `value` must be a string");
                    None
                }
            },
        };
        let flag = |r: &mut Self, name: &str| r.yaml.bool_field(map, name).unwrap_or(false);
        let shadow_mode = flag(self, "shadow_mode");
        let detailed_metric = flag(self, "detailed_metric");
        let value_to_metric = flag(self, "value_to_metric");
        let share_threshold = flag(self, "share_threshold");
        let quota_mode = flag(self, "quota_mode");
        if share_threshold && !value.as_deref().is_some_and(|v| v.contains('*')) {
            let span = map
                .get_node("share_threshold")
                .map_or(*map.span(), |n| *n.span());
            self.yaml.error(
                &span,
                "`share_threshold` needs a wildcard `value` (one with `*`) to share",
            );
        }
        let mut limits = Vec::new();
        let mut unlimited = false;
        match (map.get_node("rate_limit"), map.get_node("rate_limits")) {
            (Some(one), Some(_)) => {
                self.yaml.error(
                    one.span(),
                    "give either `rate_limit` or `rate_limits`, not both",
                );
            }
            // `rate_limit:` with nothing after it: no limit, as in Envoy's service.
            (Some(one), None) if one.as_scalar().is_some_and(is_null) => {}
            (Some(one), None) => match self.rate_limit(one, true) {
                Some(DraftLimit::Unlimited) => unlimited = true,
                Some(DraftLimit::Limited(l)) => limits.push(*l),
                None => {}
            },
            (None, Some(many)) => match many.as_sequence() {
                Some(seq) if !seq.is_empty() => {
                    for item in seq.iter() {
                        if let Some(DraftLimit::Limited(l)) = self.rate_limit(item, false) {
                            limits.push(*l);
                        }
                    }
                }
                _ => self.yaml.error(
                    many.span(),
                    "`rate_limits` must be a non-empty list of limits",
                ),
            },
            (None, None) => {}
        }
        let children = map
            .get_node("descriptors")
            .map(|n| self.descriptors(n))
            .unwrap_or_default();
        Some(DraftRule {
            key: key?,
            value,
            span: Reader::start(map),
            origin: self.yaml.origin(&Reader::start(map)),
            limits,
            unlimited,
            shadow_mode,
            detailed_metric,
            value_to_metric,
            share_threshold,
            quota_mode,
            failure,
            charge,
            consistency,
            metadata,
            children,
        })
    }

    /// `charge_rejected` of a domain or descriptor: `none`, `over_limit` or `all`.
    fn charge_rejected(&mut self, map: &MarkedMappingNode) -> Option<ChargeRejected> {
        let node = map.get_node("charge_rejected")?;
        if node.as_scalar().is_some_and(is_null) {
            return None;
        }
        let mode = node
            .as_scalar()
            .and_then(|s| ChargeRejected::from_name(s.as_str()));
        if mode.is_none() {
            self.yaml.error(
                node.span(),
                "`charge_rejected` must be none, over_limit or all",
            );
        }
        mode
    }

    /// `failure_mode`, `local_fallback_divisor` and `regions` of a domain or descriptor,
    /// each `None` when absent (inherited from above; the compiler checks that the
    /// divisor and the regions go with an inherited or given `local_fallback`).
    fn failure_mode(&mut self, map: &MarkedMappingNode) -> DraftFailure {
        let mut at_least_one = |name: &str, max: u64| match map.get_node(name) {
            None => None,
            Some(n) => {
                let span = *n.span();
                match self.yaml.number(map, name, max) {
                    Some(0) => {
                        self.yaml
                            .error(&span, format!("`{name}` must be at least 1"));
                        None
                    }
                    other => other.map(|v| (v, span)),
                }
            }
        };
        let divisor = at_least_one("local_fallback_divisor", 1_000_000);
        let regions = at_least_one("regions", 1_000);
        let node = map.get_node("failure_mode");
        let mode = match node
            .and_then(|n| n.as_scalar())
            .map(MarkedScalarNode::as_str)
        {
            None => None,
            Some("fail_open") => Some(FailureMode::FailOpen),
            Some("fail_closed") => Some(FailureMode::FailClosed),
            Some("local_fallback") => Some(FailureMode::LocalFallback {
                divisor: 1,
                regions: 1,
            }),
            Some(other) => {
                let span = node.map_or(*map.span(), |n| *n.span());
                self.yaml.error(&span, format!("unknown failure_mode `{other}` (expected fail_open, fail_closed or local_fallback)"));
                None
            }
        };
        if node.is_some_and(|n| n.as_scalar().is_none()) {
            let span = node.map_or(*map.span(), |n| *n.span());
            self.yaml.error(
                &span,
                "`failure_mode` must be fail_open, fail_closed or local_fallback",
            );
        }
        DraftFailure {
            mode,
            divisor,
            regions,
        }
    }

    /// `consistency`, `lease_period` and `sync_interval` of a domain or descriptor, each
    /// `None` when absent (inherited from above).
    fn consistency(&mut self, map: &MarkedMappingNode) -> DraftConsistency {
        let mode = map.get_node("consistency").and_then(|n| {
            match n.as_scalar().map(MarkedScalarNode::as_str) {
                Some("exact") => Some(ConsistencyMode::Exact),
                Some("leased") => Some(ConsistencyMode::Leased),
                Some("synced") => Some(ConsistencyMode::Synced),
                other => {
                    self.yaml.error(
                        n.span(),
                        format!(
                            "unknown consistency `{}` (expected exact, leased or synced)",
                            other.unwrap_or("")
                        ),
                    );
                    None
                }
            }
        });
        let mut period = |name: &str| {
            let n = map.get_node(name)?;
            match n.as_scalar().and_then(|s| parse_duration(s.as_str())) {
                Some(d) if (MIN_SCALE_PERIOD..=MAX_SCALE_PERIOD).contains(&d) => Some(d),
                _ => {
                    self.yaml.error(
                        n.span(),
                        format!("`{name}` must be a duration from 1ms to 60s, such as 50ms, 100ms or 1s"),
                    );
                    None
                }
            }
        };
        let lease_period = period("lease_period");
        let sync_interval = period("sync_interval");
        let scope =
            map.get_node("scope")
                .and_then(|n| match n.as_scalar().map(MarkedScalarNode::as_str) {
                    Some("region") => Some((Scope::Region, *n.span())),
                    Some("global") => Some((Scope::Global, *n.span())),
                    other => {
                        self.yaml.error(
                            n.span(),
                            format!(
                                "unknown scope `{}` (expected region or global)",
                                other.unwrap_or("")
                            ),
                        );
                        None
                    }
                });
        DraftConsistency {
            mode,
            lease_period,
            sync_interval,
            scope,
        }
    }

    fn rate_limit(&mut self, node: &Node, allow_unlimited: bool) -> Option<DraftLimit> {
        let Some(map) = node.as_mapping() else {
            self.yaml.error(
                node.span(),
                "a rate limit must be a mapping with `unit` and `requests_per_unit`",
            );
            return None;
        };
        self.yaml.check_keys(
            map,
            &[
                "unit",
                "requests_per_unit",
                "unlimited",
                "name",
                "replaces",
                "algorithm",
                "burst",
                "block_duration",
                "overage_percent",
                "overdraft",
                "warmup",
                "mode",
                "priority",
                "borrow",
            ],
            "a rate limit",
        );
        let unlimited = self.yaml.bool_field(map, "unlimited").unwrap_or(false);
        if unlimited {
            if !allow_unlimited {
                self.yaml.error(
                    map.span(),
                    "`unlimited` is not allowed inside `rate_limits`",
                );
            }
            for other in [
                "unit",
                "requests_per_unit",
                "algorithm",
                "burst",
                "overdraft",
                "warmup",
                "block_duration",
                "priority",
                "borrow",
            ] {
                if let Some(n) = map.get_node(other) {
                    self.yaml.error(
                        n.span(),
                        format!(
                            "an `unlimited` rate limit cannot also have {} `{other}`",
                            if other.starts_with(['a', 'o']) {
                                "an"
                            } else {
                                "a"
                            }
                        ),
                    );
                }
            }
            return Some(DraftLimit::Unlimited);
        }
        let unit = match map.get_node("unit") {
            None => {
                self.yaml.error(
                    map.span(),
                    "a rate limit needs a `unit` (second, minute, hour, day, week, month or year)",
                );
                None
            }
            Some(n) => {
                let text = n.as_scalar().map(MarkedScalarNode::as_str).unwrap_or("");
                let unit = Unit::parse(text);
                if unit.is_none() {
                    self.yaml.error(n.span(), format!("unknown unit `{text}` (expected second, minute, hour, day, week, month or year)"));
                }
                unit
            }
        };
        let rpu = if map.get_node("requests_per_unit").is_none() {
            self.yaml.error(
                &Reader::start(map),
                "a rate limit needs `requests_per_unit`",
            );
            None
        } else {
            self.yaml
                .number(map, "requests_per_unit", u64::from(u32::MAX))
        };
        let name = map.get_scalar("name").map(|s| s.as_str().to_string());
        let replaces = self.replaces(map);
        if let Some(own) = &name {
            for (other, span) in &replaces {
                if other == own {
                    self.yaml.error(
                        span,
                        format!("rate limit `{own}` names itself in `replaces`: a limit replaces other limits, never itself"),
                    );
                }
            }
        }
        let mut spec = LimitSpec::default();
        if let Some(n) = map.get_node("algorithm") {
            let text = n.as_scalar().map(MarkedScalarNode::as_str).unwrap_or("");
            match AlgorithmName::parse(text) {
                Some(a) => spec.algorithm = a,
                None => self.yaml.error(
                    n.span(),
                    format!("unknown algorithm `{text}` (expected one of: {ALGORITHMS})"),
                ),
            }
        }
        if let Some(n) = map.get_node("burst") {
            if !spec.algorithm.is_bucket() {
                self.yaml.error(
                    n.span(),
                    "`burst` applies only to token_bucket, gcra and leaky_bucket",
                );
            }
            spec.burst = self.yaml.number(map, "burst", u64::from(u32::MAX));
        }
        if let Some(n) = map.get_node("overdraft") {
            if !matches!(
                spec.algorithm,
                AlgorithmName::TokenBucket | AlgorithmName::Gcra
            ) {
                self.yaml.error(
                    n.span(),
                    "`overdraft` applies only to token_bucket and gcra (a bucket that may go into debt)",
                );
            }
            spec.overdraft = self
                .yaml
                .number(map, "overdraft", u64::from(u32::MAX))
                .unwrap_or(0);
        }
        let warmup = map.get_node("warmup");
        if let Some(n) = warmup {
            if !matches!(
                spec.algorithm,
                AlgorithmName::TokenBucket | AlgorithmName::Gcra
            ) {
                self.yaml.error(
                    n.span(),
                    "`warmup` applies only to token_bucket and gcra (a bucket whose idle keys start cold)",
                );
            }
            match n.as_scalar().and_then(|s| parse_duration(s.as_str())) {
                Some(d) if d.is_zero() => self.yaml.error(
                    n.span(),
                    "`warmup` must be longer than zero (leave it out for no warm-up)",
                ),
                Some(d) if d <= MAX_WARMUP => spec.warmup = d,
                Some(_) => self.yaml.error(
                    n.span(),
                    "`warmup` may be at most 1d (a cold key is kept that long after its last request)",
                ),
                None => self.yaml.error(
                    n.span(),
                    "`warmup` must be a duration such as 500ms, 30s, 5m or 1h",
                ),
            }
            if spec.overdraft > 0 {
                self.yaml.error(
                    n.span(),
                    "`warmup` cannot be combined with `overdraft`: a cold key admits at a third of the rate, a debt admits beyond the bucket",
                );
                // Refused once: the limit is built without it.
                spec.warmup = Duration::ZERO;
            }
            if map.get_node("priority").is_some() {
                self.yaml.error(
                    n.span(),
                    "`warmup` cannot be combined with `priority`: the classes share one counter, and how warm it is would be each class's",
                );
            }
        }
        if let Some(n) = map.get_node("mode") {
            match n.as_scalar().map(MarkedScalarNode::as_str) {
                Some("queue") if spec.algorithm == AlgorithmName::LeakyBucket => spec.queue = true,
                Some("meter") if spec.algorithm == AlgorithmName::LeakyBucket => {}
                _ => self.yaml.error(
                    n.span(),
                    "`mode` is `meter` or `queue`, and only with `algorithm: leaky_bucket`",
                ),
            }
        }
        if let Some(n) = map.get_node("block_duration") {
            match n.as_scalar().and_then(|s| parse_duration(s.as_str())) {
                Some(d) if d <= MAX_BLOCK => spec.block = d,
                Some(_) => self.yaml.error(
                    n.span(),
                    "`block_duration` may be at most 365d (a lockout is a key kept that long, and its Retry-After must stay a number a client can use)",
                ),
                None => self.yaml.error(
                    n.span(),
                    "`block_duration` must be a duration such as 900s, 15m, 1h or 1d",
                ),
            }
        }
        if map.get_node("overage_percent").is_some() {
            spec.overage_percent = self.yaml.number(map, "overage_percent", 1000).unwrap_or(0);
        }
        let priority = map.get_node("priority").and_then(|n| self.priority(n));
        let borrow = map.get_node("borrow").and_then(|n| self.borrow(n));
        let (unit, rpu) = (unit?, rpu?);
        if let Some(b) = &borrow {
            if b.up_to <= rpu {
                self.yaml.error(
                    &b.up_to_span,
                    format!("`borrow.up_to` ({}) must be above the limit's own `requests_per_unit` ({rpu}): it is how far a key may go in all while the pool has room", b.up_to),
                );
                return None;
            }
        }
        if let Some(why) = bucket_out_of_range(&spec, unit, rpu) {
            let span = map
                .get_node("overdraft")
                .or_else(|| map.get_node("burst"))
                .or_else(|| map.get_node("requests_per_unit"))
                .map_or(*map.span(), |n| *n.span());
            self.yaml.error(&span, why);
            return None;
        }
        if let (Some(n), false) = (warmup, spec.warmup.is_zero()) {
            if let Err(e) = spec.build(rpu, unit, 0) {
                self.yaml.error(n.span(), e.to_string());
                return None;
            }
            // The scripts count a lockout in the warm-up's tick, which may be 1 ns.
            if spec.block.as_nanos() >= 1 << 51 {
                self.yaml.error(
                    n.span(),
                    "`warmup` cannot be combined with a `block_duration` above 26d",
                );
                return None;
            }
        }
        if spec.algorithm == AlgorithmName::SlidingLog && rpu > 100_000 {
            let span = map
                .get_node("requests_per_unit")
                .map_or(*map.span(), |n| *n.span());
            self.yaml.error(&span, "a sliding_log keeps one entry per request: use sliding_window above 100000 per unit");
            return None;
        }
        Some(DraftLimit::Limited(Box::new(DraftRateLimit {
            span: Reader::start(map),
            name,
            requests_per_unit: rpu,
            unit,
            replaces,
            spec,
            priority,
            borrow,
        })))
    }

    /// `borrow: {from: POOL, up_to: N}`.
    fn borrow(&mut self, node: &Node) -> Option<DraftBorrow> {
        const WHAT: &str =
            "`borrow` must be `{from: <pool name>, up_to: <requests per unit in all>}`";
        let Some(map) = node.as_mapping() else {
            self.yaml.error(node.span(), WHAT);
            return None;
        };
        self.yaml.check_keys(map, &["from", "up_to"], "`borrow`");
        let from = match map.get_scalar("from") {
            Some(f) if !f.as_str().trim().is_empty() => {
                Some((f.as_str().trim().to_string(), *f.span()))
            }
            _ => {
                self.yaml.error(
                    map.get_node("from").map_or(map.span(), |n| n.span()),
                    "`borrow` needs `from`: the name of one of the domain's `pools`",
                );
                None
            }
        };
        let up_to = if map.get_node("up_to").is_none() {
            self.yaml.error(
                map.span(),
                "`borrow` needs `up_to`: how many requests per unit a key may reach in all while the pool has room",
            );
            None
        } else {
            self.yaml.number(map, "up_to", u64::from(u32::MAX))
        };
        let (from, from_span) = from?;
        Some(DraftBorrow {
            span: *node.span(),
            from,
            from_span,
            up_to: up_to?,
            up_to_span: map.get_node("up_to").map_or(*map.span(), |n| *n.span()),
        })
    }

    /// `priority: {from: KEY, shares: {CLASS: PERCENT%, ...}, default_class: CLASS}`.
    fn priority(&mut self, node: &Node) -> Option<DraftPriority> {
        const WHAT: &str = "`priority` must be `{from: <descriptor key>, shares: {<class>: <percent>%, ...}, default_class: <class>}`";
        let Some(map) = node.as_mapping() else {
            self.yaml.error(node.span(), WHAT);
            return None;
        };
        self.yaml
            .check_keys(map, &["from", "shares", "default_class"], "`priority`");
        let from = match map.get_scalar("from").map(|s| s.as_str()) {
            Some(f) if !f.is_empty() => Some(f.to_string()),
            _ => {
                self.yaml.error(
                    map.get_node("from").map_or(map.span(), |n| n.span()),
                    "`priority` needs `from`: the descriptor key whose value names the request's class (e.g. `from: priority`)",
                );
                None
            }
        };
        let mut classes: Vec<(String, u64)> = Vec::new();
        match map.get_node("shares").and_then(|n| n.as_mapping()) {
            None => self.yaml.error(
                map.get_node("shares").map_or(map.span(), |n| n.span()),
                "`priority` needs `shares`: each class and the share of the limit it may use, e.g. `{critical: 100%, default: 80%, sheddable: 50%}`",
            ),
            Some(shares) => {
                for (class, share) in shares.iter() {
                    let text = share.as_scalar().map(|s| s.as_str()).unwrap_or("");
                    let percent = text
                        .strip_suffix('%')
                        .unwrap_or(text)
                        .trim()
                        .parse::<u64>()
                        .ok()
                        .filter(|p| *p <= 100);
                    match percent {
                        Some(p) if classes.len() < MAX_PRIORITY_CLASSES => {
                            classes.push((class.as_str().to_string(), p));
                        }
                        Some(_) => {
                            self.yaml.error(
                                class.span(),
                                format!("`priority` has at most {MAX_PRIORITY_CLASSES} classes"),
                            );
                            break;
                        }
                        None => self.yaml.error(
                            share.span(),
                            format!("class `{}`: a share is a percentage from 0% to 100% of the limit, such as `80%`", class.as_str()),
                        ),
                    }
                }
                if shares.is_empty() {
                    self.yaml
                        .error(shares.span(), "`shares` names no class");
                }
            }
        }
        let default = match map.get_scalar("default_class") {
            None => {
                self.yaml.error(
                    map.span(),
                    "`priority` needs `default_class`: the class of a request that names none, or one not in `shares`",
                );
                None
            }
            Some(d) => {
                let found = classes.iter().position(|(c, _)| c == d.as_str());
                if found.is_none() && !classes.is_empty() {
                    self.yaml.error(
                        d.span(),
                        format!(
                            "`default_class: {}` is not one of the classes in `shares` ({})",
                            d.as_str(),
                            classes
                                .iter()
                                .map(|c| c.0.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    );
                }
                found
            }
        };
        Some(DraftPriority {
            span: *node.span(),
            from: from?,
            classes,
            default: default?,
        })
    }

    fn replaces(&mut self, map: &MarkedMappingNode) -> Vec<(String, Span)> {
        let Some(node) = map.get_node("replaces") else {
            return Vec::new();
        };
        let Some(seq) = node.as_sequence() else {
            self.yaml
                .error(node.span(), "`replaces` must be a list of `{name: ...}`");
            return Vec::new();
        };
        let mut names = Vec::new();
        for item in seq.iter() {
            let entry = item.as_mapping();
            match entry.and_then(|m| m.get_scalar("name")) {
                Some(n) if !n.as_str().is_empty() => {
                    names.push((n.as_str().to_string(), *n.span()))
                }
                // The entry's start, since an empty value has no place of its own.
                Some(_) => self.yaml.error(
                    &entry.map_or(*item.span(), Reader::start),
                    "empty `replaces` entry: give the `name` of the rate limit it replaces",
                ),
                _ => self.yaml.error(
                    item.span(),
                    "each `replaces` entry must be `{name: <limit name>}`",
                ),
            }
        }
        names
    }
}

/// The shortest `lease_period` and `sync_interval`.
const MIN_SCALE_PERIOD: Duration = Duration::from_millis(1);
/// The longest `lease_period` and `sync_interval`: units leased or counted longer ago
/// than this say little about the shared count.
const MAX_SCALE_PERIOD: Duration = Duration::from_secs(60);

/// The counting mode a rule file names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConsistencyMode {
    Exact,
    Leased,
    Synced,
}

/// A domain's or descriptor's `consistency` settings as written: each `None` when
/// absent, taken from the level above (the compiler inherits and resolves them).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DraftConsistency {
    pub(crate) mode: Option<ConsistencyMode>,
    pub(crate) lease_period: Option<Duration>,
    pub(crate) sync_interval: Option<Duration>,
    /// `scope`, and where it was written (for errors).
    pub(crate) scope: Option<(Scope, Span)>,
}

/// The longest `warmup`: a day.
const MAX_WARMUP: Duration = Duration::from_secs(86_400);

/// The longest `block_duration`: a year.
const MAX_BLOCK: Duration = Duration::from_secs(365 * 86_400);

/// Parses `900s`, `15m`, `1h`, `1d`, `500ms` or a plain number of seconds.
pub(crate) fn parse_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let n: u64 = digits.parse().ok()?;
    let secs = |k: u64| n.checked_mul(k).map(Duration::from_secs);
    match unit.trim() {
        "" | "s" => secs(1),
        "ms" => Some(Duration::from_millis(n)),
        "m" => secs(60),
        "h" => secs(3_600),
        "d" => secs(86_400),
        _ => None,
    }
}

/// A domain's or descriptor's failure settings as written: each `None` when absent.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DraftFailure {
    /// `failure_mode` (a `local_fallback`'s divisor and regions are in the fields below).
    pub(crate) mode: Option<FailureMode>,
    /// `local_fallback_divisor` and `regions`, with their places.
    pub(crate) divisor: Option<(u64, Span)>,
    pub(crate) regions: Option<(u64, Span)>,
}

/// A domain as read from one file, before compiling.
#[derive(Debug)]
pub(crate) struct DraftDomain {
    pub(crate) name: String,
    pub(crate) file: String,
    pub(crate) span: Span,
    pub(crate) failure: DraftFailure,
    pub(crate) consistency: DraftConsistency,
    pub(crate) charge: Option<ChargeRejected>,
    pub(crate) descriptors: Vec<DraftRule>,
    /// The file's `pools`.
    pub(crate) pools: Vec<DraftPool>,
    /// The file's gateway section.
    #[cfg(feature = "tower")]
    pub(crate) http: Option<crate::http::HttpRules>,
}

impl DraftDomain {
    /// An error at the `domain` line of this file.
    pub(crate) fn error(&self, message: String) -> ConfigError {
        let (line, column) = self.span.start().map_or((0, 0), |m| (m.line(), m.column()));
        ConfigError {
            file: self.file.clone(),
            line,
            column,
            message,
        }
    }
}

/// A descriptor as read, with the descriptors nested in it.
#[derive(Debug)]
pub(crate) struct DraftRule {
    pub(crate) key: String,
    pub(crate) value: Option<String>,
    pub(crate) span: Span,
    pub(crate) origin: String,
    pub(crate) limits: Vec<DraftRateLimit>,
    pub(crate) unlimited: bool,
    pub(crate) shadow_mode: bool,
    pub(crate) detailed_metric: bool,
    pub(crate) value_to_metric: bool,
    pub(crate) share_threshold: bool,
    pub(crate) quota_mode: bool,
    pub(crate) failure: DraftFailure,
    pub(crate) charge: Option<ChargeRejected>,
    pub(crate) consistency: DraftConsistency,
    pub(crate) metadata: Option<Metadata>,
    pub(crate) children: Vec<DraftRule>,
}

/// A `rate_limit` as read: `unlimited`, or a limit.
#[derive(Debug)]
enum DraftLimit {
    Unlimited,
    Limited(Box<DraftRateLimit>),
}

/// A limit as read, before the compiler gives it its counting and identity.
#[derive(Debug)]
pub(crate) struct DraftRateLimit {
    pub(crate) span: Span,
    pub(crate) name: Option<String>,
    pub(crate) requests_per_unit: u64,
    pub(crate) unit: Unit,
    pub(crate) replaces: Vec<(String, Span)>,
    pub(crate) spec: LimitSpec,
    pub(crate) priority: Option<DraftPriority>,
    pub(crate) borrow: Option<DraftBorrow>,
}

/// A limit's `borrow`: the pool's name and how far a key may go in all.
#[derive(Debug)]
pub(crate) struct DraftBorrow {
    pub(crate) span: Span,
    pub(crate) from: String,
    pub(crate) from_span: Span,
    pub(crate) up_to: u64,
    pub(crate) up_to_span: Span,
}

/// A pool as read: its name and its limit.
#[derive(Debug)]
pub(crate) struct DraftPool {
    pub(crate) span: Span,
    pub(crate) name: String,
    pub(crate) limit: Box<DraftRateLimit>,
}

/// A limit's `priority`: the descriptor key naming the class, each class's share of
/// the limit (percent), and the class of a request that names none (an index).
#[derive(Debug)]
pub(crate) struct DraftPriority {
    pub(crate) span: Span,
    pub(crate) from: String,
    pub(crate) classes: Vec<(String, u64)>,
    pub(crate) default: usize,
}

/// The most classes one `priority` may name.
const MAX_PRIORITY_CLASSES: usize = 64;
