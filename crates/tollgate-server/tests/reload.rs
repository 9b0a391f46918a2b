//! Hot reload end to end: rewrite the rules under a running server; the new limits
//! apply within 2 s; an invalid file leaves the old rules serving and counts an error,
//! once; an idle server does not read its rules again.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

mod support;

use std::time::{Duration, Instant};

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

#[tokio::test]
async fn a_server_with_invalid_rules_does_not_start() {
    let dir = tempdir("bad-start");
    std::fs::write(
        dir.join("r.yaml"),
        "domain: r\ndescriptors:\n  - key: user\n    ratelimit: {}\n",
    )
    .unwrap();
    let stderr = support::serve_refused(&dir, &[]);
    assert!(
        stderr.contains("r.yaml:4:5: unknown key `ratelimit`"),
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
