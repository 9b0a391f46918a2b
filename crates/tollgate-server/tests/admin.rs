//! Who may call the admin endpoints, with a real client against the real binary:
//! `--admin-token` and `--admin-token-file` (401 without the bearer token or with a wrong
//! one, the health checks open, `/metrics` open unless `--metrics-require-token`),
//! `serve --admin-listen` (the admin endpoints move off the HTTP API listener), the
//! warning about an open `/reload`, and `proxy --admin-listen --admin-token`.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

mod support;

use std::time::{Duration, Instant};

use reqwest::{Client, Method, StatusCode};
use serde_json::{json, Value};
use support::upstream::start_upstream;
use support::{free_port, serve_refused, tempdir, Proxy, Server};

const RULES: &str = "domain: api
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 100}
";

const TOKEN: &str = "7f3a9c-admin.Token_42";

/// The rules directory of a test.
fn rules(name: &str) -> std::path::PathBuf {
    let dir = tempdir(&format!("admin-{name}"));
    std::fs::write(dir.join("api.yaml"), RULES).unwrap();
    dir
}

/// `method url`, with `Authorization: Bearer token` when given.
async fn call(c: &Client, method: Method, url: &str, token: Option<&str>) -> reqwest::Response {
    let mut request = c.request(method, url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    request.send().await.unwrap()
}

/// The status of `method url` with `token`.
async fn status(c: &Client, method: Method, url: &str, token: Option<&str>) -> StatusCode {
    call(c, method, url, token).await.status()
}

/// Asserts a 401 with the bearer challenge and a problem body.
async fn assert_refused(response: reqwest::Response, what: &str) {
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED, "{what}");
    let challenge = response.headers()["www-authenticate"].to_str().unwrap();
    assert!(challenge.starts_with("Bearer"), "{what}: {challenge}");
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json",
        "{what}"
    );
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["status"], 401, "{what}: {body}");
    assert_eq!(body["title"], "Unauthorized", "{what}: {body}");
}

/// `/rules`, `POST /reload` and `/v1/stats` at `base`: 401 without the token, with a wrong one or
/// another scheme; 200 with it.
async fn assert_guarded(c: &Client, base: &str) {
    for (method, path) in [
        (Method::GET, "/rules"),
        (Method::POST, "/reload"),
        (Method::GET, "/v1/stats"),
    ] {
        let url = format!("{base}{path}");
        let what = format!("{method} {path}");
        assert_refused(call(c, method.clone(), &url, None).await, &what).await;
        let wrong = call(c, method.clone(), &url, Some("7f3a9c-admin.Token_43")).await;
        assert_eq!(
            wrong.headers()["www-authenticate"],
            "Bearer error=\"invalid_token\""
        );
        assert_refused(wrong, &format!("{what}, wrong token")).await;
        let prefix = call(c, method.clone(), &url, Some(&TOKEN[..TOKEN.len() - 1])).await;
        assert_refused(prefix, &format!("{what}, the token's prefix")).await;
        let basic = c
            .request(method.clone(), &url)
            .basic_auth("admin", Some(TOKEN))
            .send()
            .await
            .unwrap();
        assert_refused(basic, &format!("{what}, basic")).await;
        let right = call(c, method, &url, Some(TOKEN)).await;
        assert_eq!(right.status(), StatusCode::OK, "{what}, right token");
    }
    let rules: Value = call(c, Method::GET, &format!("{base}/rules"), Some(TOKEN))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(rules["loaded"], true);
    let reload: Value = call(c, Method::POST, &format!("{base}/reload"), Some(TOKEN))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(reload["outcome"], "unchanged");
}

/// The health checks at `base` answer 200 without a token.
async fn assert_health_open(c: &Client, base: &str) {
    for path in ["/healthcheck", "/healthz", "/readyz"] {
        let url = format!("{base}{path}");
        assert_eq!(status(c, Method::GET, &url, None).await, 200, "{url}");
    }
}

