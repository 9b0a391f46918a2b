//! [`AnyStore`]: the store `--store` selects, behind one type the limiter runs on; and
//! [`Maintainer`], the task that exchanges synced counts with Redis.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tollgate::clock::Nanos;
use tollgate::clock::SystemClock;
use tollgate::decision::Decision;
use tollgate::store::{
    self, Check, MemoryStore, RedisStore, RedisTls, ScaleOut, Store, TimeSource,
};

/// `memory`, or a Redis / Redis Cluster store.
pub enum AnyStore {
    /// The embedded in-memory store.
    Memory(MemoryStore),
    /// Redis (`redis://`) or Redis Cluster (`redis+cluster://`), shared with the
    /// warm-up (`warm.rs`), which loads the scripts of reloaded rules; decided through
    /// leased and synced counting for the limits whose `consistency` asks for it.
    Redis(Arc<RedisStore>, ScaleOut<Arc<RedisStore>>),
}

/// How to open a store.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Key cap of the in-memory store (and of the local fallback store).
    pub max_keys: usize,
    /// Deadline of each Redis call.
    pub deadline: Duration,
    /// Redis key prefix.
    pub prefix: String,
    /// Blocked-key cache capacity (0: off).
    pub blocked_cache: usize,
    /// Take time from the caller (conformance runs with a manual clock) instead of Redis.
    pub caller_time: bool,
    /// CA and client certificate for a `rediss://` store.
    pub tls: Option<RedisTls>,
    /// One Redis connection for all workers, instead of one per worker.
    pub shared_connection: bool,
}

impl AnyStore {
    /// Opens `spec` (as [`open`](Self::open)) with `global`, the store every region
    /// shares, beside it: limits of `scope: global` are leased from it. `global` needs
    /// a Redis `spec`; its calls have `global_deadline`.
    pub async fn open_with_global(
        spec: &str,
        global: Option<&str>,
        global_deadline: Duration,
        options: &StoreOptions,
    ) -> Result<Self, String> {
        let Some(global) = global else {
            return Self::open(spec, options).await;
        };
        let Self::Redis(regional, _) = Self::open(spec, options).await? else {
            return Err(format!(
                "a global store (`{global}`) needs a Redis store beside it, not `{spec}`"
            ));
        };
        let options = StoreOptions {
            deadline: global_deadline,
            ..options.clone()
        };
        let Self::Redis(global, _) = Self::open(global, &options)
            .await
            .map_err(|e| format!("the global store: {e}"))?
        else {
            return Err(format!("the global store must be Redis, not `{global}`"));
        };
        let scale = ScaleOut::with_global(Arc::clone(&regional), global, store::DEFAULT_MAX_KEYS);
        Ok(Self::Redis(regional, scale))
    }

    /// Opens `spec`: `memory`, `redis://host:port`, `redis+unix:///path`, or
    /// `redis+cluster://h1:p1,h2:p2`.
    pub async fn open(spec: &str, options: &StoreOptions) -> Result<Self, String> {
        if spec == "memory" {
            if options.tls.is_some() {
                return Err(
                    "Redis TLS certificates are set, but the store is memory (use --store rediss://...)"
                        .into(),
                );
            }
            return Ok(Self::Memory(
                MemoryStore::builder().max_keys(options.max_keys).build(),
            ));
        }
        if !spec.starts_with("redis") && !spec.starts_with("unix://") {
            return Err(format!(
                "unknown store `{spec}` (expected memory, redis://host:port, rediss://host:port, redis+unix:///path or redis+cluster://host:port,host:port)"
            ));
        }
        let mut builder = RedisStore::builder(spec)
            .deadline(options.deadline)
            .prefix(options.prefix.clone())
            .blocked_cache(options.blocked_cache)
            .per_thread(!options.shared_connection);
        if let Some(tls) = &options.tls {
            builder = builder.tls(tls.clone());
        }
        if options.caller_time {
            builder = builder
                .time_source(TimeSource::Caller)
                .ttl_slack(Duration::from_secs(3_600));
        }
        builder
            .connect()
            .await
            .map(|s| {
                let s = Arc::new(s);
                Self::Redis(Arc::clone(&s), ScaleOut::new(s))
            })
            .map_err(|e| e.to_string())
    }

    /// `memory`, `redis` or `redis-cluster`, for logs.
    pub fn name(&self) -> &'static str {
        match self {
            AnyStore::Memory(_) => "memory",
            AnyStore::Redis(r, _) if r.is_cluster() => "redis-cluster",
            AnyStore::Redis(..) => "redis",
        }
    }

    /// The in-memory store, when that is the store.
    pub fn memory(&self) -> Option<&MemoryStore> {
        match self {
            AnyStore::Memory(m) => Some(m),
            AnyStore::Redis(..) => None,
        }
    }

    /// The Redis store, when that is the store.
    pub fn redis(&self) -> Option<&Arc<RedisStore>> {
        match self {
            AnyStore::Memory(_) => None,
            AnyStore::Redis(r, _) => Some(r),
        }
    }

    /// The global store (`--global-store`), when there is one.
    pub fn global_redis(&self) -> Option<&Arc<RedisStore>> {
        self.scale_out()?.global_store()
    }

    /// Leased and synced counting in front of Redis, when that is the store.
    pub fn scale_out(&self) -> Option<&ScaleOut<Arc<RedisStore>>> {
        match self {
            AnyStore::Memory(_) => None,
            AnyStore::Redis(_, s) => Some(s),
        }
    }
}

