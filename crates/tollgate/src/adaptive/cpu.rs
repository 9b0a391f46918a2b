//! The host's CPU use, for system protection: [`CpuGauge`], what reads it;
//! [`ProcStat`], Linux's `/proc/stat` sampled by a thread of its own; [`ManualCpu`],
//! readings set by hand (tests, or a caller with its own source).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// One reading of the CPU use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpuReading {
    /// The share of CPU time busy over the last period, 0 to 1 (all cores together).
    pub busy: f64,
    /// Counts the readings: a new number is a new reading.
    pub seq: u64,
}

/// A source of CPU readings.
pub trait CpuGauge: Send + Sync + 'static {
    /// The latest reading; `None` when the CPU use cannot be read (or nothing was read
    /// yet).
    fn read(&self) -> Option<CpuReading>;

    /// How many readings there have been, readable or not: the reader applies each one
    /// it missed.
    fn readings(&self) -> u64;
}

/// The latest reading, shared in one atomic word: the reading's number in the high 48
/// bits (0: nothing read yet), the busy share in ten-thousandths in the low 16
/// ([`UNREADABLE`]: the CPU could not be read). One word, so that a reader never pairs
/// one reading's share with another's number.
#[derive(Debug, Default)]
struct Latest(AtomicU64);

/// The low 16 bits of a reading the CPU use could not be read for.
const UNREADABLE: u64 = 0xFFFF;

impl Latest {
    fn set(&self, busy: Option<f64>) {
        let share = busy.map_or(UNREADABLE, |b| {
            (b.clamp(0.0, 1.0) * 10_000.0).round() as u64
        });
        let mut word = self.0.load(Ordering::Relaxed);
        loop {
            let next = ((word >> 16) + 1) << 16 | share;
            match self
                .0
                .compare_exchange_weak(word, next, Ordering::Release, Ordering::Relaxed)
            {
                Ok(_) => return,
                Err(now) => word = now,
            }
        }
    }

    fn read(&self) -> Option<CpuReading> {
        let word = self.0.load(Ordering::Acquire);
        let (seq, share) = (word >> 16, word & 0xFFFF);
        (seq > 0 && share != UNREADABLE).then(|| CpuReading {
            busy: share as f64 / 10_000.0,
            seq,
        })
    }

    /// The number of the last reading, readable or not (0: none yet).
    fn seq(&self) -> u64 {
        self.0.load(Ordering::Acquire) >> 16
    }
}

/// CPU readings set by hand.
#[derive(Debug, Clone, Default)]
pub struct ManualCpu(Arc<Latest>);

impl ManualCpu {
    /// A gauge with no reading yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A new reading: `busy` (0 to 1), or `None` for "cannot be read".
    pub fn set(&self, busy: Option<f64>) {
        self.0.set(busy);
    }
}

impl CpuGauge for ManualCpu {
    fn read(&self) -> Option<CpuReading> {
        self.0.read()
    }

    fn readings(&self) -> u64 {
        self.0.seq()
    }
}

/// The host's CPU use from `/proc/stat` (Linux), read every `period` by a thread that
/// ends when the last handle is dropped. Elsewhere, or when the file cannot be read,
/// every reading is `None`.
#[derive(Debug, Clone)]
pub struct ProcStat(Arc<Latest>);

impl ProcStat {
    /// Starts the sampling thread.
    pub fn start(period: Duration) -> std::io::Result<Self> {
        let latest = Arc::new(Latest::default());
        let weak = Arc::downgrade(&latest);
        std::thread::Builder::new()
            .name("tollgate-cpu".to_string())
            .spawn(move || sample(&weak, period))?;
        Ok(Self(latest))
    }
}

impl CpuGauge for ProcStat {
    fn read(&self) -> Option<CpuReading> {
        self.0.read()
    }

    fn readings(&self) -> u64 {
        self.0.seq()
    }
}

/// Readings in a row that may fail before the gauge says the CPU cannot be read (the
/// CPU rule then sheds nothing): a passing failure (a file descriptor short, say) keeps
/// the last reading rather than switch the rule off when it is needed most.
const FAILURES_TOLERATED: u32 = 5;

