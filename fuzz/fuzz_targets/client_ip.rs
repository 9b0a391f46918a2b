//! The client address from `X-Forwarded-For` or `Forwarded` through trusted proxies: any
//! header values give an address, never a panic; and any address a key.
#![no_main]

use std::net::{IpAddr, Ipv4Addr};

use http::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Lines alternate between the two headers; the first byte picks the trusted set.
    let mut headers = HeaderMap::new();
    let names = [
        HeaderName::from_static("x-forwarded-for"),
        HeaderName::from_static("forwarded"),
    ];
    let (choice, rest) = data.split_first().unwrap_or((&0, &[]));
    for (i, line) in rest.split(|&b| b == b'\n').enumerate() {
        if let Ok(v) = HeaderValue::from_bytes(line) {
            headers.append(names[i % 2].clone(), v);
        }
    }
    let trusted: Vec<ipnet::IpNet> = match choice % 3 {
        0 => vec![],
        1 => vec![
            "10.0.0.0/8".parse().expect("a net"),
            "::1/128".parse().expect("a net"),
        ],
        _ => vec![
            "0.0.0.0/0".parse().expect("a net"),
            "::/0".parse().expect("a net"),
        ],
    };
    let peer = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
    for name in &names {
        let ip = tollgate::http::client_ip::client_ip(peer, &headers, name, &trusted);
        let _ = tollgate::http::client_ip::client_key(ip, choice % 130);
    }
});
