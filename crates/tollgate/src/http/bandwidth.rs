//! `cost: request_bytes` for a body streamed without a declared length: [`MeteredBody`]
//! charges the route's byte descriptors as the body arrives, through the limiter, before
//! the bytes go on to the inner service (the upstream).
//!
//! Frames are held until charged, in batches: a charge is made once [`BATCH`] bytes are
//! held, when the client's body pauses (nothing more to read now), and at its end. So
//! at most one batch (plus the frame that completed it) is held in memory, the store is
//! called at most once per [`BATCH`] bytes of a fast upload, and no byte is forwarded
//! before it is charged. Once a charge is refused the body fails (the forwarder aborts
//! the upstream request) and the refusal's answer, a 429 with the usual RateLimit
//! fields, is handed to the service, which sends it if no response has been sent yet.
//! Charges already made stay: those bytes were received and forwarded.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use bytes::Bytes;
use http::Response;
use http_body::{Frame, SizeHint};
use tokio::sync::oneshot;

use super::observer::DecisionObserver;
use crate::headers::HeaderSettings;
use crate::limiter::{Code, Limiter, RateLimitRequest};
use crate::rules::RuleSet;
use crate::store::Store;

/// Bytes held before they are charged, at most (a charge is made sooner when the
/// client's body pauses or ends).
pub const BATCH: u64 = 64 * 1024;

/// Why a metered body stopped.
#[derive(Debug, thiserror::Error)]
pub enum MeterError {
    /// A charge of the body's bytes was refused: the client is over its limit.
    #[error("the request body is over its rate limit")]
    OverLimit,
    /// The limiter could not charge the body's bytes.
    #[error("the request body's bytes could not be charged: {0}")]
    Limiter(#[from] crate::limiter::Error),
    /// The client's body failed.
    #[error("the request body failed")]
    Body(#[source] axum::Error),
    /// The body failed before (one of the errors above): nothing more is read.
    #[error("the request body stopped after an earlier error")]
    Stopped,
}

/// What a metered body charges, and where it reports a refusal.
pub(crate) struct Meter<S> {
    pub limiter: Arc<Limiter<S>>,
    /// The rule set the request was decided by.
    pub set: Arc<RuleSet>,
    /// One request per `http` section with byte descriptors; each descriptor's
    /// `hits_addend` is set to a batch's bytes when it is charged.
    pub charges: Vec<RateLimitRequest>,
    pub observer: Option<Arc<dyn DecisionObserver>>,
    pub headers: HeaderSettings,
    /// Receives the answer for the client when a charge is refused.
    pub refused: oneshot::Sender<Response<Body>>,
}

type Charging = Pin<Box<dyn Future<Output = Result<(), (MeterError, Response<Body>)>> + Send>>;

/// A request body charged to its route's `request_bytes` descriptors as it streams.
pub(crate) struct MeteredBody<S> {
    inner: Body,
    limiter: Arc<Limiter<S>>,
    set: Arc<RuleSet>,
    charges: Arc<Vec<RateLimitRequest>>,
    observer: Option<Arc<dyn DecisionObserver>>,
    headers: HeaderSettings,
    refused: Option<oneshot::Sender<Response<Body>>>,
    /// Frames read from the client, the first `ready` of them charged.
    held: VecDeque<Frame<Bytes>>,
    ready: usize,
    /// Data bytes in the frames not yet charged.
    uncharged: u64,
    /// A charge in flight, and how many held frames it covers.
    charging: Option<(Charging, usize)>,
    /// The client's body has ended.
    ended: bool,
    /// A charge was refused or failed: nothing more is forwarded.
    failed: bool,
}

impl<S: Store + 'static> MeteredBody<S> {
    pub(crate) fn new(inner: Body, meter: Meter<S>) -> Self {
        Self {
            inner,
            limiter: meter.limiter,
            set: meter.set,
            charges: Arc::new(meter.charges),
            observer: meter.observer,
            headers: meter.headers,
            refused: Some(meter.refused),
            held: VecDeque::new(),
            ready: 0,
            uncharged: 0,
            charging: None,
            ended: false,
            failed: false,
        }
    }

    /// Makes the held frames ready: at once when they carry no uncharged byte (empty
    /// frames, trailers), else by starting a charge of their bytes.
    fn release(&mut self) {
        if self.uncharged == 0 {
            self.ready = self.held.len();
        } else {
            self.charge();
        }
    }

    /// Starts charging the held, uncharged bytes.
    fn charge(&mut self) {
        let bytes = std::mem::take(&mut self.uncharged);
        let covers = self.held.len();
        let (limiter, set) = (Arc::clone(&self.limiter), Arc::clone(&self.set));
        let (charges, observer) = (Arc::clone(&self.charges), self.observer.clone());
        let settings = self.headers;
        let future = async move {
            for template in charges.iter() {
                let mut request = template.clone();
                for d in &mut request.descriptors {
                    d.hits_addend = Some(bytes);
                }
                let started = Instant::now();
                let response = match limiter.check_in(&set, &request, None).await {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(error = %e, "the gateway could not charge a request body");
                        let answer = super::service::problem(
                            http::StatusCode::INTERNAL_SERVER_ERROR,
                            "Internal Server Error",
                            "the gateway could not charge this request's body",
                        );
                        return Err((MeterError::Limiter(e), answer));
                    }
                };
                if let Some(observer) = &observer {
                    observer.decided(&request, &response, started.elapsed());
                }
                if response.overall == Code::OverLimit {
                    let fields = crate::headers::headers(&response, settings);
                    let answer = super::service::over_limit(&response, fields);
                    return Err((MeterError::OverLimit, answer));
                }
            }
            Ok(())
        };
        self.charging = Some((Box::pin(future), covers));
    }
}

impl<S: Store + 'static> http_body::Body for MeteredBody<S> {
    type Data = Bytes;
    type Error = MeterError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, MeterError>>> {
        let this = self.get_mut();
        loop {
            if this.failed {
                return Poll::Ready(Some(Err(MeterError::Stopped)));
            }
            if let Some((charging, covers)) = &mut this.charging {
                let covers = *covers;
                match charging.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok(())) => {
                        this.charging = None;
                        this.ready = covers;
                    }
                    Poll::Ready(Err((error, answer))) => {
                        this.charging = None;
                        this.failed = true;
                        this.held.clear();
                        if let Some(refused) = this.refused.take() {
                            // The service may have answered already: then nobody listens.
                            let _ = refused.send(answer);
                        }
                        return Poll::Ready(Some(Err(error)));
                    }
                }
            }
            if this.ready > 0 {
                if let Some(frame) = this.held.pop_front() {
                    this.ready -= 1;
                    return Poll::Ready(Some(Ok(frame)));
                }
                this.ready = 0;
            }
            if this.ended {
                if !this.held.is_empty() {
                    this.release();
                    continue;
                }
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_ref() {
                        this.uncharged += data.len() as u64;
                    }
                    this.held.push_back(frame);
                    if this.uncharged >= BATCH {
                        this.charge();
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    this.failed = true;
                    this.held.clear();
                    return Poll::Ready(Some(Err(MeterError::Body(e))));
                }
                Poll::Ready(None) => this.ended = true,
                Poll::Pending => {
                    if this.held.is_empty() {
                        return Poll::Pending;
                    }
                    // The client paused: charge what came, rather than hold it.
                    this.release();
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.held.is_empty() && self.charging.is_none() && !self.failed
    }

    fn size_hint(&self) -> SizeHint {
        // Streamed without a declared length, which the forwarder keeps.
        SizeHint::default()
    }
}
