//! Starting a real `tollgate serve` on free loopback ports for a test.

#![allow(dead_code, clippy::unwrap_used)] // each test binary uses a different part

pub mod upstream;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running server; killed when dropped.
pub struct Server {
    /// The process.
    pub child: Child,
    /// `http://127.0.0.1:<port>`.
    pub http: String,
    /// `127.0.0.1:<port>` of the gRPC listener.
    pub grpc: String,
    /// The rules directory.
    pub rules: PathBuf,
}

/// A fresh temporary directory for this test.
pub fn tempdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tollgate-it-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A loopback port nobody listens on (a small race until the process binds it).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Server {
    /// Starts `tollgate serve` on `rules` (a directory) with extra `args`, and waits
    /// until `/readyz` answers 200.
    pub async fn start(rules: &Path, args: &[&str]) -> Server {
        let (grpc, http) = (
            format!("127.0.0.1:{}", free_port()),
            format!("127.0.0.1:{}", free_port()),
        );
        let child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args([
                "serve",
                "--config",
                rules.to_str().unwrap(),
                "--grpc-listen",
                &grpc,
                "--http-listen",
                &http,
            ])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let server = Server {
            child,
            http: format!("http://{http}"),
            grpc,
            rules: rules.to_path_buf(),
        };
        let client = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(r) = client.get(format!("{}/readyz", server.http)).send().await {
                if r.status() == 200 {
                    return server;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("tollgate serve did not become ready on {}", server.http);
    }

    /// `GET path` as JSON.
    pub async fn get_json(&self, path: &str) -> serde_json::Value {
        reqwest::get(format!("{}{path}", self.http))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// `GET path` as text.
    pub async fn get_text(&self, path: &str) -> String {
        reqwest::get(format!("{}{path}", self.http))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        #[cfg(unix)]
        {
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .status();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running `tollgate proxy`; killed when dropped.
pub struct Proxy {
    /// The process.
    pub child: Child,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    /// `127.0.0.1:<port>`.
    pub addr: String,
}

impl Proxy {
    /// Starts `tollgate proxy` on the rule files in `rules` in front of `upstream`, with
    /// extra `args`, and waits until it accepts connections.
    pub async fn start(rules: &Path, upstream: &str, args: &[&str]) -> Proxy {
        let addr = format!("127.0.0.1:{}", free_port());
        let child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args([
                "proxy",
                "--config",
                rules.to_str().unwrap(),
                "--listen",
                &addr,
                "--upstream",
                upstream,
            ])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Killed by Drop if it never listens.
        let proxy = Proxy {
            child,
            url: format!("http://{addr}"),
            addr,
        };
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if tokio::net::TcpStream::connect(&proxy.addr).await.is_ok() {
                return proxy;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("tollgate proxy did not listen on {}", proxy.addr);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
