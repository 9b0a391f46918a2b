use super::*;
use crate::client::{ClientConn, Reply};
use proptest::prelude::*;

const METHODS: &[&str] = &["/test.Echo/Call", "/test.Echo/Other"];

/// Moves bytes both ways until neither side has anything to say.
fn pump(client: &mut ClientConn, server: &mut ServerConn) -> (Vec<Call>, Vec<Reply>) {
    let (mut calls, mut replies) = (Vec::new(), Vec::new());
    for _ in 0..10 {
        let to_server = std::mem::take(client.output());
        let used = server
            .receive(&to_server, &mut calls)
            .expect("server accepts");
        assert_eq!(used, to_server.len());
        let to_client = std::mem::take(server.output());
        let used = client
            .receive(&to_client, &mut replies)
            .expect("client accepts");
        assert_eq!(used, to_client.len());
        if client.output().is_empty() && server.output().is_empty() {
            break;
        }
    }
    (calls, replies)
}

fn connected() -> (ClientConn, ServerConn) {
    let mut client = ClientConn::new("localhost:8081");
    let mut server = ServerConn::new(ServerSettings::default(), METHODS);
    let (calls, replies) = pump(&mut client, &mut server);
    assert!(calls.is_empty() && replies.is_empty());
    (client, server)
}

/// Every frame in `bytes` as (type, flags, stream, payload).
fn frames(mut bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
    let mut all = Vec::new();
    while let Some((f, used)) = frame::parse(bytes, 1 << 24).expect("parses") {
        all.push((f.kind, f.flags, f.stream, f.payload.to_vec()));
        bytes = &bytes[used..];
    }
    all
}

/// A raw client's start: preface and empty SETTINGS.
fn raw_start() -> Vec<u8> {
    let mut out = frame::PREFACE.to_vec();
    frame::put_settings(&mut out, &[]);
    out
}

fn request_block(method: &[u8], path: &[u8], content_type: &[u8]) -> Vec<u8> {
    let mut block = Vec::new();
    hpack::put_indexed_name(&mut block, 2, method);
    block.push(hpack::SCHEME_HTTP);
    hpack::put_indexed_name(&mut block, hpack::PATH, path);
    hpack::put_indexed_name(&mut block, hpack::CONTENT_TYPE, content_type);
    block
}

#[test]
fn calls_are_handed_out_and_answers_reach_the_client() {
    let (mut client, mut server) = connected();
    let first = client.request(METHODS[0], b"one").expect("can send");
    let second = client.request(METHODS[1], b"two").expect("can send");
    let (calls, _) = pump(&mut client, &mut server);
    assert_eq!(
        calls,
        vec![
            Call {
                stream: first,
                method: 0,
                message: b"one".to_vec(),
                timeout: None,
            },
            Call {
                stream: second,
                method: 1,
                message: b"two".to_vec(),
                timeout: None,
            },
        ]
    );
    assert_eq!(server.in_flight(), 2);
    // Answered out of order.
    server.respond(second, Ok(b"TWO"));
    server.respond(first, Err(&Status::new(Code::InvalidArgument, "bad: 100%")));
    let (_, replies) = pump(&mut client, &mut server);
    assert_eq!(replies.len(), 2);
    assert_eq!(replies[0].stream, second);
    assert_eq!(replies[0].message(), Some(&b"TWO"[..]));
    assert_eq!(replies[1].grpc_status, Some(Code::InvalidArgument as u32));
    assert_eq!(replies[1].grpc_message, "bad: 100%");
    assert_eq!(replies[1].http_status, 200);
    assert_eq!(server.in_flight(), 0);
    assert_eq!(client.in_flight(), 0);
}

#[test]
fn a_hundred_calls_in_one_read_come_out_of_one_receive() {
    let (mut client, mut server) = connected();
    for i in 0..100u32 {
        client
            .request(METHODS[0], &i.to_be_bytes())
            .expect("can send");
    }
    let bytes = std::mem::take(client.output());
    let mut calls = Vec::new();
    assert_eq!(server.receive(&bytes, &mut calls), Ok(bytes.len()));
    assert_eq!(calls.len(), 100);
    for call in calls.iter().rev() {
        server.respond(call.stream, Ok(&call.message));
    }
    let (_, replies) = pump(&mut client, &mut server);
    assert_eq!(replies.len(), 100);
    for r in &replies {
        let n = u32::from_be_bytes(r.message().expect("ok").try_into().expect("4 bytes"));
        assert_eq!(r.stream, 2 * n + 1);
    }
}

#[test]
fn input_split_anywhere_gives_the_same_calls() {
    let (mut client, _) = connected();
    for i in 0..5u8 {
        client.request(METHODS[0], &[i; 40]).expect("can send");
    }
    let bytes = std::mem::take(client.output());
    for split in 1..bytes.len() {
        let mut server = ServerConn::new(ServerSettings::default(), METHODS);
        let mut start = raw_start();
        start.extend_from_slice(&bytes);
        let bytes = start;
        let mut calls = Vec::new();
        let mut buf = bytes[..split.min(bytes.len())].to_vec();
        let used = server.receive(&buf, &mut calls).expect("accepts");
        buf.drain(..used);
        buf.extend_from_slice(&bytes[split.min(bytes.len())..]);
        let used = server.receive(&buf, &mut calls).expect("accepts");
        assert_eq!(used, buf.len());
        assert_eq!(calls.len(), 5, "split at {split}");
        assert_eq!(calls[4].message, vec![4; 40]);
    }
}

#[test]
fn a_calls_grpc_timeout_comes_with_it_and_a_malformed_one_is_an_invalid_argument() {
    let mut server = ServerConn::new(ServerSettings::default(), METHODS);
    let mut input = raw_start();
    let mut body = Vec::new();
    grpc::put_message(&mut body, b"one");
    for (stream, timeout) in [(1, &b"20m"[..]), (3, b"20x"), (5, b"")] {
        let mut block = request_block(b"POST", METHODS[0].as_bytes(), b"application/grpc");
        if !timeout.is_empty() {
            hpack::put_literal(&mut block, b"grpc-timeout", timeout);
        }
        frame::put_headers(&mut input, stream, &block, 16_384, false);
        frame::put_data(&mut input, stream, &body, 16_384, true);
    }
    let mut calls = Vec::new();
    server.receive(&input, &mut calls).expect("accepts");
    let streams: Vec<(u32, Option<Duration>)> =
        calls.iter().map(|c| (c.stream, c.timeout)).collect();
    assert_eq!(
        streams,
        vec![(1, Some(Duration::from_millis(20))), (5, None)],
        "the call with a malformed timeout is answered, not handed out"
    );
    let out = frames(server.output());
    let headers = out
        .iter()
        .find(|f| f.0 == kind::HEADERS && f.2 == 3)
        .expect("stream 3 is answered");
    let mut fields = Vec::new();
    hpack::Decoder::new(4096)
        .decode(&headers.3, |n, v| fields.push((n.to_vec(), v.to_vec())))
        .expect("decodes");
    let field = |name: &[u8]| {
        fields
            .iter()
            .find(|f| f.0 == name)
            .map(|f| String::from_utf8_lossy(&f.1).into_owned())
    };
    assert_eq!(
        field(b"grpc-status"),
        Some((Code::InvalidArgument as u32).to_string())
    );
    assert!(
        field(b"grpc-message").is_some_and(|m| m.contains("grpc-timeout") && m.contains("20x")),
        "{fields:?}"
    );
}

