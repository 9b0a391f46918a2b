//! What one connection may hold, and for how long: the timeouts and budgets that the
//! listeners' worker threads (`workers.rs`, which builds on this module, never the
//! other way) put around every accepted connection, and the cap on how many a listener
//! holds at once ([`Gate`], [`Slot`]).
//!
//! - HTTP listeners (hyper): [`Activity`] follows a connection's requests ([`Tracked`]
//!   counts each service call; [`Outbound`] notes each response frame sent), and its
//!   [`watchdog`] has it closed when idle: no request within the header-read timeout of
//!   the accept, or later nothing for the idle timeout while no call is pending (HTTP/2
//!   keepalive PINGs do not count). [`Inbound`] cuts a
//!   request body that pauses longer than the idle timeout and charges buffered bodies
//!   to a per-connection and a listener-wide [`BodyBudget`]; a body past either is
//!   answered 503 by [`Call`].
//! - The tonic gRPC transport: [`Watched`] wraps the socket, closing it when the HTTP/2
//!   preface does not arrive within the header-read timeout, or when the client sends
//!   nothing for the idle timeout although the server PINGs it more often than that;
//!   it carries the connection's [`BodyBudget`], which [`grpc_bodies`] charges each
//!   request message to, with a process-wide one.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode};
use http_body_util::Limited;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tonic::transport::server::Connected;
use tower::util::Oneshot;
use tower::ServiceExt;

mod gate;
pub(crate) mod grpc_bodies;

pub(crate) use gate::{Gate, Slot};

/// A body error, boxed as hyper and axum take them.
type BoxError = Box<dyn StdError + Send + Sync>;

/// How long a connection may take to start, and stay without requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Timeouts {
    /// From the accept to the first request (HTTP) or the HTTP/2 preface (gRPC); each
    /// HTTP/1 request's headers (hyper's `header_read_timeout`).
    pub header_read: Duration,
    /// No request (HTTP), or no byte from the client (gRPC), for this long closes the
    /// connection; also the longest pause in a request body or a response being sent.
    pub idle: Duration,
}

/// The request bodies an HTTP listener lets its handlers buffer.
#[derive(Clone, Default)]
pub(crate) struct BodyLimits {
    /// Largest request body; past it the body fails with `http_body_util`'s
    /// `LengthLimitError`, which axum's extractors answer 413. `None`: no limit (the
    /// gateway streams bodies to its upstream and buffers none).
    pub max: Option<usize>,
    /// Bytes one connection's unfinished request bodies may hold together (each
    /// connection has a [`BodyBudget`] of this size), so that one HTTP/2 connection
    /// with many streams cannot take the whole listener's `budget`. `None`: no limit.
    pub per_connection: Option<usize>,
    /// Bytes all the listener's unfinished request bodies may hold together.
    pub budget: Option<Arc<BodyBudget>>,
}

/// A listener's budget of request-body bytes: what the bodies being received have
/// delivered so far, counted until each body is dropped (read to its end and handed
/// over, or abandoned). A frame that would take the total past the limit fails its body.
#[derive(Debug)]
pub(crate) struct BodyBudget {
    limit: usize,
    used: AtomicUsize,
}

impl BodyBudget {
    /// A budget of `limit` bytes.
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            limit,
            used: AtomicUsize::new(0),
        }
    }

    /// Takes `n` bytes from the budget; `false` (nothing taken) when they do not fit.
    pub(crate) fn charge(&self, n: usize) -> bool {
        let before = self.used.fetch_add(n, Relaxed);
        if before.saturating_add(n) > self.limit {
            self.used.fetch_sub(n, Relaxed);
            return false;
        }
        true
    }

    /// Gives `n` bytes back.
    pub(crate) fn release(&self, n: usize) {
        if n > 0 {
            self.used.fetch_sub(n, Relaxed);
        }
    }

    /// Bytes in use.
    #[cfg(test)]
    pub(crate) fn used(&self) -> usize {
        self.used.load(Relaxed)
    }
}

/// Why a request body was cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyError {
    /// No data for this long.
    Stalled(Duration),
    /// The listener's [`BodyBudget`] is spent.
    OverBudget,
    /// The connection's [`BodyBudget`] is spent.
    ConnectionOverBudget,
}

impl fmt::Display for BodyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BodyError::Stalled(after) => {
                write!(
                    f,
                    "the request body sent nothing for {}",
                    crate::HumanDuration(*after)
                )
            }
            BodyError::OverBudget => f.write_str(LISTENER_FULL),
            BodyError::ConnectionOverBudget => f.write_str(CONNECTION_FULL),
        }
    }
}

impl StdError for BodyError {}

