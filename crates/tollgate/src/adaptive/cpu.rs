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
    /// The latest reading; `None` when the CPU use cannot be read.
    fn read(&self) -> Option<CpuReading>;
}

/// The latest reading, shared: the busy share's bits (NaN: unreadable) and the
/// reading's number, each in an atomic (a reader may pair a new share with the previous
/// number, and sees the new number on its next read).
#[derive(Debug, Default)]
struct Latest {
    busy_bits: AtomicU64,
    /// 0: nothing read yet; otherwise the reading's number.
    seq: AtomicU64,
}

impl Latest {
    fn set(&self, busy: Option<f64>) {
        let bits = busy.map_or(f64::NAN, |b| b.clamp(0.0, 1.0)).to_bits();
        self.busy_bits.store(bits, Ordering::Relaxed);
        self.seq.fetch_add(1, Ordering::Release);
    }

    fn read(&self) -> Option<CpuReading> {
        let seq = self.seq.load(Ordering::Acquire);
        let busy = f64::from_bits(self.busy_bits.load(Ordering::Relaxed));
        (seq > 0 && !busy.is_nan()).then_some(CpuReading { busy, seq })
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
}

fn sample(latest: &Weak<Latest>, period: Duration) {
    let mut last = read_times();
    loop {
        std::thread::sleep(period);
        let Some(latest) = latest.upgrade() else {
            return;
        };
        let now = read_times();
        latest.set(match (last, now) {
            (Some(a), Some(b)) => busy_between(a, b),
            _ => None,
        });
        last = now;
    }
}

fn read_times() -> Option<CpuTimes> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
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
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_hosts_proc_stat_reads() {
        assert!(read_times().is_some_and(|t| t.total > 0 && t.busy <= t.total));
    }
}
