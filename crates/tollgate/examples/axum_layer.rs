//! `RateLimitLayer` in an axum service: the rules and their `http` section (routes,
//! actions) come from one rule file, and the layer answers 429 with the RateLimit
//! headers before the handler runs.
//!
//! Run: `cargo run -p tollgate --features tower --example axum_layer`
//! It serves on 127.0.0.1:3000, sends itself a few requests, prints what came back,
//! and keeps serving (try `curl -i localhost:3000/api/hello`) until Ctrl-C.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tollgate::http::{config, RateLimitLayer};
use tollgate::limiter::Limiter;
use tollgate::rules::{self, Rules};
use tollgate::store::MemoryStore;

const RULES: &str = r#"
domain: hello
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 3, name: per_ip}
http:
  routes:
    - match: {path_prefix: /api/}
      rate_limits:
        - actions: [{remote_address: {}}]
"#;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // In a real service: `Rules::load(paths, ..)` and `RateLimitLayer::new(limiter)`,
    // which read the same files and follow their hot reloads.
    let set = rules::from_str("hello.yaml", RULES)?;
    let sections: Vec<_> = config::from_str("hello.yaml", RULES)?.into_iter().collect();
    let limiter = Arc::new(Limiter::new(
        Arc::new(Rules::fixed(set)),
        MemoryStore::new(),
    ));
    let app = axum::Router::new()
        .route("/api/hello", axum::routing::get(|| async { "hello\n" }))
        .route("/health", axum::routing::get(|| async { "ok\n" }))
        .layer(RateLimitLayer::with_sections(limiter, sections).with_legacy_headers(true));

    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        // ConnectInfo gives the layer the client's address.
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
    });

    for path in [
        "/api/hello",
        "/api/hello",
        "/api/hello",
        "/api/hello",
        "/health",
    ] {
        let head = get(addr, path).await?;
        println!("GET {path}\n{head}\n");
    }
    println!("serving on http://{addr} (Ctrl-C to stop)");
    server.await??;
    Ok(())
}

/// A raw HTTP/1.1 GET; returns the status line and headers.
async fn get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    Ok(out.split("\r\n\r\n").next().unwrap_or("").to_string())
}
