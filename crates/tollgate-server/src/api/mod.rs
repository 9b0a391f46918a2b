//! The HTTP listener: Envoy's `/json`, Tollgate's `/v1/check`, and the admin endpoints
//! (`/healthcheck`, `/healthz`, `/readyz`, `/rules`, `/reload`, `/v1/enforcement`,
//! `/metrics`, the dashboard's `/dashboard` and `/v1/stats`), which
//! `tollgate serve --admin-listen` and `tollgate proxy --admin-listen` serve alone. With
//! an admin token (auth.rs), all but the health checks require it (`/metrics` only with
//! `--metrics-require-token`).

mod admin;
mod auth;
pub(crate) mod check;
pub(crate) mod json;
mod stream;

pub use auth::AdminAccess;

use std::sync::Arc;

use axum::extract::rejection::BytesRejection;
use axum::extract::DefaultBodyLimit;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::json;
use tollgate::limiter::{self, Code, RateLimitResponse, RequestLimits};

use crate::service::{Service, NO_RULES};
use tollgate::headers::{append_to, headers};

/// Every HTTP route of `tollgate serve`'s HTTP listener: the check APIs, the health
/// checks, and, with `admin` (no `--admin-listen`), the other admin endpoints. The
/// check APIs read bodies of at most [`body_limit`] bytes.
pub fn router(service: Arc<Service>, admin: Option<&AdminAccess>) -> Router {
    let limit = body_limit(&service.limiter.settings().limits);
    let api = Router::new()
        .route("/json", post(json::handle))
        .route("/v1/check", post(check::handle))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(Arc::clone(&service));
    match admin {
        Some(access) => api.merge(admin_router(service, access)),
        None => api.merge(health_router(service)),
    }
}

/// The admin endpoints (`--admin-listen`'s routes, or part of [`router`]): the health
/// checks, open; the rules and reload behind `access`'s token, and metrics too if asked.
pub fn admin_router(service: Arc<Service>, access: &AdminAccess) -> Router {
    let control = access.guard(
        Router::new()
            .route("/rules", get(admin::rules))
            .route("/reload", post(admin::reload))
            .route(
                "/v1/enforcement",
                get(crate::enforcement::show).post(crate::enforcement::switch),
            )
            .route("/v1/stats", get(crate::dashboard::stats::handle)),
    );
    let metrics = Router::new().route("/metrics", get(admin::metrics));
    let metrics = if access.metrics_guarded() {
        access.guard(metrics)
    } else {
        metrics
    };
    // The dashboard's page holds no data (it reads `/v1/stats`, guarded above).
    let page = Router::new().route("/dashboard", get(crate::dashboard::page));
    health_router(Arc::clone(&service))
        .merge(page)
        .merge(control.merge(metrics).with_state(service))
}

/// Bytes of request body the check APIs (`/json`, `/v1/check`) read, for requests
/// within `limits`: 512 bytes for every entry the limits allow (64 × 32 × 512 = 1 MiB
/// with the defaults), and at least four times `--max-entry-bytes` (room for one
/// entry of the longest key and value, written out in JSON). A longer body is refused
/// with 413 before it is parsed.
pub fn body_limit(limits: &RequestLimits) -> usize {
    limits
        .max_descriptors
        .saturating_mul(limits.max_entries)
        .saturating_mul(512)
        .max(limits.max_entry_bytes.saturating_mul(4))
}

/// The answer to a body that could not be read: 413 with a JSON body naming the limit
/// when it is longer than [`body_limit`] (counted as an invalid request), else the
/// extractor's own answer.
pub(crate) fn body_refused(service: &Service, rejection: BytesRejection) -> Response {
    if rejection.status() != StatusCode::PAYLOAD_TOO_LARGE {
        return rejection.into_response();
    }
    service.metrics.invalid_request();
    let limit = body_limit(&service.limiter.settings().limits);
    (
        StatusCode::PAYLOAD_TOO_LARGE,
        axum::Json(json!({
            "error": format!(
                "the request body may be at most {limit} bytes (512 per entry that \
                 --max-descriptors and --max-entries allow)"
            )
        })),
    )
        .into_response()
}

/// What the limiter's refusal of a request says.
pub(crate) fn refusal(e: limiter::Error) -> String {
    match e {
        limiter::Error::InvalidRequest(why) => why,
        other => other.to_string(),
    }
}

/// The health checks, open to every probe: Envoy's `/healthcheck`, `/healthz`, `/readyz`.
fn health_router(service: Arc<Service>) -> Router {
    Router::new()
        .route("/healthcheck", get(admin::healthcheck))
        .route("/healthz", get(admin::healthz))
        .route("/readyz", get(admin::readyz))
        .with_state(service)
}

/// A 400 with a JSON body saying what is wrong.
pub(crate) fn bad_request(service: &Service, message: impl Into<String>) -> Response {
    service.metrics.invalid_request();
    (
        StatusCode::BAD_REQUEST,
        axum::Json(json!({ "error": message.into() })),
    )
        .into_response()
}

/// 503 with a problem body (RFC 9457) saying [`NO_RULES`]: the answer of the check
/// APIs while no rules are loaded.
pub(crate) fn no_rules() -> Response {
    let body = json!({
        "type": "https://tollgate.dev/problems/no-configuration",
        "title": "Service Unavailable",
        "status": 503,
        "detail": NO_RULES,
    });
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        )],
        body.to_string(),
    )
        .into_response()
}

/// Maps a limiter error to a response.
pub(crate) fn limiter_error(service: &Service, e: limiter::Error) -> Response {
    match e {
        limiter::Error::InvalidRequest(why) => bad_request(service, why),
        other => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({ "error": other.to_string() })),
        )
            .into_response(),
    }
}

/// 200 or 429 with the rate limit headers of `response` and `body`.
pub(crate) fn decided(
    service: &Service,
    response: &RateLimitResponse,
    body: serde_json::Value,
) -> Response {
    let status = if response.overall == Code::OverLimit {
        StatusCode::TOO_MANY_REQUESTS
    } else {
        StatusCode::OK
    };
    let mut map = HeaderMap::new();
    append_to(&mut map, headers(response, service.headers));
    (status, map, axum::Json(body)).into_response()
}
