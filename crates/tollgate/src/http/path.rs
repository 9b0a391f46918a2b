//! The request path as the gateway matches it, and as it forwards it.
//!
//! Upstreams normalize paths before they route (nginx, most frameworks): `/%61pi/items`,
//! `//api/items`, `/./api/items`, `/x/../api/items` all reach `/api/items`. A gateway
//! that compared the raw path with `/api/` would let each of them around the route's
//! limits. So the path is normalized once, routes compare the normal form, and the
//! normal form is what is forwarded, so that the upstream serves what was matched:
//!
//! - percent-encoded unreserved characters (`A–Z a–z 0–9 - . _ ~`) are decoded, other
//!   escapes are kept with upper-case hex digits;
//! - `.` and `..` segments are resolved (RFC 3986 §5.2.4; `..` never climbs above the
//!   root), a segment that is `.` or `..` before a `;` counts as one (some servers drop
//!   the parameters first);
//! - repeated slashes are merged; a trailing slash stays.
//!
//! What cannot be normalized without guessing how the upstream reads it is refused
//! (400): a malformed escape, an encoded `/` or `\` (`%2F`, `%5C`), an encoded NUL, a
//! raw `\`.
//!
//! Each route then compares its [`Form`] of the normal path: by default without regard
//! to ASCII case and without `;` segment parameters (`/API;jsessionid=1/items` is
//! `/api/items`), each a per-route option.

use std::borrow::Cow;
use std::sync::OnceLock;

/// Why a path cannot be normalized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// A `%` not followed by two hexadecimal digits.
    #[error("a `%` at byte {0} is not followed by two hexadecimal digits")]
    MalformedEscape(usize),
    /// `%2F` or `%5C`: whether it separates segments depends on the upstream.
    #[error(
        "an encoded `/` or `\\` (`%2F`, `%5C`) at byte {0}: upstreams disagree on what it means"
    )]
    EncodedSeparator(usize),
    /// `%00`.
    #[error("an encoded NUL (`%00`) at byte {0}")]
    EncodedNul(usize),
    /// A raw backslash, which some upstreams read as `/`.
    #[error("a `\\` at byte {0}: some upstreams read it as `/`")]
    Backslash(usize),
    /// Neither `*` nor a path starting with `/`.
    #[error("the path does not start with `/`")]
    NotAbsolute,
}

/// How a route compares paths.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Form {
    /// Compare ASCII case exactly.
    pub case_sensitive: bool,
    /// Keep `;` parameters of path segments.
    pub keep_parameters: bool,
}

impl Form {
    fn index(self) -> usize {
        usize::from(self.case_sensitive) * 2 + usize::from(self.keep_parameters)
    }
}

/// A request's normalized path and, computed on first use, each route form of it.
#[derive(Debug)]
pub struct RequestPath {
    normal: String,
    /// `None` in a cell: that form is the normal path itself.
    forms: [OnceLock<Option<String>>; 4],
}

impl RequestPath {
    /// Normalizes `raw` (a request's path, without the query).
    pub fn parse(raw: &str) -> Result<Self, PathError> {
        normalize(raw).map(Self::from_normal)
    }

    /// A path that is already normal.
    pub(crate) fn from_normal(normal: String) -> Self {
        Self {
            normal,
            forms: Default::default(),
        }
    }

    /// The normalized path: what is forwarded.
    pub fn normal(&self) -> &str {
        &self.normal
    }

    /// The path in `form`: what a route with that form compares and its `path` action
    /// reads.
    pub fn get(&self, form: Form) -> &str {
        let cell = &self.forms[form.index()];
        cell.get_or_init(|| match in_form(&self.normal, form) {
            Cow::Borrowed(_) => None,
            Cow::Owned(s) => Some(s),
        })
        .as_deref()
        .unwrap_or(&self.normal)
    }
}

fn in_form(normal: &str, form: Form) -> Cow<'_, str> {
    let mut out = Cow::Borrowed(normal);
    if !form.keep_parameters && normal.contains(';') {
        out = Cow::Owned(without_parameters(normal));
    }
    if !form.case_sensitive && out.bytes().any(|b| b.is_ascii_uppercase()) {
        out = Cow::Owned(out.to_ascii_lowercase());
    }
    out
}

