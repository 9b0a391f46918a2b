//! Health, readiness, the active rules, reload, and metrics.

use std::sync::Arc;
use std::time::UNIX_EPOCH;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use tollgate::rules::ReloadOutcome;

use crate::service::{Readiness, Service, NO_RULES};

/// Envoy's name: 200 `OK` while serving, 503 while not ready (starting, or no rules
/// loaded: the body says so) or draining.
pub(super) async fn healthcheck(State(service): State<Arc<Service>>) -> Response {
    match service.readiness() {
        Readiness::Ready => (StatusCode::OK, "OK").into_response(),
        _ if !service.rules_loaded() => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("NOT READY: {NO_RULES}"),
        )
            .into_response(),
        _ => (StatusCode::SERVICE_UNAVAILABLE, "NOT READY").into_response(),
    }
}

/// Liveness: the process answers.
pub(super) async fn healthz() -> &'static str {
    "ok"
}

/// Readiness: rules loaded, listeners up (on Redis, warm); 503 otherwise and while
/// draining.
pub(super) async fn readyz(State(service): State<Arc<Service>>) -> Response {
    healthcheck(State(service)).await
}

/// The active rule set: whether one is loaded, its files, load time, domains, the last
/// load error (with no rules loaded: why the files do not load), and the emergency
/// switch.
pub(super) async fn rules(State(service): State<Arc<Service>>) -> Json<serde_json::Value> {
    let rules = service.limiter.rules();
    let set = rules.current();
    let domains: Vec<_> = set
        .domains()
        .iter()
        .map(|d| json!({"domain": &*d.name, "files": d.files, "rules": d.rule_count(), "limits": d.limit_count()}))
        .collect();
    Json(json!({
        "loaded": rules.is_loaded(),
        "loaded_at_unix": set.loaded_at().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map(|d| d.as_secs()),
        "files": set.files().iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        "domains": domains,
        "reload_attempts": rules.reload_attempts(),
        "load_successes": rules.load_successes(),
        "load_failures": rules.load_failures(),
        "last_error": rules.last_error().map(|e| e.iter().map(ToString::to_string).collect::<Vec<_>>()),
        "enforcement": crate::enforcement::to_json(&service.limiter.enforcement().state()),
    }))
}

/// Reloads the rules now: 200 when reloaded or unchanged; 422 with every error when
/// the new rules are invalid (the old ones keep serving).
///
/// The files are read on a thread of their own whose stack is set
/// ([`reload_thread`](tollgate::rules::reload_thread)), not on a blocking-pool thread,
/// whose stack `RUST_MIN_STACK` can shrink below what a deep file needs. One such
/// thread at a time: calls that come while one runs wait for it (reloads run one at a
/// time anyway), without a thread each.
pub(super) async fn reload(State(service): State<Arc<Service>>) -> Response {
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let rules = Arc::clone(service.limiter.rules());
    let outcome = {
        let _turn = ONE_AT_A_TIME.lock().await;
        let (tx, rx) = tokio::sync::oneshot::channel();
        match tollgate::rules::reload_thread("tollgate-reload").spawn(move || {
            let _ = tx.send(rules.reload());
        }) {
            Ok(_) => rx
                .await
                .map_err(|_| "the reload thread ended without an answer".to_string()),
            Err(e) => Err(format!("cannot start a thread to reload the rules: {e}")),
        }
    };
    // A first load makes the service ready: tell the health watchers now.
    service.refresh();
    match outcome {
        Ok(Ok(ReloadOutcome::Reloaded)) => (StatusCode::OK, Json(json!({"outcome": "reloaded"}))).into_response(),
        Ok(Ok(ReloadOutcome::Unchanged)) => (StatusCode::OK, Json(json!({"outcome": "unchanged"}))).into_response(),
        Ok(Err(errors)) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({"outcome": "rejected", "errors": errors.iter().map(ToString::to_string).collect::<Vec<_>>()})),
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, Json(json!({"error": e}))).into_response(),
    }
}

/// Prometheus exposition (OpenMetrics text).
pub(super) async fn metrics(State(service): State<Arc<Service>>) -> Response {
    let body = service.metrics.render(
        service.limiter.rules(),
        service.limiter.store(),
        service.limiter.fallback(),
    );
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
        .into_response()
}
