//! The response's dynamic metadata (`--response-dynamic-metadata`), as envoyproxy/ratelimit
//! sends it with `RESPONSE_DYNAMIC_METADATA=true`: the request's domain and descriptors,
//! and the `metadata` of the rules of the descriptors that passed (what Envoy's
//! quota-aware routing reads: a filter after the rate limit filter finds it under
//! `envoy.filters.http.ratelimit`).
//!
//! ```text
//! { domain: "<domain>",
//!   descriptors: [ { entries: ["key=value", ...],
//!                    limit: "requests_per_unit:N unit:MINUTE",   (a request's own limit)
//!                    hitsAddend: N,                               (a descriptor's own cost)
//!                    code: "OK" | "OVER_LIMIT" },                 (Tollgate's addition)
//!                  ... ],
//!   hitsAddend: N,                        (when the request sets it)
//!   metadata: { ... },                    (the passing descriptors' rules' metadata, merged)
//!   passedBackends: [ { backend_name: "...", model_name_override: "..." }, ... ] }
//!                                         (with quota-mode descriptors: the passing ones')
//! ```
//!
//! A descriptor passes when its status is OK, unless it is in quota mode and its quota
//! group is over (see `tollgate::limiter::quota_groups`). The merge keeps the first
//! value of a field, and merges maps field by field. Only a rule whose own limit was
//! checked contributes its metadata (not `unlimited`, not a request's own limit).
//!
//! One tree ([`Metadata`]) is built per answer, then turned into tonic's
//! `google.protobuf.Struct` ([`to_struct`]) or written as protobuf bytes by the native
//! transport ([`write_struct`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use tollgate::limiter::{quota_groups, Code, RateLimitRequest, RateLimitResponse};
use tollgate::rules::Metadata;

/// The descriptor entries that name a quota group's backend and model.
const BACKEND: &str = "backend_name";
const MODEL: &str = "model_name_override";

/// The dynamic metadata of `response` to `request`.
pub fn dynamic_metadata(request: &RateLimitRequest, response: &RateLimitResponse) -> Metadata {
    let statuses = &response.statuses;
    let descriptors = request
        .descriptors
        .iter()
        .zip(statuses)
        .map(|(d, s)| {
            let mut fields = vec![(
                "entries".to_string(),
                Metadata::List(
                    d.entries
                        .iter()
                        .map(|(k, v)| Metadata::String(format!("{k}={v}")))
                        .collect(),
                ),
            )];
            if let Some(o) = d.limit {
                fields.push((
                    "limit".into(),
                    Metadata::String(format!(
                        "requests_per_unit:{} unit:{}",
                        o.requests_per_unit,
                        o.unit.name()
                    )),
                ));
            }
            if let Some(h) = d.hits_addend {
                fields.push(("hitsAddend".into(), Metadata::Number(h as f64)));
            }
            let code = if s.code == Code::Ok {
                "OK"
            } else {
                "OVER_LIMIT"
            };
            fields.push(("code".into(), Metadata::String(code.into())));
            Metadata::Map(fields)
        })
        .collect();
    let mut fields = vec![
        (
            "domain".to_string(),
            Metadata::String(request.domain.clone()),
        ),
        ("descriptors".to_string(), Metadata::List(descriptors)),
    ];
    if request.hits_addend != 0 {
        fields.push((
            "hitsAddend".into(),
            Metadata::Number(request.hits_addend as f64),
        ));
    }

    // Quota groups with a descriptor over its limit (sets, here and below: the work
    // stays linear in the descriptors).
    let over_groups: HashSet<u32> = statuses
        .iter()
        .filter(|s| s.code == Code::OverLimit)
        .filter_map(|s| s.quota)
        .collect();
    let passed: Vec<usize> = statuses
        .iter()
        .enumerate()
        .filter(|(_, s)| {
            // An `unlimited` descriptor is not counted as passing, as in Envoy's service.
            let unlimited = s.limit.is_none() && s.remaining == u64::from(u32::MAX);
            s.code == Code::Ok && !unlimited && !s.quota.is_some_and(|g| over_groups.contains(&g))
        })
        .map(|(i, _)| i)
        .collect();

    // Each rule's metadata once, however many descriptors it passed.
    let mut rules_seen = HashSet::new();
    let maps: Vec<&[(String, Metadata)]> = passed
        .iter()
        .filter_map(|&i| {
            let m = statuses[i].metadata.as_ref()?;
            match &**m {
                Metadata::Map(fields) if rules_seen.insert(Arc::as_ptr(m)) => {
                    Some(fields.as_slice())
                }
                _ => None,
            }
        })
        .collect();
    let merged = merge(&maps);
    if !merged.is_empty() {
        fields.push(("metadata".into(), Metadata::Map(merged)));
    }

    if statuses.iter().any(|s| s.quota.is_some()) {
        let groups = quota_groups(&request.descriptors);
        let mut seen = HashSet::new();
        let mut backends = Vec::new();
        for &i in &passed {
            let Some(d) = request.descriptors.get(i) else {
                continue;
            };
            let entry = |key: &str| {
                d.entries
                    .iter()
                    .rev()
                    .find(|(k, _)| k == key)
                    .map_or("", |(_, v)| v.as_str())
            };
            let (backend, model) = (entry(BACKEND), entry(MODEL));
            if (backend.is_empty() && model.is_empty()) || !seen.insert(groups[i]) {
                continue;
            }
            backends.push(Metadata::Map(vec![
                (BACKEND.into(), Metadata::String(backend.into())),
                (MODEL.into(), Metadata::String(model.into())),
            ]));
        }
        if !backends.is_empty() {
            fields.push(("passedBackends".into(), Metadata::List(backends)));
        }
    }
    Metadata::Map(fields)
}

