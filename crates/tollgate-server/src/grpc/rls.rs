//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`, a drop-in for
//! envoyproxy/ratelimit: wire types in, [`Service::decide`], wire types out.

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    rate_limit::Unit as WireUnit, Code as WireCode, DescriptorStatus as WireStatus,
    RateLimit as WireLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{
    RateLimitRequest as WireRequest, RateLimitResponse as WireResponse,
};
use envoy_types::pb::google::protobuf::Duration as WireDuration;
use tollgate::limiter::{
    self, Code, Descriptor, LimitOverride, RateLimitRequest, RateLimitResponse, RequestLimits,
};
use tollgate::rules::Unit;

use crate::service::{Service, NO_RULES};
use tollgate::headers::{headers, problem_body, HeaderSettings};

/// The tonic service.
pub struct Rls {
    service: Arc<Service>,
}

/// The server to mount on a tonic router.
pub fn server(service: Arc<Service>) -> RateLimitServiceServer<Rls> {
    RateLimitServiceServer::new(Rls { service })
}

#[tonic::async_trait]
impl RateLimitService for Rls {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<WireRequest>,
    ) -> Result<tonic::Response<WireResponse>, tonic::Status> {
        // tonic's server gives up on the call at the caller's timeout by itself; the
        // store is given less, so that the rule's failure mode answers first.
        let timeout = match request.metadata().get("grpc-timeout") {
            None => None,
            Some(value) => match tollgate_h2::grpc::parse_timeout(value.as_bytes()) {
                Ok(timeout) => Some(timeout),
                Err(why) => return Err(tonic::Status::invalid_argument(why)),
            },
        };
        match answer(&self.service, request.into_inner(), timeout).await {
            Ok(response) => Ok(tonic::Response::new(response)),
            Err(Failure::InvalidArgument(why)) => Err(tonic::Status::invalid_argument(why)),
            Err(Failure::Unavailable(why)) => Err(tonic::Status::unavailable(why)),
            Err(Failure::NoRules) => Err(tonic::Status::unknown(NO_RULES)),
        }
    }
}

/// Why a call gets no [`WireResponse`]: the gRPC status to answer with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// `INVALID_ARGUMENT`: the request is malformed (counted in metrics).
    InvalidArgument(String),
    /// `UNAVAILABLE`: the store failed and the rule's failure mode gave no answer.
    Unavailable(String),
    /// `UNKNOWN` with [`NO_RULES`]: no rules are loaded (invalid or missing at start,
    /// not fixed since), as envoyproxy/ratelimit answers; Envoy's filter then applies
    /// its `failure_mode_deny` choice.
    NoRules,
}

/// `ShouldRateLimit` through envoy-types' structs (tonic): wire request →
/// [`decide_request`] → wire response. `timeout`: the caller's `grpc-timeout`.
pub async fn answer(
    service: &Service,
    wire: WireRequest,
    timeout: Option<Duration>,
) -> Result<WireResponse, Failure> {
    let request = from_wire(wire, &service.limiter.settings().limits).map_err(|e| {
        service.metrics.invalid_request();
        Failure::InvalidArgument(e)
    })?;
    if !service.rules_loaded() {
        return Err(Failure::NoRules);
    }
    let response = decide_request(service, &request, timeout).await?;
    Ok(to_wire_for(&request, &response, service))
}

/// [`to_wire`], with the dynamic metadata when the service sends it (it needs the
/// request too).
pub fn to_wire_for(
    request: &RateLimitRequest,
    response: &RateLimitResponse,
    service: &Service,
) -> WireResponse {
    let mut wire = to_wire(response, service);
    if service.dynamic_metadata {
        wire.dynamic_metadata = Some(super::metadata::to_struct(
            &super::metadata::dynamic_metadata(request, response),
        ));
    }
    wire
}

/// The decision for a request already read off the wire (by [`from_wire`], or by
/// the native transport's `grpc::decode`), through [`Service::decide_within`]: a caller
/// that sent a `grpc-timeout` gets the store's answer, or else its rules' failure modes,
/// within [`store_budget`] of it.
pub async fn decide_request(
    service: &Service,
    request: &RateLimitRequest,
    timeout: Option<Duration>,
) -> Result<RateLimitResponse, Failure> {
    match service
        .decide_within(request, timeout.map(store_budget))
        .await
    {
        Ok(response) => Ok(response),
        Err(limiter::Error::InvalidRequest(why)) => Err(Failure::InvalidArgument(why)),
        Err(e) => Err(Failure::Unavailable(e.to_string())),
    }
}

/// How long the store may take for a caller with `timeout` (`grpc-timeout`): four
/// fifths of it, leaving the rest for the answer's way back and the caller's own clock
/// (16 ms of Envoy's default 20 ms). The store's own deadline (`--redis-deadline`)
/// still applies when it is shorter.
pub fn store_budget(timeout: Duration) -> Duration {
    timeout * 4 / 5
}

