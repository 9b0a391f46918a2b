//! The worked cases of `tests/cases/tollgate/` (and the project's overdraft and warm-up
//! cases) that
//! need only the algorithms (one
//! descriptor, one entry, one limit), run on the in-memory store with a manual clock.
//!
//! The full rule engine runs every case file through `tollgate conformance`; this test
//! pins the algorithms to the same numbers before any rule engine is involved.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

use std::path::PathBuf;
use std::time::Duration;

use serde_norway::Value;
use tollgate::algorithm::{
    Algorithm, FixedWindow, Gcra, LeakyBucket, LeakyMode, Limit, SlidingLog, SlidingWindow,
    TokenBucket,
};
use tollgate::clock::{secs_f64_to_nanos, Clock, ManualClock, NANOS_PER_SEC};
use tollgate::store::{Check, MemoryStore};

const ALGORITHM_ONLY: [&str; 9] = [
    "01-token-bucket.yaml",
    "02-gcra.yaml",
    "03-sliding-window.yaml",
    "04-sliding-log.yaml",
    "06-lockout.yaml",
    // The project's own (tests/cases/project/), beside the shared ones.
    "../project/19-overdraft.yaml",
    "../project/20-overdraft-gcra.yaml",
    "../project/23-warmup.yaml",
    "../project/24-warmup-gcra.yaml",
];

fn cases_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/cases/tollgate")
}

fn field<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.as_mapping().and_then(|m| m.get(key))
}

fn unit_seconds(unit: &str) -> u64 {
    match unit.to_ascii_lowercase().as_str() {
        "second" => 1,
        "minute" => 60,
        "hour" => 3600,
        "day" => 86_400,
        other => panic!("unit {other} not used by the algorithm cases"),
    }
}

/// Parses a duration like `15m`, `900s`, `1h`.
fn duration(text: &str) -> Duration {
    let (n, unit) = text.split_at(text.len() - 1);
    let n: u64 = n.parse().expect("a number before the unit");
    Duration::from_secs(
        n * match unit {
            "s" => 1,
            "m" => 60,
            "h" => 3600,
            _ => panic!("unknown duration unit in {text}"),
        },
    )
}

/// Builds the limit of the config's only descriptor; returns (key, limit, unit name).
fn limit_of(config: &Value) -> (String, Limit, String) {
    let descriptor = &field(config, "descriptors").unwrap().as_sequence().unwrap()[0];
    let key = field(descriptor, "key")
        .unwrap()
        .as_str()
        .unwrap()
        .to_string();
    let rl = field(descriptor, "rate_limit").expect("one rate_limit");
    let unit = field(rl, "unit").unwrap().as_str().unwrap().to_string();
    let n = field(rl, "requests_per_unit").unwrap().as_u64().unwrap();
    let window = Duration::from_secs(unit_seconds(&unit));
    let burst = field(rl, "burst").and_then(Value::as_u64).unwrap_or(n);
    let overdraft = field(rl, "overdraft").and_then(Value::as_u64).unwrap_or(0);
    let warmup = field(rl, "warmup")
        .and_then(Value::as_str)
        .map_or(Duration::ZERO, duration);
    let algorithm = match field(rl, "algorithm")
        .and_then(Value::as_str)
        .unwrap_or("fixed_window")
    {
        "fixed_window" => Algorithm::FixedWindow(FixedWindow::new(n, window)),
        "sliding_window" => Algorithm::SlidingWindow(SlidingWindow::new(n, window)),
        "sliding_log" => Algorithm::SlidingLog(SlidingLog::new(n, window)),
        "token_bucket" => Algorithm::TokenBucket(
            TokenBucket::new(n, window)
                .with_burst(burst)
                .with_overdraft(overdraft)
                .with_warmup(warmup),
        ),
        "gcra" => Algorithm::Gcra(
            Gcra::new(n, window)
                .with_burst(burst)
                .with_overdraft(overdraft)
                .with_warmup(warmup),
        ),
        "leaky_bucket" => {
            Algorithm::LeakyBucket(LeakyBucket::new(n, window, LeakyMode::Meter).with_burst(burst))
        }
        other => panic!("unknown algorithm {other}"),
    };
    let mut limit = Limit::new(algorithm).unwrap();
    if let Some(block) = field(rl, "block_duration").and_then(Value::as_str) {
        limit = limit.with_lockout(duration(block));
    }
    (key, limit, unit)
}