#[test]
fn an_unknown_method_is_unimplemented_and_names_the_path() {
    let (mut client, mut server) = connected();
    client.request("/no.Such/Method", b"x").expect("can send");
    let (calls, replies) = pump(&mut client, &mut server);
    assert!(calls.is_empty());
    assert_eq!(replies[0].grpc_status, Some(Code::Unimplemented as u32));
    assert_eq!(replies[0].grpc_message, "unknown method /no.Such/Method");
}

#[test]
fn requests_that_are_not_grpc_get_http_statuses() {
    for (method, content_type, status) in [
        (&b"GET"[..], &b"application/grpc"[..], "405"),
        (b"POST", b"application/json", "415"),
    ] {
        let mut server = ServerConn::new(ServerSettings::default(), METHODS);
        let mut input = raw_start();
        let block = request_block(method, METHODS[0].as_bytes(), content_type);
        frame::put_headers(&mut input, 1, &block, 16_384, true);
        let mut calls = Vec::new();
        server.receive(&input, &mut calls).expect("accepts");
        assert!(calls.is_empty());
        let out = frames(server.output());
        let headers = out
            .iter()
            .find(|f| f.0 == kind::HEADERS)
            .expect("a response");
        assert_eq!(headers.1 & flag::END_STREAM, flag::END_STREAM);
        let mut fields = Vec::new();
        hpack::Decoder::new(4096)
            .decode(&headers.3, |n, v| fields.push((n.to_vec(), v.to_vec())))
            .expect("decodes");
        assert_eq!(fields[0], (b":status".to_vec(), status.as_bytes().to_vec()));
    }
}

#[test]
fn a_plain_http1_client_is_told_what_the_port_speaks() {
    let mut server = ServerConn::new(ServerSettings::default(), METHODS);
    let err = server
        .receive(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", &mut Vec::new())
        .expect_err("not HTTP/2");
    assert_eq!(err.code, ErrorCode::Protocol);
    let text = String::from_utf8_lossy(server.output()).into_owned();
    assert!(text.starts_with("HTTP/1.1 400"), "{text}");
    let length: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .and_then(|v| v.trim().parse().ok())
        .expect("a length");
    assert_eq!(text.split("\r\n\r\n").nth(1).map(str::len), Some(length));
}

#[test]
fn protocol_errors_end_the_connection_with_a_goaway() {
    let goaway_code = |input: &[u8]| {
        let mut server = ServerConn::new(ServerSettings::default(), METHODS);
        let err = server
            .receive(input, &mut Vec::new())
            .expect_err("an error");
        let out = frames(server.output());
        let goaway = out.iter().find(|f| f.0 == kind::GOAWAY).expect("a GOAWAY");
        assert_eq!(
            u32::from_be_bytes(goaway.3[4..8].try_into().expect("code")),
            err.code as u32
        );
        err.code
    };
    // The first frame is not SETTINGS.
    let mut input = frame::PREFACE.to_vec();
    frame::put_ping_ack(&mut input, &[0; 8]);
    assert_eq!(goaway_code(&input), ErrorCode::Protocol);
    // A frame longer than the announced maximum.
    let mut input = raw_start();
    frame::put_header(&mut input, 20_000, kind::DATA, 0, 1);
    assert_eq!(goaway_code(&input), ErrorCode::FrameSize);
    // HEADERS on an even (server) stream.
    let mut input = raw_start();
    frame::put_headers(
        &mut input,
        2,
        &request_block(b"POST", b"/x", b"application/grpc"),
        16_384,
        true,
    );
    assert_eq!(goaway_code(&input), ErrorCode::Protocol);
    // A header block that is not HPACK.
    let mut input = raw_start();
    frame::put_headers(
        &mut input,
        1,
        &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
        16_384,
        true,
    );
    assert_eq!(goaway_code(&input), ErrorCode::Compression);
    // DATA on a stream never opened.
    let mut input = raw_start();
    frame::put_data(&mut input, 7, b"x", 16_384, true);
    assert_eq!(goaway_code(&input), ErrorCode::Protocol);
    // A window pushed past 2^31 - 1.
    let mut input = raw_start();
    frame::put_window_update(&mut input, 0, 0x7fff_ffff);
    assert_eq!(goaway_code(&input), ErrorCode::FlowControl);
    // HEADERS interrupted by another frame before END_HEADERS.
    let mut input = raw_start();
    frame::put_header(&mut input, 1, kind::HEADERS, 0, 1);
    input.push(0x83);
    frame::put_ping_ack(&mut input, &[0; 8]);
    assert_eq!(goaway_code(&input), ErrorCode::Protocol);
}

#[test]
fn settings_and_pings_are_acknowledged() {
    let mut server = ServerConn::new(ServerSettings::default(), METHODS);
    let start = frames(&std::mem::take(server.output()));
    assert_eq!(start[0].0, kind::SETTINGS);
    let mut input = raw_start();
    input.extend_from_slice(&[0, 0, 8, kind::PING, 0, 0, 0, 0, 0]);
    input.extend_from_slice(b"12345678");
    server.receive(&input, &mut Vec::new()).expect("accepts");
    let out = frames(server.output());
    assert_eq!(out[0], (kind::SETTINGS, flag::ACK, 0, vec![]));
    assert_eq!(out[1], (kind::PING, flag::ACK, 0, b"12345678".to_vec()));
}

#[test]
fn a_response_waits_for_window_and_finishes_when_it_opens() {
    let mut server = ServerConn::new(ServerSettings::default(), METHODS);
    let mut input = raw_start();
    let block = request_block(b"POST", METHODS[0].as_bytes(), b"application/grpc");
    frame::put_headers(&mut input, 1, &block, 16_384, false);
    let mut body = Vec::new();
    grpc::put_message(&mut body, b"q");
    frame::put_data(&mut input, 1, &body, 16_384, true);
    let mut calls = Vec::new();
    server.receive(&input, &mut calls).expect("accepts");
    server.output().clear();
    let big = vec![9u8; 100_000];
    server.respond(1, Ok(&big));
    let sent: usize = frames(&std::mem::take(server.output()))
        .iter()
        .filter(|f| f.0 == kind::DATA)
        .map(|f| f.3.len())
        .sum();
    assert_eq!(sent, 65_535, "no more than the initial window");
    assert_eq!(server.in_flight(), 1);
    let mut more = Vec::new();
    frame::put_window_update(&mut more, 0, 50_000);
    server.receive(&more, &mut calls).expect("accepts");
    assert!(
        server.output().is_empty(),
        "the stream's window is still closed"
    );
    let mut more = Vec::new();
    frame::put_window_update(&mut more, 1, 50_000);
    server.receive(&more, &mut calls).expect("accepts");
    let out = frames(&std::mem::take(server.output()));
    let rest: usize = out
        .iter()
        .filter(|f| f.0 == kind::DATA)
        .map(|f| f.3.len())
        .sum();
    assert_eq!(sent + rest, 100_000 + grpc::PREFIX_LEN);
    let last = out.last().expect("trailers");
    assert_eq!(
        (last.0, last.1 & flag::END_STREAM),
        (kind::HEADERS, flag::END_STREAM)
    );
    assert_eq!(server.in_flight(), 0);
}

#[test]
fn streams_beyond_the_limit_are_refused() {
    let settings = ServerSettings {
        max_concurrent_streams: 2,
        ..ServerSettings::default()
    };
    let mut server = ServerConn::new(settings, METHODS);
    let mut client = ClientConn::new("x");
    let mut calls = Vec::new();
    server
        .receive(&std::mem::take(client.output()), &mut calls)
        .expect("accepts");
    client
        .receive(&std::mem::take(server.output()), &mut Vec::new())
        .expect("accepts");
    // The client honours the limit; a raw client does not.
    let mut input = Vec::new();
    for stream in [1, 3, 5] {
        let block = request_block(b"POST", METHODS[0].as_bytes(), b"application/grpc");
        frame::put_headers(&mut input, stream, &block, 16_384, false);
    }
    server.receive(&input, &mut calls).expect("accepts");
    let out = frames(server.output());
    assert_eq!(
        out.iter()
            .filter(|f| f.0 == kind::RST_STREAM)
            .map(|f| (f.2, f.3.clone()))
            .collect::<Vec<_>>(),
        vec![(5, (ErrorCode::RefusedStream as u32).to_be_bytes().to_vec())]
    );
    assert_eq!(server.in_flight(), 2);
}

#[test]
fn an_oversized_message_is_resource_exhausted() {
    let settings = ServerSettings {
        max_message: 10,
        ..ServerSettings::default()
    };
    let mut server = ServerConn::new(settings, METHODS);
    let mut client = ClientConn::new("x");
    let mut replies = Vec::new();
    for _ in 0..3 {
        let mut calls = Vec::new();
        server
            .receive(&std::mem::take(client.output()), &mut calls)
            .expect("accepts");
        assert!(calls.is_empty());
        client
            .receive(&std::mem::take(server.output()), &mut replies)
            .expect("accepts");
        if client.in_flight() == 0 && replies.is_empty() {
            client.request(METHODS[0], &[1; 11]).expect("can send");
        }
    }
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].grpc_status, Some(Code::ResourceExhausted as u32));
}

