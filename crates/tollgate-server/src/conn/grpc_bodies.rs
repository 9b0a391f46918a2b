//! The tonic transport's request messages, held to the native transport's budgets: at
//! most [`PER_CONNECTION`] bytes of unfinished request messages per connection, and
//! [`TOTAL`] for all the process's tonic connections together
//! (`grpc::limits::MAX_BUFFERED` and `MAX_BUFFERED_TOTAL`). A call whose message would
//! take either past its limit is answered `RESOURCE_EXHAUSTED` (its stream is then
//! reset), and the other calls go on.
//!
//! tonic reads a call's request body into a buffer until the whole message is there
//! (reserving the length its gRPC prefix declares as soon as it has read the prefix),
//! and h2 lets the client send more as tonic reads. Without these budgets, one
//! connection with 1,024 streams (`MAX_CONCURRENT_STREAMS`) each sending most of a
//! 4 MiB message and never its end held 4 GiB until the calls timed out.
//!
//! [`BudgetLayer`] wraps each request body in [`Charged`], which charges it, as tonic
//! reads it, the bytes tonic holds for it: each message's 5-byte prefix and its
//! declared length (at most the largest message, [`MAX_MESSAGE`]), the message's own
//! bytes being part of that. The charge is given back when tonic drops the body, which
//! it does once it has read the (unary) request message. The connection's budget comes
//! with the connection: [`Watched`](super::Watched) makes it, and tonic puts it in each
//! request's extensions as the connection's [`GrpcConnectInfo`].

use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::Request;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use tonic::body::Body;
use tonic::Status;

use super::BodyBudget;
use crate::grpc::limits;

/// Bytes of unfinished request messages a tonic connection may hold: one message of
/// the largest size and room for others (`grpc::limits::MAX_BUFFERED`).
pub(crate) const PER_CONNECTION: usize = limits::MAX_BUFFERED;
/// Bytes of unfinished request messages all tonic connections may hold together
/// (`grpc::limits::MAX_BUFFERED_TOTAL`).
pub(crate) const TOTAL: usize = limits::MAX_BUFFERED_TOTAL;
/// The largest request message tonic takes (its `max_decoding_message_size`, the
/// native transport's `max_message`): a longer declared length is refused by tonic
/// (`OUT_OF_RANGE`) before it reserves anything, so it is charged no more than this.
pub(crate) const MAX_MESSAGE: usize = 4 << 20;
/// Length of a gRPC message's prefix: a compression flag and a 4-byte length.
const PREFIX_LEN: usize = 5;

/// The budget all tonic connections of the process share.
fn shared() -> Arc<BodyBudget> {
    static SHARED: OnceLock<Arc<BodyBudget>> = OnceLock::new();
    Arc::clone(SHARED.get_or_init(|| Arc::new(BodyBudget::new(TOTAL))))
}

/// What tonic knows of a gRPC connection ([`Watched`](super::Watched)'s
/// `Connected::ConnectInfo`, in each request's extensions, over TLS too): its budget of request bytes. (Not tonic's
/// `TcpConnectInfo`, so `tonic::Request::remote_addr` says `None`: the service does not
/// ask it.)
#[derive(Debug, Clone)]
pub(crate) struct GrpcConnectInfo {
    /// The connection's unfinished request messages.
    pub bodies: Arc<BodyBudget>,
}

impl Default for GrpcConnectInfo {
    /// A new connection's: a budget of [`PER_CONNECTION`] bytes.
    fn default() -> Self {
        Self {
            bodies: Arc::new(BodyBudget::new(PER_CONNECTION)),
        }
    }
}

/// The connection's budget, from a request's extensions (over TLS too: tonic puts the
/// socket's connect info there beside its `TlsConnectInfo`).
fn connection_budget(extensions: &http::Extensions) -> Option<Arc<BodyBudget>> {
    extensions
        .get::<GrpcConnectInfo>()
        .map(|info| Arc::clone(&info.bodies))
}

/// The tower layer for tonic's server (`Server::layer`): each request body becomes a
/// [`Charged`] one, on its connection's budget and the process's.
#[derive(Clone)]
pub(crate) struct BudgetLayer {
    total: Arc<BodyBudget>,
}

impl BudgetLayer {
    /// On the process-wide budget of [`TOTAL`] bytes.
    pub(crate) fn new() -> Self {
        Self { total: shared() }
    }
}

impl<S> tower::Layer<S> for BudgetLayer {
    type Service = Budgeted<S>;

    fn layer(&self, inner: S) -> Budgeted<S> {
        Budgeted {
            inner,
            total: Arc::clone(&self.total),
        }
    }
}

/// [`BudgetLayer`]'s service.
#[derive(Clone)]
pub(crate) struct Budgeted<S> {
    inner: S,
    total: Arc<BodyBudget>,
}

impl<S> tower::Service<Request<Body>> for Budgeted<S>
where
    S: tower::Service<Request<Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> S::Future {
        let connection = connection_budget(request.extensions());
        let total = Arc::clone(&self.total);
        let request = request.map(|inner| Body::new(Charged::new(inner, connection, total)));
        self.inner.call(request)
    }
}

/// Follows the gRPC framing of a request body to say what each chunk costs.
#[derive(Debug, Default)]
struct Framing {
    prefix: [u8; PREFIX_LEN],
    /// Bytes of the current prefix read.
    have: usize,
    /// Bytes of the current message still to come.
    remaining: usize,
}

