//! [`RedisStore`]: limits shared by any number of instances through one Redis or a
//! Redis Cluster, decided atomically by Lua scripts that mirror the pure algorithms.
//!
//! ## One round trip, all or nothing
//! A request's checks go to Redis in one script call (see `script.rs`, `lua/call.lua`
//! and `lua/driver.lua`): `FCALL` of a Redis Functions library on Redis 7 and later
//! (the library defines the code once, when it is loaded), `EVALSHA` where Redis has no
//! functions or its ACL forbids them ([`RedisStoreBuilder::functions`]). Every check is
//! decided in order, and if one not in shadow mode is
//! rejected, every charge the request made is taken back before the script returns,
//! exactly as [`MemoryStore`](super::MemoryStore) does. Redis runs a script alone, so
//! concurrent requests from any number of instances never lose an update.
//!
//! A request of one check without lockout (the usual case) takes its algorithm's
//! short path in the script (`ALONE`: no undo log, few or no tables; the sliding log
//! has none), which decides and writes exactly what the general path would; the
//! differential tests run both.
//!
//! On a single Redis, concurrent requests share script calls: a batcher task sends
//! every request waiting when its call in flight returns (up to 128 per call),
//! and the script decides them one after another, each all or nothing on its own. A
//! lone request goes at once; under load the script's fixed cost, Redis's system calls
//! and ours are shared by the batch. A caller on a current-thread runtime (each worker
//! of `tollgate serve`) has a batcher and a connection of its own thread, so its
//! requests never cross threads; other callers share one (`batcher.rs`,
//! [`RedisStoreBuilder::per_thread`]).
//!
//! ## Time
//! By default the script reads Redis `TIME`, so instances whose clocks disagree still
//! agree on every key; stored instants never move back (each algorithm keeps a stored
//! window or instant that is later than "now"). [`TimeSource::Caller`] passes the
//! caller's `now` instead (tests, and single-writer setups).
//!
//! ## Exactness
//! The scripts compute with integers in doubles, exact below 2^53. For each limit the
//! store picks the finest tick (1 ns, 1 us, 1 ms, 1 s) at which window, lockout and the
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
//! share a slot and are decided in one script call (not batched with other requests).
//! A request spanning several slots is sent as one call per slot, concurrently. Each
//! call decides its checks all or nothing and answers, besides the decisions, a
//! *receipt* of what it changed: per key, its value before and after the call (for a
//! sliding log, its meta, last entry and length, and the entries it trimmed). When a
//! check not in shadow mode is rejected in one slot (that call has already taken back
//! its own charges), every other slot that changed something gets a second call, the
//! refund, with its receipt (`lua/driver.lua`, `refund_request`):
//! - a key still holding exactly the value the charge left is put back as the charge
//!   found it: the single-Redis undo, exact;
//! - a key that other requests have changed since loses this request's charge only,
//!   by its algorithm's `REFUND` (in its Lua file): never more than the request took,
//!   and never below what the key would hold without it. The fixed window counts
//!   down, if the stored window is still the one charged. The sliding window takes the
//!   cost off the aligned window's count it went into (the current one, or the
//!   previous one once the aligned window has moved on) and off the sub-window it went
//!   into; that sub-window's last admission stays where the charge moved it. The
//!   sliding log takes the cost off the entry at the charge's instant (removing it if
//!   nothing else is left in it) and off the meta's total; entries the request trimmed
//!   stay trimmed, and the meta's end (the reported `reset_after`) stays. The token
//!   bucket, GCRA and the leaky bucket move their exact instant back by
//!   `cost x window / limit`, but by no more than the charge still holds at the
//!   refund's "now" (its instant minus now): others' charges since, each made at or
//!   before that "now", only add on top of it. (Under [`TimeSource::Caller`] the
//!   refund's "now" is the request's.)
//!
//! Lockouts started by the rejected request stay, as everywhere. The refund then decides
//! the checks its slot had admitted again with cost 0 and answers them, so they report
//! their uncharged `remaining`, as on a single Redis.
//!
//! So a request spanning slots is answered as a single Redis answers it and leaves the
//! same state, except:
//! - between a slot's two calls (a round trip), its charge is visible: a concurrent
//!   request on the same key sees less room, and may be rejected where a single Redis
//!   would have admitted it (stricter, never looser);
//! - after a refund of a key others changed in between, the sliding window's
//!   sub-window keeps its later last admission (holding that sub-window's other
//!   admissions longer), a bucket gives back only the part of the charge still ahead
//!   of the refund's "now", and a sliding log keeps its trimming and its meta's end:
//!   each stricter or the same;
//! - under Redis `TIME`, the refunded checks' answers are decided at the refund's time
//!   on that master, a round trip after the first;
//! - a refund that fails or answers after the request's deadline leaves the charge in
//!   place (stricter) and its checks answered as charged; it is sent as a task of its
//!   own, so it still takes effect when it arrives late. A request one of whose calls
//!   fails is answered by its rules' failure modes, and what the other calls charged
//!   stays.
//!
//! The differential tests run their random traces on a 3-master cluster too, with the
//! two keys on two masters, and require the in-memory store's decisions.
//!
//! The cost falls on requests spanning slots only: their calls read each key they
//! change before and after, for the receipt (a lone check still takes its fast path;
//! several checks in a slot record their undo log, as they do on a single Redis), and
//! answer it; the extra call per slot comes only when another slot rejects. Requests within one slot,
//! and every request on a single Redis, are decided exactly as before.
//!
//! ## Failures
//! Every call has a deadline (20 ms by default); a timeout, an error or an open circuit
//! comes back as a [`store::Error`](super::Error), and the [`Limiter`](crate::limiter::Limiter)
//! applies the rule's failure mode. After `breaker_threshold` consecutive failures the
//! circuit opens and calls fail at once; every `breaker_cooldown` one probe goes
//! through, and a success closes it. The breaker counts failed script calls (not each
//! request of a failed batch) and requests that missed their deadline. A request
//! still queued when its deadline passes is dropped, never charged late; one whose
//! checks make the script fail (a key of the wrong type) fails alone. Each connection is
//! a multiplexed one (redis-rs `ConnectionManager`, or its cluster equivalent),
//! reconnecting with backoff: one shared by every request on a multi-threaded runtime,
//! plus one per current-thread runtime's thread that calls the store.
//!
//! ## Blocked-key cache
//! A rejection with a known retry time is remembered locally (see `blocked.rs`): the
//! same key is rejected without a round trip until then, with
//! [`Decision::from_cache`] set.

