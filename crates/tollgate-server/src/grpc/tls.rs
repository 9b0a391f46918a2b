//! TLS on the gRPC listener: the certificate chain and key, and for mutual TLS the
//! certificate authorities of the clients, read once at start-up into tonic's
//! [`ServerTlsConfig`] (rustls with the `ring` provider, ALPN `h2`). The native
//! transport serves cleartext HTTP/2 only, so a TLS listener is served by tonic.

use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};

use crate::cli::GrpcTlsArgs;
use crate::tls;

/// The gRPC listener's TLS settings (`None` without `--grpc-tls-cert`), so that a bad
/// file stops the start: first the checks the HTTP listeners' files get
/// ([`crate::tls::acceptor`]: a certificate in the file, a private key that matches it,
/// usable CA certificates), then tonic's own, by building its acceptor once. `Err`
/// names the flag, the file and what is wrong with it.
pub fn server_config(args: &GrpcTlsArgs) -> Result<Option<ServerTlsConfig>, String> {
    let (Some(cert), Some(key)) = (&args.grpc_tls_cert, &args.grpc_tls_key) else {
        return Ok(None);
    };
    let cert = ("--grpc-tls-cert", cert.as_path());
    let key = ("--grpc-tls-key", key.as_path());
    let ca = args
        .grpc_tls_client_ca
        .as_deref()
        .map(|ca| ("--grpc-tls-client-ca", ca));
    tls::acceptor(cert, key, ca)?;
    let identity = Identity::from_pem(tls::read(cert)?, tls::read(key)?);
    // As on the HTTP listeners: a client that does not finish its handshake is closed.
    let mut config = ServerTlsConfig::new()
        .identity(identity)
        .timeout(crate::workers::TLS_HANDSHAKE_TIMEOUT);
    if let Some(ca) = ca {
        config = config.client_ca_root(Certificate::from_pem(tls::read(ca)?));
    }
    Server::builder()
        .tls_config(config.clone())
        .map_err(|e| format!("the gRPC listener's TLS: {}", crate::error_chain(&e)))?;
    Ok(Some(config))
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;

    fn args(cert: Option<&Path>, key: Option<&Path>, ca: Option<&Path>) -> GrpcTlsArgs {
        GrpcTlsArgs {
            grpc_tls_cert: cert.map(Path::to_path_buf),
            grpc_tls_key: key.map(Path::to_path_buf),
            grpc_tls_client_ca: ca.map(Path::to_path_buf),
        }
    }

    fn temp(name: &str, body: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tollgate-grpc-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, body).unwrap();
        path
    }

    #[test]
    fn no_certificate_no_tls() {
        assert!(server_config(&args(None, None, None)).unwrap().is_none());
    }

    #[test]
    fn a_missing_or_empty_file_is_named() {
        let missing = Path::new("/nonexistent/cert.pem");
        let key = temp("key.pem", "not a key");
        let e = server_config(&args(Some(missing), Some(&key), None)).unwrap_err();
        assert!(
            e.starts_with("--grpc-tls-cert /nonexistent/cert.pem: "),
            "{e}"
        );
        let empty = temp("empty.pem", "\n");
        let e = server_config(&args(Some(&empty), Some(&key), None)).unwrap_err();
        assert!(
            e.contains("--grpc-tls-cert") && e.contains("no certificate"),
            "{e}"
        );
    }

    #[test]
    fn a_file_that_is_not_pem_is_refused_and_named() {
        let cert = temp("cert.txt", "hello");
        let key = temp("key.txt", "world");
        let e = server_config(&args(Some(&cert), Some(&key), None)).unwrap_err();
        assert!(
            e.contains("cert.txt") && e.contains("no certificate"),
            "{e}"
        );
    }
}
