//! The client's IP address: the socket peer, or what `X-Forwarded-For` / `Forwarded`
//! say, but only through proxies the configuration trusts.
//!
//! Walking the chain from the right (the hop nearest to us): the peer is the first
//! candidate; while the candidate is a trusted proxy, the next address to the left is
//! believed. The first untrusted address is the client. A client can write anything into
//! these headers, but what it writes sits left of the first untrusted hop, so it is
//! never reached. With no trusted proxies, the headers are ignored.

use std::net::{IpAddr, SocketAddr};

use http::HeaderMap;
use ipnet::IpNet;

/// The client address for a request from `peer` with `headers`, trusting `trusted`.
pub fn client_ip(peer: IpAddr, headers: &HeaderMap, trusted: &[IpNet]) -> IpAddr {
    let is_trusted = |ip: &IpAddr| trusted.iter().any(|net| net.contains(ip));
    if !is_trusted(&peer) {
        return peer;
    }
    let mut hops = forwarded_chain(headers);
    let mut client = peer;
    while let Some(hop) = hops.pop() {
        match hop {
            Some(ip) => {
                client = ip;
                if !is_trusted(&ip) {
                    return ip;
                }
            }
            // An unreadable hop ends what can be believed: the last trusted address
            // stands.
            None => return client,
        }
    }
    client
}

/// Every hop the headers name, leftmost first (`None` for one that is not an IP):
/// `Forwarded` (RFC 7239) when present, else `X-Forwarded-For`. Several header lines
/// are read in order.
fn forwarded_chain(headers: &HeaderMap) -> Vec<Option<IpAddr>> {
    let forwarded: Vec<&str> = headers
        .get_all(http::header::FORWARDED)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    if !forwarded.is_empty() {
        return forwarded
            .iter()
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
    headers
        .get_all("x-forwarded-for")
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("").split(','))
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

    #[test]
    fn an_untrusted_peer_cannot_choose_its_address() {
        let trusted = ["10.0.0.0/8".parse().unwrap()];
        let h = headers(&[("x-forwarded-for", "1.1.1.1")]);
        assert_eq!(
            client_ip(ip("203.0.113.9"), &h, &trusted),
            ip("203.0.113.9")
        );
        assert_eq!(client_ip(ip("203.0.113.9"), &h, &[]), ip("203.0.113.9"));
    }

    #[test]
    fn through_trusted_proxies_the_rightmost_untrusted_hop_is_the_client() {
        let trusted = ["10.0.0.0/8".parse().unwrap()];
        // The client spoofed 6.6.6.6; 198.51.100.7 is who reached our first proxy.
        let h = headers(&[("x-forwarded-for", "6.6.6.6, 198.51.100.7, 10.0.0.2")]);
        assert_eq!(client_ip(ip("10.0.0.1"), &h, &trusted), ip("198.51.100.7"));
        let h = headers(&[(
            "forwarded",
            "for=6.6.6.6, for=\"[2001:db8::7]:443\";proto=https",
        )]);
        assert_eq!(client_ip(ip("10.0.0.1"), &h, &trusted), ip("2001:db8::7"));
        // Only trusted hops: the leftmost is the best we know.
        let h = headers(&[("x-forwarded-for", "10.9.9.9")]);
        assert_eq!(client_ip(ip("10.0.0.1"), &h, &trusted), ip("10.9.9.9"));
        // Garbage stops the walk at the last trusted address.
        let h = headers(&[("x-forwarded-for", "6.6.6.6, junk")]);
        assert_eq!(client_ip(ip("10.0.0.1"), &h, &trusted), ip("10.0.0.1"));
    }
}
