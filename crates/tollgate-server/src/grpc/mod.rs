//! gRPC front ends: Envoy's rate limit service API (`rls.rs`).

pub mod rls;
