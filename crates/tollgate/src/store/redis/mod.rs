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
//! ## Leases
//! A lease of leased counting ([`Store::lease`]; `ScaleOut` asks for one only when it
//! leases more than the request's cost) is one check in a call of its own (not
//! batched), answering the same receipt a cluster's call does (for a lone check: the key
//! before and after the charge). [`Store::give_back`] sends it back with the units to
//! return (`lua/driver.lua`, `give_back_request`): a fixed window's count goes down by them
//! while the stored window is the one charged; a bucket moves back only while the key is
//! still exactly as the lease left it (its algorithm's `REFUND`, which never goes before
//! now). Anything else leaves the key as it is.
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
mod builder;
mod call;
mod client;
mod functions;
mod keys;
mod libraries;
mod script;
mod warm;

pub use builder::{RedisStoreBuilder, TimeSource};
pub use call::ScriptCall;
pub(crate) use client::{
    address as redis_address, failure as redis_failure, single as single_connection,
};
pub use client::{is_single_url, RedisTls};
pub use script::{script_library, script_source, ScriptNameError, SCRIPT_ALGORITHMS};
pub use warm::{Loaded, ScriptSet};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::blocked::BlockedCache;
use super::{Check, Error, LeaseToken, Store};
use crate::clock::Nanos;
use crate::decision::Decision;
use batcher::Batchers;
use breaker::Breaker;
use call::{invoke, Call, Reply, Request, FORCED, GIVE, RECEIPT, REFUND};
use client::Connection;
use keys::KeyNames;
use script::{Encoded, Scripts, FAILED};
use warm::Warming;

/// Counters kept by a [`RedisStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RedisStoreStats {
    /// Script calls sent to Redis.
    pub calls: u64,
    /// Script calls Redis answered (with their results).
    pub answered: u64,
    /// The round trips of those answered calls, summed, in nanoseconds: from sending a
    /// call (the script's arguments built) to its answer read.
    pub answered_nanos: u64,
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
    /// Calls answered, and their round trips summed in ns ([`RedisStoreStats`]).
    answered: AtomicU64,
    answered_nanos: AtomicU64,
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
    /// Where the store connects, as errors name it (`host:port`, a socket's path, or a
    /// cluster's nodes).
    address: String,
    /// Whether Redis refused the last connection the store tried.
    refused: Refused,
}

impl Shared {
    /// A Redis error of a call or of a connection, as a store error keeping it as its
    /// source (see [`client::failure`]); a refused connection is remembered until Redis
    /// answers again.
    fn failed(&self, e: redis::RedisError) -> Error {
        if e.is_connection_refusal() {
            self.refused.set(e.clone());
        } else {
            self.refused.clear();
        }
        client::failure(e, &self.address)
    }

    /// What a request that missed its deadline reports: the refusal, when Redis refused
    /// the last connection the store tried (the call waited for redis-rs's reconnection
    /// attempts), else `timeout`.
    fn missed(&self, timeout: Error) -> Error {
        match self.refused.get() {
            Some(e) => client::failure(e, &self.address),
            None => timeout,
        }
    }
}

/// The connection error of Redis refusing the store's last connection, until Redis
/// answers again.
#[derive(Default)]
struct Refused {
    /// Whether `error` holds one (read on every call without locking).
    set: AtomicBool,
    error: parking_lot::Mutex<Option<redis::RedisError>>,
}

impl Refused {
    fn set(&self, e: redis::RedisError) {
        *self.error.lock() = Some(e);
        self.set.store(true, Ordering::Release);
    }

    /// Redis answered, or failed otherwise.
    fn clear(&self) {
        if self.set.swap(false, Ordering::AcqRel) {
            *self.error.lock() = None;
        }
    }

    fn get(&self) -> Option<redis::RedisError> {
        if !self.set.load(Ordering::Acquire) {
            return None;
        }
        self.error.lock().clone()
    }
}

impl RedisStore {
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
            answered: self.shared.answered.load(Ordering::Relaxed),
            answered_nanos: self.shared.answered_nanos.load(Ordering::Relaxed),
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

    /// Reads the setting `name` that every instance sharing this Redis sees (the key
    /// `<prefix>:setting:<name>`, a plain string): `None` when none is set. Within the
    /// store's deadline.
    pub async fn shared_setting(&self, name: &str) -> Result<Option<Vec<u8>>, Error> {
        let mut conn = self.shared.conn.clone();
        let mut get = redis::cmd("GET");
        get.arg(self.setting_key(name));
        tokio::time::timeout(self.deadline, get.query_async::<Option<Vec<u8>>>(&mut conn))
            .await
            .map_err(|_| Error::Timeout(self.deadline))?
            .map_err(|e| self.shared.failed(e))
    }

    /// Sets the setting `name` (see [`shared_setting`](Self::shared_setting)) to
    /// `value`, with no expiry. Within the store's deadline.
    pub async fn set_shared_setting(&self, name: &str, value: &[u8]) -> Result<(), Error> {
        let mut conn = self.shared.conn.clone();
        let mut set = redis::cmd("SET");
        set.arg(self.setting_key(name)).arg(value);
        tokio::time::timeout(self.deadline, set.query_async::<()>(&mut conn))
            .await
            .map_err(|_| Error::Timeout(self.deadline))?
            .map_err(|e| self.shared.failed(e))
    }