mod batcher;
mod breaker;
mod client;
mod keys;
mod libraries;
mod script;
mod warm;

pub(crate) use client::single as single_connection;
pub use client::{is_single_url, RedisTls};
pub use warm::{Loaded, ScriptSet};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;

use super::blocked::BlockedCache;
use super::{Check, Error, Store};
use crate::clock::{Nanos, NANOS_PER_SEC};
use crate::decision::Decision;
use batcher::Batchers;
use breaker::Breaker;
use keys::KeyNames;
use script::{pack, Encoded, Scripts, CHECK_BYTES, FAILED};
use warm::Warming;

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
    in_flight: usize,
    tls: Option<RedisTls>,
    functions: bool,
    per_thread: bool,
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
    shared: Arc<Shared>,
    /// The batchers (single Redis only).
    batchers: Option<Batchers>,
    prefix: String,
    deadline: Duration,
    time: TimeSource,
    cache: Option<BlockedCache>,
    timeouts: AtomicU64,
    refused: AtomicU64,
    cache_hits: AtomicU64,
}

/// What the batcher and direct calls share.
struct Shared {
    conn: Connection,
    scripts: Scripts,
    slack_ms: u64,
    calls: AtomicU64,
    /// Fed once per script call (a batch of 128 failing together is one failure) and
    /// once per request that misses its deadline.
    breaker: Breaker,
    /// Script calls that failed.
    errors: AtomicU64,
    /// Whether calls go through Redis Functions (`FCALL`); cleared for good when Redis
    /// has none or forbids them, and calls then use `EVALSHA`.
    functions: AtomicBool,
    /// Script loads and the first connection in progress: a request that waits across
    /// one and misses its deadline does not feed `breaker`.
    warming: Warming,
}

#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// One request's part of a script call: its packed `ARGV` argument and its `KEYS`.
#[derive(Debug)]
struct Request {
    mask: u8,
    args: Vec<u8>,
    keys: Vec<String>,
    checks: usize,
    /// The receipt a refund call takes back (the `ARGV` after the request's; a refund
    /// is alone in its call).
    receipt: Option<Vec<u8>>,
}

/// What a script call answers: five integers per check and, for a call that asked for
/// one (a Redis Cluster's, [`RECEIPT`]), the receipt of what it charged.
struct Reply {
    answers: Vec<i64>,
    receipt: Option<Vec<u8>>,
}

/// Time mode flags of a request's packed argument (`lua/call.lua`): already rejected
/// (by the blocked-key cache), so decided and taken back.
const FORCED: u64 = 2;
/// Answer the receipt of what the request charged (Redis Cluster, a request spanning
/// slots).
const RECEIPT: u64 = 4;
/// Take back what the request charged, from the receipt its call answered.
const REFUND: u64 = 8;

