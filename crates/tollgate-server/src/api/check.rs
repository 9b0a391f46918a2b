//! `POST /v1/check`: plain JSON for callers that do not speak Envoy's API.
//!
//! ```text
//! {"domain":"api","descriptors":[{"user":"alice","path":"/upload"}],"hits":1}
//! ```
//! A descriptor is an object of entries in order (key → value), or a list of
//! `[key, value]` pairs when a key repeats. `hits` is optional (default 1). The answer
//! is 200 or 429 with the RateLimit headers, `Retry-After` when over the limit, and a
//! decision per descriptor; 503 with a problem body while no rules are loaded.

use std::fmt;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{json, Value};
use tollgate::clock::NANOS_PER_SEC;
use tollgate::limiter::{Code, Descriptor, RateLimitRequest, RateLimitResponse};

use axum::extract::rejection::BytesRejection;
use tollgate::limiter::RequestLimits;

use super::stream::{self_seed, Field, Reader};
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

/// Parses the body; `Err` says what is wrong, in words a caller can act on. The body is
/// read as it streams ([`stream`](super::stream)): the reading stops at the first size
/// over `limits`, in the order [`RequestLimits::check_sizes`] looks at them.
pub(crate) fn parse(body: &[u8], limits: &RequestLimits) -> Result<RateLimitRequest, String> {
    let reader = Reader::default();
    reader.read(
        body,
        "the body must be a JSON object",
        Body {
            reader: &reader,
            limits,
        },
    )
}

/// The body: `{"domain": …, "descriptors": […], "hits": …}`.
struct Body<'r> {
    reader: &'r Reader,
    limits: &'r RequestLimits,
}

self_seed!(Body<'_>, deserialize_map);

impl<'de> Visitor<'de> for Body<'_> {
    type Value = RateLimitRequest;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let r = self.reader;
        let (mut domain, mut descriptors, mut hits) = (None, None, None);
        let field = || Field {
            reader: r,
            names: &["domain", "descriptors", "hits"],
            strict: Some("domain, descriptors, hits"),
        };
        while let Some(key) = map.next_key_seed(field())? {
            match key {
                Some(0) => {
                    domain = Some(
                        r.value::<String, _>(&mut map, format_args!("`domain` must be a string"))?,
                    )
                }
                Some(1) => {
                    r.expect(format_args!("`descriptors` must be a list"));
                    descriptors = Some(map.next_value_seed(Descriptors {
                        reader: r,
                        limits: self.limits,
                    })?);
                }
                _ => {
                    let what = "`hits` must be a whole number of at least 1";
                    hits = match r.value::<Option<u64>, _>(&mut map, format_args!("{what}"))? {
                        None => None,
                        Some(0) => return Err(r.refuse(what)),
                        Some(h) => Some(h),
                    };
                }
            }
        }
        Ok(RateLimitRequest {
            domain: domain.ok_or_else(|| r.refuse("`domain` is missing"))?,
            descriptors: descriptors.ok_or_else(|| r.refuse("`descriptors` is missing"))?,
            hits_addend: hits.unwrap_or(1),
        })
    }
}

/// The list of descriptors, each counted against the cap before it is read.
struct Descriptors<'r> {
    reader: &'r Reader,
    limits: &'r RequestLimits,
}

self_seed!(Descriptors<'_>, deserialize_seq);

impl<'de> Visitor<'de> for Descriptors<'_> {
    type Value = Vec<Descriptor>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of descriptors")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        loop {
            let i = out.len();
            self.reader.expect(format_args!(
                "descriptor {i} must be an object (key to value) or a list of [key, value] pairs"
            ));
            let seed = Entries {
                reader: self.reader,
                limits: self.limits,
                i,
            };
            match seq.next_element_seed(seed)? {
                Some(entries) => out.push(Descriptor {
                    entries,
                    ..Descriptor::default()
                }),
                None => return Ok(out),
            }
        }
    }
}

/// Descriptor `i`'s entries: an object (key to value, in order; a key written twice is
/// refused: which value was meant is ambiguous, and repeats would not count against the
/// entry cap) or a list of `[key, value]` pairs (where a key may repeat).
struct Entries<'r> {
    reader: &'r Reader,
    limits: &'r RequestLimits,
    i: usize,
}

impl Entries<'_> {
    /// Entry `j`'s key, counted and measured before it is copied.
    fn key<E: de::Error>(&self, j: usize, key: &str) -> Result<String, E> {
        let limits = self.limits;
        limits
            .check_entry_count(self.i, j + 1)
            .and_then(|()| limits.check_entry(self.i, j, key, ""))
            .map_err(|e| self.reader.refuse(refusal(e)))?;
        Ok(key.to_owned())
    }

    /// A seed for entry `j`'s value (or its key, in a pair), which must be what `what`
    /// says.
    fn text(&self, j: usize, is_key: bool, what: fmt::Arguments<'_>) -> Text<'_> {
        self.reader.expect(what);
        Text {
            reader: self.reader,
            limits: self.limits,
            at: (self.i, j),
            is_key,
        }
    }
}

