//! Redis key names: `<prefix>:{<escaped key>}:<limit id>` plus `:m` (a sliding log's
//! meta) and `:l` (a lockout).
//!
//! The runtime key (the descriptor's values, already length-prefixed so that it is
//! unambiguous) is percent-escaped: every byte outside `A-Z a-z 0-9 - . _ ~ / @` becomes
//! `%XX`. The escaping is injective and leaves no `{`, `}`, `:`, `%`-ambiguity,
//! space or non-ASCII byte in the name (the empty key is tagged `%`, which no escaped
//! key equals), so no runtime value can collide with another
//! key or break the hash tag. The braces are a Redis Cluster hash tag: every limit of
//! one descriptor (same runtime key, different limit ids) lands in the same slot.

/// Hexadecimal digits, upper case (the escapes) and lower case (the limit id).
const UPPER: &[u8; 16] = b"0123456789ABCDEF";
const LOWER: &[u8; 16] = b"0123456789abcdef";

/// The names of one check's keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeyNames {
    /// The hash tag's content (the escaped runtime key); checks with equal tags share a slot.
    pub tag: String,
    /// The state key (a string, or for the sliding log a list of entries).
    pub state: String,
}

impl KeyNames {
    /// Names for `key` under the limit `limit_id`.
    pub fn new(prefix: &str, limit_id: u64, key: &[u8]) -> Self {
        // An empty tag `{}` is no hash tag to Redis Cluster (the whole name would be
        // hashed, scattering a check's keys over slots): the empty key is tagged `%`,
        // which escaping never produces on its own.
        let tag = if key.is_empty() {
            String::from("%")
        } else {
            escape(key)
        };
        // Written piece by piece: `format!` showed up in perf profiles of a busy
        // server on Redis.
        let mut state = String::with_capacity(prefix.len() + tag.len() + 20);
        state.push_str(prefix);
        state.push_str(":{");
        state.push_str(&tag);
        state.push_str("}:");
        for shift in (0..16).rev() {
            state.push(char::from(
                LOWER[((limit_id >> (4 * shift)) & 0xf) as usize],
            ));
        }
        Self { tag, state }
    }

    /// The sliding log's meta key.
    pub fn meta(&self) -> String {
        format!("{}:m", self.state)
    }

    /// The lockout key.
    pub fn lockout(&self) -> String {
        format!("{}:l", self.state)
    }
}

/// Percent-escapes every byte outside a small safe set.
pub(crate) fn escape(key: &[u8]) -> String {
    let mut out = String::with_capacity(key.len() * 2);
    for &b in key {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'/' | b'@') {
            out.push(b as char);
        } else {
            out.push('%');
            out.push(char::from(UPPER[usize::from(b >> 4)]));
            out.push(char::from(UPPER[usize::from(b & 0xf)]));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tricky_values_cannot_break_the_hash_tag_or_collide() {
        let values: [&[u8]; 8] = [
            b"a_b",
            b"a:b",
            b"a{b}",
            b"a b",
            "é".as_bytes(),
            b"a%7Bb",
            b"}",
            b"",
        ];
        let names: Vec<_> = values.iter().map(|v| KeyNames::new("tg", 1, v)).collect();
        for (n, v) in names.iter().zip(values) {
            assert!(!n.tag.contains(['{', '}', ':', ' ']), "{v:?} -> {}", n.tag);
            assert!(n.state.is_ascii());
            assert!(!n.tag.is_empty(), "`{{}}` is no hash tag in a cluster");
            assert_eq!(n.state.matches('{').count(), 1);
        }
        let mut all: Vec<_> = names.iter().map(|n| n.state.clone()).collect();
        all.sort();
        all.dedup();
        assert_eq!(
            all.len(),
            values.len(),
            "distinct values give distinct keys"
        );
    }

    #[test]
    fn one_descriptors_limits_share_the_tag() {
        let a = KeyNames::new("tg", 1, b"\0user");
        let b = KeyNames::new("tg", 2, b"\0user");
        assert_eq!(a.tag, b.tag);
        assert_ne!(a.state, b.state);
        assert_eq!(a.lockout(), format!("{}:l", a.state));
    }

    #[test]
    fn names_are_spelled_as_documented() {
        let n = KeyNames::new("tg", 0x1234_abcd, b"\0\x05a b\xff");
        assert_eq!(n.tag, "%00%05a%20b%FF");
        assert_eq!(n.state, "tg:{%00%05a%20b%FF}:000000001234abcd");
        assert_eq!(
            KeyNames::new("p", u64::MAX, b"").state,
            "p:{%}:ffffffffffffffff"
        );
    }
}
