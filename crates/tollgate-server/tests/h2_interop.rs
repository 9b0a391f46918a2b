//! `tollgate serve` against nghttp2's own clients, `nghttp` and `h2load` (Debian's
//! `nghttp2-client`; `bash .ci/run` installs it). Envoy speaks HTTP/2 through nghttp2
//! (or oghttp2), so what nghttp2 expects of a server is what Envoy expects: both gRPC
//! transports (`--grpc-transport native` and `tonic`), with nghttp2's default HPACK
//! table and with `--header-table-size=0` (the client then needs a dynamic table size
//! update in the server's next header block, RFC 7541 §4.2), padding and CONTINUATION
//! frames.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

mod support;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::{
    rate_limit_response::Code, RateLimitResponse,
};
use prost::Message;
use support::{rls_request, tempdir, Server};
use tollgate_h2::frame::{self, kind};
use tollgate_h2::{hpack, ErrorCode};

const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
const RULES: &str = "domain: interop
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 1000000000}
";
const TRANSPORTS: [&str; 2] = ["native", "tonic"];

/// The nghttp2 client `name`; panics with how to install it when it is missing.
fn tool(name: &str) -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "{name} is missing: this test needs nghttp2's clients \
             (`apt-get install -y nghttp2-client`, as `bash .ci/run` does)"
        )
    })
}

/// A rules directory and a request body file: the 5-byte gRPC prefix and a
/// `RateLimitRequest` for `{k: v}` in `interop`, as Envoy would send it.
fn fixtures(name: &str) -> (PathBuf, PathBuf) {
    let dir = tempdir(name);
    let rules = dir.join("rules");
    std::fs::create_dir_all(&rules).unwrap();
    std::fs::write(rules.join("interop.yaml"), RULES).unwrap();
    let message = rls_request("interop", None).into_inner().encode_to_vec();
    let mut body = vec![0u8];
    body.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    body.extend_from_slice(&message);
    let file = dir.join("request.bin");
    std::fs::write(&file, body).unwrap();
    (rules, file)
}

fn grpc_url(server: &Server) -> String {
    format!("http://{}{PATH}", server.grpc)
}

