//! The Lua scripts: one per algorithm, assembled with the shared prelude and the
//! request driver, plus the encoding of checks into `ARGV` and of replies back into
//! [`Decision`]s.
//!
//! Each algorithm's Lua lives in its own file under `lua/`, mirroring its Rust file
//! under `algorithm/`. A request whose checks all use one algorithm (the usual case)
//! runs that algorithm's script; a request mixing algorithms runs a script holding
//! just those, so that it stays one atomic call. Scripts are built and hashed once.
//!
//! Each script exists in two forms from the same Lua: an `EVAL` script (`source`),
//! whose whole chunk runs on every call, and a Redis Functions library (`library`,
//! Redis 7 and later), which defines the prelude, the algorithms and the general path
//! once, when it is loaded, and registers the per-call code (`lua/call.lua`) as one
//! function. The store calls the function with `FCALL` and loads the library again
//! when Redis answers that the function is missing (after a restart, a failover or
//! `FUNCTION FLUSH`); where Redis has no functions (or its ACL forbids them) it uses
//! `EVALSHA`, and redis-rs loads the script again on `NOSCRIPT`.

use std::collections::{HashMap, HashSet};
use std::sync::OnceLock;

use redis::Script;

use crate::algorithm::{warm_tick, Algorithm, LeakyMode, Limit, SUB_WINDOWS};
use crate::decision::{Decision, NEVER};
use crate::store::{ChargeRejected, Check};

const PRELUDE: &str = include_str!("lua/prelude.lua");
/// The bucket algorithms' shared arithmetic, before their own files.
const BUCKET: &str = include_str!("lua/bucket.lua");
/// The algorithm codes (bit `code - 1`) that use [`BUCKET`]: token bucket, GCRA, leaky
/// bucket.
const BUCKETS: u8 = 0b111000;
const DRIVER: &str = include_str!("lua/driver.lua");
const CALL: &str = include_str!("lua/call.lua");
/// Per algorithm code (1-based): its Lua.
const MODULES: [&str; 6] = [
    include_str!("lua/fixed_window.lua"),
    include_str!("lua/sliding_window.lua"),
    include_str!("lua/sliding_log.lua"),
    include_str!("lua/token_bucket.lua"),
    include_str!("lua/gcra.lua"),
    include_str!("lua/leaky_bucket.lua"),
];

/// Bytes per check in a request's packed argument (11 doubles; see `lua/driver.lua`).
pub(crate) const CHECK_BYTES: usize = 11 * 8;
/// What the script answers, per check, for a request it failed on.
pub(crate) const FAILED: i64 = -2;
/// Every quantity handed to Lua stays below this, so doubles hold it exactly.
const LUA_MAX: u64 = 1 << 51;

/// The scripts, built on first use: one per set of algorithms.
pub(crate) struct Scripts {
    by_set: [OnceLock<Built>; 64],
}

/// One set of algorithms' script in both forms.
pub(crate) struct Built {
    /// The `EVAL` form's source.
    pub source: String,
    /// The `EVAL` form (called with `EVALSHA`).
    pub script: Script,
    /// The name of the library and of its one function: `tollgate_` and the `EVAL`
    /// form's SHA-1, so that two versions of Tollgate sharing a Redis never replace
    /// each other's functions.
    pub function: String,
    /// The library's source, for `FUNCTION LOAD`.
    pub library: String,
}

impl Default for Scripts {
    fn default() -> Self {
        Self {
            by_set: std::array::from_fn(|_| OnceLock::new()),
        }
    }
}

impl Scripts {
    /// The script for the set of algorithm codes `mask` (bit `code - 1`).
    pub fn get(&self, mask: u8) -> &Built {
        let mask = mask & 63;
        self.by_set[mask as usize].get_or_init(|| Built::new(mask))
    }
}

impl Built {
    /// Both forms of the script for the set of algorithm codes `mask`.
    pub fn new(mask: u8) -> Self {
        let source = source(mask);
        let script = Script::new(&source);
        let function = format!("tollgate_{}", script.get_hash());
        let library = library(mask, &function);
        Self {
            source,
            script,
            function,
            library,
        }
    }
}

