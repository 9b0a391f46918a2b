//! [`ServerConn`]: the server side of one HTTP/2 connection carrying unary gRPC calls.
//!
//! Feed it what the socket gave ([`ServerConn::receive`]); it returns each complete call
//! (stream, method, message) and answers everything else itself: SETTINGS, PING,
//! WINDOW_UPDATE, unknown methods (`UNIMPLEMENTED`), non-gRPC requests (HTTP 415/405),
//! malformed bodies, malformed requests (RST_STREAM), protocol errors (GOAWAY). Answer
//! calls in any order with [`ServerConn::respond`]; write [`ServerConn::output`] to the
//! socket whenever it is not empty; call [`ServerConn::tick`] at
//! [`ServerConn::deadline`] for the connection's timers (keepalive, idle, preface).
//!
//! What a hostile peer can make it do is bounded (each bound is a [`ServerSettings`]
//! field, or a [`SharedLimits`] one for all connections together): memory (streams,
//! unfinished streams, buffered request bytes, header block and decoded header list
//! sizes), and CPU per byte received: a header list is decoded only
//! up to the advertised `SETTINGS_MAX_HEADER_LIST_SIZE` (the connection ends at four
//! times that, as h2 does); a SETTINGS frame costs one pass over the open streams
//! whatever its length; a WINDOW_UPDATE visits only answers it can move; SETTINGS,
//! PING, empty DATA and CONTINUATION frames, and streams the client resets before
//! their call was handed out (CVE-2023-44487), each draw on a token bucket per
//! connection, past which the connection ends with GOAWAY `ENHANCE_YOUR_CALM`. Calls
//! in flight are bounded too: a call handed out keeps its stream's place among the
//! `max_concurrent_streams` until it is answered, even when the client resets the
//! stream meanwhile (a reset after hand-off is not premature: Envoy resets a call on
//! its timeout), so resetting calls cannot make the application hold more of them
//! (CVE-2023-44487 again); new streams past the limit are refused (`REFUSED_STREAM`).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::frame::{self, flag, kind, setting, Frame};
use crate::grpc::{self, Code, Status};
use crate::hpack;
use crate::{ConnError, ErrorCode};

/// A token bucket's size and refill rate: `burst` events at once, then `per_second`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Events allowed at once (the bucket's size, full at the start).
    pub burst: u32,
    /// Tokens added back each second.
    pub per_second: u32,
}

/// Limits of one connection. Each bounds memory or CPU an abusive peer could make the
/// server spend, or how long an unused connection is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerSettings {
    /// Streams open at once (`SETTINGS_MAX_CONCURRENT_STREAMS`); more are refused with
    /// `REFUSED_STREAM`, which gRPC clients retry. A call handed out counts until it is
    /// answered ([`ServerConn::respond`]), even when its stream is reset meanwhile, so
    /// that the calls a connection has in flight stay within this limit whatever the
    /// client resets.
    pub max_concurrent_streams: u32,
    /// Streams whose request has not ended (no END_STREAM yet) at once; more are refused
    /// with `REFUSED_STREAM`. As many as `max_concurrent_streams` by default: nghttp2
    /// clients (h2load) send a burst's HEADERS frames before its DATA, so a lower cap
    /// refuses their bursts. What many connections hold together is bounded by
    /// [`SharedLimits`] instead.
    pub max_unfinished_streams: u32,
    /// Largest request message; a larger one is answered `RESOURCE_EXHAUSTED`.
    pub max_message: usize,
    /// Largest header block (HEADERS plus CONTINUATION frames), encoded; larger is a
    /// connection error (`ENHANCE_YOUR_CALM`).
    pub max_header_block: usize,
    /// Largest decoded header list (`SETTINGS_MAX_HEADER_LIST_SIZE`, RFC 7541 §4.1's
    /// sizes: name + value + 32 per field). A larger request is answered HTTP 431 and
    /// reset, as h2 does; past four times this, decoding stops and the connection ends
    /// (`ENHANCE_YOUR_CALM`).
    pub max_header_list: usize,
    /// Request bytes held for all unfinished streams together; more is a connection
    /// error (`ENHANCE_YOUR_CALM`).
    pub max_buffered: usize,
    /// The connection's receive window, granted at start and topped up as data arrives.
    pub connection_window: u32,
    /// How long a new connection has to send the preface and its SETTINGS.
    pub preface_timeout: Duration,
    /// A connection with no stream open for this long is closed gracefully (GOAWAY,
    /// a PING round trip, a final GOAWAY, then close); `None`: never.
    pub idle_timeout: Option<Duration>,
    /// After this long without receiving anything, the server sends a PING; `None`: no
    /// keepalive PINGs.
    pub keepalive_interval: Option<Duration>,
    /// How long a keepalive PING may wait for its acknowledgement before the connection
    /// is closed.
    pub keepalive_timeout: Duration,
    /// SETTINGS, PING, empty DATA (without END_STREAM) and CONTINUATION frames.
    pub control_frames: Budget,
    /// Streams the client resets before their call was handed out (unfinished, or
    /// finished and reset in the same read), which cost work and answer nothing.
    pub premature_resets: Budget,
}

