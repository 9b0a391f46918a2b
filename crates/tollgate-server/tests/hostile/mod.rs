//! Hostile inputs for every parser that reads untrusted bytes, and a way to run each
//! parser as its listener does: shared by the amplification test
//! (`tests/amplification.rs`, allocation per input byte) and the `hostile_input`
//! example (`tools/check-amplification.sh`, instructions per input byte under
//! callgrind).
#![allow(dead_code)]

use std::net::{IpAddr, Ipv4Addr};
use std::time::Instant;

use http::{HeaderMap, HeaderName, HeaderValue};
use tollgate_h2::frame::{self, kind, setting};
use tollgate_h2::hpack;
use tollgate_h2::server::{Call, ServerConn, ServerSettings};
use tollgate_server::fuzzing;

/// The parsers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The native HTTP/2 server's receive path (bytes after the preface).
    H2,
    /// The gRPC `RateLimitRequest` decoder.
    Protobuf,
    /// `/v1/check` and `/json` bodies (each input read by both).
    Json,
    /// The rule-file reader.
    Rules,
    /// The client address from `X-Forwarded-For` / `Forwarded` (lines alternate).
    ClientIp,
}

impl Target {
    /// Reads `input` as the listener would.
    pub fn run(self, input: &[u8]) {
        match self {
            Self::H2 => serve_h2(input),
            Self::Protobuf => decode(input),
            Self::Json => both_json(input),
            Self::Rules => rules(input),
            Self::ClientIp => client_ip(input),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::H2 => "h2",
            Self::Protobuf => "protobuf",
            Self::Json => "json",
            Self::Rules => "rules",
            Self::ClientIp => "client-ip",
        }
    }
}

/// One hostile shape of input for one parser, `make(n)` about `n` bytes long.
pub struct Case {
    pub target: Target,
    pub name: &'static str,
    /// The smaller size the checks use (the larger is eight times it).
    pub n: usize,
    pub make: fn(usize) -> Vec<u8>,
}

const fn case(target: Target, name: &'static str, n: usize, make: fn(usize) -> Vec<u8>) -> Case {
    Case {
        target,
        name,
        n,
        make,
    }
}

/// Every case.
pub const CASES: &[Case] = &[
    case(Target::H2, "HPACK references", 64 << 10, hpack_references),
    case(Target::H2, "SETTINGS flood", 64 << 10, settings_flood),
    case(Target::H2, "PING flood", 64 << 10, ping_flood),
    case(Target::H2, "rapid reset", 64 << 10, rapid_reset),
    case(
        Target::H2,
        "CONTINUATION flood",
        64 << 10,
        continuation_flood,
    ),
    case(Target::H2, "valid calls", 64 << 10, calls),
    case(
        Target::Protobuf,
        "many descriptors",
        32 << 10,
        many_descriptors,
    ),
    case(Target::Protobuf, "many entries", 32 << 10, many_entries),
    case(Target::Protobuf, "nested groups", 32 << 10, nested_groups),
    case(Target::Protobuf, "unknown fields", 32 << 10, unknown_fields),
    case(Target::Protobuf, "a long value", 32 << 10, long_value),
    case(Target::Protobuf, "a valid request", 1, valid_request),
    case(
        Target::Json,
        "/v1/check, many descriptors",
        128 << 10,
        check_many_descriptors,
    ),
    case(
        Target::Json,
        "/v1/check, many entries",
        128 << 10,
        check_many_entries,
    ),
    case(
        Target::Json,
        "/json, many descriptors",
        128 << 10,
        json_many_descriptors,
    ),
    case(Target::Json, "a repeated key", 128 << 10, repeated_keys),
    case(
        Target::Json,
        "unknown fields",
        128 << 10,
        unknown_json_fields,
    ),
    case(Target::Json, "deep nesting", 128 << 10, deep_nesting),
    case(Target::Json, "a long string", 128 << 10, long_string),
    case(Target::Rules, "many rules", 16 << 10, many_rules),
    case(Target::Rules, "deep nesting", 16 << 10, deep_yaml),
    case(Target::Rules, "flow-style rule trees", 16 << 10, flow_trees),
    case(Target::Rules, "aliases", 16 << 10, yaml_aliases),
    case(Target::Rules, "many errors", 16 << 10, many_errors),
    case(
        Target::ClientIp,
        "a long X-Forwarded-For",
        8 << 10,
        long_forwarded_for,
    ),
    case(
        Target::ClientIp,
        "a long Forwarded",
        8 << 10,
        long_forwarded,
    ),
    case(
        Target::ClientIp,
        "many header lines",
        8 << 10,
        many_header_lines,
    ),
];

