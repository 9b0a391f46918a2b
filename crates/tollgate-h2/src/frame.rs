//! HTTP/2 frames (RFC 9113 §4, §6): the 9-byte header, parsing one frame out of a
//! buffer, and writing the frames this crate sends.

use crate::ErrorCode;

/// The client connection preface (RFC 9113 §3.4).
pub const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Length of a frame header.
pub const HEADER_LEN: usize = 9;
/// The initial and minimum `SETTINGS_MAX_FRAME_SIZE`.
pub const DEFAULT_MAX_FRAME: usize = 16_384;
/// The largest value `SETTINGS_MAX_FRAME_SIZE` may take.
pub const MAX_MAX_FRAME: u32 = (1 << 24) - 1;
/// The initial flow-control window of a connection and of each stream.
pub const DEFAULT_WINDOW: i64 = 65_535;
/// The largest flow-control window.
pub const MAX_WINDOW: i64 = (1 << 31) - 1;

/// Frame types (RFC 9113 §6).
pub mod kind {
    /// DATA
    pub const DATA: u8 = 0x0;
    /// HEADERS
    pub const HEADERS: u8 = 0x1;
    /// PRIORITY
    pub const PRIORITY: u8 = 0x2;
    /// RST_STREAM
    pub const RST_STREAM: u8 = 0x3;
    /// SETTINGS
    pub const SETTINGS: u8 = 0x4;
    /// PUSH_PROMISE
    pub const PUSH_PROMISE: u8 = 0x5;
    /// PING
    pub const PING: u8 = 0x6;
    /// GOAWAY
    pub const GOAWAY: u8 = 0x7;
    /// WINDOW_UPDATE
    pub const WINDOW_UPDATE: u8 = 0x8;
    /// CONTINUATION
    pub const CONTINUATION: u8 = 0x9;
}

/// Frame flags.
pub mod flag {
    /// END_STREAM (DATA, HEADERS)
    pub const END_STREAM: u8 = 0x1;
    /// ACK (SETTINGS, PING)
    pub const ACK: u8 = 0x1;
    /// END_HEADERS (HEADERS, CONTINUATION)
    pub const END_HEADERS: u8 = 0x4;
    /// PADDED (DATA, HEADERS)
    pub const PADDED: u8 = 0x8;
    /// PRIORITY (HEADERS)
    pub const PRIORITY: u8 = 0x20;
}

/// Setting identifiers (RFC 9113 §6.5.2).
pub mod setting {
    /// SETTINGS_HEADER_TABLE_SIZE
    pub const HEADER_TABLE_SIZE: u16 = 0x1;
    /// SETTINGS_ENABLE_PUSH
    pub const ENABLE_PUSH: u16 = 0x2;
    /// SETTINGS_MAX_CONCURRENT_STREAMS
    pub const MAX_CONCURRENT_STREAMS: u16 = 0x3;
    /// SETTINGS_INITIAL_WINDOW_SIZE
    pub const INITIAL_WINDOW_SIZE: u16 = 0x4;
    /// SETTINGS_MAX_FRAME_SIZE
    pub const MAX_FRAME_SIZE: u16 = 0x5;
    /// SETTINGS_MAX_HEADER_LIST_SIZE
    pub const MAX_HEADER_LIST_SIZE: u16 = 0x6;
}

/// One frame, its payload borrowed from the input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame<'a> {
    /// The frame type (see [`kind`]); unknown types are passed through to be ignored.
    pub kind: u8,
    /// The flags (see [`flag`]).
    pub flags: u8,
    /// The stream identifier (the reserved bit cleared).
    pub stream: u32,
    /// The payload.
    pub payload: &'a [u8],
}

impl Frame<'_> {
    /// Whether `flag` is set.
    pub fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }
}