/// The Lua source for a set of algorithms, as one `EVAL` script.
pub(crate) fn source(mask: u8) -> String {
    let mut src = definitions(mask);
    src.push_str(CALL);
    src
}

/// The same Lua as a Redis Functions library named `name`, registering one function
/// of that name (called as `FCALL name numkeys keys... args...`).
pub(crate) fn library(mask: u8, name: &str) -> String {
    let mut src = format!("#!lua name={name}\n");
    src.push_str(&definitions(mask));
    src.push_str("local function call(KEYS, ARGV)\n");
    src.push_str(CALL);
    src.push_str(&format!("end\nredis.register_function('{name}', call)\n"));
    src
}

/// The prelude, the algorithms in `mask` (after the buckets' arithmetic, when one of
/// them is) and the general path: definitions only.
fn definitions(mask: u8) -> String {
    let mut src = String::from(PRELUDE);
    if mask & BUCKETS != 0 {
        src.push_str(BUCKET);
    }
    for (i, module) in MODULES.iter().enumerate() {
        if mask & (1 << i) != 0 {
            src.push_str(module);
        }
    }
    src.push_str(DRIVER);
    src
}

/// The Lua source of the script a request using these algorithms runs (names as in
/// rule files: `fixed_window`, `sliding_window`, `sliding_log`, `token_bucket`, `gcra`,
/// `leaky_bucket`), to review it or to pre-load it with `SCRIPT LOAD`.
pub fn script_source(algorithms: &[&str]) -> Result<String, ScriptNameError> {
    Ok(source(algorithm_mask(algorithms)?))
}

/// The same script as a Redis Functions library, as the store loads it on Redis 7 and
/// later: the function's name (also the library's) and the library's source, for
/// `FUNCTION LOAD` and `FCALL name numkeys keys... args...`.
pub fn script_library(algorithms: &[&str]) -> Result<(String, String), ScriptNameError> {
    let built = Built::new(algorithm_mask(algorithms)?);
    Ok((built.function, built.library))
}

/// The algorithms the scripts implement, as rule files name them, in the order of their
/// codes in the scripts: what [`script_source`] and [`script_library`] accept.
pub const SCRIPT_ALGORITHMS: [&str; 6] = crate::algorithm::NAMES;

/// The set of algorithm codes (bit `code - 1`) of these rule-file names.
fn algorithm_mask(algorithms: &[&str]) -> Result<u8, ScriptNameError> {
    let mut mask = 0u8;
    for name in algorithms {
        match SCRIPT_ALGORITHMS.iter().position(|n| n == name) {
            Some(i) => mask |= 1 << i,
            None => return Err(ScriptNameError::Unknown((*name).to_string())),
        }
    }
    if mask == 0 {
        return Err(ScriptNameError::None);
    }
    Ok(mask)
}

/// Why [`script_source`] or [`script_library`] has no script for these names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ScriptNameError {
    /// A name that is not one of [`SCRIPT_ALGORITHMS`].
    #[error("unknown algorithm `{0}` (expected one of: {names})", names = SCRIPT_ALGORITHMS.join(", "))]
    Unknown(String),
    /// No name at all.
    #[error("name at least one algorithm")]
    None,
}

/// One check as the scripts see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Encoded {
    /// Algorithm code, 1 to 6 (`lua/driver.lua`).
    pub alg: u8,
    /// Nanoseconds per tick: 1, 1 000, 1 000 000 or 1 000 000 000.
    pub tick: u64,
    limit: u64,
    window: u64,
    burst: u64,
    r: u64,
    wr: u64,
    /// Lockout duration in ticks (0: none).
    pub lockout: u64,
    queue: bool,
    /// The token bucket's and GCRA's overdraft in units (0: none); sent in the place
    /// of the leaky bucket's queue flag.
    overdraft: u64,
    /// A token bucket's or GCRA's warm-up as `M = warmup × r` in the scaled ticks
    /// (`None`: none); sent as [`WARM`] + M in the place of the overdraft.
    warm: Option<u64>,
}

