//! The headers of a forwarded exchange (RFC 9110 §7.6.1; see `forward.rs`): the
//! hop-by-hop headers removed both ways, the client's `Host` kept, and
//! `X-Forwarded-For`, `X-Forwarded-Proto` and `X-Forwarded-Host` added upstream.

use std::net::SocketAddr;

use axum::extract::ConnectInfo;
use bytes::{BufMut, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;

/// Rewrites a client request's headers into those sent upstream: hop-by-hop headers
/// removed, `Host` as the client sent it (an HTTP/2 client's `:authority`), the
/// client's address appended to `X-Forwarded-For`, and `X-Forwarded-Proto: scheme`
/// and `X-Forwarded-Host` added unless the client sent them.
pub(super) fn to_upstream(parts: &mut Parts, scheme: &'static str) {
    // The Host as the client sent it; HTTP/2 clients send `:authority`.
    let original_host = parts.headers.get(header::HOST).cloned().or_else(|| {
        parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    });

    strip_hop_by_hop(&mut parts.headers);

    if let Some(host) = &original_host {
        if !parts.headers.contains_key(header::HOST) {
            parts.headers.insert(header::HOST, host.clone());
        }
    }

    if let Some(ConnectInfo(addr)) = parts.extensions.get::<ConnectInfo<SocketAddr>>() {
        append_forwarded_for(&mut parts.headers, *addr);
    }
    if !parts.headers.contains_key(X_FORWARDED_PROTO) {
        parts
            .headers
            .insert(X_FORWARDED_PROTO, HeaderValue::from_static(scheme));
    }
    if let Some(host) = original_host {
        if !parts.headers.contains_key(X_FORWARDED_HOST) {
            parts.headers.insert(X_FORWARDED_HOST, host);
        }
    }
}

/// Rewrites an upstream response's headers into those sent to the client: hop-by-hop
/// headers removed.
pub(super) fn from_upstream(headers: &mut HeaderMap) {
    strip_hop_by_hop(headers);
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Hop-by-hop headers that are never forwarded (RFC 9110 §7.6.1), in
/// addition to the ones named in `Connection`.
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
];

/// Removes the hop-by-hop headers and every header named by `Connection`.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
        .collect();
    // One pass over the few names a message has, rather than a hashed lookup for each
    // of the nine (this runs twice per forwarded request).
    let listed: Vec<HeaderName> = headers
        .keys()
        .filter(|name| HOP_BY_HOP.contains(name))
        .cloned()
        .collect();
    for name in named.into_iter().chain(listed) {
        headers.remove(name);
    }
}

/// Appends `addr`'s IP to `X-Forwarded-For`, joining all existing values
/// into one with `", "`.
fn append_forwarded_for(headers: &mut HeaderMap, addr: SocketAddr) {
    let ip = addr.ip().to_canonical().to_string();
    let mut value = BytesMut::new();
    for existing in headers.get_all(&X_FORWARDED_FOR) {
        let existing = trim_ascii(existing.as_bytes());
        if existing.is_empty() {
            continue;
        }
        if !value.is_empty() {
            value.put_slice(b", ");
        }
        value.put_slice(existing);
    }
    if !value.is_empty() {
        value.put_slice(b", ");
    }
    value.put_slice(ip.as_bytes());
    match HeaderValue::from_maybe_shared(value.freeze()) {
        Ok(joined) => {
            headers.insert(X_FORWARDED_FOR, joined);
        }
        Err(_) => {
            // Cannot happen for values that came from a valid header map,
            // but never drop the client's address.
            if let Ok(ip) = HeaderValue::from_str(&ip) {
                headers.append(X_FORWARDED_FOR, ip);
            }
        }
    }
}

fn trim_ascii(mut bytes: &[u8]) -> &[u8] {
    while let [first, rest @ ..] = bytes {
        if first.is_ascii_whitespace() {
            bytes = rest;
        } else {
            break;
        }
    }
    while let [rest @ .., last] = bytes {
        if last.is_ascii_whitespace() {
            bytes = rest;
        } else {
            break;
        }
    }
    bytes
}
