//! Reading one rule file: YAML with positions (marked-yaml), validated key by key so
//! that every problem is reported with its line and column, not only the first.

use std::collections::{HashMap, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Duration;

use marked_yaml::types::{MarkedMappingNode, MarkedScalarNode};
use marked_yaml::{LoaderOptions, Node, Span};

use super::error::ConfigError;
use super::metadata::Metadata;
use super::spec::{bucket_out_of_range, AlgorithmName, LimitSpec, ALGORITHMS};
use super::tree::{Domain, Glob, Level, Rule, RuleId, RuleLimit};
use super::{FailureMode, Unit};
use crate::algorithm::Consistency;
use crate::store::ChargeRejected;

/// Collects errors for one file.
pub(crate) struct Reader<'a> {
    file: &'a str,
    errors: Vec<ConfigError>,
    lines: Vec<String>,
    /// The characters of each line an error was placed on, made the first time one
    /// needs them: a flow-style file is one long line with many errors, and collecting
    /// it again for each would make the errors cost the square of the line.
    chars: HashMap<usize, Vec<char>>,
    /// How many `descriptors` lists deep the reading is, and how deep they may go.
    depth: usize,
    max_depth: usize,
}

impl<'a> Reader<'a> {
    /// A reader that refuses `descriptors` lists nested more than `max_depth` deep.
    pub(crate) fn with_max_depth(file: &'a str, max_depth: usize) -> Self {
        Self {
            file,
            errors: Vec::new(),
            lines: Vec::new(),
            chars: HashMap::new(),
            depth: 0,
            max_depth,
        }
    }

    pub(crate) fn into_errors(self) -> Vec<ConfigError> {
        self.errors
    }

    fn error(&mut self, span: &Span, message: impl Into<String>) {
        let (line, column) = self.position(span);
        self.errors.push(ConfigError {
            file: self.file.to_string(),
            line,
            column,
            message: message.into(),
        });
    }

    /// 1-based (line, column) of a span. yaml-rust marks the first key of a block
    /// mapping at its `:`; such a marker is moved back to the start of the key.
    fn position(&mut self, span: &Span) -> (usize, usize) {
        let Some(m) = span.start() else { return (0, 0) };
        let (line, column) = (m.line(), m.column());
        let lines = &self.lines;
        let chars = self.chars.entry(line).or_insert_with(|| {
            lines
                .get(line.wrapping_sub(1))
                .map(|text| text.chars().collect())
                .unwrap_or_default()
        });
        if column >= 2 && chars.get(column - 1) == Some(&':') {
            let before = &chars[..column - 1];
            let key_len = before
                .iter()
                .rev()
                .take_while(|c| !c.is_whitespace() && !matches!(c, '{' | ',' | '-'))
                .count();
            return (line, column - key_len);
        }
        (line, column)
    }

    /// Where a mapping starts, for messages: its first key (yaml-rust puts a block
    /// mapping's own start marker at the first `:`).
    fn start(map: &MarkedMappingNode) -> Span {
        map.keys().next().map_or(*map.span(), |k| *k.span())
    }

    fn origin(&self, span: &Span) -> String {
        format!("{}:{}", self.file, span.start().map_or(0, |m| m.line()))
    }

