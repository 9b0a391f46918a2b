//! The open loop's clock: a [`Ticker`] that wakes its task every [`STEP`].
//!
//! On Linux it is a `timerfd` registered with tokio's reactor, so a tick is one
//! readable event on the thread that already runs the dispatcher: no thread of its
//! own to sleep and wake, no wake-up handed from one thread to another (on two shared
//! cores those wake-ups, not the requests, were most of the load generator's CPU time,
//! which the server then did not get). A tokio timer would not do: it ticks once a
//! millisecond, which would release a whole millisecond of requests (110 at 110,000/s)
//! in one burst. Elsewhere the ticker falls back to tokio's interval (1 ms).

use std::time::Duration;

/// How often the open loop releases the requests that have come due.
pub const STEP: Duration = Duration::from_micros(200);

/// Wakes its task every [`STEP`].
pub struct Ticker {
    #[cfg(target_os = "linux")]
    timer: tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>,
    #[cfg(not(target_os = "linux"))]
    timer: tokio::time::Interval,
}

impl Ticker {
    /// A ticker whose first tick comes one [`STEP`] from now. Must be called within a
    /// tokio runtime with I/O enabled.
    #[cfg(target_os = "linux")]
    pub fn new() -> Result<Self, String> {
        use rustix::time::{
            timerfd_create, timerfd_settime, Itimerspec, TimerfdClockId, TimerfdFlags,
            TimerfdTimerFlags, Timespec,
        };
        let step = Timespec {
            tv_sec: 0,
            tv_nsec: i64::from(STEP.subsec_nanos()),
        };
        let fd = timerfd_create(
            TimerfdClockId::Monotonic,
            TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
        )
        .map_err(|e| format!("cannot create the pacing timer: {e}"))?;
        let spec = Itimerspec {
            it_interval: step,
            it_value: step,
        };
        timerfd_settime(&fd, TimerfdTimerFlags::empty(), &spec)
            .map_err(|e| format!("cannot start the pacing timer: {e}"))?;
        // Tokio deprecated the safe constructors (its replacements are `unsafe`, which
        // this workspace forbids) because an arbitrary `AsRawFd` may close or change its
        // descriptor while registered. An `OwnedFd` that the `AsyncFd` owns cannot: it
        // stays open, the same descriptor, until the `AsyncFd` drops it.
        #[allow(deprecated)]
        let timer = tokio::io::unix::AsyncFd::with_interest(fd, tokio::io::Interest::READABLE)
            .map_err(|e| format!("cannot register the pacing timer: {e}"))?;
        Ok(Self { timer })
    }

    /// A ticker whose first tick comes one [`STEP`] from now.
    #[cfg(not(target_os = "linux"))]
    pub fn new() -> Result<Self, String> {
        let mut timer = tokio::time::interval_at(tokio::time::Instant::now() + STEP, STEP);
        timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        Ok(Self { timer })
    }

    /// Waits for the next tick (ticks missed meanwhile count as one). Cancel-safe.
    #[cfg(target_os = "linux")]
    pub async fn tick(&mut self) -> Result<(), String> {
        loop {
            let mut ready = self
                .timer
                .readable()
                .await
                .map_err(|e| format!("the pacing timer failed: {e}"))?;
            // The number of expirations since the last read; its value does not matter.
            let mut expirations = [0u8; 8];
            match rustix::io::read(ready.get_inner(), &mut expirations) {
                Ok(_) => return Ok(()),
                Err(rustix::io::Errno::AGAIN) => ready.clear_ready(),
                Err(e) => return Err(format!("the pacing timer failed: {e}")),
            }
        }
    }

    /// Waits for the next tick (ticks missed meanwhile count as one). Cancel-safe.
    #[cfg(not(target_os = "linux"))]
    pub async fn tick(&mut self) -> Result<(), String> {
        self.timer.tick().await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// Ten ticks take about ten steps: not a burst (the timer really waits), and on
    /// Linux far less than tokio's millisecond each (the upper bound is loose, as a
    /// loaded machine can hold the thread back).
    #[tokio::test]
    async fn ticks_come_a_step_apart() -> Result<(), String> {
        let mut ticker = Ticker::new()?;
        let start = Instant::now();
        for _ in 0..10 {
            ticker.tick().await?;
        }
        let took = start.elapsed();
        assert!(took >= STEP * 9, "10 ticks in {took:?}");
        assert!(took < Duration::from_secs(1), "10 ticks in {took:?}");
        Ok(())
    }
}