/// Script calls in flight at once on a single Redis connection, by default: one (the
/// requests arriving meanwhile form the next batch), which measured best on loopback.
const IN_FLIGHT: usize = 1;
/// The longest TTL slack (a day): keeps every TTL a script computes a valid number.
const MAX_SLACK_MS: u64 = 86_400_000;

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
    /// loaded, where `EVALSHA` runs the whole script on every call: about 35,000 to
    /// 40,000 Redis instructions less per call (`tools/bench-lua.sh`). Where Redis has no functions
    /// (6.x) or its ACL forbids `FCALL` or `FUNCTION LOAD`, the store notices on the
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
        let backend = |e: redis::RedisError| Error::Backend(e.to_string());
        let mut single_url = None;
        let conn = match parse_url(&self.url)? {
            Target::Single(url) => {
                let manager = client::single(&url, self.tls.as_ref()).map_err(Error::Backend)?;
                single_url = Some(url);
                Connection::Single(manager)
            }
            Target::Cluster(nodes) => {
                let builder = redis::cluster::ClusterClientBuilder::new(nodes)
                    .connection_timeout(Duration::from_millis(250))
                    .retries(1);
                let client = client::cluster(builder, &self.url, self.tls.as_ref())
                    .map_err(Error::Backend)?
                    .build()
                    .map_err(backend)?;
                let conn = client.get_async_connection().await.map_err(backend)?;
                Connection::Cluster(conn)
            }
        };
        let shared = Arc::new(Shared {
            conn,
            scripts: Scripts::default(),
            slack_ms: u64::try_from(self.ttl_slack.as_millis())
                .unwrap_or(u64::MAX)
                .min(MAX_SLACK_MS),
            calls: AtomicU64::new(0),
            breaker: Breaker::new(self.breaker_threshold, self.breaker_cooldown),
            errors: AtomicU64::new(0),
            functions: AtomicBool::new(self.functions),
            warming: Warming::default(),
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

/// The Lua source of the script a request using these algorithms runs (names as in
/// rule files: `fixed_window`, `sliding_window`, `sliding_log`, `token_bucket`, `gcra`,
/// `leaky_bucket`), to review it or to pre-load it with `SCRIPT LOAD`.
pub fn script_source(algorithms: &[&str]) -> Result<String, String> {
    Ok(script::source(algorithm_mask(algorithms)?))
}

/// The same script as a Redis Functions library, as the store loads it on Redis 7 and
/// later: the function's name (also the library's) and the library's source, for
/// `FUNCTION LOAD` and `FCALL name numkeys keys... args...`.
pub fn script_library(algorithms: &[&str]) -> Result<(String, String), String> {
    let built = script::Built::new(algorithm_mask(algorithms)?);
    Ok((built.function, built.library))
}

/// The algorithms the scripts implement, as rule files name them, in the order of their
/// codes in the scripts: what [`script_source`] and [`script_library`] accept.
pub const SCRIPT_ALGORITHMS: [&str; 6] = [
    "fixed_window",
    "sliding_window",
    "sliding_log",
    "token_bucket",
    "gcra",
    "leaky_bucket",
];

/// The set of algorithm codes (bit `code - 1`) of these rule-file names.
fn algorithm_mask(algorithms: &[&str]) -> Result<u8, String> {
    const NAMES: [&str; 6] = SCRIPT_ALGORITHMS;
    let mut mask = 0u8;
    for name in algorithms {
        match NAMES.iter().position(|n| n == name) {
            Some(i) => mask |= 1 << i,
            None => {
                return Err(format!(
                    "unknown algorithm `{name}` (expected one of: {})",
                    NAMES.join(", ")
                ))
            }
        }
    }
    if mask == 0 {
        return Err("name at least one algorithm".into());
    }
    Ok(mask)
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
            return Err(Error::Backend(format!("`{url}` names no cluster node")));
        }
        return Ok(Target::Cluster(nodes));
    }
    if client::is_single_url(url) {
        return Ok(Target::Single(url.to_string()));
    }
    Err(Error::Backend(format!(
        "`{url}` is not a Redis URL (redis://host:port, rediss://host:port, redis+unix:///path or redis+cluster://host:port,host:port)"
    )))
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

    /// The time step, in nanoseconds, at which the scripts compute `limit`: 1 when they
    /// decide exactly as the in-memory store, 1 000, 1 000 000 or 10^9 for limits whose
    /// numbers would not fit a double at 1 ns (then "now" is truncated to the step and
    /// durations are rounded up to it); `None` when no step fits (the store refuses the
    /// limit).
    pub fn tick_for(limit: &crate::algorithm::Limit) -> Option<u64> {
        Encoded::new(limit).ok().map(|e| e.tick)
    }

    /// The store's counters.
    pub fn stats(&self) -> RedisStoreStats {
        RedisStoreStats {
            calls: self.shared.calls.load(Ordering::Relaxed),
            errors: self.shared.errors.load(Ordering::Relaxed),
            timeouts: self.timeouts.load(Ordering::Relaxed),
            circuit_open: self.refused.load(Ordering::Relaxed),
            circuit_opened: self.shared.breaker.times_opened(),
            cache_hits: self.cache_hits.load(Ordering::Relaxed),
            open_now: self.shared.breaker.is_open(),
        }
    }

    /// True for a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.shared.conn, Connection::Cluster(_))
    }

    /// Deletes the Redis Functions libraries that other versions of Tollgate loaded
    /// (`tollgate_<SHA-1>` names this build never loads) and returns their names. Run it
    /// once every instance runs this version: an older instance still running reloads its
    /// library on its next call, so deleting is safe, only wasted. Other libraries are
    /// left alone.
    pub async fn delete_stale_libraries(&self) -> Result<Vec<String>, Error> {
        libraries::delete_stale(&self.shared, &self.shared.conn).await
    }

    /// The script sets this store may call while `rules` are in force: every non-empty
    /// subset of the algorithms their limits use (2^k - 1 sets for k algorithms: 1 for
    /// one, 7 for three, 63 for all six), those of fewest algorithms first.
    ///
    /// Why every subset, and not only each limit's algorithm and each descriptor's
    /// `rate_limits` list: a script call runs the script of the union of the algorithms
    /// of every check in it, and
    /// - a request holds the checks of all its descriptors, each matching a rule of its
    ///   own (one descriptor's `rate_limits` may mix algorithms, several descriptors
    ///   may match rules of different algorithms);
    /// - on a single Redis the batcher sends the requests waiting together in one call,
    ///   whatever their domains (so the call's set is the union of theirs);
    /// - the blocked-key cache answers some checks of a request itself and sends only
    ///   the others (a subset of the request's set), and on a cluster a request is one
    ///   call per hash tag (per descriptor value).
    ///
    /// So any union of any subsets can be a call's set: every subset of the algorithms
    /// in use. Loading fewer (say, each descriptor's set and each domain's union) would
    /// leave mixed batches to load their script on their first call, under load.
    pub fn script_sets(rules: &crate::rules::RuleSet) -> Vec<ScriptSet> {
        warm::script_sets(rules)
    }

    /// Loads the scripts of `sets` into Redis (after a `PING`, which also makes the
    /// store's shared connection): function libraries on Redis 7 and later (a library
    /// Redis has is kept, so a second instance loading the same sets costs Redis
    /// little), `EVALSHA` scripts where Redis has no functions or its ACL forbids them
    /// (the store then turns to `EVALSHA`, as its first call would). On a cluster every
    /// master gets them. Calls find their script loaded from then on (until Redis loses
    /// it: a restart without persistence, a failover, `FUNCTION FLUSH`; the call then
    /// loads it again). Requests that miss their deadline while this runs do not feed
    /// the circuit breaker. Fails, loading nothing more, when Redis does not answer:
    /// bound it with a timeout and try again later.
    pub async fn load_scripts(&self, sets: &[ScriptSet]) -> Result<Loaded, Error> {
        warm::load(&self.shared, &self.shared.conn, sets).await
    }

    /// Makes the connection of the calling current-thread runtime (each worker of
    /// `tollgate serve`) and waits until it answers a `PING`, so that the runtime's
    /// first requests go through it (see [`RedisStoreBuilder::per_thread`]). True once
    /// it answered; false at once when the runtime has no connection of its own (a
    /// multi-threaded runtime, `per_thread(false)`, TLS, a cluster): it then uses the
    /// shared one, which [`load_scripts`](Self::load_scripts) makes. While Redis does
    /// not answer this waits (the connection tries again every 250 ms, and is used as
    /// soon as it answers): bound it with a timeout.
    pub async fn connect_this_runtime(&self) -> bool {
        match &self.batchers {
            Some(batchers) => batchers.connect_this_runtime().await,
            None => false,
        }
    }

    /// Decides `checks` in Redis. `rejected`: the request is already rejected (by the
    /// blocked-key cache), so its checks are decided and then taken back, lockouts
    /// they start included, as if one more check had been rejected.
    async fn decide(
        &self,
        now: Nanos,
        checks: &[Check<'_>],
        rejected: bool,
        deadline: Duration,
    ) -> Result<Vec<Decision>, Error> {
        let started = tokio::time::Instant::now();
        let mut encoded = Vec::with_capacity(checks.len());
        for c in checks {
            encoded.push(Encoded::new(c.limit).map_err(|e| Error::Backend(e.to_string()))?);
        }
        let names: Vec<KeyNames> = checks
            .iter()
            .map(|c| KeyNames::new(&self.prefix, c.limit.id(), c.key))
            .collect();
        let groups = self.groups(&names);
        let epoch = self.shared.warming.epoch();
        if !self.shared.breaker.permit() {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(Error::CircuitOpen);
        }
        let call = Call {
            time: self.time,
            now,
            checks,
            encoded: &encoded,
            names: &names,
        };
        let replies = if let [group] = groups.as_slice() {
            let flags = if rejected { FORCED } else { 0 };
            vec![self
                .send(call.request(group, flags), deadline)
                .await
                .map(|answers| Reply {
                    answers,
                    receipt: None,
                })]
        } else {
            // A request spanning slots (a cluster): one call per slot, each answering a
            // receipt of what it charged, in case another slot rejects the request.
            let flags = if rejected { FORCED } else { RECEIPT };
            let calls = groups
                .iter()
                .map(|group| self.send_alone(call.request(group, flags), deadline));
            futures_util::future::join_all(calls).await
        };
        let mut decisions = vec![Decision::default(); checks.len()];
        let mut receipts = Vec::with_capacity(groups.len());
        for (group, reply) in groups.iter().zip(replies) {
            let Reply { answers, receipt } = self.answers(group, reply, epoch)?;
            for (&i, v) in group.iter().zip(answers.chunks_exact(5)) {
                decisions[i] = encoded[i].decode(checks[i].limit.limit(), v);
            }
            receipts.push(receipt);
        }
        if groups.len() > 1 && !rejected && super::rejects(checks, |i| decisions[i].allowed) {
            let left = deadline.saturating_sub(started.elapsed());
            self.refund(&call, &groups, receipts, &mut decisions, left)
                .await;
        }
        Ok(decisions)
    }

    /// One group's reply, checked: five answers per check, the script not failed.
    fn answers(
        &self,
        group: &[usize],
        reply: Result<Reply, Error>,
        epoch: u64,
    ) -> Result<Reply, Error> {
        let reply = match reply {
            Ok(r) if r.answers.len() == group.len() * 5 => r,
            Ok(r) => {
                return Err(Error::Backend(format!(
                    "the script answered {} values for {} checks",
                    r.answers.len(),
                    group.len()
                )));
            }
            Err(e) => {
                if matches!(e, Error::Timeout(_)) {
                    // The call may still be running: count the miss here, unless it
                    // waited for a script load or the first connection.
                    if self.shared.warming.overlapped(epoch) {
                        tracing::debug!("a request missed its deadline while scripts loaded or Redis was being connected: not counted as a Redis failure");
                    } else {
                        self.shared.breaker.failure();
                    }
                    self.timeouts.fetch_add(1, Ordering::Relaxed);
                }
                return Err(e);
            }
        };
        if reply.answers.first() == Some(&FAILED) {
            return Err(Error::Backend(
                "the script failed on this request (see the Redis log; a key of the wrong type?)"
                    .into(),
            ));
        }
        Ok(reply)
    }

    /// A request spanning slots was rejected in some: every other slot takes back what
    /// it charged (one call each, concurrently, with the receipt its first call
    /// answered), and its admitted checks are answered as that call decides them again
    /// with cost 0. A slot that rejected has taken back its own charges already. Each
    /// refund runs as a task of its own, so that it is made even when it answers after
    /// `wait`; a check whose slot did not answer in time (or failed) keeps its first
    /// answer, charged: stricter, never looser.
    async fn refund(
        &self,
        call: &Call<'_, '_>,
        groups: &[Vec<usize>],
        receipts: Vec<Option<Vec<u8>>>,
        decisions: &mut [Decision],
        wait: Duration,
    ) {
        let mut tasks = Vec::new();
        for (group, receipt) in groups.iter().zip(receipts) {
            let Some(receipt) = receipt.filter(|r| !r.is_empty()) else {
                // Nothing charged here (or rejected here, and taken back already).
                continue;
            };
            let mut request = call.request(group, REFUND);
            request.receipt = Some(receipt);
            let shared = Arc::clone(&self.shared);
            let task = tokio::spawn(async move { invoke(&shared, &request).await });
            tasks.push((group, tokio::time::timeout(wait, task)));
        }
        let (groups, tasks): (Vec<_>, Vec<_>) = tasks.into_iter().unzip();
        let results = futures_util::future::join_all(tasks).await;
        for (group, result) in groups.into_iter().zip(results) {
            let admitted: Vec<usize> = group
                .iter()
                .copied()
                .filter(|&i| decisions[i].allowed)
                .collect();
            let answers = match result {
                Ok(Ok(Ok(reply))) => reply.answers,
                Ok(Ok(Err(e))) => {
                    tracing::warn!(error = %e, "Redis failed to take back a charge of a request another slot rejected; it stays charged");
                    continue;
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "taking back a charge of a request another slot rejected failed; it stays charged");
                    continue;
                }
                Err(_) => {
                    tracing::debug!("taking back a charge of a request another slot rejected took longer than the deadline; its checks are answered as charged");
                    continue;
                }
            };
            if answers.len() != admitted.len() * 5 || answers.first() == Some(&FAILED) {
                tracing::warn!(
                    answers = answers.len(),
                    admitted = admitted.len(),
                    "Redis could not take back a charge of a request another slot rejected (see the Redis log); it stays charged"
                );
                continue;
            }
            for (&i, v) in admitted.iter().zip(answers.chunks_exact(5)) {
                decisions[i] = call.encoded[i].decode(call.checks[i].limit.limit(), v);
            }
        }
    }

    /// Check indexes per script call: all in one, or per hash tag on a cluster.
    fn groups(&self, names: &[KeyNames]) -> Vec<Vec<usize>> {
        if !self.is_cluster() {
            return vec![(0..names.len()).collect()];
        }
        // Groups in order of first appearance, found through a map: linear in the checks
        // however many hash tags they have.
        let mut at: HashMap<&str, usize> = HashMap::new();
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for (i, n) in names.iter().enumerate() {
            let g = *at.entry(n.tag.as_str()).or_insert_with(|| {
                groups.push(Vec::new());
                groups.len() - 1
            });
            groups[g].push(i);
        }
        groups
    }

    /// Sends one request: through the batcher (single Redis) or in a call of its own
    /// (cluster), within `deadline`.
    async fn send(&self, request: Request, deadline: Duration) -> Result<Vec<i64>, Error> {
        match &self.batchers {
            Some(batchers) => tokio::time::timeout(deadline, batchers.send(request))
                .await
                .map_err(|_| Error::Timeout(deadline))?,
            None => self
                .send_alone(request, deadline)
                .await
                .map(|reply| reply.answers),
        }
    }

    /// Sends one request in a call of its own (cluster) within `deadline`: its answers
    /// and the receipt it answered, if it asked for one.
    async fn send_alone(&self, request: Request, deadline: Duration) -> Result<Reply, Error> {
        tokio::time::timeout(deadline, invoke(&self.shared, &request))
            .await
            .map_err(|_| Error::Timeout(deadline))?
    }
}

