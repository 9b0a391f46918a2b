//! A bare Envoy rate limit gRPC server that answers OK to everything without deciding
//! anything: the floor of tonic's cost per request on this machine, for comparison
//! with `tollgate serve` in the same session.
//!
//! Run it with `cargo run --release -p tollgate-load --example bare_rls -- 127.0.0.1:38091`
//! and load it with `tollgate-load grpc --addr 127.0.0.1:38091 --server-pid <pid>`.

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

struct AlwaysOk;

#[tonic::async_trait]
impl RateLimitService for AlwaysOk {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        let statuses = request
            .into_inner()
            .descriptors
            .iter()
            .map(|_| DescriptorStatus {
                code: Code::Ok as i32,
                ..Default::default()
            })
            .collect();
        Ok(tonic::Response::new(RateLimitResponse {
            overall_code: Code::Ok as i32,
            statuses,
            ..Default::default()
        }))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:38091".into())
        .parse()?;
    tonic::transport::Server::builder()
        .add_service(RateLimitServiceServer::new(AlwaysOk))
        .serve(addr)
        .await?;
    Ok(())
}
