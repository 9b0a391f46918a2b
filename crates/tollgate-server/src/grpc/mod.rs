//! gRPC front ends: Envoy's rate limit service API (`rls.rs`: wire types ↔ the
//! limiter), served by Tollgate's own HTTP/2 layer (`native.rs`, the default) or by
//! tonic.

pub mod native;
pub mod rls;