impl<'de> DeserializeSeed<'de> for Entries<'_> {
    type Value = Vec<(String, String)>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        // The descriptor is counted when it is known to be there, before it is read.
        self.limits
            .check_descriptor_count(self.i + 1)
            .map_err(|e| self.reader.refuse(refusal(e)))?;
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Entries<'_> {
    type Value = Vec<(String, String)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object or a list of pairs")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut entries: Vec<(String, String)> = Vec::new();
        loop {
            let seed = ObjectKey {
                entries: &self,
                existing: &entries,
            };
            let Some(key) = map.next_key_seed(seed)? else {
                return Ok(entries);
            };
            let j = entries.len();
            let what = format_args!(
                "descriptor {}: the value of `{key}` must be a string",
                self.i
            );
            let value = map.next_value_seed(self.text(j, false, what))?;
            entries.push((key, value));
        }
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut entries = Vec::new();
        loop {
            let j = entries.len();
            self.reader.expect(format_args!(
                "descriptor {}: each entry must be a [key, value] pair",
                self.i
            ));
            match seq.next_element_seed(Pair { entries: &self, j })? {
                Some(entry) => entries.push(entry),
                None => return Ok(entries),
            }
        }
    }
}

/// A `[key, value]` pair, entry `j` of its descriptor.
struct Pair<'e, 'r> {
    entries: &'e Entries<'r>,
    j: usize,
}

self_seed!(Pair<'_, '_>, deserialize_seq);

impl<'de> Visitor<'de> for Pair<'_, '_> {
    type Value = (String, String);

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a [key, value] pair")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let (e, j, i) = (self.entries, self.j, self.entries.i);
        // The key: counted and measured (as a value would be) before it is copied.
        let count = e.limits.check_entry_count(i, j + 1);
        count.map_err(|err| e.reader.refuse(refusal(err)))?;
        let what = format_args!("descriptor {i}: a key must be a string");
        let key = seq.next_element_seed(e.text(j, true, what))?;
        let value = match key {
            Some(_) => {
                let what = format_args!("descriptor {i}: a value must be a string");
                seq.next_element_seed(e.text(j, false, what))?
            }
            None => None,
        };
        match (key, value) {
            (Some(key), Some(value)) if seq.next_element::<IgnoredAny>()?.is_none() => {
                Ok((key, value))
            }
            _ => Err(e.reader.refuse(format!(
                "descriptor {i}: each entry must be a [key, value] pair"
            ))),
        }
    }
}

/// A key of a descriptor written as an object: a new entry's key, counted and measured
/// before it is copied; one seen before in the object is refused.
struct ObjectKey<'e, 'r> {
    entries: &'e Entries<'r>,
    existing: &'e [(String, String)],
}

self_seed!(ObjectKey<'_, '_>, deserialize_str);

impl<'de> Visitor<'de> for ObjectKey<'_, '_> {
    type Value = String;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a key")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<String, E> {
        let e = self.entries;
        let key = e.key(self.existing.len(), key)?;
        if self.existing.iter().any(|(k, _)| *k == key) {
            return Err(e.reader.refuse(format!(
                "descriptor {}: the key `{key}` is given twice (a list of [key, value] pairs may repeat a key)",
                e.i
            )));
        }
        Ok(key)
    }
}