impl Default for ServerSettings {
    fn default() -> Self {
        Self {
            max_concurrent_streams: 1024,
            max_unfinished_streams: 1024,
            max_message: 4 << 20,
            max_header_block: 64 << 10,
            // hyper's default (tonic's transport).
            max_header_list: 16 << 10,
            // One message of the largest size, and room for the others.
            max_buffered: (4 << 20) + (64 << 10),
            connection_window: 1 << 20,
            preface_timeout: Duration::from_secs(10),
            idle_timeout: Some(Duration::from_secs(300)),
            keepalive_interval: Some(Duration::from_secs(60)),
            keepalive_timeout: Duration::from_secs(20),
            control_frames: Budget {
                burst: 1_000,
                per_second: 100,
            },
            premature_resets: Budget {
                burst: 1_000,
                per_second: 100,
            },
        }
    }
}

/// Limits shared by all the connections of a server, so that many connections together
/// cannot hold more than these, whatever each one's own limits: streams whose request
/// has not ended, and the request bytes they hold. A connection reports what it holds
/// when a read leaves something unfinished (a unary call that arrives whole in a read
/// touches no shared counter), and gives it back when it ends.
#[derive(Debug)]
pub struct SharedLimits {
    unfinished_streams: AtomicUsize,
    buffered: AtomicUsize,
    max_unfinished_streams: usize,
    max_buffered: usize,
}

impl SharedLimits {
    /// Limits of `max_unfinished_streams` streams and `max_buffered` request bytes held
    /// by all connections together.
    pub fn new(max_unfinished_streams: usize, max_buffered: usize) -> Arc<Self> {
        Arc::new(Self {
            unfinished_streams: AtomicUsize::new(0),
            buffered: AtomicUsize::new(0),
            max_unfinished_streams,
            max_buffered,
        })
    }

    /// Unfinished streams held by all connections (as of their latest reads).
    pub fn unfinished_streams(&self) -> usize {
        self.unfinished_streams.load(Ordering::Relaxed)
    }

    /// Request bytes held by all connections (as of their latest reads).
    pub fn buffered(&self) -> usize {
        self.buffered.load(Ordering::Relaxed)
    }
}

/// Moves a shared counter from `reported` to `now`.
fn report(counter: &AtomicUsize, reported: &mut usize, now: usize) {
    if now > *reported {
        counter.fetch_add(now - *reported, Ordering::Relaxed);
    } else if now < *reported {
        counter.fetch_sub(*reported - now, Ordering::Relaxed);
    }
    *reported = now;
}

/// Whether `shared` (as last reported, plus what a connection holds since: `held`
/// against `reported`) leaves room for `more` (streams, bytes).
fn shared_room(
    shared: Option<&SharedLimits>,
    held: (usize, usize),
    reported: (usize, usize),
    more: (usize, usize),
) -> bool {
    let Some(shared) = shared else {
        return true;
    };
    let streams = (shared.unfinished_streams() + held.0).saturating_sub(reported.0) + more.0;
    let bytes = (shared.buffered() + held.1).saturating_sub(reported.1) + more.1;
    streams <= shared.max_unfinished_streams && bytes <= shared.max_buffered
}

/// A token bucket ([`Budget`]), in millionths of a token.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    micros: u64,
    last: Instant,
    budget: Budget,
}

impl Bucket {
    const ONE: u64 = 1_000_000;

    fn new(budget: Budget, now: Instant) -> Self {
        Self {
            micros: u64::from(budget.burst) * Self::ONE,
            last: now,
            budget,
        }
    }

