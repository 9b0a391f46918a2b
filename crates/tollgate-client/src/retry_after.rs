//! Reading a server's hints: `Retry-After` (RFC 9110 §10.2.3) and the IETF draft fields
//! `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers), as
//! Tollgate sends them (`tollgate::headers`):
//!
//! ```text
//! RateLimit-Policy: "per_user";q=10;w=60, "global";q=1000;w=1
//! RateLimit: "per_user";r=0;t=12, "global";r=998;t=1
//! Retry-After: 12
//! ```
//!
//! The draft fields are structured-field lists (RFC 8941). A value that is not one gives
//! `None` (as RFC 8941 has a parser fail the whole field); an item of a well-formed list
//! that lacks a required parameter (`q` for a policy, `r` for a state) or has one that is
//! not a non-negative integer is left out. Nothing here panics on any input.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::header::{HeaderMap, HeaderName, RETRY_AFTER};

/// `RateLimit-Policy`.
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit`.
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// The longest number of digits of a structured-field integer (RFC 8941 §3.3.1).
const MAX_INTEGER_DIGITS: usize = 15;

/// How long `Retry-After`'s `value` asks to wait, seen at `now`: its delay-seconds, or
/// the time until its HTTP-date (zero for a date already past). `None` when the value is
/// neither.
///
/// All three HTTP-date forms RFC 9110 has recipients accept are read: the IMF-fixdate
/// (`Sun, 06 Nov 1994 08:49:37 GMT`), the obsolete RFC 850 form
/// (`Sunday, 06-Nov-94 08:49:37 GMT`) and asctime's (`Sun Nov  6 08:49:37 1994`).
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim_matches(|c| c == ' ' || c == '\t');
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Delay-seconds. A number too large for a u64 still means "a very long time".
        let secs = value.parse::<u64>().unwrap_or(u64::MAX);
        return Some(Duration::from_secs(secs));
    }
    let date = parse_http_date(value)?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The `Retry-After` of `headers` (its first value), seen at `now`.
pub fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?;
    parse_retry_after(value, now)
}

/// An HTTP-date (RFC 9110 §5.6.7) as a time; `None` when `value` is none of its forms or
/// names no real date.
pub fn parse_http_date(value: &str) -> Option<SystemTime> {
    let (weekday, rest) = match value.split_once(',') {
        Some((w, rest)) => (w, rest),
        None => {
            // asctime: `Sun Nov  6 08:49:37 1994`.
            let mut t = value.split_ascii_whitespace();
            let (w, mon, day, time, year) = (t.next()?, t.next()?, t.next()?, t.next()?, t.next()?);
            if t.next().is_some() || !is_alpha(w) || day.len() > 2 || year.len() != 4 {
                return None;
            }
            return civil(number(year)?, month(mon)?, number(day)?, time);
        }
    };
    if !is_alpha(weekday) {
        return None;
    }
    let mut t = rest.split_ascii_whitespace();
    let first = t.next()?;
    if let Some((day, rest)) = first.split_once('-') {
        // RFC 850: `Sunday, 06-Nov-94 08:49:37 GMT`.
        let (mon, yy) = rest.split_once('-')?;
        let (time, gmt) = (t.next()?, t.next()?);
        if t.next().is_some() || gmt != "GMT" || day.len() != 2 || yy.len() != 2 {
            return None;
        }
        // RFC 9110: a two-digit year that looks more than 50 years in the future is in
        // the past century; for the dates a server sends now, that is 19xx from 70 on.
        let yy = number(yy)?;
        let year = if yy < 70 { 2000 + yy } else { 1900 + yy };
        return civil(year, month(mon)?, number(day)?, time);
    }
    // IMF-fixdate: `Sun, 06 Nov 1994 08:49:37 GMT`.
    let (mon, year, time, gmt) = (t.next()?, t.next()?, t.next()?, t.next()?);
    if t.next().is_some() || gmt != "GMT" || first.len() != 2 || year.len() != 4 {
        return None;
    }
    civil(number(year)?, month(mon)?, number(first)?, time)
}

fn is_alpha(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphabetic())
}

/// A short run of ASCII digits as a number.
fn number(s: &str) -> Option<u64> {
    if s.is_empty() || s.len() > 4 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

fn month(s: &str) -> Option<u64> {
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    MONTHS.iter().position(|m| *m == s).map(|i| i as u64 + 1)
}

/// The time of a civil date (UTC) and an `hh:mm:ss`; `None` for a date that does not
/// exist or one before 1970.
fn civil(year: u64, month: u64, day: u64, time: &str) -> Option<SystemTime> {
    let mut hms = time.split(':');
    let (h, m, s) = (hms.next()?, hms.next()?, hms.next()?);
    if hms.next().is_some() || h.len() != 2 || m.len() != 2 || s.len() != 2 {
        return None;
    }
    let (h, m, s) = (number(h)?, number(m)?, number(s)?);
    // 60: a leap second.
    if year < 1970 || h > 23 || m > 59 || s > 60 {
        return None;
    }
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let days_in_month = match month {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    };
    if day == 0 || day > days_in_month {
        return None;
    }
    // Days since 1970-01-01 (Howard Hinnant's days_from_civil, for years from 1970).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = (era * 146_097 + doe).checked_sub(719_468)?;
    let secs = days * 86_400 + h * 3600 + m * 60 + s;
    UNIX_EPOCH.checked_add(Duration::from_secs(secs))
}

/// One item of `RateLimit-Policy`: a policy's name, quota and window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyItem {
    /// The policy's name (the item's string or token).
    pub name: String,
    /// `q`: the quota, in requests (Tollgate's `requests_per_unit`).
    pub quota: u64,
    /// `w`: the window in seconds, when given.
    pub window: Option<u64>,
}

/// One item of `RateLimit`: the state of a policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateItem {
    /// The policy's name, as in `RateLimit-Policy`.
    pub name: String,
    /// `r`: the requests left.
    pub remaining: u64,
    /// `t`: the seconds until the quota is full again, when given.
    pub reset: Option<u64>,
}

/// The items of a `RateLimit-Policy` value; `None` when it is no structured-field list.
pub fn parse_policy(value: &str) -> Option<Vec<PolicyItem>> {
    Some(
        parse_list(value)?
            .into_iter()
            .filter_map(|item| {
                Some(PolicyItem {
                    quota: item.param("q")?,
                    window: item.param("w"),
                    name: item.name,
                })
            })
            .collect(),
    )
}

/// The items of a `RateLimit` value; `None` when it is no structured-field list.
pub fn parse_ratelimit(value: &str) -> Option<Vec<StateItem>> {
    Some(
        parse_list(value)?
            .into_iter()
            .filter_map(|item| {
                Some(StateItem {
                    remaining: item.param("r")?,
                    reset: item.param("t"),
                    name: item.name,
                })
            })
            .collect(),
    )
}

/// The `RateLimit-Policy` items of `headers`, all its lines joined as one list; `None`
/// when there is none, or it is not a list.
pub fn policies(headers: &HeaderMap) -> Option<Vec<PolicyItem>> {
    parse_policy(&joined(headers, &RATELIMIT_POLICY)?)
}

/// The `RateLimit` items of `headers`, all its lines joined as one list; `None` when
/// there is none, or it is not a list.
pub fn states(headers: &HeaderMap) -> Option<Vec<StateItem>> {
    parse_ratelimit(&joined(headers, &RATELIMIT)?)
}

/// The values of `name`, joined by `", "` (RFC 9110 §5.3); `None` when there is none,
/// or one is not visible ASCII.
fn joined(headers: &HeaderMap, name: &HeaderName) -> Option<String> {
    let mut out: Option<String> = None;
    for v in headers.get_all(name) {
        let v = v.to_str().ok()?;
        match &mut out {
            Some(s) => {
                s.push_str(", ");
                s.push_str(v);
            }
            None => out = Some(v.to_string()),
        }
    }
    out
}

/// A list member's name and its non-negative integer parameters (others are skipped).
struct Item {
    name: String,
    params: Vec<(String, Option<u64>)>,
}

impl Item {
    /// The last value of parameter `key` (RFC 8941: a later one overrides), when a
    /// non-negative integer.
    fn param(&self, key: &str) -> Option<u64> {
        self.params
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .and_then(|(_, v)| *v)
    }
}

/// A structured-field list (RFC 8941 §4.2.1) whose members are Strings or Tokens;
/// `None` on any syntax error, or a member of another kind.
fn parse_list(value: &str) -> Option<Vec<Item>> {
    let mut p = Parser {
        s: value.as_bytes(),
        i: 0,
    };
    p.skip(|b| b == b' ');
    let mut items = Vec::new();
    if p.done() {
        return Some(items);
    }
    loop {
        let name = match p.peek()? {
            b'"' => p.string()?,
            b if b.is_ascii_alphabetic() || b == b'*' => p.token()?,
            _ => return None,
        };
        let mut params = Vec::new();
        while p.peek() == Some(b';') {
            p.i += 1;
            p.skip(|b| b == b' ');
            let key = p.key()?;
            let value = if p.peek() == Some(b'=') {
                p.i += 1;
                p.bare_item()?
            } else {
                None // A boolean true: no number.
            };
            params.push((key, value));
        }
        items.push(Item { name, params });
        p.skip(|b| b == b' ' || b == b'\t');
        if p.done() {
            return Some(items);
        }
        if p.peek()? != b',' {
            return None;
        }
        p.i += 1;
        p.skip(|b| b == b' ' || b == b'\t');
        if p.done() {
            return None; // A trailing comma.
        }
    }
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn done(&self) -> bool {
        self.i >= self.s.len()
    }

    fn skip(&mut self, f: impl Fn(u8) -> bool) {
        while self.peek().is_some_and(&f) {
            self.i += 1;
        }
    }

    /// A String: `"…"` with `\"` and `\\` escapes, printable ASCII only.
    fn string(&mut self) -> Option<String> {
        self.i += 1; // The opening quote.
        let mut out = String::new();
        loop {
            match self.peek()? {
                b'\\' => {
                    self.i += 1;
                    match self.peek()? {
                        c @ (b'"' | b'\\') => out.push(c as char),
                        _ => return None,
                    }
                }
                b'"' => {
                    self.i += 1;
                    return Some(out);
                }
                c @ b' '..=b'~' => out.push(c as char),
                _ => return None,
            }
            self.i += 1;
        }
    }

    /// A Token: `(ALPHA / "*") *(tchar / ":" / "/")`.
    fn token(&mut self) -> Option<String> {
        let start = self.i;
        self.i += 1;
        self.skip(|b| b.is_ascii_alphanumeric() || b":/!#$%&'*+-.^_`|~".contains(&b));
        std::str::from_utf8(&self.s[start..self.i])
            .ok()
            .map(str::to_string)
    }

    /// A parameter key: `(lcalpha / "*") *(lcalpha / DIGIT / "_" / "-" / "." / "*")`.
    fn key(&mut self) -> Option<String> {
        let start = self.i;
        match self.peek()? {
            b'a'..=b'z' | b'*' => self.i += 1,
            _ => return None,
        }
        self.skip(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' | b'*'));
        std::str::from_utf8(&self.s[start..self.i])
            .ok()
            .map(str::to_string)
    }

    /// A bare item as a parameter value: `Some(Some(n))` for a non-negative integer,
    /// `Some(None)` for any other well-formed item (negative or decimal number, string,
    /// token, boolean), `None` on a syntax error.
    fn bare_item(&mut self) -> Option<Option<u64>> {
        match self.peek()? {
            b'"' => self.string().map(|_| None),
            b':' => {
                // A Byte Sequence: base64 between colons.
                self.i += 1;
                self.skip(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'='));
                (self.peek()? == b':').then(|| {
                    self.i += 1;
                    None
                })
            }
            b'?' => {
                self.i += 1;
                match self.peek()? {
                    b'0' | b'1' => {
                        self.i += 1;
                        Some(None)
                    }
                    _ => None,
                }
            }
            b'-' | b'0'..=b'9' => {
                let negative = self.peek() == Some(b'-');
                if negative {
                    self.i += 1;
                }
                let start = self.i;
                self.skip(|b| b.is_ascii_digit());
                let digits = self.i - start;
                if digits == 0 || digits > MAX_INTEGER_DIGITS {
                    return None;
                }
                if self.peek() == Some(b'.') {
                    // A Decimal: at most 12 digits, a dot, 1 to 3 digits.
                    self.i += 1;
                    let frac = self.i;
                    self.skip(|b| b.is_ascii_digit());
                    let f = self.i - frac;
                    return (digits <= 12 && (1..=3).contains(&f)).then_some(None);
                }
                if negative {
                    return Some(None);
                }
                let n = std::str::from_utf8(&self.s[start..self.i])
                    .ok()?
                    .parse()
                    .ok()?;
                Some(Some(n))
            }
            b if b.is_ascii_alphabetic() || b == b'*' => self.token().map(|_| None),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    /// 1994-11-06T08:49:37Z.
    const RFC_EXAMPLE: u64 = 784_111_777;

    #[test]
    fn delay_seconds() {
        let now = SystemTime::now();
        assert_eq!(parse_retry_after("12", now), Some(Duration::from_secs(12)));
        assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
        assert_eq!(
            parse_retry_after("99999999999999999999999", now),
            Some(Duration::from_secs(u64::MAX))
        );
        for bad in ["", "-1", "1.5", "12s", "+3", "1 2", "0x10"] {
            assert_eq!(parse_retry_after(bad, now), None, "{bad:?}");
        }
    }

    #[test]
    fn http_dates_in_all_three_forms() {
        for form in [
            "Sun, 06 Nov 1994 08:49:37 GMT",
            "Sunday, 06-Nov-94 08:49:37 GMT",
            "Sun Nov  6 08:49:37 1994",
        ] {
            assert_eq!(parse_http_date(form), Some(at(RFC_EXAMPLE)), "{form}");
        }
        assert_eq!(
            parse_http_date("Thu, 01 Jan 1970 00:00:00 GMT"),
            Some(UNIX_EPOCH)
        );
        assert_eq!(
            parse_http_date("Tue, 29 Feb 2000 23:59:59 GMT"),
            Some(at(951_868_799))
        );
    }

    #[test]
    fn http_date_is_a_wait_from_now_and_zero_when_past() {
        let now = at(RFC_EXAMPLE - 30);
        let v = "Sun, 06 Nov 1994 08:49:37 GMT";
        assert_eq!(parse_retry_after(v, now), Some(Duration::from_secs(30)));
        let later = at(RFC_EXAMPLE + 30);
        assert_eq!(parse_retry_after(v, later), Some(Duration::ZERO));
    }

    #[test]
    fn bad_dates_are_none() {
        for bad in [
            "Sun, 06 Nov 1994 08:49:37 UTC",
            "Sun, 31 Feb 1994 08:49:37 GMT",
            "Sun, 29 Feb 1900 08:49:37 GMT",
            "Sun, 06 Nov 1994 24:00:00 GMT",
            "Sun, 06 Nov 1994 08:49 GMT",
            "Sun, 06 Nov 1994 08:49:37 GMT extra",
            "Sun, 06 Foo 1994 08:49:37 GMT",
            "Sun, 06 Nov 1969 08:49:37 GMT",
            "Sun, 6 Nov 1994 08:49:37 GMT",
            "Sunday, 06-Nov-1994 08:49:37 GMT",
            "Sun Nov  6 08:49:37",
            ",",
            "Sun, ",
            "1, 06 Nov 1994 08:49:37 GMT",
            "Sun, ０6 Nov 1994 08:49:37 GMT",
        ] {
            assert_eq!(parse_http_date(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_fields_as_tollgate_sends_them() {
        let p = parse_policy(r#""per_user";q=10;w=60, "global";q=1000;w=1"#).unwrap();
        assert_eq!(
            p,
            vec![
                PolicyItem {
                    name: "per_user".into(),
                    quota: 10,
                    window: Some(60)
                },
                PolicyItem {
                    name: "global".into(),
                    quota: 1000,
                    window: Some(1)
                },
            ]
        );
        let s = parse_ratelimit(r#""per_user";r=0;t=12, "global";r=998;t=1"#).unwrap();
        assert_eq!(s[0].name, "per_user");
        assert_eq!((s[0].remaining, s[0].reset), (0, Some(12)));
        assert_eq!((s[1].remaining, s[1].reset), (998, Some(1)));
        // Escapes in a name, as `push_policy_name` writes them.
        let p = parse_policy(r#""a\"b\\c";q=1;w=2"#).unwrap();
        assert_eq!(p[0].name, r#"a"b\c"#);
    }

    #[test]
    fn tolerated_forms() {
        // A token name, other parameters of any kind, no window, a later value wins,
        // tabs and spaces around commas.
        let p = parse_policy("default;q=5;pk=:AAE=:;x=?1;q=7, \"b\";q=1;qu=\"x\";w=-2").unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(
            (p[0].name.as_str(), p[0].quota, p[0].window),
            ("default", 7, None)
        );
        assert_eq!((p[1].quota, p[1].window), (1, None));
        assert_eq!(parse_policy(""), Some(vec![]));
        assert_eq!(parse_ratelimit("  ").map(|v| v.len()), Some(0));
        let s = parse_ratelimit("\"a\";r=3,\t\"b\"; r=4;t=1.5").unwrap();
        assert_eq!((s[1].remaining, s[1].reset), (4, None));
    }

    #[test]
    fn items_without_their_required_parameter_are_left_out() {
        let p = parse_policy(r#""a";w=60, "b";q=-1, "c";q=2.5, "d";q, "e";q=3"#).unwrap();
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].name, "e");
        let s = parse_ratelimit(r#""a";t=1, "b";r="0""#).unwrap();
        assert!(s.is_empty());
    }

    #[test]
    fn malformed_lists_are_none() {
        for bad in [
            r#""a";q=1,"#,
            r#""a";q=1,,"b";q=2"#,
            r#""a;q=1"#,
            r#""a\n";q=1"#,
            r#""a";Q=1"#,
            r#""a";q=1234567890123456"#,
            r#""a";q=1.2345"#,
            r#""a";q=?2"#,
            r#""a" ;q=1"#,
            r#"1;q=1"#,
            r#"("a" "b");q=1"#,
            r#""a";q=1 "b";q=2"#,
            r#""a";q="#,
            r#""a";="#,
            "\"é\";q=1",
            ";",
        ] {
            assert_eq!(parse_policy(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn no_input_panics() {
        // Every prefix and every single-byte change of a real value parses or gives
        // None.
        let real = r#""per_user";q=10;w=60, "a\"b";q=1000;w=1, tok;r=?1;t=1.25"#;
        for end in 0..=real.len() {
            let _ = parse_policy(&real[..end]);
            let _ = parse_ratelimit(&real[..end]);
        }
        let bytes = real.as_bytes();
        for i in 0..bytes.len() {
            for b in [
                b'"', b'\\', b';', b'=', b',', b'-', b'.', b'?', b'9', b' ', 0x7f,
            ] {
                let mut v = bytes.to_vec();
                v[i] = b;
                if let Ok(s) = std::str::from_utf8(&v) {
                    let _ = parse_policy(s);
                    let _ = parse_retry_after(s, SystemTime::now());
                }
            }
        }
    }

    #[test]
    fn from_a_header_map() {
        let mut h = HeaderMap::new();
        h.append(RATELIMIT_POLICY, "\"a\";q=10;w=60".parse().unwrap());
        h.append(RATELIMIT_POLICY, "\"b\";q=5;w=1".parse().unwrap());
        h.append(RATELIMIT, "\"a\";r=0;t=12".parse().unwrap());
        h.append(RETRY_AFTER, "12".parse().unwrap());
        assert_eq!(policies(&h).unwrap().len(), 2);
        assert_eq!(states(&h).unwrap()[0].reset, Some(12));
        assert_eq!(
            retry_after(&h, SystemTime::now()),
            Some(Duration::from_secs(12))
        );
        assert_eq!(states(&HeaderMap::new()), None);
    }
}
