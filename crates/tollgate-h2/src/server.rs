//! [`ServerConn`]: the server side of one HTTP/2 connection carrying unary gRPC calls.
//!
//! Feed it what the socket gave ([`ServerConn::receive`]); it returns each complete call
//! (stream, method, message) and answers everything else itself: SETTINGS, PING,
//! WINDOW_UPDATE, unknown methods (`UNIMPLEMENTED`), non-gRPC requests (HTTP 415/405),
//! malformed bodies, protocol errors (GOAWAY). Answer calls in any order with
//! [`ServerConn::respond`]; write [`ServerConn::output`] to the socket whenever it is
//! not empty.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use crate::frame::{self, flag, kind, setting, Frame};
use crate::grpc::{self, Code, Status};
use crate::hpack;
use crate::{ConnError, ErrorCode};

/// Limits of one connection. Each bounds memory an abusive peer could make the server
/// hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerSettings {
    /// Streams open at once (`SETTINGS_MAX_CONCURRENT_STREAMS`); more are refused with
    /// `REFUSED_STREAM`, which gRPC clients retry.
    pub max_concurrent_streams: u32,
    /// Largest request message; a larger one is answered `RESOURCE_EXHAUSTED`.
    pub max_message: usize,
    /// Largest header block (HEADERS plus CONTINUATION frames), encoded.
    pub max_header_block: usize,
    /// Request bytes held for all unfinished streams together; more is a connection
    /// error (`ENHANCE_YOUR_CALM`).
    pub max_buffered: usize,
    /// The connection's receive window, granted at start and topped up as data arrives.
    pub connection_window: u32,
}

impl Default for ServerSettings {
    fn default() -> Self {
        Self {
            max_concurrent_streams: 1024,
            max_message: 4 << 20,
            max_header_block: 64 << 10,
            max_buffered: 16 << 20,
            connection_window: 1 << 20,
        }
    }
}

/// A complete unary call for the caller to answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// The stream to answer on.
    pub stream: u32,
    /// Index of the call's `:path` in the method list given to [`ServerConn::new`].
    pub method: usize,
    /// The request message (without its 5-byte prefix).
    pub message: Vec<u8>,
    /// How long the caller waits for the answer (`grpc-timeout`), when it said.
    pub timeout: Option<Duration>,
}

/// What a stream's request turned out to be.
#[derive(Debug, Clone)]
enum Target {
    /// A known method.
    Method(usize),
    /// A gRPC request to answer with a status (unknown method, say).
    Status(Status),
    /// Not a gRPC request: answer with this HTTP status.
    Http(u16),
}

#[derive(Debug)]
struct Stream {
    target: Target,
    timeout: Option<Duration>,
    body: Vec<u8>,
    recv_closed: bool,
    send_window: i64,
    pending: Option<Pending>,
}

/// A response waiting for flow-control window.
#[derive(Debug)]
struct Pending {
    data: Vec<u8>,
    sent: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the 24-byte client preface.
    Preface,
    /// Waiting for the client's first SETTINGS frame.
    Settings,
    /// Running.
    Open,
}

struct Continuation {
    stream: u32,
    block: Vec<u8>,
    end_stream: bool,
}

/// The response header block: `:status: 200`, `content-type: application/grpc`.
const RESPONSE_HEADERS: &[u8] = b"\x88\x0f\x10\x10application/grpc";
/// The trailers of a successful call: `grpc-status: 0`.
const TRAILERS_OK: &[u8] = b"\x00\x0bgrpc-status\x010";
/// What a plain HTTP/1 client gets on this port.
const NOT_HTTP2: &[u8] = b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\n\
connection: close\r\ncontent-length: 62\r\n\r\n\
This port serves gRPC: HTTP/2 with prior knowledge (h2c) only\n";
/// `grpc-message` is cut to this many bytes.
const MAX_STATUS_MESSAGE: usize = 1024;

/// The server side of one connection (see the module documentation).
pub struct ServerConn {
    methods: &'static [&'static str],
    settings: ServerSettings,
    phase: Phase,
    decoder: hpack::Decoder,
    /// Keyed with aHash (random keys, like std's SipHash, and cheaper per call).
    streams: HashMap<u32, Stream, ahash::RandomState>,
    last_stream: u32,
    continuation: Option<Continuation>,
    peer_max_frame: usize,
    peer_initial_window: i64,
    send_window: i64,
    recv_unacked: u32,
    buffered: usize,
    blocked: VecDeque<u32>,
    going_away: bool,
    out: Vec<u8>,
}

