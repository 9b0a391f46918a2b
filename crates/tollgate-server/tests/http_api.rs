//! The HTTP listener with a real client: every endpoint, the rate limit headers, and a
//! 400 for every kind of malformed input.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

mod support;

use reqwest::{Client, StatusCode};
use serde_json::{json, Value};
use support::{tempdir, Server};

const RULES: &str = "domain: api
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 2, name: per_user}
  - key: path
    value: /upload*
    rate_limit: {unit: hour, requests_per_unit: 1}
";

async fn server(name: &str, args: &[&str]) -> Server {
    let dir = tempdir(name);
    std::fs::write(dir.join("api.yaml"), RULES).unwrap();
    Server::start(&dir, args).await
}

async fn check(c: &Client, s: &Server, body: Value) -> reqwest::Response {
    c.post(format!("{}/v1/check", s.http))
        .json(&body)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn v1_check_counts_down_then_answers_429_with_retry_after() {
    // Counted against 2 per minute from here on.
    support::minute::away_from_a_minute_boundary(10);
    let s = server("check", &["--legacy-headers"]).await;
    let c = Client::new();
    let req = json!({"domain": "api", "descriptors": [{"user": "alice"}]});
    let first = check(&c, &s, req.clone()).await;
    assert_eq!(first.status(), StatusCode::OK);
    let h = first.headers().clone();
    assert_eq!(h["ratelimit-policy"], "\"per_user\";q=2;w=60");
    let rl = h["ratelimit"].to_str().unwrap().to_string();
    assert!(rl.starts_with("\"per_user\";r=1;t="), "{rl}");
    assert_eq!(h["x-ratelimit-limit"], "2");
    assert_eq!(h["x-ratelimit-remaining"], "1");
    let body: Value = first.json().await.unwrap();
    assert_eq!(body["descriptors"][0]["remaining"], 1);
    assert_eq!(body["descriptors"][0]["limit"]["unit"], "MINUTE");

    assert_eq!(check(&c, &s, req.clone()).await.status(), StatusCode::OK);
    let third = check(&c, &s, req).await;
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = third.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    let body: Value = third.json().await.unwrap();
    assert_eq!(
        (body["allowed"].clone(), body["overall"].clone()),
        (json!(false), json!("OVER_LIMIT"))
    );
    assert_eq!(body["descriptors"][0]["retry_after_seconds"], retry);
}

#[tokio::test]
async fn v1_check_refuses_malformed_input_with_a_reason() {
    let s = server("check-400", &[]).await;
    let c = Client::new();
    let cases: [(&str, &str); 6] = [
        ("{not json", "the body is not valid JSON"),
        ("[1,2]", "the body must be a JSON object"),
        (r#"{"domain":"api"}"#, "`descriptors` is missing"),
        (
            r#"{"domain":"","descriptors":[{"user":"a"}]}"#,
            "rate limit domain must not be empty",
        ),
        (
            r#"{"domain":"api","descriptors":[]}"#,
            "rate limit descriptor list must not be empty",
        ),
        (
            r#"{"domain":"api","descriptors":[{"":"x"}]}"#,
            "descriptor 0, entry 0 has an empty key",
        ),
    ];
    for (body, why) in cases {
        let r = c
            .post(format!("{}/v1/check", s.http))
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{body}");
        let err: Value = r.json().await.unwrap();
        assert!(
            err["error"].as_str().unwrap().contains(why),
            "{body}: {err}"
        );
    }
    // And the service is still up.
    assert_eq!(
        check(
            &c,
            &s,
            json!({"domain": "api", "descriptors": [{"user": "z"}]})
        )
        .await
        .status(),
        200
    );
}

/// `n` descriptors `{"user": "<prefix><i>"}` for `/v1/check`.
fn users(prefix: &str, n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| json!({ "user": format!("{prefix}{i}") }))
        .collect()
}

/// The same, as `/json` (Envoy's proto3 JSON) writes them.
fn envoy_users(prefix: &str, n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| json!({"entries": [{"key": "user", "value": format!("{prefix}{i}")}]}))
        .collect()
}

