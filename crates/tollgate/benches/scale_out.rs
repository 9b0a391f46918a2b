//! The measured error curve of leased and synced counting (`consistency: leased |
//! synced`) against a real Redis.
//!
//! `INSTANCES` instances (default 4) are each a [`ScaleOut`] over a [`RedisStore`] of
//! its own (its own connection) to one `redis-server` (`REDIS_URL`), with the caller's
//! time ([`TimeSource::Caller`]) on a simulated clock: every store call the mode makes
//! (an exact decision, a lease, a seed, a sync) is decided by the real Redis scripts at
//! the simulated instant. Requests of
//! cost 1 arrive in simulated time and go to one instance each, drawn at random (seeded;
//! `SPREAD=round-robin` deals them in turn). Each configuration starts with fresh
//! instances and keys of its own.
//!
//! Configurations (every combination):
//! - algorithm: `fixed_window` of `LIMIT` (default 1000) per 1 s window, and a
//!   `token_bucket` of the same rate (burst = limit) for `leased` only (its own lines);
//! - mode: `exact` (one store call per decision), `leased` with a lease period of each
//!   of `PERIODS_MS` (default 10, 50, 100, 500, 1000 ms) and `synced` with a sync
//!   interval of each. For `synced`, each instance calls `sync(now)` at its own tick as
//!   the real maintenance task does: every `interval / 4` (at least 1 ms, at most
//!   250 ms), its ticks at a random phase;
//! - pattern: `steady` (evenly spaced, each key at a random phase) and `bursty` (bursts
//!   of a fifth of the limit at one instant, as often as the load needs);
//! - offered load: 0.5, 1, 2 and 3 times the limit, per key;
//! - keys: 1 (a hot key, `WINDOWS` windows, default 30) and 1000 (`MANY_KEYS`; each key
//!   its own limit of `MANY_LIMIT` per second, default 50, over `MANY_WINDOWS`, default
//!   3, to keep the run short: 1000 keys at 1000 per second would be a million
//!   decisions per simulated second).
//!
//! Printed per configuration (one line; the same in `OUT/curve.csv`, default
//! `target/bench-scale`):
//! - `algorithm`, `mode`, `period` (lease period or sync interval, ms; `-` for exact),
//!   `pattern`, `load` (offered, × the limit), `keys`;
//! - `max`, `min`, `med`: admitted ÷ limit in one key's 1 s window, the largest, the
//!   smallest and the median over every key and window (at load 0.5 the smallest is the
//!   demand's, not an under-admission; a token bucket may admit more than its limit in
//!   a window, its burst plus its refill);
//! - `over%`: the worst window's over-admission, % of the limit: the admitted requests of
//!   that key and window that one exact store would refuse, the admitted sequence being
//!   replayed into a fresh `MemoryStore` in time order. For the fixed window this is
//!   `admitted − limit`; for the bucket, admissions past what the bucket holds. `leased`
//!   must show 0 everywhere;
//! - `under%`, `under~%`: under-admission at load ≥ 1, the worst and the median over the
//!   windows whose demand reached the limit (demand ≥ limit: at load 1 steady a window's
//!   demand is exactly the limit), % of the limit: what one exact store fed the same
//!   requests admits in that window (a shadow `MemoryStore`; the fixed window: the whole
//!   limit) minus what the instances admitted, or 0 if they admitted more. `-` below
//!   load 1;
//! - `calls/dec`: store calls (counted by a wrapper around each `RedisStore`: lease
//!   calls, refused ones included, exact decisions, seeds and sync calls) ÷ decisions:
//!   what one instance would send on its own. Where the keys run concurrently (below),
//!   Redis's batcher packs several into one script call; the last lines compare the
//!   count with Redis's `INFO commandstats`;
//! - `expired%`: leased units that expired unspent (`ScaleOutStats::units_expired`, after
//!   a final sweep), % of the limit summed over every key and window. For the bucket a
//!   lease's units decay as the bucket refills, and much of what expires at loads under 1
//!   is refill that a full bucket would have dropped anyway: there it measures leases
//!   wasted, not under-admission;
//! - `vs_exact`: everything admitted ÷ what one exact store fed the same requests
//!   admitted (1.000: as many);
//! - `err`: store calls that failed (decisions and syncs; expected 0).
//!
//! Without syncs (`exact`, `leased`) keys never meet, so the 1000 keys run in 64 groups
//! concurrently (each key's requests still one after another in time order, decided as
//! in one timeline) so that their Redis calls overlap; `synced` runs every key in one
//! timeline, since a sync pushes every key due.
//!
//! The last lines check the issue's targets against the run: leased never over, leased
//! under-admission at steady load ≥ 1, leased store calls per decision on the hot key,
//! synced over-admission at 100 ms with 2× the limit.
//!
//! `OUT/curve.svg` plots the worst window's over- and under-admission (% of the limit)
//! against the period (log scale) for `leased` and `synced`: fixed window, steady load
//! 2× the limit, 1 key, `INSTANCES` instances.
//!
//! Filters (comma lists): `ALGORITHMS`, `MODES`, `PATTERNS`, `LOADS`, `KEYS` (a count
//! other than 1 takes the `MANY_` settings), `PERIODS_MS`. `SEED` (default 1) makes another deterministic draw. Run with
//! `bash tools/bench-scale-curve.sh` (it starts a `redis-server` of its own) or, with
//! a Redis of your own:
//!
//! ```text
//! REDIS_URL=redis://127.0.0.1:6379 cargo bench -p tollgate --features redis --bench scale_out
//! ```

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate::algorithm::{Algorithm, Consistency, FixedWindow, Limit, TokenBucket};
use tollgate::clock::{Nanos, NANOS_PER_SEC};
use tollgate::decision::Decision;
use tollgate::store::{
    Check, Error, MemoryStore, RedisStore, ScaleOut, ScaleOutStats, Store, TimeSource,
};