/// Runs one case file; returns the failures as readable lines.
fn run_case(file: &str) -> Vec<String> {
    let text = std::fs::read_to_string(cases_dir().join(file)).unwrap();
    let case: Value = serde_norway::from_str(&text).unwrap();
    let config: Value =
        serde_norway::from_str(field(&case, "config").unwrap().as_str().unwrap()).unwrap();
    let (key, limit, unit) = limit_of(&config);
    let clock = ManualClock::new(field(&case, "start").unwrap().as_u64().unwrap() * NANOS_PER_SEC);
    let store = MemoryStore::new();
    let mut failures = Vec::new();
    for (i, step) in field(&case, "steps")
        .unwrap()
        .as_sequence()
        .unwrap()
        .iter()
        .enumerate()
    {
        if let Some(advance) = field(step, "advance") {
            clock.advance_nanos(secs_f64_to_nanos(advance.as_f64().unwrap()));
        }
        let repeat = field(step, "repeat").and_then(Value::as_u64).unwrap_or(1);
        let request = field(step, "request").unwrap();
        let descriptor = &field(request, "descriptors")
            .unwrap()
            .as_sequence()
            .unwrap()[0];
        let entry = &field(descriptor, "entries").unwrap().as_sequence().unwrap()[0];
        let entry = entry.as_sequence().unwrap();
        assert_eq!(
            entry[0].as_str(),
            Some(key.as_str()),
            "{file}: one key per case"
        );
        let value = entry[1].as_str().unwrap().to_string();
        let expect = field(step, "expect").unwrap();
        for r in 0..repeat {
            let d = store.check_one(clock.now(), &Check::new(&limit, &value, 1));
            let at = format!("{file} step {} (repeat {}/{repeat})", i + 1, r + 1);
            let code = if d.allowed { "OK" } else { "OVER_LIMIT" };
            if let Some(overall) = field(expect, "overall").and_then(Value::as_str) {
                if overall != code {
                    failures.push(format!("{at}: overall {code}, expected {overall}"));
                }
            }
            let Some(status) =
                field(expect, "statuses").and_then(|s| s.as_sequence()?.first().cloned())
            else {
                continue;
            };
            let expect_u64 = |name: &str| field(&status, name).and_then(Value::as_u64);
            if let Some(c) = field(&status, "code").and_then(Value::as_str) {
                if c != code {
                    failures.push(format!("{at}: code {code}, expected {c}"));
                }
            }
            if let Some(rem) = expect_u64("remaining") {
                if rem != d.remaining {
                    failures.push(format!("{at}: remaining {}, expected {rem}", d.remaining));
                }
            }
            if let Some(flag) = field(&status, "overdraft").and_then(Value::as_bool) {
                if flag != d.overdraft {
                    failures.push(format!("{at}: overdraft {}, expected {flag}", d.overdraft));
                }
            }
            if let Some(reset) = expect_u64("reset_seconds") {
                if reset != d.reset_after_secs() {
                    failures.push(format!(
                        "{at}: reset {}s, expected {reset}s",
                        d.reset_after_secs()
                    ));
                }
            }
            if let Some(l) = field(&status, "limit") {
                let rpu = field(l, "requests_per_unit").and_then(Value::as_u64);
                let u = field(l, "unit")
                    .and_then(Value::as_str)
                    .map(str::to_ascii_lowercase);
                if rpu != Some(d.limit) || u.as_deref() != Some(unit.to_ascii_lowercase().as_str())
                {
                    failures.push(format!("{at}: limit {}/{unit}, expected {l:?}", d.limit));
                }
            }
        }
    }
    failures
}

#[test]
fn every_algorithm_case_passes() {
    let mut failures = Vec::new();
    for file in ALGORITHM_ONLY {
        failures.extend(run_case(file));
    }
    assert!(
        failures.is_empty(),
        "failing steps:\n{}",
        failures.join("\n")
    );
}

#[test]
fn the_harness_notices_a_wrong_limit() {
    // Guards the test above against passing vacuously: the same steps with the token
    // bucket's burst halved must fail.
    let text = std::fs::read_to_string(cases_dir().join("01-token-bucket.yaml")).unwrap();
    let broken = text.replace("burst: 20", "burst: 10");
    let dir = std::env::temp_dir().join(format!("tollgate-cases-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("broken.yaml"), broken).unwrap();
    // `join` with an absolute path yields that path, so run_case reads the broken copy.
    let broken_path = dir.join("broken.yaml").to_string_lossy().into_owned();
    assert!(!run_case(&broken_path).is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}
