//! One script call: a request's checks packed into its `ARGV` argument and its `KEYS`
//! ([`Call`], [`request`]), a batch of requests in one call ([`invoke_all`]), the
//! `FCALL` or `EVALSHA` sent, and the reply read back ([`Reply`]). [`ScriptCall`] is the
//! same call, made public for load tools and tests.

use std::sync::atomic::Ordering;
use std::sync::OnceLock;
use std::time::Duration;

use super::builder::MAX_SLACK_MS;
use super::client::Connection;
use super::functions::call_function;
use super::keys::KeyNames;
use super::script::{self, pack, Encoded, Scripts, CHECK_BYTES};
use super::{Shared, TimeSource};
use crate::clock::{Nanos, NANOS_PER_SEC};
use crate::store::{Check, Error};

/// One request's part of a script call: its packed `ARGV` argument and its `KEYS`.
#[derive(Debug)]
pub(super) struct Request {
    /// The set of algorithm codes of its checks (bit `code - 1`).
    pub(super) mask: u8,
    /// The packed argument.
    pub(super) args: Vec<u8>,
    /// The keys, check after check.
    pub(super) keys: Vec<String>,
    /// How many checks it has.
    pub(super) checks: usize,
    /// The receipt a refund call takes back (the `ARGV` after the request's; a refund
    /// is alone in its call).
    pub(super) receipt: Option<Vec<u8>>,
}

/// What a script call answers: five integers per check and, for a call that asked for
/// one (a Redis Cluster's, [`RECEIPT`]), the receipt of what it charged.
pub(super) struct Reply {
    /// Five per check.
    pub(super) answers: Vec<i64>,
    /// The receipt, when the call asked for one.
    pub(super) receipt: Option<Vec<u8>>,
}

/// Time mode flags of a request's packed argument (`lua/call.lua`): already rejected
/// (by the blocked-key cache), so decided and taken back.
pub(super) const FORCED: u64 = 2;
/// Answer the receipt of what the request charged (Redis Cluster, a request spanning
/// slots).
pub(super) const RECEIPT: u64 = 4;
/// Take back what the request charged, from the receipt its call answered.
pub(super) const REFUND: u64 = 8;
/// Give back the check's cost (unspent units of a lease, leased counting) from the
/// receipt the lease's call answered.
pub(super) const GIVE: u64 = 16;

/// One request as the script calls for its groups of checks see it.
pub(super) struct Call<'a, 'c> {
    /// Where "now" comes from.
    pub(super) time: TimeSource,
    /// The caller's now (under [`TimeSource::Caller`]).
    pub(super) now: Nanos,
    /// The request's checks.
    pub(super) checks: &'a [Check<'c>],
    /// Each check as the scripts see it.
    pub(super) encoded: &'a [Encoded],
    /// Each check's key names.
    pub(super) names: &'a [KeyNames],
}

impl Call<'_, '_> {
    /// The request of the checks `group`, with these time mode `flags`.
    pub(super) fn request(&self, group: &[usize], flags: u64) -> Request {
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
/// mode's [`FORCED`], [`RECEIPT`], [`REFUND`] or [`GIVE`], or 0.
pub(super) fn request(
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

/// The exact script call a [`RedisStore`](super::RedisStore) makes for a request alone in its batch, or
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

    /// One call deciding `requests` in order, as the batcher of a [`RedisStore`](super::RedisStore) with
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
                encoded.push(Encoded::new(c.limit).map_err(super::out_of_range)?);
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
pub(super) fn call_args<'a>(requests: &[&'a Request]) -> (Vec<u8>, Vec<&'a [u8]>) {
    script::dedup(
        requests
            .iter()
            .map(|r| (r.args.as_slice(), r.keys.as_slice())),
    )
}

/// One script call for one request, with the receipt it answers when it asked for one.
pub(super) async fn invoke(shared: &Shared, request: &Request) -> Result<Reply, Error> {
    invoke_reply(shared, &shared.conn, &[request]).await
}

/// One script call deciding `requests` in order.
pub(super) async fn invoke_all(
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
pub(super) async fn invoke_reply(
    shared: &Shared,
    conn: &Connection,
    requests: &[&Request],
) -> Result<Reply, Error> {
    let mask = requests.iter().fold(0, |m, r| m | r.mask);
    let built = shared.scripts.get(mask);
    let (index, distinct) = call_args(requests);
    // `FCALL <function>` or `EVALSHA <sha>`, then the same keys and arguments.
    let command = |name: &str, script: &str| {
        let mut cmd = redis::cmd(name);
        cmd.arg(script)
            .arg(requests.iter().map(|r| r.keys.len()).sum::<usize>());
        for k in requests.iter().flat_map(|r| r.keys.iter()) {
            cmd.arg(k);
        }
        cmd.arg(shared.slack_ms).arg(requests.len()).arg(&index);
        for a in &distinct {
            cmd.arg(a);
        }
        for r in requests.iter().filter_map(|r| r.receipt.as_deref()) {
            cmd.arg(r);
        }
        cmd
    };
    shared.calls.fetch_add(1, Ordering::Relaxed);
    let sent = std::time::Instant::now();
    let mut conn = conn.clone();
    let mut reply = None;
    if shared.functions.load(Ordering::Relaxed) {
        let fcall = command("FCALL", &built.function);
        reply = call_function(shared, &mut conn, built, &fcall).await;
    }
    let reply = match reply {
        Some(reply) => reply,
        None => {
            let evalsha = command("EVALSHA", built.script.get_hash());
            call_script(shared, &mut conn, built, &evalsha).await
        }
    };
    let reply = match reply {
        Ok(value) => {
            // Redis answered.
            shared.refused.clear();
            let took = u64::try_from(sent.elapsed().as_nanos()).unwrap_or(u64::MAX);
            shared.answered.fetch_add(1, Ordering::Relaxed);
            shared.answered_nanos.fetch_add(took, Ordering::Relaxed);
            read_reply(value)
        }
        Err(e) => Err(shared.failed(e)),
    };
    match reply {
        Ok(values) => {
            shared.breaker.success();
            Ok(values)
        }
        Err(e) => {
            shared.breaker.failure();
            shared.errors.fetch_add(1, Ordering::Relaxed);
            Err(e)
        }
    }
}

/// A script's reply as its answers and receipt.
fn read_reply(value: redis::Value) -> Result<Reply, Error> {
    let (bytes, receipt) = reply_parts(value)
        .ok_or_else(|| Error::backend("the script answered something else than a string"))?;
    let answers = script::answers(&bytes).ok_or_else(|| {
        Error::backend(format!(
            "the script answered {} bytes that are no answers",
            bytes.len()
        ))
    })?;
    Ok(Reply { answers, receipt })
}

/// A script's reply as its answers' string and, when it answered one, its receipt: a
/// string, or (a call that asked for a receipt, `lua/call.lua`) an array of the two.
pub(super) fn reply_parts(value: redis::Value) -> Option<(Vec<u8>, Option<Vec<u8>>)> {
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

/// Sends `evalsha`; when Redis does not have the script (`NOSCRIPT`: a restart, a
/// failover, `SCRIPT FLUSH`), loads it and sends it again. The load is a load in
/// progress, not a failure (see [`Warming`](super::warm::Warming)).
pub(super) async fn call_script(
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
