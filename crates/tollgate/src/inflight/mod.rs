//! Concurrency limits: at most `max` requests in flight at once for one key.
//!
//! A rate limit counts requests over time; a concurrency limit counts the requests
//! that have started and not yet ended. An [`InFlight`] store hands out one
//! [`Permit`] per admitted request and refuses (`Ok(None)`) while `max` permits of
//! the key are held. The caller keeps the permit for as long as the request is in
//! flight (until the response has been sent, or the client went away) and drops it
//! then: dropping gives the permit back. Nothing else releases a permit, so a permit
//! leaked with [`std::mem::forget`] stays taken (in memory) or until its lease
//! expires (in Redis).
//!
//! - [`MemoryInFlight`]: counts in this process, sharded; an entry exists only while a
//!   permit of its key is held.
//! - `RedisInFlight` (feature `redis`): permits shared by every instance through one
//!   Redis, as leases with an expiry that the holder renews, so an instance that
//!   crashes leaks nothing for longer than one lease.
//!
//! What a store failure means (admit anyway, or refuse) is the caller's decision: a
//! failing store returns the [`Error`](crate::store::Error), never a permit.
//!
//! ```
//! use tollgate::inflight::MemoryInFlight;
//!
//! let inflight = MemoryInFlight::new();
//! let first = inflight.try_acquire(b"user:1", 2);
//! let second = inflight.try_acquire(b"user:1", 2);
//! assert!(first.is_some() && second.is_some());
//! assert!(inflight.try_acquire(b"user:1", 2).is_none()); // two in flight already
//! drop(first); // the first request ended
//! assert!(inflight.try_acquire(b"user:1", 2).is_some());
//! ```

mod memory;
#[cfg(feature = "redis")]
mod redis;

use std::future::Future;

pub use memory::MemoryInFlight;
#[cfg(feature = "redis")]
pub use redis::{RedisInFlight, RedisInFlightBuilder};

/// A store of in-flight permits.
pub trait InFlight: Send + Sync {
    /// Takes one permit for `key` if fewer than `max` are held; `Ok(None)` when all
    /// `max` are taken.
    fn acquire<'a>(
        &'a self,
        key: &'a [u8],
        max: u64,
    ) -> impl Future<Output = Result<Option<Permit>, crate::store::Error>> + Send + 'a;
}

/// Held while a request is in flight; dropping it gives the permit back.
///
/// A permit is `Send + Sync + 'static`: it can move into a response body or a task
/// and be dropped anywhere.
#[derive(Debug)]
#[must_use = "the permit is given back as soon as it is dropped"]
pub struct Permit {
    // Never read: dropping it is what matters.
    #[allow(dead_code)]
    held: Held,
}

/// What a permit gives back when dropped (each variant's own `Drop` does it).
#[derive(Debug)]
#[allow(dead_code)] // never read: dropping is what matters
enum Held {
    Memory(memory::Held),
    #[cfg(feature = "redis")]
    Redis(redis::Lease),
}

impl Permit {
    fn memory(held: memory::Held) -> Self {
        Self {
            held: Held::Memory(held),
        }
    }

    #[cfg(feature = "redis")]
    fn redis(lease: redis::Lease) -> Self {
        Self {
            held: Held::Redis(lease),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permits_can_go_anywhere() {
        fn assert_bounds<T: Send + Sync + std::fmt::Debug + 'static>() {}
        assert_bounds::<Permit>();
        assert_bounds::<MemoryInFlight>();
        #[cfg(feature = "redis")]
        assert_bounds::<RedisInFlight>();
    }
}
