//! The final report: built from a measured phase, printed as aligned text or as one
//! JSON object.

use std::fmt::Write as _;

use hdrhistogram::Histogram;
use serde_json::{json, Value};

use crate::cli::Stop;
use crate::cpu::CpuUsage;
use crate::engine::{Counts, PhaseResult};

/// Latency percentiles in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Latency {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Maximum.
    pub max: f64,
}

impl Latency {
    /// Reads the percentiles from a histogram of nanoseconds.
    pub fn from_ns(h: &Histogram<u64>) -> Self {
        let us = |ns: u64| ns as f64 / 1000.0;
        if h.is_empty() {
            return Self::default();
        }
        Self {
            mean: h.mean() / 1000.0,
            p50: us(h.value_at_quantile(0.50)),
            p90: us(h.value_at_quantile(0.90)),
            p99: us(h.value_at_quantile(0.99)),
            p999: us(h.value_at_quantile(0.999)),
            max: us(h.max()),
        }
    }
}

/// What was run: the fixed parameters of the measured phase.
#[derive(Debug, Clone, PartialEq)]
pub struct RunInfo {
    /// `grpc`, `check` or `http`.
    pub mode: &'static str,
    /// The address or URL driven.
    pub target: String,
    /// Maximum requests in flight.
    pub concurrency: u32,
    /// Open-loop rate (requests per second), or `None` for closed loop.
    pub rate: Option<f64>,
    /// Number of distinct keys (`None` in `http` mode).
    pub keys: Option<u64>,
    /// The stop condition of the measured run.
    pub stop: Stop,
}

/// Everything the tool reports about a run.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// What was run.
    pub run: RunInfo,
    /// Wall time of the measured run, seconds.
    pub elapsed_s: f64,
    /// Requests by outcome.
    pub counts: Counts,
    /// Achieved requests per second (all outcomes).
    pub rps: f64,
    /// Latency percentiles, microseconds.
    pub latency: Latency,
    /// Open loop: requests sent more than 1 ms behind schedule.
    pub late: Option<u64>,
    /// Server CPU used during the run, if `--server-pid` was given.
    pub server_cpu: Option<CpuUsage>,
    /// The load generator's own CPU during the run (it shares the machine with the
    /// server in our benchmarks), if it could be read.
    pub load_cpu: Option<CpuUsage>,
    /// The first error seen.
    pub first_error: Option<String>,
}

impl Report {
    /// Builds the report of a measured phase.
    pub fn new(
        run: RunInfo,
        phase: &PhaseResult,
        server_cpu: Option<CpuUsage>,
        load_cpu: Option<CpuUsage>,
    ) -> Self {
        let elapsed_s = phase.elapsed.as_secs_f64();
        let total = phase.counts.total();
        let late = run.rate.map(|_| phase.late);
        Self {
            run,
            elapsed_s,
            counts: phase.counts,
            rps: if elapsed_s > 0.0 {
                total as f64 / elapsed_s
            } else {
                0.0
            },
            latency: Latency::from_ns(&phase.latency_ns),
            late,
            server_cpu,
            load_cpu,
            first_error: phase.first_error.clone(),
        }
    }

    /// Server CPU microseconds per request, if measured and any request was made.
    pub fn server_cpu_us_per_request(&self) -> Option<f64> {
        self.per_request(self.server_cpu)
    }

    /// The load generator's CPU microseconds per request, if measured.
    pub fn load_cpu_us_per_request(&self) -> Option<f64> {
        self.per_request(self.load_cpu)
    }

    fn per_request(&self, cpu: Option<CpuUsage>) -> Option<f64> {
        let total = self.counts.total();
        cpu.filter(|_| total > 0)
            .map(|c| c.time.as_secs_f64() * 1e6 / total as f64)
    }

