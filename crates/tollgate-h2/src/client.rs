//! [`ClientConn`]: the client side of one HTTP/2 connection sending unary gRPC calls,
//! as many at once as the server allows. Used by the load generator and the tests.
//!
//! The constant request headers (`:authority`, `content-type`, `te`) go into the
//! server's dynamic table with the first request and are sent as one-byte references
//! afterwards, as gRPC clients and Envoy do.

use std::collections::HashMap;

use crate::frame::{self, flag, kind, setting, Frame};
use crate::grpc;
use crate::hpack;
use crate::{ConnError, ErrorCode};

/// The window this client grants the server, for the connection and for each stream.
const WINDOW: u32 = 1 << 20;
/// Dynamic-table references of the constant headers once the first request has
/// inserted them (newest first: `te`, `content-type`, `:authority`).
const TE: usize = 62;
const CONTENT_TYPE: usize = 63;
const AUTHORITY: usize = 64;

/// The end of one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// The stream the call was on.
    pub stream: u32,
    /// The HTTP status (0 when the stream was reset before any headers).
    pub http_status: u16,
    /// `grpc-status` (`None` when the server sent none, or the stream was reset).
    pub grpc_status: Option<u32>,
    /// `grpc-message`, decoded, or why the stream failed.
    pub grpc_message: String,
    /// The response body: zero or more prefixed messages.
    pub body: Vec<u8>,
}

impl Reply {
    /// The response message of a successful unary call.
    pub fn message(&self) -> Option<&[u8]> {
        if self.grpc_status != Some(0) {
            return None;
        }
        grpc::unary_message(&self.body).ok()
    }
}

#[derive(Default)]
struct Open {
    http_status: u16,
    grpc_status: Option<u32>,
    grpc_message: String,
    body: Vec<u8>,
}

/// The client side of one connection (see the module documentation).
pub struct ClientConn {
    decoder: hpack::Decoder,
    authority: Vec<u8>,
    next_stream: u32,
    /// Keyed with aHash (random keys, like std's SipHash, and cheaper per call).
    streams: HashMap<u32, Open, ahash::RandomState>,
    settled: bool,
    indexed: bool,
    /// The server's `SETTINGS_HEADER_TABLE_SIZE` (the size of the table our fields go to).
    peer_table_size: u32,
    /// A table size update the next header block must start with.
    table_size: Option<u32>,
    peer_max_concurrent: u32,
    peer_max_frame: usize,
    peer_initial_window: i64,
    send_window: i64,
    recv_unacked: u32,
    continuation: Option<(u32, Vec<u8>, bool)>,
    goaway: bool,
    out: Vec<u8>,
}

impl ClientConn {
    /// A connection to a server known as `authority` (`host:port`); the preface and
    /// SETTINGS are already in the output.
    pub fn new(authority: &str) -> Self {
        let mut out = Vec::with_capacity(4096);
        out.extend_from_slice(frame::PREFACE);
        frame::put_settings(
            &mut out,
            &[
                (setting::ENABLE_PUSH, 0),
                (setting::INITIAL_WINDOW_SIZE, WINDOW),
            ],
        );
        frame::put_window_update(&mut out, 0, WINDOW - frame::DEFAULT_WINDOW as u32);
        Self {
            decoder: hpack::Decoder::new(4096),
            authority: authority.as_bytes().to_vec(),
            next_stream: 1,
            streams: HashMap::default(),
            settled: false,
            indexed: false,
            peer_table_size: 4096,
            table_size: None,
            peer_max_concurrent: u32::MAX,
            peer_max_frame: frame::DEFAULT_MAX_FRAME,
            peer_initial_window: frame::DEFAULT_WINDOW,
            send_window: frame::DEFAULT_WINDOW,
            recv_unacked: 0,
            continuation: None,
            goaway: false,
            out,
        }
    }

    /// The bytes to write to the server; the caller removes what it wrote.
    pub fn output(&mut self) -> &mut Vec<u8> {
        &mut self.out
    }