/// A check's last argument from this on is a warm-up's M (`lua/prelude.lua` `WARM`).
const WARM: u64 = 1 << 51;

/// Why a limit cannot be run by the scripts.
#[derive(Debug, thiserror::Error)]
#[error("the limit {} is out of the Redis scripts' exact range (window, (2 x (burst + overdraft) + 1) x window / gcd(limit, window) and limit below 2^51 ticks of 1 s; a warm-up's warmup x limit / gcd(limit, window) below 2^49 ticks)", describe(.0))]
pub(crate) struct OutOfRange(pub Algorithm);

/// A limit in words, as a rule file would say it: "gcra, 10 per 3600 s, burst 20".
fn describe(a: &Algorithm) -> String {
    let window = a.window();
    let window = if window % 1_000_000_000 == 0 {
        format!("{} s", window / 1_000_000_000)
    } else {
        format!("{window} ns")
    };
    let burst = match a {
        Algorithm::TokenBucket(t) => Some(t.burst),
        Algorithm::Gcra(g) => Some(g.burst),
        Algorithm::LeakyBucket(l) => Some(l.burst),
        _ => None,
    };
    let burst = burst.map_or_else(String::new, |b| format!(", burst {b}"));
    let overdraft = match a {
        Algorithm::TokenBucket(t) if t.overdraft > 0 => format!(", overdraft {}", t.overdraft),
        Algorithm::Gcra(g) if g.overdraft > 0 => format!(", overdraft {}", g.overdraft),
        _ => String::new(),
    };
    let warmup = match a.warmup() {
        0 => String::new(),
        p => format!(", warmup {p} ns"),
    };
    format!(
        "{}, {} per {window}{burst}{overdraft}{warmup}",
        a.name(),
        a.limit()
    )
}

impl Encoded {
    /// Encodes a limit, choosing the finest tick (1 ns, then 1 us, 1 ms, 1 s) at which
    /// the scripts' arithmetic is exact.
    pub fn new(limit: &Limit) -> Result<Self, OutOfRange> {
        let a = limit.algorithm();
        let (alg, burst, queue, overdraft) = match a {
            Algorithm::FixedWindow(_) => (1, 0, false, 0),
            Algorithm::SlidingWindow(_) => (2, 0, false, 0),
            Algorithm::SlidingLog(_) => (3, 0, false, 0),
            Algorithm::TokenBucket(t) => (4, t.burst, false, t.overdraft),
            Algorithm::Gcra(g) => (5, g.burst, false, g.overdraft),
            Algorithm::LeakyBucket(l) => (6, l.burst, l.mode == LeakyMode::Queue, 0),
        };
        let lockout = limit.lockout().map_or(0, |l| l.duration);
        let value = a.limit();
        // A warm-up is computed at the one tick whose grid the in-memory store rounds
        // its extra time to (`algorithm::warm_tick`).
        let warm_tick = match a.warm_parts() {
            Some((l, w, b, _, p)) => Some((warm_tick(l, w, b, p).ok_or(OutOfRange(*a))?.0, p)),
            None => None,
        };
        if value >= LUA_MAX || burst.saturating_add(overdraft) >= LUA_MAX {
            return Err(OutOfRange(*a));
        }
        for tick in [1, 1_000, 1_000_000, 1_000_000_000] {
            if a.window() % tick != 0 || warm_tick.is_some_and(|(t, _)| t != tick) {
                continue;
            }
            // The sliding window's sub-windows must be whole ticks as well, and the same
            // length in both (`sliding_window::sub_len`).
            if alg == 2 && tick > 1 && a.window() % (SUB_WINDOWS as u64 * tick) != 0 {
                continue;
            }
            let window = a.window() / tick;
            let lockout = lockout.div_ceil(tick);
            if window >= LUA_MAX || lockout >= LUA_MAX {
                continue;
            }
            let (r, wr) = if value == 0 {
                (1, window)
            } else {
                let g = gcd(value, window);
                (value / g, window / g)
            };
            let scaled = (2 * (u128::from(burst) + u128::from(overdraft)) + 1) * u128::from(wr);
            if matches!(alg, 4..=6) && scaled >= u128::from(LUA_MAX) {
                continue;
            }
            // Below 2^49 (`warm_tick`): the scripts' products of it stay exact.
            let warm = warm_tick.map(|(_, p)| p / tick * r);
            return Ok(Self {
                alg,
                tick,
                limit: value,
                window,
                burst,
                r,
                wr,
                lockout,
                queue,
                overdraft,
                warm,
            });
        }
        Err(OutOfRange(*a))
    }

