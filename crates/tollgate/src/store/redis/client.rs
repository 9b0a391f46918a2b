//! The redis-rs clients behind [`RedisStore`](super::RedisStore) and the in-flight
//! permits: one lazily connecting, reconnecting connection to a single Redis, or a
//! cluster client's settings; plain or over TLS (`rediss://`, `rediss+cluster://`).
//! [`RedisTls`] says which certificate authorities to trust and, for Redis with
//! `tls-auth-clients yes`, the client's certificate. The TLS itself is redis-rs's, over
//! rustls with the `ring` provider (feature `redis-tls`).

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::IntoConnectionInfo;

use crate::store::Error;

/// What a TLS connection to Redis presents and trusts, as PEM bytes. The default
/// trusts the system's roots and presents no client certificate.
#[derive(Clone, Default)]
pub struct RedisTls {
    /// Certificate authorities to trust instead of the system's (PEM).
    pub ca_pem: Option<Vec<u8>>,
    /// The client's certificate chain and private key (PEM), for mutual TLS.
    pub client_pem: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for RedisTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTls")
            .field("ca_pem", &self.ca_pem.as_ref().map(|_| "<set>"))
            .field(
                "client_pem",
                &self.client_pem.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

/// Whether `url` names a single Redis (not a cluster): `redis://`, `rediss://`, or its
/// Unix socket, `redis+unix:///path` (`unix:///path`).
pub fn is_single_url(url: &str) -> bool {
    ["redis://", "rediss://", "redis+unix://", "unix://"]
        .iter()
        .any(|scheme| url.starts_with(scheme))
}

/// Whether `url` asks for TLS.
pub(crate) fn is_tls_url(url: &str) -> bool {
    url.starts_with("rediss://") || url.starts_with("rediss+cluster://")
}

/// Refuses settings that cannot mean what they say: certificates for a plain
/// `redis://` URL (the connection would not use them), or TLS in a build without it.
pub(crate) fn check(url: &str, tls: Option<&RedisTls>) -> Result<(), Error> {
    let wants_tls = is_tls_url(url);
    if tls.is_some() && !wants_tls {
        return Err(Error::backend(format!(
            "TLS certificates are set but `{url}` is not a TLS URL: use rediss:// (or rediss+cluster://)"
        )));
    }
    if wants_tls && !cfg!(feature = "redis-tls") {
        return Err(Error::backend(format!(
            "`{url}` needs TLS, and this build has none (the tollgate crate's `redis-tls` feature)"
        )));
    }
    Ok(())
}

/// Where a single Redis's URL connects, as errors name it: `host:port`, or the path of
/// its Unix socket (never the URL's password). The URL itself when redis-rs cannot read
/// it (connecting then fails anyway, saying why).
pub(crate) fn address(url: &str) -> String {
    match url.into_connection_info() {
        Ok(info) => info.addr().to_string(),
        Err(_) => url.to_string(),
    }
}

/// A Redis error as a store error that keeps it as its source. A refused connection
/// says so, naming `address` (where the store connects); any other error says what
/// Redis said.
pub(crate) fn failure(e: redis::RedisError, address: &str) -> Error {
    let message = if e.is_connection_refusal() {
        format!("Redis at {address} refused the connection ({e})")
    } else {
        e.to_string()
    };
    Error::backend_caused_by(message, e)
}

/// A connection to the single Redis at `url`, made on first use and remade when it
/// breaks (connecting gives up after 250 ms; retries wait 10 to 250 ms).
pub(crate) fn single(url: &str, tls: Option<&RedisTls>) -> Result<ConnectionManager, Error> {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_millis(250)))
        .set_min_delay(Duration::from_millis(10))
        .set_max_delay(Duration::from_millis(250))
        .set_number_of_retries(3);
    ConnectionManager::new_lazy_with_config(client(url, tls)?, config)
        .map_err(|e| failure(e, &address(url)))
}

/// The redis-rs client for a single Redis at `url`.
fn client(url: &str, tls: Option<&RedisTls>) -> Result<redis::Client, Error> {
    check(url, tls)?;
    match tls {
        #[cfg(feature = "redis-tls")]
        Some(tls) => {
            install_provider();
            redis::Client::build_with_tls(url, certificates(tls))
                .map_err(|e| failure(e, &address(url)))
        }
        _ => {
            #[cfg(feature = "redis-tls")]
            if is_tls_url(url) {
                install_provider();
            }
            redis::Client::open(url).map_err(|e| failure(e, &address(url)))
        }
    }
}

/// Applies `tls` to a cluster client's settings (its nodes are already `rediss://`).
pub(crate) fn cluster(
    builder: ClusterClientBuilder,
    url: &str,
    tls: Option<&RedisTls>,
) -> Result<ClusterClientBuilder, Error> {
    check(url, tls)?;
    #[cfg(feature = "redis-tls")]
    if is_tls_url(url) {
        install_provider();
        if let Some(tls) = tls {
            return Ok(builder.certs(certificates(tls)));
        }
    }
    Ok(builder)
}

#[cfg(feature = "redis-tls")]
fn certificates(tls: &RedisTls) -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: tls
            .client_pem
            .as_ref()
            .map(|(cert, key)| redis::ClientTlsConfig {
                client_cert: cert.clone(),
                client_key: key.clone(),
            }),
        root_cert: tls.ca_pem.clone(),
    }
}

/// rustls needs a process-wide crypto provider; the first caller installs `ring`'s
/// (an application that installed its own keeps it).
#[cfg(feature = "redis-tls")]
fn install_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// A connection to a single Redis or to a cluster, as one redis-rs connection.
#[derive(Clone)]
pub(super) enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Connection {
    fn inner(&mut self) -> &mut dyn ConnectionLike {
        match self {
            Connection::Single(c) => c,
            Connection::Cluster(c) => c,
        }
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        self.inner().req_packed_command(cmd)
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        self.inner().req_packed_commands(cmd, offset, count)
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(c) => c.get_db(),
            Connection::Cluster(c) => c.get_db(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificates_for_a_plain_url_are_refused_with_the_fix() {
        let e = check("redis://h:6379", Some(&RedisTls::default()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("rediss://"), "{e}");
        assert!(check("redis://h:6379", None).is_ok());
        assert_eq!(
            check("rediss://h:6380", Some(&RedisTls::default())).is_ok(),
            cfg!(feature = "redis-tls")
        );
    }

    #[test]
    fn the_private_key_never_shows_in_debug_output() {
        let tls = RedisTls {
            ca_pem: Some(b"CA".to_vec()),
            client_pem: Some((b"CERT".to_vec(), b"SECRET KEY".to_vec())),
        };
        let shown = format!("{tls:?}");
        assert!(!shown.contains("SECRET"), "{shown}");
        assert!(shown.contains("redacted"), "{shown}");
    }
}
