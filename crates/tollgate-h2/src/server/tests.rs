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
