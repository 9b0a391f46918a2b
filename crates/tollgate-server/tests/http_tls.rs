//! TLS on the HTTP listeners: `tollgate serve --http-tls-cert/--http-tls-key` (the HTTP
//! API and admin endpoints) and `tollgate proxy --tls-cert/--tls-key` (the gateway),
//! mutual with `--http-tls-client-ca` / `--tls-client-ca`. The client is rustls
//! (tokio-rustls) sending HTTP/1.1, and hyper's HTTP/2 client after ALPN `h2`.
//! Certificates come from `openssl` (`redis_server::TlsFiles`).

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

#[path = "../../tollgate/tests/support/redis_server.rs"]
mod redis_server;
mod support;

use std::sync::Arc;

use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use redis_server::TlsFiles;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use support::{serve_refused, tempdir, Proxy, Server};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// A TLS connection to `addr` as `localhost`, trusting `files`' CA, offering `alpn`,
/// presenting the client certificate when `identity`; `Err` with why the connection or
/// the handshake failed.
async fn connect(
    addr: &str,
    files: &TlsFiles,
    identity: bool,
    alpn: &[&[u8]],
) -> Result<TlsStream<TcpStream>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&files.read("ca.pem")) {
        roots.add(c.unwrap()).unwrap();
    }
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let mut config = if identity {
        let chain = CertificateDer::pem_slice_iter(&files.read("client.pem"))
            .map(Result::unwrap)
            .collect();
        let key = PrivateKeyDer::from_pem_slice(&files.read("client.key")).unwrap();
        builder.with_client_auth_cert(chain, key).unwrap()
    } else {
        builder.with_no_client_auth()
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = ServerName::try_from("localhost").unwrap();
    TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())
}