    /// Takes a token at `now`; `false` when the bucket is empty.
    fn take(&mut self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.last);
        if !elapsed.is_zero() {
            self.last = now;
            let added = u64::try_from(elapsed.as_micros())
                .unwrap_or(u64::MAX)
                .saturating_mul(u64::from(self.budget.per_second));
            self.micros = self
                .micros
                .saturating_add(added)
                .min(u64::from(self.budget.burst) * Self::ONE);
        }
        if self.micros < Self::ONE {
            return false;
        }
        self.micros -= Self::ONE;
        true
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
    /// `content-length`, when the request has one.
    content_length: Option<u64>,
    /// DATA bytes received (without padding).
    received: u64,
    /// The [`ServerConn::receives`] count of the `receive` that handed the call out (0:
    /// not handed out).
    handed_out: u64,
    /// The stream was reset (by the client, or by us for an error) after its call was
    /// handed out and before it was answered: closed for the protocol, but kept (and
    /// counted against `max_concurrent_streams`) until [`ServerConn::respond`] drops
    /// the answer.
    reset: bool,
    send_window: i64,
    pending: Option<Pending>,
    /// Whether the stream is in [`ServerConn::blocked`].
    queued: bool,
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
/// An unknown `:path` is named in the `UNIMPLEMENTED` message up to this many bytes.
const MAX_PATH_IN_MESSAGE: usize = 128;
/// The size of the HPACK dynamic table our header blocks start from (the initial
/// `SETTINGS_HEADER_TABLE_SIZE`).
const DEFAULT_TABLE_SIZE: u32 = 4096;
/// The payload of the keepalive PING.
const KEEPALIVE_PING: &[u8; 8] = b"tg-alive";
/// The payload of the PING that follows the first GOAWAY of a graceful close.
const GOAWAY_PING: &[u8; 8] = b"tg-close";
/// The last stream id a client can open: the first GOAWAY of a graceful close names it.
const MAX_STREAM: u32 = 0x7fff_ffff;

/// The server side of one connection (see the module documentation).
pub struct ServerConn {
    methods: &'static [&'static str],
    settings: ServerSettings,
    phase: Phase,
    decoder: hpack::Decoder,
    /// Keyed with aHash (random keys, like std's SipHash, and cheaper per call).
    streams: HashMap<u32, Stream, ahash::RandomState>,
    /// Streams whose request has not ended.
    unfinished: usize,
    last_stream: u32,
    continuation: Option<Continuation>,
    peer_max_frame: usize,
    peer_initial_window: i64,
    send_window: i64,
    recv_unacked: u32,
    buffered: usize,
    /// Streams with an answer waiting for window, in the order they became ready; a
    /// stream whose own window is closed leaves the queue until a WINDOW_UPDATE (or a
    /// larger initial window) opens it, so that each turn visits only streams it can
    /// move.
    blocked: VecDeque<u32>,
    /// The final GOAWAY was sent: new streams are refused, and the connection closes
    /// when the open ones are answered.
    going_away: bool,
    /// The size of the peer's HPACK table for our header blocks; a smaller
    /// `SETTINGS_HEADER_TABLE_SIZE` must be acknowledged in our next block (RFC 7541
    /// §4.2). Our blocks use no dynamic entries, so the update is always to 0.
    encoder_table: u32,
    table_update_due: bool,
    /// Counts `receive` calls, to tell a call handed out by this one from older ones.
    receives: u64,
    /// Whether this `receive` reset a stream whose call it had handed out.
    dropped_calls: bool,
    control_frames: Bucket,
    premature_resets: Bucket,
    /// The time of the latest `receive` or `tick`.
    now: Instant,
    started: Instant,
    last_received: Instant,
    /// When the keepalive PING now unanswered was sent.
    ping_sent: Option<Instant>,
    /// Since when no stream is open.
    idle_since: Option<Instant>,
    /// When the first GOAWAY of a graceful close for idleness was sent.
    closing_since: Option<Instant>,
    shared: Option<Arc<SharedLimits>>,
    /// What this connection last reported to `shared`: unfinished streams, buffered
    /// bytes.
    reported: (usize, usize),
    out: Vec<u8>,
}

impl Drop for ServerConn {
    fn drop(&mut self) {
        self.unfinished = 0;
        self.buffered = 0;
        self.report();
    }
}