fn run(program: &Path, args: &[String]) -> Output {
    Command::new(program).args(args).output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The common arguments of a gRPC call: the body and the headers gRPC requires.
fn grpc_args(body: &Path) -> Vec<String> {
    vec![
        format!("--data={}", body.display()),
        "--header=content-type: application/grpc".into(),
        "--header=te: trailers".into(),
    ]
}

/// `h2load`'s counts: (succeeded, 2xx statuses), read from its summary lines
/// (`requests: N total, N started, N done, N succeeded, ...` and
/// `status codes: N 2xx, ...`).
fn h2load_counts(out: &str) -> (u64, u64) {
    let number_before = |line: &str, word: &str| -> Option<u64> {
        let words: Vec<&str> = line.split([' ', ',']).filter(|w| !w.is_empty()).collect();
        let i = words.iter().position(|w| *w == word)?;
        words.get(i.checked_sub(1)?)?.parse().ok()
    };
    let succeeded = out
        .lines()
        .find(|l| l.starts_with("requests:"))
        .and_then(|l| number_before(l, "succeeded"));
    let ok = out
        .lines()
        .find(|l| l.starts_with("status codes:"))
        .and_then(|l| number_before(l, "2xx"));
    (succeeded.unwrap_or(0), ok.unwrap_or(0))
}

#[tokio::test]
async fn h2load_calls_succeed_on_both_transports_with_and_without_a_header_table() {
    let h2load = tool("h2load");
    let (rules, body) = fixtures("h2load");
    const CALLS: u64 = 2_000;
    for transport in TRANSPORTS {
        let server = Server::start(&rules, &["--grpc-transport", transport]).await;
        // 16 streams at once on each of 2 connections, with and without a header table;
        // and 1,000 on one connection: nghttp2 then sends a burst's HEADERS frames
        // before their DATA, so hundreds of requests are unfinished at once.
        for (clients, streams, table) in [(2, 16, None), (2, 16, Some("0")), (1, 1_000, None)] {
            let mut args = grpc_args(&body);
            args.extend([
                format!("--requests={CALLS}"),
                format!("--clients={clients}"),
                format!("--max-concurrent-streams={streams}"),
                "--connection-inactivity-timeout=10".into(),
            ]);
            if let Some(size) = table {
                args.push(format!("--header-table-size={size}"));
            }
            args.push(grpc_url(&server));
            let out = run(&h2load, &args);
            let said = text(&out.stdout) + &text(&out.stderr);
            assert_eq!(
                h2load_counts(&said),
                (CALLS, CALLS),
                "--grpc-transport {transport}, {clients} x {streams} streams, header table \
                 {table:?}:\n{said}"
            );
        }
    }
}

#[tokio::test]
async fn nghttp_gets_grpc_answers_on_both_transports_with_and_without_a_header_table() {
    let nghttp = tool("nghttp");
    let (rules, body) = fixtures("nghttp");
    for transport in TRANSPORTS {
        let server = Server::start(&rules, &["--grpc-transport", transport]).await;
        // With nghttp2's defaults; without a header table; with padded frames (and, in
        // each, nghttp's `content-length`, which the server checks against the body).
        let variants: [&[&str]; 3] = [&[], &["--header-table-size=0"], &["--padding=16"]];
        for extra in variants {
            let what = format!("--grpc-transport {transport} {extra:?}");
            // Three calls on the connection, so that later header blocks count too.
            let args = nghttp_args(&body, extra, &server);
            // The frames (`--verbose`): each call's trailers say `grpc-status: 0`.
            let said = nghttp_verbose(&nghttp, &args, &what);
            assert_eq!(received(&said, "grpc-status: 0"), 3, "{what}:\n{said}");
            // The bodies (standard output without `--verbose`): each a prefixed
            // `RateLimitResponse` that lets the call through.
            let out = run(&nghttp, &args);
            assert!(out.status.success(), "{what}: {}", text(&out.stderr));
            let mut rest = &out.stdout[..];
            let mut answers = 0;
            while let Some((prefix, after)) = rest.split_first_chunk::<5>() {
                let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]);
                let (message, after) = after.split_at(len as usize);
                let response = RateLimitResponse::decode(message).unwrap();
                assert_eq!(response.overall_code(), Code::Ok, "{what}");
                rest = after;
                answers += 1;
            }
            assert_eq!(answers, 3, "{what}");
        }
        // `--continuation` splits each request's header block into CONTINUATION frames
        // by adding an 18 KB header: past the 16 KB header list both transports
        // advertise (hyper's default), so both answer 431, and the connection goes on.
        let what = format!("--grpc-transport {transport} --continuation");
        let args = nghttp_args(&body, &["--continuation"], &server);
        let said = nghttp_verbose(&nghttp, &args, &what);
        assert_eq!(received(&said, ":status: 431"), 3, "{what}:\n{said}");
    }
}

/// nghttp's arguments for three calls on one connection to `server`, with `extra`.
fn nghttp_args(body: &Path, extra: &[&str], server: &Server) -> Vec<String> {
    let mut args = grpc_args(body);
    args.extend(extra.iter().map(|a| a.to_string()));
    args.extend(["--multiply=3".into(), "--timeout=10".into()]);
    args.push(grpc_url(server));
    args
}

/// Runs nghttp with `--verbose` and returns what it printed (the frames it sent and
/// received); panics when it fails.
fn nghttp_verbose(nghttp: &Path, args: &[String], what: &str) -> String {
    let mut verbose = args.to_vec();
    verbose.push("--verbose".into());
    let out = run(nghttp, &verbose);
    let said = text(&out.stdout);
    assert!(out.status.success(), "{what}: {said}{}", text(&out.stderr));
    said
}

/// How many received header fields nghttp's verbose output shows as `field`.
fn received(said: &str, field: &str) -> usize {
    said.lines()
        .filter(|l| l.contains("recv (stream_id=") && l.ends_with(field))
        .count()
}

/// Writes each of `writes` to the native transport of `server` in one write, 300 ms
/// apart, then reads until it closes the connection (10 s at most): every frame it sent,
/// as (type, stream, payload).
fn exchange(server: &Server, writes: &[&[u8]]) -> Vec<(u8, u32, Vec<u8>)> {
    let mut socket = std::net::TcpStream::connect(&server.grpc).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    for (i, input) in writes.iter().enumerate() {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(300));
        }
        socket.write_all(input).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut bytes = Vec::new();
    let mut buf = [0u8; 64 << 10];
    while Instant::now() < deadline {
        match socket.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => bytes.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            // Closed with unread input: a reset.
            Err(_) => break,
        }
    }
    let mut frames = Vec::new();
    let mut rest = &bytes[..];
    while let Ok(Some((f, used))) = frame::parse(rest, 1 << 24) {
        frames.push((f.kind, f.stream, f.payload.to_vec()));
        rest = &rest[used..];
    }
    frames
}

