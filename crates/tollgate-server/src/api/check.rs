//! `POST /v1/check`: plain JSON for callers that do not speak Envoy's API.
//!
//! ```text
//! {"domain":"api","descriptors":[{"user":"alice","path":"/upload"}],"hits":1}
//! ```
//! A descriptor is an object of entries in order (key → value), or a list of
//! `[key, value]` pairs when a key repeats. `hits` is optional (default 1). The answer
//! is 200 or 429 with the RateLimit headers, `Retry-After` when over the limit, and a
//! decision per descriptor; 503 with a problem body while no rules are loaded.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;
use serde_json::{json, Value};
use tollgate::clock::NANOS_PER_SEC;
use tollgate::limiter::{Code, Descriptor, RateLimitRequest, RateLimitResponse};

use axum::extract::rejection::BytesRejection;
use tollgate::limiter::RequestLimits;

use super::{bad_request, body_refused, decided, limiter_error, no_rules, refusal};
use crate::service::Service;

pub(super) async fn handle(
    State(service): State<Arc<Service>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(body) => body,
        Err(rejection) => return body_refused(&service, rejection),
    };
    let request = match parse(&body, &service.limiter.settings().limits) {
        Ok(r) => r,
        Err(why) => return bad_request(&service, why),
    };
    if !service.rules_loaded() {
        return no_rules();
    }
    match service.decide(&request).await {
        Ok(response) => decided(&service, &response, render(&response)),
        Err(e) => limiter_error(&service, e),
    }
}

/// Parses the body; `Err` says what is wrong, in words a caller can act on. The
/// conversion of descriptors stops at the first size over `limits`, in the order
/// [`RequestLimits::check_sizes`] looks at them.
fn parse(body: &[u8], limits: &RequestLimits) -> Result<RateLimitRequest, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not valid JSON: {e}"))?;
    let obj = value.as_object().ok_or("the body must be a JSON object")?;
    for key in obj.keys() {
        if !matches!(key.as_str(), "domain" | "descriptors" | "hits") {
            return Err(format!(
                "unknown field `{key}` (expected domain, descriptors, hits)"
            ));
        }
    }
    let domain = match obj.get("domain") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err("`domain` must be a string".into()),
        None => return Err("`domain` is missing".into()),
    };
    let hits = match obj.get("hits") {
        None | Some(Value::Null) => 1,
        Some(v) => v
            .as_u64()
            .filter(|&h| h > 0)
            .ok_or("`hits` must be a whole number of at least 1")?,
    };
    let list = match obj.get("descriptors") {
        Some(Value::Array(a)) => a,
        Some(_) => return Err("`descriptors` must be a list".into()),
        None => return Err("`descriptors` is missing".into()),
    };
    let descriptors = list
        .iter()
        .enumerate()
        .map(|(i, d)| {
            limits.check_descriptor_count(i + 1).map_err(refusal)?;
            descriptor(i, d, limits)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(RateLimitRequest {
        domain,
        descriptors,
        hits_addend: hits,
    })
}

fn descriptor(i: usize, value: &Value, limits: &RequestLimits) -> Result<Descriptor, String> {
    let text = |v: &Value, what: &str| match v {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        Value::Bool(b) => Ok(b.to_string()),
        _ => Err(format!("descriptor {i}: {what} must be a string")),
    };
    // Entry `j`, judged for its size before it is taken.
    let entry = |j: usize, key: String, value: String| {
        limits.check_entry(i, j, &key, &value).map_err(refusal)?;
        Ok((key, value))
    };
    let count = |j: usize| limits.check_entry_count(i, j + 1).map_err(refusal);
    let entries = match value {
        Value::Object(map) => map
            .iter()
            .enumerate()
            .map(|(j, (k, v))| {
                count(j)?;
                entry(j, k.clone(), text(v, &format!("the value of `{k}`"))?)
            })
            .collect::<Result<Vec<_>, String>>()?,
        Value::Array(pairs) => pairs
            .iter()
            .enumerate()
            .map(|(j, p)| {
                count(j)?;
                match p.as_array().map(Vec::as_slice) {
                    Some([k, v]) => entry(j, text(k, "a key")?, text(v, "a value")?),
                    _ => Err(format!(
                        "descriptor {i}: each entry must be a [key, value] pair"
                    )),
                }
            })
            .collect::<Result<Vec<_>, String>>()?,
        _ => {
            return Err(format!(
                "descriptor {i} must be an object (key to value) or a list of [key, value] pairs"
            ))
        }
    };
    Ok(Descriptor {
        entries,
        ..Descriptor::default()
    })
}

fn code(c: Code) -> &'static str {
    match c {
        Code::Ok => "OK",
        Code::OverLimit => "OVER_LIMIT",
    }
}

fn render(response: &RateLimitResponse) -> Value {
    let descriptors: Vec<Value> = response
        .statuses
        .iter()
        .map(|s| {
            json!({
                "code": code(s.code),
                "limit": s.limit.as_ref().map(|l| json!({
                    "name": l.name,
                    "requests_per_unit": l.requests_per_unit,
                    "unit": l.unit.name(),
                })),
                "remaining": s.remaining,
                "reset_after_seconds": s.reset_after_secs(),
                "retry_after_seconds": s.retry_after_secs(),
                "delay_ms": s.delay / (NANOS_PER_SEC / 1000),
                "over_soft_limit": s.over_soft_limit,
                "shadow": s.shadow,
            })
        })
        .collect();
    json!({
        "allowed": response.overall == Code::Ok,
        "overall": code(response.overall),
        "descriptors": descriptors,
    })
}

#[cfg(test)]
mod tests {
    use super::parse as parse_within;
    use tollgate::limiter::RequestLimits;

    fn parse(body: &[u8]) -> Result<super::RateLimitRequest, String> {
        parse_within(body, &RequestLimits::default())
    }

    #[test]
    fn descriptors_keep_their_entry_order() {
        let r = parse(
            br#"{"domain":"api","descriptors":[{"user":"alice","path":"/upload"}],"hits":2}"#,
        )
        .unwrap();
        assert_eq!(
            r.descriptors[0].entries,
            [
                ("user".to_string(), "alice".to_string()),
                ("path".into(), "/upload".into())
            ]
        );
        assert_eq!(r.hits_addend, 2);
    }

    #[test]
    fn malformed_bodies_say_what_is_wrong() {
        let cases: [(&[u8], &str); 6] = [
            (
                b"{",
                "the body is not valid JSON: EOF while parsing an object at line 1 column 1",
            ),
            (b"[]", "the body must be a JSON object"),
            (br#"{"descriptors":[]}"#, "`domain` is missing"),
            (
                br#"{"domain":"d","descriptors":[7]}"#,
                "descriptor 0 must be an object (key to value) or a list of [key, value] pairs",
            ),
            (
                br#"{"domain":"d","descriptors":[],"hits":0}"#,
                "`hits` must be a whole number of at least 1",
            ),
            (
                br#"{"domain":"d","descriptors":[],"extra":1}"#,
                "unknown field `extra` (expected domain, descriptors, hits)",
            ),
        ];
        for (body, why) in cases {
            assert_eq!(parse(body).unwrap_err(), why);
        }
    }

    proptest::proptest! {
        #[test]
        fn no_body_makes_the_parser_panic(body in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let _ = parse(&body);
        }

        #[test]
        fn no_json_document_makes_the_parser_panic(text in r#"\{("[a-zA-Z_]{0,12}":(\[|\{|"[^"]{0,8}"|-?[0-9]{1,20}|null|true|\]|\}|,){0,6}){0,4}\}"#) {
            let _ = parse(text.as_bytes());
        }
    }
}
