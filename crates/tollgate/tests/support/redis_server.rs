//! Real `redis-server` processes for tests, on free loopback ports: a single Redis
//! (optionally also serving TLS, with certificates `openssl` makes), or a 3-master
//! Redis Cluster made with `redis-cli --cluster create`.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// One `redis-server`, killed when dropped.
pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
    cluster: bool,
    /// The TLS port and how clients are checked on it, when it serves TLS too.
    tls: Option<(u16, TlsFiles, &'static str)>,
    /// More `redis-server` arguments (kept for restarts).
    extra: Vec<String>,
}

/// A test CA, a server certificate for `localhost` and 127.0.0.1, a client certificate,
/// and a CA nobody used (for "wrong CA" tests): PEM files made by `openssl`.
#[derive(Clone)]
pub struct TlsFiles {
    pub dir: PathBuf,
}

impl TlsFiles {
    /// Makes the files in a fresh directory (EC P-256 keys, valid for two days).
    pub fn generate(name: &str) -> Self {
        require("openssl");
        let dir = std::env::temp_dir().join(format!("tollgate-tls-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let openssl = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(&dir)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "openssl {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let key = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        for ca in ["ca", "other-ca"] {
            let (keyout, out, subj) = (
                format!("{ca}.key"),
                format!("{ca}.pem"),
                format!("/CN=tollgate test {ca}"),
            );
            openssl(
                &[
                    &["req", "-x509", "-new"][..],
                    &key,
                    &[
                        "-keyout", &keyout, "-out", &out, "-days", "2", "-subj", &subj,
                    ],
                ]
                .concat(),
            );
        }
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n",
        )
        .unwrap();
        std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
        for (who, cn) in [("server", "localhost"), ("client", "tollgate test client")] {
            let (keyout, csr, pem, ext, subj) = (
                format!("{who}.key"),
                format!("{who}.csr"),
                format!("{who}.pem"),
                format!("{who}.ext"),
                format!("/CN={cn}"),
            );
            openssl(
                &[
                    &["req", "-new"][..],
                    &key,
                    &["-keyout", &keyout, "-out", &csr, "-subj", &subj],
                ]
                .concat(),
            );
            openssl(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "2",
                "-extfile",
                &ext,
            ]);
        }
        Self { dir }
    }

    /// The path of one of the files: `ca.pem`, `other-ca.pem`, `server.pem`,
    /// `server.key`, `client.pem`, `client.key`.
    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// The bytes of one of the files.
    pub fn read(&self, file: &str) -> Vec<u8> {
        std::fs::read(self.path(file)).unwrap()
    }
}

/// A port that is free, and whose cluster bus port (+10000) is free too.
///
/// Taken from 10000–19999 (buses 20000–29999), below the kernel's ephemeral range, from
/// a counter that never hands a port out twice in this test binary: a port the kernel
/// picked for `bind(…:0)` could be picked again for another test's listener or client
/// before `redis-server` binds it.
pub fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const FIRST: u32 = 10_000;
    const COUNT: u32 = 10_000;
    // Another test binary running at the same time starts elsewhere in the range.
    let start = std::process::id() % COUNT;
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        assert!(n < COUNT, "no free port left in {FIRST}..{}", FIRST + COUNT);
        let port = (FIRST + (start + n) % COUNT) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok()
            && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok()
        {
            return port;
        }
    }
}

fn require(binary: &str) {
    let found = Command::new(binary)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    assert!(
        found,
        "`{binary}` is not installed: these tests need a real Redis \
         (apt-get install -y redis-server redis-tools; `bash .ci/run` does this)"
    );
}

/// Sends one inline command over a fresh connection and returns the raw reply.
pub fn command(port: u16, line: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    // Generous for the first byte (a busy machine), short after it (see below).
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(format!("{line}\r\n").as_bytes())?;
    let mut buf = vec![0u8; 65_536];
    let mut out = Vec::new();
    // Read until the reply looks complete (a short pause after data).
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                out.extend_from_slice(&buf[..n]);
                s.set_read_timeout(Some(Duration::from_millis(30)))?;
            }
            Err(_) if !out.is_empty() => break,
            Err(e) => return Err(e),
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

impl RedisServer {
    /// Starts a plain Redis.
    pub fn start() -> Self {
        Self::spawn(false, &[], None, &[])
    }

    /// Starts a plain Redis with more `redis-server` arguments (configuration
    /// directives, e.g. `--rename-command FCALL ""` to act as a Redis without it).
    pub fn start_with_args(args: &[&str]) -> Self {
        Self::spawn(false, &[], None, args)
    }

    /// Starts a Redis that also serves TLS with `files`' server certificate, checking
    /// clients against `files`' CA: `auth_clients` is Redis's `tls-auth-clients` (`yes`:
    /// a client must present a certificate; `no`: none is asked for).
    pub fn start_tls(files: &TlsFiles, auth_clients: &'static str) -> Self {
        Self::spawn(false, &[], Some((files.clone(), auth_clients)), &[])
    }

    /// `rediss://127.0.0.1:TLS_PORT` (panics if this Redis serves no TLS).
    pub fn tls_url(&self) -> String {
        let (port, _, _) = self.tls.as_ref().expect("a Redis started with start_tls");
        format!("rediss://127.0.0.1:{port}")
    }