/// `POST /v1/check` at `base` decides, without a token.
async fn assert_check_decides(c: &Client, base: &str) {
    let r = c
        .post(format!("{base}/v1/check"))
        .json(&json!({"domain": "api", "descriptors": [{"user": "a"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
}

/// Polls `GET url` until it answers 200 (a listener bound, or the service made ready, a
/// little after the harness saw the one it waits for); panics after 5 s.
async fn wait_for(c: &Client, url: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !c.get(url).send().await.is_ok_and(|r| r.status() == 200) {
        assert!(Instant::now() < deadline, "{url} never answered 200");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn the_admin_token_guards_rules_and_reload_not_health_metrics_or_checks() {
    let s = Server::start(&rules("token"), &["--admin-token", TOKEN]).await;
    let c = Client::new();
    assert_guarded(&c, &s.http).await;
    assert_health_open(&c, &s.http).await;
    let metrics = call(&c, Method::GET, &format!("{}/metrics", s.http), None).await;
    assert_eq!(metrics.status(), 200, "/metrics stays open by default");
    assert!(metrics
        .text()
        .await
        .unwrap()
        .contains("tollgate_config_load_success_total"));
    assert_check_decides(&c, &s.http).await;
}

#[tokio::test]
async fn metrics_require_the_token_when_asked() {
    let s = Server::start(
        &rules("metrics"),
        &["--admin-token", TOKEN, "--metrics-require-token"],
    )
    .await;
    let c = Client::new();
    let url = format!("{}/metrics", s.http);
    assert_refused(call(&c, Method::GET, &url, None).await, "/metrics").await;
    assert_refused(
        call(&c, Method::GET, &url, Some("wrong")).await,
        "/metrics, wrong token",
    )
    .await;
    assert_eq!(status(&c, Method::GET, &url, Some(TOKEN)).await, 200);
    assert_health_open(&c, &s.http).await;
}

#[tokio::test]
async fn admin_listen_moves_the_admin_endpoints_off_the_http_api_listener() {
    let admin = format!("127.0.0.1:{}", free_port());
    let s = Server::start(&rules("listen"), &["--admin-listen", &admin]).await;
    let c = Client::new();
    let admin_url = format!("http://{admin}");
    wait_for(&c, &format!("{admin_url}/readyz")).await;

    let rules = call(&c, Method::GET, &format!("{admin_url}/rules"), None).await;
    assert_eq!(rules.status(), 200);
    assert_eq!(rules.json::<Value>().await.unwrap()["loaded"], true);
    assert_eq!(
        status(&c, Method::POST, &format!("{admin_url}/reload"), None).await,
        200
    );
    assert_eq!(
        status(&c, Method::GET, &format!("{admin_url}/metrics"), None).await,
        200
    );
    assert_health_open(&c, &admin_url).await;
    // The check APIs stay on the HTTP listener.
    assert_eq!(
        status(&c, Method::POST, &format!("{admin_url}/v1/check"), None).await,
        404
    );

    for (method, path) in [
        (Method::GET, "/rules"),
        (Method::POST, "/reload"),
        (Method::GET, "/metrics"),
    ] {
        let url = format!("{}{path}", s.http);
        assert_eq!(status(&c, method, &url, None).await, 404, "{url}");
    }
    // The health checks stay on the HTTP listener too, for the probes there.
    assert_health_open(&c, &s.http).await;
    assert_check_decides(&c, &s.http).await;
}

#[tokio::test]
async fn the_token_file_guards_the_admin_listener() {
    let dir = rules("token-file");
    let file = dir.join("admin-token");
    std::fs::write(&file, format!("{TOKEN}\n")).unwrap();
    let admin = format!("127.0.0.1:{}", free_port());
    let s = Server::start(
        &dir,
        &[
            "--admin-listen",
            &admin,
            "--admin-token-file",
            file.to_str().unwrap(),
        ],
    )
    .await;
    let c = Client::new();
    let admin_url = format!("http://{admin}");
    wait_for(&c, &format!("{admin_url}/readyz")).await;
    // The file's trailing newline is not part of the token.
    assert_guarded(&c, &admin_url).await;
    assert_health_open(&c, &admin_url).await;
    assert_eq!(
        status(&c, Method::GET, &format!("{admin_url}/metrics"), None).await,
        200
    );
    assert_eq!(
        status(&c, Method::GET, &format!("{}/rules", s.http), Some(TOKEN)).await,
        404
    );
    assert_check_decides(&c, &s.http).await;
}

#[tokio::test]
async fn a_token_file_that_cannot_be_used_stops_the_start() {
    let dir = rules("token-file-bad");
    let missing = dir.join("no-such-token");
    let said = serve_refused(&dir, &["--admin-token-file", missing.to_str().unwrap()]);
    assert!(
        said.contains("--admin-token-file") && said.contains(missing.to_str().unwrap()),
        "{said}"
    );
    let empty = dir.join("empty-token");
    std::fs::write(&empty, "\n").unwrap();
    let said = serve_refused(&dir, &["--admin-token-file", empty.to_str().unwrap()]);
    assert!(
        said.contains("--admin-token-file") && said.contains("is empty"),
        "{said}"
    );
    let said = serve_refused(&dir, &["--metrics-require-token"]);
    assert!(said.contains("--metrics-require-token needs"), "{said}");
    let said = serve_refused(
        &dir,
        &[
            "--admin-token",
            TOKEN,
            "--admin-token-file",
            empty.to_str().unwrap(),
        ],
    );
    assert!(said.contains("cannot be used with"), "{said}");
}

#[tokio::test]
async fn an_open_reload_on_a_public_address_is_warned_about() {
    let dir = rules("warn");
    let warning = "answer anyone who reaches";
    let public = format!("0.0.0.0:{}", free_port());
    let log = dir.join("open.log");
    let s = Server::start_logging(&dir, &["--admin-listen", &public], &log).await;
    drop(s);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains(warning), "{text}");

    let public = format!("0.0.0.0:{}", free_port());
    let log = dir.join("guarded.log");
    let s = Server::start_logging(
        &dir,
        &["--admin-listen", &public, "--admin-token", TOKEN],
        &log,
    )
    .await;
    drop(s);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(!text.contains(warning), "{text}");
    assert!(!text.contains(TOKEN), "the token is never logged: {text}");

    // Loopback only (the harness's HTTP listener): no warning.
    let log = dir.join("loopback.log");
    let s = Server::start_logging(&dir, &[], &log).await;
    drop(s);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(!text.contains(warning), "{text}");
}

#[tokio::test]
async fn the_gateways_admin_listener_requires_the_token() {
    let (_up, upstream) = start_upstream().await;
    let dir = rules("gateway");
    let admin = format!("127.0.0.1:{}", free_port());
    let _proxy = Proxy::start(
        &dir,
        &format!("http://{upstream}"),
        &["--admin-listen", &admin, "--admin-token", TOKEN],
    )
    .await;
    let c = Client::new();
    let admin_url = format!("http://{admin}");
    wait_for(&c, &format!("{admin_url}/readyz")).await;
    assert_guarded(&c, &admin_url).await;
    assert_health_open(&c, &admin_url).await;
    assert_eq!(
        status(&c, Method::GET, &format!("{admin_url}/metrics"), None).await,
        200
    );
}