impl ServerConn {
    /// A connection serving `methods` (`:path`s such as `/pkg.Service/Method`) that
    /// also counts what it holds against `shared` (see [`SharedLimits`]).
    pub fn with_shared(
        settings: ServerSettings,
        methods: &'static [&'static str],
        shared: Arc<SharedLimits>,
    ) -> Self {
        let mut conn = Self::new(settings, methods);
        conn.shared = Some(shared);
        conn
    }

    /// A connection serving `methods` (`:path`s such as `/pkg.Service/Method`); the
    /// server's SETTINGS are already in the output.
    pub fn new(settings: ServerSettings, methods: &'static [&'static str]) -> Self {
        let now = Instant::now();
        let decoder = hpack::Decoder::new(DEFAULT_TABLE_SIZE as usize);
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
                    u32::try_from(settings.max_header_list).unwrap_or(u32::MAX),
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
            unfinished: 0,
            last_stream: 0,
            continuation: None,
            peer_max_frame: frame::DEFAULT_MAX_FRAME,
            peer_initial_window: frame::DEFAULT_WINDOW,
            send_window: frame::DEFAULT_WINDOW,
            recv_unacked: 0,
            buffered: 0,
            blocked: VecDeque::new(),
            going_away: false,
            encoder_table: DEFAULT_TABLE_SIZE,
            table_update_due: false,
            receives: 0,
            dropped_calls: false,
            control_frames: Bucket::new(settings.control_frames, now),
            premature_resets: Bucket::new(settings.premature_resets, now),
            now,
            started: now,
            last_received: now,
            ping_sent: None,
            idle_since: Some(now),
            closing_since: None,
            shared: None,
            reported: (0, 0),
            out,
        }
    }

    /// Reports what this connection holds to the shared limits, if it has any.
    fn report(&mut self) {
        if let Some(shared) = &self.shared {
            report(
                &shared.unfinished_streams,
                &mut self.reported.0,
                self.unfinished,
            );
            report(&shared.buffered, &mut self.reported.1, self.buffered);
        }
    }

    /// Whether the shared limits leave room for `streams` more unfinished streams and
    /// `bytes` more request bytes from this connection.
    fn shared_room(&self, streams: usize, bytes: usize) -> bool {
        shared_room(
            self.shared.as_deref(),
            (self.unfinished, self.buffered),
            self.reported,
            (streams, bytes),
        )
    }

    /// The bytes to write to the peer; the caller removes what it wrote.
    pub fn output(&mut self) -> &mut Vec<u8> {
        &mut self.out
    }

    /// Streams opened and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.streams.len()
    }

    /// Whether the connection is closing (after [`shutdown`](Self::shutdown), or idle)
    /// and has nothing left to answer: write the output and close.
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

    /// When [`tick`](Self::tick) must next be called (the earliest of the connection's
    /// timers), or `None` when no timer runs. Calling it earlier does no harm.
    pub fn deadline(&self) -> Option<Instant> {
        let s = &self.settings;
        let mut at: Option<Instant> = None;
        let mut earliest = |t: Option<Instant>| {
            if let Some(t) = t {
                at = Some(at.map_or(t, |a| a.min(t)));
            }
        };
        if self.phase != Phase::Open {
            earliest(self.started.checked_add(s.preface_timeout));
        }
        match self.ping_sent {
            Some(sent) => earliest(sent.checked_add(s.keepalive_timeout)),
            None => earliest(
                s.keepalive_interval
                    .and_then(|i| self.last_received.checked_add(i)),
            ),
        }
        if !self.going_away {
            match self.closing_since {
                Some(since) => earliest(since.checked_add(s.keepalive_timeout)),
                None => earliest(
                    self.idle_since
                        .zip(s.idle_timeout)
                        .and_then(|(since, idle)| since.checked_add(idle)),
                ),
            }
        }
        at
    }

    /// Runs the timers due at `now`: the preface timeout (an error), keepalive (a PING
    /// after `keepalive_interval` of silence; an error when it is not answered within
    /// `keepalive_timeout`), and the idle timeout (a GOAWAY for the highest stream id
    /// and a PING, then, when the PING comes back or after `keepalive_timeout`, the
    /// final GOAWAY: streams the client opened meanwhile are still answered, none is
    /// lost in flight). On an error the GOAWAY is in the output: write it and close.
    pub fn tick(&mut self, now: Instant) -> Result<(), ConnError> {
        self.now = now;
        let s = self.settings;
        let due =
            |since: Instant, after: Duration| since.checked_add(after).is_some_and(|t| t <= now);
        if self.phase != Phase::Open && due(self.started, s.preface_timeout) {
            return Err(self.fail(ErrorCode::NoError, "no HTTP/2 preface and SETTINGS in time"));
        }
        match self.ping_sent {
            Some(sent) if due(sent, s.keepalive_timeout) => {
                return Err(self.fail(ErrorCode::NoError, "keepalive PING not answered"));
            }
            Some(_) => {}
            None => {
                if s.keepalive_interval
                    .is_some_and(|i| due(self.last_received, i))
                {
                    frame::put_ping(&mut self.out, KEEPALIVE_PING);
                    self.ping_sent = Some(now);
                }
            }
        }
        if !self.going_away {
            match self.closing_since {
                Some(since) if due(since, s.keepalive_timeout) => self.final_goaway(),
                Some(_) => {}
                None => {
                    let idle = self
                        .idle_since
                        .zip(s.idle_timeout)
                        .is_some_and(|(since, idle)| due(since, idle));
                    if idle && self.phase == Phase::Open {
                        frame::put_goaway(&mut self.out, MAX_STREAM, ErrorCode::NoError, b"idle");
                        frame::put_ping(&mut self.out, GOAWAY_PING);
                        self.closing_since = Some(now);
                    }
                }
            }
        }
        Ok(())
    }

    /// The second GOAWAY of a graceful close: the streams opened so far are answered,
    /// then the connection closes.
    fn final_goaway(&mut self) {
        if !self.going_away {
            self.going_away = true;
            frame::put_goaway(&mut self.out, self.last_stream, ErrorCode::NoError, b"idle");
        }
    }

    /// Processes the complete frames at the start of `input`, appending finished calls
    /// to `calls`; returns how many bytes it used (keep the rest and call again with
    /// more). On a connection error the GOAWAY is in the output: write it and close.
    pub fn receive(&mut self, input: &[u8], calls: &mut Vec<Call>) -> Result<usize, ConnError> {
        self.receive_at(Instant::now(), input, calls)
    }

    /// [`receive`](Self::receive), with the time it happens (for the rate limits and
    /// timers).
    pub fn receive_at(
        &mut self,
        now: Instant,
        input: &[u8],
        calls: &mut Vec<Call>,
    ) -> Result<usize, ConnError> {
        self.now = now;
        self.last_received = now;
        self.receives += 1;
        self.dropped_calls = false;
        let before = calls.len();
        let result = self.receive_frames(input, calls);
        if (self.unfinished, self.buffered) != self.reported {
            self.report();
        }
        if self.dropped_calls {
            // Calls of this read whose stream the client reset before they were handed
            // out are dropped: not decided, not charged.
            let streams = &self.streams;
            let mut i = 0;
            calls.retain(|c| {
                i += 1;
                i <= before || streams.contains_key(&c.stream)
            });
        }
        result
    }

    fn receive_frames(&mut self, input: &[u8], calls: &mut Vec<Call>) -> Result<usize, ConnError> {
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

    /// Answers the call on `stream` with a message or a status. The answer to a stream
    /// reset meanwhile is dropped, and the stream's place among the
    /// `max_concurrent_streams` freed.
    pub fn respond(&mut self, stream: u32, reply: Result<&[u8], &Status>) {
        match self.streams.get(&stream) {
            None => return,
            Some(s) if s.reset => {
                self.remove(stream);
                return;
            }
            Some(_) => {}
        }
        match reply {
            Ok(message) => {
                self.put_block(stream, RESPONSE_HEADERS, false);
                let mut data = Vec::with_capacity(grpc::PREFIX_LEN + message.len());
                grpc::put_message(&mut data, message);
                if let Some(s) = self.streams.get_mut(&stream) {
                    s.pending = Some(Pending { data, sent: 0 });
                    s.queued = true;
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

    /// Takes a token for a cheap frame; past the budget, the connection ends.
    fn control_frame(&mut self, what: &str) -> Result<(), ConnError> {
        if self.control_frames.take(self.now) {
            return Ok(());
        }
        Err(self.fail(
            ErrorCode::EnhanceYourCalm,
            &format!("too many {what} frames"),
        ))
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
            kind::CONTINUATION => {
                self.control_frame("CONTINUATION")?;
                self.continuation(f, calls)
            }
            kind::PRIORITY => self.check_len(&f, 5, true),
            kind::RST_STREAM => self.rst_stream(f),
            kind::SETTINGS => {
                self.control_frame("SETTINGS")?;
                self.settings(f)
            }
            kind::PUSH_PROMISE => Err(self.fail(ErrorCode::Protocol, "a client cannot push")),
            kind::PING => {
                self.control_frame("PING")?;
                self.check_len(&f, 8, false)?;
                if !f.has(flag::ACK) {
                    frame::put_ping_ack(&mut self.out, f.payload);
                } else if f.payload == KEEPALIVE_PING {
                    self.ping_sent = None;
                } else if f.payload == GOAWAY_PING && self.closing_since.is_some() {
                    self.final_goaway();
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

    /// A SETTINGS frame: every entry is checked, but only the last value of each setting
    /// is applied, once, so that a frame of thousands of entries costs one pass over the
    /// open streams.
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
        let mut initial_window = None;
        let mut max_frame = None;
        let mut smallest_table = None::<u32>;
        for entry in f.payload.chunks_exact(6) {
            let id = u16::from_be_bytes([entry[0], entry[1]]);
            let value = u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]);
            match id {
                setting::ENABLE_PUSH if value > 1 => {
                    return Err(self.fail(ErrorCode::Protocol, "SETTINGS_ENABLE_PUSH above 1"));
                }
                setting::INITIAL_WINDOW_SIZE => {
                    if i64::from(value) > frame::MAX_WINDOW {
                        return Err(self.fail(ErrorCode::FlowControl, "initial window too large"));
                    }
                    initial_window = Some(i64::from(value));
                }
                setting::MAX_FRAME_SIZE => {
                    if !(frame::DEFAULT_MAX_FRAME as u32..=frame::MAX_MAX_FRAME).contains(&value) {
                        return Err(
                            self.fail(ErrorCode::Protocol, "invalid SETTINGS_MAX_FRAME_SIZE")
                        );
                    }
                    max_frame = Some(value as usize);
                }
                setting::HEADER_TABLE_SIZE => {
                    // Every value counts here: the smallest one since our last block is
                    // what the update must go down to (RFC 7541 §4.2).
                    smallest_table = Some(smallest_table.map_or(value, |t| t.min(value)));
                }
                _ => {}
            }
        }
        if let Some(size) = smallest_table {
            if size < self.encoder_table {
                self.table_update_due = true;
            }
        }
        if let Some(frame_size) = max_frame {
            self.peer_max_frame = frame_size;
        }
        if let Some(value) = initial_window {
            let delta = value - self.peer_initial_window;
            self.peer_initial_window = value;
            if delta != 0 {
                let mut overflow = false;
                for (&id, s) in self.streams.iter_mut().filter(|(_, s)| !s.reset) {
                    s.send_window += delta;
                    overflow |= s.send_window > frame::MAX_WINDOW;
                    if s.pending.is_some() && !s.queued && s.send_window > 0 {
                        s.queued = true;
                        self.blocked.push_back(id);
                    }
                }
                if overflow {
                    return Err(self.fail(ErrorCode::FlowControl, "stream window overflow"));
                }
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
        } else if let Some(s) = self.streams.get_mut(&f.stream).filter(|s| !s.reset) {
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
            if s.pending.is_some() && !s.queued && s.send_window > 0 {
                s.queued = true;
                self.blocked.push_back(f.stream);
            }
        } else if f.stream > self.last_stream {
            return Err(self.fail(ErrorCode::Protocol, "WINDOW_UPDATE on an idle stream"));
        }
        self.flush_blocked();
        Ok(())
    }

    fn rst_stream(&mut self, f: Frame<'_>) -> Result<(), ConnError> {
        self.check_len(&f, 4, true)?;
        if f.stream > self.last_stream {
            return Err(self.fail(ErrorCode::Protocol, "RST_STREAM on an idle stream"));
        }
        let Some(s) = self.streams.get(&f.stream).filter(|s| !s.reset) else {
            // Closed already (answered, refused, or reset): nothing to do.
            return Ok(());
        };
        // Reset before its call was handed out (the request unfinished), or handed out
        // by this very read (so dropped from it, by `forget`): work done for nothing. A
        // call handed out before is kept until answered (`forget`).
        let this_read = s.handed_out == self.receives;
        if (!s.recv_closed || this_read) && !self.premature_resets.take(self.now) {
            self.forget(f.stream);
            return Err(self.fail(ErrorCode::EnhanceYourCalm, "too many streams reset"));
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
        let end = f.has(flag::END_STREAM);
        if f.payload.is_empty() && !end {
            self.control_frame("empty DATA")?;
        }
        let max_message = self.settings.max_message + grpc::PREFIX_LEN;
        let Some(s) = self.streams.get_mut(&f.stream).filter(|s| !s.reset) else {
            // Closed (answered or reset): ignored, as RFC 9113 §5.1 allows after a reset.
            return Ok(());
        };
        if s.recv_closed {
            self.reset(f.stream, ErrorCode::StreamClosed);
            return Ok(());
        }
        s.received += body.len() as u64;
        if s.content_length
            .is_some_and(|n| s.received > n || (end && s.received != n))
        {
            // RFC 9113 §8.1.1: a body that does not match content-length is malformed.
            self.reset(f.stream, ErrorCode::Protocol);
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
            // Bytes held past this frame count against the server's shared limit; a
            // message that arrives whole is handed out at once and does not.
            let held = (self.unfinished, self.buffered);
            if !end
                && self.shared.is_some()
                && !shared_room(self.shared.as_deref(), held, self.reported, (0, body.len()))
            {
                let status = Status::new(
                    Code::ResourceExhausted,
                    "the server holds too much unfinished request data; try again",
                );
                self.respond_status(f.stream, &status);
                return Ok(());
            }
            s.body.extend_from_slice(body);
            self.buffered += body.len();
        }
        if end {
            s.recv_closed = true;
            self.unfinished -= 1;
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
        // HPACK dynamic table in step with the peer's; fields past the advertised list
        // size are skipped (and past four times that, decoding stops).
        let mut request = RequestHeaders::default();
        let methods = self.methods;
        let decoded =
            self.decoder
                .decode_limited(block, self.settings.max_header_list, |name, value| {
                    request.field(methods, name, value)
                });
        let complete = match decoded {
            Ok(list) => list == hpack::List::Complete,
            Err(hpack::DecodeError::TooLarge) => {
                return Err(self.fail(ErrorCode::EnhanceYourCalm, "header list far too large"));
            }
            Err(_) => {
                return Err(self.fail(ErrorCode::Compression, "cannot decode the header block"))
            }
        };
        if let Some(s) = self.streams.get_mut(&stream).filter(|s| !s.reset) {
            // Trailers from the client: they must end the stream, and hold no
            // pseudo-header (RFC 9113 §8.1).
            if s.recv_closed {
                self.reset(stream, ErrorCode::StreamClosed);
            } else if !end_stream
                || !complete
                || request.pseudo
                || request.malformed
                || s.content_length.is_some_and(|n| n != s.received)
            {
                self.reset(stream, ErrorCode::Protocol);
            } else {
                s.recv_closed = true;
                self.unfinished -= 1;
                self.finish(stream, calls);
            }
            return Ok(());
        }
        if stream <= self.last_stream {
            // A new stream must have a higher id than every stream before it (RFC 9113
            // §5.1.1); ids skipped are closed, and a stream answered or reset takes
            // no new request.
            return Err(self.fail(ErrorCode::Protocol, "HEADERS on a closed stream"));
        }
        self.last_stream = stream;
        if !complete {
            // RFC 9113 §10.5.1 and h2: 431, and the stream reset if the client is still
            // sending.
            let mut block = Vec::with_capacity(8);
            hpack::put_indexed_name(&mut block, hpack::STATUS, b"431");
            self.put_block(stream, &block, true);
            if !end_stream {
                frame::put_rst_stream(&mut self.out, stream, ErrorCode::Protocol);
            }
            return Ok(());
        }
        if request.malformed || !request.has_method || !request.has_path || !request.has_scheme {
            // RFC 9113 §8.1.1: a malformed request is a stream error.
            frame::put_rst_stream(&mut self.out, stream, ErrorCode::Protocol);
            return Ok(());
        }
        let s = &self.settings;
        if self.going_away
            || self.streams.len() >= s.max_concurrent_streams as usize
            || (!end_stream
                && (self.unfinished >= s.max_unfinished_streams as usize
                    || !self.shared_room(1, 0)))
        {
            frame::put_rst_stream(&mut self.out, stream, ErrorCode::RefusedStream);
            return Ok(());
        }
        let timeout = request
            .timeout
            .as_ref()
            .and_then(|t| t.as_ref().ok())
            .copied();
        let content_length = request.content_length;
        if end_stream && content_length.is_some_and(|n| n != 0) {
            frame::put_rst_stream(&mut self.out, stream, ErrorCode::Protocol);
            return Ok(());
        }
        let target = request.target();
        self.streams.insert(
            stream,
            Stream {
                target,
                timeout,
                body: Vec::new(),
                recv_closed: end_stream,
                content_length,
                received: 0,
                handed_out: 0,
                reset: false,
                send_window: self.peer_initial_window,
                pending: None,
                queued: false,
            },
        );
        self.idle_since = None;
        if end_stream {
            self.finish(stream, calls);
        } else {
            self.unfinished += 1;
        }
        Ok(())
    }

    /// The peer has sent the whole request on `stream`: hand out the call or answer it.
    fn finish(&mut self, stream: u32, calls: &mut Vec<Call>) {
        let receives = self.receives;
        let Some(s) = self.streams.get_mut(&stream) else {
            return;
        };
        let mut body = std::mem::take(&mut s.body);
        let timeout = s.timeout;
        // Cheap for a method (the hot path); a status is cloned, on error paths only.
        let target = s.target.clone();
        if let Target::Method(_) = target {
            s.handed_out = receives;
        }
        self.buffered -= body.len();
        match target {
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
                self.put_block(stream, &block, true);
                self.close_answered(stream);
            }
        }
    }

    /// Writes a header block on `stream`, first with the dynamic table size update the
    /// peer's lowered `SETTINGS_HEADER_TABLE_SIZE` calls for (once per connection).
    #[inline]
    fn put_block(&mut self, stream: u32, block: &[u8], end: bool) {
        if self.table_update_due {
            self.table_update_due = false;
            self.encoder_table = 0;
            let mut with_update = Vec::with_capacity(block.len() + 1);
            // A dynamic table size update to 0 (RFC 7541 §6.3).
            with_update.push(0x20);
            with_update.extend_from_slice(block);
            frame::put_headers(
                &mut self.out,
                stream,
                &with_update,
                self.peer_max_frame,
                end,
            );
        } else {
            frame::put_headers(&mut self.out, stream, block, self.peer_max_frame, end);
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
        self.put_block(stream, &block, true);
        self.close_answered(stream);
    }

    /// Our side of `stream` has ended; if the peer is still sending, ask it to stop.
    #[inline]
    fn close_answered(&mut self, stream: u32) {
        if let Some(s) = self.remove(stream) {
            if !s.recv_closed {
                frame::put_rst_stream(&mut self.out, stream, ErrorCode::NoError);
            }
        }
    }

    fn reset(&mut self, stream: u32, code: ErrorCode) {
        frame::put_rst_stream(&mut self.out, stream, code);
        self.forget(stream);
    }

    /// Closes `stream` without an answer. A call handed out by an earlier `receive` and
    /// not answered yet keeps its place until [`respond`](Self::respond) (the
    /// application holds it: the client cannot make it hold more calls than
    /// `max_concurrent_streams` by resetting them); one handed out by this `receive` is
    /// dropped from its calls.
    fn forget(&mut self, stream: u32) {
        let receives = self.receives;
        if let Some(s) = self.streams.get_mut(&stream) {
            if s.reset {
                return;
            }
            if s.handed_out != 0 && s.pending.is_none() {
                if s.handed_out != receives {
                    s.reset = true;
                    return;
                }
                self.dropped_calls = true;
            }
        }
        self.remove(stream);
    }

    /// Removes a stream, releasing what it held.
    #[inline]
    fn remove(&mut self, stream: u32) -> Option<Stream> {
        let s = self.streams.remove(&stream)?;
        self.buffered -= s.body.len();
        if !s.recv_closed {
            self.unfinished -= 1;
        }
        if self.streams.is_empty() {
            self.idle_since = Some(self.now);
        }
        Some(s)
    }

    /// Sends as much of the waiting responses as the windows allow, in order. Visits
    /// only streams it can move: one whose own window is closed leaves the queue.
    fn flush_blocked(&mut self) {
        while self.send_window > 0 {
            let Some(&stream) = self.blocked.front() else {
                break;
            };
            let Some(s) = self.streams.get_mut(&stream) else {
                // Reset meanwhile.
                self.blocked.pop_front();
                continue;
            };
            let Some(p) = s.pending.as_mut() else {
                s.queued = false;
                self.blocked.pop_front();
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
                self.blocked.pop_front();
                self.put_block(stream, TRAILERS_OK, true);
                self.close_answered(stream);
            } else if s.send_window <= 0 {
                // Waits for its own window: back in the queue on a WINDOW_UPDATE.
                s.queued = false;
                self.blocked.pop_front();
            }
            // Otherwise the connection's window is spent: it stays first.
        }
    }
}

/// What a request's header block says, gathered field by field, with what makes it
/// malformed (RFC 9113 §8.2, §8.3).
#[derive(Default)]
struct RequestHeaders {
    method: Option<usize>,
    /// The unknown `:path`, at most [`MAX_PATH_IN_MESSAGE`] bytes of it.
    unknown_path: Option<String>,
    has_path: bool,
    has_scheme: bool,
    has_authority: bool,
    post: bool,
    has_method: bool,
    grpc: bool,
    /// A pseudo-header was seen (trailers must have none).
    pseudo: bool,
    /// A regular field was seen (pseudo-headers must come first).
    regular: bool,
    malformed: bool,
    content_length: Option<u64>,
    /// `grpc-timeout`, read (or what is wrong with it).
    timeout: Option<Result<Duration, String>>,
}

/// The bytes a regular field name may hold: no uppercase, no control characters, space,
/// DEL, non-ASCII or colon (RFC 9113 §8.2.1).
const NAME_BYTES: [bool; 256] = {
    let mut ok = [false; 256];
    let mut b = 0x21;
    while b < 0x7f {
        ok[b] = !(b as u8).is_ascii_uppercase() && b != b':' as usize;
        b += 1;
    }
    ok
};

/// Whether `name` is a valid regular field name.
fn valid_name(name: &[u8]) -> bool {
    !name.is_empty() && name.iter().all(|&b| NAME_BYTES[usize::from(b)])
}

/// Whether `value` holds no NUL, CR or LF (RFC 9113 §8.2.1). The common case, no byte
/// below 0x0e (CR), is checked eight bytes at a time (the last eight overlapping), so
/// that it costs a few instructions per field.
fn valid_value(value: &[u8]) -> bool {
    const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);
    const LOW: u64 = u64::from_ne_bytes([0x0e; 8]);
    // Sets a byte's high bit when some byte of `x` is below 0x0e (a classic SWAR test;
    // no false negative, and a false alarm only sends the value to the exact check).
    let below = |x: u64| x.wrapping_sub(LOW) & !x & HIGHS;
    let word = |c: &[u8]| u64::from_ne_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
    let low = if value.len() >= 8 {
        let mut chunks = value.chunks_exact(8);
        let acc = chunks.by_ref().fold(0, |acc, c| acc | below(word(c)));
        acc | below(word(&value[value.len() - 8..])) != 0
    } else {
        value.iter().any(|&b| b < 0x0e)
    };
    !low || !value.iter().any(|&b| b == 0 || b == b'\r' || b == b'\n')
}

impl RequestHeaders {
    /// Reads one field. A value matched exactly against a valid one (a known method's
    /// `:path`, `POST`, `trailers`, digits) needs no byte check; every other value is
    /// checked ([`valid_value`]).
    fn field(&mut self, methods: &[&str], name: &[u8], value: &[u8]) {
        // Whether the value is known to be valid already.
        let mut known = false;
        if name.first() == Some(&b':') {
            self.pseudo = true;
            if self.regular {
                self.malformed = true;
            }
            let seen = match name {
                b":path" => {
                    let seen = self.has_path;
                    self.has_path = true;
                    self.method = methods.iter().position(|m| m.as_bytes() == value);
                    known = self.method.is_some();
                    if self.method.is_none() && !seen {
                        let shown = &value[..value.len().min(MAX_PATH_IN_MESSAGE)];
                        self.unknown_path = Some(String::from_utf8_lossy(shown).into_owned());
                    }
                    seen || value.is_empty()
                }
                b":method" => {
                    let seen = self.has_method;
                    self.has_method = true;
                    self.post = value == b"POST";
                    known = self.post;
                    seen
                }
                b":scheme" => std::mem::replace(&mut self.has_scheme, true),
                b":authority" => std::mem::replace(&mut self.has_authority, true),
                // Unknown, or a response's (`:status`), or extended CONNECT's
                // `:protocol`, which is not enabled.
                _ => true,
            };
            if seen || (!known && !valid_value(value)) {
                self.malformed = true;
            }
            return;
        }
        self.regular = true;
        match name {
            b"content-type" => {
                self.grpc = value.starts_with(b"application/grpc");
            }
            b"grpc-timeout" => self.timeout = Some(grpc::parse_timeout(value)),
            b"te" => {
                known = value == b"trailers";
                self.malformed |= !known;
            }
            b"content-length" => {
                // Digits only, and a number that fits: anything else is malformed.
                let n = (!value.is_empty()).then_some(value).and_then(|digits| {
                    digits.iter().try_fold(0u64, |n, &b| {
                        let digit = b.is_ascii_digit().then(|| u64::from(b - b'0'))?;
                        n.checked_mul(10)?.checked_add(digit)
                    })
                });
                known = n.is_some();
                match (n, self.content_length) {
                    (Some(n), None) => self.content_length = Some(n),
                    (Some(n), Some(m)) if n == m => {}
                    _ => self.malformed = true,
                }
            }
            b"connection" | b"keep-alive" | b"proxy-connection" | b"transfer-encoding"
            | b"upgrade" => self.malformed = true,
            _ => {
                if !valid_name(name) {
                    self.malformed = true;
                }
            }
        }
        if !known && !valid_value(value) {
            self.malformed = true;
        }
    }

    fn target(mut self) -> Target {
        if !self.has_path || !self.has_method || !self.has_scheme {
            // Reset as malformed before; kept for safety.
            return Target::Http(400);
        }
        if !self.post {
            return Target::Http(405);
        }
        if !self.grpc {
            return Target::Http(415);
        }
        if let Some(Err(why)) = self.timeout.take() {
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
