//! `grpc --transport native`: the same calls as [`crate::grpc`], on Tollgate's own
//! HTTP/2 client (`tollgate_h2::ClientConn`). One task per connection writes every call
//! the workers have queued in one system call and reads replies in batches, so the
//! load generator spends less of the shared CPU per call than tonic's client does.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::{
    rate_limit_response::Code, RateLimitResponse,
};
use prost::Message;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tollgate_h2::{ClientConn, Reply};

use crate::cli::KeyArgs;
use crate::engine::{Outcome, Target};

const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// A call waiting for its connection's task.
struct Job {
    message: Vec<u8>,
    reply: oneshot::Sender<Outcome>,
}

/// Connections to one rate limit service, used round-robin.
pub struct NativeGrpcTarget {
    connections: Vec<mpsc::UnboundedSender<Job>>,
    keys: KeyArgs,
}

impl NativeGrpcTarget {
    /// Opens `connections` connections to `addr` (`host:port`, or `http://host:port`).
    pub async fn connect(
        addr: &str,
        connections: u32,
        keys: KeyArgs,
        connect_timeout: Duration,
    ) -> Result<Self, String> {
        let authority = addr
            .strip_prefix("http://")
            .unwrap_or(addr)
            .trim_end_matches('/');
        let mut senders = Vec::with_capacity(connections as usize);
        for _ in 0..connections {
            let stream = tokio::time::timeout(connect_timeout, TcpStream::connect(authority))
                .await
                .map_err(|_| format!("cannot connect to {authority}: timed out"))?
                .map_err(|e| format!("cannot connect to {authority}: {e}"))?;
            let _ = stream.set_nodelay(true);
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(connection(stream, authority.to_owned(), rx));
            senders.push(tx);
        }
        Ok(Self {
            connections: senders,
            keys,
        })
    }
}

impl Target for NativeGrpcTarget {
    fn call(&self, seq: u64) -> impl Future<Output = Outcome> + Send {
        let idx = (seq % self.connections.len() as u64) as usize;
        let (tx, rx) = oneshot::channel();
        let job = Job {
            message: crate::grpc::request(&self.keys, seq).encode_to_vec(),
            reply: tx,
        };
        let sent = self.connections.get(idx).map(|c| c.send(job).is_ok());
        async move {
            if sent != Some(true) {
                return Outcome::Error("the connection is closed".to_owned());
            }
            rx.await
                .unwrap_or_else(|_| Outcome::Error("the connection is closed".to_owned()))
        }
    }
}

fn outcome(reply: &Reply) -> Outcome {
    match reply.grpc_status {
        Some(0) => match reply.message().map(RateLimitResponse::decode) {
            Some(Ok(r)) => match Code::try_from(r.overall_code) {
                Ok(Code::Ok) => Outcome::Ok,
                Ok(Code::OverLimit) => Outcome::OverLimit,
                _ => Outcome::Other,
            },
            _ => Outcome::Error("an undecodable response".to_owned()),
        },
        Some(code) => Outcome::Error(format!("gRPC status {code}: {}", reply.grpc_message)),
        None => Outcome::Error(format!(
            "no gRPC status (HTTP {}): {}",
            reply.http_status, reply.grpc_message
        )),
    }
}

/// One connection: sends queued calls as the server's limits allow, hands replies back.
async fn connection(
    mut socket: TcpStream,
    authority: String,
    mut jobs: mpsc::UnboundedReceiver<Job>,
) {
    let (mut rd, wr) = socket.split();
    let mut conn = ClientConn::new(&authority);
    let mut queue: VecDeque<Job> = VecDeque::new();
    let mut waiting: HashMap<u32, oneshot::Sender<Outcome>> = HashMap::new();
    let mut input: Vec<u8> = Vec::with_capacity(64 << 10);
    let mut out: Vec<u8> = Vec::new();
    let mut replies = Vec::new();
    let mut open = true;
    let failure = loop {
        while let Some(job) = queue.front() {
            if !conn.can_send(job.message.len()) {
                break;
            }
            let Some(job) = queue.pop_front() else { break };
            match conn.request(PATH, &job.message) {
                Some(stream) => {
                    waiting.insert(stream, job.reply);
                }
                None => {
                    queue.push_front(job);
                    break;
                }
            }
        }
        out.append(conn.output());
        if let Err(e) = tollgate_h2::write_some(&mut out, |b| wr.try_write(b)) {
            break format!("write failed: {e}");
        }
        if !open && queue.is_empty() && waiting.is_empty() {
            return;
        }
        if conn.is_closed() && !queue.is_empty() {
            break "the server closed the connection (GOAWAY)".to_owned();
        }
        if input.capacity() - input.len() < 16 << 10 {
            input.reserve(64 << 10);
        }
        tokio::select! {
            job = jobs.recv(), if open => match job {
                Some(job) => {
                    queue.push_back(job);
                    // Let the workers' other ready tasks queue their calls too, so
                    // that one write carries them all (as Envoy flushes a connection
                    // once per turn of its event loop, not once per call).
                    tokio::task::yield_now().await;
                    while let Ok(job) = jobs.try_recv() {
                        queue.push_back(job);
                    }
                }
                None => open = false,
            },
            read = rd.read_buf(&mut input) => match read {
                Ok(0) => break "the server closed the connection".to_owned(),
                Ok(_) => match conn.receive(&input, &mut replies) {
                    Ok(used) => {
                        input.drain(..used);
                        for reply in replies.drain(..) {
                            if let Some(tx) = waiting.remove(&reply.stream) {
                                let _ = tx.send(outcome(&reply));
                            }
                        }
                    }
                    Err(e) => break e.to_string(),
                },
                Err(e) => break format!("read failed: {e}"),
            },
            written = wr.writable(), if !out.is_empty() => {
                if let Err(e) = written {
                    break format!("write failed: {e}");
                }
            }
        }
    };
    for (_, tx) in waiting.drain() {
        let _ = tx.send(Outcome::Error(failure.clone()));
    }
    for job in queue {
        let _ = job.reply.send(Outcome::Error(failure.clone()));
    }
}
