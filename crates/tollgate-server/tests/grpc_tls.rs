//! `tollgate serve` with TLS on its gRPC listener (`--grpc-tls-cert`, `--grpc-tls-key`,
//! and `--grpc-tls-client-ca` for mutual TLS), called by tonic's client over TLS as an
//! Envoy with a TLS transport socket on its rate limit cluster would call it; and the
//! flags that must stop the start. Certificates come from `openssl`
//! (`redis_server::TlsFiles`: a CA, a server certificate for localhost and 127.0.0.1,
//! a client certificate, and another CA).

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

#[path = "../../tollgate/tests/support/redis_server.rs"]
mod redis_server;
mod support;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use redis_server::TlsFiles;
use support::{rls_request, serve_refused, tempdir, Server};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

fn write_rules(dir: &std::path::Path) {
    std::fs::write(
        dir.join("tls.yaml"),
        "domain: tls\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 2}\n",
    )
    .unwrap();
}

/// `tollgate serve` on `rules` with the server certificate of `files` on its gRPC
/// listener, and with `client_ca`, `files`' CA as the client certificates' CA.
async fn start_tls(rules: &std::path::Path, files: &TlsFiles, client_ca: bool) -> Server {
    let path = |file: &str| files.path(file).to_string_lossy().into_owned();
    let mut args = vec![
        "--grpc-tls-cert".to_owned(),
        path("server.pem"),
        "--grpc-tls-key".to_owned(),
        path("server.key"),
    ];
    if client_ca {
        args.extend(["--grpc-tls-client-ca".to_owned(), path("ca.pem")]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Server::start(rules, &args).await
}

/// A client of `server`'s gRPC listener over TLS, trusting `ca` (a file of `files`),
/// expecting the name `localhost`, presenting the client certificate when `identity`.
async fn tls_client(
    server: &Server,
    files: &TlsFiles,
    ca: &str,
    identity: bool,
) -> Result<RateLimitServiceClient<Channel>, String> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(files.read(ca)))
        .domain_name("localhost");
    if identity {
        tls = tls.identity(Identity::from_pem(
            files.read("client.pem"),
            files.read("client.key"),
        ));
    }
    let channel = Channel::from_shared(format!("https://{}", server.grpc))
        .unwrap()
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))?;
    Ok(RateLimitServiceClient::new(channel))
}

/// The first call's overall code for a TLS client made as [`tls_client`] makes it, or
/// why the connection or the call failed.
async fn first_answer(
    server: &Server,
    files: &TlsFiles,
    ca: &str,
    identity: bool,
) -> Result<Vec<i32>, String> {
    let mut client = tls_client(server, files, ca, identity).await?;
    codes(&mut client, 1).await
}

/// The overall codes of `n` calls, or the first failure.
async fn codes(client: &mut RateLimitServiceClient<Channel>, n: usize) -> Result<Vec<i32>, String> {
    let mut out = Vec::new();
    for _ in 0..n {
        let answer = client
            .should_rate_limit(rls_request("tls", None))
            .await
            .map_err(|s| format!("{s:?}"))?;
        out.push(answer.into_inner().overall_code);
    }
    Ok(out)
}

/// With a certificate and key the listener serves TLS (through tonic, the default
/// then): a client trusting the CA is decided (2 per hour: OK, OK, OVER_LIMIT); a
/// cleartext client and a client trusting another CA get no answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_listener_serves_tls_to_clients_that_trust_its_ca() {
    let files = TlsFiles::generate("grpc-listener");
    let dir = tempdir("grpc-tls");
    write_rules(&dir);
    let server = start_tls(&dir, &files, false).await;

    let mut client = tls_client(&server, &files, "ca.pem", false).await.unwrap();
    assert_eq!(
        codes(&mut client, 3).await.unwrap(),
        [Code::Ok as i32, Code::Ok as i32, Code::OverLimit as i32]
    );

    let cleartext = RateLimitServiceClient::connect(format!("http://{}", server.grpc)).await;
    let refused = match cleartext {
        Err(e) => Err(e.to_string()),
        Ok(mut c) => codes(&mut c, 1).await,
    };
    assert!(
        refused.is_err(),
        "a cleartext call was answered: {refused:?}"
    );

    let distrusted = first_answer(&server, &files, "other-ca.pem", false).await;
    let e = distrusted.expect_err("a client trusting another CA was answered");
    assert!(e.to_lowercase().contains("certificate"), "{e}");
}

/// With `--grpc-tls-client-ca` every client must present a certificate that CA signed:
/// one without is refused, one with is decided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_client_ca_only_clients_with_a_certificate_are_answered() {
    let files = TlsFiles::generate("grpc-mutual");
    let dir = tempdir("grpc-mtls");
    write_rules(&dir);
    let server = start_tls(&dir, &files, true).await;

    let anonymous = first_answer(&server, &files, "ca.pem", false).await;
    assert!(
        anonymous.is_err(),
        "a client without a certificate was answered: {anonymous:?}"
    );

    let mut client = tls_client(&server, &files, "ca.pem", true).await.unwrap();
    assert_eq!(
        codes(&mut client, 3).await.unwrap(),
        [Code::Ok as i32, Code::Ok as i32, Code::OverLimit as i32]
    );
}

/// TLS flags that cannot work stop the start and say why: a certificate file that
/// cannot be read (named), a file that holds no key, TLS asked of the native transport,
/// and a certificate without its key.
#[test]
fn tls_flags_that_cannot_work_stop_the_start() {
    let files = TlsFiles::generate("grpc-refused");
    let dir = tempdir("grpc-tls-refused");
    write_rules(&dir);
    let (cert, key) = (files.path("server.pem"), files.path("server.key"));
    let (cert, key) = (cert.to_str().unwrap(), key.to_str().unwrap());

    let said = serve_refused(
        &dir,
        &[
            "--grpc-tls-cert",
            "/nonexistent/server.pem",
            "--grpc-tls-key",
            key,
        ],
    );
    assert!(said.contains("/nonexistent/server.pem"), "{said}");

    let said = serve_refused(&dir, &["--grpc-tls-cert", cert, "--grpc-tls-key", cert]);
    assert!(
        said.contains("--grpc-tls-key") && said.contains("private key"),
        "{said}"
    );

    let said = serve_refused(
        &dir,
        &[
            "--grpc-tls-cert",
            cert,
            "--grpc-tls-key",
            key,
            "--grpc-transport",
            "native",
        ],
    );
    assert!(said.contains("--grpc-transport tonic"), "{said}");

    let said = serve_refused(&dir, &["--grpc-tls-cert", cert]);
    assert!(said.contains("--grpc-tls-key"), "{said}");
}
