//! A local pre-check: what the server said of its limits, kept per partition key, so
//! that a request the server would reject is not sent.
//!
//! Each response's `RateLimit-Policy` and `RateLimit` fields tell, per policy, the quota,
//! the window, the requests left and the seconds until the quota is full again. The
//! pre-check keeps them under a key the caller chooses (by default the request's host;
//! or a header's value, such as an API key, or any function of the request), counts each
//! request it lets through against them, and, once a policy has nothing left before its
//! reset, either waits until the reset or fails fast, as the caller chose.
//!
//! It is a hint, not a limiter: other clients share the server's counters, so the server
//! stays the judge. A response replaces what the pre-check knew of its key; what it knew
//! is forgotten at each policy's reset.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderMap, HeaderName, HOST};
use http::Uri;
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::retry_after::{policies, states};

/// The most keys the pre-check remembers; past that, a new key is not learned until
/// some reset frees room.
const MAX_KEYS: usize = 10_000;

/// What to do with a request when a policy of its key has nothing left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhenExhausted {
    /// Wait until the reset, when it is at most `max` away; else fail fast.
    Wait {
        /// The longest wait.
        max: Duration,
    },
    /// Fail at once with [`Exhausted`].
    FailFast,
}

/// A request the pre-check held back: a policy of its key has nothing left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exhausted {
    /// The partition key.
    pub key: String,
    /// The policy's name.
    pub policy: String,
    /// The time left until its reset.
    pub reset: Duration,
}

impl fmt::Display for Exhausted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rate limit policy {:?} has no request left for {:?} for {:?}",
            self.policy, self.key, self.reset
        )
    }
}

impl std::error::Error for Exhausted {}

/// What the pre-check knows of one policy of a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Known {
    /// The policy's name.
    pub name: String,
    /// Its quota (`q`), when `RateLimit-Policy` named it.
    pub quota: Option<u64>,
    /// Its window in seconds (`w`), when given.
    pub window: Option<u64>,
    /// The requests left, less those let through since.
    pub remaining: u64,
    /// When it is full again.
    pub reset_at: Instant,
}

type KeyFn = dyn Fn(&Uri, &HeaderMap) -> Option<String> + Send + Sync;

/// The pre-check (share it in an `Arc`; see [`RetryLayer::precheck`]).
///
/// [`RetryLayer::precheck`]: crate::layer::RetryLayer::precheck
pub struct Precheck {
    when: WhenExhausted,
    key: Arc<KeyFn>,
    known: Mutex<HashMap<String, Vec<Known>>>,
}

impl fmt::Debug for Precheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Precheck")
            .field("when", &self.when)
            .field("keys", &self.known.lock().len())
            .finish()
    }
}

impl Precheck {
    /// A pre-check that does `when` on an exhausted policy, keyed by the request's host.
    pub fn new(when: WhenExhausted) -> Self {
        Precheck {
            when,
            key: Arc::new(host_key),
            known: Mutex::new(HashMap::new()),
        }
    }

    /// Keyed by `key` of the request's URI and headers (no key: not pre-checked).
    pub fn key_by(
        mut self,
        key: impl Fn(&Uri, &HeaderMap) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.key = Arc::new(key);
        self
    }

    /// Keyed by the host and the value of header `name` (requests without it are not
    /// pre-checked), e.g. the API key the server partitions by.
    pub fn key_by_header(self, name: HeaderName) -> Self {
        self.key_by(move |uri, headers| {
            let value = headers.get(&name)?.to_str().ok()?;
            Some(format!(
                "{} {value}",
                host_key(uri, headers).unwrap_or_default()
            ))
        })
    }

    /// What to do on an exhausted policy.
    pub fn when_exhausted(&self) -> WhenExhausted {
        self.when
    }

    /// The key of a request.
    pub fn key_of(&self, uri: &Uri, headers: &HeaderMap) -> Option<String> {
        (self.key)(uri, headers)
    }

    /// Learns `key`'s policies from a response's `headers`; a response without a
    /// `RateLimit` field (or with one that does not parse) changes nothing.
    pub fn learn(&self, key: &str, headers: &HeaderMap) {
        self.learn_at(key, headers, Instant::now());
    }

    /// [`learn`](Self::learn) at `now`.
    pub fn learn_at(&self, key: &str, headers: &HeaderMap, now: Instant) {
        let Some(states) = states(headers) else {
            return;
        };
        let policies = policies(headers).unwrap_or_default();
        let known: Vec<Known> = states
            .into_iter()
            .filter_map(|s| {
                // Without a reset there is nothing to wait for: not kept.
                let reset = s.reset?;
                let policy = policies.iter().find(|p| p.name == s.name);
                Some(Known {
                    quota: policy.map(|p| p.quota),
                    window: policy.and_then(|p| p.window),
                    remaining: s.remaining,
                    reset_at: now + Duration::from_secs(reset.min(u32::MAX.into())),
                    name: s.name,
                })
            })
            .collect();
        let mut map = self.known.lock();
        if known.is_empty() {
            map.remove(key);
            return;
        }
        if map.len() >= MAX_KEYS && !map.contains_key(key) {
            map.retain(|_, k| k.iter().any(|p| p.reset_at > now));
            if map.len() >= MAX_KEYS {
                return;
            }
        }
        map.insert(key.to_string(), known);
    }

