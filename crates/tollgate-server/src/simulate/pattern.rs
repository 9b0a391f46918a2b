//! The traffic a simulation offers: the synthetic patterns (`steady`, `poisson`,
//! `bursts`, `boundary`, `ramp`) and `replay` of a CSV file, turned into a time-ordered
//! list of [`Arrival`]s on one or many keys.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use hashbrown::HashMap;
use tollgate::clock::{Nanos, NANOS_PER_SEC};

use super::SimulateError;

/// The most requests one simulation runs (every algorithm gets all of them).
pub const MAX_REQUESTS: usize = 10_000_000;
/// The largest replay file read.
pub const MAX_REPLAY_BYTES: u64 = 1 << 30;
/// The longest line of a replay file, in bytes.
pub const MAX_LINE_BYTES: usize = 4096;
/// The most distinct descriptor values (keys) in a replay file.
pub const MAX_KEYS: usize = 1_000_000;

/// A traffic pattern, as `--pattern` names it.
#[derive(Debug, Clone, PartialEq)]
pub enum Pattern {
    /// `steady:RATE`: evenly spaced, RATE a second.
    Steady {
        /// Requests a second.
        rate: f64,
    },
    /// `poisson:RATE`: random arrivals averaging RATE a second (seeded).
    Poisson {
        /// Mean requests a second.
        rate: f64,
    },
    /// `bursts:RATE:EVERY:SIZE`: steady RATE a second, plus SIZE requests at once at
    /// the start and every EVERY.
    Bursts {
        /// Background requests a second (may be 0).
        rate: f64,
        /// Time between bursts.
        every: Nanos,
        /// Requests in a burst.
        size: u64,
    },
    /// `boundary:LIMIT`: LIMIT requests in the last hundredth of a unit before each
    /// window turn and LIMIT in the first hundredth after it (the fixed window's edge).
    Boundary {
        /// Requests on each side of a turn.
        limit: u64,
    },
    /// `ramp:FROM:TO`: a rate rising (or falling) linearly from FROM to TO a second.
    Ramp {
        /// Requests a second at the start.
        from: f64,
        /// Requests a second at the end.
        to: f64,
    },
    /// `replay:FILE.csv`: lines `seconds,descriptor value[,cost]`.
    Replay {
        /// The file.
        file: PathBuf,
    },
}

/// One request of the traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrival {
    /// Nanoseconds from the start of the simulation.
    pub at: Nanos,
    /// Index into [`Traffic::keys`].
    pub key: u32,
    /// The request's cost (`hits_addend`), at least 1.
    pub cost: u32,
}

/// The traffic of a simulation: its keys and its requests in time order.
#[derive(Debug, Clone, Default)]
pub struct Traffic {
    /// The descriptor values; synthetic patterns have one (`None`: the descriptor's own).
    pub keys: Vec<Option<String>>,
    /// The requests, in time order.
    pub arrivals: Vec<Arrival>,
    /// The simulated time: the requests are before it.
    pub duration: Nanos,
}

impl std::str::FromStr for Pattern {
    type Err = SimulateError;

