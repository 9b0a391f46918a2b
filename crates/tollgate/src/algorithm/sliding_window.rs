//! Sliding window counter: the classic two-window estimate, held to the true rolling
//! count by 32 sub-window counts.
//!
//! **The estimate.** The current aligned window's count plus the previous window's count
//! weighted by how much of it the rolling window still covers (the counter Cloudflare and
//! others describe): `estimate = current + floor(previous × (window - elapsed) / window)`.
//! It assumes the previous window's requests were spread evenly. They rarely are once a
//! key is limited: rejected requests charge nothing, so admissions bunch where the
//! estimate leaves room, often late in a window, which is exactly where the weighting
//! discounts them. On its own the estimate lets up to `2 × limit` through in a rolling
//! window, and 1.15–1.18 × `limit` under plain Poisson traffic near the limit
//! (`tools/bench-accuracy.sh`).
//!
//! **The bound.** Each window is also cut into [`SUB_WINDOWS`] sub-windows of
//! `ceil(window / 32)`; the state keeps the count of each of the last 33 and the instant of
//! its last admission (to the nanosecond up to a 137 s window; rounded up to 100 ns for an
//! hour, 1 µs for a day). Every request admitted in
//! a sub-window whose last admission is still inside the rolling window `(now - window,
//! now]` may still be in it; the others certainly are not. Their sum, `bound`, is never
//! below the true rolling count.
//!
//! **Decision.** A request of cost `c` passes iff
//! `bound + c <= limit`, or `estimate + c <= limit` and `bound + c <= limit + MARGIN`.
//! The first arm admits what certainly fits; the second keeps the estimate's answers where
//! they stay within [`MARGIN`] units of the limit.
//!
//! **Guarantee.** Never more than `limit` admitted in one aligned window, and never more
//! than `limit + 2` in any rolling window of length `window` (the sliding log's exact
//! `limit`, plus the margin). Compared with the exact sliding log on the same traffic,
//! it can admit a little less: a sub-window's requests count until its last one leaves
//! (`tools/bench-accuracy.sh` measures both sides).
//!
//! **State.** [`WindowState`], 296 bytes: when it expires, the aligned window's end and
//! two counts, the newest sub-window's start, 33 counts and 33 last-admission offsets.
//!
//! `remaining` is how much more would pass now by either arm; `reset_after` is the time
//! to the aligned window's end; a rejection's `retry_after` is exact: the first instant at
//! which, if nothing else is admitted, the same request passes.
//!
//! **Example** (`tests/cases/tollgate/03-sliding-window.yaml`). 7 per minute, 5 in the
//! previous minute, 3 so far in this one: 18 s in (30 % of the way), the estimate is
//! `3 + floor(5 × 0.7) = 6`, so one more passes (the rolling minute then holds 9, within
//! the margin) and the next does not.
//! ```
//! use std::time::Duration;
//! use tollgate::algorithm::{SlidingWindow, WindowState};
//! const S: u64 = 1_000_000_000;
//! let sw = SlidingWindow::new(7, Duration::from_secs(60));
//! let mut state = WindowState::default();
//! let t0 = 1_699_920_000 * S;
//! for _ in 0..5 { assert!(sw.check(&mut state, t0 + 30 * S, 1).allowed); }
//! for _ in 0..3 { assert!(sw.check(&mut state, t0 + 70 * S, 1).allowed); }
//! let d = sw.check(&mut state, t0 + 78 * S, 1);
//! assert_eq!((d.allowed, d.remaining), (true, 0));
//! assert!(!sw.check(&mut state, t0 + 78 * S, 1).allowed);
//! ```

use std::time::Duration;

use crate::clock::{nanos, Nanos};
use crate::decision::{Decision, NEVER};