// ---- the HTTP/2 receive path ----

const METHODS: &[&str] = &["/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"];
const PATH: &str = METHODS[0];

/// Feeds `input` (after the preface) to a new connection as a server would, in reads
/// of 16 KiB, answering every call, until the input ends or the connection fails. The
/// clock stands still, so rate limits see the whole input as one burst.
pub fn serve_h2(input: &[u8]) {
    let now = Instant::now();
    let mut conn = ServerConn::new(ServerSettings::default(), METHODS);
    let mut buffer = frame::PREFACE.to_vec();
    let mut calls: Vec<Call> = Vec::new();
    let mut chunks = input.chunks(16 << 10);
    loop {
        match conn.receive_at(now, &buffer, &mut calls) {
            Ok(used) => {
                buffer.drain(..used);
            }
            Err(_) => return,
        }
        for call in calls.drain(..) {
            conn.respond(call.stream, Ok(b"\x08\x01"));
        }
        conn.output().clear();
        match chunks.next() {
            Some(c) => buffer.extend_from_slice(c),
            None => return,
        }
    }
}

fn settings_frame(out: &mut Vec<u8>, entries: &[(u16, u32)]) {
    frame::put_settings(out, entries);
}

/// A call's header block.
fn call_block() -> Vec<u8> {
    let mut block = vec![hpack::METHOD_POST, hpack::SCHEME_HTTP];
    hpack::put_indexed_name(&mut block, hpack::PATH, PATH.as_bytes());
    hpack::put_indexed_name(&mut block, hpack::AUTHORITY, b"tollgate");
    hpack::put_indexed_name(&mut block, hpack::CONTENT_TYPE, b"application/grpc");
    hpack::put_literal(&mut block, b"te", b"trailers");
    block
}

/// A gRPC request message in DATA frames.
fn call_data(out: &mut Vec<u8>, stream: u32, end: bool) {
    let mut data = Vec::new();
    tollgate_h2::grpc::put_message(&mut data, &grpc_message(1, 1));
    frame::put_data(out, stream, &data, frame::DEFAULT_MAX_FRAME, end);
}

fn grow(target: usize, mut add: impl FnMut(&mut Vec<u8>, u32)) -> Vec<u8> {
    let mut out = Vec::new();
    settings_frame(&mut out, &[]);
    let mut i = 0;
    while out.len() < target {
        add(&mut out, i);
        i += 1;
    }
    out
}

/// One 4 KB field indexed, then referenced until the block is `n` bytes (HEADERS and
/// CONTINUATION frames of 16 KiB).
pub fn hpack_references(n: usize) -> Vec<u8> {
    let mut block = call_block();
    hpack::put_literal_indexing(&mut block, b"x-big", &[b'a'; 4000]);
    while block.len() < n {
        hpack::put_indexed(&mut block, 62);
    }
    let mut out = Vec::new();
    settings_frame(&mut out, &[]);
    frame::put_headers(&mut out, 1, &block, frame::DEFAULT_MAX_FRAME, false);
    out
}

/// 1,024 streams opened and left unfinished, then SETTINGS frames full of
/// INITIAL_WINDOW_SIZE entries.
pub fn settings_flood(n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    settings_frame(&mut out, &[]);
    let block = call_block();
    for s in 0..1024u32 {
        frame::put_headers(&mut out, 2 * s + 1, &block, frame::DEFAULT_MAX_FRAME, false);
    }
    let entries: Vec<(u16, u32)> = (0..2700u32)
        .map(|i| (setting::INITIAL_WINDOW_SIZE, 65_535 + (i % 2)))
        .collect();
    while out.len() < n {
        settings_frame(&mut out, &entries);
    }
    out
}

pub fn ping_flood(n: usize) -> Vec<u8> {
    grow(n, |out, i| {
        frame::put_ping(out, &u64::from(i).to_be_bytes())
    })
}

/// Calls each reset at once (CVE-2023-44487).
pub fn rapid_reset(n: usize) -> Vec<u8> {
    let block = call_block();
    grow(n, |out, i| {
        let stream = 2 * i + 1;
        frame::put_headers(out, stream, &block, frame::DEFAULT_MAX_FRAME, false);
        call_data(out, stream, true);
        frame::put_rst_stream(out, stream, tollgate_h2::ErrorCode::Cancel);
    })
}

/// Empty CONTINUATION frames after an unfinished HEADERS.
pub fn continuation_flood(n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    settings_frame(&mut out, &[]);
    let block = call_block();
    frame::put_header(&mut out, block.len(), kind::HEADERS, 0, 1);
    out.extend_from_slice(&block);
    while out.len() < n {
        frame::put_header(&mut out, 0, kind::CONTINUATION, 0, 1);
    }
    out
}

