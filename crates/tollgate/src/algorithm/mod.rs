//! The rate limiting algorithms: pure functions of (parameters, state, now, cost).
//!
//! Nothing here reads a clock or does I/O. Each algorithm takes its state by `&mut`,
//! the current time and the request's cost, and returns a [`Decision`](crate::Decision). The state is
//! changed only when the request is admitted (a rejected request charges nothing); the
//! one exception is [`Lockout`], whose whole job is to remember a rejection.
//!
//! | algorithm | never admits | state per key |
//! |---|---|---|
//! | [`FixedWindow`] | more than `limit` per epoch-aligned window (2× across a boundary) | 16 bytes |
//! | [`SlidingWindow`] | more than `limit` per aligned window, `limit + 2` per rolling window | 296 bytes |
//! | [`SlidingLog`] | more than `limit` in any rolling window | 48 bytes + 16 per distinct admitted instant in the window (queue capacity doubles from 4; docs/benchmarks.md, Library, has the memory measured per key) |
//! | [`TokenBucket`] | more than `burst + limit × T / window` in any interval `T` | 16 bytes (32 with a warm-up: [`WarmState`]) |
//! | [`Gcra`] | the same as the token bucket, request for request | 16 bytes (32 with a warm-up: [`WarmState`]) |
//! | [`LeakyBucket`] | the same; in queue mode it delays instead of bursting | 16 bytes |
//!
//! The fixed window and the buckets keep their state in one [`KeyState`]: the
//! instant at which the key is back to "fresh" (a store may then drop it) and one
//! algorithm-specific word. The bucket algorithms keep an exact instant as a rational
//! number of nanoseconds (see [`KeyState`]), so a refill of `limit / window` per
//! nanosecond loses nothing to rounding however often they are called; the three share
//! that arithmetic (`bucket.rs`). The sliding log
//! keeps a [`LogState`] and the sliding window counter a [`WindowState`]; every state
//! type says, in the same way, from which instant it is the same as a fresh one.
//!
//! [`Limit`] bundles an algorithm with its optional lockout and a counter identity;
//! it is what stores and the rule engine work with. `docs/algorithms.md` has the
//! side-by-side comparison and the reasoning behind each bound.

mod bucket;
mod fixed_window;
mod gcra;
mod leaky_bucket;
mod limit;
mod lockout;
mod sliding_log;
mod sliding_window;
mod state;
mod token_bucket;

#[cfg(feature = "redis")]
pub(crate) use bucket::warm_tick;
pub use fixed_window::FixedWindow;
pub use gcra::Gcra;
pub use leaky_bucket::{LeakyBucket, LeakyMode};
pub use limit::{Algorithm, Consistency, InvalidLimit, Limit, Scope, StateKind, NAMES};
pub use lockout::Lockout;
pub use sliding_log::{LogState, SlidingLog};
pub use sliding_window::{SlidingWindow, WindowState, MARGIN, SUB_WINDOWS};
pub use state::{KeyState, WarmState};
pub use token_bucket::TokenBucket;