/// Reads one frame from the start of `buf`: `Ok(None)` when the frame is not complete
/// yet, `Ok(Some((frame, consumed)))`, or `FRAME_SIZE_ERROR` when it is longer than
/// `max_frame` (the size this side announced).
pub fn parse(buf: &[u8], max_frame: usize) -> Result<Option<(Frame<'_>, usize)>, ErrorCode> {
    let Some(header) = buf.get(..HEADER_LEN) else {
        return Ok(None);
    };
    let len = usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
    if len > max_frame {
        return Err(ErrorCode::FrameSize);
    }
    let Some(payload) = buf.get(HEADER_LEN..HEADER_LEN + len) else {
        return Ok(None);
    };
    let stream = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff;
    Ok(Some((
        Frame {
            kind: header[3],
            flags: header[4],
            stream,
            payload,
        },
        HEADER_LEN + len,
    )))
}

/// The payload of a DATA or HEADERS frame without its padding (and, for HEADERS, without
/// the priority fields); `PROTOCOL_ERROR` when the padding is longer than the frame.
pub fn unpadded<'a>(frame: &Frame<'a>) -> Result<&'a [u8], ErrorCode> {
    let mut body = frame.payload;
    let mut pad = 0usize;
    if frame.has(flag::PADDED) {
        let (&p, rest) = body.split_first().ok_or(ErrorCode::Protocol)?;
        pad = usize::from(p);
        body = rest;
    }
    if frame.kind == kind::HEADERS && frame.has(flag::PRIORITY) {
        body = body.get(5..).ok_or(ErrorCode::Protocol)?;
    }
    let end = body.len().checked_sub(pad).ok_or(ErrorCode::Protocol)?;
    Ok(&body[..end])
}

