//! A decision written straight to the protobuf bytes of Envoy's `RateLimitResponse`, for
//! the native transport: the very bytes prost writes for [`rls::to_wire`]'s message (a
//! test holds the two equal), without building the wire structs first (a `String` per
//! header name and limit name, a `Vec` per repeated field) and without prost's second
//! pass over nested messages for their lengths (what that saves: docs/benchmarks.md,
//! The service).
//!
//! Fields are written in the order prost writes them (by field number), proto3
//! defaults left out, as prost leaves them out.
//!
//! [`rls::to_wire`]: crate::grpc::rls::to_wire

use tollgate::headers::{headers, problem_body, HeaderSettings};
use tollgate::limiter::{Code, DescriptorStatus, RateLimitResponse};

use crate::grpc::rls::{code_to_wire, unit_to_wire};

/// Wire type of varint fields.
const VARINT: u8 = 0;
/// Wire type of length-delimited fields (strings, bytes, messages).
const LEN: u8 = 2;

/// The field key of field `field` (< 16, so one byte) with wire type `wire`.
const fn key(field: u8, wire: u8) -> u8 {
    field << 3 | wire
}

/// Appends `v` as a base-128 varint.
fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// The length of `v` as a varint.
fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

/// An int32 or enum as protobuf writes it (negative values sign-extended to 64 bits).
fn int32(v: i32) -> u64 {
    i64::from(v) as u64
}

/// The length of a varint field (key + value), 0 for the default 0 (left out).
fn varint_field_len(v: u64) -> usize {
    if v == 0 {
        0
    } else {
        1 + varint_len(v)
    }
}

/// Appends a varint field unless it is the default 0.
fn varint_field(out: &mut Vec<u8>, field: u8, v: u64) {
    if v != 0 {
        out.push(key(field, VARINT));
        varint(out, v);
    }
}

/// The length of a length-delimited field of `len` bytes, always written.
fn len_field_len(len: usize) -> usize {
    1 + varint_len(len as u64) + len
}

/// Appends a length-delimited field's key and length.
fn len_prefix(out: &mut Vec<u8>, field: u8, len: usize) {
    out.push(key(field, LEN));
    varint(out, len as u64);
}

/// Appends a string or bytes field unless it is empty (the proto3 default).
fn bytes_field(out: &mut Vec<u8>, field: u8, bytes: &[u8]) {
    if !bytes.is_empty() {
        len_prefix(out, field, bytes.len());
        out.extend_from_slice(bytes);
    }
}

/// The length of a string or bytes field, 0 when empty (left out).
fn bytes_field_len(len: usize) -> usize {
    if len == 0 {
        0
    } else {
        len_field_len(len)
    }
}

/// The numbers of a `DescriptorStatus` as they go on the wire, with the lengths of
/// its nested messages.
struct WireStatus<'a> {
    code: u64,
    /// `current_limit`: (name, requests_per_unit, unit), when the status has a limit.
    limit: Option<(&'a str, u64, u64)>,
    remaining: u64,
    /// `duration_until_reset`: (seconds, nanos), when the status has a limit.
    reset: Option<(u64, u64)>,
}

impl<'a> WireStatus<'a> {
    fn of(s: &'a DescriptorStatus) -> Self {
        Self {
            code: int32(code_to_wire(s.code) as i32),
            limit: s.limit.as_ref().map(|l| {
                (
                    l.name.as_deref().unwrap_or(""),
                    u64::from(u32::try_from(l.requests_per_unit).unwrap_or(u32::MAX)),
                    int32(unit_to_wire(l.unit) as i32),
                )
            }),
            remaining: u64::from(u32::try_from(s.remaining).unwrap_or(u32::MAX)),
            // Whole seconds, rounded up (see `rls::to_wire_with`).
            reset: s.limit.as_ref().map(|_| {
                (
                    i64::try_from(s.reset_after_secs()).unwrap_or(i64::MAX) as u64,
                    0,
                )
            }),
        }
    }

    fn limit_len(&self) -> Option<usize> {
        self.limit.map(|(name, rpu, unit)| {
            bytes_field_len(name.len()) + varint_field_len(rpu) + varint_field_len(unit)
        })
    }

    fn reset_len(&self) -> Option<usize> {
        self.reset
            .map(|(secs, nanos)| varint_field_len(secs) + varint_field_len(nanos))
    }

    /// The length of the `DescriptorStatus` message.
    fn len(&self) -> usize {
        varint_field_len(self.code)
            + self.limit_len().map_or(0, len_field_len)
            + varint_field_len(self.remaining)
            + self.reset_len().map_or(0, len_field_len)
    }

