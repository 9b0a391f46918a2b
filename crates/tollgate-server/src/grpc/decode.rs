//! Envoy's `RateLimitRequest` read straight from its protobuf bytes into Tollgate's
//! [`RateLimitRequest`], for the native transport: what prost's decoding followed by
//! [`rls::from_wire`] gives (a differential test holds the two equal, on valid
//! messages and on arbitrary bytes), without the wire structs in between (a `Vec` per
//! repeated field, then a second conversion into Tollgate's types; what that saves:
//! docs/benchmarks.md, The service).
//!
//! prost's rules are kept: unknown fields are skipped (groups too, to the same depth
//! limit of 100); a known field with the wrong wire type is an error; a singular
//! message seen twice is merged and a scalar seen twice keeps its last value; strings
//! must be UTF-8; a `uint32` keeps the low 32 bits of its varint. As with prost, the
//! whole message is read before any field is judged, so a message that does not decode
//! is reported as such even where a field before the damage is also invalid — with one
//! exception: the reading stops at the first size over the service's
//! [`RequestLimits`] (a descriptor past `--max-descriptors`, an entry past
//! `--max-entries`, a key or value past `--max-entry-bytes`), so that a call of 100,000
//! descriptors costs no more than one of 65. The refusal is the one
//! [`rls::from_wire`] gives for the same message (it checks the sizes in the same
//! order, before anything else); only a message that prost cannot decode after that
//! point is refused for its size here and as undecodable there.
//!
//! [`rls::from_wire`]: crate::grpc::rls::from_wire

use std::fmt;

use tollgate::limiter::{self, RateLimitRequest, RequestLimits};

use crate::grpc::rls::{descriptor, validated};

/// prost's limit on nested messages and groups.
const RECURSION_LIMIT: u32 = 100;

/// Wire types.
const VARINT: u8 = 0;
const I64: u8 = 1;
const LEN: u8 = 2;
const START_GROUP: u8 = 3;
const END_GROUP: u8 = 4;
const I32: u8 = 5;

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Malformed {
    /// The bytes are not a protobuf `RateLimitRequest`.
    Decode(&'static str),
    /// The message decodes but is not a valid request (as [`rls::from_wire`] says).
    ///
    /// [`rls::from_wire`]: crate::grpc::rls::from_wire
    Invalid(String),
}

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Decode(why) => write!(f, "cannot decode the RateLimitRequest: {why}"),
            Self::Invalid(why) => f.write_str(why),
        }
    }
}

/// The request in `bytes` (a serialized `RateLimitRequest`), validated; the reading
/// stops at the first size over `limits`.
pub fn request_within(bytes: &[u8], limits: &RequestLimits) -> Result<RateLimitRequest, Malformed> {
    let wire = WireRequest::read(&mut Reader { buf: bytes }, limits).map_err(|e| match e {
        Stop::Decode(why) => Malformed::Decode(why),
        Stop::TooLarge(why) => Malformed::Invalid(why),
    })?;
    let mut descriptors = Vec::with_capacity(wire.descriptors.len());
    for (i, d) in wire.descriptors.into_iter().enumerate() {
        let hits = d.hits_addend;
        let d = descriptor(i, d.entries, d.limit, hits, d.is_negative_hits)
            .map_err(Malformed::Invalid)?;
        descriptors.push(d);
    }
    validated(
        RateLimitRequest {
            domain: wire.domain,
            descriptors,
            hits_addend: u64::from(wire.hits_addend),
        },
        limits,
    )
    .map_err(Malformed::Invalid)
}

type Decoded<T> = Result<T, &'static str>;

/// Why the reading of a request stopped.
enum Stop {
    /// The bytes do not decode.
    Decode(&'static str),
    /// A size is over the limits (the message says which).
    TooLarge(String),
}

impl From<&'static str> for Stop {
    fn from(why: &'static str) -> Self {
        Stop::Decode(why)
    }
}

impl From<limiter::Error> for Stop {
    fn from(e: limiter::Error) -> Self {
        match e {
            limiter::Error::InvalidRequest(why) => Stop::TooLarge(why),
            other => Stop::TooLarge(other.to_string()),
        }
    }
}

