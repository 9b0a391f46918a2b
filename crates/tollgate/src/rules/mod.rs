//! The rule engine: rule files in Envoy's rate limit service format (plus Tollgate's
//! extensions), validation with file, line and column, matching, and hot reload.
//!
//! ```
//! let set = tollgate::rules::from_str("api.yaml", r#"
//! domain: api
//! descriptors:
//!   - key: user
//!     rate_limit: {unit: minute, requests_per_unit: 60}
//!     descriptors:
//!       - key: path
//!         value: /upload*
//!         rate_limit: {unit: minute, requests_per_unit: 5, algorithm: sliding_window}
//! "#)?;
//! let api = set.domain("api").expect("loaded");
//! let m = api.find(&[("user", "alice"), ("path", "/upload/photo")]).expect("a rule");
//! assert_eq!(m.rule.limits[0].requests_per_unit, 5);
//! assert!(api.find(&[("user", "alice"), ("path", "/download")]).is_none());
//! # Ok::<(), tollgate::rules::ConfigErrors>(())
//! ```
//!
//! ## The format
//! A YAML document with `domain` and a tree of `descriptors`. A descriptor has `key`,
//! optional `value` (with `*` wildcards), optional `rate_limit` (`unit`,
//! `requests_per_unit`, `unlimited`, `name`, `replaces: [{name}]`), `shadow_mode`,
//! `detailed_metric`, `value_to_metric`, `share_threshold`, `quota_mode`, `metadata`,
//! `charge_rejected` and nested `descriptors`. A top-level `http` section belongs to the
//! gateway: with the `tower` feature it is read in the same load
//! ([`RuleSet::http`], [`crate::http::config`]), without it it is skipped. Any other key
//! is an error. As in Envoy's service, `descriptors:`,
//! `rate_limit:` or a flag left empty (YAML's null) is as if not given: a domain may
//! have no descriptors at all. A limit may not name itself in its own `replaces`.
//!
//! Tollgate's extensions, inside a rate limit: `algorithm` (`fixed_window` by default,
//! `sliding_window`, `sliding_log`, `token_bucket`, `gcra`, `leaky_bucket`), `burst`,
//! `mode` (`meter` or `queue`, leaky bucket only), `block_duration` (`15m`, `900s`,
//! `1h`, `1d`; at most a year), `overage_percent` (soft throttling); and on a descriptor, `rate_limits:`
//! (a list of limits that must all pass) instead of `rate_limit:`.
//!
//! `charge_rejected` (`none`, `over_limit` or `all`), on a domain or a descriptor and
//! inherited by the descriptors below until one sets its own, says what a request that
//! is not admitted still charges: `none` (the default) nothing; `over_limit` the
//! descriptors over their limit (envoyproxy/ratelimit with
//! `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=true`); `all` every descriptor
//! (envoyproxy/ratelimit's default).
//!
//! As in Envoy's service, a descriptor with `quota_mode: true` over its limit does not
//! by itself reject the request: quota-mode descriptors form groups (those naming the
//! same `backend_name` and `model_name_override` entries, else those of identical
//! entries), a group is over when any of its descriptors is, and the request is
//! rejected when a descriptor outside quota mode is over or every group is
//! ([`crate::limiter::quota_groups`]). `metadata` (any YAML map) is sent back, for the
//! descriptors that passed, in the service's response dynamic metadata.
//! YAML anchors and aliases are not supported. Where Tollgate reads a rule file
//! differently from envoyproxy/ratelimit, and why: docs/envoy.md, "Rule files".
//!
//! ## Matching
//! See [`Domain::find`]. Counters are per runtime value, except below a wildcard rule
//! with `share_threshold`, where every matching value shares one counter.

mod compile;
mod draft;
#[cfg(feature = "tower")]
pub(crate) use draft::parse_duration;
mod error;
mod failure;
mod load;
mod metadata;
mod read;
mod reload;
mod spec;
mod tree;
mod unit;
#[cfg(feature = "watch")]
mod watch;

pub use error::{ConfigError, ConfigErrors};
pub use failure::FailureMode;
pub use load::{from_str, load, rule_files, LoadOptions, DEFAULT_MAX_DEPTH};
pub use metadata::Metadata;
pub use read::MAX_MAX_DEPTH;
pub use reload::{reload_thread, summary, BeforeSwap, ReloadOutcome, Rules, RELOAD_STACK_SIZE};
pub use tree::{Borrow, Domain, Match, Pool, Priority, Rule, RuleId, RuleLimit, RuleSet};
pub use unit::Unit;
#[cfg(all(feature = "watch", unix))]
pub use watch::reload_on_sighup;
#[cfg(feature = "watch")]
pub use watch::{watch, Watcher};