/// One request as the script calls for its groups of checks see it.
struct Call<'a, 'c> {
    time: TimeSource,
    now: Nanos,
    checks: &'a [Check<'c>],
    encoded: &'a [Encoded],
    names: &'a [KeyNames],
}

impl Call<'_, '_> {
    /// The request of the checks `group`, with these time mode `flags`.
    fn request(&self, group: &[usize], flags: u64) -> Request {
        request(
            self.time,
            self.now,
            self.checks,
            self.encoded,
            self.names,
            group,
            flags,
        )
    }
}

/// The packed `ARGV` argument and the `KEYS` of one group of checks; `flags`: the time
/// mode's [`FORCED`], [`RECEIPT`] or [`REFUND`], or 0.
fn request(
    time: TimeSource,
    now: Nanos,
    checks: &[Check<'_>],
    encoded: &[Encoded],
    names: &[KeyNames],
    group: &[usize],
    flags: u64,
) -> Request {
    let mut args = Vec::with_capacity(32 + group.len() * CHECK_BYTES);
    let count = group.len() as u64;
    match time {
        TimeSource::Redis => pack(&mut args, &[flags, 0, 0, count]),
        TimeSource::Caller => pack(
            &mut args,
            &[1 + flags, now / NANOS_PER_SEC, now % NANOS_PER_SEC, count],
        ),
    }
    let mut keys = Vec::with_capacity(group.len());
    let mut mask = 0u8;
    for &i in group {
        let (e, n) = (&encoded[i], &names[i]);
        mask |= 1 << (e.alg - 1);
        e.push_args(&checks[i], &mut args, flags & (RECEIPT | REFUND) != 0);
        keys.push(n.state.clone());
        if e.alg == 3 {
            keys.push(n.meta());
        }
        if e.lockout > 0 {
            keys.push(n.lockout());
        }
    }
    Request {
        mask,
        args,
        keys,
        checks: group.len(),
        receipt: None,
    }
}

/// The exact script call a [`RedisStore`] makes for a request alone in its batch, or
/// for a batch of requests: the script's source, its `KEYS` and its `ARGV`. For load
/// tools that measure Redis's ceiling on the very same call, for tests, and for
/// debugging.
#[derive(Debug, Clone)]
pub struct ScriptCall {
    /// The Lua source (its SHA1 is what `EVALSHA` names).
    pub source: String,
    /// The Redis Functions form's function name, for `FCALL function numkeys KEYS...
    /// ARGV...` (what the store sends on Redis 7 and later).
    pub function: String,
    /// The Redis Functions library registering it, for `FUNCTION LOAD`.
    pub library: String,
    /// `KEYS`.
    pub keys: Vec<String>,
    /// `ARGV`: TTL slack in ms, the number of requests, which argument each request is
    /// (two bytes, 0: the first; the top bit set when a key of the request is also a
    /// key of an earlier one), then each distinct packed request once.
    pub args: Vec<Vec<u8>>,
}

impl ScriptCall {
    /// The call for `checks` under `prefix`, with Redis `TIME` and a 1 ms TTL slack.
    pub fn new(prefix: &str, checks: &[Check<'_>]) -> Result<Self, Error> {
        Self::batch(prefix, Duration::from_millis(1), [(None, checks)])
    }

    /// One call deciding `requests` in order, as the batcher of a [`RedisStore`] with
    /// this `prefix` and TTL `slack` makes it: each request with its time (`None`:
    /// Redis `TIME`) and its checks.
    pub fn batch<'a, 'c: 'a>(
        prefix: &str,
        slack: Duration,
        requests: impl IntoIterator<Item = (Option<Nanos>, &'a [Check<'c>])>,
    ) -> Result<Self, Error> {
        let mut encoded_requests = Vec::new();
        for (now, checks) in requests {
            let mut encoded = Vec::with_capacity(checks.len());
            for c in checks {
                encoded.push(Encoded::new(c.limit).map_err(|e| Error::Backend(e.to_string()))?);
            }
            let names: Vec<KeyNames> = checks
                .iter()
                .map(|c| KeyNames::new(prefix, c.limit.id(), c.key))
                .collect();
            let all: Vec<usize> = (0..checks.len()).collect();
            let time = if now.is_some() {
                TimeSource::Caller
            } else {
                TimeSource::Redis
            };
            let now = now.unwrap_or(0);
            encoded_requests.push(request(time, now, checks, &encoded, &names, &all, 0));
        }
        let refs: Vec<&Request> = encoded_requests.iter().collect();
        let mask = refs.iter().fold(0, |m, r| m | r.mask);
        let (index, distinct) = call_args(&refs);
        let slack_ms = u64::try_from(slack.as_millis()).unwrap_or(MAX_SLACK_MS);
        let mut args = vec![
            slack_ms.min(MAX_SLACK_MS).to_string().into_bytes(),
            refs.len().to_string().into_bytes(),
            index,
        ];
        args.extend(distinct.into_iter().map(<[u8]>::to_vec));
        static BUILT: OnceLock<Scripts> = OnceLock::new();
        let built = BUILT.get_or_init(Scripts::default).get(mask);
        Ok(Self {
            source: built.source.clone(),
            function: built.function.clone(),
            library: built.library.clone(),
            keys: refs.iter().flat_map(|r| r.keys.iter().cloned()).collect(),
            args,
        })
    }

    /// The script's reply as five integers per check (allowed: 1, 0 or -2 when the
    /// script failed on the request; remaining; reset after; retry after, -1 for
    /// never; delay; times in the check's ticks), or `None` if it is not such a reply.
    pub fn answers(reply: &[u8]) -> Option<Vec<i64>> {
        script::answers(reply)
    }
}