/// Merges maps, the first first: a field keeps its first value (maps merge field by
/// field, with the later maps of that field; a later value that is not a map is
/// ignored), in the order fields first appear. Linear in the maps' sizes: each field
/// is looked up in a hash map, not in the fields merged so far.
fn merge<'a>(maps: &[&'a [(String, Metadata)]]) -> Vec<(String, Metadata)> {
    let mut fields: Vec<(&'a str, Vec<&'a Metadata>)> = Vec::new();
    let mut at: HashMap<&'a str, usize> = HashMap::new();
    for map in maps {
        for (k, v) in *map {
            match at.get(k.as_str()) {
                Some(&i) => fields[i].1.push(v),
                None => {
                    at.insert(k, fields.len());
                    fields.push((k, vec![v]));
                }
            }
        }
    }
    fields
        .into_iter()
        .map(|(k, values)| {
            let value = match values[0] {
                Metadata::Map(_) => {
                    let maps: Vec<&[(String, Metadata)]> = values
                        .iter()
                        .filter_map(|v| match v {
                            Metadata::Map(m) => Some(m.as_slice()),
                            _ => None,
                        })
                        .collect();
                    Metadata::Map(merge(&maps))
                }
                first => first.clone(),
            };
            (k.to_string(), value)
        })
        .collect()
}

/// A map as tonic's `Struct` (any other value as a one-field struct would be wrong:
/// dynamic metadata is always a map).
pub fn to_struct(m: &Metadata) -> Struct {
    match m {
        Metadata::Map(fields) => Struct {
            fields: fields
                .iter()
                .map(|(k, v)| (k.clone(), to_value(v)))
                .collect::<HashMap<_, _>>(),
        },
        _ => Struct::default(),
    }
}

fn to_value(m: &Metadata) -> Value {
    let kind = match m {
        Metadata::Null => Kind::NullValue(0),
        Metadata::Bool(b) => Kind::BoolValue(*b),
        Metadata::Number(n) => Kind::NumberValue(*n),
        Metadata::String(s) => Kind::StringValue(s.clone()),
        Metadata::List(items) => Kind::ListValue(ListValue {
            values: items.iter().map(to_value).collect(),
        }),
        Metadata::Map(_) => Kind::StructValue(to_struct(m)),
    };
    Value { kind: Some(kind) }
}

