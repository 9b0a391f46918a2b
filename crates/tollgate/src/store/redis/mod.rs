//! [`RedisStore`]: limits shared by any number of instances through one Redis or a
//! Redis Cluster, decided atomically by Lua scripts that mirror the pure algorithms.
//!
//! ## One round trip, all or nothing
//! A request's checks go to Redis in one `EVALSHA` (see [`script`](self) and
//! `lua/driver.lua`): every check is decided in order, and if one not in shadow mode is
//! rejected, every charge the request made is taken back before the script returns,
//! exactly as [`MemoryStore`](super::MemoryStore) does. Redis runs a script alone, so
//! concurrent requests from any number of instances never lose an update.
//!
//! ## Time
//! By default the script reads Redis `TIME`, so instances whose clocks disagree still
//! agree on every key; stored instants never move back (each algorithm keeps a stored
//! window or instant that is later than "now"). [`TimeSource::Caller`] passes the
//! caller's `now` instead (tests, and single-writer setups).
//!
//! ## Exactness
//! The scripts compute with integers in doubles, exact below 2^53. For each limit the
//! store picks the finest tick (1 ns, 1 us, 1 ms) at which window, lockout and the
//! buckets' `burst x window / gcd(limit, window)` stay below 2^51: at 1 ns (every rule
//! up to a day, and most up to 26 days) the scripts decide exactly what the pure
//! algorithms decide, which differential tests check on random traces; at a coarser
//! tick, "now" is truncated to that tick.
//!
//! ## Keys
//! `<prefix>:{<escaped runtime key>}:<limit id>` (see `keys.rs`); every key has a TTL
//! just past the instant its state becomes fresh again (plus a slack, 1 ms by default).
//!
//! ## Redis Cluster
//! The hash tag is the descriptor's escaped runtime key, so one descriptor's limits
//! share a slot and are decided in one script call. A request spanning several slots
//! is sent as one call per slot (concurrently): each call is all-or-nothing, but a
//! request rejected in one slot keeps what it was charged in another (stricter, never
//! looser).
//!
//! ## Failures
//! Every call has a deadline (20 ms by default); a timeout, an error or an open circuit
//! comes back as a [`store::Error`](super::Error), and the [`Limiter`](crate::limiter::Limiter)
//! applies the rule's failure mode. After `breaker_threshold` consecutive failures the
//! circuit opens and calls fail at once; every `breaker_cooldown` one probe goes
//! through, and a success closes it. The connection is one multiplexed connection
//! (redis-rs `ConnectionManager`, or its cluster equivalent) shared by every request,
//! reconnecting with backoff.
//!
//! ## Blocked-key cache
//! A rejection with a known retry time is remembered locally (see `blocked.rs`): the
//! same key is rejected without a round trip until then, with
//! [`Decision::from_cache`] set.

mod breaker;
mod keys;
mod script;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;

use super::blocked::BlockedCache;
use super::{Check, Error, Store};
use crate::clock::{Nanos, NANOS_PER_SEC};
use crate::decision::Decision;
use breaker::Breaker;
use keys::KeyNames;
use script::{Encoded, Scripts, FIELDS};

/// Where the scripts take "now" from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TimeSource {
    /// Redis `TIME`, read inside the script: every instance agrees (the default).
    #[default]
    Redis,
    /// The `now` the caller passes to [`Store::check`].
    Caller,
}

/// Settings of a [`RedisStore`]; build one with [`RedisStore::builder`].
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    url: String,
    prefix: String,
    deadline: Duration,
    time: TimeSource,
    ttl_slack: Duration,
    breaker_threshold: u32,
    breaker_cooldown: Duration,
    blocked_cache: usize,
}

/// Counters kept by a [`RedisStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RedisStoreStats {
    /// Script calls sent to Redis.
    pub calls: u64,
    /// Calls that failed (error or no answer).
    pub errors: u64,
    /// Of those, calls that missed their deadline.
    pub timeouts: u64,
    /// Requests refused at once because the circuit was open.
    pub circuit_open: u64,
    /// How many times the circuit opened.
    pub circuit_opened: u64,
    /// Checks answered from the blocked-key cache.
    pub cache_hits: u64,
    /// True while the circuit is open.
    pub open_now: bool,
}

/// A [`Store`] in Redis or Redis Cluster. See the module documentation.
pub struct RedisStore {
    conn: Connection,
    prefix: String,
    deadline: Duration,
    time: TimeSource,
    slack_ms: u64,
    breaker: Breaker,
    cache: Option<BlockedCache>,
    scripts: Scripts,
    calls: AtomicU64,
    errors: AtomicU64,
    timeouts: AtomicU64,
    refused: AtomicU64,
    cache_hits: AtomicU64,
}

