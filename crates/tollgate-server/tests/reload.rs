//! Hot reload end to end: rewrite the rules under a running server; the new limits
//! apply within 2 s; an invalid file leaves the old rules serving and counts an error,
//! once; an idle server does not read its rules again. A server started with invalid
//! rules (or none at the path) stays up, not ready, answering no decision, until they
//! load; `--exit-on-invalid-rules` makes it exit instead.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

mod support;

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
    rate_limit_descriptor::Entry, RateLimitDescriptor,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use reqwest::Client;
use serde_json::{json, Value};
use support::{tempdir, Server};

const V1: &str =
    "domain: r\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";

async fn limit_of(c: &Client, s: &Server, user: &str) -> (u16, Value) {
    let r = c
        .post(format!("{}/v1/check", s.http))
        .json(&json!({"domain": "r", "descriptors": [{"user": user}]}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

async fn metric(s: &Server, name: &str) -> u64 {
    match s.metric(name).await {
        Some(v) => v,
        None => panic!("{name} not in metrics:\n{}", s.get_text("/metrics").await),
    }
}

#[tokio::test]
async fn rewritten_rules_apply_within_two_seconds_and_bad_ones_are_refused() {
    let dir = tempdir("reload");
    std::fs::write(dir.join("r.yaml"), V1).unwrap();
    let s = Server::start(&dir, &[]).await;
    let c = Client::new();
    assert_eq!(limit_of(&c, &s, "a").await.0, 200);
    assert_eq!(limit_of(&c, &s, "a").await.0, 429);

    // An editor-style save: write elsewhere, rename over.
    std::fs::write(
        dir.join(".r.yaml.tmp"),
        V1.replace("requests_per_unit: 1}", "requests_per_unit: 5}"),
    )
    .unwrap();
    std::fs::rename(dir.join(".r.yaml.tmp"), dir.join("r.yaml")).unwrap();
    let started = Instant::now();
    loop {
        let (_, body) = limit_of(&c, &s, "probe").await;
        if body["descriptors"][0]["limit"]["requests_per_unit"] == 5 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "new limits not applied within 2 s"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // The counter of "a" survived: 1 used of the new 5.
    assert_eq!(
        limit_of(&c, &s, "a").await.1["descriptors"][0]["remaining"],
        3
    );

    let errors_before = metric(&s, "tollgate_config_load_error_total").await;
    std::fs::write(dir.join("r.yaml"), "domain: r\ndescriptors:\n  - key: user\n    rate_limit: {unit: fortnight, requests_per_unit: 9}\n").unwrap();
    let started = Instant::now();
    while metric(&s, "tollgate_config_load_error_total").await == errors_before {
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the bad file was not noticed within 2 s"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let (_, body) = limit_of(&c, &s, "b").await;
    assert_eq!(
        body["descriptors"][0]["limit"]["requests_per_unit"], 5,
        "the old rules keep serving"
    );
    let rules: Value = s.get_json("/rules").await;
    let err = rules["last_error"][0].as_str().unwrap();
    assert!(
        err.contains("r.yaml:4:23: unknown unit `fortnight`")
            || err.contains("unknown unit `fortnight`"),
        "{err}"
    );

    // POST /reload reports the same errors, and a fixed file reloads.
    let r = c.post(format!("{}/reload", s.http)).send().await.unwrap();
    assert_eq!(r.status(), 422);
    std::fs::write(dir.join("r.yaml"), V1).unwrap();
    let r: Value = c
        .post(format!("{}/reload", s.http))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        r["outcome"] == "reloaded" || r["outcome"] == "unchanged",
        "{r}"
    );
    let (_, body) = limit_of(&c, &s, "c").await;
    assert_eq!(body["descriptors"][0]["limit"]["requests_per_unit"], 1);
}

const BROKEN: &str = "domain: r\ndescriptors:\n  - key: user\n    ratelimit: {}\n";
const NO_RULES: &str = "no rate limit configuration loaded";

/// Polls `GET /readyz` (5 s at most) until it answers `status`.
async fn wait_for_readyz(s: &Server, status: u16) {
    let started = Instant::now();
    loop {
        let r = reqwest::get(format!("{}/readyz", s.http)).await.unwrap();
        if r.status() == status {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "/readyz did not answer {status} within 5 s: {}",
            r.status()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The status, content type and JSON body of `POST path` with `body`.
async fn post(c: &Client, s: &Server, path: &str, body: Value) -> (u16, String, Value) {
    let r = c
        .post(format!("{}{path}", s.http))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let kind = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (status, kind, r.json().await.unwrap())
}

/// `ShouldRateLimit` for `{user: ann}` in domain `r` through tonic's client.
async fn should_rate_limit(s: &Server) -> Result<RateLimitResponse, tonic::Status> {
    let mut client = RateLimitServiceClient::connect(format!("http://{}", s.grpc))
        .await
        .unwrap();
    let request = RateLimitRequest {
        domain: "r".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "user".into(),
                value: "ann".into(),
            }],
            ..Default::default()
        }],
        hits_addend: 1,
    };
    client
        .should_rate_limit(request)
        .await
        .map(tonic::Response::into_inner)
}

#[tokio::test]
async fn a_server_with_invalid_rules_stays_up_unready_and_loads_them_once_fixed() {
    let dir = tempdir("bad-start");
    let log = dir.with_extension("log");
    std::fs::write(dir.join("r.yaml"), BROKEN).unwrap();
    let s = Server::start_alive(&dir, &[], &log).await;
    let c = Client::new();

    // Up, not ready, and saying why: in the log, in /rules and in /metrics.
    for path in ["/readyz", "/healthcheck"] {
        let r = reqwest::get(format!("{}{path}", s.http)).await.unwrap();
        assert_eq!(r.status(), 503, "{path}");
    }
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains("r.yaml:4:5: unknown key `ratelimit`"),
        "{logged}"
    );
    let rules = s.get_json("/rules").await;
    assert_eq!(rules["loaded"], false, "{rules}");
    assert_eq!(rules["load_successes"], 0, "{rules}");
    assert_eq!(rules["load_failures"], 1, "{rules}");
    let err = rules["last_error"][0].as_str().unwrap();
    assert!(err.contains("r.yaml:4:5: unknown key `ratelimit`"), "{err}");
    assert_eq!(metric(&s, "tollgate_config_load_error_total").await, 1);

    // No decision on any API: gRPC says UNKNOWN as envoyproxy/ratelimit does, HTTP 503.
    let status = should_rate_limit(&s).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unknown, "{status:?}");
    assert_eq!(status.message(), NO_RULES);
    let check = json!({"domain": "r", "descriptors": [{"user": "ann"}]});
    let envoy =
        json!({"domain": "r", "descriptors": [{"entries": [{"key": "user", "value": "ann"}]}]});
    for (path, body) in [("/v1/check", &check), ("/json", &envoy)] {
        let (status, kind, problem) = post(&c, &s, path, body.clone()).await;
        assert_eq!(status, 503, "{path}: {problem}");
        assert_eq!(kind, "application/problem+json", "{path}");
        assert_eq!(problem["status"], 503, "{path}: {problem}");
        assert_eq!(problem["detail"], NO_RULES, "{path}: {problem}");
    }

    // Fixed: loaded by the watcher, ready, deciding.
    std::fs::write(dir.join(".r.yaml.tmp"), V1).unwrap();
    std::fs::rename(dir.join(".r.yaml.tmp"), dir.join("r.yaml")).unwrap();
    wait_for_readyz(&s, 200).await;
    let (status, _, body) = post(&c, &s, "/v1/check", check.clone()).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["descriptors"][0]["limit"]["requests_per_unit"], 1);
    let response = should_rate_limit(&s).await.unwrap();
    assert_eq!(
        response.overall_code, 2,
        "ann's second hit of 1 per hour is over"
    );
    let rules = s.get_json("/rules").await;
    assert_eq!(rules["loaded"], true, "{rules}");
    assert_eq!(rules["load_successes"], 1, "{rules}");
    assert_eq!(rules["last_error"], Value::Null, "{rules}");
}

