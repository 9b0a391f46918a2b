//! The parsers the listeners run on untrusted bytes, callable on their own: the fuzz
//! targets (`fuzz/`, `tools/fuzz.sh`) and the amplification tests
//! (`tests/amplification.rs`) drive them. Each reads within
//! [`RequestLimits::default`] (the service's defaults) and does exactly what its
//! listener does before a decision, so what they find is what a client could reach.
//!
//! Not an API for embedding: the `tollgate` library is that.

use tollgate::limiter::{RateLimitRequest, RequestLimits};

use crate::api::{check, json};
use crate::grpc::{decode, rls};

/// The native gRPC transport's reading of a `ShouldRateLimit` message (a serialized
/// `RateLimitRequest`, without the gRPC frame): the request, or the words of the
/// INVALID_ARGUMENT answer.
pub fn grpc_request(message: &[u8]) -> Result<RateLimitRequest, String> {
    decode::request_within(message, &RequestLimits::default()).map_err(|e| e.to_string())
}

/// `POST /v1/check`'s reading of its body: the request, or the words of the 400 answer.
pub fn v1_check(body: &[u8]) -> Result<RateLimitRequest, String> {
    let limits = RequestLimits::default();
    let request = check::parse(body, &limits)?;
    request.validate(&limits).map_err(|e| e.to_string())?;
    Ok(request)
}

/// `POST /json`'s reading of its body (Envoy's `RateLimitRequest` in proto3 JSON): the
/// request, or the words of the 400 answer.
pub fn envoy_json(body: &[u8]) -> Result<RateLimitRequest, String> {
    let limits = RequestLimits::default();
    rls::from_wire(json::parse(body, &limits)?, &limits)
}

/// The longest body the check endpoints read under the default limits (a longer one
/// is refused with 413 before it is parsed).
pub fn body_limit() -> usize {
    crate::api::body_limit(&RequestLimits::default())
}
