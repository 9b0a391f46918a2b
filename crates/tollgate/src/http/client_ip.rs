//! The client's IP address: the socket peer, or what one configured header says
//! (`X-Forwarded-For` by default, or `Forwarded`, `X-Real-IP`, …), but only through
//! proxies the configuration trusts.
//!
//! Walking the chain from the right (the hop nearest to us): the peer is the first
//! candidate; while the candidate is a trusted proxy, the next address to the left is
//! believed. The first untrusted address is the client. A client can write anything into
//! the header, but what it writes sits left of the first untrusted hop, so it is never
//! reached. With no trusted proxies, the header is ignored.
//!
//! Exactly one header is read. A trusted proxy vouches for the header it writes and
//! passes others through untouched: nginx appends to `X-Forwarded-For` and forwards a
//! client's own `Forwarded` as it came, so reading `Forwarded` there would let the
//! client choose its address. IPv4-mapped IPv6 addresses (`::ffff:192.0.2.1`) are the
//! IPv4 address.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use http::{HeaderMap, HeaderName};
use ipnet::IpNet;

/// The client address for a request from `peer` with `headers`, reading `header`
/// through the proxies in `trusted`.
pub fn client_ip(
    peer: IpAddr,
    headers: &HeaderMap,
    header: &HeaderName,
    trusted: &[IpNet],
) -> IpAddr {
    let peer = peer.to_canonical();
    let is_trusted = |ip: &IpAddr| trusted.iter().any(|net| net.contains(ip));
    if !is_trusted(&peer) {
        return peer;
    }
    let mut hops = chain(headers, header);
    let mut client = peer;
    while let Some(hop) = hops.pop() {
        match hop {
            Some(ip) => {
                client = ip.to_canonical();
                if !is_trusted(&client) {
                    return client;
                }
            }
            // An unreadable hop ends what can be believed: the last trusted address
            // stands.
            None => return client,
        }
    }
    client
}

/// The key of a client address: an IPv4 address as written; an IPv6 address by its
/// leading `ipv6_prefix` bits (`2001:db8:1:2::/64`), as written when that is all 128.
pub fn client_key(ip: IpAddr, ipv6_prefix: u8) -> String {
    match ip {
        IpAddr::V4(_) => ip_text(ip),
        IpAddr::V6(v6) if ipv6_prefix >= 128 => v6.to_string(),
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            let mask = u128::MAX
                .checked_shl(128 - u32::from(ipv6_prefix))
                .unwrap_or(0);
            format!("{}/{ipv6_prefix}", Ipv6Addr::from(bits & mask))
        }
    }
}

/// The address as text, as `Display` writes it; IPv4 without the formatting machinery
/// (this runs for every request of a `remote_address` route).
fn ip_text(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => {
            let mut out = String::with_capacity(15);
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push('.');
                }
                if octet >= 100 {
                    out.push(char::from(b'0' + octet / 100));
                }
                if octet >= 10 {
                    out.push(char::from(b'0' + octet / 10 % 10));
                }
                out.push(char::from(b'0' + octet % 10));
            }
            out
        }
        IpAddr::V6(_) => ip.to_string(),
    }
}

/// Every hop `header` names, leftmost first (`None` for one that is not an IP).
/// `Forwarded` is read as RFC 7239 (its `for=` parameters); any other header as a
/// comma-separated list of addresses (`X-Forwarded-For`; `X-Real-IP` is a list of one).
/// Several header lines are read in order.
fn chain(headers: &HeaderMap, header: &HeaderName) -> Vec<Option<IpAddr>> {
    let lines = headers
        .get_all(header)
        .iter()
        .map(|v| v.to_str().unwrap_or(""));
    if header == http::header::FORWARDED {
        return lines
            .flat_map(|line| line.split(','))
            .map(|element| {
                element
                    .split(';')
                    .filter_map(|pair| pair.split_once('='))
                    .find(|(k, _)| k.trim().eq_ignore_ascii_case("for"))
                    .and_then(|(_, v)| parse_node(v.trim().trim_matches('"')))
            })
            .collect();
    }
    lines
        .flat_map(|line| line.split(','))
        .map(|s| parse_node(s.trim()))
        .collect()
}

