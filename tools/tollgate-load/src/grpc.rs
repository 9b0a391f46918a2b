//! `grpc` mode: Envoy's rate limit service, `ShouldRateLimit`, over several HTTP/2
//! connections used round-robin.

use std::future::Future;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
    rate_limit_descriptor::Entry, RateLimitDescriptor,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{
    rate_limit_response::Code, rate_limit_service_client::RateLimitServiceClient, RateLimitRequest,
};
use tonic::transport::{Channel, Endpoint};

use crate::cli::KeyArgs;
use crate::engine::{Outcome, Target};
use crate::error_chain;

/// A pool of gRPC clients of one rate limit service.
pub struct GrpcTarget {
    clients: Vec<RateLimitServiceClient<Channel>>,
    keys: KeyArgs,
}

impl GrpcTarget {
    /// Opens `connections` HTTP/2 connections to `addr` (`host:port`, or a URL).
    pub async fn connect(
        addr: &str,
        connections: u32,
        keys: KeyArgs,
        connect_timeout: Duration,
    ) -> Result<Self, String> {
        let uri = if addr.contains("://") {
            addr.to_owned()
        } else {
            format!("http://{addr}")
        };
        let endpoint = Endpoint::from_shared(uri.clone())
            .map_err(|e| format!("invalid gRPC address `{addr}`: {}", error_chain(&e)))?
            .connect_timeout(connect_timeout)
            .tcp_nodelay(true);
        let mut clients = Vec::with_capacity(connections as usize);
        for _ in 0..connections {
            // Each `connect` opens its own TCP connection (HTTP/2 multiplexes on it).
            let channel = endpoint
                .connect()
                .await
                .map_err(|e| format!("cannot connect to {uri}: {}", error_chain(&e)))?;
            clients.push(RateLimitServiceClient::new(channel));
        }
        Ok(Self { clients, keys })
    }
}

/// Request number `seq`: `keys.domain`, one descriptor `keys.key` = `u<seq mod keys>`.
pub fn request(keys: &KeyArgs, seq: u64) -> RateLimitRequest {
    RateLimitRequest {
        domain: keys.domain.clone(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: keys.key.clone(),
                value: format!("u{}", seq % keys.keys),
            }],
            ..Default::default()
        }],
        hits_addend: 1,
    }
}

impl Target for GrpcTarget {
    fn call(&self, seq: u64) -> impl Future<Output = Outcome> + Send {
        let idx = (seq % self.clients.len() as u64) as usize;
        // Cloning a client clones a handle to its channel (cheap).
        let client = self.clients.get(idx).cloned();
        let req = request(&self.keys, seq);
        async move {
            let Some(mut client) = client else {
                return Outcome::Error("no gRPC connection".to_owned());
            };
            match client.should_rate_limit(req).await {
                Ok(resp) => match Code::try_from(resp.get_ref().overall_code) {
                    Ok(Code::Ok) => Outcome::Ok,
                    Ok(Code::OverLimit) => Outcome::OverLimit,
                    _ => Outcome::Other,
                },
                Err(status) => Outcome::Error(format!(
                    "gRPC status {:?}: {}",
                    status.code(),
                    status.message()
                )),
            }
        }
    }
}
