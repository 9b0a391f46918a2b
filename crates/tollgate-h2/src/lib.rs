//! A small HTTP/2 layer for unary gRPC over cleartext connections (h2c with prior
//! knowledge, as Envoy and gRPC clients speak to a rate limit service), written so that
//! a server can decide a whole read's worth of requests and answer them in one write.
//!
//! It is sans I/O: [`ServerConn`] and [`ClientConn`] take the bytes read from a socket
//! and return calls or replies, and leave the bytes to write in a buffer. The caller
//! owns the socket, the scheduling and the handlers. Header blocks are decoded by
//! [`hpack::Decoder`] (dynamic table, Huffman codes; tested against RFC 7541's examples
//! and differentially against `loona-hpack`); what the server sends uses static-table
//! references and plain literals, so it needs no encoder state.
//!
//! Scope: unary calls (one request message, one response message), no compression, no
//! TLS, no server push, priorities ignored. Everything else a peer may send is either
//! handled (flow control both ways, SETTINGS, PING, GOAWAY, RST_STREAM, CONTINUATION,
//! padding) or answered with the RFC 9113 error for it. Memory and CPU per connection
//! are bounded: concurrent and unfinished streams, message size, header block and
//! decoded header list sizes, buffered request bytes, the rate of cheap frames and of
//! streams reset before their call ran all have limits, and so has how long an idle or
//! silent connection is kept ([`ServerSettings`]; see [`server`]).

pub mod client;
pub mod frame;
pub mod grpc;
pub mod hpack;
pub mod server;

pub use client::{ClientConn, Reply};
pub use server::{Budget, Call, ServerConn, ServerSettings, SharedLimits};

/// Writes what it can of `out` with a non-blocking `write` (a socket's `try_write`)
/// and drops the written bytes from the front; a write that would block is not an
/// error (the rest waits for the next turn). Both sides' connection loops use it.
pub fn write_some(
    out: &mut Vec<u8>,
    write: impl FnOnce(&[u8]) -> std::io::Result<usize>,
) -> std::io::Result<()> {
    if out.is_empty() {
        return Ok(());
    }
    match write(out) {
        Ok(n) => {
            out.drain(..n);
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(()),
        Err(e) => Err(e),
    }
}

/// HTTP/2 error codes (RFC 9113 §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[repr(u32)]
pub enum ErrorCode {
    /// NO_ERROR
    #[error("no error")]
    NoError = 0x0,
    /// PROTOCOL_ERROR
    #[error("protocol error")]
    Protocol = 0x1,
    /// INTERNAL_ERROR
    #[error("internal error")]
    Internal = 0x2,
    /// FLOW_CONTROL_ERROR
    #[error("flow-control error")]
    FlowControl = 0x3,
    /// STREAM_CLOSED
    #[error("stream closed")]
    StreamClosed = 0x5,
    /// FRAME_SIZE_ERROR
    #[error("frame size error")]
    FrameSize = 0x6,
    /// REFUSED_STREAM
    #[error("refused stream")]
    RefusedStream = 0x7,
    /// CANCEL
    #[error("cancel")]
    Cancel = 0x8,
    /// COMPRESSION_ERROR
    #[error("header compression error")]
    Compression = 0x9,
    /// ENHANCE_YOUR_CALM
    #[error("enhance your calm")]
    EnhanceYourCalm = 0xb,
}

/// Why a connection ended with an error. The GOAWAY (for [`ServerConn`]) is already in
/// the output buffer; write it, then close.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("HTTP/2 connection error ({code}): {reason}")]
pub struct ConnError {
    /// The error code sent to the peer.
    pub code: ErrorCode,
    /// What went wrong, for the log.
    pub reason: String,
}

impl ConnError {
    pub(crate) fn new(code: ErrorCode, reason: impl Into<String>) -> Self {
        Self {
            code,
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod write_tests {
    use super::write_some;
    use std::io::{Error, ErrorKind};

    #[test]
    fn write_some_drops_what_was_written_and_waits_on_would_block() {
        let mut out = b"abcdef".to_vec();
        write_some(&mut out, |b| Ok(b.len().min(4))).unwrap();
        assert_eq!(out, b"ef");
        write_some(&mut out, |_| Err(Error::from(ErrorKind::WouldBlock))).unwrap();
        assert_eq!(out, b"ef", "nothing written, nothing lost");
        let e = write_some(&mut out, |_| Err(Error::from(ErrorKind::BrokenPipe)));
        assert_eq!(e.unwrap_err().kind(), ErrorKind::BrokenPipe);
        let mut empty = Vec::new();
        write_some(&mut empty, |_| {
            panic!("not called when there is nothing to write")
        })
        .unwrap();
    }
}
