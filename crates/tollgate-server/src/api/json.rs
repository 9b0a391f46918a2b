//! `POST /json`: envoyproxy/ratelimit's HTTP endpoint. The body is a
//! `RateLimitRequest` in proto3 JSON (lowerCamelCase or the proto's snake_case field
//! names, 64-bit numbers as numbers or strings, enums by name or number); the answer is
//! a `RateLimitResponse` in proto3 JSON, 200 when OK, 429 when over the limit, 400 on
//! bad input, 503 while no rules are loaded. The request goes through the same
//! conversion as gRPC.

use std::fmt;
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
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{json, Map, Value};

use axum::extract::rejection::BytesRejection;
use tollgate::limiter::RequestLimits;

use super::stream::{self_seed, skip, Field, Reader};
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

/// Parses the body (proto3 JSON: lowerCamelCase or snake_case names, 64-bit numbers as
/// numbers or strings, enums by name or number; other fields are skipped). The body is
/// read as it streams ([`stream`](super::stream)): the reading stops at the first size
/// over `limits`, in the order [`RequestLimits::check_sizes`] looks at them.
pub(crate) fn parse(body: &[u8], limits: &RequestLimits) -> Result<RateLimitRequest, String> {
    let reader = Reader::default();
    reader.read(
        body,
        "the body must be a JSON object (a RateLimitRequest)",
        Request {
            reader: &reader,
            limits,
        },
    )
}

/// The fields of a message, known by their lowerCamelCase or snake_case name.
fn fields<'r>(reader: &'r Reader, names: &'static [&'static str]) -> Field<'r> {
    Field {
        reader,
        names,
        strict: None,
    }
}

/// The request: `domain`, `descriptors`, `hitsAddend`.
struct Request<'r> {
    reader: &'r Reader,
    limits: &'r RequestLimits,
}

self_seed!(Request<'_>, deserialize_map);

impl<'de> Visitor<'de> for Request<'_> {
    type Value = RateLimitRequest;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a RateLimitRequest")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let r = self.reader;
        let names = &["domain", "descriptors", "hitsAddend", "hits_addend"];
        let (mut domain, mut descriptors) = (None, None);
        let mut hits = TwoSpellings::new("`hitsAddend`", "hits_addend");
        while let Some(field) = map.next_key_seed(fields(r, names))? {
            match field {
                Some(0) => {
                    domain = r.value::<Option<String>, _>(
                        &mut map,
                        format_args!("`domain` must be a string"),
                    )?
                }
                Some(1) => {
                    r.expect(format_args!("`descriptors` must be a list"));
                    descriptors = Some(map.next_value_seed(Descriptors {
                        reader: r,
                        limits: self.limits,
                    })?);
                }
                Some(n @ (2 | 3)) => hits.read(&mut map, r, n - 2)?,
                _ => skip(&mut map)?,
            }
        }
        let hits = hits.value.unwrap_or(0);
        Ok(RateLimitRequest {
            domain: domain.unwrap_or_default(),
            descriptors: descriptors.unwrap_or_default(),
            hits_addend: u32::try_from(hits).map_err(|_| r.refuse("`hitsAddend` is too large"))?,
        })
    }
}

/// The list of descriptors (`null`: none), each counted against the cap before it is
/// read.
struct Descriptors<'r> {
    reader: &'r Reader,
    limits: &'r RequestLimits,
}

self_seed!(Descriptors<'_>, deserialize_any);

impl<'de> Visitor<'de> for Descriptors<'_> {
    type Value = Vec<RateLimitDescriptor>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of descriptors")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Vec::new())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        loop {
            let i = out.len();
            self.reader
                .expect(format_args!("descriptor {i} must be an object"));
            let seed = Descriptor {
                reader: self.reader,
                limits: self.limits,
                i,
            };
            match seq.next_element_seed(seed)? {
                Some(d) => out.push(d),
                None => return Ok(out),
            }
        }
    }
}

/// Descriptor `i`: `entries`, `limit`, `hitsAddend`.
struct Descriptor<'r> {
    reader: &'r Reader,
    limits: &'r RequestLimits,
    i: usize,
}

