//! The HPACK decoder (RFC 7541 §6): indexed fields, literals with and without indexing,
//! the dynamic table and its size updates, Huffman-coded strings.

use std::collections::VecDeque;

use super::huffman;
use super::tables::STATIC;

/// Why a header block cannot be decoded (a connection error: COMPRESSION_ERROR).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeError {
    /// The block ends inside a representation.
    Truncated,
    /// An integer too large to be meaningful.
    Overflow,
    /// Index 0, or past the end of the tables.
    BadIndex,
    /// A Huffman string that is not valid.
    Huffman,
    /// A table size update above the allowed size, or after a field.
    BadSizeUpdate,
    /// The decoded header list passed [`ABUSE_FACTOR`] times the limit given to
    /// [`Decoder::decode_limited`]; decoding stopped there.
    TooLarge,
}

/// How far past its limit a header list is still decoded (to keep the dynamic table in
/// step, the fields skipped) before decoding stops and the connection must end: h2's
/// `MAX_HEADER_LIST_ABUSE_MULTIPLIER`.
pub const ABUSE_FACTOR: usize = 4;

/// What [`Decoder::decode_limited`] made of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum List {
    /// Every field was handed out.
    Complete,
    /// The list is larger than the limit: the fields past it were skipped.
    TooLarge,
}

/// The decoder of one connection's header blocks.
pub struct Decoder {
    table: VecDeque<(Vec<u8>, Vec<u8>)>,
    size: usize,
    max_size: usize,
    allowed: usize,
    /// The last Huffman-coded value decoded, kept for the next block.
    last: Memo,
}

/// A Huffman-coded value and its decoding. A client that sends a value without
/// indexing it (nghttp2 never indexes `:path`) sends the same bytes on every call: the
/// next block decodes it by comparing, not by walking the code again.
#[derive(Default)]
struct Memo {
    /// The coded bytes, when `decoded` is theirs (values up to [`MEMO_MAX`] bytes).
    raw: Option<Vec<u8>>,
    decoded: Vec<u8>,
}

/// The longest coded value [`Memo`] keeps.
const MEMO_MAX: usize = 256;

/// The size of an entry (RFC 7541 §4.1).
fn entry_size(name: &[u8], value: &[u8]) -> usize {
    name.len() + value.len() + 32
}

impl Decoder {
    /// A decoder whose dynamic table may grow to `allowed` bytes (this side's
    /// `SETTINGS_HEADER_TABLE_SIZE`, 4,096 by default).
    pub fn new(allowed: usize) -> Self {
        Self {
            table: VecDeque::new(),
            size: 0,
            max_size: allowed,
            allowed,
            last: Memo::default(),
        }
    }

    /// Decodes `block`, calling `field(name, value)` for each field in order, with no
    /// limit on the decoded size (for blocks from a trusted peer: responses, tests).
    pub fn decode(
        &mut self,
        block: &[u8],
        field: impl FnMut(&[u8], &[u8]),
    ) -> Result<(), DecodeError> {
        self.decode_limited(block, usize::MAX / ABUSE_FACTOR, field)
            .map(|_| ())
    }

