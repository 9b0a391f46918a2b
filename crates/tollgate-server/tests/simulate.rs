//! `tollgate simulate` as a user runs it: the report's numbers for the boundary pattern
//! and a replayed file, every pattern writing its three files, clear errors for bad
//! input, and the report page rendered by a real browser.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn tempdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tollgate-simulate-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn tollgate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("simulate")
        .args(args)
        .env_remove("TOLLGATE_LOG")
        .output()
        .unwrap()
}

/// Runs a simulation of the test rules into `out`; returns report.json.
fn simulate(out: &Path, args: &[&str]) -> Value {
    let rules = data("simulate-rules.yaml");
    let mut all = vec![
        "--config",
        rules.to_str().unwrap(),
        "--domain",
        "api",
        "--out",
        out.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    let output = tollgate(&all);
    assert!(
        output.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    for file in ["report.html", "report.json", "timeline.csv"] {
        assert!(out.join(file).is_file(), "{args:?}: no {file}");
    }
    serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap()
}

fn n(v: &Value, algorithm: &str, field: &str) -> f64 {
    v["algorithms"][algorithm][field]
        .as_f64()
        .unwrap_or_else(|| panic!("no {algorithm}.{field} in {v}"))
}

/// A boundary burst of 20 on alice for 5 s, under every algorithm.
const BOUNDARY_ALL: &[&str] = &[
    "--descriptor",
    "user=alice",
    "--pattern",
    "boundary:20",
    "--duration",
    "5s",
    "--algorithms",
    "all",
];

#[test]
fn boundary_lets_twice_the_limit_through_a_fixed_window_and_no_more_than_the_limit_through_the_log()
{
    let out = tempdir("boundary");
    let v = simulate(&out, BOUNDARY_ALL);
    assert_eq!(v["pattern"], "boundary:20");
    assert_eq!(v["limit"]["requests_per_unit"], 20);
    assert_eq!(v["limit"]["unit"], "second");
    let names: Vec<&String> = v["algorithms"].as_object().unwrap().keys().collect();
    assert_eq!(
        names,
        [
            "fixed_window",
            "sliding_window",
            "sliding_log",
            "token_bucket",
            "gcra",
            "leaky_bucket"
        ]
    );
    let limit = 20.0;
    // 4 turns, 20 just before and 20 just after each.
    assert_eq!(n(&v, "fixed_window", "offered"), 160.0);
    let fixed = n(&v, "fixed_window", "max_in_any_window");
    assert!(
        fixed >= 1.9 * limit && fixed <= 2.0 * limit,
        "fixed window: {fixed}"
    );
    assert!(n(&v, "sliding_log", "max_in_any_window") <= limit);
    assert_eq!(n(&v, "sliding_log", "wrong_vs_exact_percent"), 0.0);
    let burst = n(&v, "token_bucket", "burst");
    assert_eq!(burst, limit);
    assert!(n(&v, "token_bucket", "max_in_any_window") <= burst + limit);
    assert!(n(&v, "fixed_window", "wrong_vs_exact_percent") > 0.0);
    for name in names {
        assert_eq!(n(&v, name, "offered"), 160.0, "{name}");
        assert!(n(&v, name, "admitted") <= 160.0, "{name}");
    }
    let csv = std::fs::read_to_string(out.join("timeline.csv")).unwrap();
    let mut lines = csv.lines();
    assert!(lines
        .next()
        .unwrap()
        .starts_with("second,offered,admitted_fixed_window,differ_fixed_window,"));
    assert_eq!(lines.count(), 5);
}

#[test]
fn replay_runs_every_key_of_the_file_with_its_costs() {
    let out = tempdir("replay");
    let file = data("replay.csv");
    let pattern = format!("replay:{}", file.display());
    let v = simulate(
        &out,
        &[
            "--descriptor",
            "user=anyone",
            "--pattern",
            &pattern,
            "--algorithms",
            "all",
        ],
    );
    let text = std::fs::read_to_string(&file).unwrap();
    let rows: Vec<Vec<&str>> = text
        .lines()
        .skip(1)
        .map(|l| l.split(',').collect())
        .collect();
    let cost: u64 = rows
        .iter()
        .map(|r| r.get(2).map_or(1, |c| c.parse::<u64>().unwrap()))
        .sum();
    let keys: std::collections::BTreeSet<&str> = rows.iter().map(|r| r[1]).collect();
    assert!(
        keys.len() >= 5 && cost > rows.len() as u64,
        "the file has keys and costs"
    );
    assert_eq!(v["keys"], keys.len());
    for name in ["fixed_window", "sliding_log", "token_bucket", "gcra"] {
        assert_eq!(n(&v, name, "offered"), rows.len() as f64, "{name}");
        assert_eq!(n(&v, name, "offered_cost"), cost as f64, "{name}");
    }
    // Each key has 20 a second of its own: the log holds every key to it, the fixed
    // window to twice it at most.
    assert!(n(&v, "sliding_log", "max_in_any_window") <= 20.0);
    assert!(n(&v, "fixed_window", "max_in_any_window") <= 40.0);
    // Under the limit a key is admitted whole: more than one key's limit got through.
    assert!(n(&v, "sliding_log", "admitted") > 30.0 * 20.0);
}

#[test]
fn every_pattern_writes_the_report() {
    for (i, (descriptor, pattern, duration)) in [
        ("user=bob", "steady:30", "6s"),
        ("user=bob", "poisson:30", "6s"),
        ("user=bob", "bursts:5:2s:50", "6s"),
        ("user=bob", "ramp:0:60", "6s"),
        ("login=10.0.0.1", "poisson:0.5", "5m"),
        ("login=10.0.0.1", "boundary:5", "3m"),
    ]
    .into_iter()
    .enumerate()
    {
        let out = tempdir(&format!("pattern-{i}"));
        let v = simulate(
            &out,
            &[
                "--descriptor",
                descriptor,
                "--pattern",
                pattern,
                "--duration",
                duration,
            ],
        );
        // `rule`: the rule as configured, one algorithm.
        let algorithms = v["algorithms"].as_object().unwrap();
        assert_eq!(algorithms.len(), 1, "{pattern}: {v}");
        let (name, limit) = if descriptor.starts_with("login") {
            ("token_bucket", 5.0)
        } else {
            ("fixed_window", 20.0)
        };
        assert!(n(&v, name, "offered") > 0.0, "{pattern}");
        assert!(n(&v, name, "max_in_any_window") <= 2.0 * limit, "{pattern}");
    }
}

/// Runs with `args` after the test rules, expecting a failure; returns stderr.
fn fails(args: &[&str]) -> String {
    let rules = data("simulate-rules.yaml");
    let out = tempdir("fails");
    let mut all = vec![
        "--config",
        rules.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    let output = tollgate(&all);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "{args:?} succeeded");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
    stderr
}

/// [`fails`] for a domain, a descriptor, a pattern and a duration.
fn simulate_fails(domain: &str, descriptor: &str, pattern: &str, duration: &str) -> String {
    fails(&[
        "--domain",
        domain,
        "--descriptor",
        descriptor,
        "--pattern",
        pattern,
        "--duration",
        duration,
    ])
}

#[test]
fn bad_input_is_one_clear_line() {
    let base = [
        "--domain",
        "api",
        "--descriptor",
        "user=a",
        "--duration",
        "5s",
    ];
    fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
        let mut v = base.to_vec();
        v.extend_from_slice(extra);
        v
    }
    let e = fails(&with(&base, &["--pattern", "sawtooth:5"]));
    assert!(
        e.contains("sawtooth:5") && e.contains("unknown pattern"),
        "{e}"
    );
    let e = fails(&with(&base, &["--pattern", "steady:fast"]));
    assert!(e.contains("`fast` is not a rate"), "{e}");
    let e = fails(&with(&base, &["--pattern", "replay:/no/such/file.csv"]));
    assert!(
        e.contains("cannot read the replay file /no/such/file.csv"),
        "{e}"
    );
    let dir = tempdir("bad-replay");
    let bad = dir.join("bad.csv");
    std::fs::write(&bad, "seconds,user\n0.5,alice\n1.0,bob,free\n").unwrap();
    let e = fails(&with(
        &base,
        &["--pattern", &format!("replay:{}", bad.display())],
    ));
    assert!(
        e.contains(&format!("{}:3: ", bad.display())) && e.contains("`free` is not a cost"),
        "{e}"
    );
    let e = fails(&[
        "--domain",
        "api",
        "--descriptor",
        "user=a",
        "--pattern",
        "steady:5",
    ]);
    assert!(e.contains("--duration") && e.contains("required"), "{e}");
    let e = simulate_fails("api", "user=a", "steady:5", "5y");
    assert!(e.contains("`5y` is not a duration"), "{e}");
    let e = fails(&with(
        &base[..4],
        &["--pattern", "steady:0.001", "--duration", "4000d"],
    ));
    assert!(e.contains("`4000d` is longer than 3650d"), "{e}");
    let e = simulate_fails("shop", "user=a", "steady:5", "5s");
    assert!(e.contains("no domain `shop`"), "{e}");
    let e = simulate_fails("api", "team=a", "steady:5", "5s");
    assert!(
        e.contains("`team=a`") && e.contains("no rule matches"),
        "{e}"
    );
    let e = simulate_fails("api", "health=x", "steady:5", "5s");
    assert!(e.contains("no limit"), "{e}");
    let e = simulate_fails("api", "user", "steady:5", "5s");
    assert!(e.contains("expected key=value"), "{e}");
    let e = simulate_fails("api", "user=a", "steady:1000000", "1h");
    assert!(e.contains("more than 10000000 requests"), "{e}");
    let e = simulate_fails("api", "user=a", "boundary:20", "1s");
    assert!(e.contains("window turn"), "{e}");
    let missing = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .env_remove("TOLLGATE_LOG")
        .args([
            "simulate",
            "--config",
            "/no/such/rules.yaml",
            "--domain",
            "api",
        ])
        .args([
            "--descriptor",
            "user=a",
            "--pattern",
            "steady:5",
            "--duration",
            "5s",
            "--out",
        ])
        .arg(tempdir("missing-config"))
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&missing.stderr);
    assert!(
        !missing.status.success() && e.contains("/no/such/rules.yaml"),
        "{e}"
    );
}

