//! gRPC over HTTP/2 (the "PROTOCOL-HTTP2" document of gRPC): status codes, the 5-byte
//! message prefix, and `grpc-message` percent-encoding.

/// gRPC status codes used here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Code {
    /// OK
    Ok = 0,
    /// CANCELLED
    Cancelled = 1,
    /// UNKNOWN
    Unknown = 2,
    /// INVALID_ARGUMENT
    InvalidArgument = 3,
    /// NOT_FOUND
    NotFound = 5,
    /// RESOURCE_EXHAUSTED
    ResourceExhausted = 8,
    /// UNIMPLEMENTED
    Unimplemented = 12,
    /// INTERNAL
    Internal = 13,
    /// UNAVAILABLE
    Unavailable = 14,
}

/// A status to end a call with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// The code.
    pub code: Code,
    /// A message for humans (`grpc-message`).
    pub message: String,
}

impl Status {
    /// A status with `code` and `message`.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

/// The caller's deadline from a `grpc-timeout` header value: 1 to 8 ASCII digits and a
/// unit (`H`, `M`, `S`, `m`, `u` or `n`), as gRPC's "PROTOCOL-HTTP2" document defines it.
/// `Err` says what is wrong with the value.
pub fn parse_timeout(value: &[u8]) -> Result<std::time::Duration, String> {
    use std::time::Duration;
    let malformed = || {
        // The value is quoted up to a few bytes more than a valid one has: enough to
        // see what is wrong, never a copy of a long value.
        const SHOWN: usize = 16;
        let shown = String::from_utf8_lossy(&value[..value.len().min(SHOWN)]);
        let more = if value.len() > SHOWN { "..." } else { "" };
        format!("grpc-timeout {shown:?}{more} is not 1 to 8 digits and a unit (H, M, S, m, u or n)")
    };
    let Some((&unit, digits)) = value.split_last() else {
        return Err(malformed());
    };
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return Err(malformed());
    }
    // At most 99,999,999: no overflow in u64, nor in hours as seconds.
    let n = digits
        .iter()
        .fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
    Ok(match unit {
        b'H' => Duration::from_secs(n * 3_600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return Err(malformed()),
    })
}

/// Length of the prefix before each message: a compressed flag and a big-endian length.
pub const PREFIX_LEN: usize = 5;

/// Appends `message` with its prefix (uncompressed).
pub fn put_message(out: &mut Vec<u8>, message: &[u8]) {
    out.push(0);
    out.extend_from_slice(
        &u32::try_from(message.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    out.extend_from_slice(message);
}

/// The one message of a unary call's body, or the status to answer a malformed body with.
pub fn unary_message(body: &[u8]) -> Result<&[u8], Status> {
    let Some((prefix, rest)) = body.split_first_chunk::<PREFIX_LEN>() else {
        return Err(Status::new(
            Code::Internal,
            if body.is_empty() {
                "missing request message"
            } else {
                "truncated message prefix"
            },
        ));
    };
    if prefix[0] != 0 {
        return Err(Status::new(
            Code::Unimplemented,
            "compressed messages are not supported (send grpc-encoding identity)",
        ));
    }
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    match rest.len().cmp(&len) {
        std::cmp::Ordering::Equal => Ok(rest),
        std::cmp::Ordering::Less => Err(Status::new(Code::Internal, "truncated request message")),
        std::cmp::Ordering::Greater => Err(Status::new(
            Code::Unimplemented,
            "more than one request message for a unary method",
        )),
    }
}

/// `message` percent-encoded for `grpc-message` (bytes outside printable ASCII and `%`).
pub fn percent_encode(message: &str) -> Vec<u8> {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = Vec::with_capacity(message.len());
    for &b in message.as_bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b);
        } else {
            out.extend_from_slice(&[b'%', HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]]);
        }
    }
    out
}

/// Decodes a percent-encoded `grpc-message` (invalid escapes are kept as they are).
pub fn percent_decode(raw: &[u8]) -> String {
    fn hex(b: u8) -> Option<u8> {
        (b as char).to_digit(16).map(|d| d as u8)
    }
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        if raw[i] == b'%' {
            if let (Some(h), Some(l)) = (
                raw.get(i + 1).copied().and_then(hex),
                raw.get(i + 2).copied().and_then(hex),
            ) {
                out.push(h << 4 | l);
                i += 3;
                continue;
            }
        }
        out.push(raw[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn grpc_timeouts_are_read_in_every_unit_and_bad_ones_named() {
        use std::time::Duration;
        for (value, expected) in [
            ("20m", Duration::from_millis(20)),
            ("5S", Duration::from_secs(5)),
            ("2M", Duration::from_secs(120)),
            ("1H", Duration::from_secs(3_600)),
            ("99999999H", Duration::from_secs(99_999_999 * 3_600)),
            ("4999994u", Duration::from_micros(4_999_994)),
            ("150n", Duration::from_nanos(150)),
            ("0m", Duration::ZERO),
        ] {
            assert_eq!(parse_timeout(value.as_bytes()), Ok(expected), "{value}");
        }
        for value in [
            "",
            "m",
            "20",
            "20x",
            "123456789m",
            "-1m",
            "1.5S",
            " 20m",
            "20ms",
        ] {
            let e = parse_timeout(value.as_bytes()).unwrap_err();
            assert!(
                e.contains("grpc-timeout") && e.contains("unit"),
                "{value}: {e}"
            );
        }
    }

    #[test]
    fn a_framed_message_is_found_and_bad_framing_named() {
        let mut body = Vec::new();
        put_message(&mut body, b"hello");
        assert_eq!(unary_message(&body), Ok(&b"hello"[..]));
        assert_eq!(unary_message(&[]).map_err(|s| s.code), Err(Code::Internal));
        assert_eq!(
            unary_message(&body[..7]).map_err(|s| s.code),
            Err(Code::Internal)
        );
        let mut two = body.clone();
        put_message(&mut two, b"again");
        assert_eq!(
            unary_message(&two).map_err(|s| s.code),
            Err(Code::Unimplemented)
        );
        body[0] = 1;
        assert_eq!(
            unary_message(&body).map_err(|s| s.code),
            Err(Code::Unimplemented)
        );
    }

    #[test]
    fn percent_encoding_escapes_what_it_must() {
        assert_eq!(percent_encode("a%b\nç"), b"a%25b%0A%C3%A7".to_vec());
    }

    proptest! {
        #[test]
        fn percent_encoding_round_trips(s in ".{0,40}") {
            let encoded = percent_encode(&s);
            prop_assert!(encoded.iter().all(|b| (0x20..=0x7e).contains(b)));
            prop_assert_eq!(percent_decode(&encoded), s);
        }
    }
}