impl ServerConn {
    /// A connection serving `methods` (`:path`s such as `/pkg.Service/Method`); the
    /// server's SETTINGS are already in the output.
    pub fn new(settings: ServerSettings, methods: &'static [&'static str]) -> Self {
        let decoder = hpack::Decoder::new(4096);
        let mut out = Vec::with_capacity(4096);
        frame::put_settings(
            &mut out,
            &[
                (
                    setting::MAX_CONCURRENT_STREAMS,
                    settings.max_concurrent_streams,
                ),
                (
                    setting::MAX_HEADER_LIST_SIZE,
                    u32::try_from(settings.max_header_block).unwrap_or(u32::MAX),
                ),
            ],
        );
        let extra = i64::from(settings.connection_window) - frame::DEFAULT_WINDOW;
        if extra > 0 {
            frame::put_window_update(&mut out, 0, extra as u32);
        }
        Self {
            methods,
            settings,
            phase: Phase::Preface,
            decoder,
            streams: HashMap::default(),
            last_stream: 0,
            continuation: None,
            peer_max_frame: frame::DEFAULT_MAX_FRAME,
            peer_initial_window: frame::DEFAULT_WINDOW,
            send_window: frame::DEFAULT_WINDOW,
            recv_unacked: 0,
            buffered: 0,
            blocked: VecDeque::new(),
            going_away: false,
            out,
        }
    }

    /// The bytes to write to the peer; the caller removes what it wrote.
    pub fn output(&mut self) -> &mut Vec<u8> {
        &mut self.out
    }

    /// Streams opened and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.streams.len()
    }

    /// Whether the connection is draining ([`shutdown`](Self::shutdown)) and has
    /// nothing left to answer: write the output and close.
    pub fn is_done(&self) -> bool {
        self.going_away && self.streams.is_empty()
    }

    /// Starts a graceful shutdown: a GOAWAY tells the peer which streams will still be
    /// answered; newer ones are refused.
    pub fn shutdown(&mut self) {
        if !self.going_away {
            self.going_away = true;
            frame::put_goaway(&mut self.out, self.last_stream, ErrorCode::NoError, b"");
        }
    }

    /// Processes the complete frames at the start of `input`, appending finished calls
    /// to `calls`; returns how many bytes it used (keep the rest and call again with
    /// more). On a connection error the GOAWAY is in the output: write it and close.
    pub fn receive(&mut self, input: &[u8], calls: &mut Vec<Call>) -> Result<usize, ConnError> {
        let mut pos = 0;
        if self.phase == Phase::Preface {
            let n = input.len().min(frame::PREFACE.len());
            if input[..n] != frame::PREFACE[..n] {
                self.out.clear();
                self.out.extend_from_slice(NOT_HTTP2);
                return Err(ConnError::new(
                    ErrorCode::Protocol,
                    "not an HTTP/2 connection preface",
                ));
            }
            if n < frame::PREFACE.len() {
                return Ok(0);
            }
            pos = n;
            self.phase = Phase::Settings;
        }
        loop {
            match frame::parse(&input[pos..], frame::DEFAULT_MAX_FRAME) {
                Ok(None) => return Ok(pos),
                Ok(Some((f, used))) => {
                    self.frame(f, calls)?;
                    pos += used;
                }
                Err(code) => return Err(self.fail(code, "frame larger than the maximum")),
            }
        }
    }

    /// Answers the call on `stream` with a message or a status. A stream the peer has
    /// reset meanwhile is ignored.
    pub fn respond(&mut self, stream: u32, reply: Result<&[u8], &Status>) {
        if !self.streams.contains_key(&stream) {
            return;
        }
        match reply {
            Ok(message) => {
                frame::put_headers(
                    &mut self.out,
                    stream,
                    RESPONSE_HEADERS,
                    self.peer_max_frame,
                    false,
                );
                let mut data = Vec::with_capacity(grpc::PREFIX_LEN + message.len());
                grpc::put_message(&mut data, message);
                if let Some(s) = self.streams.get_mut(&stream) {
                    s.pending = Some(Pending { data, sent: 0 });
                }
                self.blocked.push_back(stream);
                self.flush_blocked();
            }
            Err(status) => self.respond_status(stream, status),
        }
    }

    fn fail(&mut self, code: ErrorCode, reason: &str) -> ConnError {
        frame::put_goaway(&mut self.out, self.last_stream, code, reason.as_bytes());
        self.going_away = true;
        ConnError::new(code, reason)
    }

    fn frame(&mut self, f: Frame<'_>, calls: &mut Vec<Call>) -> Result<(), ConnError> {
        if self.phase == Phase::Settings && (f.kind != kind::SETTINGS || f.has(flag::ACK)) {
            return Err(self.fail(ErrorCode::Protocol, "the client must start with SETTINGS"));
        }
        if let Some(c) = &self.continuation {
            if f.kind != kind::CONTINUATION || f.stream != c.stream {
                return Err(self.fail(ErrorCode::Protocol, "expected CONTINUATION"));
            }
        }
        match f.kind {
            kind::DATA => self.data(f, calls),
            kind::HEADERS => self.headers(f, calls),
            kind::CONTINUATION => self.continuation(f, calls),
            kind::PRIORITY => self.check_len(&f, 5, true),
            kind::RST_STREAM => self.rst_stream(f),
            kind::SETTINGS => self.settings(f),
            kind::PUSH_PROMISE => Err(self.fail(ErrorCode::Protocol, "a client cannot push")),
            kind::PING => {
                self.check_len(&f, 8, false)?;
                if !f.has(flag::ACK) {
                    frame::put_ping_ack(&mut self.out, f.payload);
                }
                Ok(())
            }
            kind::GOAWAY => {
                if f.stream != 0 {
                    return Err(self.fail(ErrorCode::Protocol, "GOAWAY on a stream"));
                }
                Ok(())
            }
            kind::WINDOW_UPDATE => self.window_update(f),
            _ => Ok(()),
        }
    }

    /// A frame whose payload must be `len` bytes, on a stream (`on_stream`) or on the
    /// connection.
    fn check_len(&mut self, f: &Frame<'_>, len: usize, on_stream: bool) -> Result<(), ConnError> {
        if (f.stream != 0) != on_stream {
            return Err(self.fail(ErrorCode::Protocol, "frame on the wrong stream"));
        }
        if f.payload.len() != len {
            return Err(self.fail(ErrorCode::FrameSize, "frame of the wrong size"));
        }
        Ok(())
    }

    fn settings(&mut self, f: Frame<'_>) -> Result<(), ConnError> {
        if f.stream != 0 {
            return Err(self.fail(ErrorCode::Protocol, "SETTINGS on a stream"));
        }
        if f.has(flag::ACK) {
            if !f.payload.is_empty() {
                return Err(self.fail(ErrorCode::FrameSize, "SETTINGS ACK with a payload"));
            }
            return Ok(());
        }
        if f.payload.len() % 6 != 0 {
            return Err(self.fail(ErrorCode::FrameSize, "SETTINGS of the wrong size"));
        }
        for entry in f.payload.chunks_exact(6) {
            let id = u16::from_be_bytes([entry[0], entry[1]]);
            let value = u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]);
            match id {
                setting::ENABLE_PUSH if value > 1 => {
                    return Err(self.fail(ErrorCode::Protocol, "SETTINGS_ENABLE_PUSH above 1"));
                }
                setting::INITIAL_WINDOW_SIZE => {
                    let value = i64::from(value);
                    if value > frame::MAX_WINDOW {
                        return Err(self.fail(ErrorCode::FlowControl, "initial window too large"));
                    }
                    let delta = value - self.peer_initial_window;
                    self.peer_initial_window = value;
                    for s in self.streams.values_mut() {
                        s.send_window += delta;
                    }
                    if self
                        .streams
                        .values()
                        .any(|s| s.send_window > frame::MAX_WINDOW)
                    {
                        return Err(self.fail(ErrorCode::FlowControl, "stream window overflow"));
                    }
                }
                setting::MAX_FRAME_SIZE => {
                    if !(frame::DEFAULT_MAX_FRAME as u32..=frame::MAX_MAX_FRAME).contains(&value) {
                        return Err(
                            self.fail(ErrorCode::Protocol, "invalid SETTINGS_MAX_FRAME_SIZE")
                        );
                    }
                    self.peer_max_frame = value as usize;
                }
                _ => {}
            }
        }
        frame::put_settings_ack(&mut self.out);
        self.phase = Phase::Open;
        self.flush_blocked();
        Ok(())
    }

    fn window_update(&mut self, f: Frame<'_>) -> Result<(), ConnError> {
        if f.payload.len() != 4 {
            return Err(self.fail(ErrorCode::FrameSize, "WINDOW_UPDATE of the wrong size"));
        }
        let inc = i64::from(
            u32::from_be_bytes([f.payload[0], f.payload[1], f.payload[2], f.payload[3]])
                & 0x7fff_ffff,
        );
        if f.stream == 0 {
            if inc == 0 {
                return Err(self.fail(ErrorCode::Protocol, "WINDOW_UPDATE of 0"));
            }
            self.send_window += inc;
            if self.send_window > frame::MAX_WINDOW {
                return Err(self.fail(ErrorCode::FlowControl, "connection window overflow"));
            }
        } else if let Some(s) = self.streams.get_mut(&f.stream) {
            s.send_window += inc;
            if inc == 0 || s.send_window > frame::MAX_WINDOW {
                let code = if inc == 0 {
                    ErrorCode::Protocol
                } else {
                    ErrorCode::FlowControl
                };
                self.reset(f.stream, code);
                return Ok(());
            }
        }
        self.flush_blocked();
        Ok(())
    }

    fn rst_stream(&mut self, f: Frame<'_>) -> Result<(), ConnError> {
        self.check_len(&f, 4, true)?;
        if f.stream > self.last_stream {
            return Err(self.fail(ErrorCode::Protocol, "RST_STREAM on an idle stream"));
        }
        self.forget(f.stream);
        Ok(())
    }

    fn data(&mut self, f: Frame<'_>, calls: &mut Vec<Call>) -> Result<(), ConnError> {
        if f.stream == 0 {
            return Err(self.fail(ErrorCode::Protocol, "DATA on stream 0"));
        }
        // Every DATA byte counts against the connection's window, whatever the stream.
        let len = u32::try_from(f.payload.len()).unwrap_or(u32::MAX);
        self.recv_unacked = self.recv_unacked.saturating_add(len);
        if self.recv_unacked >= self.settings.connection_window / 2 {
            frame::put_window_update(&mut self.out, 0, self.recv_unacked);
            self.recv_unacked = 0;
        }
        let body = match frame::unpadded(&f) {
            Ok(b) => b,
            Err(code) => return Err(self.fail(code, "bad padding")),
        };
        if f.stream > self.last_stream {
            return Err(self.fail(ErrorCode::Protocol, "DATA on an idle stream"));
        }
        let max_message = self.settings.max_message + grpc::PREFIX_LEN;
        let Some(s) = self.streams.get_mut(&f.stream) else {
            // Closed (answered or reset): ignored, as RFC 9113 §5.1 allows after a reset.
            return Ok(());
        };
        if s.recv_closed {
            self.reset(f.stream, ErrorCode::StreamClosed);
            return Ok(());
        }
        if matches!(s.target, Target::Method(_)) {
            if s.body.len() + body.len() > max_message {
                let status = Status::new(
                    Code::ResourceExhausted,
                    format!(
                        "request message larger than {} bytes",
                        self.settings.max_message
                    ),
                );
                self.respond_status(f.stream, &status);
                return Ok(());
            }
            if self.buffered + body.len() > self.settings.max_buffered {
                return Err(self.fail(ErrorCode::EnhanceYourCalm, "too much request data buffered"));
            }
            s.body.extend_from_slice(body);
            self.buffered += body.len();
        }
        if f.has(flag::END_STREAM) {
            s.recv_closed = true;
            self.finish(f.stream, calls);
        } else if len > 0 {
            frame::put_window_update(&mut self.out, f.stream, len);
        }
        Ok(())
    }

    fn headers(&mut self, f: Frame<'_>, calls: &mut Vec<Call>) -> Result<(), ConnError> {
        if f.stream == 0 || f.stream % 2 == 0 {
            return Err(self.fail(
                ErrorCode::Protocol,
                "HEADERS on a stream a client cannot open",
            ));
        }
        let block = match frame::unpadded(&f) {
            Ok(b) => b,
            Err(code) => return Err(self.fail(code, "bad padding")),
        };
        if block.len() > self.settings.max_header_block {
            return Err(self.fail(ErrorCode::EnhanceYourCalm, "header block too large"));
        }
        if !f.has(flag::END_HEADERS) {
            self.continuation = Some(Continuation {
                stream: f.stream,
                block: block.to_vec(),
                end_stream: f.has(flag::END_STREAM),
            });
            return Ok(());
        }
        self.header_block(f.stream, block, f.has(flag::END_STREAM), calls)
    }

    fn continuation(&mut self, f: Frame<'_>, calls: &mut Vec<Call>) -> Result<(), ConnError> {
        let Some(mut c) = self.continuation.take() else {
            return Err(self.fail(ErrorCode::Protocol, "CONTINUATION without HEADERS"));
        };
        if c.block.len() + f.payload.len() > self.settings.max_header_block {
            return Err(self.fail(ErrorCode::EnhanceYourCalm, "header block too large"));
        }
        c.block.extend_from_slice(f.payload);
        if !f.has(flag::END_HEADERS) {
            self.continuation = Some(c);
            return Ok(());
        }
        self.header_block(c.stream, &c.block, c.end_stream, calls)
    }

    fn header_block(
        &mut self,
        stream: u32,
        block: &[u8],
        end_stream: bool,
        calls: &mut Vec<Call>,
    ) -> Result<(), ConnError> {
        // Every block is decoded, even for a stream that will be refused, to keep the
        // HPACK dynamic table in step with the peer's.
        let mut request = RequestHeaders::default();
        let methods = self.methods;
        let decoded = self
            .decoder
            .decode(block, |name, value| request.field(methods, name, value));
        if decoded.is_err() {
            return Err(self.fail(ErrorCode::Compression, "cannot decode the header block"));
        }
        if let Some(s) = self.streams.get_mut(&stream) {
            // Trailers from the client: they must end the stream.
            if s.recv_closed || !end_stream {
                self.reset(stream, ErrorCode::Protocol);
            } else {
                s.recv_closed = true;
                self.finish(stream, calls);
            }
            return Ok(());
        }
        if stream <= self.last_stream {
            // A stream already answered or reset: ignored (RFC 9113 §5.1).
            return Ok(());
        }
        self.last_stream = stream;
        if self.going_away || self.streams.len() >= self.settings.max_concurrent_streams as usize {
            frame::put_rst_stream(&mut self.out, stream, ErrorCode::RefusedStream);
            return Ok(());
        }
        let timeout = request
            .timeout
            .as_ref()
            .and_then(|t| t.as_ref().ok())
            .copied();
        let target = request.target();
        self.streams.insert(
            stream,
            Stream {
                target,
                timeout,
                body: Vec::new(),
                recv_closed: end_stream,
                send_window: self.peer_initial_window,
                pending: None,
            },
        );
        if end_stream {
            self.finish(stream, calls);
        }
        Ok(())
    }

    /// The peer has sent the whole request on `stream`: hand out the call or answer it.
    fn finish(&mut self, stream: u32, calls: &mut Vec<Call>) {
        let Some(s) = self.streams.get_mut(&stream) else {
            return;
        };
        let mut body = std::mem::take(&mut s.body);
        let timeout = s.timeout;
        self.buffered -= body.len();
        match s.target.clone() {
            Target::Method(method) => match grpc::unary_message(&body) {
                Ok(_) => {
                    body.drain(..grpc::PREFIX_LEN);
                    calls.push(Call {
                        stream,
                        method,
                        message: body,
                        timeout,
                    });
                }
                Err(status) => self.respond_status(stream, &status),
            },
            Target::Status(status) => self.respond_status(stream, &status),
            Target::Http(code) => {
                let mut block = Vec::with_capacity(8);
                hpack::put_indexed_name(&mut block, hpack::STATUS, code.to_string().as_bytes());
                frame::put_headers(&mut self.out, stream, &block, self.peer_max_frame, true);
                self.close_answered(stream);
            }
        }
    }

    /// A trailers-only response carrying `status`.
    fn respond_status(&mut self, stream: u32, status: &Status) {
        let mut block = Vec::with_capacity(64 + status.message.len());
        block.extend_from_slice(RESPONSE_HEADERS);
        hpack::put_literal(
            &mut block,
            b"grpc-status",
            (status.code as u32).to_string().as_bytes(),
        );
        let mut message = grpc::percent_encode(&status.message);
        message.truncate(MAX_STATUS_MESSAGE);
        hpack::put_literal(&mut block, b"grpc-message", &message);
        frame::put_headers(&mut self.out, stream, &block, self.peer_max_frame, true);
        self.close_answered(stream);
    }

    /// Our side of `stream` has ended; if the peer is still sending, ask it to stop.
    fn close_answered(&mut self, stream: u32) {
        if let Some(s) = self.streams.remove(&stream) {
            self.buffered -= s.body.len();
            if !s.recv_closed {
                frame::put_rst_stream(&mut self.out, stream, ErrorCode::NoError);
            }
        }
    }

    fn reset(&mut self, stream: u32, code: ErrorCode) {
        frame::put_rst_stream(&mut self.out, stream, code);
        self.forget(stream);
    }

    fn forget(&mut self, stream: u32) {
        if let Some(s) = self.streams.remove(&stream) {
            self.buffered -= s.body.len();
        }
    }

    /// Sends as much of the waiting responses as the windows allow, in order.
    fn flush_blocked(&mut self) {
        let mut waiting = self.blocked.len();
        while waiting > 0 && self.send_window > 0 {
            waiting -= 1;
            let Some(stream) = self.blocked.pop_front() else {
                break;
            };
            let Some(s) = self.streams.get_mut(&stream) else {
                continue;
            };
            let Some(p) = s.pending.as_mut() else {
                continue;
            };
            let left = p.data.len() - p.sent;
            let room = self.send_window.min(s.send_window).max(0) as usize;
            let n = left.min(room);
            if n > 0 || left == 0 {
                frame::put_data(
                    &mut self.out,
                    stream,
                    &p.data[p.sent..p.sent + n],
                    self.peer_max_frame,
                    false,
                );
                p.sent += n;
                s.send_window -= n as i64;
                self.send_window -= n as i64;
            }
            if p.sent == p.data.len() {
                frame::put_headers(
                    &mut self.out,
                    stream,
                    TRAILERS_OK,
                    self.peer_max_frame,
                    true,
                );
                self.close_answered(stream);
            } else {
                self.blocked.push_back(stream);
            }
        }
    }
}