/// Sub-windows per window that the bound keeps counts of.
pub const SUB_WINDOWS: usize = 32;
/// How far past `limit` the classic estimate may take a rolling window (cost units).
pub const MARGIN: u64 = 2;
/// Sub-window counts kept: the rolling window overlaps at most this many.
const RING: usize = SUB_WINDOWS + 1;
/// A last admission is kept as a 32-bit offset from its sub-window's start, in units of
/// the first power of ten at least `sub-window / UNITS` nanoseconds: exact to the
/// nanosecond for windows up to about 137 s (per second, per minute), 100 ns for an hour,
/// 1 µs for a day. (A power of ten, so that the Redis scripts, which count in ticks of
/// 1 ns to 1 s, use the same unit.)
const UNITS: u64 = u32::MAX as u64;

/// Sliding-window-counter parameters: `limit` per rolling `window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlidingWindow {
    /// Requests (cost units) per window; at most `u32::MAX`.
    pub limit: u64,
    /// Window length in nanoseconds.
    pub window: Nanos,
}

/// Per-key state of a [`SlidingWindow`] (296 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WindowState {
    /// The instant from which this state decides as a fresh one does (a store may drop
    /// it): when both the aligned windows' counts and the newest sub-window are gone.
    pub expires_at: Nanos,
    /// The end of the counted aligned window (0: none yet).
    pub end: Nanos,
    /// The count of the aligned window before it.
    pub previous: u32,
    /// The count of the aligned window ending at `end`.
    pub current: u32,
    /// The start of the newest sub-window (`counts[0]`).
    pub newest: Nanos,
    /// Admitted cost per sub-window, newest first.
    pub counts: [u32; RING],
    /// Per sub-window, its last admission: the offset from its start, rounded up to a
    /// unit of nanoseconds (1 ns up to a 137 s window; see [`SlidingWindow`]).
    pub lasts: [u32; RING],
}

impl Default for WindowState {
    fn default() -> Self {
        Self {
            expires_at: 0,
            end: 0,
            previous: 0,
            current: 0,
            newest: 0,
            counts: [0; RING],
            lasts: [0; RING],
        }
    }
}

impl WindowState {
    /// True if the state is back to fresh at `now`.
    pub fn is_fresh(&self, now: Nanos) -> bool {
        self.expires_at <= now
    }
}

impl SlidingWindow {
    /// `limit` per `window`.
    pub fn new(limit: u64, window: Duration) -> Self {
        Self {
            limit,
            window: nanos(window),
        }
    }

    /// Charges `cost` at `now` whether it fits or not (`charge_rejected`): the window's
    /// count and its sub-window's may then pass `limit` (counts saturate at `u32::MAX`).
    pub fn charge(&self, state: &mut WindowState, now: Nanos, cost: u64) {
        if cost == 0 {
            return;
        }
        let w = self.window.max(1);
        let (end, previous, current) = self.counts(state, now, w);
        let b = sub_len(w);
        state.end = end;
        state.previous = previous as u32;
        state.current = saturate(current + cost);
        charge_ring(state, now, b, cost);
        let newest_leaves = last_instant(state, 0, b).map_or(0, |l| l.saturating_add(w));
        state.expires_at = end.saturating_add(w).max(newest_leaves);
    }

    /// Decides a request of `cost` at `now`, charging `state` if it passes.
    pub fn check(&self, state: &mut WindowState, now: Nanos, cost: u64) -> Decision {
        let w = self.window.max(1);
        let limit = self.limit.min(u64::from(u32::MAX));
        let (end, previous, current) = self.counts(state, now, w);
        let start = end - w;
        // A clock that stepped back before the stored window counts as its start.
        let elapsed = now.saturating_sub(start).min(w);
        let estimate = current + weigh(previous, w - elapsed, w);
        let b = sub_len(w);
        let (bound, from) = bound(state, now, w, b);
        let reset_after = end.saturating_sub(now);
        if fits(estimate, bound, cost, limit) {
            if cost > 0 {
                state.end = end;
                state.previous = previous as u32;
                state.current = saturate(current + cost);
                charge_ring(state, now, b, cost);
                // The current count lasts one window past its own; the newest
                // sub-window until its last admission leaves.
                let newest_leaves = last_instant(state, 0, b).map_or(0, |l| l.saturating_add(w));
                state.expires_at = end.saturating_add(w).max(newest_leaves);
            }
            let remaining = room(estimate + cost, bound + cost, limit);
            return Decision::allow(limit, remaining, reset_after);
        }
        let remaining = room(estimate, bound, limit);
        if cost > limit {
            return Decision::reject(limit, remaining, reset_after, NEVER);
        }
        // Each arm's first instant (if nothing else is admitted): the bound only falls, as
        // sub-windows leave; the estimate only falls, within a window and across its end.
        let span = (now, w, b);
        let by_bound = first_bound_fitting(state, from, span, bound, cost, limit);
        let by_margin = first_bound_fitting(state, from, span, bound, cost, limit + MARGIN);
        let by_estimate =
            now.saturating_add(self.estimate_retry(previous, current, elapsed, w, cost));
        let at = by_bound.min(by_estimate.max(by_margin));
        Decision::reject(limit, remaining, reset_after, at.saturating_sub(now))
    }