/// Why a body past the listener's [`BodyBudget`] is refused.
const LISTENER_FULL: &str = "the listener holds too many request bodies; try again later";
/// Why a body past its connection's [`BodyBudget`] is refused.
const CONNECTION_FULL: &str = "this connection holds too many unfinished request bodies; \
     finish them, or send this request on another connection";

/// Which budget refused a call's request body, if one did: what [`Inbound`] tells the
/// [`Call`], which answers 503 whatever the handler made of the failed body.
#[derive(Debug, Default)]
struct Refused(AtomicU8);

impl Refused {
    // 0: not refused.
    const LISTENER: u8 = 1;
    const CONNECTION: u8 = 2;

    fn set(&self, why: BodyError) {
        let code = match why {
            BodyError::OverBudget => Self::LISTENER,
            BodyError::ConnectionOverBudget => Self::CONNECTION,
            BodyError::Stalled(_) => return,
        };
        self.0.store(code, Relaxed);
    }

    /// The answer to a refused body: 503, with why in a JSON body as the HTTP API's
    /// other refusals have it.
    fn answer(&self) -> Option<Response<Body>> {
        let why = match self.0.load(Relaxed) {
            Self::LISTENER => LISTENER_FULL,
            Self::CONNECTION => CONNECTION_FULL,
            _ => return None,
        };
        let body = serde_json::json!({ "error": why }).to_string();
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        Some(response)
    }
}

/// What an HTTP connection has been doing, shared by its service calls and response
/// bodies (which note each request event: a call starting or answered, a response
/// frame sent, a response finished) and its [`watchdog`], which closes it when idle.
/// Atomics only: noting an event reads no clock.
#[derive(Debug, Default)]
pub(crate) struct Activity {
    /// Service calls not answered yet. While one is, the connection is busy: the call
    /// has bounds of its own (the store's deadline, the upstream's timeout) and its
    /// request body the idle timeout, in [`Inbound`].
    calls: AtomicUsize,
    /// A request event since the watchdog last looked.
    seen: AtomicBool,
    /// Whether a request has come.
    started: AtomicBool,
}

impl Activity {
    /// Notes a request event.
    fn touch(&self) {
        self.seen.store(true, Relaxed);
    }

    fn call_started(&self) {
        self.started.store(true, Relaxed);
        self.calls.fetch_add(1, Relaxed);
        self.touch();
    }

    fn call_ended(&self) {
        self.calls.fetch_sub(1, Relaxed);
        self.touch();
    }

    /// Whether the connection is busy now (a call pending) or was since the last look.
    fn busy(&self) -> bool {
        self.calls.load(Relaxed) > 0 || self.seen.swap(false, Relaxed)
    }
}

/// Why an HTTP connection is closed before its client closes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Close {
    /// The server drains (SIGTERM).
    Drain,
    /// No request within the header-read timeout of the accept, or none for the idle
    /// timeout.
    Idle,
}

/// Watches an HTTP connection's [`Activity`] (in a task of its own, so that serving a
/// request polls no timer of it) and says on `close` when the connection is to be
/// closed: at `stop`, or when it is idle. Idle: no request within the header-read
/// timeout of the accept, or later no request event for the idle timeout while no call
/// is pending. It looks every quarter of the idle timeout, so an idle connection is
/// closed between one and one and a quarter idle timeouts after its last request.
/// Returns when the connection ends (`close` dropped).
pub(crate) async fn watchdog(
    activity: Arc<Activity>,
    timeouts: Timeouts,
    stopping: impl Future<Output = ()>,
    mut close: tokio::sync::oneshot::Sender<Close>,
) {
    tokio::pin!(stopping);
    let look_every = timeouts.idle / 4;
    let mut quiet_since = Instant::now();
    loop {
        let limit = if activity.started.load(Relaxed) {
            timeouts.idle
        } else {
            timeouts.header_read
        };
        let next = (quiet_since + limit).min(Instant::now() + look_every);
        tokio::select! {
            () = close.closed() => return,
            () = &mut stopping => {
                let _ = close.send(Close::Drain);
                return;
            }
            () = tokio::time::sleep_until(next) => {}
        }
        let now = Instant::now();
        if activity.busy() {
            quiet_since = now;
            continue;
        }
        let limit = if activity.started.load(Relaxed) {
            timeouts.idle
        } else {
            timeouts.header_read
        };
        if now >= quiet_since + limit {
            let _ = close.send(Close::Idle);
            return;
        }
    }
}

/// The HTTP service of one connection: puts the client's address
/// (`ConnectInfo<SocketAddr>`) in each request, wraps its body in [`Inbound`] and the
/// response's in [`Outbound`], and counts the call in the connection's [`Activity`].
pub(crate) struct Tracked<S> {
    service: S,
    peer: SocketAddr,
    activity: Arc<Activity>,
    idle: Duration,
    bodies: BodyLimits,
    /// This connection's share of request-body bytes ([`BodyLimits::per_connection`]).
    connection: Option<Arc<BodyBudget>>,
}