    /// Calls sent and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.streams.len()
    }

    /// Whether the server has said goodbye (no new calls may be sent).
    pub fn is_closed(&self) -> bool {
        self.goaway
    }

    /// Whether a call with a `message_len`-byte message can be sent now: the server's
    /// SETTINGS have arrived, its stream limit and the flow-control windows allow it.
    pub fn can_send(&self, message_len: usize) -> bool {
        let need = (message_len + grpc::PREFIX_LEN) as i64;
        self.settled
            && !self.goaway
            && self.streams.len() < self.peer_max_concurrent as usize
            && self.send_window >= need
            && self.peer_initial_window >= need
            && self.next_stream < (1 << 31)
    }

    /// Sends a call of `path` with `message`; `None` when [`can_send`](Self::can_send)
    /// says no.
    pub fn request(&mut self, path: &str, message: &[u8]) -> Option<u32> {
        if !self.can_send(message.len()) {
            return None;
        }
        let stream = self.next_stream;
        self.next_stream += 2;
        let mut block = Vec::with_capacity(128);
        if let Some(size) = self.table_size.take() {
            hpack::put_int(&mut block, 0x20, 5, size as usize);
        }
        block.extend_from_slice(&[hpack::METHOD_POST, hpack::SCHEME_HTTP]);
        hpack::put_indexed_name(&mut block, hpack::PATH, path.as_bytes());
        if self.indexed {
            hpack::put_indexed(&mut block, AUTHORITY);
            hpack::put_indexed(&mut block, CONTENT_TYPE);
            hpack::put_indexed(&mut block, TE);
        } else if self.table_size_allows_indexing() {
            hpack::put_indexed_name_indexing(&mut block, hpack::AUTHORITY, &self.authority);
            hpack::put_indexed_name_indexing(&mut block, hpack::CONTENT_TYPE, b"application/grpc");
            hpack::put_literal_indexing(&mut block, b"te", b"trailers");
            self.indexed = true;
        } else {
            hpack::put_indexed_name(&mut block, hpack::AUTHORITY, &self.authority);
            hpack::put_indexed_name(&mut block, hpack::CONTENT_TYPE, b"application/grpc");
            hpack::put_literal(&mut block, b"te", b"trailers");
        }
        frame::put_headers(&mut self.out, stream, &block, self.peer_max_frame, false);
        let mut data = Vec::with_capacity(grpc::PREFIX_LEN + message.len());
        grpc::put_message(&mut data, message);
        frame::put_data(&mut self.out, stream, &data, self.peer_max_frame, true);
        self.send_window -= data.len() as i64;
        self.streams.insert(stream, Open::default());
        Some(stream)
    }

    fn table_size_allows_indexing(&self) -> bool {
        // The three entries take about 100 bytes plus the authority.
        self.peer_table_size as usize >= 128 + self.authority.len()
    }

    /// Processes the complete frames at the start of `input`, appending finished calls
    /// to `replies`; returns how many bytes it used.
    pub fn receive(&mut self, input: &[u8], replies: &mut Vec<Reply>) -> Result<usize, ConnError> {
        let mut pos = 0;
        loop {
            match frame::parse(&input[pos..], WINDOW as usize) {
                Ok(None) => return Ok(pos),
                Ok(Some((f, used))) => {
                    self.frame(f, replies)?;
                    pos += used;
                }
                Err(code) => return Err(ConnError::new(code, "frame too large")),
            }
        }
    }

    fn frame(&mut self, f: Frame<'_>, replies: &mut Vec<Reply>) -> Result<(), ConnError> {
        if let Some((stream, _, _)) = &self.continuation {
            if f.kind != kind::CONTINUATION || f.stream != *stream {
                return Err(ConnError::new(ErrorCode::Protocol, "expected CONTINUATION"));
            }
        }
        match f.kind {
            kind::SETTINGS if !f.has(flag::ACK) => self.settings(f),
            kind::PING if !f.has(flag::ACK) => {
                frame::put_ping_ack(&mut self.out, f.payload);
                Ok(())
            }
            kind::WINDOW_UPDATE if f.payload.len() == 4 => {
                let inc =
                    u32::from_be_bytes([f.payload[0], f.payload[1], f.payload[2], f.payload[3]])
                        & 0x7fff_ffff;
                if f.stream == 0 {
                    self.send_window += i64::from(inc);
                }
                Ok(())
            }
            kind::HEADERS => {
                let block = frame::unpadded(&f).map_err(|c| ConnError::new(c, "bad padding"))?;
                if f.has(flag::END_HEADERS) {
                    self.header_block(f.stream, block, f.has(flag::END_STREAM), replies)
                } else {
                    self.continuation = Some((f.stream, block.to_vec(), f.has(flag::END_STREAM)));
                    Ok(())
                }
            }
            kind::CONTINUATION => {
                let Some((stream, mut block, end)) = self.continuation.take() else {
                    return Err(ConnError::new(
                        ErrorCode::Protocol,
                        "CONTINUATION without HEADERS",
                    ));
                };
                block.extend_from_slice(f.payload);
                if f.has(flag::END_HEADERS) {
                    self.header_block(stream, &block, end, replies)
                } else {
                    self.continuation = Some((stream, block, end));
                    Ok(())
                }
            }
            kind::DATA => {
                let len = u32::try_from(f.payload.len()).unwrap_or(u32::MAX);
                self.recv_unacked = self.recv_unacked.saturating_add(len);
                if self.recv_unacked >= WINDOW / 2 {
                    frame::put_window_update(&mut self.out, 0, self.recv_unacked);
                    self.recv_unacked = 0;
                }
                let body = frame::unpadded(&f).map_err(|c| ConnError::new(c, "bad padding"))?;
                if let Some(open) = self.streams.get_mut(&f.stream) {
                    open.body.extend_from_slice(body);
                    if f.has(flag::END_STREAM) {
                        self.complete(f.stream, replies);
                    }
                }
                Ok(())
            }
            kind::RST_STREAM if f.payload.len() == 4 => {
                if let Some(mut open) = self.streams.remove(&f.stream) {
                    let code = u32::from_be_bytes([
                        f.payload[0],
                        f.payload[1],
                        f.payload[2],
                        f.payload[3],
                    ]);
                    if open.grpc_status.is_none() {
                        open.grpc_message =
                            format!("stream reset by the server (HTTP/2 error {code})");
                    }
                    replies.push(reply(f.stream, open));
                }
                Ok(())
            }
            kind::GOAWAY if f.payload.len() >= 8 => {
                self.goaway = true;
                let last =
                    u32::from_be_bytes([f.payload[0], f.payload[1], f.payload[2], f.payload[3]])
                        & 0x7fff_ffff;
                let refused: Vec<u32> =
                    self.streams.keys().copied().filter(|s| *s > last).collect();
                for stream in refused {
                    if let Some(mut open) = self.streams.remove(&stream) {
                        open.grpc_message = "refused: the server is going away".into();
                        replies.push(reply(stream, open));
                    }
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn settings(&mut self, f: Frame<'_>) -> Result<(), ConnError> {
        for entry in f.payload.chunks_exact(6) {
            let id = u16::from_be_bytes([entry[0], entry[1]]);
            let value = u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]);
            match id {
                setting::MAX_CONCURRENT_STREAMS => self.peer_max_concurrent = value,
                setting::INITIAL_WINDOW_SIZE => self.peer_initial_window = i64::from(value),
                setting::MAX_FRAME_SIZE => self.peer_max_frame = value as usize,
                setting::HEADER_TABLE_SIZE if !self.settled && value < 4096 => {
                    self.peer_table_size = value;
                    self.table_size = Some(value);
                }
                _ => {}
            }
        }
        self.settled = true;
        frame::put_settings_ack(&mut self.out);
        Ok(())
    }

    fn header_block(
        &mut self,
        stream: u32,
        block: &[u8],
        end_stream: bool,
        replies: &mut Vec<Reply>,
    ) -> Result<(), ConnError> {
        let mut fields: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        self.decoder
            .decode(block, |name, value| {
                if matches!(name, b":status" | b"grpc-status" | b"grpc-message") {
                    fields.push((name.to_vec(), value.to_vec()));
                }
            })
            .map_err(|_| {
                ConnError::new(ErrorCode::Compression, "cannot decode the header block")
            })?;
        let Some(open) = self.streams.get_mut(&stream) else {
            return Ok(());
        };
        for (name, value) in fields {
            let text = String::from_utf8_lossy(&value);
            match name.as_slice() {
                b":status" => open.http_status = text.parse().unwrap_or(0),
                b"grpc-status" => open.grpc_status = text.parse().ok(),
                _ => open.grpc_message = grpc::percent_decode(&value),
            }
        }
        if end_stream {
            self.complete(stream, replies);
        }
        Ok(())
    }

    fn complete(&mut self, stream: u32, replies: &mut Vec<Reply>) {
        if let Some(open) = self.streams.remove(&stream) {
            replies.push(reply(stream, open));
        }
    }
}

fn reply(stream: u32, open: Open) -> Reply {
    Reply {
        stream,
        http_status: open.http_status,
        grpc_status: open.grpc_status,
        grpc_message: open.grpc_message,
        body: open.body,
    }
}
