//! Synced counting (`consistency: synced`): each instance decides locally against the
//! last count it read from the shared store plus what it admitted since, and exchanges
//! counts with the store every `sync_interval`.
//!
//! A key's first decision on an instance is made by the shared store (it reads the key's
//! count); from then on the instance admits while `pending + in flight + cost` fits in
//! what the store last said was left (a bucket's refill since then added). Every
//! interval, one call per instance pushes every key's pending units (charged whether
//! they fit or not: they were admitted already) and reads the room of each key used in
//! the last two intervals, so that the others' admissions reach it; a key unused longer
//! is read again by its next decision, in the store.
//!
//! Between reads, an instance also counts the other instances' admissions it cannot see
//! yet, at the rate it last saw them at (what the room lost between two reads beyond its
//! own pushes): those since the read, and those the others had admitted but not pushed
//! when it was made. That delay is learned for fixed windows (how far the store's count
//! of the others' units lags behind their rate since the window began, measured while
//! the room is ample), never less than half an interval. A window's first interval gives
//! no rate sample: the fleet's first decisions in it are made in the store, at once.
//!
//! And between reads, an instance admits at most its share of the room it last saw,
//! not all of it: its share is a decayed estimate of its fraction of the key's
//! admissions across the fleet (its own pushes against what the room lost, pooled over
//! reads until the room lost `SHARE_SAMPLE` units, each sample weighing
//! `SHARE_WEIGHT`), the cap rounded up or down at random in proportion so that
//! small shares neither all round down nor all up. Every instance keeping to its share,
//! the fleet together stays within the room even when the others' rate was misjudged;
//! the price is some under-admission when the load moves between instances faster than
//! the shares follow, and on keys too slow for their shares to be measured well.
//! Over-admission is bounded by what the others admit within one interval beyond these
//! estimates. Each instance's first decision in a new fixed window is made in the store.
//!
//! A key that woke after idling (unused for [`active_for`] its interval, and not read
//! since), or that the store has not answered for in [`stale_after`] its interval (the
//! store is down or unreachable), is decided by the store again, and counted here again
//! from its answer, keeping its units not pushed yet: the others may have admitted
//! anything meanwhile. While the store stays down, the rule's failure mode decides; its
//! pending units are pushed when it answers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::lease::fingerprint;
use super::per_limit::PerLimit;
use crate::algorithm::{Algorithm, Limit};
use crate::clock::Nanos;
use crate::decision::Decision;

/// Weight of one sample in the decayed estimate of an instance's share of a key's
/// admissions.
const SHARE_WEIGHT: f64 = 0.15;
/// Units the room must have lost (over one read or several) for a sample of an
/// instance's share.
const SHARE_SAMPLE: u64 = 8;
/// Weight of one sample in the learned delay of the others' pushes.
const LAG_WEIGHT: f64 = 0.15;
/// The smallest share an instance assumes it has: one whose traffic vanished for a while
/// still admits a little (the cap's random rounding lets a unit through now and then),
/// and its pushes teach it its share again when the traffic comes back.
const MIN_SHARE: f64 = 1.0 / 256.0;

/// What an instance knows of one key.
#[derive(Debug)]
struct Entry {
    limit: Limit,
    key: Box<[u8]>,
    interval: Nanos,
    /// The room the store last reported (after every push it had seen).
    seen: u64,
    /// When it reported it (the instant the call was sent).
    seen_at: Nanos,
    /// When the key's window ends (fixed window), or when the bucket is full again.
    reset_at: Nanos,
    /// Units admitted here and not yet pushed.
    pending: u64,
    /// Units pushed, their answer not yet in.
    in_flight: u64,
    /// The room should be read at the next push even with nothing to push.
    stale: bool,
    /// When this key was last pushed or read.
    pushed_at: Nanos,
    /// When the store last answered for this key (the instant the call was sent).
    synced_at: Nanos,
    last_used: Nanos,
    /// The other instances' rate on this key (units per ns), estimated from successive
    /// reads: what the room lost beyond this instance's own pushes.
    others_rate: f64,
    /// A decayed average of `others_rate`, for learning `lag`.
    rate_avg: f64,
    /// How long the others' admissions take to reach the store's count (ns): they are
    /// counted when they push, up to an interval after they admit. Learned for fixed
    /// windows from how far the count lags behind the others' rate since the window
    /// began.
    lag: f64,
    /// This instance's share of the key's admissions across the fleet (0 to 1): a
    /// decayed estimate from its own pushes against what the room lost. `None` before
    /// the first sample.
    share: Option<f64>,
    /// Units this instance may admit until the next read: its share of the room the
    /// last read left (`u64::MAX`: no share known yet).
    cap: u64,
    /// Units admitted here since the last read.
    since_read: u64,
    /// This instance's units, and the units the room lost, over the reads not yet taken
    /// as a sample of its share.
    pooled_mine: u64,
    pooled_lost: u64,
    /// This instance's units the store counts in the key's current window (fixed
    /// window): its seeds' charges and its pushes settled in the window.
    counted: u64,
    /// The state of the random rounding of the cap.
    dice: u64,
}