    fn from_str(text: &str) -> Result<Self, SimulateError> {
        let bad = |reason: String| SimulateError::Pattern {
            pattern: text.to_string(),
            reason,
        };
        let (name, rest) = text.split_once(':').unwrap_or((text, ""));
        let parts: Vec<&str> = if rest.is_empty() {
            Vec::new()
        } else {
            rest.split(':').collect()
        };
        let want = |n: usize, form: &str| {
            if parts.len() == n {
                Ok(())
            } else {
                Err(bad(format!("expected {form}")))
            }
        };
        let rate = |s: &str, zero_ok: bool| -> Result<f64, SimulateError> {
            match s.trim().parse::<f64>() {
                Ok(r) if r.is_finite() && (r > 0.0 || (zero_ok && r == 0.0)) && r <= 1e9 => Ok(r),
                _ => Err(bad(format!(
                    "`{s}` is not a rate (requests a second, {} to 1e9)",
                    if zero_ok { "0" } else { "above 0" }
                ))),
            }
        };
        let count = |s: &str| match s.trim().parse::<u64>() {
            Ok(n) if (1..=MAX_REQUESTS as u64).contains(&n) => Ok(n),
            _ => Err(bad(format!(
                "`{s}` is not a count (a whole number, 1 to {MAX_REQUESTS})"
            ))),
        };
        match name {
            "steady" => {
                want(1, "steady:RATE")?;
                Ok(Pattern::Steady {
                    rate: rate(parts[0], false)?,
                })
            }
            "poisson" => {
                want(1, "poisson:RATE")?;
                Ok(Pattern::Poisson {
                    rate: rate(parts[0], false)?,
                })
            }
            "bursts" => {
                want(3, "bursts:RATE:EVERY:SIZE")?;
                let every = parse_duration(parts[1]).map_err(bad)?;
                if every == 0 {
                    return Err(bad("EVERY must be above zero".into()));
                }
                Ok(Pattern::Bursts {
                    rate: rate(parts[0], true)?,
                    every,
                    size: count(parts[2])?,
                })
            }
            "boundary" => {
                want(1, "boundary:LIMIT")?;
                Ok(Pattern::Boundary {
                    limit: count(parts[0])?,
                })
            }
            "ramp" => {
                want(2, "ramp:FROM:TO")?;
                let (from, to) = (rate(parts[0], true)?, rate(parts[1], true)?);
                if from == 0.0 && to == 0.0 {
                    return Err(bad("FROM and TO cannot both be 0".into()));
                }
                Ok(Pattern::Ramp { from, to })
            }
            "replay" if !rest.is_empty() => Ok(Pattern::Replay {
                file: PathBuf::from(rest),
            }),
            "replay" => Err(bad("expected replay:FILE.csv".into())),
            _ => Err(bad(
                "unknown pattern; expected steady:RATE, poisson:RATE, bursts:RATE:EVERY:SIZE, \
                 boundary:LIMIT, ramp:FROM:TO or replay:FILE.csv"
                    .into(),
            )),
        }
    }
}

/// Parses a duration: a whole number with `ms`, `s`, `m`, `h` or `d` (`500ms`, `60s`,
/// `5m`); a bare number is seconds.
pub fn parse_duration(text: &str) -> Result<Nanos, String> {
    let s = text.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let bad = || format!("`{text}` is not a duration like 500ms, 60s, 5m, 2h or 1d");
    let n: u64 = n.parse().map_err(|_| bad())?;
    let per: Nanos = match unit {
        "ms" => 1_000_000,
        "s" | "" => NANOS_PER_SEC,
        "m" => 60 * NANOS_PER_SEC,
        "h" => 3_600 * NANOS_PER_SEC,
        "d" => 86_400 * NANOS_PER_SEC,
        _ => return Err(bad()),
    };
    n.checked_mul(per).ok_or_else(bad)
}

/// A small deterministic generator (SplitMix64): the same seed gives the same traffic.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform number in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn secs_to_nanos(secs: f64) -> Nanos {
    (secs * NANOS_PER_SEC as f64).round() as Nanos
}

/// Collects arrivals, refusing more than [`MAX_REQUESTS`].
struct Sink(Vec<Arrival>);

impl Sink {
    fn push(&mut self, at: Nanos, key: u32, cost: u32) -> Result<(), SimulateError> {
        if self.0.len() >= MAX_REQUESTS {
            return Err(SimulateError::TooManyRequests { max: MAX_REQUESTS });
        }
        self.0.push(Arrival { at, key, cost });
        Ok(())
    }
}

/// Refuses, before generating anything, a pattern expected to make more than
/// [`MAX_REQUESTS`] requests in `duration`.
fn check_expected(expected: f64) -> Result<(), SimulateError> {
    if expected > MAX_REQUESTS as f64 {
        Err(SimulateError::TooManyRequests { max: MAX_REQUESTS })
    } else {
        Ok(())
    }
}