#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl RedisStoreBuilder {
    /// Key prefix (default `tollgate`).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Deadline of every Redis call (default 20 ms).
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// Where "now" comes from (default [`TimeSource::Redis`]).
    pub fn time_source(mut self, time: TimeSource) -> Self {
        self.time = time;
        self
    }

    /// Extra time on every key's TTL (default 1 ms). Tests that pass their own time
    /// use a long slack so that Redis does not expire keys by its own clock first.
    pub fn ttl_slack(mut self, slack: Duration) -> Self {
        self.ttl_slack = slack;
        self
    }

    /// Consecutive failures that open the circuit (default 5), and how long it stays
    /// open before a probe (default 250 ms).
    pub fn circuit_breaker(mut self, threshold: u32, cooldown: Duration) -> Self {
        self.breaker_threshold = threshold;
        self.breaker_cooldown = cooldown;
        self
    }

    /// Capacity of the blocked-key cache (default 100 000 keys; 0 turns it off).
    pub fn blocked_cache(mut self, capacity: usize) -> Self {
        self.blocked_cache = capacity;
        self
    }

    /// Connects. A single Redis connects lazily (the store works, failing per the
    /// failure policy, until Redis is reachable); a cluster needs one reachable node to
    /// learn its topology.
    pub async fn connect(self) -> Result<RedisStore, Error> {
        let backend = |e: redis::RedisError| Error::Backend(e.to_string());
        let conn = match parse_url(&self.url)? {
            Target::Single(url) => {
                let client = redis::Client::open(url).map_err(backend)?;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(Duration::from_millis(250)))
                    .set_min_delay(Duration::from_millis(10))
                    .set_max_delay(Duration::from_millis(250))
                    .set_number_of_retries(3);
                let manager =
                    ConnectionManager::new_lazy_with_config(client, config).map_err(backend)?;
                Connection::Single(manager)
            }
            Target::Cluster(nodes) => {
                let client = redis::cluster::ClusterClientBuilder::new(nodes)
                    .connection_timeout(Duration::from_millis(250))
                    .retries(1)
                    .build()
                    .map_err(backend)?;
                let conn = client.get_async_connection().await.map_err(backend)?;
                Connection::Cluster(conn)
            }
        };
        Ok(RedisStore {
            conn,
            prefix: self.prefix,
            deadline: self.deadline,
            time: self.time,
            slack_ms: u64::try_from(self.ttl_slack.as_millis()).unwrap_or(u64::MAX),
            breaker: Breaker::new(self.breaker_threshold, self.breaker_cooldown),
            cache: (self.blocked_cache > 0).then(|| BlockedCache::new(self.blocked_cache)),
            scripts: Scripts::default(),
            calls: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            cache_hits: AtomicU64::new(0),
        })
    }
}

enum Target {
    Single(String),
    Cluster(Vec<String>),
}

/// `redis://host:port[/db]`, `rediss://...`, or `redis+cluster://h1:p1,h2:p2`.
fn parse_url(url: &str) -> Result<Target, Error> {
    if let Some(rest) = url.strip_prefix("redis+cluster://") {
        let nodes: Vec<String> = rest
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(|n| format!("redis://{n}"))
            .collect();
        if nodes.is_empty() {
            return Err(Error::Backend(format!("`{url}` names no cluster node")));
        }
        return Ok(Target::Cluster(nodes));
    }
    if url.starts_with("redis://") || url.starts_with("rediss://") {
        return Ok(Target::Single(url.to_string()));
    }
    Err(Error::Backend(format!(
        "`{url}` is not a Redis URL (redis://host:port or redis+cluster://host:port,host:port)"
    )))
}

