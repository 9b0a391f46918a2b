//! Starting a real `tollgate serve` on free loopback ports for a test.

#![allow(dead_code, clippy::unwrap_used)] // each test binary uses a different part

#[path = "../../../tollgate/tests/support/minute.rs"]
pub mod minute;
pub mod upstream;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
    rate_limit_descriptor::Entry, RateLimitDescriptor,
};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;

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

/// A loopback port nobody listens on, for a process under test to bind.
///
/// Taken below the kernel's ephemeral range (32768 and up on Linux), from a counter
/// that never hands a port out twice in this test binary: a port the kernel picked for
/// `bind(…:0)` could be picked again for another test's upstream or client before the
/// process under test binds it, and that test would then talk to the wrong listener.
/// Redis servers of the same binary take theirs from 10000–29999 (`redis_server.rs`).
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const FIRST: u32 = 30_000;
    const COUNT: u32 = 2_700;
    // Another test binary running at the same time starts elsewhere in the range.
    let start = std::process::id() % COUNT;
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        assert!(n < COUNT, "no free port left in {FIRST}..{}", FIRST + COUNT);
        let port = (FIRST + (start + n) % COUNT) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

impl Server {
    /// Starts `tollgate serve` on `rules` (a directory) with extra `args`, and waits
    /// until `/readyz` answers 200. A port found free can be taken before the server
    /// binds it; a server that exits at start is tried again on new ports.
    pub async fn start(rules: &Path, args: &[&str]) -> Server {
        // A timeout: whatever listens there might never answer.
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(1))
            .build()
            .unwrap();
        Server::start_probed(rules, args, |http| {
            let client = client.clone();
            async move {
                let r = client.get(format!("http://{http}/readyz")).send().await;
                r.is_ok_and(|r| r.status() == 200)
            }
        })
        .await
    }

    /// [`Server::start`], asking `ready` (with the HTTP listener's `host:port`) whether
    /// the server is ready, for a listener a plain HTTP client cannot ask (TLS).
    pub async fn start_probed<F, Fut>(rules: &Path, args: &[&str], ready: F) -> Server
    where
        F: Fn(String) -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        Server::start_inner(rules, args, ready, None).await
    }

    /// Starts `tollgate serve` as [`Server::start`] does, but waits only until the
    /// process answers `/healthz` (alive), not until it is ready: for a server that
    /// starts without valid rules. Its log (standard error) is written to `log`.
    pub async fn start_alive(rules: &Path, args: &[&str], log: &Path) -> Server {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(1))
            .build()
            .unwrap();
        let alive = |http: String| {
            let client = client.clone();
            async move {
                let r = client.get(format!("http://{http}/healthz")).send().await;
                r.is_ok_and(|r| r.status() == 200)
            }
        };
        Server::start_inner(rules, args, alive, Some(log)).await
    }

    /// [`Server::start`], with the server's log (its standard error) written to `log`.
    pub async fn start_logging(rules: &Path, args: &[&str], log: &Path) -> Server {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(1))
            .build()
            .unwrap();
        let ready = |http: String| {
            let client = client.clone();
            async move {
                let r = client.get(format!("http://{http}/readyz")).send().await;
                r.is_ok_and(|r| r.status() == 200)
            }
        };
        Server::start_inner(rules, args, ready, Some(log)).await
    }

    async fn start_inner<F, Fut>(
        rules: &Path,
        args: &[&str],
        ready: F,
        log: Option<&Path>,
    ) -> Server
    where
        F: Fn(String) -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let mut exits = Vec::new();
        for _ in 0..5 {
            let (grpc, http) = (
                format!("127.0.0.1:{}", free_port()),
                format!("127.0.0.1:{}", free_port()),
            );
            let stderr = match log {
                Some(path) => Stdio::from(std::fs::File::create(path).unwrap()),
                None => Stdio::null(),
            };
            let child = spawn_tollgate_with(
                &[
                    "serve",
                    "--config",
                    rules.to_str().unwrap(),
                    "--grpc-listen",
                    &grpc,
                    "--http-listen",
                    &http,
                ],
                args,
                stderr,
            );
            let mut server = Server {
                child,
                http: format!("http://{http}"),
                grpc,
                rules: rules.to_path_buf(),
            };
            let what = server.http.clone();
            match wait_until(&mut server.child, &what, || ready(http.clone())).await {
                Ok(()) => return server,
                Err(status) => exits.push(status),
            }
        }
        panic!("tollgate serve did not start: {exits:?}");
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

    /// The value of the metrics line that starts with `name` (labels included), or
    /// `None` when no such line is exported yet.
    pub async fn metric(&self, name: &str) -> Option<u64> {
        let text = self.get_text("/metrics").await;
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
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
    /// [`start`](Self::start) with the admin endpoints on a listener of their own (a
    /// free port): the proxy, and the admin listener's URL (`http://127.0.0.1:<port>`).
    pub async fn start_with_admin(rules: &Path, upstream: &str, args: &[&str]) -> (Proxy, String) {
        let admin = format!("127.0.0.1:{}", free_port());
        let mut all = vec!["--admin-listen", admin.as_str()];
        all.extend_from_slice(args);
        let proxy = Self::start(rules, upstream, &all).await;
        (proxy, format!("http://{admin}"))
    }

    /// Starts `tollgate proxy` on the rule files in `rules` in front of `upstream`, with
    /// extra `args`, and waits until it accepts connections (on new ports if it exits
    /// at start, as [`Server::start`] does).
    pub async fn start(rules: &Path, upstream: &str, args: &[&str]) -> Proxy {
        Self::start_inner(rules, upstream, args, None).await
    }

    /// [`Proxy::start`], with the gateway's log (its standard error) written to `log`.
    pub async fn start_logging(rules: &Path, upstream: &str, args: &[&str], log: &Path) -> Proxy {
        Self::start_inner(rules, upstream, args, Some(log)).await
    }

    async fn start_inner(rules: &Path, upstream: &str, args: &[&str], log: Option<&Path>) -> Proxy {
        let mut exits = Vec::new();
        for _ in 0..5 {
            let addr = format!("127.0.0.1:{}", free_port());
            let stderr = match log {
                Some(path) => Stdio::from(std::fs::File::create(path).unwrap()),
                None => Stdio::null(),
            };
            let child = spawn_tollgate_with(
                &[
                    "proxy",
                    "--config",
                    rules.to_str().unwrap(),
                    "--listen",
                    &addr,
                    "--upstream",
                    upstream,
                ],
                args,
                stderr,
            );
            // Killed by Drop if it never listens.
            let mut proxy = Proxy {
                child,
                url: format!("http://{addr}"),
                addr,
            };
            let addr = proxy.addr.clone();
            match wait_until(&mut proxy.child, &proxy.url, || async {
                tokio::net::TcpStream::connect(&addr).await.is_ok()
            })
            .await
            {
                Ok(()) => return proxy,
                Err(status) => exits.push(status),
            }
        }
        panic!("tollgate proxy did not start: {exits:?}");
    }
}

