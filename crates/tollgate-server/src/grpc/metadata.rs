//! The response's dynamic metadata (`--response-dynamic-metadata`), as envoyproxy/ratelimit
//! sends it with `RESPONSE_DYNAMIC_METADATA=true`: the request's domain and descriptors,
//! and which descriptors passed, with the matched rule's `metadata` (what Envoy's
//! quota-aware routing reads: a filter after the rate limit filter finds it under
//! `envoy.filters.http.ratelimit`).
//!
//! ```text
//! { domain: "<domain>",
//!   descriptors: [ { entries: ["key=value", ...],
//!                    limit: { requestsPerUnit: N, unit: "MINUTE" },   (a request's own limit)
//!                    hitsAddend: N,                                    (a descriptor's own cost)
//!                    code: "OK" | "OVER_LIMIT",
//!                    metadata: { ... } },                              (the rule's, when OK)
//!                  ... ],
//!   hitsAddend: N }                                                    (when the request says)
//! ```
//!
//! One tree ([`Metadata`]) is built per answer, then turned into tonic's
//! `google.protobuf.Struct` ([`to_struct`]) or written as protobuf bytes by the native
//! transport ([`write_struct`]).

use std::collections::HashMap;

use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use tollgate::limiter::{Code, RateLimitRequest, RateLimitResponse};
use tollgate::rules::Metadata;

/// The dynamic metadata of `response` to `request`.
pub fn dynamic_metadata(request: &RateLimitRequest, response: &RateLimitResponse) -> Metadata {
    let descriptors = request
        .descriptors
        .iter()
        .zip(&response.statuses)
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
                    Metadata::Map(vec![
                        (
                            "requestsPerUnit".into(),
                            Metadata::Number(o.requests_per_unit as f64),
                        ),
                        ("unit".into(), Metadata::String(o.unit.name().into())),
                    ]),
                ));
            }
            if let Some(h) = d.hits_addend {
                fields.push(("hitsAddend".into(), Metadata::Number(h as f64)));
            }
            let passed = s.code == Code::Ok;
            fields.push((
                "code".into(),
                Metadata::String(if passed { "OK" } else { "OVER_LIMIT" }.into()),
            ));
            if let (true, Some(m)) = (passed, &s.metadata) {
                fields.push(("metadata".into(), (**m).clone()));
            }
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
    Metadata::Map(fields)
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