/// A call's index and distinct packed requests (`ARGV[3]` and on): see `script::dedup`.
fn call_args<'a>(requests: &[&'a Request]) -> (Vec<u8>, Vec<&'a [u8]>) {
    script::dedup(
        requests
            .iter()
            .map(|r| (r.args.as_slice(), r.keys.as_slice())),
    )
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
    let Ok(Ok(info)) = info else {
        return;
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

/// One script call for one request, with the receipt it answers when it asked for one.
async fn invoke(shared: &Shared, request: &Request) -> Result<Reply, Error> {
    invoke_reply(shared, &shared.conn, &[request]).await
}

/// One script call deciding `requests` in order.
async fn invoke_all(
    shared: &Shared,
    conn: &Connection,
    requests: &[&Request],
) -> Result<Vec<i64>, Error> {
    invoke_reply(shared, conn, requests)
        .await
        .map(|reply| reply.answers)
}

/// One script call deciding `requests` in order: their answers, and a receipt when the
/// (single) request asked for one.
async fn invoke_reply(
    shared: &Shared,
    conn: &Connection,
    requests: &[&Request],
) -> Result<Reply, Error> {
    let mask = requests.iter().fold(0, |m, r| m | r.mask);
    let built = shared.scripts.get(mask);
    let (index, distinct) = call_args(requests);
    let keys = || requests.iter().flat_map(|r| r.keys.iter());
    let receipts = || requests.iter().filter_map(|r| r.receipt.as_deref());
    shared.calls.fetch_add(1, Ordering::Relaxed);
    let mut conn = conn.clone();
    let mut reply = None;
    if shared.functions.load(Ordering::Relaxed) {
        let mut fcall = redis::cmd("FCALL");
        fcall
            .arg(&built.function)
            .arg(requests.iter().map(|r| r.keys.len()).sum::<usize>());
        for k in keys() {
            fcall.arg(k);
        }
        fcall.arg(shared.slack_ms).arg(requests.len()).arg(&index);
        for a in &distinct {
            fcall.arg(a);
        }
        for r in receipts() {
            fcall.arg(r);
        }
        reply = call_function(shared, &mut conn, built, &fcall).await;
    }
    let reply = match reply {
        Some(reply) => reply,
        None => {
            let mut evalsha = redis::cmd("EVALSHA");
            evalsha
                .arg(built.script.get_hash())
                .arg(requests.iter().map(|r| r.keys.len()).sum::<usize>());
            for k in keys() {
                evalsha.arg(k);
            }
            evalsha.arg(shared.slack_ms).arg(requests.len()).arg(&index);
            for a in &distinct {
                evalsha.arg(a);
            }
            for r in receipts() {
                evalsha.arg(r);
            }
            call_script(shared, &mut conn, built, &evalsha).await
        }
    };
    let reply = reply.map_err(|e| e.to_string()).and_then(|value| {
        let (bytes, receipt) = reply_parts(value)
            .ok_or_else(|| "the script answered something else than a string".to_string())?;
        let answers = script::answers(&bytes).ok_or_else(|| {
            format!(
                "the script answered {} bytes that are no answers",
                bytes.len()
            )
        })?;
        Ok(Reply { answers, receipt })
    });
    match reply {
        Ok(values) => {
            shared.breaker.success();
            Ok(values)
        }
        Err(e) => {
            shared.breaker.failure();
            shared.errors.fetch_add(1, Ordering::Relaxed);
            Err(Error::Backend(e))
        }
    }
}

/// A script's reply as its answers' string and, when it answered one, its receipt: a
/// string, or (a call that asked for a receipt, `lua/call.lua`) an array of the two.
fn reply_parts(value: redis::Value) -> Option<(Vec<u8>, Option<Vec<u8>>)> {
    match value {
        redis::Value::BulkString(answers) => Some((answers, None)),
        redis::Value::Array(parts) => match <[redis::Value; 2]>::try_from(parts) {
            Ok([redis::Value::BulkString(answers), redis::Value::BulkString(receipt)]) => {
                Some((answers, Some(receipt)))
            }
            _ => None,
        },
        _ => None,
    }
}

/// Sends `fcall`: when Redis no longer has the function (a restart, a failover,
/// `FUNCTION FLUSH`), loads the library and sends it again. `None` when Redis cannot
/// run functions at all (no `FCALL` or `FUNCTION LOAD`, or its ACL forbids them): the
/// store then turns to `EVALSHA` for good, and the caller sends this call that way.
async fn call_function(
    shared: &Shared,
    conn: &mut Connection,
    built: &script::Built,
    fcall: &redis::Cmd,
) -> Option<redis::RedisResult<redis::Value>> {
    let first = fcall.query_async::<redis::Value>(conn).await;
    let missing = match &first {
        Err(e) if functions_unusable(e) => {
            give_up_functions(shared, e);
            return None;
        }
        Err(e) => function_missing(e),
        Ok(_) => false,
    };
    if !missing {
        return Some(first);
    }
    let loading = shared.warming.begin();
    let loaded = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(&built.library)
        .query_async::<redis::Value>(conn)
        .await;
    drop(loading);
    match loaded {
        Ok(_) => Some(fcall.query_async::<redis::Value>(conn).await),
        // Redis refused the library itself (no FUNCTION, an ACL, or a library it
        // cannot compile): EVALSHA still works.
        Err(e) if functions_unusable(&e) || library_refused(&e) => {
            give_up_functions(shared, &e);
            None
        }
        // Anything else (a transport failure, a cluster in flux, Redis still loading
        // its data) fails this call only; the next one tries again.
        Err(e) => Some(Err(e)),
    }
}

/// Sends `evalsha`; when Redis does not have the script (`NOSCRIPT`: a restart, a
/// failover, `SCRIPT FLUSH`), loads it and sends it again. The load is a load in
/// progress, not a failure (see [`Warming`]).
async fn call_script(
    shared: &Shared,
    conn: &mut Connection,
    built: &script::Built,
    evalsha: &redis::Cmd,
) -> redis::RedisResult<redis::Value> {
    match evalsha.query_async::<redis::Value>(&mut *conn).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            let loading = shared.warming.begin();
            let loaded = built.script.load_async(&mut *conn).await;
            drop(loading);
            loaded?;
            evalsha.query_async::<redis::Value>(conn).await
        }
        reply => reply,
    }
}