impl<S> Tracked<S> {
    /// `service` for the connection from `peer`.
    pub(crate) fn new(
        service: S,
        peer: SocketAddr,
        activity: Arc<Activity>,
        idle: Duration,
        bodies: BodyLimits,
    ) -> Self {
        let connection = bodies
            .per_connection
            .map(|limit| Arc::new(BodyBudget::new(limit)));
        Self {
            service,
            peer,
            activity,
            idle,
            bodies,
            connection,
        }
    }
}

impl<S> hyper::service::Service<Request<Incoming>> for Tracked<S>
where
    S: tower::Service<Request<Body>, Response = Response<Body>> + Clone + Unpin,
    S::Future: Unpin,
{
    type Response = Response<Outbound>;
    type Error = S::Error;
    type Future = Call<S>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        self.activity.call_started();
        // Only where a budget may refuse the body.
        let refused = (self.bodies.budget.is_some() || self.connection.is_some())
            .then(|| Arc::new(Refused::default()));
        let mut request = request.map(|body| {
            Body::new(Inbound::new(
                body,
                self.idle,
                &self.bodies,
                self.connection.clone(),
                refused.clone(),
            ))
        });
        request.extensions_mut().insert(ConnectInfo(self.peer));
        Call {
            inner: self.service.clone().oneshot(request),
            activity: Some(Arc::clone(&self.activity)),
            refused,
        }
    }
}

/// A [`Tracked`] call: the service's answer, with its body in [`Outbound`]. The call
/// counts as pending in the connection's [`Activity`] until it is answered or dropped.
/// A call whose request body a budget refused is answered 503 (the handler saw a body
/// that failed to read, and would have answered 400).
pub(crate) struct Call<S: tower::Service<Request<Body>>> {
    inner: Oneshot<S, Request<Body>>,
    activity: Option<Arc<Activity>>,
    refused: Option<Arc<Refused>>,
}

impl<S> Future for Call<S>
where
    S: tower::Service<Request<Body>, Response = Response<Body>> + Unpin,
    S::Future: Unpin,
{
    type Output = Result<Response<Outbound>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let answer = ready!(Pin::new(&mut this.inner).poll(cx));
        let Some(activity) = this.activity.take() else {
            // Polled again after it was ready: an error of the caller's, not ours.
            return Poll::Pending;
        };
        activity.call_ended();
        let refusal = this.refused.as_ref().and_then(|r| r.answer());
        Poll::Ready(answer.map(|response| {
            refusal
                .unwrap_or(response)
                .map(|inner| Outbound { inner, activity })
        }))
    }
}

impl<S: tower::Service<Request<Body>>> Drop for Call<S> {
    fn drop(&mut self) {
        // Dropped unanswered: the client reset the stream or left.
        if let Some(activity) = self.activity.take() {
            activity.call_ended();
        }
    }
}

/// A response body that notes each frame it yields, and its end, in the connection's
/// [`Activity`]: a download that keeps going keeps its connection busy, one the client
/// stops reading (or an upstream stops sending) leaves it idle.
pub(crate) struct Outbound {
    inner: Body,
    activity: Arc<Activity>,
}

impl HttpBody for Outbound {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let frame = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        if matches!(frame, Some(Ok(_))) {
            this.activity.touch();
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Outbound {
    fn drop(&mut self) {
        self.activity.touch();
    }
}

/// A request body as the handlers get it: at most [`BodyLimits::max`] bytes, charged to
/// its connection's and the listener's [`BodyBudget`] until dropped, and failed when no
/// data comes for the idle timeout (a stalled upload would otherwise hold its buffer
/// and its connection for ever). The timer is set only when the body has to wait for
/// data.
struct Inbound {
    inner: Limited<Incoming>,
    /// The longest wait for the next frame.
    pause: Duration,
    timer: Option<Pin<Box<Sleep>>>,
    /// A frame came since the timer was set: the next wait starts a new pause.
    rearm: bool,
    budget: Option<Arc<BodyBudget>>,
    /// The connection's budget.
    connection: Option<Arc<BodyBudget>>,
    /// Bytes taken from `budget` and from `connection`.
    charged: usize,
    /// Where a refusal is noted for the [`Call`].
    refused: Option<Arc<Refused>>,
}

impl Inbound {
    fn new(
        body: Incoming,
        pause: Duration,
        limits: &BodyLimits,
        connection: Option<Arc<BodyBudget>>,
        refused: Option<Arc<Refused>>,
    ) -> Self {
        Self {
            inner: Limited::new(body, limits.max.unwrap_or(usize::MAX)),
            pause,
            timer: None,
            rearm: false,
            budget: limits.budget.clone(),
            connection,
            charged: 0,
            refused,
        }
    }