/// The unread rest of a message.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn has_more(&self) -> bool {
        !self.buf.is_empty()
    }

    /// A base-128 varint of at most 10 bytes whose value fits in 64 bits.
    fn varint(&mut self) -> Decoded<u64> {
        let mut value = 0u64;
        for (i, &b) in self.buf.iter().enumerate().take(10) {
            if i == 9 && b > 1 {
                return Err("invalid varint");
            }
            value |= u64::from(b & 0x7f) << (7 * i);
            if b < 0x80 {
                self.buf = &self.buf[i + 1..];
                return Ok(value);
            }
        }
        Err("invalid varint")
    }

    /// A field key: (field number, wire type).
    fn key(&mut self) -> Decoded<(u32, u8)> {
        let key = self.varint()?;
        let key = u32::try_from(key).map_err(|_| "invalid key value")?;
        let wire = (key & 7) as u8;
        if wire > I32 {
            return Err("invalid wire type value");
        }
        if key >> 3 == 0 {
            return Err("invalid tag value: 0");
        }
        Ok((key >> 3, wire))
    }

    /// `n` bytes.
    fn take(&mut self, n: u64) -> Decoded<&'a [u8]> {
        let n = usize::try_from(n).map_err(|_| "buffer underflow")?;
        if n > self.buf.len() {
            return Err("buffer underflow");
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    /// A length-delimited field's bytes.
    fn bytes(&mut self) -> Decoded<&'a [u8]> {
        let n = self.varint()?;
        self.take(n)
    }

    /// A string field.
    fn string(&mut self, wire: u8) -> Decoded<String> {
        self.str(wire).map(str::to_owned)
    }

    /// A string field, borrowed from the message.
    fn str(&mut self, wire: u8) -> Decoded<&'a str> {
        expect(wire, LEN)?;
        let bytes = self.bytes()?;
        std::str::from_utf8(bytes).map_err(|_| "invalid string value: data is not UTF-8 encoded")
    }

    /// A varint field.
    fn scalar(&mut self, wire: u8) -> Decoded<u64> {
        expect(wire, VARINT)?;
        self.varint()
    }

    /// A nested message's bytes, `depth` levels left to nest.
    fn message(&mut self, wire: u8, depth: u32) -> Decoded<Reader<'a>> {
        expect(wire, LEN)?;
        if depth == 0 {
            return Err("recursion limit reached");
        }
        Ok(Reader { buf: self.bytes()? })
    }

    /// Skips an unknown field, as prost's `skip_field`.
    fn skip(&mut self, wire: u8, field: u32, depth: u32) -> Decoded<()> {
        if depth == 0 {
            return Err("recursion limit reached");
        }
        match wire {
            VARINT => self.varint().map(drop),
            I64 => self.take(8).map(drop),
            LEN => self.bytes().map(drop),
            I32 => self.take(4).map(drop),
            START_GROUP => loop {
                let (inner, inner_wire) = self.key()?;
                if inner_wire == END_GROUP {
                    if inner != field {
                        return Err("unexpected end group tag");
                    }
                    return Ok(());
                }
                self.skip(inner_wire, inner, depth - 1)?;
            },
            _ => Err("unexpected end group tag"),
        }
    }
}

/// A known field must come with its wire type.
fn expect(wire: u8, expected: u8) -> Decoded<()> {
    if wire == expected {
        Ok(())
    } else {
        Err("invalid wire type for a known field")
    }
}

/// `RateLimitRequest` as read, before it is judged.
#[derive(Default)]
struct WireRequest {
    domain: String,
    descriptors: Vec<WireDescriptor>,
    hits_addend: u32,
}