#[tokio::test]
async fn a_missing_rule_directory_is_waited_for_and_watched_once_it_exists() {
    let dir = tempdir("missing-dir");
    let log = dir.with_extension("log");
    let rules = dir.join("rules");
    let s = Server::start_alive(&rules, &[], &log).await;
    let r = reqwest::get(format!("{}/readyz", s.http)).await.unwrap();
    assert_eq!(r.status(), 503);
    let listed = s.get_json("/rules").await;
    let err = listed["last_error"][0].as_str().unwrap();
    assert!(err.contains("no such file or directory"), "{err}");

    // The directory appears whole (as a ConfigMap mount or a renamed checkout would).
    let staging = dir.join("staging");
    std::fs::create_dir(&staging).unwrap();
    std::fs::write(staging.join("r.yaml"), V1).unwrap();
    std::fs::rename(&staging, &rules).unwrap();
    wait_for_readyz(&s, 200).await;

    // Its files are watched from then on.
    let c = Client::new();
    std::fs::write(
        rules.join("r.yaml"),
        V1.replace("requests_per_unit: 1}", "requests_per_unit: 7}"),
    )
    .unwrap();
    let started = Instant::now();
    while limit_of(&c, &s, "probe").await.1["descriptors"][0]["limit"]["requests_per_unit"] != 7 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "an edit in the new directory was not loaded within 5 s"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test]