/// Writes `m` (a map) as the protobuf bytes of a `google.protobuf.Struct` field `tag`,
/// entries in the file's order (a map's order is not part of its meaning).
pub fn write_struct(out: &mut Vec<u8>, tag: u32, m: &Metadata) {
    len_prefix(out, tag, struct_len(m));
    write_struct_body(out, m);
}

/// The length of `m`'s `Struct` body.
fn struct_len(m: &Metadata) -> usize {
    match m {
        Metadata::Map(fields) => fields
            .iter()
            .map(|(k, v)| {
                let entry = bytes_field_len(k.len()) + len_prefix_len(2, value_len(v));
                len_prefix_len(1, entry)
            })
            .sum(),
        _ => 0,
    }
}

fn write_struct_body(out: &mut Vec<u8>, m: &Metadata) {
    if let Metadata::Map(fields) = m {
        for (k, v) in fields {
            let entry = bytes_field_len(k.len()) + len_prefix_len(2, value_len(v));
            len_prefix(out, 1, entry);
            bytes_field(out, 1, k.as_bytes());
            len_prefix(out, 2, value_len(v));
            write_value_body(out, v);
        }
    }
}

/// The length of a `Value` body: its one field.
fn value_len(m: &Metadata) -> usize {
    match m {
        // null_value = 1 (enum NULL_VALUE = 0): a tag and a zero.
        Metadata::Null => 2,
        // number_value = 2 (fixed64).
        Metadata::Number(_) => 9,
        Metadata::String(s) => bytes_field_len(s.len()),
        // bool_value = 4.
        Metadata::Bool(_) => 2,
        Metadata::Map(_) => len_prefix_len(5, struct_len(m)),
        Metadata::List(items) => len_prefix_len(6, list_len(items)),
    }
}

fn list_len(items: &[Metadata]) -> usize {
    items.iter().map(|v| len_prefix_len(1, value_len(v))).sum()
}

fn write_value_body(out: &mut Vec<u8>, m: &Metadata) {
    match m {
        Metadata::Null => out.extend_from_slice(&[key(1, 0), 0]),
        Metadata::Number(n) => {
            out.push(key(2, 1));
            out.extend_from_slice(&n.to_le_bytes());
        }
        Metadata::String(s) => bytes_field(out, 3, s.as_bytes()),
        Metadata::Bool(b) => out.extend_from_slice(&[key(4, 0), u8::from(*b)]),
        Metadata::Map(_) => {
            len_prefix(out, 5, struct_len(m));
            write_struct_body(out, m);
        }
        Metadata::List(items) => {
            len_prefix(out, 6, list_len(items));
            for v in items {
                len_prefix(out, 1, value_len(v));
                write_value_body(out, v);
            }
        }
    }
}

/// A field's key byte: its number (below 16) and wire type.
fn key(field: u32, wire: u8) -> u8 {
    (field as u8) << 3 | wire
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

/// A length-delimited field's key and length.
fn len_prefix(out: &mut Vec<u8>, field: u32, len: usize) {
    out.push(key(field, 2));
    varint(out, len as u64);
}

/// The bytes a length-delimited field of `len` bytes takes, written even when empty
/// (inside a `oneof`, as every `Value` field is, an empty string is present).
fn len_prefix_len(_field: u32, len: usize) -> usize {
    1 + varint_len(len as u64) + len
}

fn bytes_field(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    len_prefix(out, field, bytes.len());
    out.extend_from_slice(bytes);
}

fn bytes_field_len(len: usize) -> usize {
    len_prefix_len(0, len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use prost::Message;

    fn metadata() -> impl Strategy<Value = Metadata> {
        let leaf = prop_oneof![
            Just(Metadata::Null),
            any::<bool>().prop_map(Metadata::Bool),
            (-1e12f64..1e12).prop_map(Metadata::Number),
            ".{0,20}".prop_map(Metadata::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Metadata::List),
                prop::collection::btree_map("[a-z]{1,6}", inner, 0..4)
                    .prop_map(|m| Metadata::Map(m.into_iter().collect())),
            ]
        })
    }

    /// The answer of a memory-store limiter over `rules` to `request`.
    fn answer(rules: &str, request: &RateLimitRequest) -> Metadata {
        use std::sync::Arc;
        use tollgate::limiter::Limiter;
        use tollgate::rules::{from_str, Rules};
        use tollgate::store::MemoryStore;
        let set = from_str("rules.yaml", rules).expect("valid rules");
        let limiter = Limiter::new(Arc::new(Rules::fixed(set)), MemoryStore::new());
        let response = limiter.check_now(request).expect("an answer");
        dynamic_metadata(request, &response)
    }

    fn field<'a>(m: &'a Metadata, name: &str) -> Option<&'a Metadata> {
        match m {
            Metadata::Map(fields) => fields.iter().find(|(k, _)| k == name).map(|(_, v)| v),
            _ => None,
        }
    }

    fn string(s: &str) -> Metadata {
        Metadata::String(s.into())
    }

    const RULES: &str = "
