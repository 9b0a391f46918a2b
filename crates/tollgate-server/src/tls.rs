//! TLS on the HTTP listeners: `tollgate serve`'s HTTP API (`--http-tls-cert`) and
//! `tollgate proxy`'s gateway (`--tls-cert`). The certificate chain and key, and for
//! mutual TLS the certificate authorities of the clients, are read once at start-up
//! into a rustls server configuration (the `ring` provider, TLS 1.2 and 1.3, ALPN `h2`
//! then `http/1.1`); [`crate::workers::serve_http`] does the handshakes. The gRPC
//! listener's TLS goes through tonic instead (`grpc/tls.rs`).

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio_rustls::TlsAcceptor;

/// A file given by a flag: the flag's name (for errors) and the path.
pub type FlagFile<'a> = (&'a str, &'a Path);

/// The acceptor for a listener with the certificate chain `cert`, its private key
/// `key` and, for mutual TLS, `client_ca`: the authorities whose client certificates
/// are accepted (every client must then present one). `Err` names the flag, the file
/// and what is wrong with it.
pub fn acceptor(
    cert: FlagFile<'_>,
    key: FlagFile<'_>,
    client_ca: Option<FlagFile<'_>>,
) -> Result<TlsAcceptor, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = certificates(cert)?;
    let private = PrivateKeyDer::from_pem_slice(&read(key)?).map_err(|e| match e {
        pem::Error::NoItemsFound => format!("{}: no private key in it", named(key)),
        e => format!("{}: {}", named(key), pem_words(&e)),
    })?;
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in certificates(ca)? {
                roots
                    .add(c)
                    .map_err(|e| format!("{}: not a usable CA certificate: {e}", named(ca)))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| format!("{}: {e}", named(ca)))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(chain, private)
        .map_err(|e| format!("{} with {}: {e}", named(cert), named(key)))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

fn named((flag, path): FlagFile<'_>) -> String {
    format!("{flag} {}", path.display())
}

/// The bytes of a file given by a flag; `Err` names both.
pub fn read(file: FlagFile<'_>) -> Result<Vec<u8>, String> {
    std::fs::read(file.1).map_err(|e| format!("{}: {e}", named(file)))
}

/// What is wrong with a PEM file, in words (the error's own text shows bytes as lists
/// of numbers).
fn pem_words(e: &pem::Error) -> String {
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).trim().to_string();
    match e {
        pem::Error::MissingSectionEnd { end_marker } => {
            let label = text(end_marker);
            format!("its BEGIN {label} section has no END {label} line")
        }
        pem::Error::IllegalSectionStart { line } => {
            format!("a malformed PEM line \"{}\"", text(line))
        }
        pem::Error::Base64Decode(e) => format!("a PEM section is not valid base64 ({e})"),
        pem::Error::NoItemsFound => "nothing of the expected kind in it".to_string(),
        e => e.to_string(),
    }
}

/// Every certificate of a PEM file; `Err` when it holds none.
fn certificates(file: FlagFile<'_>) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = read(file)?;
    let chain = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {}", named(file), pem_words(&e)))?;
    if chain.is_empty() {
        return Err(format!("{}: no certificate in it", named(file)));
    }
    Ok(chain)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn temp(name: &str, body: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tollgate-http-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, body).unwrap();
        path
    }

    #[test]
    fn a_missing_file_or_one_without_certificates_is_named() {
        let key = temp("key.pem", "not a key");
        let missing = Path::new("/nonexistent/cert.pem");
        let e = acceptor(("--tls-cert", missing), ("--tls-key", &key), None)
            .err()
            .unwrap();
        assert!(e.starts_with("--tls-cert /nonexistent/cert.pem: "), "{e}");
        let text = temp("cert.txt", "hello");
        let e = acceptor(("--tls-cert", &text), ("--tls-key", &key), None)
            .err()
            .unwrap();
        assert!(
            e.contains("--tls-cert") && e.contains("no certificate"),
            "{e}"
        );
    }

    #[test]
    fn a_damaged_pem_file_is_described_in_words() {
        let key = temp("key2.pem", "not a key");
        let cut = temp("cut.pem", "-----BEGIN CERTIFICATE-----\nMIIB\n");
        let e = acceptor(("--tls-cert", &cut), ("--tls-key", &key), None)
            .err()
            .unwrap();
        assert_eq!(
            e,
            format!(
                "--tls-cert {}: its BEGIN CERTIFICATE section has no END CERTIFICATE line",
                cut.display()
            )
        );
    }
}