    /// Appends this check's fields to its request's packed argument. `spanning`: the
    /// request is one call per slot of a cluster, where no call sees every quota-mode
    /// check: those go as shadow-mode checks, and the store applies the quota rule to
    /// the answers (taking back the other slots' charges when it rejects).
    pub fn push_args(&self, check: &Check<'_>, args: &mut Vec<u8>, spanning: bool) {
        let (shadow, quota) = match check.quota {
            Some(_) if spanning => (true, None),
            q => (check.shadow, q),
        };
        let charge = match check.charge {
            ChargeRejected::None => 0,
            ChargeRejected::OverLimit => 1,
            ChargeRejected::All => 2,
        };
        let flags = u64::from(shadow)
            | u64::from(quota.is_some()) << 1
            | charge << 2
            | u64::from(quota.unwrap_or(0)) << 4;
        pack(
            args,
            &[
                u64::from(self.alg),
                self.tick,
                self.limit,
                self.window,
                self.burst,
                self.r,
                self.wr,
                check.cost.min(LUA_MAX),
                flags,
                self.lockout,
                if self.alg == 6 {
                    u64::from(self.queue)
                } else if let Some(m) = self.warm {
                    WARM + m
                } else {
                    self.overdraft
                },
            ],
        );
    }

    /// The decision from this check's five reply integers.
    pub fn decode(&self, limit: u64, v: &[i64]) -> Decision {
        let ticks = |t: i64| u64::try_from(t).unwrap_or(0).saturating_mul(self.tick);
        let remaining = u64::try_from(v[1]).unwrap_or(0);
        let mut d = if v[0] == 1 {
            Decision::allow(limit, remaining, ticks(v[2]))
        } else {
            let retry = if v[3] < 0 { NEVER } else { ticks(v[3]) };
            Decision::reject(limit, remaining, ticks(v[2]), retry)
        };
        // A delay of -1: an admission in overdraft (`lua/bucket.lua`).
        d.overdraft = v[0] == 1 && v[4] == -1;
        d.delay = ticks(v[4]);
        d
    }
}

/// Appends numbers as little-endian doubles (exact: every number here is below 2^53),
/// the form `lua/driver.lua` unpacks with one `struct.unpack`.
pub(crate) fn pack(out: &mut Vec<u8>, numbers: &[u64]) {
    for &n in numbers {
        out.extend_from_slice(&(n as f64).to_le_bytes());
    }
}

/// The most distinct packed arguments one script call can name: the index has two
/// bytes per request, whose top bit is [`REREAD`].
pub(crate) const MAX_ARGUMENTS: usize = 1 << 15;

/// The top bit of a request's index entry: a key of the request is also a key of an
/// earlier request in the call, so the script reads its state again (`GET`) instead of
/// taking the value it read for every key before the first request (`MGET`), which an
/// earlier request may have changed since.
pub(crate) const REREAD: u16 = 1 << 15;