    fn setting_key(&self, name: &str) -> String {
        format!("{}:setting:{name}", self.prefix)
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
            encoded.push(Encoded::new(c.limit).map_err(out_of_range)?);
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
                return Err(Error::backend(format!(
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
                    return Err(self.shared.missed(e));
                }
                return Err(e);
            }
        };
        if reply.answers.first() == Some(&FAILED) {
            return Err(Error::backend(
                "the script failed on this request (see the Redis log; a key of the wrong type?)",
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

    /// Decides one check in a call of its own with the time mode `flags` ([`RECEIPT`]:
    /// a lease; [`GIVE`]: giving back units of one, `receipt` being its lease's), within
    /// `deadline`: its decision and the receipt the call answered.
    async fn alone(
        &self,
        now: Nanos,
        check: Check<'_>,
        flags: u64,
        receipt: Option<&LeaseToken>,
        deadline: Duration,
    ) -> Result<(Decision, Option<Vec<u8>>), Error> {
        let encoded = [Encoded::new(check.limit).map_err(out_of_range)?];
        let names = [KeyNames::new(&self.prefix, check.limit.id(), check.key)];
        let checks = [check];
        let epoch = self.shared.warming.epoch();
        if !self.shared.breaker.permit() {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(Error::CircuitOpen);
        }
        let call = Call {
            time: self.time,
            now,
            checks: &checks,
            encoded: &encoded,
            names: &names,
        };
        let mut request = call.request(&[0], flags);
        request.receipt = receipt.map(|t| t.0.to_vec());
        let reply = self.send_alone(request, deadline).await;
        let Reply { answers, receipt } = self.answers(&[0], reply, epoch)?;
        let d = encoded[0].decode(check.limit.limit(), &answers[..5]);
        Ok((d, receipt))
    }

    /// Sends one request in a call of its own (cluster) within `deadline`: its answers
    /// and the receipt it answered, if it asked for one.
    async fn send_alone(&self, request: Request, deadline: Duration) -> Result<Reply, Error> {
        tokio::time::timeout(deadline, invoke(&self.shared, &request))
            .await
            .map_err(|_| Error::Timeout(deadline))?
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

    /// A lease is one check in a call of its own (not batched: its call answers the
    /// receipt of the key before and after the charge, `lua/driver.lua`'s
    /// `lone_receipt`), the token [`Store::give_back`] sends back.
    async fn lease(
        &self,
        now: Nanos,
        check: Check<'_>,
        budget: Option<Duration>,
    ) -> Result<(Decision, Option<LeaseToken>), Error> {
        let deadline = budget.map_or(self.deadline, |b| deadline_within(self.deadline, b));
        let (d, receipt) = self.alone(now, check, RECEIPT, None, deadline).await?;
        let token = receipt
            .filter(|r| d.allowed && !r.is_empty())
            .map(|r| LeaseToken(r.into()));
        Ok((d, token))
    }

    /// Gives back in a call of its own (`lua/driver.lua`'s `give_back_request`).
    async fn give_back(
        &self,
        now: Nanos,
        check: Check<'_>,
        token: &LeaseToken,
    ) -> Result<(), Error> {
        self.alone(now, check, GIVE, Some(token), self.deadline)
            .await
            .map(|_| ())
    }
}

/// A limit the scripts cannot run, as a store error.
fn out_of_range(e: script::OutOfRange) -> Error {
    Error::backend_caused_by(e.to_string(), e)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{Algorithm, FixedWindow, Limit};

    /// Nothing listens on a free port, so the connection is refused: the store says so
    /// and names the address, with Redis's error as the source, whether the call itself
    /// failed or the request's deadline passed first (once the store has seen the
    /// refusal: the first requests wait for redis-rs's connection attempts).
    #[test]
    fn a_refused_connection_is_named_with_its_address_not_as_a_timeout() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a runtime");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let address = format!("127.0.0.1:{port}");
        let limit = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
            5,
            Duration::from_secs(1),
        )))
        .expect("a valid limit");
        let checks = [Check::new(&limit, "k", 1)];
        let store = |deadline| {
            rt.block_on(
                RedisStore::builder(format!("redis://{address}"))
                    .deadline(deadline)
                    .connect(),
            )
            .expect("a single Redis connects lazily")
        };

        // A deadline past redis-rs's attempts to connect: the call fails itself.
        let patient = store(Duration::from_secs(5));
        let e = rt
            .block_on(patient.check(0, &checks))
            .expect_err("nothing listens");
        assert_refused(&e, &address);

        // The default deadline (20 ms) passes during those attempts.
        let hasty = store(Duration::from_millis(20));
        let started = std::time::Instant::now();
        let e = loop {
            let e = rt
                .block_on(hasty.check(0, &checks))
                .expect_err("nothing listens");
            if !matches!(e, Error::Timeout(_)) || started.elapsed() > Duration::from_secs(5) {
                break e;
            }
        };
        assert_refused(&e, &address);
    }

    fn assert_refused(e: &Error, address: &str) {
        let text = e.to_string();
        assert!(text.contains("refused") && text.contains(address), "{text}");
        assert_eq!(e.kind(), "error");
        let source = std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<redis::RedisError>())
            .map(redis::RedisError::is_connection_refusal);
        assert_eq!(source, Some(true), "{e:?}");
    }

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
}
