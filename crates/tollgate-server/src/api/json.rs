//! `POST /json`: envoyproxy/ratelimit's HTTP endpoint. The body is a
//! `RateLimitRequest` in proto3 JSON (lowerCamelCase or the proto's snake_case field
//! names, 64-bit numbers as numbers or strings, enums by name or number); the answer is
//! a `RateLimitResponse` in proto3 JSON, 200 when OK, 429 when over the limit, 400 on
//! bad input, 503 while no rules are loaded. The request goes through the same
//! conversion as gRPC.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{rate_limit::Unit, Code};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use serde_json::{json, Map, Value};

use axum::extract::rejection::BytesRejection;
use tollgate::limiter::RequestLimits;

use super::{bad_request, body_refused, decided, limiter_error, no_rules, refusal};
use crate::grpc::rls::{from_wire, to_wire};
use crate::service::Service;

pub(super) async fn handle(
    State(service): State<Arc<Service>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(body) => body,
        Err(rejection) => return body_refused(&service, rejection),
    };
    let limits = service.limiter.settings().limits;
    let wire = match parse(&body, &limits) {
        Ok(w) => w,
        Err(why) => return bad_request(&service, why),
    };
    let request = match from_wire(wire, &limits) {
        Ok(r) => r,
        Err(why) => return bad_request(&service, why),
    };
    if !service.rules_loaded() {
        return no_rules();
    }
    match service.decide(&request).await {
        Ok(response) => {
            let wire = to_wire(&response, &service);
            let mut body = render(&wire);
            if service.dynamic_metadata {
                let m = crate::grpc::metadata::dynamic_metadata(&request, &response);
                if let Value::Object(out) = &mut body {
                    out.insert("dynamicMetadata".into(), json_of(&m));
                }
            }
            decided(&service, &response, body)
        }
        Err(e) => limiter_error(&service, e),
    }
}

/// A field by its JSON (lowerCamelCase) or proto (snake_case) name.
fn get<'a>(obj: &'a Map<String, Value>, camel: &str, snake: &str) -> Option<&'a Value> {
    obj.get(camel).or_else(|| obj.get(snake))
}

/// A proto3-JSON unsigned integer: a number or a decimal string.
fn unsigned(v: &Value, what: &str) -> Result<u64, String> {
    match v {
        Value::Number(n) => n
            .as_u64()
            .ok_or_else(|| format!("{what} must be a non-negative whole number")),
        Value::String(s) => s
            .parse()
            .map_err(|_| format!("{what} must be a non-negative whole number, got \"{s}\"")),
        Value::Null => Ok(0),
        _ => Err(format!("{what} must be a number")),
    }
}

/// Parses the body; the conversion of descriptors stops at the first size over
/// `limits`, in the order [`RequestLimits::check_sizes`] looks at them.
fn parse(body: &[u8], limits: &RequestLimits) -> Result<RateLimitRequest, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not valid JSON: {e}"))?;
    let obj = value
        .as_object()
        .ok_or("the body must be a JSON object (a RateLimitRequest)")?;
    let domain = match obj.get("domain") {
        Some(Value::String(s)) => s.clone(),
        None | Some(Value::Null) => String::new(),
        Some(_) => return Err("`domain` must be a string".into()),
    };
    let hits = match get(obj, "hitsAddend", "hits_addend") {
        Some(v) => u32::try_from(unsigned(v, "`hitsAddend`")?)
            .map_err(|_| "`hitsAddend` is too large".to_string())?,
        None => 0,
    };
    let descriptors = match obj.get("descriptors") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, d)| {
                limits.check_descriptor_count(i + 1).map_err(refusal)?;
                descriptor(i, d, limits)
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err("`descriptors` must be a list".into()),
    };
    Ok(RateLimitRequest {
        domain,
        descriptors,
        hits_addend: hits,
    })
}

fn descriptor(i: usize, v: &Value, limits: &RequestLimits) -> Result<RateLimitDescriptor, String> {
    let obj = v
        .as_object()
        .ok_or_else(|| format!("descriptor {i} must be an object"))?;
    let entries = match obj.get("entries") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(j, e)| {
                limits.check_entry_count(i, j + 1).map_err(refusal)?;
                let e = e
                    .as_object()
                    .ok_or_else(|| format!("descriptor {i}, entry {j} must be an object"))?;
                let field = |name: &str| match e.get(name) {
                    Some(Value::String(s)) => Ok(s.clone()),
                    None | Some(Value::Null) => Ok(String::new()),
                    Some(_) => Err(format!(
                        "descriptor {i}, entry {j}: `{name}` must be a string"
                    )),
                };
                let (key, value) = (field("key")?, field("value")?);
                limits.check_entry(i, j, &key, &value).map_err(refusal)?;
                Ok(Entry { key, value })
            })
            .collect::<Result<_, String>>()?,
        Some(_) => return Err(format!("descriptor {i}: `entries` must be a list")),
    };
    let limit = match obj.get("limit") {
        None | Some(Value::Null) => None,
        Some(Value::Object(l)) => {
            let rpu = get(l, "requestsPerUnit", "requests_per_unit")
                .map_or(Ok(0), |v| unsigned(v, "`requestsPerUnit`"))?;
            let unit = match l.get("unit") {
                Some(Value::String(s)) => Unit::from_str_name(s)
                    .map(|u| u as i32)
                    .ok_or_else(|| format!("descriptor {i}: unknown unit \"{s}\""))?,
                Some(Value::Number(n)) => {
                    n.as_i64().and_then(|n| i32::try_from(n).ok()).unwrap_or(0)
                }
                _ => 0,
            };
            Some(RateLimitOverride {
                requests_per_unit: u32::try_from(rpu)
                    .map_err(|_| format!("descriptor {i}: `requestsPerUnit` is too large"))?,
                unit,
            })
        }
        Some(_) => return Err(format!("descriptor {i}: `limit` must be an object")),
    };
    let hits_addend = match get(obj, "hitsAddend", "hits_addend") {
        None | Some(Value::Null) => None,
        Some(v) => Some(UInt64Value {
            value: unsigned(v, "`hitsAddend`")?,
        }),
    };
    Ok(RateLimitDescriptor {
        entries,
        limit,
        hits_addend,
        is_negative_hits: false,
    })
}