impl Framing {
    /// What `data` adds to what tonic holds: the prefix bytes as they come, and a
    /// message's declared length (at most [`MAX_MESSAGE`]) once its prefix is whole;
    /// the message's bytes are part of that.
    fn cost(&mut self, mut data: &[u8]) -> usize {
        let mut cost = 0usize;
        while !data.is_empty() {
            if self.remaining > 0 {
                let n = self.remaining.min(data.len());
                self.remaining -= n;
                data = &data[n..];
                continue;
            }
            let n = (PREFIX_LEN - self.have).min(data.len());
            self.prefix[self.have..self.have + n].copy_from_slice(&data[..n]);
            self.have += n;
            data = &data[n..];
            cost += n;
            if self.have == PREFIX_LEN {
                let [_, a, b, c, d] = self.prefix;
                let declared = u32::from_be_bytes([a, b, c, d]) as usize;
                self.have = 0;
                self.remaining = declared;
                cost = cost.saturating_add(declared.min(MAX_MESSAGE));
            }
        }
        cost
    }
}

/// A tonic request body charged to its connection's budget and the process's until it
/// is dropped; a frame that would take either past its limit fails the body with
/// `RESOURCE_EXHAUSTED`, which tonic answers.
struct Charged {
    inner: Body,
    connection: Option<Arc<BodyBudget>>,
    total: Arc<BodyBudget>,
    /// Bytes taken from `connection` and from `total`.
    charged: usize,
    framing: Framing,
}

impl Charged {
    fn new(inner: Body, connection: Option<Arc<BodyBudget>>, total: Arc<BodyBudget>) -> Self {
        Self {
            inner,
            connection,
            total,
            charged: 0,
            framing: Framing::default(),
        }
    }

    /// Takes `n` bytes from the connection's budget, then from the process's.
    fn charge(&mut self, n: usize) -> Result<(), Status> {
        if let Some(connection) = &self.connection {
            if !connection.charge(n) {
                return Err(Status::resource_exhausted(format!(
                    "this connection holds too many unfinished request messages (at most \
                     {PER_CONNECTION} bytes together); finish them, or send this call on \
                     another connection"
                )));
            }
        }
        if !self.total.charge(n) {
            if let Some(connection) = &self.connection {
                connection.release(n);
            }
            return Err(Status::resource_exhausted(
                "the server holds too many unfinished request messages; try again later",
            ));
        }
        self.charged += n;
        Ok(())
    }
}

impl HttpBody for Charged {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        let frame = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        if let Some(Ok(frame)) = &frame {
            if let Some(data) = frame.data_ref() {
                let cost = this.framing.cost(data);
                if cost > 0 {
                    if let Err(status) = this.charge(cost) {
                        return Poll::Ready(Some(Err(status)));
                    }
                }
            }
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

impl Drop for Charged {
    fn drop(&mut self) {
        self.total.release(self.charged);
        if let Some(connection) = &self.connection {
            connection.release(self.charged);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(declared: u32, body: &[u8]) -> Vec<u8> {
        let mut out = vec![0];
        out.extend(declared.to_be_bytes());
        out.extend(body);
        out
    }

    #[test]
    fn the_largest_message_is_the_native_transports() {
        assert_eq!(MAX_MESSAGE, crate::grpc::native::settings().max_message);
    }

    #[test]
    fn a_message_costs_its_prefix_and_declared_length_once() {
        let bytes = message(10, b"0123456789");
        let mut framing = Framing::default();
        assert_eq!(framing.cost(&bytes), 15);
        // Byte by byte: the same total, charged as the prefix completes.
        let mut framing = Framing::default();
        let costs: Vec<usize> = bytes.iter().map(|b| framing.cost(&[*b])).collect();
        assert_eq!(costs.iter().sum::<usize>(), 15);
        assert_eq!(costs[4], 11);
        assert!(costs[5..].iter().all(|&c| c == 0));
        // Two messages in one chunk; a declared length past the largest message
        // costs the largest.
        let mut two = message(3, b"abc");
        two.extend(message(u32::MAX, b"x"));
        assert_eq!(Framing::default().cost(&two), 8 + 5 + MAX_MESSAGE);
    }

    #[tokio::test]
    async fn a_body_past_the_connections_budget_fails_and_gives_back_its_charge() {
        use http_body_util::BodyExt;
        let connection = Arc::new(BodyBudget::new(100));
        let total = Arc::new(BodyBudget::new(1_000));
        let fits = Charged::new(
            Body::new(http_body_util::Full::new(Bytes::from(message(
                50, &[0; 50],
            )))),
            Some(Arc::clone(&connection)),
            Arc::clone(&total),
        );
        let mut fits = Box::pin(fits);
        assert!(fits.frame().await.expect("a frame").is_ok());
        assert_eq!((connection.used(), total.used()), (55, 55));
        let over = Charged::new(
            Body::new(http_body_util::Full::new(Bytes::from(message(
                60, &[0; 60],
            )))),
            Some(Arc::clone(&connection)),
            Arc::clone(&total),
        );
        let status = Box::pin(over)
            .frame()
            .await
            .expect("a frame")
            .expect_err("over the budget");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert_eq!((connection.used(), total.used()), (55, 55));
        drop(fits);
        assert_eq!((connection.used(), total.used()), (0, 0));
    }

    #[tokio::test]
    async fn a_body_past_the_process_budget_fails_and_leaves_the_connections_whole() {
        use http_body_util::BodyExt;
        let connection = Arc::new(BodyBudget::new(1_000));
        let total = Arc::new(BodyBudget::new(100));
        let body = Body::new(http_body_util::Full::new(Bytes::from(message(
            200, &[0; 200],
        ))));
        let status = Box::pin(Charged::new(
            body,
            Some(Arc::clone(&connection)),
            Arc::clone(&total),
        ))
        .frame()
        .await
        .expect("a frame")
        .expect_err("over the budget");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(status.message().contains("the server holds"), "{status:?}");
        assert_eq!((connection.used(), total.used()), (0, 0));
    }
}