impl Entry {
    fn new(limit: Limit, key: &[u8], interval: Nanos, fp: u64) -> Self {
        Self {
            limit,
            key: key.into(),
            interval,
            seen: 0,
            seen_at: 0,
            reset_at: 0,
            pending: 0,
            in_flight: 0,
            stale: false,
            pushed_at: 0,
            synced_at: 0,
            last_used: 0,
            others_rate: 0.0,
            rate_avg: 0.0,
            lag: interval as f64 / 2.0,
            share: None,
            cap: u64::MAX,
            since_read: 0,
            pooled_mine: 0,
            pooled_lost: 0,
            counted: 0,
            dice: fp,
        }
    }

    /// The room at `now`: what the store said, a bucket's refill since added. `None`
    /// when a fixed window has ended since: the new window's count is read in the store.
    fn room(&mut self, now: Nanos) -> Option<u64> {
        let base = self.base_room(now)?;
        // What the others have admitted and the store has not counted: since the count
        // was read, and before it what they had not pushed yet (their learned delay), at
        // their recent rate.
        let unseen = now.saturating_sub(self.seen_at) as f64 + self.lag;
        let others = self.others_rate * unseen;
        Some(base.saturating_sub(others as u64))
    }

    /// The room at `now` as the store last said it (a bucket's refill since added),
    /// before the others' estimated admissions.
    fn base_room(&self, now: Nanos) -> Option<u64> {
        let limit = self.limit.limit();
        match self.limit.algorithm() {
            Algorithm::FixedWindow(_) => (now < self.reset_at).then_some(self.seen),
            a => {
                let burst = match a {
                    Algorithm::TokenBucket(b) => b.burst,
                    Algorithm::Gcra(b) => b.burst,
                    Algorithm::LeakyBucket(b) => b.burst,
                    _ => limit,
                };
                let refill = u128::from(now.saturating_sub(self.seen_at)) * u128::from(limit)
                    / u128::from(self.limit.window().max(1));
                let refill = u64::try_from(refill).unwrap_or(u64::MAX);
                Some(self.seen.saturating_add(refill).min(burst))
            }
        }
    }

    /// When the current fixed window began (0 for other algorithms).
    fn window_start(&self) -> Nanos {
        match self.limit.algorithm() {
            Algorithm::FixedWindow(w) => self.reset_at.saturating_sub(w.window),
            _ => 0,
        }
    }

    /// Whether a read at `at` is in the first interval of its fixed window, where the
    /// fleet's first decisions are made in the store (charged at once, not an interval
    /// late) and the room's loss is no sample of the others' steady rate.
    fn early(&self, at: Nanos) -> bool {
        matches!(self.limit.algorithm(), Algorithm::FixedWindow(_))
            && at < self.window_start().saturating_add(self.interval)
    }

