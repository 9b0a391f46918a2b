//! The request a front end hands the [`Limiter`](super::Limiter): its domain, its
//! descriptors and their costs, and the sizes every front end refuses beyond
//! ([`RequestLimits`], [`RateLimitRequest::validate`]).

use super::Error;
use crate::rules::Unit;

/// A request: a domain and descriptors, each a list of (key, value) entries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RateLimitRequest {
    /// The rule domain.
    pub domain: String,
    /// The descriptors; each is limited on its own and the request is all-or-nothing.
    pub descriptors: Vec<Descriptor>,
    /// Cost of the request for every descriptor without its own; 0 means 1.
    pub hits_addend: u64,
}

/// One descriptor of a request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Descriptor {
    /// The (key, value) entries, outermost first.
    pub entries: Vec<(String, String)>,
    /// Replaces the configured numbers for this request: the rule's counter when the unit is
    /// the rule's, else a counter of this descriptor and unit (as Envoy's service counts).
    pub limit: Option<LimitOverride>,
    /// This descriptor's cost; overrides the request's. `Some(0)` checks without charging.
    pub hits_addend: Option<u64>,
}

/// A request's own numbers for a descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitOverride {
    /// Requests per unit.
    pub requests_per_unit: u64,
    /// The unit.
    pub unit: Unit,
}

/// How large a request may be: what [`RateLimitRequest::validate`] refuses beyond
/// (INVALID_ARGUMENT / 400), so that no single call can cost a worker more than a
/// bounded amount of work or make an answer of unbounded size.
///
/// The defaults are above what Envoy sends: one descriptor per `rate_limits` action
/// list of a route (a handful in practice), one entry per action, and values no longer
/// than Envoy's own limit on a request's headers (`max_request_headers_kb`, 60 KiB by
/// default), so that a request Envoy makes is never refused (Envoy's filter would then
/// let it through by `failure_mode_deny: false`, its default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// Most descriptors in one request (`--max-descriptors`; default 64).
    pub max_descriptors: usize,
    /// Most entries in one descriptor (`--max-entries`; default 32).
    pub max_entries: usize,
    /// Most bytes in one entry's key, and in its value (`--max-entry-bytes`; default
    /// 65,536).
    pub max_entry_bytes: usize,
}

impl RequestLimits {
    /// Default of [`max_descriptors`](Self::max_descriptors).
    pub const DEFAULT_MAX_DESCRIPTORS: usize = 64;
    /// Default of [`max_entries`](Self::max_entries).
    pub const DEFAULT_MAX_ENTRIES: usize = 32;
    /// Default of [`max_entry_bytes`](Self::max_entry_bytes).
    pub const DEFAULT_MAX_ENTRY_BYTES: usize = 64 << 10;

    /// `Err` once a request has more than [`max_descriptors`](Self::max_descriptors):
    /// `count` is how many it has (or has so far, for a decoder that stops there).
    pub fn check_descriptor_count(&self, count: usize) -> Result<(), Error> {
        if count > self.max_descriptors {
            return Err(Error::InvalidRequest(format!(
                "a request may carry at most {} descriptors (--max-descriptors)",
                self.max_descriptors
            )));
        }
        Ok(())
    }

    /// `Err` once descriptor `i` has more than [`max_entries`](Self::max_entries):
    /// `count` is how many it has (or has so far).
    pub fn check_entry_count(&self, i: usize, count: usize) -> Result<(), Error> {
        if count > self.max_entries {
            return Err(Error::InvalidRequest(format!(
                "descriptor {i}: a descriptor may carry at most {} entries (--max-entries)",
                self.max_entries
            )));
        }
        Ok(())
    }

    /// `Err` when entry `j` of descriptor `i` has a key or a value longer than
    /// [`max_entry_bytes`](Self::max_entry_bytes).
    pub fn check_entry(&self, i: usize, j: usize, key: &str, value: &str) -> Result<(), Error> {
        for (what, text) in [("key", key), ("value", value)] {
            if text.len() > self.max_entry_bytes {
                return Err(Error::InvalidRequest(format!(
                    "descriptor {i}, entry {j}: the {what} is {} bytes; a key or value may be \
                     at most {} bytes (--max-entry-bytes)",
                    text.len(),
                    self.max_entry_bytes
                )));
            }
        }
        Ok(())
    }

    /// Checks the sizes of `descriptors` (each given by its entries) in the order a
    /// decoder reads them: descriptor by descriptor, the count of descriptors first,
    /// then each entry's count and lengths. The first size over a limit is reported,
    /// so a decoder that stops at it and a check of the whole request agree.
    pub fn check_sizes<'a, E>(&self, descriptors: impl IntoIterator<Item = E>) -> Result<(), Error>
    where
        E: IntoIterator<Item = (&'a str, &'a str)>,
    {
        for (i, entries) in descriptors.into_iter().enumerate() {
            self.check_descriptor_count(i + 1)?;
            for (j, (key, value)) in entries.into_iter().enumerate() {
                self.check_entry_count(i, j + 1)?;
                self.check_entry(i, j, key, value)?;
            }
        }
        Ok(())
    }
}

impl Default for RequestLimits {
    /// 64 descriptors of 32 entries, keys and values of at most 64 KiB.
    fn default() -> Self {
        Self {
            max_descriptors: Self::DEFAULT_MAX_DESCRIPTORS,
            max_entries: Self::DEFAULT_MAX_ENTRIES,
            max_entry_bytes: Self::DEFAULT_MAX_ENTRY_BYTES,
        }
    }
}

impl RateLimitRequest {
    /// A request on `domain` with one descriptor per item of `descriptors`, cost 1.
    pub fn new<K, V, D>(domain: &str, descriptors: impl IntoIterator<Item = D>) -> Self
    where
        K: Into<String>,
        V: Into<String>,
        D: IntoIterator<Item = (K, V)>,
    {
        Self {
            domain: domain.to_string(),
            descriptors: descriptors
                .into_iter()
                .map(|d| Descriptor {
                    entries: d.into_iter().map(|(k, v)| (k.into(), v.into())).collect(),
                    ..Descriptor::default()
                })
                .collect(),
            hits_addend: 0,
        }
    }

    /// Checks what every front end must refuse: an empty domain, no descriptors (with
    /// Envoy's service's words), a request larger than `limits` allow (the first size
    /// over a limit, in [`RequestLimits::check_sizes`]'s order), an entry with an empty
    /// key. A descriptor without entries is not refused: no rule matches it, and it is
    /// answered OK with no limit, as Envoy's service answers it.
    pub fn validate(&self, limits: &RequestLimits) -> Result<(), Error> {
        if self.domain.is_empty() {
            return Err(Error::InvalidRequest(
                "rate limit domain must not be empty".into(),
            ));
        }
        if self.descriptors.is_empty() {
            return Err(Error::InvalidRequest(
                "rate limit descriptor list must not be empty".into(),
            ));
        }
        limits.check_sizes(
            self.descriptors
                .iter()
                .map(|d| d.entries.iter().map(|(k, v)| (k.as_str(), v.as_str()))),
        )?;
        for (i, d) in self.descriptors.iter().enumerate() {
            if let Some(j) = d.entries.iter().position(|(k, _)| k.is_empty()) {
                return Err(Error::InvalidRequest(format!(
                    "descriptor {i}, entry {j} has an empty key"
                )));
            }
        }
        Ok(())
    }
}