/// Chromium, from `TOLLGATE_CHROMIUM` or the PATH.
fn chromium() -> String {
    std::env::var("TOLLGATE_CHROMIUM").unwrap_or_else(|_| "chromium".into())
}

#[test]
fn the_report_page_shows_its_charts_in_a_browser() {
    let out = tempdir("browser");
    simulate(&out, BOUNDARY_ALL);
    let page = out.join("report.html");
    let html = std::fs::read_to_string(&page).unwrap();
    // Self-contained: nothing is fetched.
    for fetch in ["<script", "<link", " src=", " href=", "url("] {
        assert!(!html.contains(fetch), "the page has {fetch}");
    }
    let output = Command::new(chromium())
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--dump-dom"])
        .arg(format!("file://{}", page.display()))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} (set TOLLGATE_CHROMIUM): {e}", chromium()));
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let dom = String::from_utf8_lossy(&output.stdout);
    // Per algorithm: offered vs admitted and the differences; plus the window bars and
    // timeline, and the Retry-After bars and retry times.
    assert!(dom.matches("<svg").count() >= 6 * 2 + 4, "{dom}");
    assert!(dom.matches("<polyline").count() >= 6 * 4 + 6 * 2, "{dom}");
    for words in [
        "Most admitted in any one-second window, per algorithm",
        "limit: 20 per second",
        "Retry-After header values given, per algorithm",
        "fixed_window: 1 s",
        "Retry times given, by tenth of a second",
        "fixed_window: decisions that differ from the exact sliding log",
        "40 (2.00× the limit)",
    ] {
        assert!(dom.contains(words), "no `{words}` in the page");
    }
}