/// The packed arguments of a batch's requests, each distinct one once, and the index
/// string that names each request's (two little-endian bytes per request, counting
/// from the first distinct argument, plus [`REREAD`] when one of its keys came in an
/// earlier request). Under Redis `TIME` the requests of one limit and cost are the
/// same bytes: Redis then makes one argument where it made one per request, and the
/// script unpacks it once. A batch holds at most `MAX_BATCH` requests, far fewer than
/// [`MAX_ARGUMENTS`].
pub(crate) fn dedup<'a>(
    requests: impl Iterator<Item = (&'a [u8], &'a [String])>,
) -> (Vec<u8>, Vec<&'a [u8]>) {
    let mut seen: HashMap<&[u8], u16, ahash::RandomState> = HashMap::default();
    let mut keys: HashSet<&str, ahash::RandomState> = HashSet::default();
    let mut distinct = Vec::new();
    let mut index = Vec::new();
    for (a, request_keys) in requests {
        debug_assert!(
            distinct.len() < MAX_ARGUMENTS,
            "more arguments than the index names"
        );
        let next = u16::try_from(distinct.len()).unwrap_or(REREAD - 1);
        let mut i = *seen.entry(a).or_insert_with(|| {
            distinct.push(a);
            next
        });
        // Every key inserted (not stopping at the first seen): a later request must
        // find each one.
        let mut again = false;
        for k in request_keys {
            again |= !keys.insert(k.as_str());
        }
        if again {
            i |= REREAD;
        }
        index.extend_from_slice(&i.to_le_bytes());
    }
    (index, distinct)
}

