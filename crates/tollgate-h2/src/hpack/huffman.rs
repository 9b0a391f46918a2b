//! HPACK's Huffman code (RFC 7541 §5.2, Appendix B), decoded four bits at a time: the
//! code's tree has 256 inner nodes; from each, a table says for each of the 16 nibbles
//! which node the walk ends on and which symbol (at most one: the shortest code has
//! five bits) it passed. Two lookups a byte, no branch per bit and no allocation per
//! string (nghttp2 decodes the same way).

use std::sync::OnceLock;

use super::tables::HUFFMAN;

/// The end-of-string symbol, which must not appear in a string.
const EOS: u16 = 256;

/// One nibble's walk from a node.
#[derive(Debug, Clone, Copy, Default)]
struct Step {
    /// The node the walk ends on (0: the root).
    node: u8,
    /// The symbol passed on the way, if `EMIT` is set.
    symbol: u8,
    flags: u8,
}

/// The walk passed a symbol.
const EMIT: u8 = 1;
/// The walk reached EOS.
const FAIL: u8 = 2;

struct Decoder {
    /// Per inner node, per nibble.
    steps: Vec<[Step; 16]>,
    /// Per inner node: whether the bits from the root to it are all ones and fewer than
    /// eight (valid padding at the end of a string).
    padding: Vec<bool>,
}

/// A child in the tree being built: an inner node or a symbol.
#[derive(Debug, Clone, Copy)]
enum Child {
    None,
    Node(usize),
    Leaf(u16),
}

fn decoder() -> &'static Decoder {
    static TABLE: OnceLock<Decoder> = OnceLock::new();
    TABLE.get_or_init(|| {
        // The tree: node 0 is the root; every code walks from it, most significant bit
        // first, to its symbol's leaf.
        let mut tree: Vec<[Child; 2]> = vec![[Child::None; 2]];
        let mut padding = vec![true];
        for symbol in 0..=EOS {
            let (code, len) = HUFFMAN[usize::from(symbol)];
            let mut node = 0;
            for depth in (0..len).rev() {
                let bit = (code >> depth & 1) as usize;
                if depth == 0 {
                    tree[node][bit] = Child::Leaf(symbol);
                    break;
                }
                node = match tree[node][bit] {
                    Child::Node(n) => n,
                    _ => {
                        tree.push([Child::None; 2]);
                        let ones = padding[node] && bit == 1 && len - depth < 8;
                        padding.push(ones);
                        let n = tree.len() - 1;
                        tree[node][bit] = Child::Node(n);
                        n
                    }
                };
            }
        }
        let steps = (0..tree.len())
            .map(|start| {
                let mut row = [Step::default(); 16];
                for (nibble, step) in row.iter_mut().enumerate() {
                    let mut node = start;
                    for shift in (0..4).rev() {
                        match tree[node][nibble >> shift & 1] {
                            Child::Node(n) => node = n,
                            Child::Leaf(EOS) | Child::None => {
                                step.flags |= FAIL;
                                break;
                            }
                            Child::Leaf(symbol) => {
                                step.symbol = symbol as u8;
                                step.flags |= EMIT;
                                node = 0;
                            }
                        }
                    }
                    // 256 inner nodes: each fits a byte.
                    step.node = node as u8;
                }
                row
            })
            .collect();
        Decoder { steps, padding }
    })
}

/// Why a Huffman string is invalid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HuffmanError {
    /// The EOS symbol inside the string.
    Eos,
    /// Padding longer than 7 bits or not all ones.
    BadPadding,
}

/// Appends the decoding of `bytes` to `out`.
pub fn decode(bytes: &[u8], out: &mut Vec<u8>) -> Result<(), HuffmanError> {
    let table = decoder();
    // Each byte is at least one symbol's worth of bits in eight: at most 8/5 symbols.
    out.reserve(bytes.len() * 8 / 5);
    let mut node = 0usize;
    for &byte in bytes {
        for nibble in [byte >> 4, byte & 0x0f] {
            let step = table.steps[node][usize::from(nibble)];
            if step.flags & FAIL != 0 {
                return Err(HuffmanError::Eos);
            }
            if step.flags & EMIT != 0 {
                out.push(step.symbol);
            }
            node = usize::from(step.node);
        }
    }
    // What is left must be a prefix of EOS (all ones), shorter than a byte.
    if !table.padding[node] {
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

    /// The code decoded a bit at a time (canonical: within a length, codes are
    /// consecutive in symbol order), as the oracle for the table decoder.
    fn decode_bitwise(bytes: &[u8], out: &mut Vec<u8>) -> Result<(), HuffmanError> {
        let mut by_code: Vec<(u32, u8, u16)> = (0..=EOS)
            .map(|s| {
                let (code, len) = HUFFMAN[usize::from(s)];
                (code, len, s)
            })
            .collect();
        by_code.sort_by_key(|&(code, len, _)| (len, code));
        let (mut code, mut len) = (0u32, 0u8);
        for &byte in bytes {
            for shift in (0..8).rev() {
                code = code << 1 | u32::from(byte >> shift & 1);
                len += 1;
                if let Some(&(_, _, symbol)) =
                    by_code.iter().find(|&&(c, l, _)| l == len && c == code)
                {
                    if symbol == EOS {
                        return Err(HuffmanError::Eos);
                    }
                    out.push(symbol as u8);
                    (code, len) = (0, 0);
                }
            }
        }
        if len > 7 || code != (1 << len) - 1 {
            return Err(HuffmanError::BadPadding);
        }
        Ok(())
    }

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
        fn arbitrary_bytes_decode_as_bit_by_bit(s in proptest::collection::vec(any::<u8>(), 0..64)) {
            let (mut fast, mut slow) = (Vec::new(), Vec::new());
            let (a, b) = (decode(&s, &mut fast), decode_bitwise(&s, &mut slow));
            prop_assert_eq!(a, b);
            if a.is_ok() {
                prop_assert_eq!(fast, slow);
            }
        }

        #[test]
        fn encoded_strings_with_damage_decode_as_bit_by_bit(
            s in proptest::collection::vec(any::<u8>(), 1..40),
            at in any::<prop::sample::Index>(),
            flip in 0u8..8,
            cut in any::<bool>(),
        ) {
            let mut encoded = Vec::new();
            encode(&s, &mut encoded);
            let i = at.index(encoded.len());
            encoded[i] ^= 1 << flip;
            if cut {
                encoded.truncate(i + 1);
            }
            let (mut fast, mut slow) = (Vec::new(), Vec::new());
            let (a, b) = (decode(&encoded, &mut fast), decode_bitwise(&encoded, &mut slow));
            prop_assert_eq!(a, b);
            if a.is_ok() {
                prop_assert_eq!(fast, slow);
            }
        }
    }
}