    /// When the estimate first leaves room for `cost`, from `elapsed` into the window.
    fn estimate_retry(
        &self,
        previous: u64,
        current: u64,
        elapsed: Nanos,
        w: Nanos,
        cost: u64,
    ) -> Nanos {
        let limit = self.limit.min(u64::from(u32::MAX));
        // When would `current + floor(previous × (w - e) / w) + cost <= limit` first hold?
        match (limit - cost).checked_sub(current) {
            Some(room) => first_elapsed_fitting(previous, room, w).saturating_sub(elapsed),
            // Not in this window: in the next one, `current` becomes the previous count.
            None => (w - elapsed) + first_elapsed_fitting(current, limit - cost, w),
        }
    }

    /// (end of the current window, previous count, current count) at `now`.
    fn counts(&self, state: &WindowState, now: Nanos, w: Nanos) -> (Nanos, u64, u64) {
        let aligned_end = (now - now % w).saturating_add(w);
        let (previous, current) = (u64::from(state.previous), u64::from(state.current));
        if state.expires_at <= now || state.end < w {
            return (aligned_end, 0, 0);
        }
        let stored_end = state.end;
        if stored_end >= aligned_end {
            (stored_end, previous, current)
        } else if stored_end + w == aligned_end {
            (aligned_end, current, 0)
        } else {
            (aligned_end, 0, 0)
        }
    }
}

/// Whether a request of `cost` passes (see the module's documentation).
fn fits(estimate: u64, bound: u64, cost: u64, limit: u64) -> bool {
    let need = bound.saturating_add(cost);
    need <= limit || (estimate.saturating_add(cost) <= limit && need <= limit + MARGIN)
}

/// How much more would pass now by either arm, given the estimate and the bound.
fn room(estimate: u64, bound: u64, limit: u64) -> u64 {
    let by_bound = limit.saturating_sub(bound);
    let by_estimate = limit
        .saturating_sub(estimate)
        .min((limit + MARGIN).saturating_sub(bound));
    by_bound.max(by_estimate)
}

/// The sub-window length: `ceil(window / SUB_WINDOWS)`, so that the ring covers a window
/// and one sub-window more.
pub(crate) fn sub_len(w: Nanos) -> Nanos {
    w.div_ceil(SUB_WINDOWS as u64).max(1)
}

/// The unit, in nanoseconds, of a sub-window's last admission.
fn unit(b: Nanos) -> Nanos {
    let at_least = b.div_ceil(UNITS);
    let mut unit = 1;
    while unit < at_least {
        unit *= 10;
    }
    unit
}

/// Sub-window `i`'s last admission, as an instant (rounded up); `None` before the epoch.
fn last_instant(state: &WindowState, i: usize, b: Nanos) -> Option<Nanos> {
    let start = state.newest.checked_sub(i as u64 * b)?;
    Some(start.saturating_add(u64::from(state.lasts[i]) * unit(b)))
}

/// When sub-window `i`'s count leaves the window: a window after its last admission.
fn leaves(state: &WindowState, i: usize, w: Nanos, b: Nanos) -> Nanos {
    last_instant(state, i, b).map_or(0, |l| l.saturating_add(w))
}