/// `normal` with each segment's `;…` cut off.
fn without_parameters(normal: &str) -> String {
    let mut out = String::with_capacity(normal.len());
    for (i, segment) in normal.split('/').enumerate() {
        if i > 0 {
            out.push('/');
        }
        out.push_str(segment.split(';').next().unwrap_or(""));
    }
    out
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// The normal form of `raw` (see the module's documentation). `*` (as in `OPTIONS *`)
/// and the empty path (`/`) are normal.
pub fn normalize(raw: &str) -> Result<String, PathError> {
    if raw.is_empty() {
        return Ok("/".to_string());
    }
    if raw == "*" {
        return Ok(raw.to_string());
    }
    if !raw.starts_with('/') {
        return Err(PathError::NotAbsolute);
    }
    // Pass 1: escapes.
    let bytes = raw.as_bytes();
    let mut decoded = String::with_capacity(raw.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        match b {
            b'%' => {
                let hex = |k: usize| bytes.get(k).and_then(|&c| (c as char).to_digit(16));
                let (Some(hi), Some(lo)) = (hex(i + 1), hex(i + 2)) else {
                    return Err(PathError::MalformedEscape(i));
                };
                let value = (hi * 16 + lo) as u8;
                match value {
                    b'/' | b'\\' => return Err(PathError::EncodedSeparator(i)),
                    0 => return Err(PathError::EncodedNul(i)),
                    v if is_unreserved(v) => decoded.push(char::from(v)),
                    v => {
                        const HEX: &[u8; 16] = b"0123456789ABCDEF";
                        decoded.push('%');
                        decoded.push(char::from(HEX[usize::from(v >> 4)]));
                        decoded.push(char::from(HEX[usize::from(v & 15)]));
                    }
                }
                i += 3;
            }
            b'\\' => return Err(PathError::Backslash(i)),
            _ => {
                // Copy the run up to the next byte that needs a look (keeps UTF-8 whole).
                let end = bytes[i..]
                    .iter()
                    .position(|&c| c == b'%' || c == b'\\')
                    .map_or(bytes.len(), |n| i + n);
                decoded.push_str(&raw[i..end]);
                i = end;
            }
        }
    }
    // Pass 2: segments.
    let mut kept: Vec<&str> = Vec::new();
    let mut trailing = false;
    for segment in decoded.split('/').skip(1) {
        let name = segment.split(';').next().unwrap_or("");
        trailing = false;
        match name {
            // An empty segment, or one of parameters only: merged away.
            "" | "." => trailing = true,
            ".." => {
                kept.pop();
                trailing = true;
            }
            _ => kept.push(segment),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for segment in &kept {
        out.push('/');
        out.push_str(segment);
    }
    if trailing || kept.is_empty() {
        out.push('/');
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn every_bypass_of_a_prefix_normalizes_to_the_path_it_reaches() {
        for raw in [
            "/api/items",
            "/%61pi/items",
            "//api/items",
            "/./api/items",
            "/x/../api/items",
            "/%2e/api/items",
            "/%2E%2E/api/items",
            "/../../api/items",
            "/api/./items",
            "/api//items",
            "/api/items/x/..",
        ] {
            let p = RequestPath::parse(raw).unwrap();
            let want = if raw.ends_with("..") {
                "/api/items/"
            } else {
                "/api/items"
            };
            assert_eq!(p.normal(), want, "{raw}");
        }
        let p = RequestPath::parse("/API;x=1/Items").unwrap();
        assert_eq!(
            p.normal(),
            "/API;x=1/Items",
            "forwarded as sent, but for case and escapes"
        );
        assert_eq!(p.get(Form::default()), "/api/items");
        let exact = Form {
            case_sensitive: true,
            keep_parameters: true,
        };
        assert_eq!(p.get(exact), "/API;x=1/Items");
        let case_only = Form {
            case_sensitive: true,
            keep_parameters: false,
        };
        assert_eq!(p.get(case_only), "/API/Items");
        // `..;` is `..` to servers that drop parameters first.
        assert_eq!(normalize("/x/..;a=b/api/items").unwrap(), "/api/items");
        // A segment of parameters only is an empty one.
        assert_eq!(normalize("/;x=1/api/items").unwrap(), "/api/items");
    }

    #[test]
    fn escapes_other_than_unreserved_are_kept_with_upper_case_hex() {
        assert_eq!(normalize("/caf%c3%a9/%7e%41").unwrap(), "/caf%C3%A9/~A");
        assert_eq!(normalize("/a%20b/é").unwrap(), "/a%20b/é");
        assert_eq!(normalize("/").unwrap(), "/");
        assert_eq!(normalize("").unwrap(), "/");
        assert_eq!(normalize("*").unwrap(), "*");
        assert_eq!(normalize("/..").unwrap(), "/");
        assert_eq!(normalize("/a/").unwrap(), "/a/");
    }

    #[test]
    fn what_cannot_be_normalized_is_refused_with_its_place() {
        assert_eq!(normalize("/a%2fb"), Err(PathError::EncodedSeparator(2)));
        assert_eq!(normalize("/a%5Cb"), Err(PathError::EncodedSeparator(2)));
        assert_eq!(normalize("/a%00"), Err(PathError::EncodedNul(2)));
        assert_eq!(normalize("/a%g0"), Err(PathError::MalformedEscape(2)));
        assert_eq!(normalize("/a%4"), Err(PathError::MalformedEscape(2)));
        assert_eq!(normalize("/a\\..\\b"), Err(PathError::Backslash(2)));
        assert_eq!(normalize("api"), Err(PathError::NotAbsolute));
    }

    proptest! {
        /// Normal is a fixed point, and has no segment an upstream would resolve.
        #[test]
        fn normal_paths_are_normal(raw in "/[a-zA-Z0-9./;%~_-]{0,40}") {
            if let Ok(normal) = normalize(&raw) {
                let again = normalize(&normal);
                prop_assert_eq!(again.as_deref(), Ok(normal.as_str()));
                prop_assert!(normal.starts_with('/'));
                prop_assert!(!normal.contains("//"), "{}", normal);
                for segment in normal.split('/') {
                    let name = segment.split(';').next().unwrap_or("");
                    prop_assert!(name != "." && name != "..", "{}", normal);
                }
                for form in [false, true].into_iter().flat_map(|c| [false, true].map(move |k| Form { case_sensitive: c, keep_parameters: k })) {
                    let p = RequestPath::from_normal(normal.clone());
                    let want = in_form(&normal, form);
                    prop_assert_eq!(p.get(form), want.as_ref());
                }
            }
        }

        /// Decoding an unreserved escape never changes what the path normalizes to.
        #[test]
        fn an_escaped_unreserved_character_is_the_character(prefix in "/[a-z/]{0,10}", c in "[a-zA-Z0-9._~-]", suffix in "[a-z/]{0,10}") {
            let byte = c.as_bytes()[0];
            let plain = format!("{prefix}{c}{suffix}");
            let escaped = format!("{prefix}%{byte:02x}{suffix}");
            prop_assert_eq!(normalize(&plain), normalize(&escaped));
        }
    }
}