    /// Starts a Redis on a free port other than `avoid`. A port found free can be
    /// taken before Redis binds it (another test's client may get it as its local
    /// port), so a Redis that exits at start is tried again on a new port.
    fn spawn(
        cluster: bool,
        avoid: &[u16],
        tls: Option<(TlsFiles, &'static str)>,
        extra: &[&str],
    ) -> Self {
        require("redis-server");
        let mut failures = Vec::new();
        for _ in 0..5 {
            let port = loop {
                let p = free_port();
                if !avoid.contains(&p) {
                    break p;
                }
            };
            let dir =
                std::env::temp_dir().join(format!("tollgate-redis-{}-{port}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let mut server = Self {
                child: None,
                port,
                dir,
                cluster,
                tls: tls.clone().map(|(files, auth)| (free_port(), files, auth)),
                extra: extra.iter().map(|a| (*a).to_owned()).collect(),
            };
            match server.launch() {
                Ok(()) => return server,
                Err(why) => failures.push(format!("port {port}: {why}")),
            }
        }
        panic!("redis-server did not start:\n{}", failures.join("\n"));
    }

    /// Starts `redis-server` on `self.port`; on failure, says why (its log).
    fn launch(&mut self) -> Result<(), String> {
        let log = self.dir.join("redis.log");
        let out = std::fs::File::create(&log).map_err(|e| e.to_string())?;
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--loglevel", "warning", "--protected-mode", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.extra)
            .stdout(out)
            .stderr(Stdio::null());
        if let Some((port, files, auth)) = &self.tls {
            cmd.args(["--tls-port", &port.to_string()])
                .arg("--tls-cert-file")
                .arg(files.path("server.pem"))
                .arg("--tls-key-file")
                .arg(files.path("server.key"))
                .arg("--tls-ca-cert-file")
                .arg(files.path("ca.pem"))
                .args(["--tls-auth-clients", auth]);
            if self.cluster {
                // The cluster bus over TLS too; nodes then tell TLS clients their TLS ports.
                cmd.args(["--tls-cluster", "yes"]);
            }
        }
        if self.cluster {
            cmd.args(["--cluster-enabled", "yes"])
                .args([
                    "--cluster-config-file",
                    &format!("nodes-{}.conf", self.port),
                ])
                .args(["--cluster-node-timeout", "2000"]);
        }
        let child = self.child.insert(cmd.spawn().map_err(|e| e.to_string())?);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if command(self.port, "PING").is_ok_and(|r| r.starts_with("+PONG")) {
                return Ok(());
            }
            let exited = child.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() >= deadline {
                self.kill();
                let said = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(match exited {
                    Some(status) => format!("exited ({status}): {}", said.trim()),
                    None => format!("no PONG within 10 s: {}", said.trim()),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL): connections drop, nothing answers.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port, empty (scripts and keys gone). If the port
    /// was taken meanwhile, tries again for a few seconds.
    pub fn restart(&mut self) {
        self.kill();
        let mut failures = Vec::new();
        for _ in 0..10 {
            match self.launch() {
                Ok(()) => return,
                Err(why) => failures.push(why),
            }
            std::thread::sleep(Duration::from_millis(300));
        }
        panic!(
            "redis-server did not start again on {}:\n{}",
            self.port,
            failures.join("\n")
        );
    }

    /// SIGSTOP / SIGCONT: the server keeps its connections but answers nothing.
    pub fn pause(&self, paused: bool) {
        if let Some(c) = &self.child {
            let signal = if paused { "-STOP" } else { "-CONT" };
            let _ = Command::new("kill")
                .arg(signal)
                .arg(c.id().to_string())
                .status();
        }
    }

    /// `INFO commandstats` calls of one command (e.g. `evalsha`).
    pub fn calls(&self, command_name: &str) -> u64 {
        let info = command(self.port, "INFO commandstats").expect("INFO commandstats");
        let needle = format!("cmdstat_{command_name}:calls=");
        info.lines()
            .find_map(|l| l.strip_prefix(&needle))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// Script calls this server ran: `FCALL` (the store's default on Redis 7) and
    /// `EVALSHA` (without functions).
    pub fn script_calls(&self) -> u64 {
        self.calls("fcall") + self.calls("evalsha")
    }

    /// Keys in this server's keyspace.
    pub fn dbsize(&self) -> u64 {
        let reply = command(self.port, "DBSIZE").expect("DBSIZE");
        let n = reply.trim().trim_start_matches(':').parse();
        n.unwrap_or_else(|_| panic!("DBSIZE answered {reply:?}"))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.pause(false);
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Three masters joined into a Redis Cluster, dropped together.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// A cluster whose nodes also serve TLS (clients are not asked for certificates)
    /// and talk to each other over TLS.
    pub fn start_tls(files: &TlsFiles) -> Self {
        Self::start_with(Some((files.clone(), "no")))
    }

    fn start_with(tls: Option<(TlsFiles, &'static str)>) -> Self {
        require("redis-cli");
        let mut nodes: Vec<RedisServer> = Vec::new();
        while nodes.len() < 3 {
            let taken: Vec<u16> = nodes.iter().map(|n| n.port).collect();
            nodes.push(RedisServer::spawn(true, &taken, tls.clone(), &[]));
        }
        let ports: Vec<u16> = nodes.iter().map(|n| n.port).collect();
        let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        // redis-cli waits for the nodes to join for as long as it takes: 30 s at most.
        let mut create = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let started = Instant::now();
        while create.try_wait().unwrap().is_none() {
            if started.elapsed() > Duration::from_secs(30) {
                let _ = create.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let out = create.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed or took over 30 s: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        for node in &nodes {
            loop {
                let info = command(node.port, "CLUSTER INFO").unwrap_or_default();
                if info.contains("cluster_state:ok") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the cluster did not become ready"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Self { nodes }
    }

    /// `redis+cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3`.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", nodes.join(","))
    }

    /// `rediss+cluster://127.0.0.1:T1,...` with the nodes' TLS ports.
    pub fn tls_url(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| n.tls_url().replace("rediss://", ""))
            .collect();
        format!("rediss+cluster://{}", nodes.join(","))
    }
}
