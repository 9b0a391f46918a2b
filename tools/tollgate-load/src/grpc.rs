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
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use crate::cli::KeyArgs;
use crate::engine::{Outcome, Target};
use crate::error_chain;

/// TLS to the rate limit service: the authorities to trust and the name the server's
/// certificate must carry.
pub struct Tls {
    /// PEM certificates of the authorities to trust.
    pub ca_pem: Vec<u8>,
    /// The server's name in its certificate (and SNI).
    pub server_name: String,
}

/// A pool of gRPC clients of one rate limit service.
pub struct GrpcTarget {
    clients: Vec<RateLimitServiceClient<Channel>>,
    keys: KeyArgs,
}

impl GrpcTarget {
    /// Opens `connections` HTTP/2 connections to `addr` (`host:port`, or a URL), over
    /// TLS with `tls`.
    pub async fn connect(
        addr: &str,
        connections: u32,
        tls: Option<Tls>,
        keys: KeyArgs,
        connect_timeout: Duration,
    ) -> Result<Self, String> {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let uri = if addr.contains("://") {
            addr.to_owned()
        } else {
            format!("{scheme}://{addr}")
        };
        let mut endpoint = Endpoint::from_shared(uri.clone())
            .map_err(|e| format!("invalid gRPC address `{addr}`: {}", error_chain(&e)))?
            .connect_timeout(connect_timeout)
            .tcp_nodelay(true);
        if let Some(tls) = tls {
            let config = ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(tls.ca_pem))
                .domain_name(tls.server_name);
            endpoint = endpoint
                .tls_config(config)
                .map_err(|e| format!("TLS to {uri}: {}", error_chain(&e)))?;
        }
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

#[cfg(test)]
mod tests {
    use std::process::Command;

    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
        RateLimitService, RateLimitServiceServer,
    };
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
    use tonic::transport::{Identity, Server, ServerTlsConfig};

    use super::*;

    /// A rate limit service that admits everything.
    struct AdmitAll;

    #[tonic::async_trait]
    impl RateLimitService for AdmitAll {
        async fn should_rate_limit(
            &self,
            _: tonic::Request<RateLimitRequest>,
        ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
            Ok(tonic::Response::new(RateLimitResponse {
                overall_code: Code::Ok as i32,
                ..Default::default()
            }))
        }
    }

    /// A self-signed certificate for `localhost` (`openssl`), as (cert PEM, key PEM).
    fn certificate() -> (Vec<u8>, Vec<u8>) {
        let dir = std::env::temp_dir().join(format!("tollgate-load-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = Command::new("openssl")
            .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
            .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"])
            .args([
                "-keyout",
                "key.pem",
                "-out",
                "cert.pem",
                "-subj",
                "/CN=localhost",
            ])
            .args(["-addext", "subjectAltName=DNS:localhost"])
            .args(["-addext", "basicConstraints=critical,CA:FALSE"])
            .current_dir(&dir)
            .output()
            .expect("openssl is needed for this test");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let read = |f: &str| std::fs::read(dir.join(f)).unwrap();
        (read("cert.pem"), read("key.pem"))
    }

    fn keys() -> KeyArgs {
        KeyArgs {
            keys: 10,
            domain: "bench".into(),
            key: "user".into(),
        }
    }

    /// With `Tls`, the tonic client reaches a TLS-only server and gets its answers;
    /// without, or trusting nothing that signed the server's certificate, it does not.
    #[tokio::test]
    async fn the_tonic_client_speaks_tls_when_told_to() {
        let (cert, key) = certificate();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let tls = ServerTlsConfig::new().identity(Identity::from_pem(&cert, &key));
        let server = Server::builder()
            .tls_config(tls)
            .unwrap()
            .add_service(RateLimitServiceServer::new(AdmitAll))
            .serve_with_incoming(tokio_stream_of(listener));
        tokio::spawn(server);

        let timeout = Duration::from_secs(5);
        let trusted = Tls {
            ca_pem: cert.clone(),
            server_name: "localhost".into(),
        };
        let target = GrpcTarget::connect(&addr, 1, Some(trusted), keys(), timeout)
            .await
            .unwrap();
        for seq in 0..3 {
            assert_eq!(target.call(seq).await, Outcome::Ok);
        }

        // Cleartext to a TLS listener: no answer.
        let outcome = match GrpcTarget::connect(&addr, 1, None, keys(), timeout).await {
            Ok(target) => target.call(0).await,
            Err(e) => Outcome::Error(e),
        };
        assert!(matches!(outcome, Outcome::Error(_)), "{outcome:?}");
        // A name the certificate does not carry: refused.
        let wrong = Tls {
            ca_pem: cert,
            server_name: "elsewhere".into(),
        };
        let e = GrpcTarget::connect(&addr, 1, Some(wrong), keys(), timeout)
            .await
            .err()
            .expect("a certificate for another name was accepted");
        assert!(e.contains("certificate"), "{e}");
    }

    /// The accepted connections of `listener`, as tonic's `serve_with_incoming` takes them.
    fn tokio_stream_of(
        listener: tokio::net::TcpListener,
    ) -> impl futures_util::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
        futures_util::stream::unfold(listener, |listener| async move {
            let accepted = listener.accept().await.map(|(stream, _)| stream);
            Some((accepted, listener))
        })
    }
}