domain: ai
descriptors:
  - key: backend_name
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 100}
    metadata: {route: {cluster: primary, weight: 1}, team: models}
    descriptors:
      - key: model_name_override
        quota_mode: true
        rate_limit: {unit: minute, requests_per_unit: 1}
        metadata: {route: {cluster: small, zone: a}}
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 5}
    metadata: {team: users, tier: free}
  - key: free
    rate_limit: {unlimited: true}
    metadata: {never: shown}
";

    #[test]
    fn metadata_of_passing_descriptors_merges_first_value_first() {
        let request = RateLimitRequest::new(
            "ai",
            [
                vec![("user", "u")],
                vec![("backend_name", "b1"), ("model_name_override", "m1")],
                vec![("backend_name", "b3")],
                vec![("free", "x")],
            ],
        );
        let m = answer(RULES, &request);
        // `team` from the first, `route` merged field by field, nothing from `unlimited`.
        let expected = Metadata::Map(vec![
            ("team".into(), string("users")),
            ("tier".into(), string("free")),
            (
                "route".into(),
                Metadata::Map(vec![
                    ("cluster".into(), string("small")),
                    ("zone".into(), string("a")),
                    ("weight".into(), Metadata::Number(1.0)),
                ]),
            ),
        ]);
        assert_eq!(field(&m, "metadata"), Some(&expected));
        assert_eq!(field(&m, "domain"), Some(&string("ai")));
        // No hitsAddend when the request does not set one.
        assert_eq!(field(&m, "hitsAddend"), None);
        let backends = Metadata::List(vec![
            Metadata::Map(vec![
                ("backend_name".into(), string("b1")),
                ("model_name_override".into(), string("m1")),
            ]),
            Metadata::Map(vec![
                ("backend_name".into(), string("b3")),
                ("model_name_override".into(), string("")),
            ]),
        ]);
        assert_eq!(field(&m, "passedBackends"), Some(&backends));
        let Some(Metadata::List(descriptors)) = field(&m, "descriptors") else {
            panic!("no descriptors in {m:?}");
        };
        assert_eq!(descriptors.len(), 4);
        assert_eq!(
            field(&descriptors[1], "entries"),
            Some(&Metadata::List(vec![
                string("backend_name=b1"),
                string("model_name_override=m1")
            ]))
        );
        assert_eq!(field(&descriptors[1], "code"), Some(&string("OK")));
    }

    #[test]
    fn an_over_quota_group_passes_no_backend_and_no_metadata() {
        use std::sync::Arc;
        use tollgate::limiter::Limiter;
        use tollgate::rules::{from_str, Rules};
        use tollgate::store::MemoryStore;
        let set = from_str("rules.yaml", RULES).expect("valid rules");
        let limiter = Limiter::new(Arc::new(Rules::fixed(set)), MemoryStore::new());
        let model = vec![("backend_name", "b1"), ("model_name_override", "m1")];
        let once = RateLimitRequest::new("ai", [model.clone()]);
        limiter.check_now(&once).expect("an answer");
        // b1/m1's limit of 1 is used: its group is over, b3's is not.
        let request = RateLimitRequest::new("ai", [model, vec![("backend_name", "b3")]]);
        let response = limiter.check_now(&request).expect("an answer");
        let m = dynamic_metadata(&request, &response);
        let backends = Metadata::List(vec![Metadata::Map(vec![
            ("backend_name".into(), string("b3")),
            ("model_name_override".into(), string("")),
        ])]);
        assert_eq!(field(&m, "passedBackends"), Some(&backends));
        let expected = Metadata::Map(vec![
            (
                "route".into(),
                Metadata::Map(vec![
                    ("cluster".into(), string("primary")),
                    ("weight".into(), Metadata::Number(1.0)),
                ]),
            ),
            ("team".into(), string("models")),
        ]);
        assert_eq!(field(&m, "metadata"), Some(&expected));
        let Some(Metadata::List(descriptors)) = field(&m, "descriptors") else {
            panic!("no descriptors in {m:?}");
        };
        assert_eq!(field(&descriptors[0], "code"), Some(&string("OVER_LIMIT")));
        assert_eq!(field(&descriptors[1], "code"), Some(&string("OK")));
    }

    #[test]
    fn a_request_over_every_group_passes_nothing() {
        let request = RateLimitRequest::new(
            "ai",
            [vec![("backend_name", "b1"), ("model_name_override", "m1")]],
        );
        let mut request = request;
        request.hits_addend = 2;
        let m = answer(RULES, &request);
        assert_eq!(field(&m, "hitsAddend"), Some(&Metadata::Number(2.0)));
        assert_eq!(field(&m, "passedBackends"), None);
        assert_eq!(field(&m, "metadata"), None);
    }

    /// Many descriptors (past the default caps, as a library caller may allow): each
    /// quota group's backend listed once, each rule's metadata merged once; the sets
    /// and the merge keep this linear in the descriptors.
    #[test]
    fn many_descriptors_merge_each_rules_metadata_once() {
        use std::sync::Arc;
        use tollgate::limiter::{Limiter, RequestLimits, Settings};
        use tollgate::rules::{from_str, Rules};
        use tollgate::store::MemoryStore;
        let n = 5_000;
        let set = from_str("rules.yaml", RULES).expect("valid rules");
        let limiter =
            Limiter::new(Arc::new(Rules::fixed(set)), MemoryStore::new()).with_settings(Settings {
                limits: RequestLimits {
                    max_descriptors: n,
                    ..RequestLimits::default()
                },
                ..Settings::default()
            });
        let request = RateLimitRequest::new(
            "ai",
            (0..n).map(|i| {
                if i % 2 == 0 {
                    vec![("backend_name".to_string(), format!("b{}", i % 1_000))]
                } else {
                    vec![("user".to_string(), format!("u{i}"))]
                }
            }),
        );
        let response = limiter.check_now(&request).expect("an answer");
        let m = dynamic_metadata(&request, &response);
        let Some(Metadata::List(backends)) = field(&m, "passedBackends") else {
            panic!("no backends in the answer");
        };
        // b0, b2, ..., b998: each group once.
        assert_eq!(backends.len(), 500);
        let expected = Metadata::Map(vec![
            (
                "route".into(),
                Metadata::Map(vec![
                    ("cluster".into(), string("primary")),
                    ("weight".into(), Metadata::Number(1.0)),
                ]),
            ),
            ("team".into(), string("models")),
            ("tier".into(), string("free")),
        ]);
        assert_eq!(field(&m, "metadata"), Some(&expected));
    }

    proptest! {
        /// What the native transport writes decodes, with prost, to what tonic sends.
        #[test]
        fn written_bytes_decode_to_the_struct_tonic_sends(
            fields in prop::collection::btree_map("[a-z]{1,6}", metadata(), 0..5),
        ) {
            let m = Metadata::Map(fields.into_iter().collect());
            let mut out = Vec::new();
            write_struct_body(&mut out, &m);
            prop_assert_eq!(out.len(), struct_len(&m));
            let decoded = Struct::decode(out.as_slice()).expect("valid protobuf");
            prop_assert_eq!(decoded, to_struct(&m));
        }
    }
}