/// The bound: every sub-window's count, less those of the oldest sub-windows whose last
/// admission has left `(now - w, now]`, up to the first that has not (returned too).
/// (Taken from the oldest: beyond a 137 s window a last admission is rounded up, and can
/// then lie a few nanoseconds past the start of the next sub-window.)
fn bound(state: &WindowState, now: Nanos, w: Nanos, b: Nanos) -> (u64, Option<usize>) {
    let mut bound: u64 = state.counts.iter().map(|&c| u64::from(c)).sum();
    for i in (0..RING).rev() {
        if state.counts[i] == 0 {
            continue;
        }
        if leaves(state, i, w, b) > now {
            return (bound, Some(i));
        }
        bound -= u64::from(state.counts[i]);
    }
    (bound, None)
}

/// The first instant at which `bound + cost <= cap`, if nothing else is admitted: the
/// oldest sub-windows leave first, from `from` (the oldest still in the window), each
/// when its last admission and those of every older one have left the window.
fn first_bound_fitting(
    state: &WindowState,
    from: Option<usize>,
    (now, w, b): (Nanos, Nanos, Nanos),
    bound: u64,
    cost: u64,
    cap: u64,
) -> Nanos {
    let Some(mut excess) = (bound + cost).checked_sub(cap).filter(|&e| e > 0) else {
        return now;
    };
    let mut at = now;
    for i in (0..=from.unwrap_or(0)).rev() {
        if state.counts[i] == 0 {
            continue;
        }
        at = at.max(leaves(state, i, w, b));
        let count = u64::from(state.counts[i]);
        if count >= excess {
            return at;
        }
        excess -= count;
    }
    // Unreachable when cost <= cap: the bound's sub-windows all leave eventually.
    NEVER
}

/// Charges `cost` to the sub-window of `now`, moving the ring forward first.
fn charge_ring(state: &mut WindowState, now: Nanos, b: Nanos, cost: u64) {
    let empty = state.counts.iter().all(|&c| c == 0);
    if empty || now >= state.newest.saturating_add(b) {
        let steps = if empty {
            RING as u64
        } else {
            (now - state.newest) / b
        };
        if steps >= RING as u64 {
            state.counts = [0; RING];
            state.lasts = [0; RING];
            state.newest = now - now % b;
        } else {
            let steps = steps as usize;
            state.counts.copy_within(0..RING - steps, steps);
            state.lasts.copy_within(0..RING - steps, steps);
            state.counts[..steps].fill(0);
            state.lasts[..steps].fill(0);
            state.newest += steps as u64 * b;
        }
    }
    state.counts[0] = saturate(u64::from(state.counts[0]) + cost);
    // A clock that stepped back into an earlier sub-window charges the newest one and
    // leaves its last admission where it is.
    if let Some(offset) = now.checked_sub(state.newest) {
        // offset < b, so the quotient is below 2^32 - 1.
        let q = offset.div_ceil(unit(b)).min(UNITS);
        state.lasts[0] = state.lasts[0].max(q as u32);
    }
}

/// A count as stored: at most `u32::MAX` (only a charge past the limit can reach it).
fn saturate(count: u64) -> u32 {
    u32::try_from(count).unwrap_or(u32::MAX)
}

/// `floor(count × part / w)`.
fn weigh(count: u64, part: Nanos, w: Nanos) -> u64 {
    (count as u128 * part as u128 / w as u128) as u64
}

/// The smallest elapsed time `e` in `[0, w]` with `floor(count × (w - e) / w) <= room`.
fn first_elapsed_fitting(count: u64, room: u64, w: Nanos) -> Nanos {
    // floor(count (w - e) / w) <= room  <=>  count (w - e) < (room + 1) w
    let lhs = count as u128 * w as u128;
    let rhs = (room as u128 + 1) * w as u128;
    if lhs < rhs {
        return 0;
    }
    // e > (count w - (room + 1) w) / count
    let e = ((lhs - rhs) / count as u128) as u64 + 1;
    e.min(w)
}

