//! The service client over Envoy's gRPC API, `ShouldRateLimit` (the `grpc` feature).

use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
    rate_limit_descriptor::Entry, RateLimitDescriptor,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{
    rate_limit_response::{self, Code},
    rate_limit_service_client::RateLimitServiceClient,
    RateLimitRequest, RateLimitResponse,
};
use tonic::transport::{Channel, Endpoint};

use super::{Decision, Descriptor, DescriptorStatus, Error};

/// A lazily connected channel to the gRPC listener at `addr` (`host:port` or
/// `http://host:port`).
pub(super) fn channel(addr: &str) -> Result<RateLimitServiceClient<Channel>, Error> {
    let uri = if addr.contains("://") {
        addr.to_owned()
    } else {
        format!("http://{addr}")
    };
    let endpoint = Endpoint::from_shared(uri).map_err(|e| Error::InvalidGrpcAddress {
        addr: addr.to_owned(),
        source: e,
    })?;
    Ok(RateLimitServiceClient::new(
        endpoint.tcp_nodelay(true).connect_lazy(),
    ))
}

/// One `ShouldRateLimit` call, without deadline or policy.
pub(super) async fn ask(
    mut client: RateLimitServiceClient<Channel>,
    domain: &str,
    descriptors: &[Descriptor],
    hits: u64,
) -> Result<Decision, Error> {
    // The API reads 0 as 1, and counts in 32 bits: refuse rather than charge other
    // than asked.
    let hits_addend = match u32::try_from(hits) {
        Ok(0) | Err(_) => return Err(Error::Hits(hits)),
        Ok(h) => h,
    };
    let request = RateLimitRequest {
        domain: domain.to_owned(),
        descriptors: descriptors
            .iter()
            .map(|d| RateLimitDescriptor {
                entries: d
                    .entries
                    .iter()
                    .map(|(key, value)| Entry {
                        key: key.clone(),
                        value: value.clone(),
                    })
                    .collect(),
                ..Default::default()
            })
            .collect(),
        hits_addend,
    };
    let response = client
        .should_rate_limit(request)
        .await
        .map_err(Error::Grpc)?;
    Ok(decision(response.get_ref()))
}

/// The decision in a `RateLimitResponse`. The API has no retry-after per descriptor: an
/// over-limit descriptor's is the time until its window resets.
fn decision(response: &RateLimitResponse) -> Decision {
    let statuses = response
        .statuses
        .iter()
        .map(|s| {
            let ok = s.code != Code::OverLimit as i32;
            let reset = s
                .duration_until_reset
                .as_ref()
                .map(|d| Duration::from_secs(u64::try_from(d.seconds).unwrap_or(0)))
                .unwrap_or_default();
            let limit = s.current_limit.as_ref();
            DescriptorStatus {
                ok,
                matched: limit.is_some(),
                name: limit.map(|l| l.name.clone()).filter(|n| !n.is_empty()),
                limit: limit.map(|l| u64::from(l.requests_per_unit)),
                unit: limit.map(|l| {
                    rate_limit_response::rate_limit::Unit::try_from(l.unit)
                        .map_or_else(|_| l.unit.to_string(), |u| u.as_str_name().to_owned())
                }),
                remaining: u64::from(s.limit_remaining),
                reset,
                retry_after: (!ok && reset > Duration::ZERO).then_some(reset),
                shadow: false,
            }
        })
        .collect();
    Decision::from_statuses(response.overall_code != Code::OverLimit as i32, statuses)
}