    /// Decodes `block` as [`decode`](Self::decode) does, but counts the decoded size of
    /// the header list as RFC 7541 §4.1 does (name + value + 32 per field) and calls
    /// `field` only while the list stays within `max_list` bytes: a field is checked
    /// before it is handed out, so a reference repeated many times costs no copy.
    ///
    /// `Ok(List::Complete)`: every field was handed out. `Ok(List::TooLarge)`: the list
    /// is larger than `max_list`; the fields from the first one that did not fit on were
    /// skipped, but the block was decoded to its end, so the dynamic table is still in
    /// step with the peer's (a stream error is enough). `Err(DecodeError::TooLarge)`:
    /// the list passed [`ABUSE_FACTOR`] times `max_list` and decoding stopped there;
    /// the table is no longer in step (a connection error), as h2 does.
    pub fn decode_limited(
        &mut self,
        block: &[u8],
        max_list: usize,
        mut field: impl FnMut(&[u8], &[u8]),
    ) -> Result<List, DecodeError> {
        let abuse = max_list.saturating_mul(ABUSE_FACTOR);
        let mut list = 0usize;
        // Whether `field` is still called. Past the limit, literals are still decoded
        // (their cost is bounded by the block's length) to count their size exactly, as
        // h2 does; references, whose decoded size is not, are only counted.
        let mut deliver = true;
        let mut name_buf = Vec::new();
        // Taken for the block (values borrow it while the table changes); an error
        // leaves it empty, which only costs the next block a decoding.
        let mut memo = std::mem::take(&mut self.last);
        let mut pos = 0;
        let mut fields = 0usize;
        while let Some(&first) = block.get(pos) {
            let rest = &block[pos..];
            if first & 0x80 != 0 {
                let (index, n) = integer(rest, 7)?;
                pos += n;
                let (name, value) = self.get(index)?;
                account(&mut list, name.len() + value.len(), abuse)?;
                deliver &= list <= max_list;
                if deliver {
                    field(name, value);
                }
            } else if first & 0xe0 == 0x20 {
                if fields > 0 {
                    return Err(DecodeError::BadSizeUpdate);
                }
                let (size, n) = integer(rest, 5)?;
                pos += n;
                if size > self.allowed {
                    return Err(DecodeError::BadSizeUpdate);
                }
                self.max_size = size;
                self.evict(0);
                continue;
            } else {
                let indexing = first & 0x40 != 0;
                let (index, n) = integer(rest, if indexing { 6 } else { 4 })?;
                pos += n;
                if index == 0 {
                    let (name, n) = string(&block[pos..], &mut name_buf)?;
                    pos += n;
                    let (value, m) = value_string(&block[pos..], &mut memo)?;
                    pos += m;
                    account(&mut list, name.len() + value.len(), abuse)?;
                    deliver &= list <= max_list;
                    if deliver {
                        field(name, value);
                    }
                    if indexing {
                        self.insert(name, value);
                    }
                } else {
                    let (value, m) = value_string(&block[pos..], &mut memo)?;
                    pos += m;
                    let (name, _) = self.get(index)?;
                    account(&mut list, name.len() + value.len(), abuse)?;
                    deliver &= list <= max_list;
                    if deliver {
                        field(name, value);
                    }
                    if indexing {
                        // The insert may evict the entry the name is read from: copied,
                        // now that the field is known to be within the limits.
                        name_buf.clear();
                        name_buf.extend_from_slice(name);
                        self.insert(&name_buf, value);
                    }
                }
            }
            fields += 1;
        }
        self.last = memo;
        Ok(if deliver {
            List::Complete
        } else {
            List::TooLarge
        })
    }

    /// Entry `index` of the static table (1–61) or the dynamic table (62 on, newest
    /// first).
    fn get(&self, index: usize) -> Result<(&[u8], &[u8]), DecodeError> {
        if index == 0 {
            return Err(DecodeError::BadIndex);
        }
        if let Some(&(name, value)) = STATIC.get(index - 1) {
            return Ok((name, value));
        }
        self.table
            .get(index - 1 - STATIC.len())
            .map(|(n, v)| (n.as_slice(), v.as_slice()))
            .ok_or(DecodeError::BadIndex)
    }

    /// Adds an entry; copies it only once it is known to fit in the table.
    fn insert(&mut self, name: &[u8], value: &[u8]) {
        let size = entry_size(name, value);
        if size > self.max_size {
            // RFC 7541 §4.4: an entry larger than the table empties it.
            self.table.clear();
            self.size = 0;
            return;
        }
        self.evict(size);
        self.size += size;
        self.table.push_front((name.to_vec(), value.to_vec()));
    }

