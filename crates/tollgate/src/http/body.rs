//! What a request holds while it is in flight ([`Held`]), and a response body that holds
//! its concurrency permits until it ends: the last frame sent, an error, or the client
//! going away (the body is dropped) gives them back. Its adaptive-concurrency and
//! system-protection places are given back earlier, when the response head comes.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use super::adaptive::AdaptivePermit;
use super::protection::SystemPermit;
use crate::clock::Nanos;
use crate::inflight::Permit;

/// What a request holds while it is in flight.
#[derive(Default)]
pub(crate) struct Held {
    pub permits: Vec<Permit>,
    pub adaptive: Vec<AdaptivePermit>,
    pub system: Option<SystemPermit>,
}

impl Held {
    /// Whether it holds nothing.
    pub(crate) fn is_empty(&self) -> bool {
        self.permits.is_empty() && self.adaptive.is_empty() && self.system.is_none()
    }

    /// The request is forwarded at `now`: its latency counts from here.
    pub(crate) fn forwarded(&mut self, now: Nanos) {
        for a in &mut self.adaptive {
            a.start(now);
        }
        if let Some(s) = &mut self.system {
            s.start(now);
        }
    }

    /// The upstream's response head came at `now` with `status`: the latency goes to
    /// the controllers, and the adaptive and system places are given back; what is left
    /// (the concurrency permits) is held until the body ends.
    pub(crate) fn answered(mut self, now: Nanos, status: u16) -> Self {
        for a in self.adaptive.drain(..) {
            a.answered(now, status);
        }
        if let Some(s) = self.system.take() {
            s.answered(now, status);
        }
        self
    }
}

/// `B`, holding a request's places until it ends or is dropped.
pub(crate) struct PermitBody<B> {
    inner: B,
    held: Option<Held>,
}

impl<B> PermitBody<B> {
    pub(crate) fn new(inner: B, held: Held) -> Self {
        Self {
            inner,
            held: Some(held),
        }
    }
}

impl<B> Body for PermitBody<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            self.held = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