    /// Takes one request from `key`'s policies: `Err` when one has nothing left before
    /// its reset (the one whose reset is furthest).
    pub fn try_take(&self, key: &str) -> Result<(), Exhausted> {
        self.try_take_at(key, Instant::now())
    }

    /// [`try_take`](Self::try_take) at `now`.
    pub fn try_take_at(&self, key: &str, now: Instant) -> Result<(), Exhausted> {
        let mut map = self.known.lock();
        let Some(known) = map.get_mut(key) else {
            return Ok(());
        };
        known.retain(|p| p.reset_at > now);
        if known.is_empty() {
            map.remove(key);
            return Ok(());
        }
        if let Some(p) = known
            .iter()
            .filter(|p| p.remaining == 0)
            .max_by_key(|p| p.reset_at)
        {
            return Err(Exhausted {
                key: key.to_string(),
                policy: p.name.clone(),
                reset: p.reset_at - now,
            });
        }
        for p in known.iter_mut() {
            p.remaining -= 1;
        }
        Ok(())
    }

    /// What the pre-check knows of `key` now.
    pub fn known(&self, key: &str) -> Vec<Known> {
        let now = Instant::now();
        self.known
            .lock()
            .get(key)
            .map(|k| k.iter().filter(|p| p.reset_at > now).cloned().collect())
            .unwrap_or_default()
    }
}

/// The request's host (and port): the URI's authority, else the `Host` header.
fn host_key(uri: &Uri, headers: &HeaderMap) -> Option<String> {
    if let Some(a) = uri.authority() {
        return Some(a.as_str().to_ascii_lowercase());
    }
    Some(headers.get(HOST)?.to_str().ok()?.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(policy: &str, state: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("ratelimit-policy", policy.parse().unwrap());
        h.insert("ratelimit", state.parse().unwrap());
        h
    }

    #[test]
    fn counts_down_then_holds_back_until_the_reset() {
        let pc = Precheck::new(WhenExhausted::FailFast);
        let t0 = Instant::now();
        let h = response(r#""per_user";q=10;w=60"#, r#""per_user";r=2;t=12"#);
        pc.learn_at("k", &h, t0);
        assert_eq!(pc.known("k")[0].quota, Some(10));
        assert_eq!(pc.try_take_at("k", t0), Ok(()));
        assert_eq!(pc.try_take_at("k", t0), Ok(()));
        let e = pc
            .try_take_at("k", t0 + Duration::from_secs(2))
            .unwrap_err();
        assert_eq!(e.policy, "per_user");
        assert_eq!(e.reset, Duration::from_secs(10));
        // Other keys are not held back; at the reset, neither is this one.
        assert_eq!(pc.try_take_at("other", t0), Ok(()));
        assert_eq!(pc.try_take_at("k", t0 + Duration::from_secs(12)), Ok(()));
        assert!(pc.known("k").is_empty());
    }

    #[test]
    fn the_furthest_exhausted_reset_wins_and_responses_replace() {
        let pc = Precheck::new(WhenExhausted::FailFast);
        let t0 = Instant::now();
        let h = response(
            r#""a";q=1;w=1, "b";q=5;w=60"#,
            r#""a";r=0;t=1, "b";r=0;t=40, "c";r=9;t=5"#,
        );
        pc.learn_at("k", &h, t0);
        let e = pc.try_take_at("k", t0).unwrap_err();
        assert_eq!((e.policy.as_str(), e.reset), ("b", Duration::from_secs(40)));
        // A later response that says there is room again is believed.
        pc.learn_at("k", &response(r#""b";q=5"#, r#""b";r=3;t=30"#), t0);
        assert_eq!(pc.try_take_at("k", t0), Ok(()));
        // One without the fields changes nothing; one with no reset forgets the key.
        pc.learn_at("k", &HeaderMap::new(), t0);
        assert_eq!(pc.known("k").len(), 1);
        pc.learn_at("k", &response(r#""b";q=5"#, r#""b";r=0"#), t0);
        assert!(pc.known("k").is_empty());
        // Garbage changes nothing either.
        pc.learn_at("k", &response("((", "\"b\";r=;"), t0);
        assert_eq!(pc.try_take_at("k", t0), Ok(()));
    }

    #[test]
    fn keys_by_host_or_header() {
        let pc = Precheck::new(WhenExhausted::FailFast);
        let uri: Uri = "http://API.example:8080/x".parse().unwrap();
        assert_eq!(
            pc.key_of(&uri, &HeaderMap::new()).as_deref(),
            Some("api.example:8080")
        );
        let mut h = HeaderMap::new();
        h.insert(HOST, "b.example".parse().unwrap());
        assert_eq!(
            pc.key_of(&"/x".parse().unwrap(), &h).as_deref(),
            Some("b.example")
        );
        let pc = pc.key_by_header(HeaderName::from_static("x-api-key"));
        assert_eq!(pc.key_of(&uri, &h), None);
        h.insert("x-api-key", "k1".parse().unwrap());
        assert_eq!(pc.key_of(&uri, &h).as_deref(), Some("api.example:8080 k1"));
    }
}