    /// The report as one JSON object (latencies in µs, rounded to 0.1).
    pub fn to_json(&self) -> Value {
        let r1 = |x: f64| (x * 10.0).round() / 10.0;
        let (duration_s, requests_limit) = match self.run.stop {
            Stop::Duration(d) => (Some(d.as_secs_f64()), None),
            Stop::Requests(n) => (None, Some(n)),
        };
        json!({
            "mode": self.run.mode,
            "target": self.run.target,
            "concurrency": self.run.concurrency,
            "rate": self.run.rate,
            "keys": self.run.keys,
            "duration_s": duration_s,
            "requests_limit": requests_limit,
            "elapsed_s": (self.elapsed_s * 1000.0).round() / 1000.0,
            "requests": self.counts.total(),
            "ok": self.counts.ok,
            "over_limit": self.counts.over_limit,
            "other": self.counts.other,
            "errors": self.counts.errors,
            "rps": r1(self.rps),
            "latency_us": {
                "mean": r1(self.latency.mean),
                "p50": r1(self.latency.p50),
                "p90": r1(self.latency.p90),
                "p99": r1(self.latency.p99),
                "p99_9": r1(self.latency.p999),
                "max": r1(self.latency.max),
            },
            "late": self.late,
            "server_cpu_us_per_request": self.server_cpu_us_per_request().map(r1),
            "server_cpu_s": self.server_cpu.map(|c| c.time.as_secs_f64()),
            "server_cpu_source": self.server_cpu.map(|c| c.source),
            "load_cpu_us_per_request": self.load_cpu_us_per_request().map(r1),
            "load_cpu_s": self.load_cpu.map(|c| c.time.as_secs_f64()),
            "first_error": self.first_error,
        })
    }