/// A key or value of entry `at` (descriptor, entry): a string, or a number or boolean
/// in its JSON spelling; refused when longer than the limits allow, before it is copied.
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
        f.write_str("a string, number or boolean")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
        self.measured(v)?;
        Ok(v.to_owned())
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<String, E> {
        self.spelled(v.to_string())
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<String, E> {
        self.spelled(v.to_string())
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<String, E> {
        // JSON numbers are finite; spelled as serde_json spells them.
        self.spelled(
            serde_json::Number::from_f64(v).map_or_else(|| v.to_string(), |n| n.to_string()),
        )
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<String, E> {
        self.spelled(v.to_string())
    }
}

impl Text<'_> {
    /// Refuses `text` when it is longer than the limits allow.
    fn measured<E: de::Error>(&self, text: &str) -> Result<(), E> {
        let (i, j) = self.at;
        let (key, value) = if self.is_key { (text, "") } else { ("", text) };
        self.limits
            .check_entry(i, j, key, value)
            .map_err(|e| self.reader.refuse(refusal(e)))
    }

    /// A number or boolean in its JSON spelling (a few bytes), measured as text.
    fn spelled<E: de::Error>(&self, text: String) -> Result<String, E> {
        self.measured(&text)?;
        Ok(text)
    }
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
                // False: no rule matched this descriptor (it is not limited; `remaining`
                // is then 0, as Envoy's service says it).
                "matched": s.metric.is_some(),
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
                "overdraft": s.overdraft,
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
    use proptest::prelude::*;
    use serde_json::Value;
    use tollgate::limiter::RequestLimits;

    /// The reading this module had before it streamed: the whole body as a
    /// `serde_json::Value` tree, then converted. The differential test holds the
    /// streaming reader to its answers.
    mod tree {
        use serde_json::Value;
        use tollgate::limiter::{Descriptor, RateLimitRequest, RequestLimits};

        use crate::api::refusal;

        /// Parses the body; `Err` says what is wrong, in words a caller can act on. The
        /// conversion of descriptors stops at the first size over `limits`, in the order
        /// [`RequestLimits::check_sizes`] looks at them.
        pub fn parse(body: &[u8], limits: &RequestLimits) -> Result<RateLimitRequest, String> {
            let value: Value = serde_json::from_slice(body)
                .map_err(|e| format!("the body is not valid JSON: {e}"))?;
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

        fn descriptor(
            i: usize,
            value: &Value,
            limits: &RequestLimits,
        ) -> Result<Descriptor, String> {
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
            (-1e6f64..1e6).prop_map(Value::from),
            "[a-c]{0,6}".prop_map(Value::from),
        ]
    }

    fn object(value: impl Strategy<Value = Value>) -> impl Strategy<Value = Value> {
        proptest::collection::vec(("[a-c]{0,6}", value), 0..5)
            .prop_map(|fields| Value::Object(fields.into_iter().collect()))
    }

    fn descriptor() -> impl Strategy<Value = Value> {
        let pair = proptest::collection::vec(scalar(), 0..4).prop_map(Value::from);
        prop_oneof![
            4 => object(scalar()),
            4 => proptest::collection::vec(pair, 0..4).prop_map(Value::from),
            1 => scalar(),
        ]
    }

    fn body() -> impl Strategy<Value = Value> {
        let descriptors = prop_oneof![
            8 => proptest::collection::vec(descriptor(), 0..5).prop_map(Value::from),
            1 => scalar(),
        ];
        (
            proptest::option::weighted(
                0.9,
                prop_oneof![4 => "[a-c]{0,3}".prop_map(Value::from), 1 => scalar()],
            ),
            proptest::option::weighted(0.9, descriptors),
            proptest::option::weighted(0.5, scalar()),
            proptest::option::weighted(0.1, scalar()),
        )
            .prop_map(|(domain, descriptors, hits, extra)| {
                let mut body = serde_json::Map::new();
                for (name, value) in [
                    ("domain", domain),
                    ("descriptors", descriptors),
                    ("hits", hits),
                    ("extra", extra),
                ] {
                    if let Some(v) = value {
                        body.insert(name.into(), v);
                    }
                }
                Value::Object(body)
            })
    }

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

    #[test]
    fn a_key_given_twice_in_an_object_is_refused() {
        assert_eq!(
            parse(br#"{"domain":"d","descriptors":[{"a":"1","b":2,"a":true}]}"#).unwrap_err(),
            "descriptor 0: the key `a` is given twice (a list of [key, value] pairs may repeat a key)"
        );
        let r = parse(br#"{"domain":"d","descriptors":[[["a","1"],["a","2"]]]}"#).unwrap();
        assert_eq!(
            r.descriptors[0].entries,
            [("a".to_string(), "1".to_string()), ("a".into(), "2".into())]
        );
    }

    #[test]
    fn pairs_have_two_items() {
        for body in [
            &br#"{"domain":"d","descriptors":[[["k"]]]}"#[..],
            br#"{"domain":"d","descriptors":[[["k","v","w"]]]}"#,
        ] {
            assert_eq!(
                parse(body).unwrap_err(),
                "descriptor 0: each entry must be a [key, value] pair"
            );
        }
    }

    #[test]
    fn the_reading_stops_at_the_first_size_over_the_caps() {
        // 65 descriptors, then a body that is not even JSON: the cap answers first.
        let mut body = br#"{"domain":"d","descriptors":["#.to_vec();
        for _ in 0..65 {
            body.extend_from_slice(br#"{"k":"v"},"#);
        }
        body.extend_from_slice(b"garbage");
        assert_eq!(
            parse(&body).unwrap_err(),
            "a request may carry at most 64 descriptors (--max-descriptors)"
        );
        let entries: Vec<String> = (0..33).map(|j| format!(r#"["k{j}","v"]"#)).collect();
        let body = format!(
            r#"{{"domain":"d","descriptors":[[{}]]}}"#,
            entries.join(",")
        );
        assert_eq!(
            parse(body.as_bytes()).unwrap_err(),
            "descriptor 0: a descriptor may carry at most 32 entries (--max-entries)"
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