/// Whether `FUNCTION LOAD` failed on the library's code (Redis answers "Error
/// registering functions" or "Error compiling function"): a fault of this build that a
/// retry cannot mend.
fn library_refused(e: &redis::RedisError) -> bool {
    refused_code(e.code(), e.detail())
}

/// [`library_refused`] on an error's code and text.
fn refused_code(code: Option<&str>, detail: Option<&str>) -> bool {
    code == Some("ERR")
        && detail.is_some_and(|d| {
            d.starts_with("Error registering functions") || d.starts_with("Error compiling")
        })
}

/// Whether Redis answered that the called function does not exist.
fn function_missing(e: &redis::RedisError) -> bool {
    refusal(e.code(), e.detail()) == Refusal::Missing
}

/// Whether Redis cannot run `FCALL` at all: an unknown command (before 7.0) or an ACL
/// refusal.
fn functions_unusable(e: &redis::RedisError) -> bool {
    refusal(e.code(), e.detail()) == Refusal::Unusable
}

/// What an error answered to `FCALL` says about functions.
#[derive(Debug, PartialEq, Eq)]
enum Refusal {
    /// The function is not loaded: load the library and call again.
    Missing,
    /// Functions cannot be used here: use `EVALSHA`.
    Unusable,
    /// Anything else: a failure of this call.
    Other,
}