    /// A uniform draw in [0, 1), from the entry's own sequence.
    fn roll(&mut self) -> f64 {
        self.dice = self.dice.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.dice;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The store said `room` at `at`: this instance may admit its share of it until the
    /// next read (the others' admissions not counted yet taken out first), rounded up or
    /// down at random in proportion, so that small shares neither all round down nor
    /// all up.
    fn new_cap(&mut self, at: Nanos) {
        self.since_read = 0;
        let Some(share) = self.share else {
            self.cap = u64::MAX;
            return;
        };
        let room = self.room(at).unwrap_or(0) as f64;
        let u = self.roll();
        self.cap = (share * room + u).floor() as u64;
    }

    /// Learns from a read at `at` of `room` that follows the last one, in the same
    /// window: `mine` of what the room lost since was this instance's.
    fn learn(&mut self, at: Nanos, room: u64, mine: u64) {
        let Some(before) = self.base_room(at) else {
            return;
        };
        if at <= self.seen_at || self.early(self.seen_at) {
            // A window's first interval: the first decisions, made in the store, say
            // nothing of the steady rate.
            return;
        }
        let lost = before.saturating_sub(room);
        if room == 0 {
            // A key with no room left says nothing of the others' demand (they are being
            // refused, not idle) nor of the shares: the rate seen before it filled stays.
            return;
        }
        let others = lost.saturating_sub(mine);
        self.others_rate = others as f64 / (at - self.seen_at) as f64;
        // On a slow key one interval's units say little: reads are pooled until the
        // room lost enough for a sample.
        self.pooled_mine = self.pooled_mine.saturating_add(mine.min(lost));
        self.pooled_lost = self.pooled_lost.saturating_add(lost);
        let sample = (self.pooled_lost >= SHARE_SAMPLE).then(|| {
            let s = self.pooled_mine as f64 / self.pooled_lost as f64;
            self.pooled_mine = 0;
            self.pooled_lost = 0;
            s
        });
        if let Some(s) = sample {
            let share = match self.share {
                Some(old) => old + SHARE_WEIGHT * (s - old),
                None => s,
            };
            self.share = Some(share.clamp(MIN_SHARE, 1.0));
        }
        // The others' delay: their units the store counts in this window against what
        // their rate would have admitted since it began. Learned only while the room is
        // ample (nobody is being held back, so their rate is their demand's).
        if let Algorithm::FixedWindow(_) = self.limit.algorithm() {
            let total = self.limit.limit().saturating_sub(room);
            let theirs = total.saturating_sub(self.counted) as f64;
            let ample = room >= self.limit.limit() / 2;
            if ample {
                if self.rate_avg > 0.0 {
                    self.rate_avg += LAG_WEIGHT * (self.others_rate - self.rate_avg);
                } else {
                    self.rate_avg = self.others_rate;
                }
            }
            if ample && self.rate_avg > 0.0 && theirs > 0.0 {
                let since = at.saturating_sub(self.window_start()) as f64;
                let lag = (since - theirs / self.rate_avg)
                    .clamp(self.interval as f64 / 2.0, 2.0 * self.interval as f64);
                self.lag += LAG_WEIGHT * (lag - self.lag);
            }
        }
    }
}

/// How long after its last use a key's count is still read at every push (two
/// intervals); a key unused longer is read again by its next decision.
pub fn active_for(interval: Nanos) -> Nanos {
    interval.saturating_mul(2)
}

/// How long without an answer from the store a key's count is still decided on
/// locally: five intervals, at least a second.
pub fn stale_after(interval: Nanos) -> Nanos {
    interval.saturating_mul(5).max(1_000_000_000)
}

/// One key's units to push, taken by [`Syncs::due`].
#[derive(Debug, Clone)]
pub struct Push {
    fp: u64,
    /// The limit.
    pub limit: Limit,
    /// The runtime key.
    pub key: Box<[u8]>,
    /// Units admitted here since the last push (0: only read the room).
    pub units: u64,
}

/// Counters of synced counting.
#[derive(Debug, Default)]
pub struct SyncCounters {
    /// Sync calls made (each pushes every due key).
    pub calls: AtomicU64,
    /// Sync calls that failed (their units are pushed again next time).
    pub failures: AtomicU64,
    /// Units pushed.
    pub units: AtomicU64,
    /// Checks decided locally.
    pub local: AtomicU64,
    /// When the last sync call succeeded (ns since the epoch; 0: never).
    pub last_success: AtomicU64,
}

/// Every synced key of this instance.
pub struct Syncs {
    shards: Box<[Mutex<HashMap<u64, Entry>>]>,
    per_shard: usize,
    /// The counters.
    pub counters: SyncCounters,
    /// The counters per limit.
    pub(crate) per_limit: PerLimit,
}

/// What a synced check may do at `now`.
pub enum Local {
    /// Decided here.
    Decided(Decision),
    /// Decide it in the shared store, then [`Syncs::seed`] the key from the answer.
    Seed,
    /// The table is full: decide it in the shared store, as `exact`.
    Exact,
}

impl Syncs {
    /// A table of at most about `max_keys` keys.
    pub fn new(max_keys: usize) -> Self {
        let n = 16;
        Self {
            shards: (0..n).map(|_| Mutex::new(HashMap::new())).collect(),
            per_shard: (max_keys / n).max(1),
            counters: SyncCounters::default(),
            per_limit: PerLimit::default(),
        }
    }

    fn shard(&self, fp: u64) -> &Mutex<HashMap<u64, Entry>> {
        &self.shards[(fp as usize) % self.shards.len()]
    }