/// Runs `tollgate serve` on `rules` with extra `args`, expecting it to refuse to start:
/// panics if it exits successfully; returns what it printed (stderr, then stdout).
pub fn serve_refused(rules: &Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["serve", "--config", rules.to_str().unwrap()])
        .args([
            "--grpc-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .args(args)
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "tollgate serve started: {said}");
    said
}

/// Starts the `tollgate` binary with `command` then the test's own `args`, its output
/// discarded.
fn spawn_tollgate(command: &[&str], args: &[&str]) -> Child {
    spawn_tollgate_with(command, args, Stdio::null())
}

fn spawn_tollgate_with(command: &[&str], args: &[&str], stderr: Stdio) -> Child {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(command)
        .args(args)
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap()
}

/// Polls `ready` every 50 ms until it says yes (`Ok`) or `child` exits (`Err`, its exit
/// status, so that the caller can try again on other ports); panics after 15 s.
async fn wait_until<F, Fut>(child: &mut Child, what: &str, ready: F) -> Result<(), String>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("{what}: exited ({status})"));
        }
        if ready().await {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what} did not become ready within 15 s");
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Posts `{"domain": domain, "descriptors": [{"k": "v"}]}` to the server's
/// `/v1/check` and returns the status with the client-side round trip time.
pub async fn check_domain(client: &reqwest::Client, server: &str, domain: &str) -> (u16, Duration) {
    let body = serde_json::json!({"domain": domain, "descriptors": [{"k": "v"}]});
    let started = Instant::now();
    let status = client
        .post(format!("{server}/v1/check"))
        .json(&body)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16();
    (status, started.elapsed())
}

/// `ShouldRateLimit` for `{k: v}` in `domain`, as Envoy would send it, with a raw
/// `grpc-timeout` (tonic's client also gives up after it).
pub fn rls_request(domain: &str, grpc_timeout: Option<&str>) -> tonic::Request<RateLimitRequest> {
    let mut request = tonic::Request::new(RateLimitRequest {
        domain: domain.into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "k".into(),
                value: "v".into(),
            }],
            ..Default::default()
        }],
        hits_addend: 1,
    });
    if let Some(timeout) = grpc_timeout {
        request
            .metadata_mut()
            .insert("grpc-timeout", timeout.parse().unwrap());
    }
    request
}

/// Sends `total` `POST /v1/check` calls of `body` from `in_flight` concurrent clients, the
/// clients spread over `servers` (HTTP base URLs) in turn; returns how many were admitted
/// (200). Any status but 200 and 429 fails the test.
pub async fn spread_checks(
    servers: &[String],
    in_flight: usize,
    total: u64,
    body: serde_json::Value,
) -> u64 {
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;
    let sent = Arc::new(AtomicU64::new(0));
    let admitted = Arc::new(AtomicU64::new(0));
    let (servers, body) = (Arc::new(servers.to_vec()), Arc::new(body));
    let mut clients = Vec::new();
    for c in 0..in_flight {
        let (sent, admitted) = (Arc::clone(&sent), Arc::clone(&admitted));
        let (servers, body) = (Arc::clone(&servers), Arc::clone(&body));
        clients.push(tokio::spawn(async move {
            let client = reqwest::Client::new();
            let server = &servers[c % servers.len()];
            while sent.fetch_add(1, Ordering::Relaxed) < total {
                let status = client
                    .post(format!("{server}/v1/check"))
                    .json(&*body)
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16();
                match status {
                    200 => {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                    429 => {}
                    other => panic!("status {other}"),
                }
            }
        }));
    }
    for c in clients {
        c.await.unwrap();
    }
    admitted.load(Ordering::Relaxed)
}