#[test]
fn a_call_reset_by_the_client_is_not_answered() {
    let (mut client, mut server) = connected();
    let stream = client.request(METHODS[0], b"x").expect("can send");
    let (calls, _) = pump(&mut client, &mut server);
    assert_eq!(calls.len(), 1);
    let mut rst = Vec::new();
    frame::put_rst_stream(&mut rst, stream, ErrorCode::Cancel);
    server.receive(&rst, &mut Vec::new()).expect("accepts");
    server.respond(stream, Ok(b"late"));
    assert!(server.output().is_empty());
    assert_eq!(server.in_flight(), 0);
}

#[test]
fn shutdown_answers_what_it_has_and_refuses_the_rest() {
    let (mut client, mut server) = connected();
    let first = client.request(METHODS[0], b"a").expect("can send");
    let (calls, _) = pump(&mut client, &mut server);
    assert_eq!(calls.len(), 1);
    server.shutdown();
    assert!(!server.is_done());
    let out = frames(server.output());
    assert_eq!(out[0].0, kind::GOAWAY);
    assert_eq!(&out[0].3[..4], &first.to_be_bytes());
    // A stream the client opened before it read the GOAWAY.
    let block = request_block(b"POST", METHODS[0].as_bytes(), b"application/grpc");
    let mut late = Vec::new();
    frame::put_headers(&mut late, first + 2, &block, 16_384, true);
    server.output().clear();
    server.receive(&late, &mut Vec::new()).expect("accepts");
    let out = frames(&std::mem::take(server.output()));
    assert_eq!(out[0].0, kind::RST_STREAM);
    server.respond(first, Ok(b"done"));
    assert!(server.is_done());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Whatever follows the preface, the server neither panics nor holds more than its
    /// limits allow.
    #[test]
    fn arbitrary_input_never_panics(chunks in proptest::collection::vec(
        proptest::collection::vec(any::<u8>(), 0..64), 0..16)
    ) {
        let settings = ServerSettings {
            max_concurrent_streams: 4,
            max_message: 64,
            max_header_block: 256,
            max_buffered: 128,
            ..ServerSettings::default()
        };
        let mut server = ServerConn::new(settings, METHODS);
        let mut buf = raw_start();
        let mut calls = Vec::new();
        for chunk in chunks {
            buf.extend_from_slice(&chunk);
            match server.receive(&buf, &mut calls) {
                Ok(used) => { buf.drain(..used); }
                Err(_) => break,
            }
            prop_assert!(server.in_flight() <= 4);
            prop_assert!(server.buffered <= 128);
            for call in calls.drain(..) {
                server.respond(call.stream, Ok(&call.message));
            }
        }
    }

    /// Frames with valid headers and random payloads and flags, to reach deeper.
    #[test]
    fn arbitrary_frames_never_panic(frames in proptest::collection::vec(
        (0u8..10, any::<u8>(), 0u32..8, proptest::collection::vec(any::<u8>(), 0..40)), 0..24)
    ) {
        let mut server = ServerConn::new(ServerSettings::default(), METHODS);
        let mut input = raw_start();
        for (kind, flags, stream, payload) in frames {
            frame::put_header(&mut input, payload.len(), kind, flags, stream);
            input.extend_from_slice(&payload);
        }
        let mut calls = Vec::new();
        if server.receive(&input, &mut calls).is_ok() {
            for call in calls {
                server.respond(call.stream, Err(&Status::new(Code::Internal, "x")));
            }
        }
    }
}