/// Over a cap: 400 naming it, on both endpoints; at the caps: 200, with one policy
/// item for the 64 descriptors of one limit.
#[tokio::test]
async fn requests_over_the_caps_get_400_naming_the_cap() {
    let s = server("caps", &[]).await;
    let c = Client::new();
    let post = |path: &str, body: Value| c.post(format!("{}{path}", s.http)).json(&body).send();
    let at_cap = post(
        "/v1/check",
        json!({"domain": "api", "descriptors": users("a", 64)}),
    )
    .await
    .unwrap();
    assert_eq!(at_cap.status(), StatusCode::OK);
    // 64 descriptors of one limit: one policy, reporting the least remaining.
    assert_eq!(
        at_cap.headers()["ratelimit-policy"],
        "\"per_user\";q=2;w=60"
    );
    let state = at_cap.headers()["ratelimit"].to_str().unwrap().to_string();
    assert!(state.starts_with("\"per_user\";r=1;t="), "{state}");
    assert!(!state.contains(','), "{state}");

    let too_many = "a request may carry at most 64 descriptors (--max-descriptors)";
    let over = [
        (
            "/v1/check",
            json!({"domain": "api", "descriptors": users("b", 65)}),
        ),
        (
            "/json",
            json!({"domain": "api", "descriptors": envoy_users("b", 65)}),
        ),
        // 20,000 descriptors (under the body limit): refused for the count, unconverted.
        (
            "/v1/check",
            json!({"domain": "api", "descriptors": users("c", 20_000)}),
        ),
    ];
    for (path, body) in over {
        let r = post(path, body).await.unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{path}");
        let err: Value = r.json().await.unwrap();
        assert_eq!(err["error"], too_many, "{path}");
    }
    let entries: serde_json::Map<String, Value> =
        (0..33).map(|j| (format!("k{j}"), json!("v"))).collect();
    let r = post(
        "/v1/check",
        json!({"domain": "api", "descriptors": [entries]}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let err: Value = r.json().await.unwrap();
    assert_eq!(
        err["error"],
        "descriptor 0: a descriptor may carry at most 32 entries (--max-entries)"
    );
    let long = json!({"domain": "api", "descriptors": [{"user": "x".repeat(70_000)}]});
    let r = post("/v1/check", long).await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let err: Value = r.json().await.unwrap();
    assert!(
        err["error"]
            .as_str()
            .unwrap()
            .contains("the value is 70000 bytes; a key or value may be at most 65536 bytes"),
        "{err}"
    );
    // A body past the limit (1 MiB with the default caps): 413, unread.
    let huge = json!({"domain": "api", "descriptors": [{"user": "y".repeat(2 << 20)}]});
    let r = post("/json", huge).await.unwrap();
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let err: Value = r.json().await.unwrap();
    assert!(
        err["error"]
            .as_str()
            .unwrap()
            .starts_with("the request body may be at most 1048576 bytes"),
        "{err}"
    );
    // A new connection: the server closes the one whose body it left unread.
    let m = Client::new()
        .get(format!("{}/metrics", s.http))
        .send()
        .await
        .unwrap();
    let text = m.text().await.unwrap();
    let refused = text
        .lines()
        .find_map(|l| l.strip_prefix("tollgate_invalid_requests_total "))
        .unwrap_or_default();
    assert_eq!(refused, "6", "each refusal counted once: {text}");
}

/// The caps are the service's: `--max-descriptors` and `--max-entries` move them.
#[tokio::test]
async fn the_caps_follow_the_flags() {
    let s = server(
        "caps-flags",
        &["--max-descriptors", "2", "--max-entries", "1"],
    )
    .await;
    let c = Client::new();
    let r = check(
        &c,
        &s,
        json!({"domain": "api", "descriptors": users("f", 3)}),
    )
    .await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let err: Value = r.json().await.unwrap();
    assert_eq!(
        err["error"],
        "a request may carry at most 2 descriptors (--max-descriptors)"
    );
    let two = json!({"domain": "api", "descriptors": [{"user": "g", "k": "v"}]});
    assert_eq!(check(&c, &s, two).await.status(), StatusCode::BAD_REQUEST);
    let fine = json!({"domain": "api", "descriptors": users("h", 2)});
    assert_eq!(check(&c, &s, fine).await.status(), StatusCode::OK);
}

#[tokio::test]
async fn envoys_json_endpoint_speaks_proto3_json() {
    let s = server("json", &[]).await;
    let c = Client::new();
    let req = json!({"domain": "api", "descriptors": [
        {"entries": [{"key": "path", "value": "/upload/a.png"}]},
        {"entries": [{"key": "nothing", "value": "x"}]}
    ]});
    let ok = c
        .post(format!("{}/json", s.http))
        .json(&req)
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    let body: Value = ok.json().await.unwrap();
    assert_eq!(body["overallCode"], "OK");
    assert_eq!(
        body["statuses"][0]["currentLimit"],
        json!({"requestsPerUnit": 1, "unit": "HOUR"})
    );
    assert_eq!(body["statuses"][1], json!({"code": "OK"}));
    let over = c
        .post(format!("{}/json", s.http))
        .json(&req)
        .send()
        .await
        .unwrap();
    assert_eq!(over.status(), 429);
    let body: Value = over.json().await.unwrap();
    assert_eq!(body["overallCode"], "OVER_LIMIT");
    assert!(body["responseHeadersToAdd"]
        .as_array()
        .unwrap()
        .iter()
        .any(|h| h["key"] == "Retry-After"));
    let bad = c
        .post(format!("{}/json", s.http))
        .body(r#"{"domain":"api","descriptors":"x"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
}

#[tokio::test]
async fn envoys_json_endpoint_sends_dynamic_metadata_when_asked() {
    let dir = tempdir("json-metadata");
    let rules = format!(
        "{RULES}  - key: tier\n    rate_limit: {{unit: hour, requests_per_unit: 5}}\n    metadata: {{team: payments, weight: 2}}\n"
    );
    std::fs::write(dir.join("api.yaml"), rules).unwrap();
    let s = Server::start(&dir, &["--response-dynamic-metadata"]).await;
    let c = Client::new();
    let req = json!({"domain": "api", "hitsAddend": 2, "descriptors": [
        {"entries": [{"key": "tier", "value": "gold"}]},
        {"entries": [{"key": "path", "value": "/upload/a.png"}]}
    ]});
    let answer = c
        .post(format!("{}/json", s.http))
        .json(&req)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 429, "uploads allow 1 an hour, 2 asked");
    let body: Value = answer.json().await.unwrap();
    assert_eq!(
        body["dynamicMetadata"],
        json!({
            "domain": "api",
            "hitsAddend": 2.0,
            "descriptors": [
                {"entries": ["tier=gold"], "code": "OK"},
                {"entries": ["path=/upload/a.png"], "code": "OVER_LIMIT"}
            ],
            "metadata": {"team": "payments", "weight": 2.0}
        })
    );
}

#[tokio::test]
async fn health_rules_and_metrics_endpoints_answer() {
    let s = server("admin", &[]).await;
    let c = Client::new();
    for (path, body) in [
        ("/healthcheck", "OK"),
        ("/healthz", "ok"),
        ("/readyz", "OK"),
    ] {
        let r = c.get(format!("{}{path}", s.http)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
        assert_eq!(r.text().await.unwrap(), body);
    }
    let rules: Value = s.get_json("/rules").await;
    assert_eq!(
        rules["domains"][0],
        json!({"domain": "api", "files": [s.rules.join("api.yaml").display().to_string()], "rules": 2, "limits": 2})
    );
    assert!(rules["loaded_at_unix"].as_u64().unwrap() > 1_700_000_000);

    check(
        &c,
        &s,
        json!({"domain": "api", "descriptors": [{"user": "m"}]}),
    )
    .await;
    let text = s.get_text("/metrics").await;
    for needle in [
        "tollgate_total_hits_total{domain=\"api\",descriptor=\"user\"} 1",
        "tollgate_within_limit_total{domain=\"api\",descriptor=\"user\"} 1",
        "tollgate_decision_duration_seconds_count 1",
        "tollgate_config_load_success_total 1",
        "tollgate_config_load_error_total 0",
        "tollgate_store_keys 1",
    ] {
        assert!(text.contains(needle), "missing {needle} in:\n{text}");
    }
}

/// A log written to a file is for people and tools: no terminal colour codes, and no
/// Rust debug spellings (`Native`, `None`, `Some(..)`).
#[tokio::test]
async fn a_log_file_is_plain_text() {
    let dir = tempdir("log");
    std::fs::write(dir.join("api.yaml"), RULES).unwrap();
    let log = dir.join("serve.log");
    let s = Server::start_logging(&dir, &[], &log).await;
    drop(s);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("tollgate serving"), "{text}");
    assert!(!text.contains('\u{1b}'), "colour codes in a file:\n{text}");
    assert!(text.contains("grpc_transport=native"), "{text}");
    for debug in ["None", "Some(", "Native"] {
        assert!(!text.contains(debug), "`{debug}` in:\n{text}");
    }
}

/// A descriptor no rule limits is answered OK with `remaining: 0` (Envoy's service says
/// the same): `/v1/check` says `matched: false`, and the metrics count it, by domain when
/// the domain is loaded and apart when it is not.
#[tokio::test]
async fn unmatched_descriptors_are_said_and_counted() {
    let s = server("unmatched", &[]).await;
    let c = Client::new();
    let body =
        json!({"domain": "api", "descriptors": [{"user": "u"}, {"team": "t"}, {"path": "/x"}]});
    let r: Value = check(&c, &s, body).await.json().await.unwrap();
    let matched: Vec<bool> = r["descriptors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["matched"].as_bool().unwrap())
        .collect();
    // `team` has no rule; `path` has one only for /upload*.
    assert_eq!(matched, [true, false, false], "{r}");
    assert_eq!(r["descriptors"][1]["remaining"], 0);
    assert_eq!(r["allowed"], true);
    let other = json!({"domain": "nope", "descriptors": [{"user": "u"}]});
    let r: Value = check(&c, &s, other).await.json().await.unwrap();
    assert_eq!(
        (
            r["allowed"].as_bool(),
            r["descriptors"][0]["matched"].as_bool()
        ),
        (Some(true), Some(false))
    );
    assert_eq!(
        s.metric("tollgate_unmatched_descriptors_total{domain=\"api\"}")
            .await,
        Some(2)
    );
    assert_eq!(
        s.metric("tollgate_unknown_domain_descriptors_total").await,
        Some(1)
    );
}

/// `--max-keys` bounds memory without handing out resets: a flood of new keys evicts
/// its own kind, not a client that is over its limit; the metrics say both.
#[tokio::test]
async fn a_flood_of_new_keys_does_not_reset_a_limited_client() {
    support::minute::away_from_a_minute_boundary(10);
    let s = server("flood", &["--max-keys", "256"]).await;
    let c = Client::new();
    let victim = json!({"domain": "api", "descriptors": [{"user": "victim"}]});
    for want in [200, 200, 429] {
        assert_eq!(check(&c, &s, victim.clone()).await.status(), want);
    }
    for batch in 0..100 {
        let flood = json!({"domain": "api", "descriptors": users(&format!("flood{batch}-"), 64)});
        assert_eq!(check(&c, &s, flood).await.status(), 200);
    }
    assert_eq!(
        check(&c, &s, victim).await.status(),
        429,
        "the flood reset the victim"
    );
    let evictions = s.metric("tollgate_store_evictions_total").await.unwrap();
    assert!(evictions >= 6400 - 256, "{evictions}");
    assert_eq!(
        s.metric("tollgate_store_limited_evictions_total").await,
        Some(0)
    );
}

#[tokio::test]
async fn metric_labels_stay_bounded_whatever_the_runtime_values() {
    let s = server("cardinality", &[]).await;
    let c = Client::new();
    for i in 0..300 {
        check(
            &c,
            &s,
            json!({"domain": "api", "descriptors": [{"user": format!("u{i}")}]}),
        )
        .await;
    }
    let text = s.get_text("/metrics").await;
    let series = text
        .lines()
        .filter(|l| l.starts_with("tollgate_total_hits_total{"))
        .count();
    assert_eq!(series, 1, "one series per rule, not per user:\n{text}");
}

#[tokio::test]
async fn sigterm_drains_and_exits_cleanly() {
    let mut s = server("drain", &[]).await;
    s.terminate();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            assert!(status.success(), "{status}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "did not exit after SIGTERM"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn concurrent_clients_on_one_key_get_exactly_the_limit() {
    let dir = tempdir("exact");
    std::fs::write(
        dir.join("e.yaml"),
        "domain: e\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 300, algorithm: sliding_log}\n",
    )
    .unwrap();
    let s = Server::start(&dir, &[]).await;
    let c = Client::new();
    let url = format!("{}/v1/check", s.http);
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move {
                let mut admitted = 0;
                for _ in 0..10 {
                    let r = c
                        .post(&url)
                        .json(&json!({"domain": "e", "descriptors": [{"k": "hot"}]}))
                        .send()
                        .await
                        .unwrap();
                    admitted += usize::from(r.status() == StatusCode::OK);
                }
                admitted
            })
        })
        .collect();
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    assert_eq!(total, 300, "500 concurrent attempts, a limit of 300");
}

#[tokio::test]
async fn an_overdraft_is_flagged_in_the_answer_the_header_and_the_metrics() {
    let dir = tempdir("overdraft");
    std::fs::write(
        dir.join("od.yaml"),
        "domain: od\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: hour, requests_per_unit: 1, algorithm: token_bucket, burst: 2, overdraft: 2, name: per_tenant}\n",
    )
    .unwrap();
    let s = Server::start(&dir, &[]).await;
    let c = Client::new();
    let req = json!({"domain": "od", "descriptors": [{"tenant": "t1"}]});
    for i in 0..5 {
        let r = check(&c, &s, req.clone()).await;
        let header = r
            .headers()
            .get("tollgate-overdraft")
            .map(|v| v.to_str().unwrap().to_string());
        let status = r.status();
        let body: Value = r.json().await.unwrap();
        let d = &body["descriptors"][0];
        match i {
            0 | 1 => {
                assert_eq!(status, StatusCode::OK, "{i}");
                assert_eq!(d["overdraft"], false, "{i}: {body}");
                assert_eq!(header, None, "{i}");
            }
            2 | 3 => {
                assert_eq!(status, StatusCode::OK, "{i}");
                assert_eq!(d["overdraft"], true, "{i}: {body}");
                assert_eq!(d["remaining"], 0, "{i}: {body}");
                assert_eq!(header.as_deref(), Some("\"per_tenant\""), "{i}");
            }
            _ => {
                assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{i}");
                assert_eq!(header, None, "{i}");
            }
        }
    }
    let text = s.get_text("/metrics").await;
    for needle in [
        "tollgate_overdraft_total{domain=\"od\",descriptor=\"tenant\"} 2",
        "tollgate_within_limit_total{domain=\"od\",descriptor=\"tenant\"} 4",
    ] {
        assert!(text.contains(needle), "missing {needle} in:\n{text}");
    }
}

#[tokio::test]
async fn a_borrowed_admission_is_flagged_in_the_answer_the_header_and_the_metrics() {
    let dir = tempdir("borrow");
    std::fs::write(
        dir.join("pool.yaml"),
        "domain: pool\npools:\n  - {name: shared, rate_limit: {unit: hour, requests_per_unit: 3}}\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: hour, requests_per_unit: 1, name: per_tenant, borrow: {from: shared, up_to: 5}}\n",
    )
    .unwrap();
    let s = Server::start(&dir, &[]).await;
    let c = Client::new();
    let req = json!({"domain": "pool", "descriptors": [{"tenant": "t1"}]});
    // Its own 1, then 2 borrowed (the pool of 3 is spent), then refused.
    for i in 0..4 {
        let r = check(&c, &s, req.clone()).await;
        let header = r
            .headers()
            .get("tollgate-overage")
            .map(|v| v.to_str().unwrap().to_string());
        let status = r.status();
        let body: Value = r.json().await.unwrap();
        let d = &body["descriptors"][0];
        assert_eq!(d["limit"]["requests_per_unit"], 1, "{i}: {body}");
        match i {
            0 => {
                assert_eq!(status, StatusCode::OK);
                assert_eq!(d["over_soft_limit"], false, "{body}");
                assert_eq!(header, None);
            }
            1 | 2 => {
                assert_eq!(status, StatusCode::OK, "{i}");
                assert_eq!(d["over_soft_limit"], true, "{i}: {body}");
                assert_eq!(d["remaining"], 0, "{i}: {body}");
                assert_eq!(header.as_deref(), Some("\"per_tenant\""), "{i}");
            }
            _ => {
                assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
                assert_eq!(header, None);
            }
        }
    }
    let text = s.get_text("/metrics").await;
    for needle in [
        "tollgate_overage_total{domain=\"pool\",descriptor=\"tenant\"} 2",
        "tollgate_within_limit_total{domain=\"pool\",descriptor=\"tenant\"} 3",
        "tollgate_over_limit_total{domain=\"pool\",descriptor=\"tenant\"} 1",
    ] {
        assert!(text.contains(needle), "missing {needle} in:\n{text}");
    }
}
