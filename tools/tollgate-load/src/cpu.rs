//! CPU time of a process (the server under test, or this tool itself), read from Linux
//! `/proc`.
//!
//! Preferred source: `/proc/PID/task/*/schedstat`, whose first field is the thread's
//! CPU time in nanoseconds. It must be summed over the threads: `/proc/PID/schedstat`
//! alone only covers the main thread, which in a tokio server does almost nothing.
//! If a thread exited between the two samples its time is lost from that sum, so then
//! (or if schedstat is unavailable, or disagrees with the next source) the process
//! totals `utime + stime` from `/proc/PID/stat` are used instead. Those are in clock
//! ticks (`sysconf(_SC_CLK_TCK)`), read from the `AT_CLKTCK` entry of
//! `/proc/self/auxv` (100 if that cannot be read): 10 ms resolution, so fine over a
//! run of seconds.

use std::collections::HashMap;
use std::fs;
use std::time::Duration;

/// `AT_CLKTCK` in the ELF auxiliary vector (`<elf.h>`).
const AT_CLKTCK: usize = 17;

/// The usual Linux clock tick rate, if `/proc/self/auxv` cannot be read.
const DEFAULT_CLK_TCK: u64 = 100;

/// One reading of a process's CPU time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuSample {
    /// CPU nanoseconds per live thread id, from `schedstat` (`None` if unavailable).
    threads_ns: Option<HashMap<u32, u64>>,
    /// `utime + stime` of the whole process in clock ticks.
    ticks: u64,
}

/// CPU time used between two samples, and where it was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuUsage {
    /// The CPU time.
    pub time: Duration,
    /// `"schedstat"` (per-thread nanoseconds) or `"stat"` (clock ticks).
    pub source: &'static str,
}

/// Reads the CPU time of process `pid`.
pub fn sample(pid: u32) -> Result<CpuSample, String> {
    let stat_path = format!("/proc/{pid}/stat");
    let stat = fs::read_to_string(&stat_path).map_err(|e| {
        format!("cannot read {stat_path} (is process {pid} running, on Linux?): {e}")
    })?;
    let ticks = parse_stat_ticks(&stat).ok_or_else(|| format!("cannot parse {stat_path}"))?;
    Ok(CpuSample {
        threads_ns: read_threads_ns(pid),
        ticks,
    })
}

