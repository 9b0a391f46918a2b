//! Resident memory per key: Tollgate's [`MemoryStore`] (one line per algorithm) against
//! governor's keyed limiter (`DefaultKeyedStateStore<String>`, a DashMap).
//!
//! Each variant inserts N = 1,000,000 keys `user:000000`..`user:999999` (one admitted
//! request per key) and reports the growth of the process's resident set (`VmRSS` in
//! `/proc/self/status`) divided by N. Each variant runs in a fresh child process (this
//! binary re-executed with `--variant <name>`) so that no variant inherits another's
//! heap. The keys are formatted into one reused buffer, so the figure holds only what
//! the limiter itself keeps (governor keeps its own copy of each key; Tollgate keeps a
//! 64-bit fingerprint).
//!
//! Nothing expires during a run: `now` is fixed for Tollgate, the windows are one hour
//! and the limits admit every insert; the store's `max_keys` (10,000,000) is above N.
//! Each child checks that it ends with N keys and no evictions.
//!
//! Linux only (it reads `/proc`). Run with:
//!
//! ```text
//! cargo bench -p tollgate --bench memory_per_key
//! ```

use std::fmt::Write as _;
use std::num::NonZeroU32;
use std::process::Command;
use std::time::Duration;

use governor::state::keyed::DefaultKeyedStateStore;
use governor::{Quota, RateLimiter};
use tollgate::algorithm::{
    Algorithm, FixedWindow, Gcra, LeakyBucket, LeakyMode, Limit, SlidingLog, SlidingWindow,
    TokenBucket,
};
use tollgate::clock::NANOS_PER_SEC;
use tollgate::store::{Check, MemoryStore};

/// Keys inserted per variant.
const N: usize = 1_000_000;
/// Tollgate's fixed `now`: a whole hour, 2023-11-14 00:00:00 UTC.
const NOW: u64 = 1_699_920_000 * NANOS_PER_SEC;
const HOUR: Duration = Duration::from_secs(3600);
/// Requests per hour for every limit but the sliding log: every insert is admitted.
const PER_HOUR: u64 = 1_000_000;

const VARIANTS: [&str; 7] = [
    "fixed_window",
    "sliding_window",
    "token_bucket",
    "gcra",
    "leaky_bucket_meter",
    "sliding_log",
    "governor_keyed",
];

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == "--variant") {
        Some(at) => {
            let variant = args.get(at + 1).expect("--variant needs a name");
            child(variant);
        }
        None => parent(),
    }
}

/// Runs every variant in its own process and prints the table.
fn parent() {
    let exe = std::env::current_exe().expect("the path of this executable");
    let mut rows = Vec::new();
    let mut sizes = String::new();
    for variant in VARIANTS {
        let out = Command::new(&exe)
            .args(["--variant", variant])
            .output()
            .expect("could not run a child process");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{variant} failed: {}{stdout}",
            String::from_utf8_lossy(&out.stderr)
        );
        let delta: u64 = stdout
            .lines()
            .find_map(|l| l.strip_prefix("rss_delta_bytes="))
            .and_then(|v| v.trim().parse().ok())
            .expect("the child prints rss_delta_bytes=");
        if let Some(note) = stdout.lines().find(|l| l.starts_with("size_of ")) {
            sizes = note.to_string();
        }
        rows.push((variant, delta));
    }
    let governor = rows
        .iter()
        .find(|r| r.0 == "governor_keyed")
        .map(|r| r.1 as f64 / N as f64)
        .expect("governor row");
    println!("memory per key, N = {N} keys, RSS growth / N (one process per variant)");
    println!(
        "{:<28} {:>14} {:>10} {:>12}",
        "variant", "RSS growth MB", "bytes/key", "vs governor"
    );
    for (variant, delta) in rows {
        let per_key = delta as f64 / N as f64;
        let name = if variant == "governor_keyed" {
            "governor keyed (DashMap)".to_string()
        } else {
            format!("tollgate {variant}")
        };
        println!(
            "{name:<28} {:>14.1} {per_key:>10.1} {:>11.2}x",
            delta as f64 / 1e6,
            per_key / governor
        );
    }
    println!("({sizes} bytes)");
}

/// Resident set size of this process, in bytes.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .expect("VmRSS in /proc/self/status")
}

fn key(buf: &mut String, i: usize) -> &str {
    buf.clear();
    write!(buf, "user:{i:06}").expect("formatting into a String");
    buf
}

fn child(variant: &str) {
    let mut buf = String::with_capacity(32);
    let (before, after, size_note) = if variant == "governor_keyed" {
        let quota = Quota::per_hour(NonZeroU32::new(1000).expect("nonzero"));
        let limiter: RateLimiter<String, DefaultKeyedStateStore<String>, _, _> =
            RateLimiter::keyed(quota);
        let before = rss();
        let mut owned = String::with_capacity(32);
        for i in 0..N {
            owned.clear();
            owned.push_str(key(&mut buf, i));
            assert!(limiter.check_key(&owned).is_ok(), "governor rejected {i}");
        }
        let after = rss();
        assert_eq!(limiter.len(), N);
        (before, after, String::new())
    } else {
        let algorithm = match variant {
            "fixed_window" => Algorithm::FixedWindow(FixedWindow::new(PER_HOUR, HOUR)),
            "sliding_window" => Algorithm::SlidingWindow(SlidingWindow::new(PER_HOUR, HOUR)),
            "token_bucket" => Algorithm::TokenBucket(TokenBucket::new(PER_HOUR, HOUR)),
            "gcra" => Algorithm::Gcra(Gcra::new(PER_HOUR, HOUR)),
            "leaky_bucket_meter" => {
                Algorithm::LeakyBucket(LeakyBucket::new(PER_HOUR, HOUR, LeakyMode::Meter))
            }
            "sliding_log" => Algorithm::SlidingLog(SlidingLog::new(10, HOUR)),
            other => panic!("unknown variant {other}"),
        };
        let limit = Limit::new(algorithm).expect("a valid limit");
        let store = MemoryStore::new();
        let before = rss();
        for i in 0..N {
            let d = store.check_one(NOW, &Check::new(&limit, key(&mut buf, i), 1));
            assert!(d.allowed, "tollgate rejected {i}");
        }
        let after = rss();
        let stats = store.stats();
        assert_eq!((stats.keys, stats.evictions), (N, 0), "keys, evictions");
        let note = format!(
            "size_of KeyState={} LogState={} WindowState={}",
            std::mem::size_of::<tollgate::algorithm::KeyState>(),
            std::mem::size_of::<tollgate::algorithm::LogState>(),
            std::mem::size_of::<tollgate::algorithm::WindowState>()
        );
        (before, after, note)
    };
    println!("variant={variant}");
    println!("rss_before_bytes={before}");
    println!("rss_after_bytes={after}");
    println!("rss_delta_bytes={}", after.saturating_sub(before));
    println!("{size_note}");
}