/// `1.2.3.4`, `1.2.3.4:80`, `2001:db8::1`, `[2001:db8::1]:80`.
fn parse_node(s: &str) -> Option<IpAddr> {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Ok(sa) = s.parse::<SocketAddr>() {
        return Some(sa.ip());
    }
    s.strip_prefix('[')
        .and_then(|r| r.split(']').next())
        .and_then(|ip| ip.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn xff() -> HeaderName {
        HeaderName::from_static("x-forwarded-for")
    }

    #[test]
    fn an_untrusted_peer_cannot_choose_its_address() {
        let trusted = ["10.0.0.0/8".parse().unwrap()];
        let h = headers(&[("x-forwarded-for", "1.1.1.1")]);
        assert_eq!(
            client_ip(ip("203.0.113.9"), &h, &xff(), &trusted),
            ip("203.0.113.9")
        );
        assert_eq!(
            client_ip(ip("203.0.113.9"), &h, &xff(), &[]),
            ip("203.0.113.9")
        );
    }

    #[test]
    fn through_trusted_proxies_the_rightmost_untrusted_hop_is_the_client() {
        let trusted = ["10.0.0.0/8".parse().unwrap()];
        // The client spoofed 6.6.6.6; 198.51.100.7 is who reached our first proxy.
        let h = headers(&[("x-forwarded-for", "6.6.6.6, 198.51.100.7, 10.0.0.2")]);
        assert_eq!(
            client_ip(ip("10.0.0.1"), &h, &xff(), &trusted),
            ip("198.51.100.7")
        );
        let h = headers(&[(
            "forwarded",
            "for=6.6.6.6, for=\"[2001:db8::7]:443\";proto=https",
        )]);
        let fwd = http::header::FORWARDED;
        assert_eq!(
            client_ip(ip("10.0.0.1"), &h, &fwd, &trusted),
            ip("2001:db8::7")
        );
        // Only trusted hops: the leftmost is the best we know.
        let h = headers(&[("x-forwarded-for", "10.9.9.9")]);
        assert_eq!(
            client_ip(ip("10.0.0.1"), &h, &xff(), &trusted),
            ip("10.9.9.9")
        );
        // Garbage stops the walk at the last trusted address.
        let h = headers(&[("x-forwarded-for", "6.6.6.6, junk")]);
        assert_eq!(
            client_ip(ip("10.0.0.1"), &h, &xff(), &trusted),
            ip("10.0.0.1")
        );
    }

    /// Behind nginx (which appends to X-Forwarded-For and passes `Forwarded` through as
    /// the client sent it), a client's own `Forwarded` is not read.
    #[test]
    fn only_the_configured_header_is_read() {
        let trusted = ["10.0.0.0/8".parse().unwrap()];
        let h = headers(&[
            ("forwarded", "for=10.42.0.9"),
            ("x-forwarded-for", "198.51.100.7"),
        ]);
        assert_eq!(
            client_ip(ip("10.0.0.1"), &h, &xff(), &trusted),
            ip("198.51.100.7")
        );
        let fwd = http::header::FORWARDED;
        assert_eq!(
            client_ip(ip("10.0.0.1"), &h, &fwd, &trusted),
            ip("10.42.0.9")
        );
        let real = HeaderName::from_static("x-real-ip");
        let h = headers(&[("x-real-ip", "198.51.100.8")]);
        assert_eq!(
            client_ip(ip("10.0.0.1"), &h, &real, &trusted),
            ip("198.51.100.8")
        );
    }

    #[test]
    fn ipv6_clients_are_keyed_by_their_network_and_mapped_ipv4_is_ipv4() {
        assert_eq!(
            client_key(ip("2001:db8:1:2:aaaa::1"), 64),
            "2001:db8:1:2::/64"
        );
        assert_eq!(
            client_key(ip("2001:db8:1:2:bbbb::9"), 64),
            "2001:db8:1:2::/64"
        );
        assert_eq!(client_key(ip("2001:db8:1:2::1"), 128), "2001:db8:1:2::1");
        assert_eq!(client_key(ip("2001:db8::1"), 0), "::/0");
        assert_eq!(client_key(ip("2001:db8:1:2::1"), 48), "2001:db8:1::/48");
        assert_eq!(client_key(ip("192.0.2.1"), 64), "192.0.2.1");
        let mapped = ip("::ffff:192.0.2.1");
        assert_eq!(
            client_ip(mapped, &HeaderMap::new(), &xff(), &[]),
            ip("192.0.2.1")
        );
    }

    proptest::proptest! {
        #[test]
        fn ip_text_writes_what_display_writes(a: u8, b: u8, c: u8, d: u8, v6: u128) {
            let v4 = IpAddr::from([a, b, c, d]);
            proptest::prop_assert_eq!(ip_text(v4), v4.to_string());
            let v6 = IpAddr::from(Ipv6Addr::from(v6));
            proptest::prop_assert_eq!(ip_text(v6), v6.to_string());
        }
    }
}