impl Pattern {
    /// The traffic of this pattern over `duration` (for `replay`, `None`: up to the
    /// file's last request), for a limit whose window is `unit` long (the boundary
    /// pattern's turns), with `seed` for the random ones.
    pub fn traffic(
        &self,
        duration: Option<Nanos>,
        unit: Nanos,
        seed: u64,
    ) -> Result<Traffic, SimulateError> {
        if let Pattern::Replay { file } = self {
            return replay(file, duration);
        }
        let duration = duration.ok_or_else(|| {
            SimulateError::Duration("required for this pattern (e.g. --duration 60s)".into())
        })?;
        let d = duration as f64 / NANOS_PER_SEC as f64;
        let mut sink = Sink(Vec::new());
        match *self {
            Pattern::Steady { rate } => {
                check_expected(rate * d)?;
                steady(&mut sink, rate, duration)?;
            }
            Pattern::Poisson { rate } => {
                check_expected(rate * d)?;
                let mut rng = Rng::new(seed);
                let mut t = 0.0;
                loop {
                    t += -(1.0 - rng.next_f64()).ln() / rate;
                    let at = secs_to_nanos(t);
                    if at >= duration {
                        break;
                    }
                    sink.push(at, 0, 1)?;
                }
            }
            Pattern::Bursts { rate, every, size } => {
                let bursts = duration.div_ceil(every);
                check_expected(rate * d + (bursts as f64) * size as f64)?;
                if rate > 0.0 {
                    steady(&mut sink, rate, duration)?;
                }
                let mut at = 0;
                while at < duration {
                    for _ in 0..size {
                        sink.push(at, 0, 1)?;
                    }
                    at += every;
                }
                // Stable: at the same instant the background request comes first.
                sink.0.sort_by_key(|a| a.at);
            }
            Pattern::Boundary { limit } => {
                let edge = unit / 100;
                if edge == 0 || limit > edge {
                    return Err(SimulateError::Pattern {
                        pattern: format!("boundary:{limit}"),
                        reason: format!(
                            "{limit} requests do not fit, a nanosecond apart, in a hundredth of the unit"
                        ),
                    });
                }
                let turns = (duration.saturating_sub(edge)) / unit;
                if turns == 0 {
                    return Err(SimulateError::Duration(format!(
                        "boundary needs a window turn inside the run: make it longer than the \
                         limit's unit ({}s) plus a hundredth",
                        unit / NANOS_PER_SEC
                    )));
                }
                check_expected(2.0 * turns as f64 * limit as f64)?;
                let step = edge / limit;
                for k in 1..=turns {
                    let turn = k * unit;
                    for i in 0..limit {
                        sink.push(turn - edge + i * step, 0, 1)?;
                    }
                    for i in 0..limit {
                        sink.push(turn + i * step, 0, 1)?;
                    }
                }
            }
            Pattern::Ramp { from, to } => {
                check_expected((from + to) / 2.0 * d)?;
                // Arrival i is where the expected count FROM·t + (TO − FROM)·t²/2D
                // reaches i.
                let a = (to - from) / (2.0 * d);
                let b = from;
                let mut i = 0u64;
                loop {
                    let disc = b * b + 4.0 * a * i as f64;
                    if disc < 0.0 {
                        break;
                    }
                    let t = if i == 0 {
                        0.0
                    } else {
                        2.0 * i as f64 / (b + disc.sqrt())
                    };
                    let at = secs_to_nanos(t);
                    if !t.is_finite() || at >= duration {
                        break;
                    }
                    sink.push(at, 0, 1)?;
                    i += 1;
                }
            }
            Pattern::Replay { .. } => {}
        }
        Ok(Traffic {
            keys: vec![None],
            arrivals: sink.0,
            duration,
        })
    }
}

fn steady(sink: &mut Sink, rate: f64, duration: Nanos) -> Result<(), SimulateError> {
    let mut i = 0u64;
    loop {
        let at = secs_to_nanos(i as f64 / rate);
        if at >= duration {
            return Ok(());
        }
        sink.push(at, 0, 1)?;
        i += 1;
    }
}