/// A metadata tree as JSON (`google.protobuf.Struct`'s JSON form).
fn json_of(m: &tollgate::rules::Metadata) -> Value {
    use tollgate::rules::Metadata as M;
    match m {
        M::Null => Value::Null,
        M::Bool(b) => json!(b),
        M::Number(n) => json!(n),
        M::String(s) => json!(s),
        M::List(items) => Value::Array(items.iter().map(json_of).collect()),
        M::Map(fields) => Value::Object(
            fields
                .iter()
                .map(|(k, v)| (k.clone(), json_of(v)))
                .collect(),
        ),
    }
}

/// The response in proto3 JSON (default values left out, as proto3 JSON does).
fn render(wire: &RateLimitResponse) -> Value {
    let code = |c: i32| Code::try_from(c).map_or("UNKNOWN", |c| c.as_str_name());
    let statuses: Vec<Value> = wire
        .statuses
        .iter()
        .map(|s| {
            let mut m = Map::new();
            m.insert("code".into(), json!(code(s.code)));
            if let Some(l) = &s.current_limit {
                let mut limit = Map::new();
                if !l.name.is_empty() {
                    limit.insert("name".into(), json!(l.name));
                }
                limit.insert("requestsPerUnit".into(), json!(l.requests_per_unit));
                limit.insert(
                    "unit".into(),
                    json!(Unit::try_from(l.unit).map_or("UNKNOWN", |u| u.as_str_name())),
                );
                m.insert("currentLimit".into(), Value::Object(limit));
            }
            if s.limit_remaining > 0 {
                m.insert("limitRemaining".into(), json!(s.limit_remaining));
            }
            if let Some(d) = &s.duration_until_reset {
                let secs = if d.nanos == 0 {
                    format!("{}s", d.seconds)
                } else {
                    format!("{}.{:09}s", d.seconds, d.nanos)
                };
                m.insert("durationUntilReset".into(), json!(secs));
            }
            Value::Object(m)
        })
        .collect();
    let headers: Vec<Value> = wire
        .response_headers_to_add
        .iter()
        .map(|h| json!({"key": h.key, "value": h.value}))
        .collect();
    let mut out = Map::new();
    out.insert("overallCode".into(), json!(code(wire.overall_code)));
    out.insert("statuses".into(), Value::Array(statuses));
    if !headers.is_empty() {
        out.insert("responseHeadersToAdd".into(), Value::Array(headers));
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::parse as parse_within;
    use tollgate::limiter::RequestLimits;

    fn parse(body: &[u8]) -> Result<super::RateLimitRequest, String> {
        parse_within(body, &RequestLimits::default())
    }

    #[test]
    fn both_field_spellings_and_string_numbers_are_accepted() {
        let w = parse(br#"{"domain":"d","hits_addend":2,"descriptors":[{"entries":[{"key":"k","value":"v"}],"hitsAddend":"5","limit":{"requests_per_unit":"7","unit":"MINUTE"}}]}"#).unwrap();
        assert_eq!(w.hits_addend, 2);
        assert_eq!(
            w.descriptors[0].hits_addend.as_ref().map(|h| h.value),
            Some(5)
        );
        assert_eq!(
            w.descriptors[0]
                .limit
                .as_ref()
                .map(|l| (l.requests_per_unit, l.unit)),
            Some((7, 2))
        );
    }

    #[test]
    fn bad_input_is_named() {
        assert_eq!(
            parse(br#"{"domain":5}"#).unwrap_err(),
            "`domain` must be a string"
        );
        assert_eq!(
            parse(br#"{"domain":"d","descriptors":[{"entries":[{"key":1}]}]}"#).unwrap_err(),
            "descriptor 0, entry 0: `key` must be a string"
        );
        assert_eq!(
            parse(br#"{"domain":"d","hitsAddend":-1}"#).unwrap_err(),
            "`hitsAddend` must be a non-negative whole number"
        );
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
