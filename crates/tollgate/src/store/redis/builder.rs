//! [`RedisStoreBuilder`]: a [`RedisStore`]'s settings, the URLs it accepts, and
//! connecting: the connection (a single Redis's, made lazily, or a cluster's), the
//! shared state, the batchers, and the first contact that checks Redis's version.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Duration;

use super::batcher::Batchers;
use super::breaker::Breaker;
use super::client::{self, Connection};
use super::script::Scripts;
use super::warm::Warming;
use super::{RedisStore, RedisTls, Refused, Shared};
use crate::store::blocked::BlockedCache;
use crate::store::Error;

/// Where the scripts take "now" from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TimeSource {
    /// Redis `TIME`, read inside the script: every instance agrees (the default).
    #[default]
    Redis,
    /// The `now` the caller passes to [`Store::check`](crate::store::Store::check).
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
    in_flight: usize,
    tls: Option<RedisTls>,
    functions: bool,
    per_thread: bool,
}

/// Script calls in flight at once on a single Redis connection, by default: one (the
/// requests arriving meanwhile form the next batch), which measured best on loopback.
const IN_FLIGHT: usize = 1;
/// The longest TTL slack (a day): keeps every TTL a script computes a valid number.
pub(super) const MAX_SLACK_MS: u64 = 86_400_000;

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

    /// Extra time on every key's TTL (default 1 ms, at most a day). A state that is
    /// fresh again is kept for the slack too, so a clock stepping back by less than
    /// the slack still finds it. Tests that pass their own time
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

    /// Script calls in flight at once on each connection to a single Redis (default 1;
    /// see [`per_thread`](Self::per_thread) for how many connections): requests that
    /// arrive while they run are batched into the next call. More can help when Redis
    /// is far away (a long round trip); on loopback one measured best.
    pub fn in_flight(mut self, calls: usize) -> Self {
        self.in_flight = calls.max(1);
        self
    }

    /// Whether to call the scripts as Redis Functions (`FCALL`, Redis 7 and later;
    /// default true). A function library defines the scripts' code once, when it is
    /// loaded, where `EVALSHA` runs the whole script, definitions included, on every
    /// call: a request alone in its call costs Redis about two thirds as much
    /// (docs/benchmarks.md, "Redis Functions"). Where Redis has no functions (6.x) or its
    /// ACL forbids `FCALL` or `FUNCTION LOAD`, the store notices on the
    /// first call, logs it once and uses `EVALSHA` from then on. False: always `EVALSHA`.
    pub fn functions(mut self, on: bool) -> Self {
        self.functions = on;
        self
    }

    /// Whether callers on a current-thread tokio runtime get a batcher and a Redis
    /// connection of that runtime (single Redis; default true): `tollgate serve`'s
    /// workers each run one, and their requests then never cross threads on the way to
    /// Redis and back. One more connection per such runtime, opened on its first
    /// request and used once it answers a `PING` (the shared one serves until then).
    /// False: every caller shares the store's one batcher and connection, so the calls
    /// are fewer and larger. Callers on a multi-threaded runtime always share them, and
    /// so does everyone over TLS (`rediss://`: redis-rs reads the system's certificate
    /// store on each TLS connect, which would stall the runtime's thread).
    pub fn per_thread(mut self, on: bool) -> Self {
        self.per_thread = on;
        self
    }

    /// The CA to trust and the client certificate to present over TLS (`rediss://`);
    /// without it a TLS URL trusts the system's roots. Needs the `redis-tls` feature.
    pub fn tls(mut self, tls: RedisTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Connects. A single Redis connects lazily (the store works, failing per the
    /// failure policy, until Redis is reachable); a cluster needs one reachable node to
    /// learn its topology.
    pub async fn connect(self) -> Result<RedisStore, Error> {
        let mut single_url = None;
        let (conn, address) = match parse_url(&self.url)? {
            Target::Single(url) => {
                let manager = client::single(&url, self.tls.as_ref())?;
                let address = client::address(&url);
                single_url = Some(url);
                (Connection::Single(manager), address)
            }
            Target::Cluster(nodes) => {
                let address = nodes
                    .iter()
                    .map(|n| client::address(n))
                    .collect::<Vec<_>>()
                    .join(",");
                let failed = |e| client::failure(e, &address);
                let builder = redis::cluster::ClusterClientBuilder::new(nodes)
                    .connection_timeout(Duration::from_millis(250))
                    .retries(1);
                let client = client::cluster(builder, &self.url, self.tls.as_ref())?
                    .build()
                    .map_err(failed)?;
                let conn = client.get_async_connection().await.map_err(failed)?;
                (Connection::Cluster(conn), address)
            }
        };
        let shared = Arc::new(Shared {
            conn,
            scripts: Scripts::default(),
            slack_ms: u64::try_from(self.ttl_slack.as_millis())
                .unwrap_or(u64::MAX)
                .min(MAX_SLACK_MS),
            calls: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            answered_nanos: AtomicU64::new(0),
            breaker: Breaker::new(self.breaker_threshold, self.breaker_cooldown),
            errors: AtomicU64::new(0),
            functions: AtomicBool::new(self.functions),
            warming: Warming::default(),
            address,
            refused: Refused::default(),
        });
        let batchers = match (&shared.conn, single_url) {
            (Connection::Single(_), Some(url)) => Some(Batchers::start(
                Arc::clone(&shared),
                shared.conn.clone(),
                self.in_flight,
                self.per_thread.then(|| (url, self.tls.clone())),
            )),
            _ => None,
        };
        tokio::spawn(check_version(Arc::clone(&shared)));
        Ok(RedisStore {
            shared,
            batchers,
            prefix: self.prefix,
            deadline: self.deadline,
            time: self.time,
            cache: (self.blocked_cache > 0).then(|| BlockedCache::new(self.blocked_cache)),
            timeouts: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            cache_hits: AtomicU64::new(0),
        })
    }
}

impl RedisStore {
    /// Settings for a store at `url`: `redis://host:port[/db]`,
    /// `redis+cluster://host:port,host:port,...`, either over TLS (`rediss://`,
    /// `rediss+cluster://`; see [`RedisStoreBuilder::tls`]), or a Redis on this host
    /// through its Unix socket, `redis+unix:///path/to/redis.sock` (`?db=N` picks the
    /// database).
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
            in_flight: IN_FLIGHT,
            tls: None,
            functions: true,
            per_thread: true,
        }
    }
}