    /// Drops the oldest entries until `room` more bytes fit.
    fn evict(&mut self, room: usize) {
        while self.size + room > self.max_size {
            match self.table.pop_back() {
                Some((n, v)) => self.size -= entry_size(&n, &v),
                None => break,
            }
        }
    }
}

/// An integer with an `n`-bit prefix (RFC 7541 §5.1): the value and the bytes used.
fn integer(buf: &[u8], n: u32) -> Result<(usize, usize), DecodeError> {
    let max = (1usize << n) - 1;
    let first = usize::from(*buf.first().ok_or(DecodeError::Truncated)?) & max;
    if first < max {
        return Ok((first, 1));
    }
    let mut value = max;
    let mut shift = 0;
    for (i, &b) in buf.iter().enumerate().skip(1) {
        if shift > 28 {
            return Err(DecodeError::Overflow);
        }
        value += usize::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok((value, i + 1));
        }
        shift += 7;
    }
    Err(DecodeError::Truncated)
}

/// Adds a field's size (RFC 7541 §4.1: name and value lengths, here `len`, plus 32) to
/// `list`; past `abuse`, decoding stops.
#[inline(always)]
fn account(list: &mut usize, len: usize, abuse: usize) -> Result<(), DecodeError> {
    *list = list.saturating_add(len + 32);
    if *list > abuse {
        return Err(DecodeError::TooLarge);
    }
    Ok(())
}

/// A string literal (RFC 7541 §5.2): its bytes (from `buf`, or decoded into `scratch`)
/// and the bytes used.
fn string<'a>(buf: &'a [u8], scratch: &'a mut Vec<u8>) -> Result<(&'a [u8], usize), DecodeError> {
    let huffman = buf.first().ok_or(DecodeError::Truncated)? & 0x80 != 0;
    let (len, n) = integer(buf, 7)?;
    let raw = buf.get(n..n + len).ok_or(DecodeError::Truncated)?;
    if !huffman {
        return Ok((raw, n + len));
    }
    scratch.clear();
    huffman::decode(raw, scratch).map_err(|_| DecodeError::Huffman)?;
    Ok((scratch.as_slice(), n + len))
}