impl WireRequest {
    /// Reads a request, stopping at the first size over `limits`.
    fn read(r: &mut Reader<'_>, limits: &RequestLimits) -> Result<Self, Stop> {
        let mut m = Self::default();
        while r.has_more() {
            match r.key()? {
                (1, wire) => m.domain = r.string(wire)?,
                (2, wire) => {
                    let mut inner = r.message(wire, RECURSION_LIMIT)?;
                    let i = m.descriptors.len();
                    limits.check_descriptor_count(i + 1)?;
                    m.descriptors.push(WireDescriptor::read(
                        &mut inner,
                        RECURSION_LIMIT - 1,
                        i,
                        limits,
                    )?);
                }
                (3, wire) => m.hits_addend = r.scalar(wire)? as u32,
                (field, wire) => r.skip(wire, field, RECURSION_LIMIT)?,
            }
        }
        Ok(m)
    }
}

/// `RateLimitDescriptor` as read: entries, the override's (requests_per_unit, unit),
/// `hits_addend`'s value, `is_negative_hits`.
#[derive(Default)]
struct WireDescriptor {
    entries: Vec<(String, String)>,
    limit: Option<(u32, i32)>,
    hits_addend: Option<u64>,
    is_negative_hits: bool,
}

impl WireDescriptor {
    /// Reads the fields of descriptor `i`, `depth` levels left to nest, stopping at the
    /// first size over `limits`.
    fn read(
        r: &mut Reader<'_>,
        depth: u32,
        i: usize,
        limits: &RequestLimits,
    ) -> Result<Self, Stop> {
        let mut m = Self::default();
        while r.has_more() {
            match r.key()? {
                (1, wire) => {
                    let mut inner = r.message(wire, depth)?;
                    let j = m.entries.len();
                    limits.check_entry_count(i, j + 1)?;
                    // Borrowed until judged: a long key or value is refused uncopied.
                    let (mut key, mut value) = ("", "");
                    while inner.has_more() {
                        match inner.key()? {
                            (1, wire) => key = inner.str(wire)?,
                            (2, wire) => value = inner.str(wire)?,
                            (field, wire) => inner.skip(wire, field, depth - 1)?,
                        }
                    }
                    limits.check_entry(i, j, key, value)?;
                    m.entries.push((key.to_owned(), value.to_owned()));
                }
                (2, wire) => {
                    // A second override merges into the first, field by field.
                    let mut inner = r.message(wire, depth)?;
                    let (rpu, unit) = m.limit.get_or_insert((0, 0));
                    while inner.has_more() {
                        match inner.key()? {
                            (1, wire) => *rpu = inner.scalar(wire)? as u32,
                            (2, wire) => *unit = inner.scalar(wire)? as i32,
                            (field, wire) => inner.skip(wire, field, depth - 1)?,
                        }
                    }
                }
                (3, wire) => {
                    // google.protobuf.UInt64Value; merged as the override is.
                    let mut inner = r.message(wire, depth)?;
                    let value = m.hits_addend.get_or_insert(0);
                    while inner.has_more() {
                        match inner.key()? {
                            (1, wire) => *value = inner.scalar(wire)?,
                            (field, wire) => inner.skip(wire, field, depth - 1)?,
                        }
                    }
                }
                (4, wire) => m.is_negative_hits = r.scalar(wire)? != 0,
                (field, wire) => r.skip(wire, field, depth)?,
            }
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grpc::rls::from_wire;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
        Entry, RateLimitOverride,
    };
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest as ProstRequest;
    use envoy_types::pb::google::protobuf::UInt64Value;
    use proptest::prelude::*;
    use prost::Message;

    /// What prost and `from_wire` make of `bytes`: the request, `Decode` (the
    /// message is not decided by prost; its reason is not compared), or `Invalid`.
    fn oracle(bytes: &[u8]) -> Result<RateLimitRequest, Malformed> {
        oracle_within(bytes, &RequestLimits::default())
    }

    fn oracle_within(bytes: &[u8], limits: &RequestLimits) -> Result<RateLimitRequest, Malformed> {
        let wire = ProstRequest::decode(bytes).map_err(|_| Malformed::Decode(""))?;
        from_wire(wire, limits).map_err(Malformed::Invalid)
    }

    fn ours(bytes: &[u8]) -> Result<RateLimitRequest, Malformed> {
        ours_within(bytes, &RequestLimits::default())
    }

    fn ours_within(bytes: &[u8], limits: &RequestLimits) -> Result<RateLimitRequest, Malformed> {
        request_within(bytes, limits).map_err(|e| match e {
            Malformed::Decode(_) => Malformed::Decode(""),
            other => other,
        })
    }

    /// Small limits, which the generated requests cross.
    const SMALL: RequestLimits = RequestLimits {
        max_descriptors: 2,
        max_entries: 1,
        max_entry_bytes: 4,
    };

    /// Whether `why` is a refusal for a size (what the decoder may say where prost
    /// finds damage after the point it stopped at).
    fn is_size_refusal(why: &Malformed) -> bool {
        matches!(why, Malformed::Invalid(w) if w.contains("(--max-"))
    }

    /// A request of `descriptors` descriptors of `entries` entries each, as bytes.
    fn many(descriptors: usize, entries: usize) -> Vec<u8> {
        ProstRequest {
            domain: "d".into(),
            descriptors: (0..descriptors)
                .map(|i| RateLimitDescriptor {
                    entries: (0..entries)
                        .map(|j| Entry {
                            key: format!("k{j}"),
                            value: format!("v{i}"),
                        })
                        .collect(),
                    ..RateLimitDescriptor::default()
                })
                .collect(),
            hits_addend: 0,
        }
        .encode_to_vec()
    }

    fn text() -> impl Strategy<Value = String> {
        prop_oneof![Just(String::new()), "[a-z_]{1,6}", "[ -~é\u{1F600}]{0,8}"]
    }

    fn wire_descriptor() -> impl Strategy<Value = RateLimitDescriptor> {
        (
            proptest::collection::vec((text(), text()), 0..3),
            proptest::option::of((any::<u32>(), -2i32..10)),
            proptest::option::of(prop_oneof![Just(0u64), 1u64..5, any::<u64>()]),
            proptest::bool::weighted(0.1),
        )
            .prop_map(|(entries, limit, hits, negative)| RateLimitDescriptor {
                entries: entries
                    .into_iter()
                    .map(|(key, value)| Entry { key, value })
                    .collect(),
                limit: limit.map(|(requests_per_unit, unit)| RateLimitOverride {
                    requests_per_unit,
                    unit,
                }),
                hits_addend: hits.map(|value| UInt64Value { value }),
                is_negative_hits: negative,
            })
    }

    fn wire_request() -> impl Strategy<Value = ProstRequest> {
        (
            text(),
            proptest::collection::vec(wire_descriptor(), 0..4),
            prop_oneof![Just(0u32), any::<u32>()],
        )
            .prop_map(|(domain, descriptors, hits_addend)| ProstRequest {
                domain,
                descriptors,
                hits_addend,
            })
    }

    /// An edit of a message's bytes: overwrite, insert or remove one byte.
    fn mutate(bytes: &mut Vec<u8>, at: usize, byte: u8, how: u8) {
        if bytes.is_empty() {
            bytes.push(byte);
            return;
        }
        let at = at % bytes.len();
        match how % 3 {
            0 => bytes[at] = byte,
            1 => bytes.insert(at, byte),
            _ => {
                bytes.remove(at);
            }
        }
    }

    proptest! {
        /// Any request prost writes: the same request (or the same refusal).
        #[test]
        fn reads_what_prost_and_from_wire_read(wire in wire_request()) {
            let bytes = wire.encode_to_vec();
            prop_assert_eq!(ours(&bytes), oracle(&bytes));
        }

        /// Damaged messages (a byte overwritten, inserted or removed, up to three
        /// times): whatever prost makes of them, so do we.
        #[test]
        fn damaged_messages_get_prosts_verdict(
            wire in wire_request(),
            edits in proptest::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 1..4),
        ) {
            let mut bytes = wire.encode_to_vec();
            for (at, byte, how) in edits {
                mutate(&mut bytes, at, byte, how);
            }
            prop_assert_eq!(ours(&bytes), oracle(&bytes));
        }

        /// Arbitrary bytes: never a panic, and prost's verdict.
        #[test]
        fn arbitrary_bytes_get_prosts_verdict(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            prop_assert_eq!(ours(&bytes), oracle(&bytes));
        }

        /// Within limits that the requests cross: the same request, or the same
        /// refusal, naming the same size.
        #[test]
        fn stops_where_from_wire_refuses(wire in wire_request()) {
            let bytes = wire.encode_to_vec();
            prop_assert_eq!(ours_within(&bytes, &SMALL), oracle_within(&bytes, &SMALL));
        }

        /// Damaged messages within small limits: prost's verdict, except that a message
        /// prost cannot decode may be refused for a size met before the damage.
        #[test]
        fn damaged_messages_within_limits_get_prosts_verdict_or_a_size_refusal(
            wire in wire_request(),
            edits in proptest::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 1..4),
        ) {
            let mut bytes = wire.encode_to_vec();
            for (at, byte, how) in edits {
                mutate(&mut bytes, at, byte, how);
            }
            let (got, want) = (ours_within(&bytes, &SMALL), oracle_within(&bytes, &SMALL));
            if want == Err(Malformed::Decode("")) && got.as_ref().is_err_and(is_size_refusal) {
                return Ok(());
            }
            prop_assert_eq!(got, want);
        }
    }

    /// The caps, with the words every front end uses; the decoder stops at them: what
    /// follows the 65th descriptor (or a descriptor's 33rd entry) is not even read, so
    /// bytes that do not decode there change nothing.
    #[test]
    fn stops_reading_at_the_caps() {
        let limits = RequestLimits::default();
        let too_many = Malformed::Invalid(
            "a request may carry at most 64 descriptors (--max-descriptors)".into(),
        );
        assert!(request_within(&many(64, 32), &limits).is_ok());
        assert_eq!(request_within(&many(65, 1), &limits), Err(too_many.clone()));
        assert_eq!(oracle(&many(65, 1)), Err(too_many.clone()));
        // 100,000 descriptors (1.9 MB).
        let huge = many(100_000, 1);
        assert_eq!(request_within(&huge, &limits), Err(too_many.clone()));
        // Damage after the 65th descriptor: prost does not decode it; we never got there.
        let mut damaged = many(65, 1);
        damaged.extend_from_slice(&[0x12, 0x7f]);
        assert_eq!(oracle(&damaged), Err(Malformed::Decode("")));
        assert_eq!(request_within(&damaged, &limits), Err(too_many));

        let too_long = Malformed::Invalid(
            "descriptor 0: a descriptor may carry at most 32 entries (--max-entries)".into(),
        );
        // Descriptor 1 (and the damage after it) is never read.
        let mut entries = many(2, 33);
        assert_eq!(request_within(&entries, &limits), Err(too_long.clone()));
        entries.extend_from_slice(&[0x12, 0x7f]);
        assert_eq!(request_within(&entries, &limits), Err(too_long));
    }

    /// A 1 MB value is refused, uncopied, saying how long it is and may be; a key or
    /// value repeated in its entry counts only as its last (prost's rule).
    #[test]
    fn a_long_value_is_refused_with_its_length() {
        let wire = |value: String| ProstRequest {
            domain: "d".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "path".into(),
                    value,
                }],
                ..RateLimitDescriptor::default()
            }],
            hits_addend: 0,
        };
        let bytes = wire("x".repeat(1 << 20)).encode_to_vec();
        let refusal = Malformed::Invalid(
            "descriptor 0, entry 0: the value is 1048576 bytes; a key or value may be at most \
             65536 bytes (--max-entry-bytes)"
                .into(),
        );
        assert_eq!(ours(&bytes), Err(refusal.clone()));
        assert_eq!(oracle(&bytes), Err(refusal));
        assert!(ours(&wire("x".repeat(1 << 16)).encode_to_vec()).is_ok());
        // value "xxxxx" then value "x" in one entry: prost keeps the last.
        let bytes = [
            0x0a, 1, b'd', 0x12, 15, 0x0a, 13, 0x0a, 1, b'k', 0x12, 5, b'x', b'x', b'x', b'x',
            b'x', 0x12, 1, b'x',
        ];
        let small = RequestLimits {
            max_entry_bytes: 4,
            ..RequestLimits::default()
        };
        assert!(ours_within(&bytes, &small).is_ok());
        assert_eq!(ours_within(&bytes, &small), oracle_within(&bytes, &small));
    }

    /// Hand-built messages for the rules prost follows that random messages rarely hit.
    #[test]
    fn follows_prosts_rules_on_unusual_messages() {
        let cases: Vec<Vec<u8>> = vec![
            // domain "a", then a descriptor {entry {key "k"}}, an unknown group
            // (field 9) holding a varint, and unknown 32- and 64-bit fields.
            vec![
                0x0a, 1, b'a', 0x12, 5, 0x0a, 3, 0x0a, 1, b'k', 0x4b, 0x08, 1, 0x4c, 0x4d, 1, 2, 3,
                4, 0x49, 1, 2, 3, 4, 5, 6, 7, 8,
            ],
            // The same group closed by the wrong field number.
            vec![0x0a, 1, b'a', 0x4b, 0x54],
            // A lone end-group.
            vec![0x0a, 1, b'a', 0x4c],
            // Groups nested 100 and 101 deep.
            [vec![0x0a, 1, b'a'], vec![0x4b; 100], vec![0x4c; 100]].concat(),
            [vec![0x0a, 1, b'a'], vec![0x4b; 101], vec![0x4c; 101]].concat(),
            // domain with the wrong wire type (varint).
            vec![0x08, 1],
            // field number 0.
            vec![0x02, 0],
            // A non-canonical varint (0 in two bytes) for hits_addend, then domain.
            vec![0x18, 0x80, 0x00, 0x0a, 1, b'a'],
            // A ten-byte varint whose last byte overflows 64 bits.
            vec![
                0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02,
            ],
            // hits_addend beyond 32 bits (prost keeps the low 32).
            vec![
                0x0a, 1, b'a', 0x12, 5, 0x0a, 3, 0x0a, 1, b'k', 0x18, 0x81, 0x80, 0x80, 0x80, 0x10,
            ],
            // Two overrides merged: requests_per_unit from the first, unit from the second.
            vec![
                0x0a, 1, b'a', 0x12, 13, 0x0a, 3, 0x0a, 1, b'k', 0x12, 2, 0x08, 7, 0x12, 2, 0x10, 3,
            ],
            // Two hits_addend values, the second empty: the first value stays.
            vec![
                0x0a, 1, b'a', 0x12, 11, 0x0a, 3, 0x0a, 1, b'k', 0x1a, 2, 0x08, 5, 0x1a, 0,
            ],
            // An entry's string runs past the end of its message.
            vec![
                0x0a, 1, b'a', 0x12, 5, 0x0a, 3, 0x0a, 5, b'k', b'x', b'y', b'z',
            ],
            // Not UTF-8.
            vec![0x0a, 1, 0xff],
            // is_negative_hits written as 2 (any non-zero varint is true).
            vec![0x0a, 1, b'a', 0x12, 7, 0x0a, 3, 0x0a, 1, b'k', 0x20, 2],
        ];
        for bytes in cases {
            assert_eq!(ours(&bytes), oracle(&bytes), "{bytes:02x?}");
        }
    }

    #[test]
    fn a_valid_request_reads_as_tollgate_s_request() {
        let wire = ProstRequest {
            domain: "api".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "user".into(),
                    value: "alice".into(),
                }],
                limit: None,
                hits_addend: Some(UInt64Value { value: 3 }),
                is_negative_hits: false,
            }],
            hits_addend: 2,
        };
        let got = request_within(&wire.encode_to_vec(), &RequestLimits::default()).expect("valid");
        assert_eq!(got.domain, "api");
        assert_eq!(got.hits_addend, 2);
        assert_eq!(
            got.descriptors[0].entries,
            vec![("user".to_string(), "alice".to_string())]
        );
        assert_eq!(got.descriptors[0].hits_addend, Some(3));
    }
}