/// The code of the GOAWAY among `frames`.
fn goaway(frames: &[(u8, u32, Vec<u8>)]) -> Option<u32> {
    frames
        .iter()
        .find(|f| f.0 == kind::GOAWAY)
        .map(|f| u32::from_be_bytes(f.2[4..8].try_into().unwrap()))
}

/// A `ShouldRateLimit` request's header block, as Envoy's gRPC client sends one.
fn request_block() -> Vec<u8> {
    let mut block = vec![hpack::METHOD_POST, hpack::SCHEME_HTTP];
    hpack::put_indexed_name(&mut block, hpack::PATH, PATH.as_bytes());
    hpack::put_indexed_name(&mut block, hpack::AUTHORITY, b"ratelimit");
    hpack::put_indexed_name(&mut block, hpack::CONTENT_TYPE, b"application/grpc");
    hpack::put_literal(&mut block, b"te", b"trailers");
    block
}

#[tokio::test]
async fn the_native_transport_stands_up_to_rapid_reset_and_hpack_amplification() {
    let (rules, body) = fixtures("hostile");
    let body = std::fs::read(body).unwrap();
    let server = Server::start(&rules, &["--grpc-transport", "native"]).await;
    let hits = "tollgate_total_hits_total{domain=\"interop\",descriptor=\"k\"}";

    // CVE-2023-44487: 5,000 calls, each reset right after it in the same write.
    let mut input = frame::PREFACE.to_vec();
    frame::put_settings(&mut input, &[]);
    let block = request_block();
    for i in 0..5_000u32 {
        let stream = 2 * i + 1;
        frame::put_headers(&mut input, stream, &block, 16_384, false);
        frame::put_data(&mut input, stream, &body, 16_384, true);
        frame::put_rst_stream(&mut input, stream, ErrorCode::Cancel);
    }
    let frames = exchange(&server, &[&input]);
    assert_eq!(goaway(&frames), Some(ErrorCode::EnhanceYourCalm as u32));
    // A call whose RST_STREAM came in the next read ran; the others were dropped.
    let charged = server.metric(hits).await.unwrap_or(0);
    assert!(charged < 100, "{charged} of the reset calls were charged");

    // A 4 KB field indexed and referenced 4 times (20 KB decoded, past the 16 KB
    // advertised): answered 431, and the connection goes on. Referenced 4,000 times
    // (16 MB decoded from 4 KB): past four times the advertised list, the connection
    // ends before the block is decoded.
    let mut input = frame::PREFACE.to_vec();
    frame::put_settings(&mut input, &[]);
    let mut big = request_block();
    hpack::put_literal_indexing(&mut big, b"x-big", &[b'a'; 4000]);
    big.extend(std::iter::repeat_n(0xbe, 4));
    frame::put_headers(&mut input, 1, &big, 16_384, false);
    frame::put_data(&mut input, 1, &body, 16_384, true);
    frame::put_headers(&mut input, 3, &block, 16_384, false);
    frame::put_data(&mut input, 3, &body, 16_384, true);
    let mut huge = request_block();
    huge.extend(std::iter::repeat_n(0xbe, 4_000));
    let mut later = Vec::new();
    frame::put_headers(&mut later, 5, &huge, 16_384, true);
    let frames = exchange(&server, &[&input, &later]);
    let headers: Vec<u32> = frames
        .iter()
        .filter(|f| f.0 == kind::HEADERS)
        .map(|f| f.1)
        .collect();
    assert_eq!(headers, [1, 3, 3], "431 on 1; headers and trailers on 3");
    let status_431 = &frames.iter().find(|f| f.0 == kind::HEADERS).unwrap().2;
    let mut fields = Vec::new();
    hpack::Decoder::new(4096)
        .decode(status_431, |n, v| fields.push((n.to_vec(), v.to_vec())))
        .unwrap();
    assert!(
        fields.contains(&(b":status".to_vec(), b"431".to_vec())),
        "{fields:?}"
    );
    assert_eq!(goaway(&frames), Some(ErrorCode::EnhanceYourCalm as u32));
}