impl<'de> DeserializeSeed<'de> for Descriptor<'_> {
    type Value = RateLimitDescriptor;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        let (reader, limits, i) = (self.reader, self.limits, self.i);
        // Counted when it is known to be there, before it is read.
        limits
            .check_descriptor_count(i + 1)
            .map_err(|e| reader.refuse(refusal(e)))?;
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Descriptor<'_> {
    type Value = RateLimitDescriptor;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a descriptor")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let (r, i) = (self.reader, self.i);
        let names = &["entries", "limit", "hitsAddend", "hits_addend"];
        let (mut entries, mut limit) = (Vec::new(), None);
        let mut hits = TwoSpellings::new("`hitsAddend`", "hits_addend");
        while let Some(field) = map.next_key_seed(fields(r, names))? {
            match field {
                Some(0) => {
                    r.expect(format_args!("descriptor {i}: `entries` must be a list"));
                    entries = map.next_value_seed(Entries {
                        reader: r,
                        limits: self.limits,
                        i,
                    })?;
                }
                Some(1) => {
                    r.expect(format_args!("descriptor {i}: `limit` must be an object"));
                    limit = map.next_value_seed(Limit { reader: r, i })?;
                }
                Some(n @ (2 | 3)) => hits.read(&mut map, r, n - 2)?,
                _ => skip(&mut map)?,
            }
        }
        Ok(RateLimitDescriptor {
            entries,
            limit,
            hits_addend: hits.value.map(|value| UInt64Value { value }),
            is_negative_hits: false,
        })
    }
}

/// Descriptor `i`'s entries (`null`: none), each counted before it is read.
struct Entries<'r> {
    reader: &'r Reader,
    limits: &'r RequestLimits,
    i: usize,
}

self_seed!(Entries<'_>, deserialize_any);

impl<'de> Visitor<'de> for Entries<'_> {
    type Value = Vec<Entry>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of entries")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Vec::new())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let (r, i) = (self.reader, self.i);
        let mut out = Vec::new();
        loop {
            let j = out.len();
            r.expect(format_args!("descriptor {i}, entry {j} must be an object"));
            let seed = EntrySeed {
                reader: r,
                limits: self.limits,
                at: (i, j),
            };
            match seq.next_element_seed(seed)? {
                Some(e) => out.push(e),
                None => return Ok(out),
            }
        }
    }
}

/// Entry `at` (descriptor, entry): `key` and `value`, each measured before it is copied.
struct EntrySeed<'r> {
    reader: &'r Reader,
    limits: &'r RequestLimits,
    at: (usize, usize),
}

impl<'de> DeserializeSeed<'de> for EntrySeed<'_> {
    type Value = Entry;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        let (i, j) = self.at;
        self.limits
            .check_entry_count(i, j + 1)
            .map_err(|e| self.reader.refuse(refusal(e)))?;
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for EntrySeed<'_> {
    type Value = Entry;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an entry")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let (r, (i, j)) = (self.reader, self.at);
        let mut entry = Entry::default();
        while let Some(field) = map.next_key_seed(fields(r, &["key", "value"]))? {
            let Some(n) = field else {
                skip(&mut map)?;
                continue;
            };
            let name = ["key", "value"][n];
            r.expect(format_args!(
                "descriptor {i}, entry {j}: `{name}` must be a string"
            ));
            let text = map.next_value_seed(Text {
                reader: r,
                limits: self.limits,
                at: self.at,
                is_key: n == 0,
            })?;
            match n {
                0 => entry.key = text,
                _ => entry.value = text,
            }
        }
        Ok(entry)
    }
}

/// An entry's key or value: a string (`null`: empty), refused when longer than the
/// limits allow, before it is copied.
struct Text<'r> {
    reader: &'r Reader,
    limits: &'r RequestLimits,
    at: (usize, usize),
    is_key: bool,
}

self_seed!(Text<'_>, deserialize_any);

impl<'de> Visitor<'de> for Text<'_> {
    type Value = String;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_unit<E: de::Error>(self) -> Result<String, E> {
        Ok(String::new())
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
        let (i, j) = self.at;
        let (key, value) = if self.is_key { (v, "") } else { ("", v) };
        self.limits
            .check_entry(i, j, key, value)
            .map_err(|e| self.reader.refuse(refusal(e)))?;
        Ok(v.to_owned())
    }
}

/// Descriptor `i`'s `limit` override (`null`: none): `requestsPerUnit`, `unit`.
struct Limit<'r> {
    reader: &'r Reader,
    i: usize,
}

self_seed!(Limit<'_>, deserialize_any);

impl<'de> Visitor<'de> for Limit<'_> {
    type Value = Option<RateLimitOverride>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a limit")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let (r, i) = (self.reader, self.i);
        let names = &["requestsPerUnit", "requests_per_unit", "unit"];
        let (mut rpu, mut unit) = (
            TwoSpellings::new("`requestsPerUnit`", "requests_per_unit"),
            0,
        );
        while let Some(field) = map.next_key_seed(fields(r, names))? {
            match field {
                Some(n @ (0 | 1)) => rpu.read(&mut map, r, n)?,
                Some(_) => unit = map.next_value_seed(UnitSeed { reader: r, i })?,
                None => skip(&mut map)?,
            }
        }
        let rpu = rpu.value.unwrap_or(0);
        let requests_per_unit = u32::try_from(rpu)
            .map_err(|_| r.refuse(format!("descriptor {i}: `requestsPerUnit` is too large")))?;
        Ok(Some(RateLimitOverride {
            requests_per_unit,
            unit,
        }))
    }
}