/// What a request's header block says, gathered field by field.
#[derive(Default)]
struct RequestHeaders {
    method: Option<usize>,
    unknown_path: Option<String>,
    has_path: bool,
    post: bool,
    has_method: bool,
    grpc: bool,
    /// `grpc-timeout`, read (or what is wrong with it).
    timeout: Option<Result<Duration, String>>,
}

impl RequestHeaders {
    fn field(&mut self, methods: &[&str], name: &[u8], value: &[u8]) {
        match name {
            b":path" => {
                self.has_path = true;
                self.method = methods.iter().position(|m| m.as_bytes() == value);
                if self.method.is_none() {
                    self.unknown_path = Some(String::from_utf8_lossy(value).into_owned());
                }
            }
            b":method" => {
                self.has_method = true;
                self.post = value == b"POST";
            }
            b"content-type" => {
                self.grpc = value.starts_with(b"application/grpc");
            }
            b"grpc-timeout" => self.timeout = Some(grpc::parse_timeout(value)),
            _ => {}
        }
    }

    fn target(self) -> Target {
        if !self.has_path || !self.has_method {
            return Target::Http(400);
        }
        if !self.post {
            return Target::Http(405);
        }
        if !self.grpc {
            return Target::Http(415);
        }
        if let Some(Err(why)) = self.timeout {
            return Target::Status(Status::new(Code::InvalidArgument, why));
        }
        match self.method {
            Some(m) => Target::Method(m),
            None => Target::Status(Status::new(
                Code::Unimplemented,
                format!("unknown method {}", self.unknown_path.unwrap_or_default()),
            )),
        }
    }
}

#[cfg(test)]
mod tests;