impl RedisStore {
    /// Settings for a store at `url`: `redis://host:port[/db]` or
    /// `redis+cluster://host:port,host:port,...`.
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url: url.into(),
            prefix: "tollgate".into(),
            deadline: Duration::from_millis(20),
            time: TimeSource::Redis,
            ttl_slack: Duration::from_millis(1),
            breaker_threshold: 5,
            breaker_cooldown: Duration::from_millis(250),
            blocked_cache: 100_000,
        }
    }

    /// The store's counters.
    pub fn stats(&self) -> RedisStoreStats {
        RedisStoreStats {
            calls: self.calls.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            timeouts: self.timeouts.load(Ordering::Relaxed),
            circuit_open: self.refused.load(Ordering::Relaxed),
            circuit_opened: self.breaker.times_opened(),
            cache_hits: self.cache_hits.load(Ordering::Relaxed),
            open_now: self.breaker.is_open(),
        }
    }

    /// True for a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.conn, Connection::Cluster(_))
    }

    async fn decide(&self, now: Nanos, checks: &[Check<'_>]) -> Result<Vec<Decision>, Error> {
        let mut encoded = Vec::with_capacity(checks.len());
        for c in checks {
            encoded.push(Encoded::new(c.limit).map_err(|e| Error::Backend(e.to_string()))?);
        }
        let names: Vec<KeyNames> = checks
            .iter()
            .map(|c| KeyNames::new(&self.prefix, c.limit.id(), c.key))
            .collect();
        let groups = self.groups(&names);
        if !self.breaker.permit() {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(Error::CircuitOpen);
        }
        let calls = groups
            .iter()
            .map(|group| self.call(now, checks, &encoded, &names, group));
        let replies = futures_util::future::join_all(calls).await;
        let mut decisions = vec![Decision::default(); checks.len()];
        for (group, reply) in groups.iter().zip(replies) {
            let values = match reply {
                Ok(v) => v,
                Err(e) => {
                    self.breaker.failure();
                    return Err(e);
                }
            };
            if values.len() != group.len() * 5 {
                self.breaker.failure();
                return Err(Error::Backend(format!(
                    "the script answered {} values for {} checks",
                    values.len(),
                    group.len()
                )));
            }
            for (&i, v) in group.iter().zip(values.chunks_exact(5)) {
                decisions[i] = encoded[i].decode(checks[i].limit.limit(), v);
            }
        }
        self.breaker.success();
        Ok(decisions)
    }

    /// Check indexes per script call: all in one, or per hash tag on a cluster.
    fn groups(&self, names: &[KeyNames]) -> Vec<Vec<usize>> {
        if !self.is_cluster() {
            return vec![(0..names.len()).collect()];
        }
        let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
        for (i, n) in names.iter().enumerate() {
            match groups.iter_mut().find(|g| g.0 == n.tag) {
                Some(g) => g.1.push(i),
                None => groups.push((&n.tag, vec![i])),
            }
        }
        groups.into_iter().map(|g| g.1).collect()
    }

    async fn call(
        &self,
        now: Nanos,
        checks: &[Check<'_>],
        encoded: &[Encoded],
        names: &[KeyNames],
        group: &[usize],
    ) -> Result<Vec<i64>, Error> {
        let mask = group
            .iter()
            .fold(0u8, |m, &i| m | 1 << (encoded[i].alg - 1));
        let mut invocation = self.scripts.get(mask).prepare_invoke();
        match self.time {
            TimeSource::Redis => invocation.arg("").arg(""),
            TimeSource::Caller => invocation.arg(now / NANOS_PER_SEC).arg(now % NANOS_PER_SEC),
        };
        invocation.arg(self.slack_ms).arg(group.len());
        let mut args = Vec::with_capacity(group.len() * FIELDS);
        for &i in group {
            let (e, n) = (&encoded[i], &names[i]);
            e.push_args(&checks[i], &mut args);
            invocation.key(&n.state);
            if e.alg == 3 {
                invocation.key(n.meta());
            }
            if e.lockout > 0 {
                invocation.key(n.lockout());
            }
        }
        invocation.arg(args);
        self.calls.fetch_add(1, Ordering::Relaxed);
        let mut conn = self.conn.clone();
        let result = tokio::time::timeout(self.deadline, invocation.invoke_async(&mut conn)).await;
        match result {
            Ok(Ok(values)) => Ok(values),
            Ok(Err(e)) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                Err(Error::Backend(e.to_string()))
            }
            Err(_) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                self.timeouts.fetch_add(1, Ordering::Relaxed);
                Err(Error::Timeout(self.deadline))
            }
        }
    }
}

impl Store for RedisStore {
    async fn check(&self, now: Nanos, checks: &[Check<'_>]) -> Result<Vec<Decision>, Error> {
        let Some(cache) = &self.cache else {
            return self.decide(now, checks).await;
        };
        let cached: Vec<Option<Decision>> = checks.iter().map(|c| cache.lookup(c, now)).collect();
        let hits = cached.iter().filter(|d| d.is_some()).count();
        if hits == 0 {
            let decisions = self.decide(now, checks).await?;
            for (c, d) in checks.iter().zip(&decisions) {
                cache.remember(c, d, now);
            }
            return Ok(decisions);
        }
        self.cache_hits.fetch_add(hits as u64, Ordering::Relaxed);
        // The request is rejected: the other checks are only looked at, not charged.
        let rest: Vec<usize> = (0..checks.len()).filter(|&i| cached[i].is_none()).collect();
        let mut decisions: Vec<Decision> =
            cached.into_iter().map(Option::unwrap_or_default).collect();
        if !rest.is_empty() {
            let peeks: Vec<Check<'_>> = rest
                .iter()
                .map(|&i| Check {
                    cost: 0,
                    ..checks[i]
                })
                .collect();
            for (i, d) in rest.into_iter().zip(self.decide(now, &peeks).await?) {
                decisions[i] = d;
            }
        }
        Ok(decisions)
    }
}

impl Connection {
    fn inner(&mut self) -> &mut dyn ConnectionLike {
        match self {
            Connection::Single(c) => c,
            Connection::Cluster(c) => c,
        }
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        self.inner().req_packed_command(cmd)
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        self.inner().req_packed_commands(cmd, offset, count)
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(c) => c.get_db(),
            Connection::Cluster(c) => c.get_db(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_a_single_redis_or_a_cluster() {
        assert!(matches!(
            parse_url("redis://127.0.0.1:6379"),
            Ok(Target::Single(_))
        ));
        match parse_url("redis+cluster://a:1, b:2") {
            Ok(Target::Cluster(n)) => assert_eq!(n, ["redis://a:1", "redis://b:2"]),
            _ => panic!("a cluster URL"),
        }
        assert!(parse_url("memory").is_err());
        assert!(parse_url("redis+cluster://").is_err());
    }
}