    /// Parses a whole file into a draft domain (`None` when it could not be read at all).
    pub(crate) fn read(&mut self, text: &str) -> Option<DraftDomain> {
        let text = without_bom(text);
        self.lines = text.lines().map(str::to_string).collect();
        let unreadable = forbidden_character(text).or_else(|| too_deep(text, MAX_YAML_DEPTH));
        if let Some((line, column, message)) = unreadable {
            self.errors.push(ConfigError {
                file: self.file.to_string(),
                line,
                column,
                message,
            });
            return None;
        }
        let root = match parse(text) {
            Ok(root) => root,
            Err(e) => {
                self.yaml_error(e);
                return None;
            }
        };
        let Some(top) = root.as_mapping() else {
            self.error(
                root.span(),
                "a rule file must be a mapping with `domain` and `descriptors`",
            );
            return None;
        };
        self.check_keys(
            top,
            &[
                "domain",
                "descriptors",
                "http",
                "failure_mode",
                "local_fallback_divisor",
                "charge_rejected",
                "consistency",
                "lease_period",
                "sync_interval",
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
                self.error(&span, "`domain` is empty: every rule file names its domain");
                None
            }
            None => {
                if let Some(n) = top.get_node("domain") {
                    self.error(n.span(), "`domain` must be a string");
                } else {
                    self.error(
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
        #[cfg(feature = "tower")]
        let http = match (top.get_node("http"), &domain) {
            (Some(node), Some(name)) => crate::http::config::from_node(self.file, name, node)
                .unwrap_or_else(|e| {
                    self.errors.push(e);
                    None
                }),
            _ => None,
        };
        Some(DraftDomain {
            #[cfg(feature = "tower")]
            http,
            name: domain?,
            file: self.file.to_string(),
            span: top.get_node("domain").map_or(*top.span(), |n| *n.span()),
            failure,
            charge,
            consistency,
            descriptors,
        })
    }

    fn yaml_error(&mut self, e: marked_yaml::LoadError) {
        use marked_yaml::LoadError as E;
        let (marker, message) = match &e {
            E::TopLevelMustBeMapping(m) => (
                Some(*m),
                "a rule file must be a mapping with `domain` and `descriptors`".to_string(),
            ),
            E::UnexpectedAnchor(m) => (
                Some(*m),
                "YAML anchors and aliases are not supported in rule files".to_string(),
            ),
            E::MappingKeyMustBeScalar(m) => {
                (Some(*m), "a mapping key must be a plain string".to_string())
            }
            E::UnexpectedTag(m) => (
                Some(*m),
                "YAML tags are not supported in rule files".to_string(),
            ),
            E::ScanError(m, se) => (Some(*m), format!("not valid YAML: {}", se.info())),
            E::DuplicateKey(d) => (
                d.key.span().start().copied(),
                format!(
                    "duplicate key `{}` (first given on line {})",
                    d.key.as_str(),
                    d.prev_key.span().start().map_or(0, |m| m.line())
                ),
            ),
            other => (None, format!("not valid YAML: {other}")),
        };
        let span = marker.map_or_else(Span::new_blank, Span::new_start);
        self.error(&span, message);
    }

    /// Reports every key of `map` not in `allowed`.
    fn check_keys(&mut self, map: &MarkedMappingNode, allowed: &[&str], place: &str) {
        for key in map.keys() {
            if !allowed.contains(&key.as_str()) {
                self.error(
                    key.span(),
                    format!(
                        "unknown key `{}` in {place} (expected one of: {})",
                        key.as_str(),
                        allowed.join(", ")
                    ),
                );
            }
        }
    }

    fn descriptors(&mut self, node: &Node) -> Vec<DraftRule> {
        // `descriptors:` with nothing after it (YAML's null) is an empty list, as in
        // Envoy's service: a domain (or descriptor) with no rules below it.
        if node.as_scalar().is_some_and(is_null) {
            return Vec::new();
        }
        let Some(seq) = node.as_sequence() else {
            self.error(node.span(), "`descriptors` must be a list");
            return Vec::new();
        };
        // The reading, the rule tree and its compilation all recurse once per level:
        // bounded here, so that no file can exhaust a thread's stack.
        if self.depth >= self.max_depth {
            let max = self.max_depth;
            self.error(
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
            self.error(
                node.span(),
                "a descriptor must be a mapping with at least `key`",
            );
            return None;
        };
        self.check_keys(
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
                "charge_rejected",
                "consistency",
                "lease_period",
                "sync_interval",
            ],
            "a descriptor",
        );
        let failure = self.failure_mode(map);
        let consistency = self.consistency(map);
        let charge = self.charge_rejected(map);
        let metadata = match map.get_node("metadata") {
            Some(n) if !n.as_scalar().is_some_and(is_null) => {
                if n.as_mapping().is_none() {
                    self.error(n.span(), "`metadata` must be a mapping");
                }
                Some(Metadata::from_node(n))
            }
            _ => None,
        };
        let key = match map.get_node("key") {
            None => {
                self.error(&Self::start(map), "a descriptor needs a `key`");
                None
            }
            Some(n) => match n.as_scalar() {
                Some(s) if !s.as_str().is_empty() => Some(s.as_str().to_string()),
                Some(s) => {
                    self.error(s.span(), "a descriptor's `key` is empty");
                    None
                }
                None => {
                    self.error(n.span(), "a descriptor's `key` must be a string");
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
                    self.error(n.span(), "a descriptor's `value` must be a string");
                    None
                }
            },
        };
        let flag = |r: &mut Self, name: &str| r.bool_field(map, name).unwrap_or(false);
        let shadow_mode = flag(self, "shadow_mode");
        let detailed_metric = flag(self, "detailed_metric");
        let value_to_metric = flag(self, "value_to_metric");
        let share_threshold = flag(self, "share_threshold");
        let quota_mode = flag(self, "quota_mode");
        if share_threshold && !value.as_deref().is_some_and(|v| v.contains('*')) {
            let span = map
                .get_node("share_threshold")
                .map_or(*map.span(), |n| *n.span());
            self.error(
                &span,
                "`share_threshold` needs a wildcard `value` (one with `*`) to share",
            );
        }
        let mut limits = Vec::new();
        let mut unlimited = false;
        match (map.get_node("rate_limit"), map.get_node("rate_limits")) {
            (Some(one), Some(_)) => {
                self.error(
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
                _ => self.error(
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
            span: Self::start(map),
            origin: self.origin(&Self::start(map)),
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
            self.error(
                node.span(),
                "`charge_rejected` must be none, over_limit or all",
            );
        }
        mode
    }

    /// `failure_mode` (and `local_fallback_divisor`) of a domain or descriptor.
    fn failure_mode(&mut self, map: &MarkedMappingNode) -> Option<FailureMode> {
        let divisor = match map.get_node("local_fallback_divisor") {
            None => None,
            Some(_) => match self.number(map, "local_fallback_divisor", 1_000_000) {
                Some(0) => {
                    let span = map
                        .get_node("local_fallback_divisor")
                        .map_or(*map.span(), |n| *n.span());
                    self.error(&span, "`local_fallback_divisor` must be at least 1");
                    None
                }
                other => other,
            },
        };
        let node = map.get_node("failure_mode");
        let mode = match node
            .and_then(|n| n.as_scalar())
            .map(MarkedScalarNode::as_str)
        {
            None => None,
            Some("fail_open") => Some(FailureMode::FailOpen),
            Some("fail_closed") => Some(FailureMode::FailClosed),
            Some("local_fallback") => Some(FailureMode::LocalFallback {
                divisor: divisor.unwrap_or(1),
            }),
            Some(other) => {
                let span = node.map_or(*map.span(), |n| *n.span());
                self.error(&span, format!("unknown failure_mode `{other}` (expected fail_open, fail_closed or local_fallback)"));
                return None;
            }
        };
        if node.is_some() && mode.is_none() {
            let span = node.map_or(*map.span(), |n| *n.span());
            self.error(
                &span,
                "`failure_mode` must be fail_open, fail_closed or local_fallback",
            );
        }
        if divisor.is_some() && !matches!(mode, Some(FailureMode::LocalFallback { .. })) {
            let span = map
                .get_node("local_fallback_divisor")
                .map_or(*map.span(), |n| *n.span());
            self.error(
                &span,
                "`local_fallback_divisor` needs `failure_mode: local_fallback` beside it",
            );
        }
        mode
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
                    self.error(
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
                    self.error(
                        n.span(),
                        format!("`{name}` must be a duration from 1ms to 60s, such as 50ms, 100ms or 1s"),
                    );
                    None
                }
            }
        };
        DraftConsistency {
            mode,
            lease_period: period("lease_period"),
            sync_interval: period("sync_interval"),
        }
    }

    /// A flag: `None` when absent or null (Envoy's service reads both as false).
    fn bool_field(&mut self, map: &MarkedMappingNode, name: &str) -> Option<bool> {
        let node = map.get_node(name)?;
        if node.as_scalar().is_some_and(is_null) {
            return None;
        }
        match node.as_scalar().map(|s| s.as_str().to_ascii_lowercase()) {
            Some(s) if s == "true" => Some(true),
            Some(s) if s == "false" => Some(false),
            _ => {
                self.error(node.span(), format!("`{name}` must be true or false"));
                None
            }
        }
    }

    fn number(&mut self, map: &MarkedMappingNode, name: &str, max: u64) -> Option<u64> {
        let node = map.get_node(name)?;
        let text = node.as_scalar().map(MarkedScalarNode::as_str);
        match text
            .and_then(|t| t.trim().parse::<u64>().ok())
            .filter(|&n| n <= max)
        {
            Some(n) => Some(n),
            None => {
                self.error(
                    node.span(),
                    format!(
                        "`{name}` must be a whole number from 0 to {max}, got `{}`",
                        text.unwrap_or("a non-scalar")
                    ),
                );
                None
            }
        }
    }

    fn rate_limit(&mut self, node: &Node, allow_unlimited: bool) -> Option<DraftLimit> {
        let Some(map) = node.as_mapping() else {
            self.error(
                node.span(),
                "a rate limit must be a mapping with `unit` and `requests_per_unit`",
            );
            return None;
        };
        self.check_keys(
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
                "mode",
            ],
            "a rate limit",
        );
        let unlimited = self.bool_field(map, "unlimited").unwrap_or(false);
        if unlimited {
            if !allow_unlimited {
                self.error(
                    map.span(),
                    "`unlimited` is not allowed inside `rate_limits`",
                );
            }
            for other in [
                "unit",
                "requests_per_unit",
                "algorithm",
                "burst",
                "block_duration",
            ] {
                if let Some(n) = map.get_node(other) {
                    self.error(
                        n.span(),
                        format!("an `unlimited` rate limit cannot also have a `{other}`"),
                    );
                }
            }
            return Some(DraftLimit::Unlimited);
        }
        let unit = match map.get_node("unit") {
            None => {
                self.error(
                    map.span(),
                    "a rate limit needs a `unit` (second, minute, hour, day, week, month or year)",
                );
                None
            }
            Some(n) => {
                let text = n.as_scalar().map(MarkedScalarNode::as_str).unwrap_or("");
                let unit = Unit::parse(text);
                if unit.is_none() {
                    self.error(n.span(), format!("unknown unit `{text}` (expected second, minute, hour, day, week, month or year)"));
                }
                unit
            }
        };
        let rpu = if map.get_node("requests_per_unit").is_none() {
            self.error(&Self::start(map), "a rate limit needs `requests_per_unit`");
            None
        } else {
            self.number(map, "requests_per_unit", u64::from(u32::MAX))
        };
        let name = map.get_scalar("name").map(|s| s.as_str().to_string());
        let replaces = self.replaces(map);
        if let Some(own) = &name {
            for (other, span) in &replaces {
                if other == own {
                    self.error(
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
                None => self.error(
                    n.span(),
                    format!("unknown algorithm `{text}` (expected one of: {ALGORITHMS})"),
                ),
            }
        }
        if let Some(n) = map.get_node("burst") {
            if !spec.algorithm.is_bucket() {
                self.error(
                    n.span(),
                    "`burst` applies only to token_bucket, gcra and leaky_bucket",
                );
            }
            spec.burst = self.number(map, "burst", u64::from(u32::MAX));
        }
        if let Some(n) = map.get_node("mode") {
            match n.as_scalar().map(MarkedScalarNode::as_str) {
                Some("queue") if spec.algorithm == AlgorithmName::LeakyBucket => spec.queue = true,
                Some("meter") if spec.algorithm == AlgorithmName::LeakyBucket => {}
                _ => self.error(
                    n.span(),
                    "`mode` is `meter` or `queue`, and only with `algorithm: leaky_bucket`",
                ),
            }
        }
        if let Some(n) = map.get_node("block_duration") {
            match n.as_scalar().and_then(|s| parse_duration(s.as_str())) {
                Some(d) if d <= MAX_BLOCK => spec.block = d,
                Some(_) => self.error(
                    n.span(),
                    "`block_duration` may be at most 365d (a lockout is a key kept that long, and its Retry-After must stay a number a client can use)",
                ),
                None => self.error(
                    n.span(),
                    "`block_duration` must be a duration such as 900s, 15m, 1h or 1d",
                ),
            }
        }
        if map.get_node("overage_percent").is_some() {
            spec.overage_percent = self.number(map, "overage_percent", 1000).unwrap_or(0);
        }
        let (unit, rpu) = (unit?, rpu?);
        if let Some(why) = bucket_out_of_range(&spec, unit, rpu) {
            let span = map
                .get_node("burst")
                .or_else(|| map.get_node("requests_per_unit"))
                .map_or(*map.span(), |n| *n.span());
            self.error(&span, why);
            return None;
        }
        if spec.algorithm == AlgorithmName::SlidingLog && rpu > 100_000 {
            let span = map
                .get_node("requests_per_unit")
                .map_or(*map.span(), |n| *n.span());
            self.error(&span, "a sliding_log keeps one entry per request: use sliding_window above 100000 per unit");
            return None;
        }
        Some(DraftLimit::Limited(Box::new(DraftRateLimit {
            span: Self::start(map),
            name,
            requests_per_unit: rpu,
            unit,
            replaces,
            spec,
        })))
    }

    fn replaces(&mut self, map: &MarkedMappingNode) -> Vec<(String, Span)> {
        let Some(node) = map.get_node("replaces") else {
            return Vec::new();
        };
        let Some(seq) = node.as_sequence() else {
            self.error(node.span(), "`replaces` must be a list of `{name: ...}`");
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
                Some(_) => self.error(
                    &entry.map_or(*item.span(), Self::start),
                    "empty `replaces` entry: give the `name` of the rate limit it replaces",
                ),
                _ => self.error(
                    item.span(),
                    "each `replaces` entry must be `{name: <limit name>}`",
                ),
            }
        }
        names
    }
}

/// Parses a rule file's YAML: duplicate keys are errors, and scalars stay text (a
/// number or `true` is read by the field that expects it).
fn parse(text: &str) -> Result<Node, marked_yaml::LoadError> {
    let options = LoaderOptions::default()
        .error_on_duplicate_keys(true)
        .prevent_coercion(true);
    marked_yaml::parse_yaml_with_options(0, text, options)
}

/// `text` without the byte order mark an editor may have put first (not part of the
/// first key).
fn without_bom(text: &str) -> &str {
    text.strip_prefix('\u{feff}').unwrap_or(text)
}

/// The first character a rule file may not hold, as (line, column, message), both
/// 1-based: a control character other than tab, line feed and carriage return. A NUL
/// in particular ends the YAML reader's view of the file, which would load what came
/// before it and silently drop the rest.
fn forbidden_character(text: &str) -> Option<(usize, usize, String)> {
    let at = text.find(|c: char| c.is_control() && !matches!(c, '\t' | '\n' | '\r'))?;
    let before = &text[..at];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    let c = text[at..].chars().next().map_or(0, u32::from);
    Some((
        line,
        column,
        format!("a control character (U+{c:04X}) where text was expected: a rule file is text; remove it"),
    ))
}

/// How deep the YAML of a rule file may nest, whatever `--max-rule-depth` says (the
/// one reader of a file, its rules and its `http` section alike, holds it to this
/// bound before parsing): each descriptor level is two YAML levels (a list and a
/// mapping), [`MAX_MAX_DEPTH`] of them and room for the fields inside the deepest. The
/// YAML reader recurses once per level; this bound is what keeps it within a 2 MiB
/// stack, and the threads that read rule files are given twice that
/// ([`RELOAD_STACK_SIZE`](super::RELOAD_STACK_SIZE)).
pub(crate) const MAX_YAML_DEPTH: usize = 2 * super::MAX_MAX_DEPTH + 32;

/// Where the YAML of `text` first nests deeper than `limit` levels, as (line, column,
/// message), found without parsing: block levels from the indentation (and each `- `,
/// `? ` or `: ` that opens a collection inside a line: `- - x`, `? ? x`, `: - x`), flow levels from brackets outside quotes and
/// comments. An upper estimate for ordinary files (a block scalar's lines are skipped),
/// linear in the text.
fn too_deep(text: &str, limit: usize) -> Option<(usize, usize, String)> {
    let message =
        || format!("the YAML nests more than {limit} levels deep (the rule files' limit)");
    let mut indents: Vec<usize> = Vec::new();
    let mut flow = 0usize;
    // A quoted scalar that goes on past the end of its line: `'` or `"`.
    let mut quote: Option<char> = None;
    // The indentation a block scalar's lines (`|`, `>`) are deeper than.
    let mut block_scalar: Option<usize> = None;
    for (number, line) in text.lines().enumerate() {
        let indent = line.len() - line.trim_start_matches(' ').len();
        let content = &line[indent..];
        if let Some(parent) = block_scalar {
            if content.is_empty() || indent > parent {
                continue;
            }
            block_scalar = None;
        }
        let mut chars = content.char_indices().peekable();
        if quote.is_none() && flow == 0 {
            if content.is_empty() || content.starts_with('#') {
                continue;
            }
            while indents.last().is_some_and(|&i| i >= indent) {
                indents.pop();
            }
            indents.push(indent);
            // `- - x`, `? ? x`, `: - x`: each indicator opens a collection inside
            // the line (a list, a mapping with a complex key, the value of one).
            while let Some(&(at, '-' | '?' | ':')) = chars.peek() {
                let next = content[at + 1..].chars().next();
                if !matches!(next, None | Some(' ' | '\t')) {
                    break;
                }
                chars.next();
                while chars.next_if(|&(_, c)| c == ' ' || c == '\t').is_some() {}
                indents.push(indent + at + 2);
            }
        }
        if indents.len() + flow > limit {
            return Some((number + 1, indent + 1, message()));
        }
        let mut previous = ' ';
        while let Some((at, c)) = chars.next() {
            match quote {
                Some('"') => match c {
                    '\\' => {
                        chars.next();
                    }
                    '"' => quote = None,
                    _ => {}
                },
                Some(_) => {
                    if c == '\'' && chars.next_if(|&(_, c)| c == '\'').is_none() {
                        quote = None;
                    }
                }
                None => match c {
                    '"' | '\'' if matches!(previous, ' ' | '\t' | '[' | '{' | ',' | ':') => {
                        quote = Some(c);
                    }
                    '#' if matches!(previous, ' ' | '\t') => break,
                    '[' | '{' => {
                        flow += 1;
                        if indents.len() + flow > limit {
                            let column = indent + content[..at].chars().count() + 1;
                            return Some((number + 1, column, message()));
                        }
                    }
                    ']' | '}' => flow = flow.saturating_sub(1),
                    '|' | '>' if flow == 0 && matches!(previous, ' ' | '\t' | ':') => {
                        // A block scalar header ends the line's structure (`key: |-`).
                        let rest = content[at + 1..].trim_end();
                        if rest.chars().all(|c| matches!(c, '-' | '+' | '0'..='9')) {
                            block_scalar = Some(indent);
                        }
                    }
                    _ => {}
                },
            }
            previous = c;
        }
    }
    None
}

/// YAML's null: a plain (unquoted) empty value, `~` or `null`.
fn is_null(scalar: &MarkedScalarNode) -> bool {
    scalar.may_coerce() && matches!(scalar.as_str(), "" | "~" | "null" | "Null" | "NULL")
}

/// The shortest `lease_period` and `sync_interval`.
const MIN_SCALE_PERIOD: Duration = Duration::from_millis(1);
/// The longest `lease_period` and `sync_interval`: units leased or counted longer ago
/// than this say little about the shared count.
const MAX_SCALE_PERIOD: Duration = Duration::from_secs(60);
/// A lease's period when the rule file gives none.
const DEFAULT_LEASE_PERIOD: Duration = Duration::from_millis(100);
/// A sync interval when the rule file gives none.
const DEFAULT_SYNC_INTERVAL: Duration = Duration::from_millis(100);

/// The counting mode a rule file names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConsistencyMode {
    Exact,
    Leased,
    Synced,
}

/// A domain's or descriptor's `consistency` settings as written: each `None` when
/// absent, taken from the level above.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DraftConsistency {
    mode: Option<ConsistencyMode>,
    lease_period: Option<Duration>,
    sync_interval: Option<Duration>,
}

impl DraftConsistency {
    /// These settings over `parent`'s: what is given here wins.
    fn over(self, parent: DraftConsistency) -> DraftConsistency {
        DraftConsistency {
            mode: self.mode.or(parent.mode),
            lease_period: self.lease_period.or(parent.lease_period),
            sync_interval: self.sync_interval.or(parent.sync_interval),
        }
    }

    /// The limit's [`Consistency`].
    fn resolve(self) -> Consistency {
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

/// A domain as read from one file, before compiling.
#[derive(Debug)]
pub(crate) struct DraftDomain {
    pub(crate) name: String,
    pub(crate) file: String,
    pub(crate) span: Span,
    pub(crate) failure: Option<FailureMode>,
    pub(crate) consistency: DraftConsistency,
    pub(crate) charge: Option<ChargeRejected>,
    pub(crate) descriptors: Vec<DraftRule>,
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

#[derive(Debug)]
pub(crate) struct DraftRule {
    key: String,
    value: Option<String>,
    span: Span,
    origin: String,
    limits: Vec<DraftRateLimit>,
    unlimited: bool,
    shadow_mode: bool,
    detailed_metric: bool,
    value_to_metric: bool,
    share_threshold: bool,
    quota_mode: bool,
    failure: Option<FailureMode>,
    charge: Option<ChargeRejected>,
    consistency: DraftConsistency,
    metadata: Option<Metadata>,
    children: Vec<DraftRule>,
}

#[derive(Debug)]
enum DraftLimit {
    Unlimited,
    Limited(Box<DraftRateLimit>),
}

#[derive(Debug)]
struct DraftRateLimit {
    span: Span,
    name: Option<String>,
    requests_per_unit: u64,
    unit: Unit,
    replaces: Vec<(String, Span)>,
    spec: LimitSpec,
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
            let divisor = match failure_mode {
                FailureMode::LocalFallback { divisor } => divisor,
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
                l.spec.consistency = consistency.resolve();
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