/// The CPU time used from `before` to `after` (see the module docs for the source).
pub fn usage(before: &CpuSample, after: &CpuSample, clk_tck: u64) -> CpuUsage {
    let tick_ns = 1_000_000_000 / clk_tck.max(1);
    let stat_ns = after.ticks.saturating_sub(before.ticks) * tick_ns;
    let stat = CpuUsage {
        time: Duration::from_nanos(stat_ns),
        source: "stat",
    };
    let (Some(b), Some(a)) = (&before.threads_ns, &after.threads_ns) else {
        return stat;
    };
    if b.keys().any(|tid| !a.contains_key(tid)) {
        return stat; // a thread exited: its time since `before` is lost from schedstat
    }
    let sched_ns: u64 = a
        .iter()
        .map(|(tid, &ns)| ns.saturating_sub(b.get(tid).copied().unwrap_or(0)))
        .sum();
    // Each ticks reading is truncated to a tick; allow for that plus 1 %.
    let tolerance = 2 * tick_ns + sched_ns.max(stat_ns) / 100;
    if sched_ns.abs_diff(stat_ns) > tolerance {
        return stat;
    }
    CpuUsage {
        time: Duration::from_nanos(sched_ns),
        source: "schedstat",
    }
}

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`), from `/proc/self/auxv`.
pub fn clock_ticks_per_second() -> u64 {
    fs::read("/proc/self/auxv")
        .ok()
        .and_then(|auxv| parse_auxv(&auxv, AT_CLKTCK))
        .map(|v| v as u64)
        .filter(|&v| v > 0)
        .unwrap_or(DEFAULT_CLK_TCK)
}

/// `utime + stime` (fields 14 and 15) from the text of `/proc/PID/stat`.
fn parse_stat_ticks(stat: &str) -> Option<u64> {
    // Field 2 is `(comm)`, which may itself contain spaces and parentheses.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11); // fields 3..=13
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// The first field of a `schedstat` file: CPU time in nanoseconds.
fn parse_schedstat_ns(schedstat: &str) -> Option<u64> {
    schedstat.split_whitespace().next()?.parse().ok()
}

/// CPU nanoseconds of each thread of `pid`; `None` if schedstat is not available.
fn read_threads_ns(pid: u32) -> Option<HashMap<u32, u64>> {
    let mut out = HashMap::new();
    for entry in fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let entry = entry.ok()?;
        let Some(tid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        match fs::read_to_string(entry.path().join("schedstat")) {
            Ok(text) => {
                out.insert(tid, parse_schedstat_ns(&text)?);
            }
            // The thread exited after the directory listing: it is not live.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(_) => return None,
        }
    }
    (!out.is_empty()).then_some(out)
}

/// The value of entry `key` in an ELF auxiliary vector (native-endian word pairs).
fn parse_auxv(auxv: &[u8], key: usize) -> Option<usize> {
    const W: usize = std::mem::size_of::<usize>();
    let word = |b: &[u8]| b.try_into().ok().map(usize::from_ne_bytes);
    auxv.chunks_exact(2 * W).find_map(|pair| {
        let (k, v) = pair.split_at(W);
        if word(k)? == key {
            word(v)
        } else {
            None
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn parses_stat_with_awkward_comm() {
        let stat = "1234 (my (weird) proc) S 1 1234 1234 0 -1 4194560 500 0 0 0 \
                    250 75 0 0 20 0 9 0 12345 1000000 300 18446744073709551615";
        assert_eq!(parse_stat_ticks(stat), Some(325));
        assert_eq!(parse_stat_ticks("garbage"), None);
    }

    #[test]
    fn parses_schedstat() {
        assert_eq!(parse_schedstat_ns("123456789 2000 30\n"), Some(123_456_789));
        assert_eq!(parse_schedstat_ns(""), None);
    }

    #[test]
    fn parses_auxv() {
        let mut auxv = Vec::new();
        for (k, v) in [(6usize, 4096usize), (AT_CLKTCK, 250), (0, 0)] {
            auxv.extend_from_slice(&k.to_ne_bytes());
            auxv.extend_from_slice(&v.to_ne_bytes());
        }
        assert_eq!(parse_auxv(&auxv, AT_CLKTCK), Some(250));
        assert_eq!(parse_auxv(&auxv, 99), None);
        assert!(clock_ticks_per_second() > 0);
    }

    /// The calling thread's CPU time (`/proc/thread-self/schedstat`, first field).
    fn thread_cpu() -> Result<Duration, String> {
        let text = std::fs::read_to_string("/proc/thread-self/schedstat")
            .map_err(|e| format!("cannot read /proc/thread-self/schedstat: {e}"))?;
        let ns = text
            .split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
            .ok_or("no run time in /proc/thread-self/schedstat")?;
        Ok(Duration::from_nanos(ns))
    }

    /// Burns CPU in a second thread: the per-thread sum sees it, and so does stat.
    /// The thread spins for 300 ms of its own CPU time (read from the kernel), not
    /// of wall time, so a busy machine cannot starve the test into failing.
    #[test]
    fn measures_own_cpu_across_threads() -> Result<(), String> {
        let clk = clock_ticks_per_second();
        let spinner = std::thread::spawn(move || -> Result<_, String> {
            let before = sample(std::process::id())?;
            let start = Instant::now();
            let mut x = 0u64;
            // Gives up after 20 s of wall time: a sampler that never sees CPU fails.
            while start.elapsed() < Duration::from_secs(20) {
                for _ in 0..100_000 {
                    x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                }
                if thread_cpu()? >= Duration::from_millis(300) {
                    break;
                }
            }
            Ok((before, sample(std::process::id())?))
        });
        let (before, after) = spinner.join().map_err(|_| "spinner panicked")??;
        let u = usage(&before, &after, clk);
        assert!(u.time >= Duration::from_millis(250), "{u:?}");
        assert!(u.time < Duration::from_secs(30), "{u:?}");
        Ok(())
    }

    #[test]
    fn falls_back_to_stat_when_a_thread_exits() {
        let before = CpuSample {
            threads_ns: Some(HashMap::from([(1, 1_000), (2, 5_000_000_000)])),
            ticks: 600,
        };
        let after = CpuSample {
            threads_ns: Some(HashMap::from([(1, 2_000_000_000)])),
            ticks: 900,
        };
        let u = usage(&before, &after, 100);
        assert_eq!(u.source, "stat");
        assert_eq!(u.time, Duration::from_secs(3));
    }

    #[test]
    fn prefers_schedstat_when_consistent() {
        let before = CpuSample {
            threads_ns: Some(HashMap::from([(1, 1_000_000_000)])),
            ticks: 100,
        };
        let after = CpuSample {
            threads_ns: Some(HashMap::from([(1, 2_234_567_891), (3, 10_000_000)])),
            ticks: 224,
        };
        let u = usage(&before, &after, 100);
        assert_eq!(u.source, "schedstat");
        assert_eq!(u.time, Duration::from_nanos(1_244_567_891));
    }

    #[test]
    fn missing_process_is_a_clear_error() {
        // PIDs are at most 2^22 on Linux.
        let e = sample(u32::MAX - 1).err().unwrap_or_default();
        assert!(e.contains("cannot read /proc/"), "{e}");
    }
}
