//! [`RedisInFlight`]: in-flight permits shared by every instance through one Redis,
//! as leases that expire, so that an instance that crashes leaks nothing for long.
//!
//! ## Leases
//! Each key is a sorted set, `<prefix>:inflight:{<escaped key>}`. A permit is one
//! member: a lease id (this instance's random 64-bit id and a counter, unique
//! between instances with probability 1 - 2^-64 per pair) scored with the instant its
//! lease expires, in milliseconds of Redis `TIME` (so instances whose clocks disagree
//! still agree on every lease). One Lua script takes a permit atomically: it reads
//! `TIME`, drops the key's expired leases (`ZREMRANGEBYSCORE`), and adds one if fewer
//! than `max` are left (`ZCARD`, `ZADD`), keeping the key's TTL at least a lease plus
//! a second past now. Redis runs a script alone, so concurrent requests from any number
//! of instances never take more than `max` permits.
//!
//! While a permit is held, a task on the tokio runtime renews its lease every third of
//! the lease (30 s by default, so every 10 s): one small script call per held permit.
//! Dropping the permit stops the renewals and removes the lease (`ZREM`, sent from a
//! task spawned on the runtime; with no runtime left, the lease expires on its own).
//! An instance that crashes, or loses Redis, stops renewing: its leases expire within
//! one lease and the next acquire of their key drops them. A shorter lease frees a
//! crashed instance's permits sooner, at the cost of more renewals.
//!
//! ## Failures
//! Every Redis call has a deadline (20 ms by default): a call that misses it fails with
//! [`Error::Timeout`], a Redis error or an unreachable Redis with [`Error::Backend`].
//! The caller decides what that means (admit anyway or refuse). An acquire that timed
//! out may still have taken its lease in Redis: the lease is removed in the background
//! right away. A renewal that fails is retried at the next period; a permit whose lease
//! expired anyway (Redis was unreachable for a whole lease, or restarted empty) is no
//! longer counted, which is logged.
//!
//! ## Single Redis only
//! The store talks to one Redis (`redis://` or `rediss://`, through redis-rs'
//! reconnecting `ConnectionManager`); a `redis+cluster://` URL is refused with an
//! error. Key names still carry a hash tag, the escaped key between braces, so that
//! one key's set would stay in one slot.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::aio::ConnectionManager;
use redis::Script;
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use super::{InFlight, Permit};
use crate::store::redis::{redis_address, redis_failure, single_connection, RedisTls};
use crate::store::Error;

/// Takes a permit. `KEYS[1]`: the key's sorted set. `ARGV`: lease id, lease (ms),
/// max. Returns 1 when the lease was added, 0 when `max` leases are held.
const ACQUIRE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + lease, ARGV[1])
if redis.call('PTTL', KEYS[1]) < lease + 1000 then
  redis.call('PEXPIRE', KEYS[1], lease + 1000)
end
return 1
";

/// Renews a lease. `KEYS[1]`: the key's sorted set. `ARGV`: lease id, lease (ms).
/// Returns 1 when renewed, 0 when the lease is gone.
///
/// A lease past its expiry but still present is renewed: every acquire drops expired
/// leases before counting, so no acquire has counted without it.
const RENEW: &str = r"
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[1])
if redis.call('PTTL', KEYS[1]) < lease + 1000 then
  redis.call('PEXPIRE', KEYS[1], lease + 1000)
end
return 1
";

/// The longest lease (a day).
const MAX_LEASE_MS: u64 = 86_400_000;

/// Settings of a [`RedisInFlight`]; build one with [`RedisInFlight::builder`].
#[derive(Debug, Clone)]
pub struct RedisInFlightBuilder {
    url: String,
    prefix: String,
    lease: Duration,
    deadline: Duration,
    tls: Option<RedisTls>,
}

/// In-flight permits in one Redis, shared by every instance using it. See the module
/// documentation. Cheap to clone: clones share the connection.
#[derive(Clone)]
pub struct RedisInFlight {
    shared: Arc<Shared>,
}