/// The script's reply (see `lua/driver.lua`: little-endian doubles; per check either
/// -1 and its five numbers, or for a check admitted with no retry and no delay just its
/// remaining count and reset time) as five integers per check: allowed, remaining,
/// reset after, retry after (-1: never), delay. `None` when the reply is not such a
/// sequence (cut short, or a record that starts with neither).
pub(crate) fn answers(reply: &[u8]) -> Option<Vec<i64>> {
    if reply.len() % 8 != 0 {
        return None;
    }
    let mut numbers = reply.chunks_exact(8).map(|b| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(b);
        f64::from_le_bytes(bytes)
    });
    // Saturating conversions; every value the script answers is an integer in range.
    let mut out = Vec::with_capacity(reply.len() / 8 * 5 / 2);
    while let Some(first) = numbers.next() {
        if first >= 0.0 {
            let reset = numbers.next()?;
            out.extend_from_slice(&[1, first as i64, reset as i64, 0, 0]);
        } else if first == -1.0 {
            for _ in 0..5 {
                out.push(numbers.next()? as i64);
            }
        } else {
            return None;
        }
    }
    Some(out)
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{Gcra, TokenBucket};
    use std::time::Duration;

    #[test]
    fn each_distinct_argument_is_sent_once() {
        let (a, b, c): (&[u8], &[u8], &[u8]) = (b"aaaa", b"bb", b"aaaa");
        let k = |names: &[&str]| -> Vec<String> { names.iter().map(|n| n.to_string()).collect() };
        let (kx, ky, kz, kxz) = (k(&["x"]), k(&["y"]), k(&["z"]), k(&["q", "x"]));
        let (index, distinct) = dedup(
            [(a, &kx), (b, &ky), (c, &kz), (b, &kxz)]
                .into_iter()
                .map(|(a, k)| (a, k.as_slice())),
        );
        assert_eq!(distinct, vec![a, b]);
        // The 4th request shares key x with the 1st: it reads its state again.
        assert_eq!(index, vec![0, 0, 1, 0, 0, 0, 1, 0x80]);
        // Past 255 distinct arguments, the second byte counts too.
        let many: Vec<Vec<u8>> = (0u32..300).map(|i| i.to_le_bytes().to_vec()).collect();
        let names: Vec<Vec<String>> = (0..300).map(|i| vec![format!("k{i}")]).collect();
        let (index, distinct) = dedup(
            many.iter()
                .zip(&names)
                .map(|(a, k)| (a.as_slice(), k.as_slice())),
        );
        assert_eq!(distinct.len(), 300);
        assert_eq!(&index[2 * 299..], &299u16.to_le_bytes());
    }

    #[test]
    fn answers_are_five_numbers_per_check_in_two_forms() {
        let mut reply = Vec::new();
        // Long: rejected, never; short: admitted with 7 left, reset in 3e9; long:
        // failed; long: admitted with a delay.
        let doubles = [
            -1.0f64, 0.0, 0.0, 5.0, -1.0, 0.0, //
            7.0, 3e9, //
            -1.0, -2.0, 0.0, 0.0, 0.0, 0.0, //
            -1.0, 1.0, 2.0, 8.0, 0.0, 4.0,
        ];
        for v in doubles {
            reply.extend_from_slice(&v.to_le_bytes());
        }
        assert_eq!(
            answers(&reply),
            Some(vec![
                0,
                0,
                5,
                -1,
                0, //
                1,
                7,
                3_000_000_000,
                0,
                0, //
                -2,
                0,
                0,
                0,
                0, //
                1,
                2,
                8,
                0,
                4
            ])
        );
        assert_eq!(answers(&[]), Some(vec![]));
        // A reply cut short is not read as fewer checks, in either form.
        assert_eq!(answers(&reply[..reply.len() - 8]), None);
        assert_eq!(answers(&reply[..6 * 8 + 8]), None);
        assert_eq!(answers(&reply[..reply.len() - 3]), None);
        // A record starting with another negative number is no answer.
        assert_eq!(answers(&(-3.0f64).to_le_bytes()), None);
    }

    #[test]
    fn ticks_are_as_fine_as_exactness_allows() {
        let day = Limit::new(Algorithm::Gcra(Gcra::new(
            10_000,
            Duration::from_secs(86_400),
        )))
        .unwrap();
        assert_eq!(Encoded::new(&day).unwrap().tick, 1);
        // A prime limit per hour: burst x window / gcd is too large in nanoseconds.
        let odd = Limit::new(Algorithm::TokenBucket(TokenBucket::new(
            99_991,
            Duration::from_secs(3_600),
        )))
        .unwrap();
        assert_eq!(Encoded::new(&odd).unwrap().tick, 1_000);
        let year = Limit::new(Algorithm::FixedWindow(crate::algorithm::FixedWindow::new(
            5,
            Duration::from_secs(365 * 86_400),
        )))
        .unwrap();
        assert_eq!(Encoded::new(&year).unwrap().tick, 1_000);
        let huge = Limit::new(Algorithm::Gcra(Gcra::new(
            4_000_000_007,
            Duration::from_secs(365 * 86_400),
        )))
        .unwrap();
        let err = Encoded::new(&huge).expect_err("beyond even 1 s ticks");
        assert!(
            err.to_string().starts_with(
                "the limit gcra, 4000000007 per 31536000 s, burst 4000000007 is out of"
            ),
            "{err}"
        );
        // A prime per year: too big for 1 ms ticks, fine at 1 s.
        let yearly = Limit::new(Algorithm::Gcra(Gcra::new(
            1_000_003,
            Duration::from_secs(365 * 86_400),
        )))
        .unwrap();
        assert_eq!(Encoded::new(&yearly).unwrap().tick, 1_000_000_000);
    }

    #[test]
    fn every_algorithm_set_gets_its_own_script() {
        let one = source(0b10000);
        assert!(one.contains("ALG[5]") && !one.contains("ALG[1]"));
        let two = source(0b10001);
        assert!(two.contains("ALG[5]") && two.contains("ALG[1]"));
        let s = Scripts::default();
        assert_ne!(
            s.get(0b10000).script.get_hash(),
            s.get(0b10001).script.get_hash()
        );
        // The library form: named after the EVAL form's hash, the same Lua around one
        // registered function.
        let built = s.get(0b10001);
        assert_eq!(
            built.function,
            format!("tollgate_{}", built.script.get_hash())
        );
        assert_ne!(built.function, s.get(0b10000).function);
        let first = built.library.lines().next().unwrap_or_default();
        assert_eq!(first, format!("#!lua name={}", built.function));
        assert!(built.library.contains("ALG[5]") && built.library.contains("ALG[1]"));
        assert!(built.library.ends_with(&format!(
            "redis.register_function('{}', call)\n",
            built.function
        )));
    }
}