/// Reads a replay file: one request a line, `seconds,value[,cost]` (seconds from the
/// start, a decimal; the descriptor's last value; a whole cost, 1 by default). Blank
/// lines, lines starting with `#` and a first line starting with `seconds` (a header)
/// are skipped. The lines need not be in time order.
fn replay(file: &Path, duration: Option<Nanos>) -> Result<Traffic, SimulateError> {
    let read_err = |source| SimulateError::ReplayRead {
        file: file.to_path_buf(),
        source,
    };
    let handle = std::fs::File::open(file).map_err(read_err)?;
    let size = handle.metadata().map_err(read_err)?.len();
    if size > MAX_REPLAY_BYTES {
        return Err(SimulateError::ReplayFile {
            file: file.to_path_buf(),
            reason: format!("{size} bytes; at most {MAX_REPLAY_BYTES} are read"),
        });
    }
    read_replay(BufReader::new(handle), file, duration, MAX_REPLAY_BYTES)
}

/// [`replay`]'s reading, from any reader: fails once more than `max_bytes` have been
/// read (every line counts, skipped or not), so a pipe or FIFO that never ends is
/// bounded too.
fn read_replay(
    reader: impl BufRead,
    file: &Path,
    duration: Option<Nanos>,
    max_bytes: u64,
) -> Result<Traffic, SimulateError> {
    let read_err = |source| SimulateError::ReplayRead {
        file: file.to_path_buf(),
        source,
    };
    let mut reader = reader.take(max_bytes + 1);
    let mut keys: Vec<Option<String>> = Vec::new();
    let mut index: HashMap<String, u32> = HashMap::new();
    let mut sink = Sink(Vec::new());
    let mut buf = Vec::new();
    let mut number = 0usize;
    let mut skipped = 0usize;
    loop {
        buf.clear();
        let n = reader
            .by_ref()
            .take(MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut buf)
            .map_err(read_err)?;
        if n == 0 {
            break;
        }
        if reader.limit() == 0 {
            return Err(SimulateError::ReplayFile {
                file: file.to_path_buf(),
                reason: format!("more than {max_bytes} bytes; at most {max_bytes} are read"),
            });
        }
        number += 1;
        let bad = |reason: String| SimulateError::ReplayLine {
            file: file.to_path_buf(),
            line: number,
            reason,
        };
        if buf.len() > MAX_LINE_BYTES && buf.last() != Some(&b'\n') {
            return Err(bad(format!("longer than {MAX_LINE_BYTES} bytes")));
        }
        let line = std::str::from_utf8(&buf)
            .map_err(|_| bad("not UTF-8 text".into()))?
            .trim();
        if line.is_empty() || line.starts_with('#') || (number == 1 && line.starts_with("seconds"))
        {
            continue;
        }
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        if !(2..=3).contains(&fields.len()) {
            return Err(bad(format!(
                "expected `seconds,value[,cost]`, got {} fields",
                fields.len()
            )));
        }
        let secs = match fields[0].parse::<f64>() {
            Ok(s) if (0.0..1e9).contains(&s) => s,
            _ => {
                return Err(bad(format!(
                    "`{}` is not a time in seconds (a number from 0)",
                    fields[0]
                )))
            }
        };
        let value = fields[1];
        if value.is_empty() {
            return Err(bad("the descriptor value is empty".into()));
        }
        let cost = match fields.get(2) {
            None => 1,
            Some(c) => match c.parse::<u32>() {
                Ok(c) if c >= 1 => c,
                _ => {
                    return Err(bad(format!(
                        "`{c}` is not a cost (a whole number, 1 to {})",
                        u32::MAX
                    )))
                }
            },
        };
        let at = secs_to_nanos(secs);
        if duration.is_some_and(|d| at >= d) {
            skipped += 1;
            continue;
        }
        let key = match index.get(value) {
            Some(&k) => k,
            None => {
                if keys.len() >= MAX_KEYS {
                    return Err(bad(format!("more than {MAX_KEYS} distinct values")));
                }
                let k = keys.len() as u32;
                keys.push(Some(value.to_string()));
                index.insert(value.to_string(), k);
                k
            }
        };
        sink.push(at, key, cost)?;
    }
    if sink.0.is_empty() {
        return Err(SimulateError::ReplayFile {
            file: file.to_path_buf(),
            reason: "no requests (lines `seconds,value[,cost]`) within the duration".into(),
        });
    }
    if skipped > 0 {
        tracing::info!(skipped, "replay lines after --duration left out");
    }
    sink.0.sort_by_key(|a| a.at);
    let last = sink.0.last().map_or(0, |a| a.at);
    let duration = duration.unwrap_or_else(|| (last / NANOS_PER_SEC + 1) * NANOS_PER_SEC);
    Ok(Traffic {
        keys,
        arrivals: sink.0,
        duration,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const S: Nanos = NANOS_PER_SEC;

    fn traffic(pattern: &str, secs: u64) -> Traffic {
        pattern
            .parse::<Pattern>()
            .unwrap()
            .traffic(Some(secs * S), S, 7)
            .unwrap()
    }

    fn per_second(t: &Traffic) -> Vec<usize> {
        let mut out = vec![0; (t.duration / S) as usize];
        for a in &t.arrivals {
            out[(a.at / S) as usize] += 1;
        }
        out
    }

    #[test]
    fn steady_makes_its_rate_every_second() {
        let t = traffic("steady:50", 10);
        assert!(
            per_second(&t).iter().all(|&n| n == 50),
            "{:?}",
            per_second(&t)
        );
        assert_eq!(t.arrivals[1].at - t.arrivals[0].at, S / 50);
    }

    #[test]
    fn poisson_averages_its_rate_and_repeats_with_its_seed() {
        let t = traffic("poisson:200", 50);
        let n = t.arrivals.len() as f64;
        assert!((n / 50.0 - 200.0).abs() < 10.0, "{n}");
        assert_eq!(t.arrivals, traffic("poisson:200", 50).arrivals);
        let other = "poisson:200"
            .parse::<Pattern>()
            .unwrap()
            .traffic(Some(50 * S), S, 8)
            .unwrap();
        assert_ne!(t.arrivals, other.arrivals);
        assert!(t.arrivals.windows(2).all(|w| w[0].at <= w[1].at));
    }

    #[test]
    fn bursts_add_their_size_at_each_turn() {
        let t = traffic("bursts:10:5s:100", 10);
        assert_eq!(t.arrivals.len(), 100 + 2 * 100);
        assert_eq!(t.arrivals.iter().filter(|a| a.at == 5 * S).count(), 101);
        assert!(t.arrivals.windows(2).all(|w| w[0].at <= w[1].at));
    }

    #[test]
    fn boundary_puts_the_limit_just_before_and_after_each_turn() {
        let t = traffic("boundary:20", 3);
        // Turns at 1 s and 2 s (3 s has no room after it).
        assert_eq!(t.arrivals.len(), 2 * 2 * 20);
        let edge = S / 100;
        for turn in [S, 2 * S] {
            let before = t
                .arrivals
                .iter()
                .filter(|a| a.at >= turn - edge && a.at < turn);
            let after = t
                .arrivals
                .iter()
                .filter(|a| a.at >= turn && a.at < turn + edge);
            assert_eq!((before.count(), after.count()), (20, 20));
        }
    }

    #[test]
    fn boundary_needs_a_turn_inside_the_run() {
        let e = "boundary:5"
            .parse::<Pattern>()
            .unwrap()
            .traffic(Some(60 * S), 60 * S, 1)
            .unwrap_err();
        assert!(e.to_string().contains("window turn"), "{e}");
    }

    #[test]
    fn ramp_goes_from_its_first_rate_to_its_last() {
        let t = traffic("ramp:10:110", 10);
        let s = per_second(&t);
        // Linear: 15, 25, ..., 105 a second; 600 in all.
        assert!(
            (t.arrivals.len() as i64 - 600).abs() <= 1,
            "{}",
            t.arrivals.len()
        );
        assert!(
            (s[0] as i64 - 15).abs() <= 1 && (s[9] as i64 - 105).abs() <= 1,
            "{s:?}"
        );
        let down = traffic("ramp:110:10", 10);
        let s = per_second(&down);
        assert!(
            (s[0] as i64 - 105).abs() <= 1 && (s[9] as i64 - 15).abs() <= 1,
            "{s:?}"
        );
    }

    #[test]
    fn bad_patterns_say_what_is_wrong() {
        for (text, words) in [
            ("sawtooth:5", "unknown pattern"),
            ("steady", "expected steady:RATE"),
            ("steady:-1", "not a rate"),
            ("steady:abc", "not a rate"),
            ("bursts:1:0s:5", "EVERY must be above zero"),
            ("bursts:1:5x:5", "not a duration"),
            ("boundary:0", "not a count"),
            ("ramp:0:0", "cannot both be 0"),
            ("replay:", "expected replay:FILE.csv"),
        ] {
            let e = text.parse::<Pattern>().unwrap_err().to_string();
            assert!(e.contains(words) && e.contains(text), "{text}: {e}");
        }
    }

    #[test]
    fn too_much_traffic_is_refused_before_it_is_made() {
        let e = "steady:1000000"
            .parse::<Pattern>()
            .unwrap()
            .traffic(Some(3600 * S), S, 1)
            .unwrap_err();
        assert!(matches!(e, SimulateError::TooManyRequests { .. }), "{e}");
    }

    fn replay_text(
        name: &str,
        text: &str,
        duration: Option<Nanos>,
    ) -> Result<Traffic, SimulateError> {
        let dir = std::env::temp_dir().join(format!("tollgate-replay-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join(name);
        std::fs::write(&file, text).unwrap();
        replay(&file, duration)
    }

    #[test]
    fn replay_reads_keys_and_costs_in_time_order() {
        let t = replay_text(
            "ok.csv",
            "seconds,user,cost\n# a comment\n1.5,alice,3\n0.25,bob\n\n2,alice\n",
            None,
        )
        .unwrap();
        assert_eq!(
            t.keys,
            vec![Some("alice".to_string()), Some("bob".to_string())]
        );
        let got: Vec<(Nanos, u32, u32)> =
            t.arrivals.iter().map(|a| (a.at, a.key, a.cost)).collect();
        assert_eq!(got, vec![(S / 4, 1, 1), (3 * S / 2, 0, 3), (2 * S, 0, 1)]);
        assert_eq!(t.duration, 3 * S);
        let cut = replay_text("cut.csv", "0,a\n5,a\n", Some(2 * S)).unwrap();
        assert_eq!(cut.arrivals.len(), 1);
    }

    #[test]
    fn replay_bounds_what_it_reads_from_a_stream_that_never_ends() {
        // Every line is past --duration, so skipped: the bound must still end it.
        let endless = std::io::BufReader::new(std::io::repeat(b'\n').take(u64::MAX));
        let lines = BufReader::new(b"5,a\n".as_slice().chain(endless));
        let e = read_replay(lines, Path::new("/dev/stdin"), Some(S), 1000)
            .unwrap_err()
            .to_string();
        assert!(e.contains("/dev/stdin: more than 1000 bytes"), "{e}");
        let endless = (0..).flat_map(|_| b"5,a\n".iter().copied());
        let lines = BufReader::new(IterRead(endless));
        let e = read_replay(lines, Path::new("pipe"), Some(S), 1000)
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than 1000 bytes"), "{e}");
        // Exactly at the bound is read.
        let t = read_replay(BufReader::new(b"0,a\n".as_slice()), Path::new("f"), None, 4);
        assert_eq!(t.unwrap().arrivals.len(), 1);
    }

    struct IterRead<I>(I);

    impl<I: Iterator<Item = u8>> Read for IterRead<I> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let mut n = 0;
            for (slot, byte) in buf.iter_mut().zip(&mut self.0) {
                *slot = byte;
                n += 1;
            }
            Ok(n)
        }
    }

    #[test]
    fn replay_names_the_file_and_line_of_a_bad_line() {
        for (text, line, words) in [
            ("0,a\nx,a\n", 2, "not a time"),
            ("0,a\n1\n", 2, "expected `seconds,value[,cost]`"),
            ("0,a,0\n", 1, "not a cost"),
            ("0,,1\n", 1, "value is empty"),
            ("-1,a\n", 1, "not a time"),
        ] {
            let e = replay_text("bad.csv", text, None).unwrap_err().to_string();
            assert!(
                e.contains(&format!("bad.csv:{line}: ")) && e.contains(words),
                "{e}"
            );
        }
        let long = format!("0,{}\n", "v".repeat(MAX_LINE_BYTES + 10));
        let e = replay_text("long.csv", &long, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("long.csv:1: longer than"), "{e}");
        let e = replay_text("empty.csv", "# nothing\n", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no requests"), "{e}");
    }
}