/// Reads a Redis error by its code (`ERR`, `NOPERM`...) and the text after it.
fn refusal(code: Option<&str>, detail: Option<&str>) -> Refusal {
    let detail = detail.unwrap_or_default();
    match code {
        Some("ERR") if detail.starts_with("Function not found") => Refusal::Missing,
        Some("ERR") if detail.to_ascii_lowercase().starts_with("unknown command") => {
            Refusal::Unusable
        }
        Some("NOPERM") => Refusal::Unusable,
        _ => Refusal::Other,
    }
}

/// Turns the store to `EVALSHA` for good, saying why once.
fn give_up_functions(shared: &Shared, e: &redis::RedisError) {
    if shared.functions.swap(false, Ordering::Relaxed) {
        tracing::warn!(
            error = %e,
            "Redis cannot run Tollgate's scripts as functions (FCALL); using EVALSHA, \
             which costs Redis more per call"
        );
    }
}

impl Store for RedisStore {
    async fn check(&self, now: Nanos, checks: &[Check<'_>]) -> Result<Vec<Decision>, Error> {
        self.check_by(now, checks, self.deadline).await
    }

    async fn check_within(
        &self,
        now: Nanos,
        checks: &[Check<'_>],
        budget: Duration,
    ) -> Result<Vec<Decision>, Error> {
        self.check_by(now, checks, deadline_within(self.deadline, budget))
            .await
    }
}

/// The deadline for a caller that waits at most `budget`: the budget when it is at
/// least half the store's `deadline` (and shorter), else the deadline itself. A budget
/// far shorter than the deadline says more about the caller than about Redis, and
/// honouring it would let any caller buy its rules' failure mode (`fail_open`: admitted,
/// uncounted) by being impatient (`grpc-timeout: 0m`), or open the circuit for everyone.
fn deadline_within(deadline: Duration, budget: Duration) -> Duration {
    if budget * 2 >= deadline {
        budget.min(deadline)
    } else {
        deadline
    }
}

impl RedisStore {
    /// [`Store::check`] with Redis answering within `deadline`.
    async fn check_by(
        &self,
        now: Nanos,
        checks: &[Check<'_>],
        deadline: Duration,
    ) -> Result<Vec<Decision>, Error> {
        let Some(cache) = &self.cache else {
            return self.decide(now, checks, false, deadline).await;
        };
        let cached: Vec<Option<Decision>> = checks.iter().map(|c| cache.lookup(c, now)).collect();
        let hits = cached.iter().filter(|d| d.is_some()).count();
        if hits == 0 {
            let decisions = self.decide(now, checks, false, deadline).await?;
            for (c, d) in checks.iter().zip(&decisions) {
                cache.remember(c, d, now);
            }
            return Ok(decisions);
        }
        self.cache_hits.fetch_add(hits as u64, Ordering::Relaxed);
        // The request is rejected. Its other checks are still decided in Redis (and
        // taken back), so that a lockout one of them would start does start.
        let rest: Vec<usize> = (0..checks.len()).filter(|&i| cached[i].is_none()).collect();
        let mut decisions: Vec<Decision> =
            cached.into_iter().map(Option::unwrap_or_default).collect();
        if rest.is_empty() {
            return Ok(decisions);
        }
        let others: Vec<Check<'_>> = rest.iter().map(|&i| checks[i]).collect();
        match self.decide(now, &others, true, deadline).await {
            Ok(answers) => {
                for (&i, d) in rest.iter().zip(answers) {
                    cache.remember(&checks[i], &d, now);
                    decisions[i] = d;
                }
            }
            Err(e) => {
                // The cached rejection stands whatever Redis does; the other checks
                // were not charged, and are reported as having all their room.
                tracing::debug!(error = %e, "Redis failed on a request the blocked-key cache rejects");
                for i in rest {
                    let limit = checks[i].limit.limit();
                    decisions[i] = Decision::allow(limit, limit, 0);
                }
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
    fn only_a_callers_budget_near_the_deadline_shortens_it() {
        let ms = Duration::from_millis;
        assert_eq!(
            deadline_within(ms(20), ms(16)),
            ms(16),
            "Envoy's 20 ms, 4/5 of it"
        );
        assert_eq!(deadline_within(ms(20), ms(10)), ms(10));
        assert_eq!(
            deadline_within(ms(20), ms(9)),
            ms(20),
            "under half: not honoured"
        );
        assert_eq!(deadline_within(ms(20), Duration::ZERO), ms(20));
        assert_eq!(deadline_within(ms(20), ms(5_000)), ms(20), "never longer");
    }

    #[test]
    fn a_reply_is_the_answers_or_the_answers_and_a_receipt() {
        use redis::Value;
        let bulk = |b: &[u8]| Value::BulkString(b.to_vec());
        assert_eq!(reply_parts(bulk(b"ab")), Some((b"ab".to_vec(), None)));
        assert_eq!(
            reply_parts(Value::Array(vec![bulk(b"ab"), bulk(b"")])),
            Some((b"ab".to_vec(), Some(Vec::new())))
        );
        assert_eq!(reply_parts(Value::Array(vec![bulk(b"ab")])), None);
        assert_eq!(
            reply_parts(Value::Array(vec![bulk(b"a"), Value::Int(1)])),
            None
        );
        assert_eq!(reply_parts(Value::Int(1)), None);
    }

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

    #[test]
    fn fcall_refusals_are_read_by_code_and_text() {
        assert_eq!(
            refusal(Some("ERR"), Some("Function not found")),
            Refusal::Missing
        );
        // Redis 6 has no FCALL (the text's quotes vary between versions).
        assert_eq!(
            refusal(
                Some("ERR"),
                Some("unknown command 'FCALL', with args beginning with: 'tollgate_ab' ")
            ),
            Refusal::Unusable
        );
        assert_eq!(
            refusal(Some("ERR"), Some("Unknown command `FUNCTION`")),
            Refusal::Unusable
        );
        assert_eq!(
            refusal(
                Some("NOPERM"),
                Some("User nofn has no permissions to run the 'fcall' command")
            ),
            Refusal::Unusable
        );
        // A failure inside the script, or of the call, is the call's own.
        assert_eq!(
            refusal(Some("ERR"), Some("user_script:1: Script attempted ...")),
            Refusal::Other
        );
        assert_eq!(refusal(Some("BUSY"), Some("Redis is busy")), Refusal::Other);
        assert_eq!(refusal(None, None), Refusal::Other);
        // FUNCTION LOAD's answers to a library Redis cannot take (as Redis 7.0 words
        // them), against one it may take later (still loading its data).
        assert!(refused_code(
            Some("ERR"),
            Some("Error registering functions: ERR user_function:2: Script attempted to access nonexistent global variable 'math'")
        ));
        assert!(refused_code(
            Some("ERR"),
            Some("Error compiling function: user_function:2: <name> expected")
        ));
        assert!(!refused_code(
            Some("LOADING"),
            Some("Redis is loading the dataset in memory")
        ));
    }
}