/// Appends a frame header.
pub fn put_header(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    let len = u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes();
    out.extend_from_slice(&len[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
}

/// Appends a SETTINGS frame with `settings`.
pub fn put_settings(out: &mut Vec<u8>, settings: &[(u16, u32)]) {
    put_header(out, settings.len() * 6, kind::SETTINGS, 0, 0);
    for (id, value) in settings {
        out.extend_from_slice(&id.to_be_bytes());
        out.extend_from_slice(&value.to_be_bytes());
    }
}

/// Appends a SETTINGS acknowledgement.
pub fn put_settings_ack(out: &mut Vec<u8>) {
    put_header(out, 0, kind::SETTINGS, flag::ACK, 0);
}

/// Appends a PING acknowledgement echoing `opaque`.
pub fn put_ping_ack(out: &mut Vec<u8>, opaque: &[u8]) {
    put_header(out, 8, kind::PING, flag::ACK, 0);
    out.extend_from_slice(opaque);
}

/// Appends a PING carrying `opaque` (its acknowledgement echoes it).
pub fn put_ping(out: &mut Vec<u8>, opaque: &[u8; 8]) {
    put_header(out, 8, kind::PING, 0, 0);
    out.extend_from_slice(opaque);
}

/// Appends a WINDOW_UPDATE.
pub fn put_window_update(out: &mut Vec<u8>, stream: u32, increment: u32) {
    put_header(out, 4, kind::WINDOW_UPDATE, 0, stream);
    out.extend_from_slice(&(increment & 0x7fff_ffff).to_be_bytes());
}

/// Appends a RST_STREAM.
pub fn put_rst_stream(out: &mut Vec<u8>, stream: u32, code: ErrorCode) {
    put_header(out, 4, kind::RST_STREAM, 0, stream);
    out.extend_from_slice(&(code as u32).to_be_bytes());
}

/// Appends a GOAWAY naming the last stream this side will process.
pub fn put_goaway(out: &mut Vec<u8>, last_stream: u32, code: ErrorCode, debug: &[u8]) {
    put_header(out, 8 + debug.len(), kind::GOAWAY, 0, 0);
    out.extend_from_slice(&(last_stream & 0x7fff_ffff).to_be_bytes());
    out.extend_from_slice(&(code as u32).to_be_bytes());
    out.extend_from_slice(debug);
}

/// Appends `data` as DATA frames of at most `max_frame` bytes each on `stream`;
/// END_STREAM on the last when `end` is set.
pub fn put_data(out: &mut Vec<u8>, stream: u32, data: &[u8], max_frame: usize, end: bool) {
    let max_frame = max_frame.max(1);
    if data.is_empty() {
        put_header(
            out,
            0,
            kind::DATA,
            if end { flag::END_STREAM } else { 0 },
            stream,
        );
        return;
    }
    let mut chunks = data.chunks(max_frame).peekable();
    while let Some(chunk) = chunks.next() {
        let last = chunks.peek().is_none();
        let flags = if end && last { flag::END_STREAM } else { 0 };
        put_header(out, chunk.len(), kind::DATA, flags, stream);
        out.extend_from_slice(chunk);
    }
}

/// Appends a header block as one HEADERS frame followed by CONTINUATION frames when it
/// is longer than `max_frame`.
pub fn put_headers(out: &mut Vec<u8>, stream: u32, block: &[u8], max_frame: usize, end: bool) {
    let max_frame = max_frame.max(1);
    let end_flag = if end { flag::END_STREAM } else { 0 };
    if block.len() <= max_frame {
        put_header(
            out,
            block.len(),
            kind::HEADERS,
            end_flag | flag::END_HEADERS,
            stream,
        );
        out.extend_from_slice(block);
        return;
    }
    let mut chunks = block.chunks(max_frame).enumerate().peekable();
    while let Some((i, chunk)) = chunks.next() {
        let last = chunks.peek().is_none();
        let end_headers = if last { flag::END_HEADERS } else { 0 };
        let (kind, flags) = if i == 0 {
            (kind::HEADERS, end_flag | end_headers)
        } else {
            (kind::CONTINUATION, end_headers)
        };
        put_header(out, chunk.len(), kind, flags, stream);
        out.extend_from_slice(chunk);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_frame_parses_back() {
        let mut out = Vec::new();
        put_window_update(&mut out, 7, 1000);
        assert_eq!(parse(&out[..5], DEFAULT_MAX_FRAME), Ok(None));
        assert_eq!(parse(&out[..12], DEFAULT_MAX_FRAME), Ok(None));
        let (frame, used) = parse(&out, DEFAULT_MAX_FRAME)
            .ok()
            .flatten()
            .expect("a frame");
        assert_eq!(used, 13);
        assert_eq!(frame.kind, kind::WINDOW_UPDATE);
        assert_eq!(frame.stream, 7);
        assert_eq!(frame.payload, &1000u32.to_be_bytes());
    }

    #[test]
    fn a_frame_longer_than_announced_is_a_frame_size_error() {
        let mut out = Vec::new();
        put_header(&mut out, DEFAULT_MAX_FRAME + 1, kind::DATA, 0, 1);
        assert_eq!(parse(&out, DEFAULT_MAX_FRAME), Err(ErrorCode::FrameSize));
    }

    #[test]
    fn padding_and_priority_are_removed_and_overlong_padding_is_refused() {
        let frame = Frame {
            kind: kind::HEADERS,
            flags: flag::PADDED | flag::PRIORITY,
            stream: 1,
            payload: &[2, 0, 0, 0, 0, 16, b'a', b'b', 0, 0],
        };
        assert_eq!(unpadded(&frame), Ok(&b"ab"[..]));
        let frame = Frame {
            kind: kind::DATA,
            flags: flag::PADDED,
            stream: 1,
            payload: &[5, b'a'],
        };
        assert_eq!(unpadded(&frame), Err(ErrorCode::Protocol));
    }

    #[test]
    fn long_data_and_header_blocks_are_split_at_the_frame_size() {
        let mut out = Vec::new();
        put_data(&mut out, 3, &[7; 10], 4, true);
        let mut rest = &out[..];
        let mut sizes = Vec::new();
        while let Some((f, used)) = parse(rest, 4).ok().flatten() {
            sizes.push((f.payload.len(), f.has(flag::END_STREAM)));
            rest = &rest[used..];
        }
        assert_eq!(sizes, vec![(4, false), (4, false), (2, true)]);

        let mut out = Vec::new();
        put_headers(&mut out, 3, &[1; 9], 4, true);
        let mut rest = &out[..];
        let mut frames = Vec::new();
        while let Some((f, used)) = parse(rest, 4).ok().flatten() {
            frames.push((f.kind, f.flags));
            rest = &rest[used..];
        }
        assert_eq!(
            frames,
            vec![
                (kind::HEADERS, flag::END_STREAM),
                (kind::CONTINUATION, 0),
                (kind::CONTINUATION, flag::END_HEADERS)
            ]
        );
    }
}