    /// Takes `n` bytes from the connection's budget, then from the listener's.
    fn charge(&mut self, n: usize) -> Result<(), BodyError> {
        if let Some(connection) = &self.connection {
            if !connection.charge(n) {
                return Err(BodyError::ConnectionOverBudget);
            }
        }
        if let Some(budget) = &self.budget {
            if !budget.charge(n) {
                if let Some(connection) = &self.connection {
                    connection.release(n);
                }
                return Err(BodyError::OverBudget);
            }
        }
        self.charged += n;
        Ok(())
    }
}

impl HttpBody for Inbound {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.rearm = true;
                let len = frame.data_ref().map_or(0, Bytes::len);
                if len > 0 && (this.budget.is_some() || this.connection.is_some()) {
                    if let Err(why) = this.charge(len) {
                        if let Some(refused) = &this.refused {
                            refused.set(why);
                        }
                        return Poll::Ready(Some(Err(Box::new(why))));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(other) => Poll::Ready(other),
            Poll::Pending => {
                match &mut this.timer {
                    Some(timer) if this.rearm => timer.as_mut().reset(Instant::now() + this.pause),
                    Some(_) => {}
                    None => this.timer = Some(Box::pin(tokio::time::sleep(this.pause))),
                }
                this.rearm = false;
                if let Some(timer) = &mut this.timer {
                    ready!(timer.as_mut().poll(cx));
                }
                Poll::Ready(Some(Err(Box::new(BodyError::Stalled(this.pause)))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Inbound {
    fn drop(&mut self) {
        if let Some(budget) = &self.budget {
            budget.release(self.charged);
        }
        if let Some(connection) = &self.connection {
            connection.release(self.charged);
        }
    }
}

/// Length of the HTTP/2 connection preface (`PRI * HTTP/2.0…`), which a gRPC client
/// sends first; a TLS client's hello is longer.
const PREFACE_LEN: usize = 24;

/// A gRPC connection's socket for tonic: holds the listener's [`Slot`] until the
/// connection closes, and fails the connection (a read error, `TimedOut`) when the
/// client has not sent [`PREFACE_LEN`] bytes within the header-read timeout of the
/// accept, or later sends nothing at all for the idle timeout. tonic PINGs a quiet
/// client more often than that (the listener's keepalive, `workers::grpc_keepalive`),
/// so a client that is there always answers in time, however long it makes no call. It
/// carries the connection's budget of request bytes ([`grpc_bodies::GrpcConnectInfo`]).
pub(crate) struct Watched {
    io: TcpStream,
    _slot: Slot,
    info: grpc_bodies::GrpcConnectInfo,
    timeouts: Timeouts,
    opened: Instant,
    /// Bytes read, counted up to [`PREFACE_LEN`].
    read: usize,
    last_read: Instant,
    timer: Pin<Box<Sleep>>,
}

impl Watched {
    /// `io`, accepted now, holding `slot`.
    pub(crate) fn new(io: TcpStream, slot: Slot, timeouts: Timeouts) -> Self {
        let opened = Instant::now();
        let info = grpc_bodies::GrpcConnectInfo::default();
        Self {
            io,
            _slot: slot,
            info,
            timeouts,
            opened,
            read: 0,
            last_read: opened,
            timer: Box::pin(tokio::time::sleep_until(opened + timeouts.header_read)),
        }
    }

    /// When the connection is due to be closed, as things stand.
    fn due(&self) -> Instant {
        if self.read < PREFACE_LEN {
            self.opened + self.timeouts.header_read
        } else {
            self.last_read + self.timeouts.idle
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let n = buf.filled().len() - before;
                if n > 0 {
                    let had_preface = this.read >= PREFACE_LEN;
                    this.read = this.read.saturating_add(n).min(PREFACE_LEN);
                    this.last_read = Instant::now();
                    if !had_preface && this.read >= PREFACE_LEN {
                        // From the header-read deadline to the idle one, which may be sooner.
                        let due = this.due();
                        this.timer.as_mut().reset(due);
                    }
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => loop {
                // The timer is moved on only when it fires (not at every read).
                ready!(this.timer.as_mut().poll(cx));
                let due = this.due();
                if due <= Instant::now() {
                    let why = if this.read < PREFACE_LEN {
                        "no HTTP/2 preface within the header-read timeout"
                    } else {
                        "the client sent nothing for the idle timeout"
                    };
                    return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, why)));
                }
                this.timer.as_mut().reset(due);
            },
        }
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl Connected for Watched {
    type ConnectInfo = grpc_bodies::GrpcConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
    }
}
