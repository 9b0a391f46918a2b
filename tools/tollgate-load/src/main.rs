//! `tollgate-load`: a load generator for `tollgate serve` (Envoy's rate limit gRPC
//! API or the JSON `/v1/check` API) and for any HTTP URL. It keeps a number of
//! requests in flight (closed loop) or paces them at a fixed rate (open loop), then
//! reports counts by outcome, throughput, latency percentiles and, optionally, the
//! server's CPU time per request. See `tollgate-load --help`.

mod cli;
mod cpu;
mod engine;
mod grpc;
mod grpc_native;
mod http;
mod pacer;
mod redis;
mod report;

use std::io::IsTerminal as _;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser as _;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::cli::{Cli, CommonArgs, Mode, Stop, Transport};
use crate::engine::{Outcome, Plan, Target};
use crate::report::{Report, RunInfo};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut rt = match cli.mode.common().threads {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(n) => {
            let mut rt = tokio::runtime::Builder::new_multi_thread();
            rt.worker_threads(n as usize);
            rt
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    rt.enable_all();
    let result = rt
        .build()
        .map_err(|e| format!("cannot start the tokio runtime: {e}"))
        .and_then(|rt| rt.block_on(run(cli.mode)));
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tollgate-load: error: {e}");
            ExitCode::FAILURE
        }
    }
}

impl Mode {
    /// The flags shared by every mode.
    fn common(&self) -> &CommonArgs {
        match self {
            Mode::Grpc { common, .. }
            | Mode::Check { common, .. }
            | Mode::Http { common, .. }
            | Mode::Redis { common, .. } => common,
        }
    }
}

/// Sets up the target of `mode` and drives it.
async fn run(mode: Mode) -> Result<ExitCode, String> {
    match mode {
        Mode::Grpc {
            addr,
            transport,
            connections,
            tls_ca,
            tls_server_name,
            keys,
            common,
        } => {
            let info = run_info("grpc", addr.clone(), Some(keys.keys), &common);
            let tls = match tls_ca {
                None => None,
                Some(_) if transport == Transport::Native => return Err(
                    "--tls-ca needs --transport tonic (the native client speaks cleartext only)"
                        .into(),
                ),
                Some(ca) => Some(grpc::Tls {
                    ca_pem: std::fs::read(&ca)
                        .map_err(|e| format!("--tls-ca {}: {e}", ca.display()))?,
                    server_name: tls_server_name,
                }),
            };
            match transport {
                Transport::Native => {
                    let target = grpc_native::NativeGrpcTarget::connect(
                        &addr,
                        connections,
                        keys,
                        common.timeout,
                    )
                    .await?;
                    drive(target, info, &common).await
                }
                Transport::Tonic => {
                    let target =
                        grpc::GrpcTarget::connect(&addr, connections, tls, keys, common.timeout)
                            .await?;
                    drive(target, info, &common).await
                }
            }
        }
        Mode::Check { url, keys, common } => {
            let info = run_info("check", url.clone(), Some(keys.keys), &common);
            let target = http::CheckTarget::new(&url, keys, common.concurrency, common.timeout)?;
            drive(target, info, &common).await
        }
        Mode::Redis { url, keys, common } => {
            let info = run_info("redis", url.clone(), Some(keys), &common);
            let target =
                redis::RedisTarget::connect(&url, common.concurrency, keys, common.timeout).await?;
            drive(target, info, &common).await
        }
        Mode::Http { url, common } => {
            let info = run_info("http", url.clone(), None, &common);
            let target = http::GetTarget::new(&url, common.concurrency, common.timeout)?;
            drive(target, info, &common).await
        }
    }
}

fn run_info(mode: &'static str, target: String, keys: Option<u64>, c: &CommonArgs) -> RunInfo {
    RunInfo {
        mode,
        target,
        concurrency: c.concurrency,
        rate: c.rate,
        keys,
        stop: c.stop(),
    }
}

/// Checks the target answers, warms up, runs the measured phase (sampling the
/// server's CPU around it) and prints the report.
async fn drive<T: Target>(
    target: T,
    info: RunInfo,
    common: &CommonArgs,
) -> Result<ExitCode, String> {
    let target = Arc::new(target);

    // One request first, so that a wrong address or a server that is down gives one
    // clear message rather than a report full of errors.
    let first = tokio::time::timeout(common.timeout, target.call(0)).await;
    match first {
        Ok(Outcome::Error(e)) => {
            return Err(format!(
                "{} {}: first request failed: {e}",
                info.mode, info.target
            ))
        }
        Err(_) => {
            return Err(format!(
                "{} {}: first request timed out after {:?}",
                info.mode, info.target, common.timeout
            ))
        }
        Ok(_) => {}
    }

    let clk_tck = cpu::clock_ticks_per_second();
    if let Some(pid) = common.server_pid {
        cpu::sample(pid)?; // fail now, not after the run
    }

    let plan = Plan {
        concurrency: common.concurrency,
        stop: common.stop(),
        rate: common.rate,
        timeout: common.timeout,
    };
    if !common.warmup.is_zero() {
        let warmup = Plan {
            stop: Stop::Duration(common.warmup),
            ..plan
        };
        engine::run(
            Arc::clone(&target),
            warmup,
            progress_bar(common.quiet, warmup.stop, "warmup"),
        )
        .await?;
    }

    let before = common.server_pid.map(cpu::sample).transpose()?;
    // This tool's own CPU (best effort: not reported if /proc cannot be read).
    let own_before = cpu::sample(std::process::id()).ok();
    let phase = engine::run(
        Arc::clone(&target),
        plan,
        progress_bar(common.quiet, plan.stop, "run"),
    )
    .await?;
    let own_after = cpu::sample(std::process::id()).ok();
    let after = common.server_pid.map(cpu::sample).transpose()?;
    let server_cpu = before.zip(after).map(|(b, a)| cpu::usage(&b, &a, clk_tck));
    let load_cpu = own_before
        .zip(own_after)
        .map(|(b, a)| cpu::usage(&b, &a, clk_tck));

    let report = Report::new(info, &phase, server_cpu, load_cpu);
    if common.json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.to_text());
    }

    let total = phase.counts.total();
    if total > 0 && phase.counts.errors == total {
        eprintln!("tollgate-load: error: every request failed");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// A progress bar on stderr, hidden with `--quiet` or when stderr is not a terminal.
fn progress_bar(quiet: bool, stop: Stop, label: &str) -> ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let (len, template) = match stop {
        Stop::Duration(d) => (
            u64::try_from(d.as_millis()).unwrap_or(u64::MAX),
            "{prefix:>6} [{bar:30}] {elapsed_precise} {msg}",
        ),
        Stop::Requests(n) => (n, "{prefix:>6} [{bar:30}] {pos}/{len} {msg}"),
    };
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(label.to_owned());
    bar
}

/// An error and its chain of sources, as one line (`a: b: c`).
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        // Some errors repeat their source's message in their own.
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}
