//! Load shedding that adapts to what the upstream and the host can take, rather than to
//! fixed numbers: the controllers, pure (state, time and measurements in, a limit or a
//! decision out). The gateway applies them (`http/adaptive.rs`, `http/protection.rs`).
//!
//! - [`gradient`]: [`Gradient`], a route's concurrency limit following the upstream's
//!   latency (Envoy's adaptive concurrency: a gradient controller on a periodically
//!   re-sampled minimum RTT).
//! - [`capacity`]: [`Capacity`], what the upstream can take in flight before requests
//!   queue: the most answers per second times the least latency (Sentinel, after BBR).
//! - [`protection`]: [`Protection`], whether the gateway sheds a request: in flight past
//!   the capacity, or the host's CPU past a threshold; priority classes shed lowest
//!   first.
//! - [`cpu`]: the host's CPU use, read from `/proc/stat` or set by hand.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::adaptive::{Gradient, GradientSettings};
//!
//! const MS: u64 = 1_000_000;
//! let settings = GradientSettings { min_rtt_samples: 5, ..GradientSettings::default() };
//! let mut g = Gradient::new(settings, 0, 7);
//! // The minimum RTT is measured first, with the limit pinned low.
//! let mut now = 0;
//! for _ in 0..5 {
//!     now += MS;
//!     g.record(now, g.epoch(), 10 * MS);
//! }
//! assert_eq!(g.min_rtt(), Some(10 * MS));
//! // Then answers at the minimum, with the limit in use, grow the limit each interval.
//! let before = g.limit();
//! g.in_flight(before);
//! now += 100 * MS;
//! g.record(now, g.epoch(), 10 * MS);
//! assert!(g.limit() > before);
//! ```

pub mod capacity;
pub mod cpu;
pub mod gradient;
pub mod protection;

pub use capacity::Capacity;
pub use cpu::{CpuGauge, CpuReading, ManualCpu, ProcStat};
pub use gradient::{Gradient, GradientSettings, Phase};
pub use protection::{Protection, ProtectionSettings, Shed};
