//! gRPC front ends: Envoy's rate limit service API (`rls.rs`: wire types ↔ the
//! limiter) and gRPC's health service (`health.rs`), served by Tollgate's own HTTP/2
//! layer (`native.rs`, the default, which reads the request bytes with `decode.rs` and
//! writes the response bytes with `encode.rs`, no wire structs between) or by tonic,
//! which also serves TLS (`tls.rs`: the listener's certificate, and client
//! certificates for mutual TLS).

pub mod decode;
pub mod encode;
pub mod health;
pub mod limits;
pub mod metadata;
pub mod native;
pub mod rls;
pub mod tls;