/// The wire request as a [`RateLimitRequest`]; `Err` names what is malformed. Sizes
/// over `limits` are looked for first, in the order the native decoder reads them
/// (see [`RequestLimits::check_sizes`]), before anything is converted: a call of
/// 100,000 descriptors is refused for its size at the cost of a count.
pub fn from_wire(wire: WireRequest, limits: &RequestLimits) -> Result<RateLimitRequest, String> {
    limits
        .check_sizes(
            wire.descriptors
                .iter()
                .map(|d| d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str()))),
        )
        .map_err(invalid)?;
    let descriptors = wire
        .descriptors
        .into_iter()
        .enumerate()
        .map(|(i, d)| {
            descriptor(
                i,
                d.entries.into_iter().map(|e| (e.key, e.value)).collect(),
                d.limit.map(|o| (o.requests_per_unit, o.unit)),
                d.hits_addend.map(|h| h.value),
                d.is_negative_hits,
            )
        })
        .collect::<Result<Vec<_>, String>>()?;
    validated(
        RateLimitRequest {
            domain: wire.domain,
            descriptors,
            hits_addend: u64::from(wire.hits_addend),
        },
        limits,
    )
}

/// `request` if it is valid (a domain, descriptors within `limits`, entries with
/// keys), else what is wrong with it.
pub(crate) fn validated(
    request: RateLimitRequest,
    limits: &RequestLimits,
) -> Result<RateLimitRequest, String> {
    request.validate(limits).map_err(invalid)?;
    Ok(request)
}

/// What a refusal of the limiter says.
fn invalid(e: limiter::Error) -> String {
    match e {
        limiter::Error::InvalidRequest(why) => why,
        other => other.to_string(),
    }
}

/// Descriptor `i` of a wire request, from its fields: the entries, the limit
/// override's (`requests_per_unit`, `unit`), `hits_addend` and `is_negative_hits`.
pub(crate) fn descriptor(
    i: usize,
    entries: Vec<(String, String)>,
    limit: Option<(u32, i32)>,
    hits_addend: Option<u64>,
    is_negative_hits: bool,
) -> Result<Descriptor, String> {
    if is_negative_hits {
        return Err(format!(
            "descriptor {i}: is_negative_hits (returning hits) is not supported"
        ));
    }
    let limit = match limit {
        None => None,
        Some((requests_per_unit, unit)) => Some(LimitOverride {
            requests_per_unit: u64::from(requests_per_unit),
            unit: unit_from_wire(unit)
                .ok_or_else(|| format!("descriptor {i}: the limit override has no valid unit"))?,
        }),
    };
    Ok(Descriptor {
        entries,
        limit,
        hits_addend,
    })
}

/// `envoy.type.v3.RateLimitUnit` (the override's unit) as a [`Unit`].
fn unit_from_wire(unit: i32) -> Option<Unit> {
    Some(match unit {
        1 => Unit::Second,
        2 => Unit::Minute,
        3 => Unit::Hour,
        4 => Unit::Day,
        5 => Unit::Month,
        6 => Unit::Year,
        7 => Unit::Week,
        _ => return None,
    })
}

pub(crate) fn unit_to_wire(unit: Unit) -> WireUnit {
    match unit {
        Unit::Second => WireUnit::Second,
        Unit::Minute => WireUnit::Minute,
        Unit::Hour => WireUnit::Hour,
        Unit::Day => WireUnit::Day,
        Unit::Week => WireUnit::Week,
        Unit::Month => WireUnit::Month,
        Unit::Year => WireUnit::Year,
    }
}

pub(crate) fn code_to_wire(code: Code) -> WireCode {
    match code {
        Code::Ok => WireCode::Ok,
        Code::OverLimit => WireCode::OverLimit,
    }
}

/// A decision as the wire response Envoy reads, with the service's header settings.
pub fn to_wire(response: &RateLimitResponse, service: &Service) -> WireResponse {
    to_wire_with(response, service.headers)
}

/// A decision as the wire response Envoy reads, with the headers `settings` ask for.
pub fn to_wire_with(response: &RateLimitResponse, settings: HeaderSettings) -> WireResponse {
    let statuses = response
        .statuses
        .iter()
        .map(|s| WireStatus {
            code: code_to_wire(s.code) as i32,
            current_limit: s.limit.as_ref().map(|l| WireLimit {
                name: l.name.clone().unwrap_or_default(),
                requests_per_unit: u32::try_from(l.requests_per_unit).unwrap_or(u32::MAX),
                unit: unit_to_wire(l.unit) as i32,
            }),
            limit_remaining: u32::try_from(s.remaining).unwrap_or(u32::MAX),
            // Whole seconds, rounded up, as Envoy's service sends them (`unit - now % unit`
            // on whole-second time); the headers keep the exact value.
            duration_until_reset: s.limit.as_ref().map(|_| WireDuration {
                seconds: i64::try_from(s.reset_after_secs()).unwrap_or(i64::MAX),
                nanos: 0,
            }),
            quota: None,
        })
        .collect();
    let response_headers_to_add = headers(response, settings)
        .into_iter()
        .map(|(key, value)| HeaderValue {
            key: key.to_string(),
            value,
            ..Default::default()
        })
        .collect();
    WireResponse {
        overall_code: code_to_wire(response.overall) as i32,
        statuses,
        response_headers_to_add,
        raw_body: if settings.problem_body && response.overall == Code::OverLimit {
            problem_body(response)
        } else {
            Vec::new()
        },
        ..Default::default()
    }
}