/// An unsigned field that proto3 JSON may name two ways (lowerCamelCase or snake_case):
/// read from either, refused when given both ways (as protobuf's JSON readers do).
struct TwoSpellings {
    /// The lowerCamelCase name, in backticks; the snake_case name.
    names: (&'static str, &'static str),
    /// Which spelling was read (0 or 1).
    read: Option<usize>,
    value: Option<u64>,
}

impl TwoSpellings {
    fn new(camel: &'static str, snake: &'static str) -> Self {
        Self {
            names: (camel, snake),
            read: None,
            value: None,
        }
    }

    /// Reads the field's value, spelled the `spelling`th way.
    fn read<'de, A: MapAccess<'de>>(
        &mut self,
        map: &mut A,
        reader: &Reader,
        spelling: usize,
    ) -> Result<(), A::Error> {
        let (camel, snake) = self.names;
        if self.read.is_some_and(|s| s != spelling) {
            return Err(reader.refuse(format!("{camel} is given twice (also as `{snake}`)")));
        }
        self.read = Some(spelling);
        self.value = map.next_value_seed(unsigned(reader, camel))?;
        Ok(())
    }
}

/// A proto3-JSON unsigned integer, `what`: a number or a decimal string; `null`: unset.
fn unsigned<'r>(reader: &'r Reader, what: &'static str) -> Unsigned<'r> {
    reader.expect(format_args!("{what} must be a number"));
    Unsigned { reader, what }
}

struct Unsigned<'r> {
    reader: &'r Reader,
    what: &'static str,
}

self_seed!(Unsigned<'_>, deserialize_any);

impl<'de> Visitor<'de> for Unsigned<'_> {
    type Value = Option<u64>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a number")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok(Some(v))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        let what = self.what;
        Err(self
            .reader
            .refuse(format!("{what} must be a non-negative whole number")))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        self.visit_i64(0)
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
        let what = self.what;
        s.parse().map(Some).map_err(|_| {
            self.reader.refuse(format!(
                "{what} must be a non-negative whole number, got \"{s}\""
            ))
        })
    }
}

/// Descriptor `i`'s limit `unit`: an enum name or number (another number, or anything
/// else, is unset).
struct UnitSeed<'r> {
    reader: &'r Reader,
    i: usize,
}