/// What the store, its permits and their renewal tasks share.
struct Shared {
    conn: ConnectionManager,
    /// Where `conn` connects, as errors name it.
    address: String,
    acquire: Script,
    renew: Script,
    prefix: String,
    lease_ms: u64,
    deadline: Duration,
    /// This instance's random id, the first half of its lease ids.
    instance: u64,
    /// The second half.
    next: AtomicU64,
}

/// One permit of a [`RedisInFlight`]: its lease, renewed until the permit is dropped.
pub(super) struct Lease {
    shared: Arc<Shared>,
    key: String,
    id: String,
    renewal: Option<JoinHandle<()>>,
    /// The runtime the permit was taken on, to release from outside any runtime.
    runtime: Option<Handle>,
}

impl RedisInFlightBuilder {
    /// Key prefix (default `tollgate`): a key's leases live in
    /// `<prefix>:inflight:{<escaped key>}`.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long a lease lasts without renewal (default 30 s; between 1 ms and a day,
    /// in whole milliseconds): at most how long a crashed instance's permits stay taken.
    /// Held permits are renewed every third of it.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Deadline of every Redis call (default 20 ms).
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// TLS settings for a `rediss://` URL, as [`RedisStoreBuilder::tls`](crate::store::RedisStoreBuilder::tls).
    pub fn tls(mut self, tls: RedisTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Connects, lazily: the store is ready at once, and its calls fail (with
    /// [`Error::Backend`] or [`Error::Timeout`]) until Redis is reachable. Fails for a
    /// URL that is not `redis://...` or `rediss://...`, in particular for a Redis
    /// Cluster (`redis+cluster://...`), which this store does not support.
    pub async fn connect(self) -> Result<RedisInFlight, Error> {
        let url = single_redis(&self.url)?;
        let conn = single_connection(url, self.tls.as_ref())?;
        let address = redis_address(url);
        let lease_ms = u64::try_from(self.lease.as_millis())
            .unwrap_or(u64::MAX)
            .clamp(1, MAX_LEASE_MS);
        Ok(RedisInFlight {
            shared: Arc::new(Shared {
                conn,
                address,
                acquire: Script::new(ACQUIRE),
                renew: Script::new(RENEW),
                prefix: self.prefix,
                lease_ms,
                deadline: self.deadline,
                instance: random_instance_id(),
                next: AtomicU64::new(0),
            }),
        })
    }
}

/// The URL, if it names a single Redis.
fn single_redis(url: &str) -> Result<&str, Error> {
    if url.starts_with("redis+cluster://") {
        return Err(Error::backend(
            "in-flight permits need a single Redis: a Redis Cluster (`redis+cluster://`) is not supported",
        ));
    }
    if crate::store::redis::is_single_url(url) {
        return Ok(url);
    }
    Err(Error::backend(
        "not a Redis URL for in-flight permits (expected redis://host:port[/db], rediss://... or redis+unix:///path)",
    ))
}

/// A random 64-bit id for this instance, seeded from the OS like std's `HashMap`.
fn random_instance_id() -> u64 {
    use std::hash::BuildHasher;
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::collections::hash_map::RandomState::new().hash_one((nanos, std::process::id()))
}

/// `<prefix>:inflight:{<escaped key>}`. The key is percent-escaped: every byte outside
/// `A-Z a-z 0-9 - . _ ~ / @` becomes `%XX`, which is injective and leaves no brace,
/// colon or space in the tag; the empty key is tagged `%`, which escaping never
/// produces alone (and `{}` would be no hash tag for a cluster).
fn key_name(prefix: &str, key: &[u8]) -> String {
    use std::fmt::Write;
    let mut name = String::with_capacity(prefix.len() + 12 + key.len() * 3);
    name.push_str(prefix);
    name.push_str(":inflight:{");
    if key.is_empty() {
        name.push('%');
    }
    for &b in key {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'/' | b'@') {
            name.push(char::from(b));
        } else {
            // Writing to a String cannot fail.
            let _ = write!(name, "%{b:02X}");
        }
    }
    name.push('}');
    name
}

impl RedisInFlight {
    /// Settings for a store at `url`, `redis://host:port[/db]` or `rediss://...`:
    /// prefix `tollgate`, leases of 30 s, a deadline of 20 ms.
    pub fn builder(url: impl Into<String>) -> RedisInFlightBuilder {
        RedisInFlightBuilder {
            url: url.into(),
            prefix: "tollgate".into(),
            lease: Duration::from_secs(30),
            deadline: Duration::from_millis(20),
            tls: None,
        }
    }