    /// Decides `cost` of `key` under `limit` at `now` from what this instance knows.
    pub fn decide(&self, limit: &Limit, key: &[u8], cost: u64, now: Nanos) -> Local {
        let fp = fingerprint(limit, key);
        let mut shard = self.shard(fp).lock();
        let Some(e) = shard.get_mut(&fp) else {
            return if shard.len() >= self.per_shard {
                Local::Exact
            } else {
                Local::Seed
            };
        };
        if e.limit != *limit || *e.key != *key {
            return Local::Exact;
        }
        let idle = now.saturating_sub(e.last_used);
        e.last_used = now;
        let age = now.saturating_sub(e.synced_at);
        // An active key is read at every push, so its count is at most about an interval
        // old. One that was idle, or that the store has not answered for a while (down,
        // unreachable), is decided by the store (and when it cannot, by the rule's failure
        // mode), and counted here again from its answer: the others may have admitted
        // anything meanwhile.
        let woke = idle > active_for(e.interval) && age > active_for(e.interval);
        if woke || age > stale_after(e.interval) {
            e.stale = true;
            return Local::Seed;
        }
        let Some(room) = e.room(now) else {
            // A new window: each instance's first decision in it is made in the store, so
            // that none starts the window blind to the others' admissions in it.
            e.stale = true;
            return Local::Seed;
        };
        let used = e.pending.saturating_add(e.in_flight);
        let reset = e.reset_at.saturating_sub(now);
        self.counters.local.fetch_add(1, Ordering::Relaxed);
        let fits = used.saturating_add(cost) <= room;
        let in_share = e.since_read.saturating_add(cost) <= e.cap;
        if fits && in_share {
            e.pending += cost;
            e.since_read += cost;
            let left = (room - used - cost).min(e.cap - e.since_read);
            return Local::Decided(Decision::allow(limit.limit(), left, reset));
        }
        // Over, as far as this instance knows: read the room again at the next push.
        e.stale = true;
        let retry = match limit.algorithm() {
            Algorithm::FixedWindow(_) => reset,
            _ => e.interval,
        };
        Local::Decided(Decision::reject(
            limit.limit(),
            room.saturating_sub(used),
            reset,
            retry.max(1),
        ))
    }

    /// Takes back `cost` a check admitted here, its request being rejected.
    pub fn give_back(&self, limit: &Limit, key: &[u8], cost: u64) {
        let fp = fingerprint(limit, key);
        if let Some(e) = self.shard(fp).lock().get_mut(&fp) {
            e.pending = e.pending.saturating_sub(cost);
            e.since_read = e.since_read.saturating_sub(cost);
        }
    }

    /// Starts counting `key` here, or counts it again, from the shared store's decision
    /// `d` of a call sent at `sent`, which charged the store `charged` units (0 when the
    /// request was rejected).
    pub fn seed(
        &self,
        limit: &Limit,
        key: &[u8],
        d: &Decision,
        charged: u64,
        sent: Nanos,
        interval: Nanos,
    ) {
        let fp = fingerprint(limit, key);
        let mut shard = self.shard(fp).lock();
        if let Some(e) = shard.get_mut(&fp) {
            if e.limit != *limit || *e.key != *key || sent < e.seen_at {
                return;
            }
            let reset = sent.saturating_add(d.reset_after);
            let turned = match e.limit.algorithm() {
                Algorithm::FixedWindow(w) => {
                    sent >= e.reset_at || reset.abs_diff(e.reset_at) >= w.window / 2
                }
                _ => false,
            };
            if turned {
                // A window turned: the new one's count, as the store just said. What was
                // admitted here in the old one and not pushed belongs to it, and is
                // dropped.
                e.pending = 0;
                e.counted = charged;
            } else {
                // Read again after an idle spell or a stale count: what is pending here
                // is not in the store's count yet, and stays to be pushed; the charge is
                // this instance's share of what the room lost since the last read.
                e.learn(sent, d.remaining, charged);
                e.counted = e.counted.saturating_add(charged);
            }
            e.seen = d.remaining;
            e.seen_at = sent;
            e.reset_at = reset;
            e.synced_at = sent;
            e.new_cap(sent);
            return;
        }
        if shard.len() >= self.per_shard {
            return;
        }
        let mut e = Entry::new(*limit, key, interval, fp);
        e.seen = d.remaining;
        e.seen_at = sent;
        e.reset_at = sent.saturating_add(d.reset_after);
        e.pushed_at = sent;
        e.synced_at = sent;
        e.last_used = sent;
        e.counted = charged;
        shard.insert(fp, e);
    }