    /// Appends the `DescriptorStatus` message (without its own key and length).
    fn write(&self, out: &mut Vec<u8>) {
        varint_field(out, 1, self.code);
        if let (Some((name, rpu, unit)), Some(len)) = (self.limit, self.limit_len()) {
            len_prefix(out, 2, len);
            varint_field(out, 1, rpu);
            varint_field(out, 2, unit);
            bytes_field(out, 3, name.as_bytes());
        }
        varint_field(out, 3, self.remaining);
        if let (Some((secs, nanos)), Some(len)) = (self.reset, self.reset_len()) {
            len_prefix(out, 4, len);
            varint_field(out, 1, secs);
            varint_field(out, 2, nanos);
        }
    }
}

/// `response` as the protobuf bytes of Envoy's `RateLimitResponse`, with the headers
/// `settings` ask for and, on OVER_LIMIT, the problem body: what
/// `rls::to_wire(response, ..).encode_to_vec()` gives.
pub fn response(response: &RateLimitResponse, settings: HeaderSettings) -> Vec<u8> {
    let fields = headers(response, settings);
    let body = if settings.problem_body && response.overall == Code::OverLimit {
        problem_body(response)
    } else {
        Vec::new()
    };
    let mut size = 2 * response.statuses.len() + 16 + body.len();
    for s in &response.statuses {
        size += WireStatus::of(s).len() + 4;
    }
    for (name, value) in &fields {
        size += name.len() + value.len() + 8;
    }
    let mut out = Vec::with_capacity(size);

    varint_field(&mut out, 1, int32(code_to_wire(response.overall) as i32));
    for s in &response.statuses {
        let s = WireStatus::of(s);
        len_prefix(&mut out, 2, s.len());
        s.write(&mut out);
    }
    for (name, value) in &fields {
        len_prefix(
            &mut out,
            3,
            bytes_field_len(name.len()) + bytes_field_len(value.len()),
        );
        bytes_field(&mut out, 1, name.as_bytes());
        bytes_field(&mut out, 2, value.as_bytes());
    }
    bytes_field(&mut out, 5, &body);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grpc::rls::to_wire_with;
    use proptest::prelude::*;
    use prost::Message;
    use std::sync::Arc;
    use tollgate::limiter::{MetricKey, ReportedLimit};
    use tollgate::rules::Unit;

    fn unit() -> impl Strategy<Value = Unit> {
        prop_oneof![
            Just(Unit::Second),
            Just(Unit::Minute),
            Just(Unit::Hour),
            Just(Unit::Day),
            Just(Unit::Week),
            Just(Unit::Month),
            Just(Unit::Year),
        ]
    }

    fn big() -> impl Strategy<Value = u64> {
        prop_oneof![
            0u64..200,
            Just(u64::from(u32::MAX)),
            Just(u64::from(u32::MAX) + 1),
            any::<u64>(),
        ]
    }

    fn status() -> impl Strategy<Value = DescriptorStatus> {
        (
            any::<bool>(),
            proptest::option::of((proptest::option::of("[ -~é]{0,12}"), big(), unit())),
            big(),
            big(),
            big(),
            proptest::option::of("[ -~\"\\\\é]{0,12}"),
        )
            .prop_map(|(over, limit, remaining, reset_after, retry_after, path)| {
                DescriptorStatus {
                    code: if over { Code::OverLimit } else { Code::Ok },
                    limit: limit.map(|(name, requests_per_unit, unit)| ReportedLimit {
                        name,
                        requests_per_unit,
                        unit,
                    }),
                    remaining,
                    reset_after,
                    retry_after,
                    delay: 0,
                    over_soft_limit: false,
                    overdraft: false,
                    shadow: false,
                    would_reject: false,
                    metric: path.map(|p| MetricKey {
                        domain: Arc::from("d"),
                        path: Arc::from(p.as_str()),
                    }),
                    from_cache: false,
                    failure_mode: None,
                    quota: None,
                    metadata: None,
                }
            })
    }

    proptest! {
        /// Any decision, any header settings: the bytes prost writes for the wire
        /// message `rls::to_wire` builds.
        #[test]
        fn writes_what_prost_writes(
            statuses in proptest::collection::vec(status(), 0..4),
            flags in any::<[bool; 5]>(),
        ) {
            let [draft, legacy, envoy, retry_after, problem_body] = flags;
            let overall = if statuses.iter().any(|s| s.code == Code::OverLimit) {
                Code::OverLimit
            } else {
                Code::Ok
            };
            let decision = RateLimitResponse { overall, statuses, store_failure: None };
            let settings = HeaderSettings { draft, legacy, envoy, retry_after, problem_body };
            let expected = to_wire_with(&decision, settings).encode_to_vec();
            prop_assert_eq!(response(&decision, settings), expected);
        }
    }

    #[test]
    fn varint_lengths_match_the_varints_written() {
        for v in [
            0,
            1,
            127,
            128,
            16_383,
            16_384,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            let mut out = Vec::new();
            varint(&mut out, v);
            assert_eq!(varint_len(v), out.len(), "{v}");
        }
    }
}