const MS: Nanos = 1_000_000;
/// The reporting window and the fixed window's: 1 s.
const WINDOW: Nanos = NANOS_PER_SEC;
/// A whole second, so the windows start at the run's start.
const START: Nanos = 1_700_000_000 * NANOS_PER_SEC;
const LOADS: [f64; 4] = [0.5, 1.0, 2.0, 3.0];
/// Groups of keys run concurrently where keys never meet (see `run`).
const GROUPS: usize = 64;

/// A small, seeded generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A [`RedisStore`] whose script calls are counted.
struct Counted {
    store: RedisStore,
    calls: AtomicU64,
}

impl Store for Counted {
    async fn check(&self, now: Nanos, checks: &[Check<'_>]) -> Result<Vec<Decision>, Error> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.store.check(now, checks).await
    }

    async fn check_within(
        &self,
        now: Nanos,
        checks: &[Check<'_>],
        budget: Duration,
    ) -> Result<Vec<Decision>, Error> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.store.check_within(now, checks, budget).await
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Algo {
    Window,
    Bucket,
}

impl Algo {
    fn name(self) -> &'static str {
        match self {
            Algo::Window => "fixed_window",
            Algo::Bucket => "token_bucket",
        }
    }

    fn limit(self, limit: u64) -> Limit {
        let w = Duration::from_nanos(WINDOW);
        let a = match self {
            Algo::Window => Algorithm::FixedWindow(FixedWindow::new(limit, w)),
            Algo::Bucket => Algorithm::TokenBucket(TokenBucket::new(limit, w)),
        };
        Limit::new(a).expect("a valid limit")
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Exact,
    Leased(Nanos),
    Synced(Nanos),
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Exact => "exact",
            Mode::Leased(_) => "leased",
            Mode::Synced(_) => "synced",
        }
    }

    fn period(self) -> Option<Nanos> {
        match self {
            Mode::Exact => None,
            Mode::Leased(p) | Mode::Synced(p) => Some(p),
        }
    }

    fn consistency(self) -> Consistency {
        match self {
            Mode::Exact => Consistency::Exact,
            Mode::Leased(period) => Consistency::Leased { period },
            Mode::Synced(interval) => Consistency::Synced { interval },
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Pattern {
    Steady,
    Bursty,
}

impl Pattern {
    fn name(self) -> &'static str {
        match self {
            Pattern::Steady => "steady",
            Pattern::Bursty => "bursty",
        }
    }

    /// One key's arrival instants (from 0) over `duration` at `load` × `limit` per window.
    fn arrivals(self, rng: &mut Rng, limit: u64, load: f64, duration: Nanos) -> Vec<Nanos> {
        let rate = load * limit as f64 / WINDOW as f64;
        let size = match self {
            Pattern::Steady => 1,
            Pattern::Bursty => (limit / 5).max(1),
        };
        let gap = size as f64 / rate;
        let mut out = Vec::new();
        let mut t = rng.unit() * gap;
        while (t as Nanos) < duration {
            out.extend(std::iter::repeat_n(t as Nanos, size as usize));
            t += gap;
        }
        out
    }
}

#[derive(Clone, Copy)]
struct Config {
    algo: Algo,
    mode: Mode,
    pattern: Pattern,
    load: f64,
    keys: usize,
    limit: u64,
    windows: usize,
}

/// What one configuration measured.
#[derive(Default)]
struct Outcome {
    decisions: u64,
    admitted: u64,
    exact_admitted: u64,
    ratio_max: f64,
    ratio_min: f64,
    ratio_median: f64,
    over_worst: u64,
    over_total: u64,
    /// Worst and median under-admission (units) over windows with demand ≥ limit; `None`
    /// below load 1 or when no window's demand reached the limit.
    under: Option<(u64, u64)>,
    calls: u64,
    stats: ScaleOutStats,
    errors: u64,
    seconds: f64,
}

struct Settings {
    round_robin: bool,
    seed: u64,
    prefix: String,
}

fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

fn add(a: ScaleOutStats, b: ScaleOutStats) -> ScaleOutStats {
    ScaleOutStats {
        leases_taken: a.leases_taken + b.leases_taken,
        units_leased: a.units_leased + b.units_leased,
        units_expired: a.units_expired + b.units_expired,
        units_returned: a.units_returned + b.units_returned,
        leases_refused: a.leases_refused + b.leases_refused,
        leased_local: a.leased_local + b.leased_local,
        leased_dry: a.leased_dry + b.leased_dry,
        sync_calls: a.sync_calls + b.sync_calls,
        sync_failures: a.sync_failures + b.sync_failures,
        units_synced: a.units_synced + b.units_synced,
        synced_local: a.synced_local + b.synced_local,
        last_sync: a.last_sync.max(b.last_sync),
        global_calls: a.global_calls + b.global_calls,
        global_failures: a.global_failures + b.global_failures,
        global_down: a.global_down + b.global_down,
    }
}

/// What one group of keys' requests did, per key and window (`key × windows + window`).
struct Tally {
    demand: Vec<u64>,
    admitted: Vec<u64>,
    /// What one exact store fed the same requests admitted.
    exact_admitted: Vec<u64>,
    /// Admitted requests that one exact store, fed the admitted ones, refuses.
    over: Vec<u64>,
    decisions: u64,
    errors: u64,
}

impl Tally {
    fn new(cells: usize) -> Self {
        Self {
            demand: vec![0; cells],
            admitted: vec![0; cells],
            exact_admitted: vec![0; cells],
            over: vec![0; cells],
            decisions: 0,
            errors: 0,
        }
    }

    fn merge(&mut self, other: &Tally) {
        let sum = |a: &mut Vec<u64>, b: &Vec<u64>| a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
        sum(&mut self.demand, &other.demand);
        sum(&mut self.admitted, &other.admitted);
        sum(&mut self.exact_admitted, &other.exact_admitted);
        sum(&mut self.over, &other.over);
        self.decisions += other.decisions;
        self.errors += other.errors;
    }
}

/// One request: when, which key, which instance.
#[derive(Clone, Copy)]
struct Event {
    at: Nanos,
    key: usize,
    instance: usize,
}

/// Sends `events` (in time order) to `instances`, measuring each against one exact
/// store. `ticks`: synced counting's exchange period and each instance's next tick.
async fn drive(
    instances: &[ScaleOut<Arc<Counted>>],
    limit: &Limit,
    names: &[Vec<u8>],
    windows: usize,
    events: &[Event],
    mut ticks: Option<(Nanos, Vec<Nanos>)>,
) -> Tally {
    let plain = limit.with_consistency(Consistency::Exact);
    let one_exact_store = MemoryStore::new();
    let replay = MemoryStore::new();
    let mut t = Tally::new(names.len() * windows);
    for e in events {
        let now = e.at;
        if let Some((tick, next)) = ticks.as_mut() {
            // Every instance's ticks due by now, in time order across the instances (one
            // instance's ticks running ahead of another's would let it read counts from
            // the others' future).
            while let Some((k, at)) = next
                .iter()
                .copied()
                .enumerate()
                .filter(|&(_, at)| at <= now)
                .min_by_key(|&(k, at)| (at, k))
            {
                if instances[k].sync(at).await.is_err() {
                    t.errors += 1;
                }
                next[k] = at + *tick;
            }
        }
        let cell = e.key * windows + ((now - START) / WINDOW) as usize;
        let key = &names[e.key];
        t.demand[cell] += 1;
        if one_exact_store
            .check_one(now, &Check::new(&plain, key, 1))
            .allowed
        {
            t.exact_admitted[cell] += 1;
        }
        t.decisions += 1;
        match instances[e.instance]
            .check(now, &[Check::new(limit, key, 1)])
            .await
        {
            Ok(d) if d[0].allowed => {
                t.admitted[cell] += 1;
                if !replay.check_one(now, &Check::new(&plain, key, 1)).allowed {
                    t.over[cell] += 1;
                }
            }
            Ok(_) => {}
            Err(_) => t.errors += 1,
        }
    }
    t
}

/// Runs one configuration; `tag` keeps its Redis keys apart from the others'.
fn run(
    rt: &tokio::runtime::Runtime,
    stores: &[Arc<Counted>],
    cfg: &Config,
    settings: &Settings,
    tag: usize,
) -> Outcome {
    let started = Instant::now();
    let limit = cfg
        .algo
        .limit(cfg.limit)
        .with_consistency(cfg.mode.consistency());
    let windows = cfg.windows;
    let duration = windows as Nanos * WINDOW;
    let mut rng = Rng(settings.seed
        ^ (cfg.load * 1000.0) as u64
        ^ (cfg.pattern as u64) << 20
        ^ (cfg.keys as u64) << 32);
    let names: Vec<Vec<u8>> = (0..cfg.keys)
        .map(|k| format!("{}:c{tag}:k{k}", settings.prefix).into_bytes())
        .collect();
    let mut events: Vec<Event> = Vec::new();
    for key in 0..cfg.keys {
        for at in cfg
            .pattern
            .arrivals(&mut rng, cfg.limit, cfg.load, duration)
        {
            events.push(Event {
                at: START + at,
                key,
                instance: 0,
            });
        }
    }
    events.sort_unstable_by_key(|e| (e.at, e.key));
    let n = stores.len();
    for (turn, e) in events.iter_mut().enumerate() {
        e.instance = if settings.round_robin {
            turn % n
        } else {
            rng.below(n as u64) as usize
        };
    }

    let instances: Vec<ScaleOut<Arc<Counted>>> = stores
        .iter()
        .map(|s| ScaleOut::new(Arc::clone(s)))
        .collect();
    let calls_before: u64 = stores.iter().map(|s| s.calls.load(Ordering::Relaxed)).sum();
    let tally = match cfg.mode {
        Mode::Synced(interval) => {
            // Synced counting's exchanges, at each instance's tick (as
            // `ScaleOut::maintain`), in one timeline with every key's requests: a sync
            // pushes every key due.
            let tick = (interval / 4).clamp(MS, 250 * MS);
            let next = (0..n).map(|_| START + rng.below(tick)).collect();
            rt.block_on(drive(
                &instances,
                &limit,
                &names,
                windows,
                &events,
                Some((tick, next)),
            ))
        }
        _ => {
            // Without syncs, keys never meet (their leases, their Redis keys): each group
            // of keys runs its own timeline, the groups concurrently, so that their Redis
            // calls overlap. Each key still sees its requests one after another, in time
            // order, as in one timeline.
            let groups = GROUPS.min(cfg.keys);
            let parts: Vec<Vec<Event>> = (0..groups)
                .map(|g| {
                    events
                        .iter()
                        .filter(|e| e.key % groups == g)
                        .copied()
                        .collect()
                })
                .collect();
            let tallies = rt.block_on(futures_util::future::join_all(
                parts
                    .iter()
                    .map(|part| drive(&instances, &limit, &names, windows, part, None)),
            ));
            let mut all = Tally::new(cfg.keys * windows);
            for t in &tallies {
                all.merge(t);
            }
            all
        }
    };
    let mut out = Outcome {
        decisions: tally.decisions,
        errors: tally.errors,
        ..Outcome::default()
    };
    // Whatever is still in hand expires unspent.
    let end = START + duration + 2 * WINDOW;
    for i in &instances {
        i.sweep(end);
        out.stats = add(out.stats, i.stats());
    }
    let calls_after: u64 = stores.iter().map(|s| s.calls.load(Ordering::Relaxed)).sum();
    out.calls = calls_after - calls_before;

    let cap = cfg.limit;
    let mut ratios: Vec<u64> = tally.admitted.clone();
    out.ratio_max = ratios.iter().copied().max().unwrap_or(0) as f64 / cap as f64;
    out.ratio_min = ratios.iter().copied().min().unwrap_or(0) as f64 / cap as f64;
    out.ratio_median = median(&mut ratios) as f64 / cap as f64;
    out.admitted = tally.admitted.iter().sum();
    out.exact_admitted = tally.exact_admitted.iter().sum();
    out.over_worst = tally.over.iter().copied().max().unwrap_or(0);
    out.over_total = tally.over.iter().sum();
    if cfg.load >= 1.0 {
        let mut under: Vec<u64> = (0..cfg.keys * windows)
            .filter(|&c| tally.demand[c] >= cap)
            .map(|c| tally.exact_admitted[c].saturating_sub(tally.admitted[c]))
            .collect();
        if !under.is_empty() {
            let worst = under.iter().copied().max().unwrap_or(0);
            out.under = Some((worst, median(&mut under)));
        }
    }
    out.seconds = started.elapsed().as_secs_f64();
    out
}

fn pct(units: u64, of: u64) -> f64 {
    100.0 * units as f64 / of.max(1) as f64
}

fn period_label(mode: Mode) -> String {
    mode.period()
        .map_or_else(|| "-".to_owned(), |p| (p / MS).to_string())
}

const HEADER: &str = "algorithm     mode    period pattern load keys   max   min   med  over%  under% under~% calls/dec expired% vs_exact err";

fn line(cfg: &Config, o: &Outcome) -> String {
    let (under, under_med) = match o.under {
        Some((w, m)) => (
            format!("{:.2}", pct(w, cfg.limit)),
            format!("{:.2}", pct(m, cfg.limit)),
        ),
        None => ("-".to_owned(), "-".to_owned()),
    };
    let budget = cfg.limit * (cfg.keys * cfg.windows) as u64;
    format!(
        "{:<13} {:<7} {:>6} {:<7} {:>4} {:>4} {:>5.3} {:>5.3} {:>5.3} {:>6.2} {:>7} {:>7} {:>9.4} {:>8.2} {:>8.3} {:>3}",
        cfg.algo.name(),
        cfg.mode.name(),
        period_label(cfg.mode),
        cfg.pattern.name(),
        cfg.load,
        cfg.keys,
        o.ratio_max,
        o.ratio_min,
        o.ratio_median,
        pct(o.over_worst, cfg.limit),
        under,
        under_med,
        o.calls as f64 / o.decisions.max(1) as f64,
        pct(o.stats.units_expired, budget),
        o.admitted as f64 / o.exact_admitted.max(1) as f64,
        o.errors,
    )
}

const CSV_HEADER: &str = "algorithm,mode,period_ms,pattern,load,keys,instances,limit,windows,\
decisions,admitted,exact_admitted,max_ratio,min_ratio,median_ratio,over_worst_units,\
over_worst_pct,over_total_units,under_worst_pct,under_median_pct,redis_calls,\
calls_per_decision,units_expired,expired_pct,leases_taken,units_leased,leases_refused,\
sync_calls,errors,seconds";

fn csv_row(cfg: &Config, o: &Outcome, instances: usize) -> String {
    let budget = cfg.limit * (cfg.keys * cfg.windows) as u64;
    let (under, under_med) = match o.under {
        Some((w, m)) => (
            format!("{:.3}", pct(w, cfg.limit)),
            format!("{:.3}", pct(m, cfg.limit)),
        ),
        None => (String::new(), String::new()),
    };
    format!(
        "{},{},{},{},{},{},{},{},{},{},{},{},{:.4},{:.4},{:.4},{},{:.3},{},{},{},{},{:.6},{},{:.3},{},{},{},{},{},{:.2}",
        cfg.algo.name(),
        cfg.mode.name(),
        cfg.mode.period().map_or(String::new(), |p| (p / MS).to_string()),
        cfg.pattern.name(),
        cfg.load,
        cfg.keys,
        instances,
        cfg.limit,
        cfg.windows,
        o.decisions,
        o.admitted,
        o.exact_admitted,
        o.ratio_max,
        o.ratio_min,
        o.ratio_median,
        o.over_worst,
        pct(o.over_worst, cfg.limit),
        o.over_total,
        under,
        under_med,
        o.calls,
        o.calls as f64 / o.decisions.max(1) as f64,
        o.stats.units_expired,
        pct(o.stats.units_expired, budget),
        o.stats.leases_taken,
        o.stats.units_leased,
        o.stats.leases_refused,
        o.stats.sync_calls,
        o.errors,
        o.seconds,
    )
}

/// One line of the plot.
struct Series {
    label: &'static str,
    color: &'static str,
    dash: &'static str,
    marker: Marker,
    points: Vec<(f64, f64)>,
}

#[derive(Clone, Copy)]
enum Marker {
    Circle,
    Square,
    Triangle,
    Diamond,
}

/// The smallest of 1, 2, 2.5, 5 × 10^k at least `x`.
fn nice_ceil(x: f64) -> f64 {
    let p = 10f64.powf(x.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|&v| v >= x)
        .unwrap_or(10.0 * p)
}

fn marker(svg: &mut String, m: Marker, x: f64, y: f64, color: &str) {
    let r = 4.5;
    let _ = match m {
        Marker::Circle => writeln!(
            svg,
            r#"<circle cx="{x:.1}" cy="{y:.1}" r="{r}" fill="{color}"/>"#
        ),
        Marker::Square => writeln!(
            svg,
            r#"<rect x="{:.1}" y="{:.1}" width="{}" height="{}" fill="white" stroke="{color}" stroke-width="2"/>"#,
            x - r,
            y - r,
            2.0 * r,
            2.0 * r
        ),
        Marker::Triangle => writeln!(
            svg,
            r#"<path d="M{:.1},{:.1} L{:.1},{:.1} L{:.1},{:.1} Z" fill="{color}"/>"#,
            x,
            y - r - 1.0,
            x - r - 1.0,
            y + r,
            x + r + 1.0,
            y + r
        ),
        Marker::Diamond => writeln!(
            svg,
            r#"<path d="M{:.1},{:.1} L{:.1},{:.1} L{:.1},{:.1} L{:.1},{:.1} Z" fill="white" stroke="{color}" stroke-width="2"/>"#,
            x,
            y - r - 1.5,
            x + r + 1.5,
            y,
            x,
            y + r + 1.5,
            x - r - 1.5,
            y
        ),
    };
}

/// A line plot, % of the limit against the period on a log axis, as SVG text.
fn plot(title: &str, subtitle: &str, series: &[Series]) -> String {
    let (width, height) = (820.0, 500.0);
    let (left, right, top, bottom) = (80.0, 600.0, 70.0, 430.0);
    let (x_lo, x_hi) = (8f64.log10(), 1250f64.log10());
    let highest = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(1.0f64, f64::max);
    // About five gridlines, at a round step.
    let step = nice_ceil(highest * 1.05 / 5.0);
    let lines = (highest * 1.05 / step).ceil().max(1.0) as u32;
    let y_max = step * f64::from(lines);
    let x = |ms: f64| left + (ms.log10() - x_lo) / (x_hi - x_lo) * (right - left);
    let y = |v: f64| bottom - v / y_max * (bottom - top);
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="13">"#
    );
    let _ = writeln!(
        svg,
        r#"<rect width="{width}" height="{height}" fill="white"/>"#
    );
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="28" text-anchor="middle" font-size="17" font-weight="bold">{title}</text>"#,
        (left + right) / 2.0
    );
    let _ = writeln!(
        svg,
        r##"<text x="{}" y="50" text-anchor="middle" fill="#444">{subtitle}</text>"##,
        (left + right) / 2.0
    );
    // Horizontal grid and the y axis's labels.
    for n in 0..=lines {
        let v = step * f64::from(n);
        let yy = y(v);
        let _ = writeln!(
            svg,
            r##"<line x1="{left}" y1="{yy:.1}" x2="{right}" y2="{yy:.1}" stroke="#ddd"/>"##
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            left - 8.0,
            yy + 4.0,
            trim(v)
        );
    }
    // Vertical grid at the periods and the x axis's labels.
    for ms in [10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0] {
        let xx = x(ms);
        let _ = writeln!(
            svg,
            r##"<line x1="{xx:.1}" y1="{top}" x2="{xx:.1}" y2="{bottom}" stroke="#ddd"/>"##
        );
        let _ = writeln!(
            svg,
            r#"<text x="{xx:.1}" y="{:.1}" text-anchor="middle">{ms}</text>"#,
            bottom + 20.0
        );
    }
    // The 1 % target.
    if y_max > 1.0 {
        let yy = y(1.0);
        let _ = writeln!(
            svg,
            r##"<line x1="{left}" y1="{yy:.1}" x2="{right}" y2="{yy:.1}" stroke="#2a2" stroke-dasharray="2 4" stroke-width="1.5"/>"##
        );
        let _ = writeln!(
            svg,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="#2a2" font-size="11">1 % target</text>"##,
            right - 4.0,
            yy - 4.0
        );
    }
    let _ = writeln!(
        svg,
        r#"<rect x="{left}" y="{top}" width="{}" height="{}" fill="none" stroke="black"/>"#,
        right - left,
        bottom - top
    );
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">lease period / sync interval (ms, log scale)</text>"#,
        (left + right) / 2.0,
        bottom + 48.0
    );
    let _ = writeln!(
        svg,
        r#"<text transform="translate(24 {}) rotate(-90)" text-anchor="middle">% of the limit, worst 1 s window</text>"#,
        (top + bottom) / 2.0
    );
    for s in series {
        let path: Vec<String> = s
            .points
            .iter()
            .map(|&(ms, v)| format!("{:.1},{:.1}", x(ms), y(v)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2.5" stroke-dasharray="{}"/>"#,
            path.join(" "),
            s.color,
            s.dash
        );
        for &(ms, v) in &s.points {
            marker(&mut svg, s.marker, x(ms), y(v), s.color);
        }
    }
    // The legend, right of the plot, with each line's values.
    let mut ly = top + 10.0;
    for s in series {
        let lx = right + 20.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{}" stroke-width="2.5" stroke-dasharray="{}"/>"#,
            lx + 34.0,
            s.color,
            s.dash
        );
        marker(&mut svg, s.marker, lx + 17.0, ly, s.color);
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}">{}</text>"#,
            lx + 42.0,
            ly + 4.0,
            s.label
        );
        ly += 6.0;
        for &(ms, v) in &s.points {
            ly += 15.0;
            let _ = writeln!(
                svg,
                r##"<text x="{}" y="{ly}" font-size="11" fill="#444">{ms} ms: {v:.2} %</text>"##,
                lx + 42.0
            );
        }
        ly += 26.0;
    }
    svg.push_str("</svg>\n");
    svg
}

