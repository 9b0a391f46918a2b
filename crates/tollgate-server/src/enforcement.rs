//! The emergency switch's admin endpoint (`GET` and `POST /v1/enforcement`) and, with a
//! Redis store, its sharing: a switch is written to a Redis key that every instance
//! reads every [`FOLLOW_EVERY`], so it applies to the whole fleet within a second. The
//! switch itself ([`Enforcement`]) lives in the limiter, beside the rules: a reload
//! keeps it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{ConnectInfo, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::sync::watch;
use tollgate::limiter::{Change, Enforcement, EnforcementState, Mode, MAX_SWITCHED_DOMAINS};
use tracing::{info, warn};

use crate::service::Service;

/// The shared setting the switch is kept in (`<prefix>:setting:enforcement`).
const SETTING: &str = "enforcement";

/// How often each instance reads the shared switch.
pub(crate) const FOLLOW_EVERY: Duration = Duration::from_millis(500);

/// Bytes a `POST /v1/enforcement` body may hold.
const BODY_LIMIT: usize = 4096;

/// Bytes a domain name may hold in a switch.
const MAX_DOMAIN_BYTES: usize = 1024;

/// The switch as JSON: `{"all": mode, "domains": {name: mode}, "last_change": {domain,
/// mode, by, at_unix} | null}`.
pub(crate) fn to_json(state: &EnforcementState) -> Value {
    json!({
        "all": state.all.as_str(),
        "domains": state.domains.iter().map(|(d, m)| (d.clone(), Value::from(m.as_str()))).collect::<serde_json::Map<_, _>>(),
        "last_change": state.last_change.as_ref().map(|c| json!({
            "domain": c.domain,
            "mode": c.mode.as_str(),
            "by": c.by,
            "at_unix": c.at_unix,
        })),
    })
}

/// The switch from its JSON ([`to_json`]), as another instance shared it.
pub(crate) fn from_json(text: &[u8]) -> Result<EnforcementState, String> {
    let v: Value = serde_json::from_slice(text).map_err(|e| e.to_string())?;
    let mode = |v: &Value, what: &str| -> Result<Mode, String> {
        v.as_str()
            .ok_or_else(|| format!("{what}: not a string"))?
            .parse()
    };
    let all = mode(&v["all"], "all")?;
    let mut domains = std::collections::BTreeMap::new();
    if let Some(map) = v["domains"].as_object() {
        for (d, m) in map.iter().take(MAX_SWITCHED_DOMAINS) {
            domains.insert(d.clone(), mode(m, d)?);
        }
    }
    let last_change = match &v["last_change"] {
        Value::Object(c) => Some(Change {
            domain: c
                .get("domain")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            mode: mode(c.get("mode").unwrap_or(&Value::Null), "last_change.mode")?,
            by: c
                .get("by")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            at_unix: c.get("at_unix").and_then(Value::as_u64).unwrap_or(0),
        }),
        _ => None,
    };
    Ok(EnforcementState {
        all,
        domains,
        last_change,
    })
}

/// `GET /v1/enforcement`: the switch.
pub(crate) async fn show(State(service): State<Arc<Service>>) -> Json<Value> {
    Json(json!({ "enforcement": to_json(&service.limiter.enforcement().state()) }))
}

/// `POST /v1/enforcement` with `{"domain": "api" | "*", "mode": "shadow" | "enforce"}`:
/// switches at once, logs who (the caller's address) and when, and with a Redis store
/// shares the switch with every instance. 200 with the switch after; 400 for a body
/// that says something else.
pub(crate) async fn switch(State(service): State<Arc<Service>>, request: Request) -> Response {
    if !service.switch_allowed() {
        return refused(
            StatusCode::FORBIDDEN,
            "the emergency switch needs guarded admin endpoints: set an admin token \
             (--admin-token-file) or serve them on a loopback --admin-listen",
        );
    }
    // One change at a time on this instance: each reads what the fleet shares, changes
    // it and writes it back.
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _turn = ONE_AT_A_TIME.lock().await;
    let by = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map_or_else(|| "unknown".to_string(), |c| c.0.to_string());
    let body = match axum::body::to_bytes(request.into_body(), BODY_LIMIT).await {
        Ok(body) => body,
        Err(_) => {
            return refused(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body may be at most {BODY_LIMIT} bytes"),
            )
        }
    };
    let (domain, mode) = match parse_switch(&body) {
        Ok(asked) => asked,
        Err(why) => return refused(StatusCode::BAD_REQUEST, why),
    };
    let at_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let enforcement = service.limiter.enforcement();
    // With a shared switch, the change applies to what the fleet shares (another
    // instance's switch included), not to this instance's copy of it: a switch that
    // cannot read it is refused rather than overwrite it with a copy that may be stale.
    let redis = shared_store(&service);
    if let Some(redis) = &redis {
        match redis.shared_setting(SETTING).await {
            Ok(Some(text)) => match from_json(&text) {
                Ok(state) => {
                    enforcement.replace(state);
                }
                Err(e) => warn!(error = %e, "the shared enforcement switch in Redis is not readable; this change replaces it"),
            },
            Ok(None) => {}
            Err(e) => {
                return refused(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("the shared switch could not be read from Redis ({e}); nothing was switched: try again"),
                )
            }
        }
    }
    let state = match enforcement.set(&domain, mode, &by, at_unix) {
        Ok(state) => state,
        Err(why) => return refused(StatusCode::CONFLICT, why),
    };
    let known = domain == "*" || service.limiter.rules().current().domain(&domain).is_some();
    warn!(domain = %domain, mode = mode.as_str(), by = %by, at_unix, known_domain = known, "enforcement switched");
    service.metrics.enforcement(&state);
    let shown = to_json(&state);
    let shared = match &redis {
        None => Value::Null,
        Some(redis) => match redis
            .set_shared_setting(SETTING, shown.to_string().as_bytes())
            .await
        {
            Ok(()) => Value::Bool(true),
            Err(e) => {
                warn!(error = %e, "the enforcement switch applies here but could not be written to Redis for the other instances");
                Value::Bool(false)
            }
        },
    };
    (
        StatusCode::OK,
        Json(json!({ "enforcement": shown, "shared": shared, "known_domain": known })),
    )
        .into_response()
}

