//! HPACK's Huffman code (RFC 7541 §5.2, Appendix B). The code is canonical (within a
//! length, codes are consecutive in symbol order), so a decoder needs, per length, the
//! first code, how many codes there are and where their symbols start: no tree and
//! no allocation per string.

use std::sync::OnceLock;

use super::tables::HUFFMAN;

/// The end-of-string symbol, which must not appear in a string.
const EOS: u16 = 256;
/// The longest code.
const MAX_LEN: usize = 30;

struct Canonical {
    first: [u32; MAX_LEN + 1],
    count: [u32; MAX_LEN + 1],
    offset: [usize; MAX_LEN + 1],
    symbols: Vec<u16>,
}

fn canonical() -> &'static Canonical {
    static TABLE: OnceLock<Canonical> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut symbols: Vec<u16> = (0..=EOS).collect();
        symbols.sort_by_key(|&s| {
            let (code, len) = HUFFMAN[usize::from(s)];
            (len, code)
        });
        let mut table = Canonical {
            first: [0; MAX_LEN + 1],
            count: [0; MAX_LEN + 1],
            offset: [0; MAX_LEN + 1],
            symbols,
        };
        for (i, &s) in table.symbols.iter().enumerate() {
            let (code, len) = HUFFMAN[usize::from(s)];
            let len = usize::from(len);
            if table.count[len] == 0 {
                table.first[len] = code;
                table.offset[len] = i;
            }
            table.count[len] += 1;
        }
        table
    })
}

/// Why a Huffman string is invalid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HuffmanError {
    /// The EOS symbol inside the string.
    Eos,
    /// Bits that are no code.
    InvalidCode,
    /// Padding longer than 7 bits or not all ones.
    BadPadding,
}

/// Appends the decoding of `bytes` to `out`.
pub fn decode(bytes: &[u8], out: &mut Vec<u8>) -> Result<(), HuffmanError> {
    let table = canonical();
    let mut code: u32 = 0;
    let mut len: usize = 0;
    for &byte in bytes {
        for shift in (0..8).rev() {
            code = code << 1 | u32::from(byte >> shift & 1);
            len += 1;
            if len > MAX_LEN {
                return Err(HuffmanError::InvalidCode);
            }
            let index = code.wrapping_sub(table.first[len]);
            if index < table.count[len] {
                let symbol = table.symbols[table.offset[len] + index as usize];
                if symbol == EOS {
                    return Err(HuffmanError::Eos);
                }
                out.push(symbol as u8);
                code = 0;
                len = 0;
            }
        }
    }
    // What is left must be a prefix of EOS (all ones), shorter than a byte.
    if len > 7 || code != (1 << len) - 1 {
        return Err(HuffmanError::BadPadding);
    }
    Ok(())
}

/// Appends the encoding of `bytes` to `out` (padded with ones).
pub fn encode(bytes: &[u8], out: &mut Vec<u8>) {
    let mut acc: u64 = 0;
    let mut bits: u32 = 0;
    for &b in bytes {
        let (code, len) = HUFFMAN[usize::from(b)];
        acc = acc << len | u64::from(code);
        bits += u32::from(len);
        while bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    if bits > 0 {
        let pad = 8 - bits;
        out.push(((acc << pad) as u8) | ((1u16 << pad) - 1) as u8);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_rfc_example_decodes() {
        // RFC 7541 C.4.1: "www.example.com".
        let bytes = [
            0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff,
        ];
        let mut out = Vec::new();
        assert_eq!(decode(&bytes, &mut out), Ok(()));
        assert_eq!(out, b"www.example.com");
        let mut encoded = Vec::new();
        encode(b"www.example.com", &mut encoded);
        assert_eq!(encoded, bytes);
    }

    #[test]
    fn every_symbol_round_trips_and_bad_strings_are_refused() {
        let all: Vec<u8> = (0..=255).collect();
        let mut encoded = Vec::new();
        encode(&all, &mut encoded);
        let mut out = Vec::new();
        assert_eq!(decode(&encoded, &mut out), Ok(()));
        assert_eq!(out, all);
        // 30 ones: EOS.
        assert_eq!(
            decode(&[0xff, 0xff, 0xff, 0xfc], &mut Vec::new()),
            Err(HuffmanError::Eos)
        );
        // A full byte of padding.
        let mut padded = Vec::new();
        encode(b"a", &mut padded);
        padded.push(0xff);
        assert_eq!(
            decode(&padded, &mut Vec::new()),
            Err(HuffmanError::BadPadding)
        );
        // Padding with a zero in it: '0' is 00000, then 000 is not all ones.
        assert_eq!(
            decode(&[0x00], &mut Vec::new()),
            Err(HuffmanError::BadPadding)
        );
    }

    proptest! {
        #[test]
        fn strings_round_trip(s in proptest::collection::vec(any::<u8>(), 0..100)) {
            let mut encoded = Vec::new();
            encode(&s, &mut encoded);
            let mut out = Vec::new();
            prop_assert_eq!(decode(&encoded, &mut out), Ok(()));
            prop_assert_eq!(out, s);
        }

        #[test]
        fn arbitrary_bytes_never_panic(s in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode(&s, &mut Vec::new());
        }
    }
}