/// Runs `--algorithms rule` on simulate-mixed-rules.yaml against a replay made of
/// `lines`; returns the output.
fn mixed(name: &str, descriptor: &str, lines: &str) -> (Output, PathBuf) {
    let out = tempdir(name);
    let replay = out.join("replay.csv");
    std::fs::write(&replay, lines).unwrap();
    let rules = data("simulate-mixed-rules.yaml");
    let pattern = format!("replay:{}", replay.display());
    let output = tollgate(&[
        "--config",
        rules.to_str().unwrap(),
        "--domain",
        "api",
        "--descriptor",
        descriptor,
        "--pattern",
        &pattern,
        "--out",
        out.join("report").to_str().unwrap(),
    ]);
    (output, out.join("report/report.json"))
}

/// `rate` a second of each of `values`, for `secs` seconds.
fn replay_lines(values: &[&str], rate: u32, secs: u32) -> String {
    let mut text = String::new();
    for i in 0..rate * secs {
        for v in values {
            text += &format!("{:.4},{v}\n", f64::from(i) / f64::from(rate));
        }
    }
    text
}

#[test]
fn replay_values_of_another_rule_are_run_and_measured_at_that_rule() {
    // `vip` has a rule of its own (100/s): 50/s is within it, whatever `--descriptor`'s
    // placeholder value matches.
    let (output, json) = mixed("vip", "user=x", &replay_lines(&["vip"], 50, 3));
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    assert_eq!(v["limit"]["requests_per_unit"], 100);
    assert_eq!(n(&v, "fixed_window", "admitted"), 150.0);
    assert_eq!(n(&v, "fixed_window", "wrong_vs_exact_percent"), 0.0);
    assert_eq!(n(&v, "fixed_window", "max_in_any_window"), 50.0);
}

