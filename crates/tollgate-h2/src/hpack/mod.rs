//! HPACK (RFC 7541). Reading: [`Decoder`] (dynamic table, Huffman, a limit on the
//! decoded header list). Writing: the representations this crate sends, indexed fields
//! and plain literals, never Huffman-coded. The server's blocks use no dynamic entries,
//! so they need no encoder state, except that a peer that lowers its
//! `SETTINGS_HEADER_TABLE_SIZE` must get a dynamic table size update at the start of the
//! next block (RFC 7541 §4.2): the server then sends one, to 0, once.

mod decoder;
pub mod huffman;
mod tables;

pub use decoder::{DecodeError, Decoder, List, ABUSE_FACTOR};

/// `:method: POST` (index 3).
pub const METHOD_POST: u8 = 0x83;
/// `:scheme: http` (index 6).
pub const SCHEME_HTTP: u8 = 0x86;
/// Static-table index of `:authority`.
pub const AUTHORITY: usize = 1;
/// Static-table index of `:path`.
pub const PATH: usize = 4;
/// Static-table index of `:status`.
pub const STATUS: usize = 8;
/// Static-table index of `content-type`.
pub const CONTENT_TYPE: usize = 31;

/// Appends `value` as an HPACK integer with an `n`-bit prefix whose high bits are `high`.
pub fn put_int(out: &mut Vec<u8>, high: u8, n: u32, mut value: usize) {
    let max = (1usize << n) - 1;
    if value < max {
        out.push(high | value as u8);
        return;
    }
    out.push(high | max as u8);
    value -= max;
    while value >= 128 {
        out.push((value % 128) as u8 | 0x80);
        value /= 128;
    }
    out.push(value as u8);
}

/// Appends a string literal (not Huffman-coded).
pub fn put_str(out: &mut Vec<u8>, s: &[u8]) {
    put_int(out, 0, 7, s.len());
    out.extend_from_slice(s);
}

/// Appends a literal field without indexing whose name is static-table entry `index`.
pub fn put_indexed_name(out: &mut Vec<u8>, index: usize, value: &[u8]) {
    put_int(out, 0x00, 4, index);
    put_str(out, value);
}

/// Appends a literal field with incremental indexing whose name is static-table entry
/// `index` (the peer adds it to its dynamic table).
pub fn put_indexed_name_indexing(out: &mut Vec<u8>, index: usize, value: &[u8]) {
    put_int(out, 0x40, 6, index);
    put_str(out, value);
}

/// Appends a literal field without indexing with a literal name.
pub fn put_literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x00);
    put_str(out, name);
    put_str(out, value);
}

/// Appends a literal field with incremental indexing with a literal name.
pub fn put_literal_indexing(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x40);
    put_str(out, name);
    put_str(out, value);
}

/// Appends an indexed field (static or dynamic table `index`).
pub fn put_indexed(out: &mut Vec<u8>, index: usize) {
    put_int(out, 0x80, 7, index);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_written_decodes_with_a_real_decoder() {
        let mut block = vec![0x88, METHOD_POST];
        put_indexed_name(&mut block, CONTENT_TYPE, b"application/grpc");
        put_literal(&mut block, b"grpc-message", &[b'x'; 300]);
        put_indexed_name_indexing(&mut block, PATH, b"/a/b");
        put_literal_indexing(&mut block, b"te", b"trailers");
        put_indexed(&mut block, 62);
        let mut decoder = Decoder::new(4096);
        let mut text: Vec<(String, String)> = Vec::new();
        decoder
            .decode(&block, |n, v| {
                text.push((
                    String::from_utf8_lossy(n).into_owned(),
                    String::from_utf8_lossy(v).into_owned(),
                ))
            })
            .expect("decodes");
        assert_eq!(text[0], (":status".into(), "200".into()));
        assert_eq!(text[1], (":method".into(), "POST".into()));
        assert_eq!(text[2], ("content-type".into(), "application/grpc".into()));
        assert_eq!(text[3], ("grpc-message".into(), "x".repeat(300)));
        assert_eq!(text[4], (":path".into(), "/a/b".into()));
        assert_eq!(text[5], ("te".into(), "trailers".into()));
        // Index 62 is the newest dynamic entry: `te: trailers`.
        assert_eq!(text[6], ("te".into(), "trailers".into()));
    }
}