/// Valid calls, each answered: the work a well-behaved client buys per byte.
pub fn calls(n: usize) -> Vec<u8> {
    let block = call_block();
    grow(n, |out, i| {
        let stream = 2 * i + 1;
        frame::put_headers(out, stream, &block, frame::DEFAULT_MAX_FRAME, false);
        call_data(out, stream, true);
    })
}

// ---- the protobuf request decoder ----

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_len(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_varint(out, u64::from(field << 3 | 2));
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A `RateLimitRequest` with `descriptors` descriptors of `entries` entries each.
pub fn grpc_message(descriptors: usize, entries: usize) -> Vec<u8> {
    let mut entry = Vec::new();
    put_len(&mut entry, 1, b"user");
    put_len(&mut entry, 2, b"alice");
    let mut descriptor = Vec::new();
    for _ in 0..entries {
        put_len(&mut descriptor, 1, &entry);
    }
    let mut out = Vec::new();
    put_len(&mut out, 1, b"api");
    for _ in 0..descriptors {
        put_len(&mut out, 2, &descriptor);
    }
    out
}

/// A message of about `n` bytes of descriptors (far past the descriptor cap).
pub fn many_descriptors(n: usize) -> Vec<u8> {
    grpc_message(n / 16, 1)
}

/// One descriptor with entries past the entry cap.
pub fn many_entries(n: usize) -> Vec<u8> {
    grpc_message(1, n / 14)
}

/// Unknown fields, nested groups as deep as the input allows.
pub fn nested_groups(n: usize) -> Vec<u8> {
    let depth = n / 2;
    let mut out = Vec::with_capacity(2 * depth);
    out.extend(std::iter::repeat_n(9 << 3 | 3, depth)); // START_GROUP, field 9
    out.extend(std::iter::repeat_n(9 << 3 | 4, depth)); // END_GROUP
    out
}

/// Unknown fields, one after the other.
pub fn unknown_fields(n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    while out.len() < n {
        put_len(&mut out, 15, b"ignored");
        put_varint(&mut out, 16 << 3);
        put_varint(&mut out, u64::MAX);
    }
    out
}

/// One entry whose value is the whole input.
pub fn long_value(n: usize) -> Vec<u8> {
    let mut entry = Vec::new();
    put_len(&mut entry, 1, b"user");
    put_len(&mut entry, 2, &vec![b'a'; n]);
    let mut descriptor = Vec::new();
    put_len(&mut descriptor, 1, &entry);
    let mut out = Vec::new();
    put_len(&mut out, 2, &descriptor);
    out
}

/// A valid request of `k` descriptors (at most the cap) of four entries.
pub fn valid_request(k: usize) -> Vec<u8> {
    grpc_message(k.min(64), 4)
}

pub fn decode(bytes: &[u8]) {
    let _ = fuzzing::grpc_request(bytes);
}

// ---- /v1/check and /json bodies ----

fn repeat_to(n: usize, head: &str, item: &str, sep: &str, tail: &str) -> Vec<u8> {
    let mut out = String::from(head);
    let mut first = true;
    while out.len() < n {
        if !first {
            out.push_str(sep);
        }
        out.push_str(item);
        first = false;
    }
    out.push_str(tail);
    out.into_bytes()
}

pub fn check_many_descriptors(n: usize) -> Vec<u8> {
    repeat_to(
        n,
        r#"{"domain":"api","descriptors":["#,
        r#"{"u":"a"}"#,
        ",",
        "]}",
    )
}

pub fn check_many_entries(n: usize) -> Vec<u8> {
    repeat_to(
        n,
        r#"{"domain":"api","descriptors":[["#,
        r#"["u","a"]"#,
        ",",
        "]]}",
    )
}

pub fn json_many_descriptors(n: usize) -> Vec<u8> {
    repeat_to(
        n,
        r#"{"domain":"api","descriptors":["#,
        r#"{"entries":[{"key":"u","value":"a"}]}"#,
        ",",
        "]}",
    )
}

pub fn repeated_keys(n: usize) -> Vec<u8> {
    repeat_to(
        n,
        r#"{"domain":"api","descriptors":[{"#,
        r#""u":"a""#,
        ",",
        "}]}",
    )
}

pub fn unknown_json_fields(n: usize) -> Vec<u8> {
    repeat_to(
        n,
        r#"{"domain":"api","#,
        r#""x":{"y":[1,2,{"z":null}]}"#,
        ",",
        "}",
    )
}

pub fn deep_nesting(n: usize) -> Vec<u8> {
    let mut out = br#"{"domain":"api","descriptors":"#.to_vec();
    out.extend(std::iter::repeat_n(b'[', n));
    out.extend(std::iter::repeat_n(b']', n));
    out.push(b'}');
    out
}

pub fn long_string(n: usize) -> Vec<u8> {
    let mut out = br#"{"domain":""#.to_vec();
    out.extend(std::iter::repeat_n(b'a', n));
    out.extend_from_slice(br#"","descriptors":[]}"#);
    out
}

pub fn both_json(body: &[u8]) {
    let _ = fuzzing::v1_check(body);
    let _ = fuzzing::envoy_json(body);
}

// ---- the rule-file reader ----

pub fn rules(text: &[u8]) {
    let text = String::from_utf8_lossy(text);
    match tollgate::rules::from_str("amplification.yaml", &text) {
        Ok(set) => {
            for domain in set.domains() {
                let _ = domain.find(&[("key", "value")]);
            }
        }
        Err(errors) => {
            let _ = errors.to_string();
        }
    }
}

pub fn many_rules(n: usize) -> Vec<u8> {
    let mut out = String::from("domain: api\ndescriptors:\n");
    let mut i = 0;
    while out.len() < n {
        out.push_str(&format!(
            "  - key: k{i}\n    rate_limit: {{unit: second, requests_per_unit: 5}}\n"
        ));
        i += 1;
    }
    out.into_bytes()
}

pub fn deep_yaml(n: usize) -> Vec<u8> {
    let mut out = b"domain: api\ndescriptors: ".to_vec();
    out.extend(std::iter::repeat_n(b'[', n / 2));
    out.extend(std::iter::repeat_n(b']', n / 2));
    out.push(b'\n');
    out
}

/// Valid rule trees written in flow style, each nested 60 descriptors deep (within the
/// depth cap), side by side until the file is `n` bytes.
pub fn flow_trees(n: usize) -> Vec<u8> {
    let mut tree = String::from("{key: a, rate_limit: {unit: second, requests_per_unit: 1}}");
    for _ in 0..60 {
        tree = format!("{{key: a, descriptors: [{tree}]}}");
    }
    let mut out = String::from("domain: api\ndescriptors: [");
    let mut i = 0;
    while out.len() < n {
        out.push_str(&format!("{{key: k{i}, descriptors: [{tree}]}}, "));
        i += 1;
    }
    out.push_str("]\n");
    out.into_bytes()
}

/// "Billion laughs": each alias level doubles what an expanding reader would build.
pub fn yaml_aliases(n: usize) -> Vec<u8> {
    let mut out = String::from("a0: &a0 [x, x, x, x, x, x, x, x]\n");
    let mut i = 1;
    while out.len() < n {
        out.push_str(&format!(
            "a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n",
            p = i - 1
        ));
        i += 1;
    }
    out.push_str("domain: api\n");
    out.into_bytes()
}

pub fn many_errors(n: usize) -> Vec<u8> {
    // Every rule wrong: the error list grows with the file.
    let mut out = String::from("domain: api\ndescriptors:\n");
    while out.len() < n {
        out.push_str("  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: -1}\n");
    }
    out.into_bytes()
}

// ---- the client-address headers ----

pub fn client_ip(lines: &[u8]) {
    let mut headers = HeaderMap::new();
    let names = [
        HeaderName::from_static("x-forwarded-for"),
        HeaderName::from_static("forwarded"),
    ];
    for (i, line) in lines.split(|&b| b == b'\n').enumerate() {
        if let Ok(v) = HeaderValue::from_bytes(line) {
            headers.append(names[i % 2].clone(), v);
        }
    }
    let everyone: Vec<ipnet::IpNet> = vec![
        "0.0.0.0/0".parse().expect("a net"),
        "::/0".parse().expect("a net"),
    ];
    let peer = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
    for name in &names {
        let _ = tollgate::http::client_ip::client_ip(peer, &headers, name, &everyone);
    }
}

pub fn long_forwarded_for(n: usize) -> Vec<u8> {
    repeat_to(n, "", "192.0.2.1", ", ", "")
}

pub fn long_forwarded(n: usize) -> Vec<u8> {
    let mut out = b"\n".to_vec();
    out.extend(repeat_to(
        n,
        "",
        r#"for="[2001:db8::1]:80";proto=http"#,
        ", ",
        "",
    ));
    out
}

pub fn many_header_lines(n: usize) -> Vec<u8> {
    repeat_to(n, "", "192.0.2.1\nfor=192.0.2.2", "\n", "")
}