#[test]
fn replay_values_meeting_different_rules_are_refused_naming_two() {
    let (output, _) = mixed(
        "two-rules",
        "user=x",
        &replay_lines(&["alice", "vip"], 5, 2),
    );
    let e = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{e}");
    assert_eq!(e.trim().lines().count(), 1, "{e}");
    for words in [
        "`alice` and `vip` match different rules",
        "`alice` matches `user` (",
        "`vip` matches `user=vip` (",
        "one rule at a time",
    ] {
        assert!(e.contains(words), "{words}: {e}");
    }
}

#[test]
fn replay_values_sharing_one_counter_are_measured_together() {
    // Two clients at 10/s each on one shared counter of 10/s: the rule admits 10 a
    // second in all, as the exact log on that one counter does.
    let (output, json) = mixed("shared", "client=x", &replay_lines(&["a", "b"], 10, 3));
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    assert_eq!(v["limit"]["requests_per_unit"], 10);
    assert_eq!(n(&v, "fixed_window", "offered"), 60.0);
    assert_eq!(n(&v, "fixed_window", "admitted"), 30.0);
    assert_eq!(n(&v, "fixed_window", "wrong_vs_exact_percent"), 0.0);
    assert_eq!(n(&v, "fixed_window", "max_in_any_window"), 10.0);
}

/// The peak resident memory (`VmHWM`) of a process while it runs, in KiB, sampled until
/// it exits; and whether it succeeded.
#[cfg(target_os = "linux")]
fn peak_kib(mut command: Command) -> (u64, bool) {
    use std::process::Stdio;
    let mut child = command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let status = format!("/proc/{}/status", child.id());
    let mut peak = 0;
    loop {
        if let Ok(text) = std::fs::read_to_string(&status) {
            let hwm = text
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok());
            peak = peak.max(hwm.unwrap_or(0));
        }
        if let Some(exit) = child.try_wait().unwrap() {
            return (peak, exit.success());
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[cfg(target_os = "linux")]
#[test]
fn replay_keys_are_not_copied_per_algorithm() {
    // 200,000 distinct values (5 MB): each run once held a request per key (~300 bytes
    // each), six runs at once under `all`: 350 MB. Now each run builds its request
    // from the key index as it plays.
    let out = tempdir("keys");
    let replay = out.join("keys.csv");
    let mut text = String::new();
    for i in 0..200_000 {
        text += &format!("{}.{:03},user-number-{i}\n", i / 1000, i % 1000);
    }
    std::fs::write(&replay, text).unwrap();
    let rules = data("simulate-rules.yaml");
    let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    command
        .args(["simulate", "--config", rules.to_str().unwrap()])
        .args([
            "--domain",
            "api",
            "--descriptor",
            "user=x",
            "--algorithms",
            "all",
        ])
        .arg(format!("--pattern=replay:{}", replay.display()))
        .arg(format!("--out={}", out.join("report").display()))
        .env_remove("TOLLGATE_LOG");
    let (peak, ok) = peak_kib(command);
    assert!(ok);
    assert!(peak > 0 && peak < 200 * 1024, "peak {peak} KiB");
}

#[test]
fn a_replay_without_duration_is_held_to_the_longest_duration() {
    // 400,000,000 s is past the ten years --duration allows.
    let (output, _) = mixed("long", "user=x", "0,alice\n400000000,alice\n");
    let e = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{e}");
    assert!(
        e.contains("--duration: the replay runs") && e.contains("longer than 3650d"),
        "{e}"
    );
}