async fn with_exit_on_invalid_rules_a_server_with_invalid_rules_does_not_start() {
    let dir = tempdir("bad-start-exit");
    std::fs::write(dir.join("r.yaml"), BROKEN).unwrap();
    let stderr = support::serve_refused(&dir, &["--exit-on-invalid-rules"]);
    assert!(
        stderr.contains("r.yaml:4:5: unknown key `ratelimit`"),
        "{stderr}"
    );
    // The same through the environment, and for a path that does not exist.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["serve", "--config"])
        .arg(dir.join("nothing-here"))
        .args([
            "--grpc-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .env("TOLLGATE_EXIT_ON_INVALID_RULES", "true")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("nothing-here") && stderr.contains("no such file or directory"),
        "{stderr}"
    );
}

/// (reload_attempts, load_successes, load_failures) from `/rules`.
async fn counters(s: &Server) -> (u64, u64, u64) {
    let r: Value = s.get_json("/rules").await;
    let n = |k: &str| {
        r[k].as_u64()
            .unwrap_or_else(|| panic!("{k} not in /rules: {r}"))
    };
    (
        n("reload_attempts"),
        n("load_successes"),
        n("load_failures"),
    )
}

/// Waits (2 s at most) until `/rules` says `key` is `value`.
async fn wait_for_counter(s: &Server, key: &str, value: u64) {
    let started = Instant::now();
    loop {
        let r: Value = s.get_json("/rules").await;
        if r[key] == value {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{key} did not reach {value} within 2 s: {r}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test]
async fn an_idle_server_does_not_read_its_rules_again() {
    let dir = tempdir("idle");
    std::fs::write(dir.join("r.yaml"), V1).unwrap();
    let s = Server::start(&dir, &[]).await;
    // Someone reads the files (an operator's `cat`), and a reload is asked for: reading
    // is not changing, for the server's own reads too.
    std::fs::read(dir.join("r.yaml")).unwrap();
    let r = Client::new()
        .post(format!("{}/reload", s.http))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let before = counters(&s).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        counters(&s).await,
        before,
        "(attempts, successes, failures)"
    );
    assert_eq!(before, (1, 1, 0));
}

#[tokio::test]
async fn a_broken_file_is_counted_and_logged_once_and_one_edit_is_one_reload() {
    let dir = tempdir("idle-broken");
    let log = dir.with_extension("log");
    std::fs::write(dir.join("r.yaml"), V1).unwrap();
    let s = Server::start_logging(&dir, &[], &log).await;

    std::fs::write(dir.join("r.yaml"), V1.replace("hour", "fortnight")).unwrap();
    wait_for_counter(&s, "load_failures", 1).await;
    let broken = counters(&s).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        counters(&s).await,
        broken,
        "(attempts, successes, failures)"
    );
    assert_eq!(broken, (1, 1, 1));
    let logged = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        logged.matches("rules not reloaded").count(),
        1,
        "logged once:\n{logged}"
    );

    // One edit, one reload.
    std::fs::write(
        dir.join("r.yaml"),
        V1.replace("requests_per_unit: 1}", "requests_per_unit: 4}"),
    )
    .unwrap();
    wait_for_counter(&s, "load_successes", 2).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(counters(&s).await, (2, 2, 1));
    let c = Client::new();
    assert_eq!(
        limit_of(&c, &s, "a").await.1["descriptors"][0]["limit"]["requests_per_unit"],
        4
    );
}

