//! Property tests on random traces: each algorithm's guarantee, checked against what it
//! actually admitted, plus agreement between algorithms that must admit the same.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

use std::time::Duration;

use proptest::prelude::*;
use tollgate::algorithm::{
    FixedWindow, Gcra, KeyState, LeakyBucket, LeakyMode, Lockout, LogState, SlidingLog,
    SlidingWindow, TokenBucket, WarmState, WindowState, MARGIN,
};
use tollgate::clock::Nanos;
use tollgate::decision::{Decision, NEVER};

const S: Nanos = 1_000_000_000;
const START: Nanos = 1_699_920_000 * S;

/// A trace: (gap before the request in ns, cost).
fn trace(window: Nanos, max_cost: u64) -> impl Strategy<Value = Vec<(Nanos, u64)>> {
    // Gaps from 0 (bursts) to a quarter window, with the odd long pause.
    let gap = prop_oneof![
        4 => 0..window / 4,
        1 => Just(0),
        1 => window / 2..window * 2,
    ];
    prop::collection::vec((gap, 0..=max_cost), 1..160)
}

fn windows() -> impl Strategy<Value = Nanos> {
    prop_oneof![Just(S), Just(60 * S), Just(7 * S / 3), 1_000u64..10 * S]
}

/// Any algorithm, on whichever state it keeps.
type AnyCheck = dyn Fn(&mut States, Nanos, u64) -> Decision;

/// One key's state of every shape, for a test that picks the algorithm at random.
#[derive(Clone, Default, PartialEq, Eq, Debug)]
struct States {
    key: KeyState,
    log: LogState,
    window: WindowState,
}

/// Runs `check` over the trace; returns every request as (time, cost, decision).
fn run(
    trace: &[(Nanos, u64)],
    mut check: impl FnMut(Nanos, u64) -> Decision,
) -> Vec<(Nanos, u64, Decision)> {
    let mut now = START;
    trace
        .iter()
        .map(|&(gap, cost)| {
            now += gap;
            (now, cost, check(now, cost))
        })
        .collect()
}

fn admitted(events: &[(Nanos, u64, Decision)]) -> Vec<(Nanos, u64)> {
    events
        .iter()
        .filter(|e| e.2.allowed)
        .map(|e| (e.0, e.1))
        .collect()
}

/// Largest total cost admitted in any half-open interval `[t, t + span)` starting at an admission.
fn max_in_span(adm: &[(Nanos, u64)], span: Nanos) -> u64 {
    adm.iter()
        .map(|&(t, _)| {
            adm.iter()
                .filter(|&&(u, _)| u >= t && u < t + span)
                .map(|e| e.1)
                .sum()
        })
        .max()
        .unwrap_or(0)
}

/// Asserts the bucket bound: for all admissions i <= j,
/// `sum(cost i..=j) × window <= burst × window + limit × (t_j - t_i)`.
fn assert_bucket_bound(adm: &[(Nanos, u64)], limit: u64, window: Nanos, burst: u64) {
    for i in 0..adm.len() {
        let mut sum = 0u128;
        for j in i..adm.len() {
            sum += adm[j].1 as u128;
            let allowance =
                burst as u128 * window as u128 + limit as u128 * (adm[j].0 - adm[i].0) as u128;
            assert!(
                sum * window as u128 <= allowance,
                "admitted {sum} between {} and {} ns",
                adm[i].0,
                adm[j].0
            );
        }
    }
}

/// A token bucket kept the textbook way, (tokens, last refill), with exact fractions:
/// tokens are held in units of 1/window. The reference the real ones must agree with.
struct ReferenceBucket {
    limit: u128,
    window: u128,
    capacity: u128,
    tokens: u128,
    last: Nanos,
}

impl ReferenceBucket {
    fn new(limit: u64, window: Nanos, burst: u64) -> Self {
        let capacity = burst as u128 * window as u128;
        Self {
            limit: limit as u128,
            window: window as u128,
            capacity,
            tokens: capacity,
            last: 0,
        }
    }