/// A value's string literal, as [`string`], its Huffman decoding from `memo` when it
/// is the same coded bytes as the last one (else decoded into it).
fn value_string<'a>(buf: &'a [u8], memo: &'a mut Memo) -> Result<(&'a [u8], usize), DecodeError> {
    let huffman = buf.first().ok_or(DecodeError::Truncated)? & 0x80 != 0;
    let (len, n) = integer(buf, 7)?;
    let raw = buf.get(n..n + len).ok_or(DecodeError::Truncated)?;
    if !huffman {
        return Ok((raw, n + len));
    }
    if memo.raw.as_deref() != Some(raw) {
        memo.decoded.clear();
        let mut kept = memo.raw.take().unwrap_or_default();
        huffman::decode(raw, &mut memo.decoded).map_err(|_| DecodeError::Huffman)?;
        if raw.len() <= MEMO_MAX {
            kept.clear();
            kept.extend_from_slice(raw);
            memo.raw = Some(kept);
        }
    }
    Ok((memo.decoded.as_slice(), n + len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fields(decoder: &mut Decoder, block: &[u8]) -> Result<Vec<(String, String)>, DecodeError> {
        let mut out = Vec::new();
        decoder.decode(block, |n, v| {
            out.push((
                String::from_utf8_lossy(n).into_owned(),
                String::from_utf8_lossy(v).into_owned(),
            ))
        })?;
        Ok(out)
    }

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
            .collect()
    }

    #[test]
    fn the_rfc_requests_with_huffman_decode_in_sequence() {
        // RFC 7541 C.4: three requests on one connection, Huffman-coded.
        let mut d = Decoder::new(4096);
        let first =
            fields(&mut d, &hex("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff")).expect("C.4.1");
        assert_eq!(first[3], (":authority".into(), "www.example.com".into()));
        let second = fields(&mut d, &hex("8286 84be 5886 a8eb 1064 9cbf")).expect("C.4.2");
        assert_eq!(second[3], (":authority".into(), "www.example.com".into()));
        assert_eq!(second[4], ("cache-control".into(), "no-cache".into()));
        let third = fields(
            &mut d,
            &hex("8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf"),
        )
        .expect("C.4.3");
        assert_eq!(third[1], (":scheme".into(), "https".into()));
        assert_eq!(third[2], (":path".into(), "/index.html".into()));
        assert_eq!(third[4], ("custom-key".into(), "custom-value".into()));
        assert_eq!(d.size, 164, "RFC 7541 C.4.3: the table holds 164 bytes");
    }

    #[test]
    fn a_repeated_huffman_value_decodes_the_same_every_time() {
        // `:path` (static name 4) without indexing, Huffman-coded, as nghttp2 sends it.
        let block = |value: &[u8]| {
            let mut coded = Vec::new();
            huffman::encode(value, &mut coded);
            let mut b = vec![0x04];
            b.push(0x80 | coded.len() as u8);
            b.extend_from_slice(&coded);
            b
        };
        let mut d = Decoder::new(4096);
        let long = vec![b'x'; 300];
        // Longer than the memo keeps (its length takes more than the prefix).
        let mut coded = Vec::new();
        huffman::encode(&long, &mut coded);
        let mut long_block = vec![0x04];
        super::super::put_int(&mut long_block, 0x80, 7, coded.len());
        long_block.extend_from_slice(&coded);
        let long_text = String::from_utf8(long).unwrap();
        for (b, want) in [
            (block(b"/a.B/C"), "/a.B/C"),
            (block(b"/a.B/C"), "/a.B/C"),
            (block(b"/other"), "/other"),
            (long_block.clone(), long_text.as_str()),
            (block(b""), ""),
            (long_block, long_text.as_str()),
            (block(b"/a.B/C"), "/a.B/C"),
        ] {
            assert_eq!(
                fields(&mut d, &b).unwrap(),
                [(":path".to_string(), want.to_string())]
            );
        }
    }

    #[test]
    fn eviction_follows_the_table_size() {
        // RFC 7541 C.5: table size 256, responses evict older entries.
        let mut d = Decoder::new(256);
        fields(&mut d, &hex("4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 7861 6d70 6c65 2e63 6f6d")).expect("C.5.1");
        assert_eq!(d.size, 222);
        let second = fields(&mut d, &hex("4803 3330 37c1 c0bf")).expect("C.5.2");
        assert_eq!(second[0], (":status".into(), "307".into()));
        assert_eq!(d.size, 222);
        assert_eq!(d.table.len(), 4);
    }

    #[test]
    fn bad_blocks_are_errors() {
        let mut d = Decoder::new(4096);
        assert_eq!(fields(&mut d, &[0x80]), Err(DecodeError::BadIndex));
        assert_eq!(
            fields(&mut d, &[0xbe]),
            Err(DecodeError::BadIndex),
            "empty dynamic table"
        );
        assert_eq!(
            fields(&mut d, &[0x04, 0x05, b'a']),
            Err(DecodeError::Truncated)
        );
        assert_eq!(
            fields(&mut d, &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]),
            Err(DecodeError::Overflow)
        );
        assert_eq!(
            fields(&mut d, &[0x3f, 0xe2, 0x1f]),
            Err(DecodeError::BadSizeUpdate),
            "above 4096"
        );
        assert_eq!(
            fields(&mut d, &[0x82, 0x20]),
            Err(DecodeError::BadSizeUpdate),
            "after a field"
        );
        assert_eq!(
            fields(&mut d, &[0x04, 0x81, 0x00]),
            Err(DecodeError::Huffman)
        );
    }

    #[test]
    fn a_list_past_its_limit_is_skipped_then_stopped_and_the_table_kept_in_step() {
        let mut d = Decoder::new(4096);
        // `x: <1000 a>` indexed, then referenced 3 times: 4 fields of 1,033 bytes.
        let mut block = vec![0x40];
        super::super::put_str(&mut block, b"x");
        super::super::put_str(&mut block, &[b'a'; 1000]);
        block.extend_from_slice(&[0xbe, 0xbe, 0xbe]);
        // And a literal with indexing past the limit: skipped, but in the table.
        block.push(0x40);
        super::super::put_str(&mut block, b"y");
        super::super::put_str(&mut block, b"z");
        let mut seen = 0;
        assert_eq!(
            d.decode_limited(&block, 2_100, |_, _| seen += 1),
            Ok(List::TooLarge)
        );
        assert_eq!(seen, 2, "only the fields within the limit are handed out");
        assert_eq!(
            fields(&mut d, &[0xbe, 0xbf]).expect("in step"),
            vec![("y".into(), "z".into()), ("x".into(), "a".repeat(1000))]
        );
        // Past four times the limit, decoding stops.
        let many = vec![0xbf; 9];
        let mut seen = 0;
        assert_eq!(
            d.decode_limited(&many, 2_100, |_, _| seen += 1),
            Err(DecodeError::TooLarge)
        );
        assert_eq!(seen, 2);
        assert_eq!(
            d.decode_limited(&many[..2], 2_100, |_, _| {}),
            Ok(List::Complete)
        );
    }

    proptest! {
        /// The same blocks through this decoder and loona-hpack's give the same fields
        /// and the same errors-or-not, block after block (the dynamic tables stay equal).
        #[test]
        fn agrees_with_loona_hpack(blocks in proptest::collection::vec(block(), 1..6)) {
            let mut ours = Decoder::new(4096);
            let mut theirs = loona_hpack::Decoder::new();
            theirs.set_max_allowed_table_size(4096);
            for block in blocks {
                let a = fields(&mut ours, &block);
                let b = theirs.decode(&block).map(|fs| fs.into_iter().map(|(n, v)| (
                    String::from_utf8_lossy(&n).into_owned(),
                    String::from_utf8_lossy(&v).into_owned(),
                )).collect::<Vec<_>>());
                match (a, b) {
                    (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
                    (Err(_), Err(_)) => break,
                    (a, b) => prop_assert!(false, "ours {:?}, loona {:?}", a, b),
                }
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = Decoder::new(4096).decode(&bytes, |_, _| {});
        }
    }

    /// Valid representations, some Huffman-coded, indexing into tables that may hold
    /// entries from earlier blocks (an index past the end is an error both must agree
    /// on).
    fn block() -> impl Strategy<Value = Vec<u8>> {
        let text = proptest::collection::vec(any::<u8>(), 0..20);
        let repr = (0u8..5, 1usize..70, text.clone(), text, any::<bool>()).prop_map(
            |(kind, index, name, value, huff)| {
                let mut out = Vec::new();
                let put_str = |out: &mut Vec<u8>, s: &[u8]| {
                    if huff {
                        let mut h = Vec::new();
                        huffman::encode(s, &mut h);
                        super::super::put_int(out, 0x80, 7, h.len());
                        out.extend_from_slice(&h);
                    } else {
                        super::super::put_str(out, s);
                    }
                };
                match kind {
                    0 => super::super::put_int(&mut out, 0x80, 7, index),
                    1 => {
                        super::super::put_int(&mut out, 0x40, 6, index);
                        put_str(&mut out, &value);
                    }
                    2 => {
                        out.push(0x40);
                        put_str(&mut out, &name);
                        put_str(&mut out, &value);
                    }
                    3 => {
                        super::super::put_int(&mut out, 0x10, 4, index.min(61));
                        put_str(&mut out, &value);
                    }
                    _ => {
                        out.push(0x00);
                        put_str(&mut out, &name);
                        put_str(&mut out, &value);
                    }
                }
                out
            },
        );
        proptest::collection::vec(repr, 0..6).prop_map(|rs| rs.concat())
    }
}
