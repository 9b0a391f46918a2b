//! A response body that holds concurrency permits until it ends: the last frame sent,
//! an error, or the client going away (the body is dropped) gives them back.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use crate::inflight::Permit;

/// `B`, holding `permits` until it ends or is dropped.
pub(crate) struct PermitBody<B> {
    inner: B,
    permits: Vec<Permit>,
}

impl<B> PermitBody<B> {
    pub(crate) fn new(inner: B, permits: Vec<Permit>) -> Self {
        Self { inner, permits }
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
            self.permits.clear();
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