    /// The keys due for a push at `now` (pending units, or a room to read again, and
    /// their interval passed); their pending units move in flight. `all`: every key
    /// with anything to push, due or not (a flush before stopping).
    pub fn due(&self, now: Nanos, all: bool) -> Vec<Push> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            for (&fp, e) in shard.lock().iter_mut() {
                if matches!(e.limit.algorithm(), Algorithm::FixedWindow(_)) && now >= e.reset_at {
                    // Units admitted in a window that has ended belong to it: pushed now,
                    // they would be charged to the next one.
                    e.pending = 0;
                }
                // Pending units, or a count to read: of a key used within the last two
                // intervals (the others' admissions must reach it), or one marked stale.
                let active = now.saturating_sub(e.last_used) <= active_for(e.interval);
                let wanted = e.pending > 0 || (!all && (e.stale || active));
                let time = all || now.saturating_sub(e.pushed_at) >= e.interval;
                if !wanted || !time || e.in_flight > 0 {
                    continue;
                }
                e.in_flight = e.pending;
                e.pending = 0;
                // Pushes keep to their schedule (one every interval on average, whatever
                // the task's tick), unless they fell a whole interval behind.
                e.pushed_at = if now.saturating_sub(e.pushed_at) < 2 * e.interval {
                    e.pushed_at + e.interval
                } else {
                    now
                };
                out.push(Push {
                    fp,
                    limit: e.limit,
                    key: e.key.clone(),
                    units: e.in_flight,
                });
            }
        }
        out
    }

    /// The store answered `d` to a push sent at `sent`: the key's room is what it said.
    pub fn settled(&self, push: &Push, d: &Decision, sent: Nanos) {
        let mut shard = self.shard(push.fp).lock();
        let Some(e) = shard.get_mut(&push.fp) else {
            return;
        };
        self.counters.units.fetch_add(push.units, Ordering::Relaxed);
        if push.units > 0 {
            self.per_limit
                .add(push.limit.id(), |s| s.units_synced += push.units);
        }
        e.in_flight = 0;
        if sent < e.seen_at {
            // The key was read since this push left (a new window's first decision):
            // that count is newer.
            return;
        }
        // A charge that did not fit is made anyway: the room after it is what was left
        // before it, less the charge.
        let room = if d.allowed {
            d.remaining
        } else {
            d.remaining.saturating_sub(push.units)
        };
        let reset = sent.saturating_add(d.reset_after);
        let same_window = match e.limit.algorithm() {
            Algorithm::FixedWindow(w) => reset.abs_diff(e.reset_at) < w.window / 2,
            _ => true,
        };
        if same_window {
            e.learn(sent, room, push.units);
            e.counted = e.counted.saturating_add(push.units);
        } else {
            e.counted = push.units;
        }
        e.seen = room;
        e.seen_at = sent;
        e.reset_at = reset;
        e.stale = false;
        e.synced_at = sent;
        e.new_cap(sent);
        // Units admitted after this push left are not in the count read.
        e.since_read = e.pending;
    }

    /// A push failed: its units are pushed again next time.
    pub fn unsettled(&self, push: &Push) {
        if let Some(e) = self.shard(push.fp).lock().get_mut(&push.fp) {
            e.pending += e.in_flight;
            e.in_flight = 0;
            e.pushed_at = 0;
        }
    }

    /// Forgets keys with nothing to push that were not used for `idle`. Returns how many
    /// are kept.
    pub fn sweep(&self, now: Nanos, idle: Nanos) -> usize {
        let mut kept = 0;
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            shard.retain(|_, e| {
                e.pending > 0 || e.in_flight > 0 || now.saturating_sub(e.last_used) < idle
            });
            kept += shard.len();
        }
        kept
    }

    /// Each limit's lag at `now`: the age of the oldest count that one of its keys in use
    /// (used within [`active_for`] its interval) is decided on. Limits with no key in use
    /// are left out.
    pub fn lag(&self, now: Nanos) -> Vec<(u64, Nanos)> {
        let mut lag: HashMap<u64, Nanos> = HashMap::new();
        for shard in self.shards.iter() {
            for e in shard.lock().values() {
                if now.saturating_sub(e.last_used) > active_for(e.interval) {
                    continue;
                }
                let age = now.saturating_sub(e.synced_at);
                let l = lag.entry(e.limit.id()).or_default();
                *l = (*l).max(age);
            }
        }
        lag.into_iter().collect()
    }

    /// Units admitted here and not yet settled with the store, over every key.
    pub fn unsettled_units(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| {
                s.lock()
                    .values()
                    .map(|e| e.pending + e.in_flight)
                    .sum::<u64>()
            })
            .sum()
    }
}