/// Limits of `set` that the Redis store cannot compute (see `RedisStore::tick_for`),
/// as messages naming the rule's file and line.
pub fn redis_out_of_range(set: &tollgate::rules::RuleSet) -> Vec<String> {
    let mut out = Vec::new();
    for domain in set.domains() {
        for rule in domain.rules() {
            for l in &rule.limits {
                if RedisStore::tick_for(&l.limit).is_none() {
                    out.push(format!(
                        "{}: domain `{}`: {} per {} with this burst is beyond what the Redis store computes exactly (lower the burst or use a shorter unit)",
                        rule.origin,
                        domain.name,
                        l.requests_per_unit,
                        l.unit.name().to_lowercase()
                    ));
                }
                // What a borrowing limit borrowed is counted on a counter of its own.
                if let Some(b) = &l.borrow {
                    if RedisStore::tick_for(&b.extra.limit).is_none() {
                        out.push(format!(
                            "{}: domain `{}`: `borrow.up_to: {}` leaves {} per {} to borrow, beyond what the Redis store computes exactly (lower `up_to` or use a shorter unit)",
                            rule.origin,
                            domain.name,
                            b.up_to,
                            b.extra.requests_per_unit,
                            l.unit.name().to_lowercase()
                        ));
                    }
                }
            }
        }
        for pool in &domain.pools {
            if RedisStore::tick_for(&pool.limit.limit).is_none() {
                out.push(format!(
                    "{}: domain `{}`: pool `{}`: {} per {} with this burst is beyond what the Redis store computes exactly (lower the burst or use a shorter unit)",
                    domain.files.join(", "),
                    domain.name,
                    pool.name,
                    pool.limit.requests_per_unit,
                    pool.limit.unit.name().to_lowercase()
                ));
            }
        }
    }
    out
}

impl Store for AnyStore {
    async fn check(&self, now: Nanos, checks: &[Check<'_>]) -> Result<Vec<Decision>, store::Error> {
        match self {
            AnyStore::Memory(m) => Ok(m.check_all(now, checks)),
            AnyStore::Redis(_, s) => s.check(now, checks).await,
        }
    }

    async fn check_within(
        &self,
        now: Nanos,
        checks: &[Check<'_>],
        budget: std::time::Duration,
    ) -> Result<Vec<Decision>, store::Error> {
        match self {
            AnyStore::Memory(m) => Ok(m.check_all(now, checks)),
            AnyStore::Redis(_, s) => s.check_within(now, checks, budget).await,
        }
    }
}

/// The task that exchanges synced counts with Redis every `sync_interval` and forgets
/// idle leased and synced keys; stopped after the listeners drained, it sends what is
/// still pending.
pub struct Maintainer {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

/// How long the last push of synced counts may take when stopping.
const FLUSH_WITHIN: Duration = Duration::from_secs(2);

impl Maintainer {
    /// Starts it for `store`, when it is Redis.
    pub fn start(store: &AnyStore) -> Option<Self> {
        let scale = store.scale_out()?.clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let stopped = async move {
                let _ = stopped.await;
            };
            scale.maintain(SystemClock, stopped, FLUSH_WITHIN).await;
        });
        Some(Self { stop, task })
    }

    /// Stops it, once the synced counts still pending are sent (or [`FLUSH_WITHIN`]
    /// passed).
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A borrowing limit whose borrowed counter, or a pool, the Redis store cannot
    /// compute is named at start, not left to fail every request.
    #[test]
    fn a_borrowed_counter_or_pool_out_of_range_is_named() {
        let text = "domain: d
pools:
  - {name: wide, rate_limit: {unit: month, requests_per_unit: 4294967291, algorithm: token_bucket}}
descriptors:
  - key: tenant
    rate_limit: {unit: month, requests_per_unit: 1, algorithm: token_bucket, borrow: {from: wide, up_to: 4294967292}}
";
        let set = tollgate::rules::from_str("d.yaml", text).expect("valid rules");
        let problems = redis_out_of_range(&set);
        assert!(
            problems
                .iter()
                .any(|p| p.contains("`borrow.up_to: 4294967292`")),
            "{problems:?}"
        );
        assert!(
            problems.iter().any(|p| p.contains("pool `wide`")),
            "{problems:?}"
        );
    }
}