/// The Redis the switch is shared through: the global store when regions share one (so
/// that a switch reaches every region), else the instance's own Redis.
fn shared_store(service: &Service) -> Option<Arc<tollgate::store::RedisStore>> {
    let store = service.limiter.store();
    store.global_redis().or(store.redis()).cloned()
}

/// The domain and mode a switch's body asks for.
fn parse_switch(body: &[u8]) -> Result<(String, Mode), String> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| format!("the body is not JSON: {e}; expected {{\"domain\": \"api\" or \"*\", \"mode\": \"shadow\" or \"enforce\"}}"))?;
    let Some(obj) = v.as_object() else {
        return Err("the body must be a JSON object with `domain` and `mode`".into());
    };
    if let Some(other) = obj.keys().find(|k| *k != "domain" && *k != "mode") {
        return Err(format!(
            "unknown field `{other}`: a switch has `domain` and `mode`"
        ));
    }
    let domain = obj.get("domain").and_then(Value::as_str).ok_or(
        "`domain` is missing or not a string (a domain's name, or \"*\" for every domain)",
    )?;
    if domain.is_empty() || domain.len() > MAX_DOMAIN_BYTES {
        return Err(format!("`domain` must hold 1 to {MAX_DOMAIN_BYTES} bytes"));
    }
    let mode = obj
        .get("mode")
        .and_then(Value::as_str)
        .ok_or("`mode` is missing or not a string (\"shadow\" or \"enforce\")")?
        .parse()?;
    Ok((domain.to_string(), mode))
}

fn refused(status: StatusCode, why: impl Into<String>) -> Response {
    (status, Json(json!({ "error": why.into() }))).into_response()
}

/// Reads the shared switch every [`FOLLOW_EVERY`] until `stop` (with a Redis store; with
/// another store it returns at once), applying what another instance switched. Also
/// keeps the switch's metric up to date.
pub(crate) async fn follow(service: Arc<Service>, mut stop: watch::Receiver<bool>) {
    let enforcement: &Arc<Enforcement> = service.limiter.enforcement();
    service.metrics.enforcement(&enforcement.state());
    let Some(redis) = shared_store(&service) else {
        return;
    };
    let mut last: Option<Vec<u8>> = None;
    let mut tick = tokio::time::interval(FOLLOW_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut warned = false;
    let mut failing = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
        // A change made here while the read was on its way is newer than what it read.
        let generation = enforcement.generation();
        let text = match redis.shared_setting(SETTING).await {
            Ok(Some(text)) => text,
            Ok(None) => continue,
            Err(e) => {
                if !failing {
                    warn!(error = %e, "the shared enforcement switch cannot be read from Redis; this instance keeps its own until it can");
                    failing = true;
                }
                continue;
            }
        };
        if failing {
            info!("the shared enforcement switch can be read from Redis again");
            failing = false;
        }
        if last.as_deref() == Some(&text[..]) {
            continue;
        }
        match from_json(&text) {
            Ok(state) => {
                if enforcement.replace_if(generation, state.clone()) {
                    info!(switch = %to_json(&state), "enforcement switch applied, as shared in Redis");
                }
                service.metrics.enforcement(&enforcement.state());
                warned = false;
            }
            Err(e) if !warned => {
                warn!(error = %e, "the shared enforcement switch in Redis is not readable; this instance keeps its own");
                warned = true;
            }
            Err(_) => {}
        }
        last = Some(text.to_vec());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_round_trips_through_its_json() {
        let e = Enforcement::default();
        e.set("api", Mode::Shadow, "10.0.0.1:5000", 1_800_000_000)
            .expect("room");
        let state = e.set("*", Mode::Enforce, "10.0.0.2:6000", 1_800_000_001);
        let state = state.expect("room");
        let text = to_json(&state).to_string();
        assert_eq!(from_json(text.as_bytes()), Ok(state));
    }

    #[test]
    fn a_bad_switch_is_refused_with_what_is_wrong() {
        assert_eq!(
            parse_switch(br#"{"domain": "api", "mode": "shadow"}"#),
            Ok(("api".to_string(), Mode::Shadow))
        );
        let why = |b: &[u8]| parse_switch(b).expect_err("refused");
        assert!(why(br#"{"domain": "api", "mode": "off"}"#).contains("`off`"));
        assert!(why(br#"{"domain": "api"}"#).contains("`mode`"));
        assert!(why(br#"{"mode": "shadow"}"#).contains("`domain`"));
        assert!(why(br#"{"domain": "", "mode": "shadow"}"#).contains("1 to 1024"));
        assert!(why(br#"{"domain": "a", "mode": "shadow", "x": 1}"#).contains("unknown field `x`"));
        assert!(why(b"[1]").contains("JSON object"));
        assert!(why(b"{").contains("not JSON"));
    }
}