/// Prints the issue's targets as the run measured them.
fn targets(results: &[(Config, Outcome)], instances: usize) {
    let leased = || {
        results
            .iter()
            .filter(|(c, _)| matches!(c.mode, Mode::Leased(_)))
    };
    if leased().next().is_some() {
        let over: Vec<String> = leased()
            .filter(|(_, o)| o.over_total > 0)
            .map(|(c, o)| {
                format!(
                    "{} {} ms {} {}x {} keys: {}",
                    c.algo.name(),
                    period_label(c.mode),
                    c.pattern.name(),
                    c.load,
                    c.keys,
                    o.over_total
                )
            })
            .collect();
        println!(
            "# target leased, 0 over-admission in every run: {} ({} runs{})",
            if over.is_empty() { "met" } else { "MISSED" },
            leased().count(),
            if over.is_empty() {
                String::new()
            } else {
                format!("; over: {}", over.join(", "))
            }
        );
        let steady: Vec<&(Config, Outcome)> = leased()
            .filter(|(c, o)| c.pattern == Pattern::Steady && c.load >= 1.0 && o.under.is_some())
            .collect();
        let missed: Vec<String> = steady
            .iter()
            .filter_map(|(c, o)| {
                let worst = pct(o.under?.0, c.limit);
                (worst > 1.0).then(|| {
                    format!(
                        "{} {} ms {}x {} key(s): {worst:.1} %",
                        c.algo.name(),
                        period_label(c.mode),
                        c.load,
                        c.keys
                    )
                })
            })
            .collect();
        println!(
            "# target leased, under-admission ≤ 1 % at steady load ≥ 1 (worst window): {} of {} runs met{}",
            steady.len() - missed.len(),
            steady.len(),
            if missed.is_empty() { String::new() } else { format!("; over 1 %: {}", missed.join(", ")) }
        );
        for algo in [Algo::Window, Algo::Bucket] {
            let hot: Vec<(String, f64)> = leased()
                .filter(|(c, _)| c.algo == algo && c.keys == 1)
                .map(|(c, o)| {
                    (
                        format!(
                            "{} ms {} {}x",
                            period_label(c.mode),
                            c.pattern.name(),
                            c.load
                        ),
                        o.calls as f64 / o.decisions.max(1) as f64,
                    )
                })
                .collect();
            if hot.is_empty() {
                continue;
            }
            let met = hot.iter().filter(|h| h.1 <= 0.01).count();
            let least = hot
                .iter()
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .map(|h| format!("{:.4} ({})", h.1, h.0));
            let most = hot
                .iter()
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .map(|h| format!("{:.4} ({})", h.1, h.0));
            println!(
                "# target leased, ≤ 0.01 store calls per decision on a hot key, {}: {met} of {} runs met; least {}, most {}",
                algo.name(),
                hot.len(),
                least.unwrap_or_default(),
                most.unwrap_or_default()
            );
        }
    }
    let synced: Vec<String> = results
        .iter()
        .filter(|(c, _)| c.mode == Mode::Synced(100 * MS) && c.load == 2.0)
        .map(|(c, o)| {
            let v = pct(o.over_worst, c.limit);
            format!(
                "{} {} key(s): {v:.1} % ({})",
                c.pattern.name(),
                c.keys,
                if v <= 1.0 { "met" } else { "MISSED" }
            )
        })
        .collect();
    if !synced.is_empty() {
        println!(
            "# target synced, over-admission ≤ 1 % at 100 ms, {instances} instances, 2x the limit (worst window): {}",
            synced.join("; ")
        );
    }
}