#[cfg(test)]
mod tests {
    use super::*;
    const S: u64 = 1_000_000_000;

    #[test]
    fn retry_after_lands_exactly_where_the_request_first_fits() {
        let sw = SlidingWindow::new(7, Duration::from_secs(60));
        let mut st = WindowState::default();
        for _ in 0..7 {
            assert!(sw.check(&mut st, 30 * S, 1).allowed);
        }
        let now = 61 * S;
        // 1 + floor(7 × 59/60) = 7: the first passes (within the margin), the second not.
        assert!(sw.check(&mut st, now, 1).allowed);
        let d = sw.check(&mut st, now, 1);
        assert!(!d.allowed);
        let mut probe = st;
        assert!(!sw.check(&mut probe, now + d.retry_after - 1, 1).allowed);
        assert!(sw.check(&mut st, now + d.retry_after, 1).allowed);
    }

    #[test]
    fn retry_after_can_reach_into_the_next_window() {
        let sw = SlidingWindow::new(4, Duration::from_secs(10));
        let mut st = WindowState::default();
        for _ in 0..4 {
            assert!(sw.check(&mut st, 11 * S, 1).allowed);
        }
        let d = sw.check(&mut st, 12 * S, 2);
        assert!(!d.allowed);
        let mut probe = st;
        assert!(!sw.check(&mut probe, 12 * S + d.retry_after - 1, 2).allowed);
        assert!(sw.check(&mut st, 12 * S + d.retry_after, 2).allowed);
        assert!(d.retry_after > 8 * S);
    }

    #[test]
    fn counts_older_than_one_window_are_forgotten() {
        let sw = SlidingWindow::new(2, Duration::from_secs(10));
        let mut st = WindowState::default();
        assert!(sw.check(&mut st, 5 * S, 2).allowed);
        assert!(!sw.check(&mut st, 14 * S, 2).allowed);
        assert!(sw.check(&mut st, 25 * S, 2).allowed);
    }

    #[test]
    fn requests_bunched_late_in_a_window_are_not_discounted() {
        // 100 per minute, all of them in the last second of a minute: the estimate alone
        // lets about 98 more through in the next minute's first seconds (the previous
        // minute weighs 59/60, 58/60, ...); the bound holds every rolling minute to 100
        // and the margin.
        let sw = SlidingWindow::new(100, Duration::from_secs(60));
        let mut st = WindowState::default();
        let t0 = 1_699_920_000 * S;
        for _ in 0..100 {
            assert!(sw.check(&mut st, t0 + 59 * S, 1).allowed);
        }
        let mut admitted = Vec::new();
        for i in 0..1_200 {
            let now = t0 + 59 * S + i * S / 10;
            if sw.check(&mut st, now, 1).allowed {
                admitted.push(now);
            }
        }
        let in_the_first_minute = admitted.iter().filter(|&&t| t < t0 + 119 * S).count();
        assert_eq!(in_the_first_minute as u64, MARGIN);
        // They leave when their sub-window's last admission leaves: a minute later, to
        // the nanosecond.
        let first_after = admitted.iter().find(|&&t| t >= t0 + 119 * S).copied();
        assert_eq!(first_after, Some(t0 + 119 * S));
    }

    #[test]
    fn a_state_expires_when_its_newest_admission_leaves_the_window() {
        let sw = SlidingWindow::new(3, Duration::from_secs(10));
        let mut st = WindowState::default();
        assert!(sw.check(&mut st, 1_000 * S + 3 * S, 1).allowed);
        assert_eq!(
            st.expires_at,
            1_020 * S,
            "the aligned window's end + one window"
        );
        let fresh = WindowState::default();
        for now in [1_005 * S, 1_009 * S] {
            let (mut a, mut b) = (st, fresh);
            assert_ne!(
                sw.check(&mut a, now, 3),
                sw.check(&mut b, now, 3),
                "at {now}"
            );
        }
        let (mut a, mut b) = (st, fresh);
        assert_eq!(
            sw.check(&mut a, 1_020 * S, 3),
            sw.check(&mut b, 1_020 * S, 3)
        );
    }
}