self_seed!(UnitSeed<'_>, deserialize_any);

impl<'de> Visitor<'de> for UnitSeed<'_> {
    type Value = i32;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a unit")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<i32, E> {
        let i = self.i;
        Unit::from_str_name(s).map(|u| u as i32).ok_or_else(|| {
            self.reader
                .refuse(format!("descriptor {i}: unknown unit \"{s}\""))
        })
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<i32, E> {
        Ok(i32::try_from(v).unwrap_or(0))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<i32, E> {
        Ok(i32::try_from(v).unwrap_or(0))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<i32, E> {
        Ok(0)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<i32, E> {
        Ok(0)
    }

    fn visit_unit<E: de::Error>(self) -> Result<i32, E> {
        Ok(0)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<i32, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(0)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<i32, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(0)
    }
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
    use proptest::prelude::*;
    use serde_json::Value;
    use tollgate::limiter::RequestLimits;

    /// The reading this module had before it streamed: the whole body as a
    /// `serde_json::Value` tree, then converted. The differential test holds the
    /// streaming reader to its answers.
    mod tree {
        use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
            Entry, RateLimitOverride,
        };
        use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
        use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
        use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
        use envoy_types::pb::google::protobuf::UInt64Value;
        use serde_json::{Map, Value};
        use tollgate::limiter::RequestLimits;

        use crate::api::refusal;

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
                Value::String(s) => s.parse().map_err(|_| {
                    format!("{what} must be a non-negative whole number, got \"{s}\"")
                }),
                Value::Null => Ok(0),
                _ => Err(format!("{what} must be a number")),
            }
        }

        /// Parses the body; the conversion of descriptors stops at the first size over
        /// `limits`, in the order [`RequestLimits::check_sizes`] looks at them.
        pub fn parse(body: &[u8], limits: &RequestLimits) -> Result<RateLimitRequest, String> {
            let value: Value = serde_json::from_slice(body)
                .map_err(|e| format!("the body is not valid JSON: {e}"))?;
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

        fn descriptor(
            i: usize,
            v: &Value,
            limits: &RequestLimits,
        ) -> Result<RateLimitDescriptor, String> {
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
                        let e = e.as_object().ok_or_else(|| {
                            format!("descriptor {i}, entry {j} must be an object")
                        })?;
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
                        requests_per_unit: u32::try_from(rpu).map_err(|_| {
                            format!("descriptor {i}: `requestsPerUnit` is too large")
                        })?,
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
    }

    /// Small caps, so that generated bodies cross them often.
    const SMALL: RequestLimits = RequestLimits {
        max_descriptors: 3,
        max_entries: 2,
        max_entry_bytes: 4,
    };

    fn scalar() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            (0u64..10).prop_map(Value::from),
            (-1e6f64..1e6).prop_map(Value::from),
            "[a-c]{0,6}".prop_map(Value::from),
            "[0-9]{1,3}".prop_map(Value::from),
            Just(Value::from("MINUTE")),
        ]
    }

    /// An object of some of `fields` (each with its value strategy) and a stray field.
    fn object(
        fields: Vec<(BoxedStrategy<&'static str>, BoxedStrategy<Value>)>,
    ) -> BoxedStrategy<Value> {
        let chosen: Vec<_> = fields
            .into_iter()
            .map(|(name, value)| (name, proptest::option::weighted(0.6, value)))
            .collect();
        (chosen, proptest::option::weighted(0.1, scalar()))
            .prop_map(|(fields, stray)| {
                let mut out = serde_json::Map::new();
                for (name, value) in fields {
                    if let Some(v) = value {
                        out.insert(name.into(), v);
                    }
                }
                if let Some(v) = stray {
                    out.insert("stray".into(), v);
                }
                Value::Object(out)
            })
            .boxed()
    }

    /// One of a field's two spellings (giving both is refused; the tree took the first).
    fn either(camel: &'static str, snake: &'static str) -> BoxedStrategy<&'static str> {
        prop_oneof![Just(camel), Just(snake)].boxed()
    }

    fn named(name: &'static str) -> BoxedStrategy<&'static str> {
        Just(name).boxed()
    }

    fn or_scalar(s: BoxedStrategy<Value>) -> BoxedStrategy<Value> {
        prop_oneof![8 => s, 1 => scalar()].boxed()
    }

    fn body() -> impl Strategy<Value = Value> {
        let entry = or_scalar(object(vec![
            (named("key"), scalar().boxed()),
            (named("value"), scalar().boxed()),
        ]));
        let limit = or_scalar(object(vec![
            (
                either("requestsPerUnit", "requests_per_unit"),
                scalar().boxed(),
            ),
            (named("unit"), scalar().boxed()),
        ]));
        let entries = or_scalar(
            proptest::collection::vec(entry, 0..4)
                .prop_map(Value::from)
                .boxed(),
        );
        let descriptor = or_scalar(object(vec![
            (named("entries"), entries),
            (named("limit"), limit),
            (either("hitsAddend", "hits_addend"), scalar().boxed()),
        ]));
        let descriptors = or_scalar(
            proptest::collection::vec(descriptor, 0..5)
                .prop_map(Value::from)
                .boxed(),
        );
        object(vec![
            (named("domain"), scalar().boxed()),
            (named("descriptors"), descriptors),
            (either("hitsAddend", "hits_addend"), scalar().boxed()),
        ])
    }

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
        assert_eq!(
            parse(br#"{"domain":"d","hitsAddend":1,"hits_addend":2}"#).unwrap_err(),
            "`hitsAddend` is given twice (also as `hits_addend`)"
        );
    }

    #[test]
    fn the_reading_stops_at_the_first_size_over_the_caps() {
        // 65 descriptors, then a body that is not even JSON: the cap answers first,
        // and nothing after it is read.
        let mut body = br#"{"domain":"d","descriptors":["#.to_vec();
        for _ in 0..65 {
            body.extend_from_slice(br#"{"entries":[{"key":"k","value":"v"}]},"#);
        }
        body.extend_from_slice(b"garbage");
        assert_eq!(
            parse(&body).unwrap_err(),
            "a request may carry at most 64 descriptors (--max-descriptors)"
        );
        let long = format!(
            r#"{{"descriptors":[{{"entries":[{{"key":"{}"}}]}}]}}"#,
            "k".repeat(70_000)
        );
        assert!(parse(long.as_bytes())
            .unwrap_err()
            .contains("the key is 70000 bytes"));
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

        #[test]
        fn streaming_reads_what_the_tree_reads(body in body()) {
            let text = body.to_string();
            let streamed = parse_within(text.as_bytes(), &SMALL);
            let tree = tree::parse(text.as_bytes(), &SMALL);
            match (&streamed, &tree) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
                (Err(_), Err(_)) => {}
                _ => prop_assert!(false, "{text}: streamed {streamed:?}, tree {tree:?}"),
            }
        }
    }
}
