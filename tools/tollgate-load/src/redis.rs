//! `redis` mode: Redis's ceiling for Tollgate's script. Sends the exact script call a
//! `RedisStore` makes for a request alone in its batch (one `fixed_window` check per
//! request, Redis `TIME`), over one connection per concurrent request, as
//! `redis-benchmark -c N` does. Like the store, it calls the script as a Redis
//! Functions library (`FUNCTION LOAD` once, then `FCALL`), or with `EVALSHA` where
//! Redis refuses the library (Redis 6, an ACL). (`redis-benchmark` itself cannot send the call: its
//! packed argument holds NUL bytes, which no command-line argument can.)

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::Script;
use tollgate::algorithm::{Algorithm, FixedWindow, Limit};
use tollgate::store::{Check, ScriptCall};

use crate::engine::{Outcome, Target};

/// Connections to one Redis and the prepared calls, one per key.
pub struct RedisTarget {
    connections: Vec<MultiplexedConnection>,
    /// `None` when the library was loaded: calls go by `FCALL`.
    script: Option<Script>,
    calls: Vec<ScriptCall>,
}

impl RedisTarget {
    /// Connects `connections` times to `url` and prepares `keys` calls of a limit so
    /// high that every request is admitted (as `tools/bench-redis.sh` configures
    /// `tollgate serve`).
    pub async fn connect(
        url: &str,
        connections: u32,
        keys: u64,
        timeout: Duration,
    ) -> Result<Self, String> {
        let client =
            redis::Client::open(url).map_err(|e| format!("invalid Redis URL `{url}`: {e}"))?;
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        let mut conns = Vec::with_capacity(connections as usize);
        for _ in 0..connections {
            conns.push(
                client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
                    .map_err(|e| format!("cannot connect to {url}: {e}"))?,
            );
        }
        let limit = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
            1_000_000_000,
            Duration::from_secs(1),
        )))
        .map_err(|e| e.to_string())?;
        let mut calls = Vec::with_capacity(keys as usize);
        for k in 0..keys.max(1) {
            let key = format!("u{k}");
            let check = Check::new(&limit, &key, 1);
            calls.push(ScriptCall::new("bench", &[check]).map_err(|e| e.to_string())?);
        }
        let loaded = redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(&calls[0].library)
            .query_async::<redis::Value>(&mut conns[0])
            .await;
        let script = match loaded {
            Ok(_) => None,
            Err(e) => {
                eprintln!("tollgate-load: Redis refused the function library ({e}); using EVALSHA");
                Some(Script::new(&calls[0].source))
            }
        };
        Ok(Self {
            connections: conns,
            script,
            calls,
        })
    }
}

impl Target for RedisTarget {
    async fn call(&self, seq: u64) -> Outcome {
        let call = &self.calls[(seq % self.calls.len() as u64) as usize];
        let mut conn = self.connections[(seq % self.connections.len() as u64) as usize].clone();
        let reply = match &self.script {
            None => {
                let mut fcall = redis::cmd("FCALL");
                fcall.arg(&call.function).arg(call.keys.len());
                for k in &call.keys {
                    fcall.arg(k);
                }
                for a in &call.args {
                    fcall.arg(a.as_slice());
                }
                fcall.query_async::<Vec<u8>>(&mut conn).await
            }
            Some(script) => {
                let mut invocation = script.prepare_invoke();
                for k in &call.keys {
                    invocation.key(k);
                }
                for a in &call.args {
                    invocation.arg(a.as_slice());
                }
                invocation.invoke_async::<Vec<u8>>(&mut conn).await
            }
        };
        match reply {
            Ok(reply) => match ScriptCall::answers(&reply)
                .as_deref()
                .and_then(|v| v.first())
            {
                Some(1) => Outcome::Ok,
                Some(0) => Outcome::OverLimit,
                _ => Outcome::Other,
            },
            Err(e) => Outcome::Error(e.to_string()),
        }
    }
}