/// Starts `tollgate serve` on `dir` as [`Server::start`] does, with `RUST_MIN_STACK` at
/// 256 KiB: the default stack of every thread that does not set its own (tokio's
/// included). Enough to serve; far too little to read the deepest rule file the depth
/// caps let through, which is what a reload on such a thread used to do (and abort).
async fn start_with_small_default_stacks(dir: &std::path::Path) -> Server {
    let client = Client::builder()
        .timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    for _ in 0..5 {
        let grpc = format!("127.0.0.1:{}", support::free_port());
        let http = format!("127.0.0.1:{}", support::free_port());
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["serve", "--config", dir.to_str().unwrap()])
            .args(["--grpc-listen", &grpc, "--http-listen", &http])
            .env("RUST_MIN_STACK", (256 << 10).to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut server = Server {
            child,
            http: format!("http://{http}"),
            grpc,
            rules: dir.to_path_buf(),
        };
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(15) {
            if server.child.try_wait().unwrap().is_some() {
                break; // a port taken meanwhile: try others
            }
            let ready = client.get(format!("{}/readyz", server.http)).send().await;
            if ready.is_ok_and(|r| r.status() == 200) {
                return server;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    panic!("tollgate serve did not start");
}

/// A rule file whose descriptors nest `depth` levels deep (two YAML levels each).
fn nested(depth: usize) -> String {
    let mut text = String::from("domain: r\ndescriptors:\n");
    for level in 0..depth {
        let pad = "  ".repeat(level * 2 + 1);
        text.push_str(&format!("{pad}- key: k{level}\n{pad}  descriptors:\n"));
    }
    let pad = "  ".repeat(depth * 2 + 1);
    text.push_str(&format!("{pad}- key: leaf\n"));
    text
}

/// A file as deep as the nesting estimate lets through (232 YAML levels, 4 of them
/// blocks), refused after it is parsed: `key` names a descriptor field that does not
/// exist.
fn deepest_refused(key: &str) -> String {
    let n = 228;
    format!(
        "domain: r\ndescriptors:\n  - key: user\n    {key}: {{x: {}{}}}\n",
        "[".repeat(n),
        "]".repeat(n)
    )
}

#[tokio::test]
async fn a_deep_or_broken_rule_file_never_crashes_a_reload_and_the_old_rules_keep_serving() {
    let dir = tempdir("deep-reload");
    std::fs::write(dir.join("r.yaml"), V1).unwrap();
    let mut s = start_with_small_default_stacks(&dir).await;
    let c = Client::new();
    assert_eq!(limit_of(&c, &s, "a").await.0, 200);
    assert_eq!(limit_of(&c, &s, "a").await.0, 429);

    let nul =
        V1.to_string() + "\0  - key: other\n    rate_limit: {unit: hour, requests_per_unit: 9}\n";
    let cases = [
        // 1,200 YAML levels (2.9 MB): refused by the estimate, before parsing.
        (
            nested(600),
            "r.yaml:233:".to_string(),
            "levels deep (the rule files' limit)",
        ),
        // As deep as gets past the estimate: parsed, on the reload's own stack.
        (
            deepest_refused("metadaat"),
            "r.yaml:4:5:".to_string(),
            "unknown key `metadaat`",
        ),
        // A NUL would have ended the file there: refused with its place.
        (
            nul,
            "r.yaml:5:1:".to_string(),
            "a control character (U+0000)",
        ),
    ];
    for (text, place, what) in cases {
        std::fs::write(dir.join("r.yaml"), text).unwrap();
        // The watcher may read it first; either way the answer is the file's errors.
        let r = c.post(format!("{}/reload", s.http)).send().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            s.child.try_wait().unwrap().is_none(),
            "the server died reloading a file with {what}"
        );
        let r = r.unwrap();
        assert_eq!(r.status(), 422, "{what}");
        let body: Value = r.json().await.unwrap();
        let error = body["errors"][0].as_str().unwrap();
        assert!(error.contains(&place) && error.contains(what), "{body}");
        let rules = s.get_json("/rules").await;
        let last = rules["last_error"][0].as_str().unwrap();
        assert!(last.contains(&place) && last.contains(what), "{rules}");
        // The old rules serve, their counters intact.
        let (status, body) = limit_of(&c, &s, "a").await;
        assert_eq!(status, 429, "{body}");
        assert_eq!(body["descriptors"][0]["limit"]["requests_per_unit"], 1);
    }

    // SIGHUP's thread reads the files on a stack of its own too (as does the watcher's,
    // which sees the same file).
    std::fs::write(dir.join("r.yaml"), deepest_refused("metadatta")).unwrap();
    let sighup = std::process::Command::new("kill")
        .args(["-HUP", &s.child.id().to_string()])
        .status()
        .unwrap();
    assert!(sighup.success());
    let started = Instant::now();
    loop {
        assert!(
            s.child.try_wait().unwrap().is_none(),
            "the server died reloading on SIGHUP"
        );
        let rules = s.get_json("/rules").await;
        if rules["last_error"][0]
            .as_str()
            .is_some_and(|e| e.contains("unknown key `metadatta`"))
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the file was not reloaded within 5 s: {rules}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(s.child.try_wait().unwrap().is_none());
    assert_eq!(limit_of(&c, &s, "a").await.0, 429);
}