    /// The report as human-readable text (several lines, newline-terminated).
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let c = &self.counts;
        let load = match self.run.rate {
            Some(r) => format!(
                "open loop at {r} req/s, concurrency {}",
                self.run.concurrency
            ),
            None => format!("closed loop, concurrency {}", self.run.concurrency),
        };
        let keys = self
            .run
            .keys
            .map(|k| format!(", {k} keys"))
            .unwrap_or_default();
        // `write!` to a String cannot fail.
        let _ = writeln!(out, "target       {} {}", self.run.mode, self.run.target);
        let _ = writeln!(out, "load         {load}{keys}");
        let _ = writeln!(out, "elapsed      {:.2} s", self.elapsed_s);
        let _ = writeln!(out, "requests     {}", c.total());
        let _ = writeln!(out, "  ok         {}", c.ok);
        let _ = writeln!(out, "  over limit {}", c.over_limit);
        let _ = writeln!(out, "  other      {}", c.other);
        let _ = writeln!(out, "  errors     {}", c.errors);
        let _ = writeln!(out, "throughput   {:.1} req/s", self.rps);
        let l = &self.latency;
        let _ = writeln!(
            out,
            "latency µs   p50 {:.1}  p90 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}  (mean {:.1})",
            l.p50, l.p90, l.p99, l.p999, l.max, l.mean
        );
        if let Some(late) = self.late {
            let _ = writeln!(
                out,
                "late         {late} requests sent >1 ms behind schedule"
            );
        }
        if let (Some(cpu), Some(per)) = (self.server_cpu, self.server_cpu_us_per_request()) {
            let _ = writeln!(
                out,
                "server cpu   {per:.1} µs/request ({:.3} s in total, from {})",
                cpu.time.as_secs_f64(),
                cpu.source
            );
        }
        if let (Some(cpu), Some(per)) = (self.load_cpu, self.load_cpu_us_per_request()) {
            let _ = writeln!(
                out,
                "load cpu     {per:.1} µs/request ({:.3} s in total: this tool's own)",
                cpu.time.as_secs_f64()
            );
        }
        if let Some(e) = &self.first_error {
            let _ = writeln!(out, "first error  {e}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn phase() -> Result<PhaseResult, String> {
        let mut h = Histogram::<u64>::new(3).map_err(|e| e.to_string())?;
        for i in 1..=1000u64 {
            h.record(i * 1000).map_err(|e| e.to_string())?; // 1..=1000 µs
        }
        Ok(PhaseResult {
            latency_ns: h,
            counts: Counts {
                ok: 900,
                over_limit: 90,
                other: 0,
                errors: 10,
            },
            elapsed: Duration::from_secs(2),
            late: 3,
            first_error: Some("HTTP 503 Service Unavailable".to_owned()),
        })
    }

    #[test]
    fn percentiles_and_rates() -> Result<(), String> {
        let cpu = CpuUsage {
            time: Duration::from_millis(50),
            source: "schedstat",
        };
        let run = RunInfo {
            mode: "check",
            target: "http://127.0.0.1:8080/v1/check".to_owned(),
            concurrency: 64,
            rate: Some(500.0),
            keys: Some(10_000),
            stop: Stop::Duration(Duration::from_secs(2)),
        };
        let own = CpuUsage {
            time: Duration::from_millis(20),
            source: "schedstat",
        };
        let r = Report::new(run, &phase()?, Some(cpu), Some(own));
        assert_eq!(r.rps, 500.0);
        assert!((r.latency.p50 - 500.0).abs() <= 1.0, "{:?}", r.latency);
        assert!((r.latency.p99 - 990.0).abs() <= 1.0, "{:?}", r.latency);
        assert!((r.latency.max - 1000.0).abs() <= 1.0, "{:?}", r.latency);
        assert_eq!(r.server_cpu_us_per_request(), Some(50.0));
        assert_eq!(r.load_cpu_us_per_request(), Some(20.0));

        let j = r.to_json();
        assert_eq!(j["requests"], 1000);
        assert_eq!(j["over_limit"], 90);
        assert_eq!(j["errors"], 10);
        assert_eq!(j["rps"], 500.0);
        assert_eq!(j["late"], 3);
        assert_eq!(j["server_cpu_us_per_request"], 50.0);
        assert_eq!(j["server_cpu_source"], "schedstat");
        assert_eq!(j["load_cpu_us_per_request"], 20.0);
        assert_eq!(j["load_cpu_s"], 0.02);
        assert_eq!(j["duration_s"], 2.0);
        assert!(j["requests_limit"].is_null());

        let t = r.to_text();
        assert!(t.contains("throughput   500.0 req/s"), "{t}");
        assert!(
            t.contains("open loop at 500 req/s, concurrency 64, 10000 keys"),
            "{t}"
        );
        assert!(t.contains("server cpu   50.0 µs/request"), "{t}");
        assert!(t.contains("load cpu     20.0 µs/request"), "{t}");
        assert!(t.contains("first error  HTTP 503"), "{t}");
        Ok(())
    }

    #[test]
    fn closed_loop_without_cpu() -> Result<(), String> {
        let run = RunInfo {
            mode: "http",
            target: "http://127.0.0.1:18080/".to_owned(),
            concurrency: 8,
            rate: None,
            keys: None,
            stop: Stop::Requests(1000),
        };
        let r = Report::new(run, &phase()?, None, None);
        let j = r.to_json();
        assert!(j["late"].is_null());
        assert!(j["server_cpu_us_per_request"].is_null());
        assert!(j["load_cpu_us_per_request"].is_null());
        assert_eq!(j["requests_limit"], 1000);
        let t = r.to_text();
        assert!(t.contains("closed loop, concurrency 8\n"), "{t}");
        assert!(!t.contains("server cpu"), "{t}");
        assert!(!t.contains("load cpu"), "{t}");
        Ok(())
    }

    #[test]
    fn empty_histogram_is_zero() -> Result<(), String> {
        let h = Histogram::<u64>::new(3).map_err(|e| e.to_string())?;
        assert_eq!(Latency::from_ns(&h), Latency::default());
        Ok(())
    }
}