/// Sends `request` (HTTP/1.1, `Connection: close`) over TLS and returns the response,
/// or why the handshake or the exchange failed.
async fn https(
    addr: &str,
    files: &TlsFiles,
    identity: bool,
    request: &str,
) -> Result<String, String> {
    let mut tls = connect(addr, files, identity, &[b"http/1.1"]).await?;
    tls.write_all(request.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut response = Vec::new();
    tls.read_to_end(&mut response)
        .await
        .map_err(|e| e.to_string())?;
    Ok(String::from_utf8_lossy(&response).into_owned())
}

fn get(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
}

fn check(domain: &str) -> String {
    let body = format!(r#"{{"domain":"{domain}","descriptors":[{{"k":"v"}}]}}"#);
    format!(
        "POST /v1/check HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// The status code of an HTTP/1.1 response ("HTTP/1.1 200 OK ...").
fn status(response: &str) -> u16 {
    response
        .strip_prefix("HTTP/1.1 ")
        .and_then(|r| r.get(..3))
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP/1.1 response: {response:?}"))
}

/// What a cleartext HTTP/1.1 request to `addr` gets back (a TLS listener answers no
/// HTTP: an alert, or nothing).
async fn cleartext(addr: &str, request: &str) -> String {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    let _ = tcp.read_to_end(&mut response).await;
    String::from_utf8_lossy(&response).into_owned()
}

fn flags(files: &TlsFiles, names: [&str; 3], client_ca: bool) -> Vec<String> {
    let path = |file: &str| files.path(file).to_string_lossy().into_owned();
    let mut args = vec![
        names[0].to_owned(),
        path("server.pem"),
        names[1].to_owned(),
        path("server.key"),
    ];
    if client_ca {
        args.extend([names[2].to_owned(), path("ca.pem")]);
    }
    args
}

const SERVE_FLAGS: [&str; 3] = ["--http-tls-cert", "--http-tls-key", "--http-tls-client-ca"];
const PROXY_FLAGS: [&str; 3] = ["--tls-cert", "--tls-key", "--tls-client-ca"];

/// `tollgate serve` with the HTTP listener on TLS: `/v1/check` decides over HTTPS (2 per
/// hour: 200, 200, 429, with the RateLimit headers), `/metrics` answers, HTTP/2 is
/// negotiated by ALPN and serves `/healthz`, and a cleartext request gets no HTTP answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_answers_its_http_api_over_tls() {
    let files = TlsFiles::generate("http-api");
    let dir = tempdir("http-tls");
    std::fs::write(
        dir.join("tls.yaml"),
        "domain: tls\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 2}\n",
    )
    .unwrap();
    let args = flags(&files, SERVE_FLAGS, false);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let files = Arc::new(files);
    let server = Server::start_probed(&dir, &args, |http| {
        let files = Arc::clone(&files);
        async move {
            https(&http, &files, false, &get("/readyz"))
                .await
                .is_ok_and(|r| status(&r) == 200)
        }
    })
    .await;
    let addr = server.http.trim_start_matches("http://").to_owned();

    let mut statuses = Vec::new();
    for _ in 0..3 {
        let response = https(&addr, &files, false, &check("tls")).await.unwrap();
        assert!(
            response.to_lowercase().contains("ratelimit-policy:"),
            "{response}"
        );
        statuses.push(status(&response));
    }
    assert_eq!(statuses, [200, 200, 429]);
    let metrics = https(&addr, &files, false, &get("/metrics")).await.unwrap();
    assert!(metrics.contains("tollgate_total_hits_total"), "{metrics}");

    // HTTP/2, negotiated by ALPN.
    let tls = connect(&addr, &files, false, &[b"h2", b"http/1.1"])
        .await
        .unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .unwrap();
    tokio::spawn(conn);
    let request = http::Request::get("https://localhost/healthz")
        .body(Empty::<bytes::Bytes>::new())
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.version(), http::Version::HTTP_2);
    let _ = response.into_body().collect().await.unwrap();

    let plain = cleartext(&addr, &get("/readyz")).await;
    assert!(!plain.starts_with("HTTP/"), "{plain:?}");
}

/// `tollgate proxy` with TLS and a client CA: a client without a certificate is refused
/// in the handshake; one with it is forwarded (the upstream is told
/// `X-Forwarded-Proto: https`) and limited (2 per hour: 200, 200, 429).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_serves_mutual_tls_and_tells_the_upstream() {
    let files = TlsFiles::generate("gateway");
    let dir = tempdir("proxy-tls");
    std::fs::write(
        dir.join("edge.yaml"),
        "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: hour, requests_per_unit: 2}\n\
         http:\n  routes:\n    - match: {path_prefix: /}\n      rate_limits:\n        - actions: [{remote_address: {}}]\n",
    )
    .unwrap();
    // The upstream answers with the X-Forwarded-Proto it was sent.
    let upstream = axum::Router::new().fallback(|request: axum::extract::Request| async move {
        let proto = request
            .headers()
            .get("x-forwarded-proto")
            .map(|v| v.to_str().unwrap().to_owned());
        format!("proto={proto:?}")
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, upstream).await });

    let args = flags(&files, PROXY_FLAGS, true);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let proxy = Proxy::start(&dir, &format!("http://{upstream_addr}"), &args).await;

    let anonymous = https(&proxy.addr, &files, false, &get("/x")).await;
    assert!(
        anonymous.is_err() || !anonymous.as_deref().unwrap_or("").starts_with("HTTP/"),
        "a client without a certificate was answered: {anonymous:?}"
    );

    let mut statuses = Vec::new();
    for _ in 0..3 {
        let response = https(&proxy.addr, &files, true, &get("/x")).await.unwrap();
        if status(&response) == 200 {
            assert!(response.ends_with(r#"proto=Some("https")"#), "{response}");
        }
        statuses.push(status(&response));
    }
    assert_eq!(statuses, [200, 200, 429]);
}

/// TLS flags that cannot work stop the start and say which file: a certificate that
/// cannot be read, a certificate given as the key; and a key without a certificate.
#[test]
fn listener_tls_flags_that_cannot_work_stop_the_start() {
    let files = TlsFiles::generate("http-refused");
    let dir = tempdir("http-tls-refused");
    std::fs::write(
        dir.join("tls.yaml"),
        "domain: tls\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 2}\n",
    )
    .unwrap();
    let (cert, key) = (files.path("server.pem"), files.path("server.key"));
    let (cert, key) = (cert.to_str().unwrap(), key.to_str().unwrap());

    let said = serve_refused(
        &dir,
        &[
            "--http-tls-cert",
            "/nonexistent/server.pem",
            "--http-tls-key",
            key,
        ],
    );
    assert!(
        said.contains("--http-tls-cert /nonexistent/server.pem"),
        "{said}"
    );
    let said = serve_refused(&dir, &["--http-tls-cert", cert, "--http-tls-key", cert]);
    assert!(
        said.contains("--http-tls-key") && said.contains("private key"),
        "{said}"
    );
    let said = serve_refused(&dir, &["--http-tls-key", key]);
    assert!(said.contains("--http-tls-cert"), "{said}");
}