fn sample(latest: &Weak<Latest>, period: Duration) {
    // Kept open and read again from the start: no new file descriptor per reading.
    let mut file = std::fs::File::open("/proc/stat").ok();
    let mut last = read_times(&mut file);
    let mut failures = 0;
    loop {
        std::thread::sleep(period);
        let Some(latest) = latest.upgrade() else {
            return;
        };
        let now = read_times(&mut file);
        match (last, now) {
            (Some(a), Some(b)) => {
                failures = 0;
                latest.set(busy_between(a, b));
            }
            _ => {
                failures += 1;
                if failures >= FAILURES_TOLERATED {
                    latest.set(None);
                }
            }
        }
        if now.is_some() {
            last = now;
        }
    }
}

/// `/proc/stat`'s aggregate times, from `file` read again from its start (opened again
/// if it is not open).
fn read_times(file: &mut Option<std::fs::File>) -> Option<CpuTimes> {
    use std::io::{Read, Seek};
    if file.is_none() {
        *file = std::fs::File::open("/proc/stat").ok();
    }
    let f = file.as_mut()?;
    let mut text = String::new();
    let read = f
        .rewind()
        .and_then(|()| f.read_to_string(&mut text))
        .is_ok();
    if !read {
        *file = None;
        return None;
    }
    parse_proc_stat(&text)
}

/// Cumulative CPU time of all cores, in the kernel's ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTimes {
    /// Time not idle.
    pub busy: u64,
    /// All time.
    pub total: u64,
}

/// The aggregate `cpu` line of `/proc/stat`: `user nice system idle iowait irq softirq
/// steal` (guest time is counted in user time already, so it is not added); idle and
/// iowait are not busy. `None` when the line is missing or malformed.
pub fn parse_proc_stat(text: &str) -> Option<CpuTimes> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let fields: Vec<u64> = line
        .split_ascii_whitespace()
        .skip(1)
        .take(8)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    if fields.len() < 4 {
        return None;
    }
    let total = fields.iter().try_fold(0u64, |a, f| a.checked_add(*f))?;
    let idle = fields[3].checked_add(fields.get(4).copied().unwrap_or(0))?;
    Some(CpuTimes {
        busy: total.checked_sub(idle)?,
        total,
    })
}

/// The busy share between two readings; `None` when no time passed or the counters
/// went back.
pub fn busy_between(a: CpuTimes, b: CpuTimes) -> Option<f64> {
    let total = b.total.checked_sub(a.total)?;
    let busy = b.busy.checked_sub(a.busy)?;
    (total > 0).then(|| (busy as f64 / total as f64).clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_is_read_and_bad_lines_are_none() {
        let text = "cpu  100 5 50 800 40 3 2 0 7 0\ncpu0 50 2 25 400 20 1 1 0 0 0\nintr 1\n";
        let t = parse_proc_stat(text).unwrap_or(CpuTimes { busy: 0, total: 0 });
        assert_eq!(
            t,
            CpuTimes {
                busy: 160,
                total: 1000
            }
        );
        assert_eq!(parse_proc_stat("cpu0 1 2 3 4\n"), None);
        assert_eq!(parse_proc_stat("cpu  1 x 3 4\n"), None);
        assert_eq!(parse_proc_stat("cpu  1 2\n"), None);
        assert_eq!(parse_proc_stat(&format!("cpu  {} 1 0 0\n", u64::MAX)), None);
        let a = CpuTimes {
            busy: 100,
            total: 1000,
        };
        let b = CpuTimes {
            busy: 175,
            total: 1100,
        };
        assert_eq!(busy_between(a, b), Some(0.75));
        assert_eq!(busy_between(a, a), None);
        assert_eq!(busy_between(b, a), None);
    }

    #[test]
    fn manual_readings_are_numbered() {
        let cpu = ManualCpu::new();
        assert_eq!(cpu.read(), None);
        cpu.set(Some(0.5));
        let first = cpu.read();
        assert_eq!(first.map(|r| r.busy), Some(0.5));
        cpu.set(Some(1.5));
        let second = cpu.read();
        assert_eq!(second.map(|r| r.busy), Some(1.0));
        assert!(second.map(|r| r.seq) > first.map(|r| r.seq));
        cpu.set(None);
        assert_eq!(cpu.read(), None);
        assert_eq!(cpu.readings(), 3);
        cpu.set(Some(0.25));
        assert_eq!(cpu.read(), Some(CpuReading { busy: 0.25, seq: 4 }));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_hosts_proc_stat_reads() {
        let mut file = None;
        let first = read_times(&mut file);
        assert!(first.is_some_and(|t| t.total > 0 && t.busy <= t.total));
        // Read again through the file kept open.
        assert!(file.is_some());
        assert!(read_times(&mut file).is_some_and(|t| t.total >= first.map_or(0, |f| f.total)));
    }
}