fn trim(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A comma list of the environment variable `name`, or `None` when unset or empty.
fn list(name: &str) -> Option<Vec<String>> {
    let v = std::env::var(name).ok()?;
    let items: Vec<String> = v
        .split(',')
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect();
    (!items.is_empty()).then_some(items)
}

fn numbers<T: std::str::FromStr + Copy>(name: &str, default: &[T]) -> Vec<T> {
    list(name).map_or_else(
        || default.to_vec(),
        |items| {
            items
                .iter()
                .map(|s| {
                    s.parse()
                        .unwrap_or_else(|_| panic!("{name}: {s:?} is not a number"))
                })
                .collect()
        },
    )
}

fn wanted(name: &str, item: &str) -> bool {
    list(name).is_none_or(|items| items.iter().any(|i| i == item))
}

/// Script calls Redis ran (`INFO commandstats`: `fcall` and `evalsha`), or `None`.
fn redis_script_calls(url: &str) -> Option<u64> {
    let addr = url.strip_prefix("redis://")?.trim_end_matches('/');
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(b"INFO commandstats\r\n").ok()?;
    let mut out = Vec::new();
    let mut buf = [0u8; 16_384];
    // A bulk reply: `$<len>\r\n<body>\r\n`.
    loop {
        let n = s.read(&mut buf).ok()?;
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&out);
        if let Some((head, body)) = text.split_once("\r\n") {
            let len: usize = head.trim_start_matches('$').parse().ok()?;
            if body.len() >= len {
                break;
            }
        }
    }
    let text = String::from_utf8_lossy(&out);
    let calls = |cmd: &str| -> u64 {
        let needle = format!("cmdstat_{cmd}:calls=");
        text.lines()
            .find_map(|l| l.strip_prefix(needle.as_str()))
            .and_then(|r| r.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    Some(calls("fcall") + calls("evalsha"))
}

fn main() {
    // `cargo bench` passes `--bench`; there is nothing else to parse.
    let url = std::env::var("REDIS_URL")
        .expect("REDIS_URL (redis://HOST:PORT) is required: run tools/bench-scale-curve.sh");
    let instances = env("INSTANCES", 4).max(1) as usize;
    let settings = Settings {
        round_robin: std::env::var("SPREAD").is_ok_and(|s| s == "round-robin"),
        seed: env("SEED", 1),
        prefix: format!("bench-scale-{}", std::process::id()),
    };
    let limit = env("LIMIT", 1000);
    let windows = env("WINDOWS", 30) as usize;
    let many_keys = env("MANY_KEYS", 1000) as usize;
    let many_limit = env("MANY_LIMIT", 50);
    let many_windows = env("MANY_WINDOWS", 3) as usize;
    let periods: Vec<u64> = numbers("PERIODS_MS", &[10, 50, 100, 500, 1000]);
    let loads: Vec<f64> = numbers("LOADS", &LOADS);
    let key_counts: Vec<usize> = numbers("KEYS", &[1, many_keys]);
    let out_dir = std::env::var("OUT").map_or_else(
        |_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/bench-scale"),
        PathBuf::from,
    );
    std::fs::create_dir_all(&out_dir).expect("create the OUT directory");

    let mut configs = Vec::new();
    for &keys in &key_counts {
        let (limit, windows) = if keys == 1 {
            (limit, windows)
        } else {
            (many_limit, many_windows)
        };
        for algo in [Algo::Window, Algo::Bucket] {
            if !wanted("ALGORITHMS", algo.name()) {
                continue;
            }
            let mut modes = Vec::new();
            if algo == Algo::Window {
                modes.push(Mode::Exact);
            }
            modes.extend(periods.iter().map(|&p| Mode::Leased(p * MS)));
            if algo == Algo::Window {
                modes.extend(periods.iter().map(|&p| Mode::Synced(p * MS)));
            }
            for mode in modes {
                if !wanted("MODES", mode.name()) {
                    continue;
                }
                for pattern in [Pattern::Steady, Pattern::Bursty] {
                    if !wanted("PATTERNS", pattern.name()) {
                        continue;
                    }
                    for &load in &loads {
                        configs.push(Config {
                            algo,
                            mode,
                            pattern,
                            load,
                            keys,
                            limit,
                            windows,
                        });
                    }
                }
            }
        }
    }

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let stores: Vec<Arc<Counted>> = (0..instances)
        .map(|_| {
            let store = rt
                .block_on(
                    RedisStore::builder(url.clone())
                        .prefix(settings.prefix.clone())
                        .time_source(TimeSource::Caller)
                        .ttl_slack(Duration::from_secs(3600))
                        .blocked_cache(0)
                        .deadline(Duration::from_secs(2))
                        .circuit_breaker(1_000, Duration::from_millis(10))
                        .connect(),
                )
                .expect("connect to REDIS_URL");
            Arc::new(Counted {
                store,
                calls: AtomicU64::new(0),
            })
        })
        .collect();
    let redis_before = redis_script_calls(&url);

    let csv_path = out_dir.join("curve.csv");
    let mut csv = std::fs::File::create(&csv_path).expect("create curve.csv");
    writeln!(csv, "{CSV_HEADER}").expect("write curve.csv");
    println!(
        "# {instances} instances, each a ScaleOut over its own RedisStore connection to {url}; \
         {} spread; 1 key: {limit}/s over {windows} windows; {many_keys} keys: {many_limit}/s \
         each over {many_windows} windows; cost 1; seed {}",
        if settings.round_robin {
            "round-robin"
        } else {
            "random"
        },
        settings.seed
    );
    println!("# ratios: admitted ÷ limit per key and 1 s window; %: of the limit; see benches/scale_out.rs");
    println!("{HEADER}");
    let started = Instant::now();
    let mut results: Vec<(Config, Outcome)> = Vec::new();
    let mut section = None;
    for (n, cfg) in configs.iter().enumerate() {
        if section != Some((cfg.keys, cfg.algo)) {
            if section.is_some() {
                println!();
            }
            section = Some((cfg.keys, cfg.algo));
        }
        let o = run(&rt, &stores, cfg, &settings, n);
        println!("{}", line(cfg, &o));
        writeln!(csv, "{}", csv_row(cfg, &o, instances)).expect("write curve.csv");
        eprintln!(
            "[{}/{}] {:.1}s (total {:.0}s): {} {} {} {} {}x {} key(s), {} decisions, {} Redis calls",
            n + 1,
            configs.len(),
            o.seconds,
            started.elapsed().as_secs_f64(),
            cfg.algo.name(),
            cfg.mode.name(),
            period_label(cfg.mode),
            cfg.pattern.name(),
            cfg.load,
            cfg.keys,
            o.decisions,
            o.calls
        );
        results.push((*cfg, o));
    }
    let counted: u64 = stores.iter().map(|s| s.calls.load(Ordering::Relaxed)).sum();
    let redis_ran = redis_before
        .zip(redis_script_calls(&url))
        .map(|(a, b)| b - a);
    println!(
        "# Redis script calls: {counted} counted by the wrapper, {} in INFO commandstats (fcall + evalsha); {:.0} s",
        redis_ran.map_or_else(|| "unknown".to_owned(), |n| n.to_string()),
        started.elapsed().as_secs_f64()
    );

    targets(&results, instances);

    // The plot: fixed window, steady, 2× the limit, 1 key.
    let pick = |mode: &str, over: bool| -> Vec<(f64, f64)> {
        results
            .iter()
            .filter(|(c, _)| {
                c.algo == Algo::Window
                    && c.mode.name() == mode
                    && c.pattern == Pattern::Steady
                    && c.load == 2.0
                    && c.keys == 1
            })
            .filter_map(|(c, o)| {
                let ms = c.mode.period()? as f64 / MS as f64;
                let v = if over {
                    pct(o.over_worst, c.limit)
                } else {
                    pct(o.under?.0, c.limit)
                };
                Some((ms, v))
            })
            .collect()
    };
    let series = vec![
        Series {
            label: "leased: over",
            color: "#1f5fb4",
            dash: "none",
            marker: Marker::Circle,
            points: pick("leased", true),
        },
        Series {
            label: "leased: under",
            color: "#1f5fb4",
            dash: "7 4",
            marker: Marker::Square,
            points: pick("leased", false),
        },
        Series {
            label: "synced: over",
            color: "#c8281e",
            dash: "none",
            marker: Marker::Triangle,
            points: pick("synced", true),
        },
        Series {
            label: "synced: under",
            color: "#c8281e",
            dash: "7 4",
            marker: Marker::Diamond,
            points: pick("synced", false),
        },
    ];
    let svg_path = out_dir.join("curve.svg");
    if series.iter().any(|s| !s.points.is_empty()) {
        let svg = plot(
            "Over- and under-admission against the period",
            &format!(
                "fixed window {limit}/s, {instances} instances on one Redis, steady load 2× the limit, 1 key, worst of {windows} windows"
            ),
            &series,
        );
        std::fs::write(&svg_path, svg).expect("write curve.svg");
        println!("# {} and {}", csv_path.display(), svg_path.display());
    } else {
        println!(
            "# {} (no plot: the run had no steady 2× 1-key leased or synced line)",
            csv_path.display()
        );
    }
}
