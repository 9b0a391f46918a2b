//! The native gRPC transport's receive path (frames, HPACK, flow control, gRPC
//! messages): any bytes after the connection preface, cut into reads anywhere, end in
//! calls, answers or a connection error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tollgate_h2::server::{ServerConn, ServerSettings};

const METHODS: &[&str] = &["/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"];
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

fuzz_target!(|data: &[u8]| {
    // The first byte sets the read size, so frames are also split across reads.
    let (cut, rest) = data.split_first().unwrap_or((&0, &[]));
    let cut = usize::from(*cut).max(1) * 7;
    let mut conn = ServerConn::new(ServerSettings::default(), METHODS);
    let mut input = PREFACE.to_vec();
    let mut calls = Vec::new();
    let mut chunks = rest.chunks(cut);
    loop {
        match conn.receive(&input, &mut calls) {
            Ok(used) => {
                input.drain(..used);
            }
            Err(_) => return,
        }
        // Answer every finished call, as the server does.
        for call in calls.drain(..) {
            conn.respond(call.stream, Ok(b"\x08\x01"));
        }
        conn.output().clear();
        match chunks.next() {
            Some(c) => input.extend_from_slice(c),
            None => return,
        }
    }
});