enum Target {
    Single(String),
    Cluster(Vec<String>),
}

/// `redis://host:port[/db]`, `rediss://...`, `redis+unix:///path` (or `unix:///path`:
/// a Redis on this host, through its Unix socket), or `redis+cluster://h1:p1,h2:p2`
/// (`rediss+cluster://` over TLS).
fn parse_url(url: &str) -> Result<Target, Error> {
    let cluster = url
        .strip_prefix("redis+cluster://")
        .map(|rest| ("redis", rest))
        .or_else(|| {
            url.strip_prefix("rediss+cluster://")
                .map(|rest| ("rediss", rest))
        });
    if let Some((scheme, rest)) = cluster {
        let nodes: Vec<String> = rest
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(|n| format!("{scheme}://{n}"))
            .collect();
        if nodes.is_empty() {
            return Err(Error::backend(format!("`{url}` names no cluster node")));
        }
        return Ok(Target::Cluster(nodes));
    }
    if client::is_single_url(url) {
        return Ok(Target::Single(url.to_string()));
    }
    Err(Error::backend(format!(
        "`{url}` is not a Redis URL (redis://host:port, rediss://host:port, redis+unix:///path or redis+cluster://host:port,host:port)"
    )))
}

/// The oldest Redis the scripts run on: `SET … KEEPTTL` came in 6.0.
const MIN_REDIS: (u32, u32) = (6, 0);

/// Asks Redis its version once, in the background, and logs an error when it is older
/// than [`MIN_REDIS`] (the scripts would then fail on every request, each answered by
/// its failure mode). A Redis not reachable yet is not waited for. This is the store's
/// first contact with Redis: it makes the lazy connection of a single Redis, and the
/// requests that miss their deadline meanwhile do not feed the circuit breaker (a
/// connection in progress is no failure of Redis; once this attempt has failed, they do).
async fn check_version(shared: Arc<Shared>) {
    let mut conn = shared.conn.clone();
    let mut cmd = redis::cmd("INFO");
    cmd.arg("server");
    let connecting = shared.warming.begin();
    let info = cmd.query_async::<String>(&mut conn);
    let info = tokio::time::timeout(Duration::from_secs(2), info).await;
    drop(connecting);
    let info = match info {
        Ok(Ok(info)) => {
            shared.refused.clear();
            info
        }
        Ok(Err(e)) => {
            // A refusal is what the requests that miss their deadline report.
            shared.failed(e);
            return;
        }
        Err(_) => return,
    };
    if let Some((version, false)) = version_supported(&info) {
        tracing::error!(
            "Redis {version} is too old: Tollgate's scripts need Redis {}.{} or later; \
             every request to it will fail and be answered by its rule's failure mode",
            MIN_REDIS.0,
            MIN_REDIS.1
        );
    }
}

/// The `redis_version` in an `INFO server` reply, and whether it is at least
/// [`MIN_REDIS`]; `None` when the reply names no version.
fn version_supported(info: &str) -> Option<(&str, bool)> {
    let version = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))?
        .trim();
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    let major = parts.next().flatten()?;
    let minor = parts.next().flatten().unwrap_or(0);
    Some((version, (major, minor) >= MIN_REDIS))
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
        assert!(matches!(
            parse_url("redis+unix:///run/redis.sock"),
            Ok(Target::Single(_))
        ));
        assert!(matches!(
            parse_url("unix:///run/redis.sock"),
            Ok(Target::Single(_))
        ));
        assert!(parse_url("memory").is_err());
        assert!(parse_url("redis+cluster://").is_err());
    }

    #[test]
    fn redis_older_than_6_0_is_named_too_old() {
        let info = |v: &str| format!("# Server\r\nredis_version:{v}\r\nredis_mode:standalone\r\n");
        assert_eq!(version_supported(&info("7.0.15")), Some(("7.0.15", true)));
        assert_eq!(version_supported(&info("6.0.0")), Some(("6.0.0", true)));
        assert_eq!(version_supported(&info("5.0.14")), Some(("5.0.14", false)));
        assert_eq!(version_supported(&info("10.2")), Some(("10.2", true)));
        assert_eq!(version_supported("# Server\r\nos:Linux\r\n"), None);
        assert_eq!(version_supported(&info("unstable")), None);
    }
}