// ---- Hardening (issue 22): each test below failed before its fix. ----

/// A request's header block for `stream`'s POST to `path` with gRPC's content type,
/// then `extra` fields (literal, not indexed).
fn grpc_block(path: &[u8], extra: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut block = request_block(b"POST", path, b"application/grpc");
    for (name, value) in extra {
        hpack::put_literal(&mut block, name, value);
    }
    block
}

/// One unary request (HEADERS, then DATA with END_STREAM) on `stream`.
fn put_call(out: &mut Vec<u8>, stream: u32, block: &[u8], message: &[u8]) {
    frame::put_headers(out, stream, block, 16_384, false);
    let mut body = Vec::new();
    grpc::put_message(&mut body, message);
    frame::put_data(out, stream, &body, 16_384, true);
}

/// The code of the GOAWAY in `out`, if there is one.
fn goaway(out: &[u8]) -> Option<u32> {
    frames(out)
        .iter()
        .find(|f| f.0 == kind::GOAWAY)
        .map(|f| u32::from_be_bytes(f.3[4..8].try_into().expect("code")))
}

/// The RST_STREAM codes in `out`, by stream.
fn resets(out: &[u8]) -> Vec<(u32, u32)> {
    frames(out)
        .iter()
        .filter(|f| f.0 == kind::RST_STREAM)
        .map(|f| (f.2, u32::from_be_bytes(f.3[..4].try_into().expect("code"))))
        .collect()
}

/// The fields of the first HEADERS frame on `stream` in `out`.
fn response_fields(out: &[u8], stream: u32) -> Vec<(String, String)> {
    let all = frames(out);
    let headers = all
        .iter()
        .find(|f| f.0 == kind::HEADERS && f.2 == stream)
        .expect("a response on the stream");
    let mut fields = Vec::new();
    hpack::Decoder::new(4096)
        .decode(&headers.3, |n, v| {
            fields.push((
                String::from_utf8_lossy(n).into_owned(),
                String::from_utf8_lossy(v).into_owned(),
            ))
        })
        .expect("decodes");
    fields
}

fn field<'a>(fields: &'a [(String, String)], name: &str) -> Option<&'a str> {
    fields.iter().find(|f| f.0 == name).map(|(_, v)| v.as_str())
}

#[test]
fn a_header_list_past_the_advertised_size_is_refused_without_decoding_it_whole() {
    // One 4 KB `:path` indexed, then referenced thousands of times: 64 KB encoded,
    // hundreds of MB decoded.
    let mut server = ServerConn::new(ServerSettings::default(), METHODS);
    let start = frames(&std::mem::take(server.output()));
    let advertised = start[0]
        .3
        .chunks_exact(6)
        .find(|e| u16::from_be_bytes([e[0], e[1]]) == setting::MAX_HEADER_LIST_SIZE)
        .map(|e| u32::from_be_bytes([e[2], e[3], e[4], e[5]]) as usize)
        .expect("SETTINGS_MAX_HEADER_LIST_SIZE is advertised");
    let mut input = raw_start();
    // Within the advertised size, but with a long unknown path: answered, and the path
    // in the message is cut short.
    let mut block = request_block(b"POST", b"/", b"application/grpc");
    block.clear();
    block.push(hpack::METHOD_POST);
    block.push(hpack::SCHEME_HTTP);
    let long_path = [b"/".as_slice(), &[b'a'; 4000]].concat();
    hpack::put_indexed_name_indexing(&mut block, hpack::PATH, &long_path);
    hpack::put_indexed_name(&mut block, hpack::CONTENT_TYPE, b"application/grpc");
    frame::put_headers(&mut input, 1, &block, 16_384, true);
    // Past it: the same path (dynamic entry 62) referenced again and again.
    let mut big = vec![hpack::METHOD_POST, hpack::SCHEME_HTTP];
    hpack::put_indexed_name(&mut big, hpack::CONTENT_TYPE, b"application/grpc");
    let refs = (advertised / 4032).max(1) + 1;
    big.extend(std::iter::repeat_n(0xbe, refs));
    frame::put_headers(&mut input, 3, &big, 16_384, true);
    // Then a normal call: the dynamic table is still in step.
    put_call(
        &mut input,
        5,
        &grpc_block(METHODS[0].as_bytes(), &[]),
        b"ok",
    );
    let mut calls = Vec::new();
    server
        .receive(&input, &mut calls)
        .expect("not a connection error");
    let out = std::mem::take(server.output());
    let first = response_fields(&out, 1);
    assert_eq!(field(&first, "grpc-status"), Some("12"));
    let message = field(&first, "grpc-message").expect("a message");
    assert!(message.len() < 300, "{} bytes", message.len());
    let second = response_fields(&out, 3);
    assert_eq!(field(&second, ":status"), Some("431"), "{second:?}");
    assert_eq!(
        calls.iter().map(|c| c.stream).collect::<Vec<_>>(),
        vec![5],
        "only the normal call is handed out"
    );

    // Thousands of references (far past the limit) end the connection, as h2 does,
    // before they are all decoded.
    let mut server = ServerConn::new(ServerSettings::default(), METHODS);
    let mut input = raw_start();
    frame::put_headers(&mut input, 1, &block, 16_384, true);
    let mut huge = vec![hpack::METHOD_POST, hpack::SCHEME_HTTP];
    huge.extend(std::iter::repeat_n(0xbe, 60_000));
    frame::put_header(&mut input, 16_384, kind::HEADERS, 0, 3);
    input.extend_from_slice(&huge[..16_384]);
    for chunk in huge[16_384..].chunks(16_384) {
        let last = chunk.as_ptr_range().end == huge.as_ptr_range().end;
        let flags = if last { flag::END_HEADERS } else { 0 };
        frame::put_header(&mut input, chunk.len(), kind::CONTINUATION, flags, 3);
        input.extend_from_slice(chunk);
    }
    let err = server
        .receive(&input, &mut Vec::new())
        .expect_err("a connection error");
    assert_eq!(err.code, ErrorCode::EnhanceYourCalm);
}