    fn check(&mut self, now: Nanos, cost: u64) -> bool {
        let elapsed = now.saturating_sub(self.last) as u128;
        self.tokens = (self.tokens + elapsed * self.limit).min(self.capacity);
        self.last = now.max(self.last);
        let need = cost as u128 * self.window;
        if need <= self.tokens && self.limit > 0 {
            self.tokens -= need;
            true
        } else {
            false
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn sliding_log_never_admits_more_than_limit_in_any_rolling_window(
        limit in 1u64..12, window in windows(), tr in windows().prop_flat_map(|w| trace(w, 3)),
    ) {
        let log = SlidingLog { limit, window };
        let mut st = LogState::default();
        let events = run(&tr, |now, cost| log.check(&mut st, now, cost));
        prop_assert!(max_in_span(&admitted(&events), window) <= limit);
    }

    #[test]
    fn token_bucket_gcra_and_leaky_meter_admit_the_same_and_keep_the_bound(
        limit in 1u64..20, burst in 1u64..30, window in windows(),
        tr in windows().prop_flat_map(|w| trace(w, 4)),
    ) {
        let tb = TokenBucket { limit, window, burst, overdraft: 0, warmup: 0 };
        let gcra = Gcra { limit, window, burst, overdraft: 0, warmup: 0 };
        let meter = LeakyBucket { limit, window, burst, mode: LeakyMode::Meter };
        let mut reference = ReferenceBucket::new(limit, window, burst);
        let (mut a, mut b, mut c) = (KeyState::default(), KeyState::default(), KeyState::default());
        let mut now = START;
        let mut adm = Vec::new();
        for &(gap, cost) in &tr {
            now += gap;
            let (da, db, dc) = (tb.check(&mut a, now, cost), gcra.check(&mut b, now, cost), meter.check(&mut c, now, cost));
            let dr = reference.check(now, cost);
            prop_assert_eq!(da.allowed, dr, "token bucket vs reference at {}", now);
            prop_assert_eq!(db.allowed, dr, "gcra vs reference at {}", now);
            prop_assert_eq!(dc.allowed, dr, "leaky meter vs reference at {}", now);
            prop_assert_eq!(da.remaining, db.remaining);
            if da.allowed {
                adm.push((now, cost));
            }
        }
        assert_bucket_bound(&adm, limit, window, burst);
    }

    #[test]
    fn an_overdraft_admits_as_a_bigger_burst_and_reports_against_the_burst(
        limit in 1u64..20, burst in 1u64..30, overdraft in 0u64..10, window in windows(),
        tr in windows().prop_flat_map(|w| trace(w, 4)),
    ) {
        // A bucket of `burst` with overdraft D admits exactly what a bucket of
        // `burst + D` admits (so never more than burst + D + refill over any interval);
        // it reports what is left against `burst` alone, and flags the admissions that
        // left it in debt.
        let bigger = burst + overdraft;
        let tb = TokenBucket::new(limit, Duration::from_nanos(window)).with_burst(burst).with_overdraft(overdraft);
        let gcra = Gcra::new(limit, Duration::from_nanos(window)).with_burst(burst).with_overdraft(overdraft);
        let plain = TokenBucket::new(limit, Duration::from_nanos(window)).with_burst(bigger);
        let (mut a, mut b, mut c) = (KeyState::default(), KeyState::default(), KeyState::default());
        let mut now = START;
        let mut adm = Vec::new();
        for &(gap, cost) in &tr {
            now += gap;
            let (da, db, dp) = (tb.check(&mut a, now, cost), gcra.check(&mut b, now, cost), plain.check(&mut c, now, cost));
            prop_assert_eq!(da.allowed, dp.allowed, "token bucket vs a burst of {} at {}", bigger, now);
            prop_assert_eq!(db.allowed, dp.allowed, "gcra vs a burst of {} at {}", bigger, now);
            prop_assert_eq!(da.remaining, dp.remaining.saturating_sub(overdraft));
            prop_assert_eq!(db.remaining, da.remaining);
            prop_assert_eq!((da.reset_after, da.retry_after), (dp.reset_after, dp.retry_after));
            let flagged = dp.allowed && cost > 0 && dp.remaining < overdraft;
            prop_assert_eq!(da.overdraft, flagged);
            prop_assert_eq!(db.overdraft, flagged);
            if da.overdraft {
                prop_assert_eq!(da.remaining, 0);
            }
            if da.allowed {
                adm.push((now, cost));
            }
        }
        assert_bucket_bound(&adm, limit, window, bigger);
    }

    #[test]
    fn a_warm_up_never_admits_more_than_the_bucket_without_it(
        limit in 1u64..20, burst in 1u64..30, window in windows(),
        warmup in prop_oneof![Just(S), 1_000u64..60 * S],
        tr in windows().prop_flat_map(|w| trace(w, 4)),
        unit in any::<bool>(),
    ) {
        // The admission test is the bucket's and the instant only moves further: the
        // bucket's bound holds over any interval, the token bucket and GCRA admit the
        // same costs, and with costs of 1 (where admitting greedily admits
        // the most) never more than the bucket without warm-up, at any point of the trace.
        let w = Duration::from_nanos(window);
        let tb = TokenBucket::new(limit, w).with_burst(burst).with_warmup(Duration::from_nanos(warmup));
        let gcra = Gcra::new(limit, w).with_burst(burst).with_warmup(Duration::from_nanos(warmup));
        let plain = TokenBucket::new(limit, w).with_burst(burst);
        let (mut a, mut b, mut c) = (WarmState::default(), WarmState::default(), KeyState::default());
        let (mut again, mut now) = (WarmState::default(), START);
        let (mut warm_admitted, mut plain_admitted) = (0u64, 0u64);
        let mut adm = Vec::new();
        for &(gap, cost) in &tr {
            now += gap;
            let cost = if unit { cost.min(1) } else { cost };
            let (da, db, dp) = (tb.check_warm(&mut a, now, cost), gcra.check_warm(&mut b, now, cost), plain.check(&mut c, now, cost));
            // (A cold admission may leave the instant past the capacity, where a request
            // of cost 0 passes a token bucket, which empties, and not a GCRA.)
            if cost > 0 {
                prop_assert_eq!(da.allowed, db.allowed, "token bucket vs gcra at {}", now);
                prop_assert_eq!((da.remaining, da.reset_after), (db.remaining, db.reset_after));
            }
            // Deterministic: the same request on the same state decides the same.
            prop_assert_eq!(tb.check_warm(&mut again, now, cost), da);
            prop_assert_eq!(again, a);
            prop_assert!(!da.overdraft);
            if da.allowed {
                adm.push((now, cost));
                warm_admitted += cost;
            }
            if dp.allowed {
                plain_admitted += cost;
            }
            if unit {
                prop_assert!(warm_admitted <= plain_admitted, "{} > {} at {}", warm_admitted, plain_admitted, now);
            }
        }
        assert_bucket_bound(&adm, limit, window, burst);
    }

    #[test]
    fn fixed_window_never_exceeds_limit_per_aligned_window(
        limit in 1u64..15, window in windows(), tr in windows().prop_flat_map(|w| trace(w, 3)),
    ) {
        let fw = FixedWindow { limit, window };
        let mut st = KeyState::default();
        let adm = admitted(&run(&tr, |now, cost| fw.check(&mut st, now, cost)));
        let mut per_window = std::collections::HashMap::new();
        for (t, c) in adm {
            *per_window.entry(t / window).or_insert(0u64) += c;
        }
        prop_assert!(per_window.values().all(|&n| n <= limit));
    }

    #[test]
    fn sliding_window_stays_within_its_documented_bound(
        limit in 1u64..15, window in windows(), tr in windows().prop_flat_map(|w| trace(w, 3)),
    ) {
        let sw = SlidingWindow { limit, window };
        let mut st = WindowState::default();
        let adm = admitted(&run(&tr, |now, cost| sw.check(&mut st, now, cost)));
        let mut per_window = std::collections::HashMap::new();
        for &(t, c) in &adm {
            *per_window.entry(t / window).or_insert(0u64) += c;
        }
        prop_assert!(per_window.values().all(|&n| n <= limit), "aligned window over limit");
        prop_assert!(max_in_span(&adm, window) <= limit + MARGIN, "rolling window over limit + margin");
    }

    #[test]
    fn a_rejection_charges_nothing_and_retry_after_is_exact(
        which in 0usize..6, limit in 1u64..10, burst in 1u64..12, window in windows(),
        tr in windows().prop_flat_map(|w| trace(w, 4)),
    ) {
        // For every rejection that can pass later: the state is untouched, the same
        // request one nanosecond before `retry_after` still fails, and at it passes.
        let mut states = States::default();
        let algo: Box<AnyCheck> = match which {
            0 => Box::new(move |s, t, c| FixedWindow { limit, window }.check(&mut s.key, t, c)),
            1 => Box::new(move |s, t, c| SlidingWindow { limit, window }.check(&mut s.window, t, c)),
            2 => Box::new(move |s, t, c| SlidingLog { limit, window }.check(&mut s.log, t, c)),
            3 => Box::new(move |s, t, c| TokenBucket { limit, window, burst, overdraft: 0, warmup: 0 }.check(&mut s.key, t, c)),
            4 => Box::new(move |s, t, c| Gcra { limit, window, burst, overdraft: 0, warmup: 0 }.check(&mut s.key, t, c)),
            _ => Box::new(move |s, t, c| LeakyBucket { limit, window, burst, mode: LeakyMode::Queue }.check(&mut s.key, t, c)),
        };
        let mut now = START;
        for &(gap, cost) in &tr {
            now += gap;
            let before = states.clone();
            let d = algo(&mut states, now, cost);
            if d.allowed {
                continue;
            }
            prop_assert_eq!(states.key, before.key, "a rejection changed the state");
            prop_assert_eq!(states.window, before.window, "a rejection changed the state");
            // Pruning entries that left the window is not a charge; adding one would be.
            prop_assert!(states.log.used() <= before.log.used(), "a rejection was logged");
            if d.retry_after == NEVER {
                continue;
            }
            prop_assert!(d.retry_after > 0);
            let mut early = states.clone();
            prop_assert!(!algo(&mut early, now + d.retry_after - 1, cost).allowed, "passed before retry_after");
            let mut on_time = states.clone();
            prop_assert!(algo(&mut on_time, now + d.retry_after, cost).allowed, "failed at retry_after {}", d.retry_after);
        }
    }

    #[test]
    fn queued_requests_never_leave_faster_than_the_drain_rate(
        limit in 1u64..20, burst in 1u64..20, window in windows(),
        tr in windows().prop_flat_map(|w| trace(w, 1)),
    ) {
        let q = LeakyBucket { limit, window, burst, mode: LeakyMode::Queue };
        let mut st = KeyState::default();
        let events = run(&tr, |now, cost| q.check(&mut st, now, cost));
        let mut departures: Vec<Nanos> = events.iter()
            .filter(|e| e.2.allowed && e.1 > 0)
            .map(|e| e.0 + e.2.delay)
            .collect();
        let sorted = { let mut s = departures.clone(); s.sort_unstable(); s };
        prop_assert_eq!(&departures, &sorted, "departures out of arrival order");
        departures.dedup();
        for pair in departures.windows(2) {
            // window / limit between departures, up to the 1 ns rounding of each delay.
            prop_assert!((pair[1] - pair[0]) as u128 * limit as u128 + limit as u128 >= window as u128);
        }
        for e in events.iter().filter(|e| e.2.allowed) {
            prop_assert!(e.2.delay as u128 * limit as u128 <= (burst - e.1.min(burst)) as u128 * window as u128 + limit as u128);
        }
    }

    #[test]
    fn a_lockout_admits_nothing_until_it_ends(
        limit in 1u64..6, block_secs in 1u64..120, tr in trace(60 * S, 8),
    ) {
        // Costs up to 8 against limits of 1 to 5: some requests ask for more than the
        // limit can ever hold, and those start a lockout too.
        let fw = FixedWindow { limit, window: 60 * S };
        let lockout = Lockout::new(Duration::from_secs(block_secs));
        let (mut st, mut until) = (KeyState::default(), 0);
        // (index of the request that started it, start, end)
        let mut lockouts: Vec<(usize, Nanos, Nanos)> = Vec::new();
        let mut i = 0;
        let (mut missed_starts, mut wrong_reset) = (0, 0);
        let events = run(&tr, |now, cost| {
            let was_locked = now < until;
            let d = lockout.check(&mut until, now, limit, |t| fw.check(&mut st, t, cost));
            if !was_locked && now < until {
                lockouts.push((i, now, until));
            }
            if !was_locked && !d.allowed {
                missed_starts += usize::from(until <= now);
                wrong_reset += usize::from(d.reset_after != block_secs * S);
            }
            i += 1;
            d
        });
        for (j, (t, _, d)) in events.iter().enumerate() {
            if d.allowed {
                let inside = lockouts.iter().any(|&(k, from, to)| j > k && *t >= from && *t < to);
                prop_assert!(!inside, "request {} admitted at {} inside a lockout", j, t);
            }
        }
        prop_assert_eq!(missed_starts, 0, "a rejection did not start a lockout");
        prop_assert_eq!(wrong_reset, 0, "a rejection starting a lockout reset elsewhere");
        let lock_ends: Vec<(Nanos, Nanos)> = lockouts.iter().map(|l| (l.1, l.2)).collect();
        for &(from, to) in &lock_ends {
            prop_assert_eq!(to - from, block_secs * S);
        }
    }
}

#[test]
fn a_fixed_window_lets_twice_the_limit_through_across_a_boundary() {
    // The documented weakness: 10 per minute, 10 at 59.9 s and 10 more at 60.0 s.
    let fw = FixedWindow::new(10, Duration::from_secs(60));
    let mut st = KeyState::default();
    let before = START + 59 * S + 900_000_000;
    let after = START + 60 * S;
    let n = (0..10)
        .filter(|_| fw.check(&mut st, before, 1).allowed)
        .count()
        + (0..10)
            .filter(|_| fw.check(&mut st, after, 1).allowed)
            .count();
    assert_eq!(n, 20, "20 admitted within 100 ms");
    // A sliding log of the same numbers admits only the first 10.
    let log = SlidingLog::new(10, Duration::from_secs(60));
    let mut ls = LogState::default();
    let m = (0..10)
        .filter(|_| log.check(&mut ls, before, 1).allowed)
        .count()
        + (0..10)
            .filter(|_| log.check(&mut ls, after, 1).allowed)
            .count();
    assert_eq!(m, 10);
}
