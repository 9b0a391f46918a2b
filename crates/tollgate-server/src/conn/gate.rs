//! A listener's cap on the connections it holds open (`--max-connections`): the
//! [`Gate`] its acceptor takes a [`Slot`] from for each connection, which the
//! connection holds until it closes.

use std::sync::Arc;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::metrics::ListenerMetrics;

/// A listener's cap on the connections it holds open, and its metrics: one per
/// listening address, shared by its acceptor and (through each [`Slot`]) its workers.
#[derive(Clone)]
pub(crate) struct Gate {
    /// The listener's name in logs and metrics (`grpc`, `http`, `proxy`, `admin`).
    name: &'static str,
    slots: Arc<Semaphore>,
    metrics: ListenerMetrics,
}

impl Gate {
    /// A cap of `max` connections on the listener `name`, counted in `metrics`.
    pub(crate) fn new(name: &'static str, max: usize, metrics: ListenerMetrics) -> Self {
        Self {
            name,
            slots: Arc::new(Semaphore::new(max.clamp(1, Semaphore::MAX_PERMITS))),
            metrics,
        }
    }

    /// The listener's name in logs and metrics.
    pub(crate) fn name(&self) -> &'static str {
        self.name
    }

    /// The listener's metrics.
    pub(crate) fn metrics(&self) -> &ListenerMetrics {
        &self.metrics
    }

    fn slot(&self, permit: OwnedSemaphorePermit) -> Slot {
        self.metrics.open.inc();
        Slot {
            _permit: permit,
            open: self.metrics.open.clone(),
        }
    }

    /// A free slot now, if any.
    pub(crate) fn try_slot(&self) -> Option<Slot> {
        Arc::clone(&self.slots)
            .try_acquire_owned()
            .ok()
            .map(|p| self.slot(p))
    }

    /// The next free slot.
    pub(crate) async fn next_slot(&self) -> Option<Slot> {
        let permit = Arc::clone(&self.slots).acquire_owned().await.ok()?;
        Some(self.slot(permit))
    }

    /// Slots free now.
    #[cfg(test)]
    pub(crate) fn available(&self) -> usize {
        self.slots.available_permits()
    }
}

/// One connection's place under its listener's cap (and in the `tollgate_connections`
/// gauge), given back when dropped, with the connection.
pub(crate) struct Slot {
    _permit: OwnedSemaphorePermit,
    open: Gauge,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.dec();
    }
}