#[test]
fn a_malformed_grpc_timeout_is_named_but_not_copied_whole() {
    let e = grpc::parse_timeout(&[b'9'; 4096]).expect_err("malformed");
    assert!(e.len() < 200, "{} bytes", e.len());
    assert!(e.contains("grpc-timeout"), "{e}");
}

#[test]
fn a_settings_frame_applies_the_last_value_of_each_setting() {
    // Stream 1's window is 100 above the initial one; a frame that sets the largest
    // initial window, then the default, leaves the windows as they were (only the
    // last value counts), where applying each in turn overflowed the stream's window.
    let mut server = ServerConn::new(ServerSettings::default(), METHODS);
    let mut input = raw_start();
    let block = grpc_block(METHODS[0].as_bytes(), &[]);
    frame::put_headers(&mut input, 1, &block, 16_384, false);
    frame::put_window_update(&mut input, 1, 100);
    frame::put_settings(
        &mut input,
        &[
            (setting::INITIAL_WINDOW_SIZE, 0x7fff_ffff),
            (setting::INITIAL_WINDOW_SIZE, 65_535),
        ],
    );
    server
        .receive(&input, &mut Vec::new())
        .expect("no flow-control error");
    assert_eq!(goaway(server.output()), None);
}

/// The fastest of three runs of `f`.
fn fastest(mut f: impl FnMut()) -> Duration {
    (0..3)
        .map(|_| {
            let t = std::time::Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .unwrap_or_default()
}

/// A server with `open` streams whose answers wait for window (the peer's initial window
/// is 0), the bytes that set it up consumed.
fn blocked_server(open: u32) -> ServerConn {
    let mut server = ServerConn::new(ServerSettings::default(), METHODS);
    let mut input = raw_start();
    frame::put_settings(&mut input, &[(setting::INITIAL_WINDOW_SIZE, 0)]);
    let block = grpc_block(METHODS[0].as_bytes(), &[]);
    for i in 0..open {
        put_call(&mut input, 2 * i + 1, &block, b"q");
    }
    let mut calls = Vec::new();
    server.receive(&input, &mut calls).expect("accepts");
    for call in &calls {
        server.respond(call.stream, Ok(b"answer"));
    }
    server.output().clear();
    server
}

#[test]
fn settings_and_window_updates_cost_the_same_with_many_streams_open() {
    // A 16 KB SETTINGS frame of INITIAL_WINDOW_SIZE entries, and a burst of connection
    // WINDOW_UPDATEs, with 1 stream open and with 1,000: each took time in proportion to
    // the streams open (every entry walked every stream twice, every update walked every
    // blocked answer: hundreds of times longer with 1,000). Now the work left with 1,000
    // is what the last value asks for (1,000 answers queued, a byte of each sent).
    let mut settings = Vec::new();
    let entries: Vec<(u16, u32)> = (0..2_730u32)
        .map(|i| (setting::INITIAL_WINDOW_SIZE, i % 2))
        .collect();
    frame::put_settings(&mut settings, &entries);
    let mut updates = Vec::new();
    for _ in 0..1_000 {
        frame::put_window_update(&mut updates, 0, 1);
    }
    let cost = |open: u32, input: &[u8]| {
        let mut servers: Vec<ServerConn> = (0..3).map(|_| blocked_server(open)).collect();
        fastest(|| {
            let mut server = servers.pop().expect("one per run");
            server.receive(input, &mut Vec::new()).expect("accepts");
        })
    };
    for (what, input) in [("WINDOW_UPDATE", &updates), ("SETTINGS", &settings)] {
        let few = cost(1, input);
        let many = cost(1_000, input);
        assert!(
            many < few * 20 + Duration::from_millis(5),
            "{what}: {many:?} with 1,000 streams open, {few:?} with 1"
        );
    }
}

#[test]
fn floods_of_cheap_frames_end_the_connection_with_enhance_your_calm() {
    let block = grpc_block(METHODS[0].as_bytes(), &[]);
    let floods: Vec<(&str, Vec<u8>)> = vec![
        ("SETTINGS", {
            let mut v = Vec::new();
            for _ in 0..5_000 {
                frame::put_settings(&mut v, &[]);
            }
            v
        }),
        ("PING", {
            let mut v = Vec::new();
            for _ in 0..5_000 {
                frame::put_header(&mut v, 8, kind::PING, 0, 0);
                v.extend_from_slice(&[0; 8]);
            }
            v
        }),
        ("empty DATA", {
            let mut v = Vec::new();
            frame::put_headers(&mut v, 1, &block, 16_384, false);
            for _ in 0..5_000 {
                frame::put_data(&mut v, 1, &[], 16_384, false);
            }
            v
        }),
        ("CONTINUATION", {
            let mut v = Vec::new();
            frame::put_header(&mut v, block.len(), kind::HEADERS, 0, 1);
            v.extend_from_slice(&block);
            for _ in 0..5_000 {
                frame::put_header(&mut v, 0, kind::CONTINUATION, 0, 1);
            }
            v
        }),
    ];
    for (what, flood) in floods {
        let mut server = ServerConn::new(ServerSettings::default(), METHODS);
        let mut input = raw_start();
        input.extend_from_slice(&flood);
        let err = server.receive(&input, &mut Vec::new()).expect_err(what);
        assert_eq!(err.code, ErrorCode::EnhanceYourCalm, "{what}");
        assert_eq!(
            goaway(server.output()),
            Some(ErrorCode::EnhanceYourCalm as u32),
            "{what}"
        );
    }
}

#[test]
fn a_lowered_header_table_size_is_acknowledged_in_the_next_header_block() {
    // RFC 7541 §4.2: a client that lowers SETTINGS_HEADER_TABLE_SIZE (nghttp
    // --header-table-size=0) expects a dynamic table size update at the start of the
    // next header block, and fails the connection (COMPRESSION_ERROR) without it.
    let mut server = ServerConn::new(ServerSettings::default(), METHODS);
    let mut input = frame::PREFACE.to_vec();
    frame::put_settings(&mut input, &[(setting::HEADER_TABLE_SIZE, 0)]);
    let block = grpc_block(METHODS[0].as_bytes(), &[]);
    put_call(&mut input, 1, &block, b"a");
    put_call(&mut input, 3, &block, b"b");
    let mut calls = Vec::new();
    server.receive(&input, &mut calls).expect("accepts");
    server.output().clear();
    server.respond(1, Ok(b"A"));
    server.respond(3, Err(&Status::new(Code::Internal, "x")));
    let blocks: Vec<Vec<u8>> = frames(server.output())
        .into_iter()
        .filter(|f| f.0 == kind::HEADERS)
        .map(|f| f.3)
        .collect();
    assert_eq!(
        blocks.len(),
        3,
        "headers and trailers of 1, trailers-only 3"
    );
    assert_eq!(blocks[0][0], 0x20, "a size update to 0 first");
    assert!(blocks[1..].iter().all(|b| b[0] & 0xe0 != 0x20), "once");
    // And the blocks decode with a table of size 0.
    let mut decoder = hpack::Decoder::new(0);
    for b in &blocks {
        decoder.decode(b, |_, _| {}).expect("decodes");
    }
}

#[test]
fn calls_reset_in_the_same_read_are_dropped_and_a_reset_flood_ends_the_connection() {
    let block = grpc_block(METHODS[0].as_bytes(), &[]);
    let rapid = |n: u32| {
        let mut input = raw_start();
        for i in 0..n {
            put_call(&mut input, 2 * i + 1, &block, b"q");
            frame::put_rst_stream(&mut input, 2 * i + 1, ErrorCode::Cancel);
        }
        input
    };
    let mut server = ServerConn::new(ServerSettings::default(), METHODS);
    let mut calls = Vec::new();
    server.receive(&rapid(10), &mut calls).expect("accepts");
    assert!(
        calls.is_empty(),
        "reset before they were handed out: {calls:?}"
    );
    assert_eq!(server.in_flight(), 0);
    // CVE-2023-44487: thousands of them.
    let mut server = ServerConn::new(ServerSettings::default(), METHODS);
    let mut calls = Vec::new();
    let err = server
        .receive(&rapid(5_000), &mut calls)
        .expect_err("a connection error");
    assert_eq!(err.code, ErrorCode::EnhanceYourCalm);
    assert!(calls.is_empty(), "{} calls handed out", calls.len());
}

#[test]
fn calls_reset_after_hand_off_keep_their_place_until_answered() {
    // Calls handed out and not answered (waiting for Redis, say), then reset by the
    // client in a later read: each still holds its place among the concurrent streams,
    // so more calls than the limit are never in flight, whatever the client resets.
    const LIMIT: u32 = 4;
    let settings = ServerSettings {
        max_concurrent_streams: LIMIT,
        ..ServerSettings::default()
    };
    let block = grpc_block(METHODS[0].as_bytes(), &[]);
    let mut server = ServerConn::new(settings, METHODS);
    let mut next = 1;
    let mut in_flight: Vec<Call> = Vec::new();
    let mut input = raw_start();
    for round in 0..5 {
        // LIMIT new calls, after resetting every stream opened so far (the calls of the
        // last round by RST_STREAM, half of them by a DATA frame after END_STREAM,
        // which the server resets itself).
        for i in (1..next).step_by(2) {
            if i % 4 == 1 {
                frame::put_data(&mut input, i, b"x", 16_384, true);
            } else {
                frame::put_rst_stream(&mut input, i, ErrorCode::Cancel);
            }
        }
        let first = next;
        for _ in 0..LIMIT {
            put_call(&mut input, next, &block, b"q");
            next += 2;
        }
        let mut calls = Vec::new();
        server
            .receive(&std::mem::take(&mut input), &mut calls)
            .expect("accepts");
        let out = std::mem::take(server.output());
        if round == 0 {
            assert_eq!(calls.len(), LIMIT as usize);
        } else {
            assert!(
                calls.is_empty(),
                "round {round}: {} more calls",
                calls.len()
            );
            let refused: Vec<u32> = resets(&out)
                .into_iter()
                .filter(|&(_, code)| code == ErrorCode::RefusedStream as u32)
                .map(|(stream, _)| stream)
                .collect();
            assert_eq!(refused, (first..next).step_by(2).collect::<Vec<_>>());
        }
        in_flight.extend(calls);
        assert_eq!(server.in_flight(), LIMIT as usize);
    }
    assert_eq!(in_flight.len(), LIMIT as usize);
    // Answered, the reset calls' answers are dropped and their places freed.
    for call in &in_flight {
        server.respond(call.stream, Ok(b"late"));
    }
    assert!(
        frames(server.output()).iter().all(|f| f.0 != kind::HEADERS),
        "an answer on a reset stream"
    );
    assert_eq!(server.in_flight(), 0);
    let mut input = Vec::new();
    put_call(&mut input, next, &block, b"q");
    let mut calls = Vec::new();
    server.receive(&input, &mut calls).expect("accepts");
    assert_eq!(calls.len(), 1, "a new call once the others are answered");
    // A reset after hand-off is not premature (Envoy resets calls on its timeout):
    // these did not end the connection, and a call answered normally still is.
    server.respond(next, Ok(b"a"));
    assert!(frames(server.output())
        .iter()
        .any(|f| f.0 == kind::HEADERS && f.2 == next));
    assert_eq!(server.in_flight(), 0);
}

#[test]
fn headers_on_a_lower_stream_never_opened_are_a_connection_error() {
    let mut server = ServerConn::new(ServerSettings::default(), METHODS);
    let mut input = raw_start();
    let block = grpc_block(METHODS[0].as_bytes(), &[]);
    put_call(&mut input, 5, &block, b"q");
    put_call(&mut input, 3, &block, b"q");
    let err = server
        .receive(&input, &mut Vec::new())
        .expect_err("a connection error");
    assert_eq!(err.code, ErrorCode::Protocol);
}

#[test]
fn malformed_requests_are_reset_with_protocol_error() {
    let path = METHODS[0].as_bytes();
    let post = |extra: &[(&[u8], &[u8])]| grpc_block(path, extra);
    let cases: Vec<(&str, Vec<u8>, usize)> = vec![
        ("uppercase name", post(&[(b"X-Custom", b"1")]), 1),
        ("name with a space", post(&[(b"x custom", b"1")]), 1),
        ("value with a line feed", post(&[(b"x-custom", b"a\nb")]), 1),
        (
            "pseudo after regular",
            {
                let mut b = vec![hpack::METHOD_POST, hpack::SCHEME_HTTP];
                hpack::put_indexed_name(&mut b, hpack::CONTENT_TYPE, b"application/grpc");
                hpack::put_indexed_name(&mut b, hpack::PATH, path);
                b
            },
            1,
        ),
        ("connection", post(&[(b"connection", b"close")]), 1),
        ("keep-alive", post(&[(b"keep-alive", b"5")]), 1),
        ("proxy-connection", post(&[(b"proxy-connection", b"x")]), 1),
        (
            "transfer-encoding",
            post(&[(b"transfer-encoding", b"chunked")]),
            1,
        ),
        ("upgrade", post(&[(b"upgrade", b"h2c")]), 1),
        ("te: gzip", post(&[(b"te", b"gzip")]), 1),
        (
            "duplicate :path",
            {
                let mut b = post(&[]);
                hpack::put_indexed_name(&mut b, hpack::PATH, path);
                b
            },
            1,
        ),
        (
            "duplicate :method",
            {
                let mut b = vec![hpack::METHOD_POST];
                b.extend_from_slice(&post(&[]));
                b
            },
            1,
        ),
        (
            "unknown pseudo-header",
            {
                let mut b = vec![hpack::METHOD_POST, hpack::SCHEME_HTTP];
                hpack::put_literal(&mut b, b":protocol", b"websocket");
                hpack::put_indexed_name(&mut b, hpack::PATH, path);
                b
            },
            1,
        ),
        (
            "no :scheme",
            {
                let mut b = vec![hpack::METHOD_POST];
                hpack::put_indexed_name(&mut b, hpack::PATH, path);
                hpack::put_indexed_name(&mut b, hpack::CONTENT_TYPE, b"application/grpc");
                b
            },
            1,
        ),
        (
            "content-length larger than the body",
            post(&[(b"content-length", b"100")]),
            1,
        ),
        (
            "content-length smaller than the body",
            post(&[(b"content-length", b"2")]),
            1,
        ),
        (
            "content-length not a number",
            post(&[(b"content-length", b"1e3")]),
            1,
        ),
        (
            // Found by fuzzing (h2_server): the digits overflowed a u64 while they were
            // read, a panic in a debug build and a wrong length in a release build.
            "content-length too large for a number",
            post(&[(b"content-length", b"99999999999999999999999999")]),
            1,
        ),
        (
            "content-length of 20 digits",
            post(&[(b"content-length", b"18446744073709551616")]),
            1,
        ),
    ];
    for (what, block, stream) in cases {
        let mut server = ServerConn::new(ServerSettings::default(), METHODS);
        let mut input = raw_start();
        put_call(&mut input, stream as u32, &block, b"four");
        // And a good call after it: only the stream failed.
        put_call(
            &mut input,
            3,
            &post(&[(b"te", b"trailers"), (b"content-length", b"9")]),
            b"four",
        );
        let mut calls = Vec::new();
        server.receive(&input, &mut calls).expect(what);
        assert_eq!(
            resets(server.output()),
            vec![(stream as u32, ErrorCode::Protocol as u32)],
            "{what}"
        );
        assert_eq!(
            calls.iter().map(|c| c.stream).collect::<Vec<_>>(),
            vec![3],
            "{what}"
        );
    }
}

#[test]
fn cheap_frames_are_limited_in_rate_not_in_number() {
    // 900 PINGs now and 900 ten seconds later fit the budget (1,000 at once, 100 a
    // second); 1,100 at once do not.
    let pings = |n: usize| {
        let mut v = Vec::new();
        for _ in 0..n {
            frame::put_header(&mut v, 8, kind::PING, 0, 0);
            v.extend_from_slice(&[1; 8]);
        }
        v
    };
    let t0 = std::time::Instant::now();
    let mut server = ServerConn::new(ServerSettings::default(), METHODS);
    let mut input = raw_start();
    input.extend_from_slice(&pings(900));
    server
        .receive_at(t0, &input, &mut Vec::new())
        .expect("within the burst");
    server
        .receive_at(t0 + Duration::from_secs(10), &pings(900), &mut Vec::new())
        .expect("refilled");
    let err = server
        .receive_at(t0 + Duration::from_secs(10), &pings(200), &mut Vec::new())
        .expect_err("past the budget");
    assert_eq!(err.code, ErrorCode::EnhanceYourCalm);
}

#[test]
fn connections_share_a_limit_on_unfinished_streams_and_bytes() {
    // Streams opened and never finished, and bodies never finished, on many
    // connections: the server's shared limits refuse what passes them, and a
    // connection gives back what it held when it ends.
    let shared = SharedLimits::new(100, 40_000);
    let block = grpc_block(METHODS[0].as_bytes(), &[]);
    let open = |from: u32, n: u32| {
        let mut input = raw_start();
        for i in 0..n {
            frame::put_headers(&mut input, from + 2 * i, &block, 16_384, false);
        }
        input
    };
    let refused = |server: &mut ServerConn| {
        resets(&std::mem::take(server.output()))
            .iter()
            .filter(|r| r.1 == ErrorCode::RefusedStream as u32)
            .count()
    };
    let mut a = ServerConn::with_shared(ServerSettings::default(), METHODS, shared.clone());
    a.receive(&open(1, 60), &mut Vec::new()).expect("accepts");
    assert_eq!((refused(&mut a), shared.unfinished_streams()), (0, 60));
    let mut b = ServerConn::with_shared(ServerSettings::default(), METHODS, shared.clone());
    b.receive(&open(1, 60), &mut Vec::new()).expect("accepts");
    assert_eq!((refused(&mut b), b.in_flight()), (20, 40));
    assert_eq!(shared.unfinished_streams(), 100);
    drop(a);
    assert_eq!(shared.unfinished_streams(), 40);
    // Bytes held past their frame: 30,000 on one connection, then 15,000 more on
    // another pass the 40,000 shared; that stream is answered RESOURCE_EXHAUSTED.
    let mut c = ServerConn::with_shared(ServerSettings::default(), METHODS, shared.clone());
    let mut input = raw_start();
    frame::put_headers(&mut input, 1, &block, 16_384, false);
    frame::put_data(&mut input, 1, &[0; 15_000], 16_384, false);
    frame::put_data(&mut input, 1, &[0; 15_000], 16_384, false);
    c.receive(&input, &mut Vec::new()).expect("accepts");
    assert_eq!(shared.buffered(), 30_000);
    let mut input = Vec::new();
    frame::put_data(&mut input, 1, &[0; 15_000], 16_384, false);
    b.receive(&input, &mut Vec::new()).expect("accepts");
    let answer = response_fields(&std::mem::take(b.output()), 1);
    assert_eq!(field(&answer, "grpc-status"), Some("8"), "{answer:?}");
    drop((b, c));
    assert_eq!((shared.unfinished_streams(), shared.buffered()), (0, 0));
}

#[test]
fn unfinished_bodies_past_one_largest_message_end_the_connection() {
    let block = grpc_block(METHODS[0].as_bytes(), &[]);
    // Unfinished bodies: past about one largest message in all, the connection ends.
    let mut server = ServerConn::new(ServerSettings::default(), METHODS);
    let mut input = raw_start();
    let mut prefix = vec![0u8];
    prefix.extend_from_slice(&(4u32 << 20).to_be_bytes());
    for stream in [1, 3] {
        frame::put_headers(&mut input, stream, &block, 16_384, false);
        frame::put_data(&mut input, stream, &prefix, 16_384, false);
    }
    let chunk = vec![7u8; 16_000];
    for i in 0..300 {
        frame::put_data(&mut input, 1 + 2 * (i % 2), &chunk, 16_384, false);
        // The client keeps the connection window open.
        frame::put_window_update(&mut input, 0, 16_000);
    }
    let err = server
        .receive(&input, &mut Vec::new())
        .expect_err("too much buffered");
    assert_eq!(err.code, ErrorCode::EnhanceYourCalm);
}

#[test]
fn a_silent_peer_is_pinged_and_closed_when_it_does_not_answer() {
    let t0 = std::time::Instant::now();
    let mut server = ServerConn::new(ServerSettings::default(), METHODS);
    server
        .receive_at(t0, &raw_start(), &mut Vec::new())
        .expect("accepts");
    server.output().clear();
    let at = server.deadline().expect("a timer");
    assert!(at <= t0 + Duration::from_secs(60), "{:?}", at - t0);
    server
        .tick(t0 + Duration::from_secs(30))
        .expect("nothing due");
    assert!(server.output().is_empty());
    server.tick(t0 + Duration::from_secs(60)).expect("a PING");
    let out = frames(&std::mem::take(server.output()));
    assert_eq!((out[0].0, out[0].1), (kind::PING, 0));
    // Answered: the connection stays.
    let mut ack = Vec::new();
    frame::put_header(&mut ack, 8, kind::PING, flag::ACK, 0);
    ack.extend_from_slice(&out[0].3);
    server
        .receive_at(t0 + Duration::from_secs(61), &ack, &mut Vec::new())
        .expect("accepts");
    server
        .tick(t0 + Duration::from_secs(90))
        .expect("still alive");
    // Not answered within 20 s: closed.
    server.tick(t0 + Duration::from_secs(121)).expect("a PING");
    assert_eq!(frames(&std::mem::take(server.output()))[0].0, kind::PING);
    let err = server
        .tick(t0 + Duration::from_secs(142))
        .expect_err("no answer");
    assert_eq!(err.code, ErrorCode::NoError);
    assert_eq!(goaway(server.output()), Some(ErrorCode::NoError as u32));
}

#[test]
fn an_idle_connection_is_closed_in_two_steps_without_losing_a_call() {
    let settings = ServerSettings {
        keepalive_interval: None,
        ..ServerSettings::default()
    };
    let t0 = std::time::Instant::now();
    let mut server = ServerConn::new(settings, METHODS);
    server
        .receive_at(t0, &raw_start(), &mut Vec::new())
        .expect("accepts");
    let block = grpc_block(METHODS[0].as_bytes(), &[]);
    let mut input = Vec::new();
    put_call(&mut input, 1, &block, b"a");
    let mut calls = Vec::new();
    server.receive_at(t0, &input, &mut calls).expect("accepts");
    // Not idle while a call is open.
    server
        .tick(t0 + Duration::from_secs(400))
        .expect("no timer");
    server.output().clear();
    assert!(!server.is_done());
    server.respond(1, Ok(b"A"));
    server.output().clear();
    // Idle from then on (the time of the latest receive or tick): 300 s later, a
    // GOAWAY for every stream id and a PING.
    let t1 = t0 + Duration::from_secs(400);
    assert!(server
        .deadline()
        .is_some_and(|d| d <= t1 + Duration::from_secs(300)));
    server.tick(t1 + Duration::from_secs(299)).expect("not yet");
    assert!(server.output().is_empty());
    server.tick(t1 + Duration::from_secs(300)).expect("closing");
    let out = frames(&std::mem::take(server.output()));
    assert_eq!(out[0].0, kind::GOAWAY);
    assert_eq!(&out[0].3[..4], &0x7fff_ffffu32.to_be_bytes());
    assert_eq!(out[1].0, kind::PING);
    // A call the client sent before it saw the GOAWAY is still answered.
    let mut input = Vec::new();
    put_call(&mut input, 3, &block, b"b");
    frame::put_header(&mut input, 8, kind::PING, flag::ACK, 0);
    input.extend_from_slice(&out[1].3);
    let mut calls = Vec::new();
    server
        .receive_at(t1 + Duration::from_secs(301), &input, &mut calls)
        .expect("accepts");
    assert_eq!(calls.len(), 1);
    let out = frames(&std::mem::take(server.output()));
    let last = out
        .iter()
        .find(|f| f.0 == kind::GOAWAY)
        .expect("the final GOAWAY");
    assert_eq!(&last.3[..4], &3u32.to_be_bytes());
    assert!(!server.is_done());
    server.respond(3, Ok(b"B"));
    assert!(server.is_done());
}

#[test]
fn a_connection_without_a_preface_is_closed() {
    let mut server = ServerConn::new(ServerSettings::default(), METHODS);
    let t0 = std::time::Instant::now();
    server
        .receive_at(t0, &frame::PREFACE[..10], &mut Vec::new())
        .expect("waits for more");
    assert!(server
        .deadline()
        .is_some_and(|d| d <= t0 + Duration::from_secs(10)));
    let err = server
        .tick(t0 + Duration::from_secs(11))
        .expect_err("too slow");
    assert_eq!(err.code, ErrorCode::NoError);
}

proptest! {
    /// The fast field value check agrees with the plain one, wherever the bad byte is.
    #[test]
    fn value_checks_agree(value in proptest::collection::vec(
        prop_oneof![Just(0u8), Just(b'\r'), Just(b'\n'), Just(b'\t'), 0x0eu8..=0xff], 0..40)
    ) {
        let plain = !value.iter().any(|&b| b == 0 || b == b'\r' || b == b'\n');
        prop_assert_eq!(valid_value(&value), plain);
    }
}