    /// The Redis key holding the leases of `key` (a sorted set: lease id → expiry in
    /// milliseconds), for operators and tests.
    pub fn key_name(&self, key: &[u8]) -> String {
        key_name(&self.shared.prefix, key)
    }
}

impl Shared {
    fn lease_id(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("{:016x}-{n:x}", self.instance)
    }

    /// Runs `script` on the lease `id` of `key` (with `max` for acquire), within the deadline.
    async fn run(
        &self,
        script: &Script,
        key: &str,
        id: &str,
        max: Option<u64>,
    ) -> Result<i64, Error> {
        let mut invocation = script.prepare_invoke();
        invocation.key(key).arg(id).arg(self.lease_ms);
        if let Some(max) = max {
            invocation.arg(max);
        }
        let mut conn = self.conn.clone();
        match tokio::time::timeout(self.deadline, invocation.invoke_async(&mut conn)).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(e)) => Err(redis_failure(e, &self.address)),
            Err(_) => Err(Error::Timeout(self.deadline)),
        }
    }

    /// Removes the lease `id` of `key`. Nothing waits on a release, so it gets a longer
    /// deadline (at least 1 s) than a request's acquire: a release that missed 20 ms
    /// would hold the permit until its lease ran out.
    async fn release(&self, key: &str, id: &str) -> Result<(), Error> {
        let mut conn = self.conn.clone();
        let mut zrem = redis::cmd("ZREM");
        zrem.arg(key).arg(id);
        let deadline = self.deadline.max(RELEASE_DEADLINE);
        match tokio::time::timeout(deadline, zrem.query_async::<i64>(&mut conn)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(redis_failure(e, &self.address)),
            Err(_) => Err(Error::Timeout(deadline)),
        }
    }
}

/// The least deadline of a background release.
const RELEASE_DEADLINE: Duration = Duration::from_secs(1);

/// Removes a lease in the background; if that fails, the lease expires on its own.
async fn release(shared: Arc<Shared>, key: String, id: String) {
    if let Err(e) = shared.release(&key, &id).await {
        tracing::debug!(error = %e, lease = %id, "releasing an in-flight lease failed; it expires on its own");
    }
}

/// Renews a held lease every third of the lease, until aborted (the permit dropped)
/// or the lease is found gone.
async fn renew(shared: Arc<Shared>, key: String, id: String) {
    let every = Duration::from_millis((shared.lease_ms / 3).max(1));
    loop {
        tokio::time::sleep(every).await;
        match shared.run(&shared.renew, &key, &id, None).await {
            Ok(1) => {}
            Ok(_) => {
                tracing::warn!(
                    lease = %id,
                    "an in-flight lease expired while its permit was held (Redis unreachable or restarted); it is no longer counted"
                );
                return;
            }
            Err(e) => {
                tracing::debug!(error = %e, lease = %id, "renewing an in-flight lease failed; retrying");
            }
        }
    }
}

impl InFlight for RedisInFlight {
    async fn acquire(&self, key: &[u8], max: u64) -> Result<Option<Permit>, Error> {
        if max == 0 {
            return Ok(None);
        }
        let shared = &self.shared;
        let name = key_name(&shared.prefix, key);
        let id = shared.lease_id();
        match shared.run(&shared.acquire, &name, &id, Some(max)).await {
            Ok(0) => Ok(None),
            Ok(_) => Ok(Some(Permit::redis(Lease::start(
                Arc::clone(shared),
                name,
                id,
            )))),
            Err(e) => {
                if matches!(e, Error::Timeout(_)) {
                    // Redis may have added the lease after all: take it back.
                    if let Ok(runtime) = Handle::try_current() {
                        runtime.spawn(release(Arc::clone(shared), name, id));
                    }
                }
                Err(e)
            }
        }
    }
}

impl Lease {
    /// A lease just taken: starts its renewals on the current runtime.
    fn start(shared: Arc<Shared>, key: String, id: String) -> Self {
        let runtime = Handle::try_current().ok();
        let renewal = match &runtime {
            Some(r) => Some(r.spawn(renew(Arc::clone(&shared), key.clone(), id.clone()))),
            None => {
                tracing::warn!(lease = %id, "no tokio runtime: this in-flight lease is not renewed");
                None
            }
        };
        Self {
            shared,
            key,
            id,
            renewal,
            runtime,
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(renewal) = self.renewal.take() {
            renewal.abort();
        }
        // The current runtime, else the one the permit was taken on (a runtime that has
        // shut down drops the task at once: the lease then expires on its own).
        let Some(runtime) = Handle::try_current().ok().or_else(|| self.runtime.take()) else {
            tracing::debug!(lease = %self.id, "no tokio runtime to release an in-flight lease; it expires on its own");
            return;
        };
        runtime.spawn(release(
            Arc::clone(&self.shared),
            std::mem::take(&mut self.key),
            std::mem::take(&mut self.id),
        ));
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisPermit")
            .field("key", &self.key)
            .field("lease", &self.id)
            .finish()
    }
}

impl fmt::Debug for RedisInFlight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisInFlight")
            .field("prefix", &self.shared.prefix)
            .field("lease", &Duration::from_millis(self.shared.lease_ms))
            .field("deadline", &self.shared.deadline)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tricky_keys_get_distinct_names_with_one_nonempty_tag() {
        let keys: [&[u8]; 10] = [
            b"a_b",
            b"a:b",
            b"a{b}",
            b"a b",
            b"{",
            b"}",
            b"",
            b"%",
            b"a%7Bb",
            "é".as_bytes(),
        ];
        let names: Vec<String> = keys.iter().map(|k| key_name("tg", k)).collect();
        for (name, key) in names.iter().zip(keys) {
            assert!(name.is_ascii(), "{key:?} -> {name}");
            assert!(!name.contains(' '), "{key:?} -> {name}");
            assert_eq!(name.matches('{').count(), 1, "{key:?} -> {name}");
            assert_eq!(name.matches('}').count(), 1, "{key:?} -> {name}");
            let open = name.find('{').unwrap_or_default();
            let close = name.find('}').unwrap_or_default();
            assert!(close > open + 1, "`{{}}` is no hash tag: {key:?} -> {name}");
            assert!(name.starts_with("tg:inflight:{") && name.ends_with('}'));
            assert!(!name[open + 1..close].contains(':'));
        }
        let mut distinct = names.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), keys.len(), "distinct keys, distinct names");
        assert_eq!(key_name("tg", b"user-1"), "tg:inflight:{user-1}");
    }

    #[test]
    fn only_single_redis_urls() {
        assert!(single_redis("redis://127.0.0.1:6379").is_ok());
        assert!(single_redis("rediss://example:6380/2").is_ok());
        match single_redis("redis+cluster://a:1,b:2") {
            Err(Error::Backend { message, .. }) => {
                assert!(message.contains("Cluster"), "{message}")
            }
            other => panic!("a cluster URL must be refused, got {other:?}"),
        }
        assert!(single_redis("memory").is_err());
    }

    #[test]
    fn lease_ids_are_unique_per_instance() {
        let a = random_instance_id();
        let b = random_instance_id();
        assert_ne!(a, b);
    }
}
