//! The `tollgate` command: the rate limit service (`serve`), the gateway (`proxy`) and
//! the tools around them. `src/main.rs` is only [`run`]; the library target exists so
//! that the fuzz targets and the amplification tests reach the same input parsers the
//! listeners use ([`fuzzing`]).

mod api;
mod app;
mod cli;
mod conformance;
mod conn;
mod dashboard;
mod enforcement;
pub mod fuzzing;
mod grpc;
mod metrics;
mod proxy;
mod service;
mod simulate;
mod store;
mod tls;
mod validate;
mod warm;
mod workers;

use std::process::ExitCode;

use clap::{CommandFactory, Parser};
use cli::{Cli, Command};
use tollgate::rules::LoadOptions;

/// `tollgate` with the process's arguments: what `main` runs.
pub fn run() -> ExitCode {
    match Cli::parse().command {
        None => {
            let _ = Cli::command().print_help();
            ExitCode::SUCCESS
        }
        Some(Command::Serve(args)) => app::serve(args),
        Some(Command::Proxy(args)) => proxy::gateway::run(args),
        Some(Command::Validate {
            paths,
            merge_domains,
            max_rule_depth,
        }) => exit(validate::run(
            &paths,
            LoadOptions {
                merge_domains,
                max_depth: max_rule_depth,
            },
        )),
        Some(Command::Conformance { dir, store, tls }) => match tls.read() {
            Ok(tls) => exit(conformance::report(&dir, &store, tls.as_ref())),
            Err(e) => {
                eprintln!("cannot set up TLS to Redis: {e}");
                ExitCode::FAILURE
            }
        },
        Some(Command::RedisPrune { store, tls }) => redis_prune(&store, tls),
        Some(Command::Simulate(args)) => simulate::main(&args),
        Some(Command::RedisScript {
            algorithms,
            library,
        }) => {
            let names: Vec<&str> = algorithms.iter().map(String::as_str).collect();
            let source = if library {
                tollgate::store::script_library(&names).map(|(_, library)| library)
            } else {
                tollgate::store::script_source(&names)
            };
            match source {
                Ok(source) => {
                    print!("{source}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("{e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// `tollgate redis-prune`: deletes other versions' libraries, prints their names.
fn redis_prune(store: &str, tls: cli::RedisTlsArgs) -> ExitCode {
    let tls = match tls.read() {
        Ok(tls) => tls,
        Err(e) => {
            eprintln!("cannot set up TLS to Redis: {e}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start a runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let deleted = runtime.block_on(async {
        let mut builder = tollgate::store::RedisStore::builder(store).per_thread(false);
        if let Some(tls) = tls {
            builder = builder.tls(tls);
        }
        builder.connect().await?.delete_stale_libraries().await
    });
    match deleted {
        Ok(names) => {
            for name in &names {
                println!("{name}");
            }
            eprintln!(
                "deleted {} librar{} of other Tollgate versions",
                names.len(),
                if names.len() == 1 { "y" } else { "ies" }
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("cannot prune {store}: {e}");
            ExitCode::FAILURE
        }
    }
}

fn exit(ok: bool) -> ExitCode {
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `err` and its sources, joined with `": "`, for logs and start-up errors.
pub(crate) fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut current = err.source();
    while let Some(e) = current {
        out.push_str(": ");
        out.push_str(&e.to_string());
        current = e.source();
    }
    out
}

/// A duration for logs and messages people read, in the units the flags take: `30s`,
/// `1.5s`, `500ms`, `2.25ms`, `800µs` (to the millisecond above a second, the
/// microsecond below). What `Debug` prints for whole values, without its nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HumanDuration(pub std::time::Duration);

impl std::fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        /// `whole`, then `part` thousandths without trailing zeros, then `unit`.
        fn write(
            f: &mut std::fmt::Formatter<'_>,
            whole: u128,
            part: u32,
            unit: &str,
        ) -> std::fmt::Result {
            if part == 0 {
                return write!(f, "{whole}{unit}");
            }
            let part = format!("{part:03}");
            write!(f, "{whole}.{}{unit}", part.trim_end_matches('0'))
        }
        let d = self.0;
        if d.as_secs() > 0 {
            write(f, u128::from(d.as_secs()), d.subsec_millis(), "s")
        } else if d.as_millis() > 0 {
            write(f, d.as_millis(), d.subsec_micros() % 1_000, "ms")
        } else {
            write!(f, "{}µs", d.as_micros())
        }
    }
}

/// The flags of every `tollgate` command as Markdown tables (flag, variable, default,
/// meaning), from the same definitions the commands parse: the flags part of
/// docs/configuration.md, which a test holds to this.
pub fn flags_reference() -> String {
    let mut out = String::new();
    let cli = Cli::command();
    for command in cli.get_subcommands() {
        let name = command.get_name();
        out.push_str(&format!("### `tollgate {name}`\n\n"));
        if let Some(about) = command.get_about() {
            out.push_str(&format!("{about}\n\n"));
        }
        out.push_str("| flag | variable | default | meaning |\n|---|---|---|---|\n");
        for arg in command.get_arguments() {
            let id = arg.get_id().as_str();
            if id == "help" || id == "version" {
                continue;
            }
            let flag = match arg.get_long() {
                Some(long) => format!("`--{long}`"),
                None => format!("`{}` (positional)", id.to_ascii_uppercase()),
            };
            let env = arg
                .get_env()
                .map(|e| format!("`{}`", e.to_string_lossy()))
                .unwrap_or_default();
            let defaults: Vec<String> = arg
                .get_default_values()
                .iter()
                .map(|v| v.to_string_lossy().into_owned())
                .collect();
            let default = if defaults.is_empty() {
                String::new()
            } else {
                format!("`{}`", defaults.join(","))
            };
            let help = arg
                .get_help()
                .map(|h| h.to_string().replace('\n', " ").replace('|', "\\|"))
                .unwrap_or_default();
            out.push_str(&format!("| {flag} | {env} | {default} | {help} |\n"));
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::HumanDuration;

    #[test]
    fn durations_are_shown_in_the_flags_units() {
        let shown = |d: Duration| HumanDuration(d).to_string();
        // Whole values as `Debug` has them (and as the flags take them).
        for d in [
            Duration::from_secs(30),
            Duration::from_secs(120),
            Duration::from_millis(500),
            Duration::from_millis(10),
            Duration::from_micros(800),
        ] {
            assert_eq!(shown(d), format!("{d:?}"));
        }
        // Fractions to the millisecond above a second, the microsecond below.
        assert_eq!(shown(Duration::from_millis(1_500)), "1.5s");
        assert_eq!(shown(Duration::from_nanos(1_234_567_891)), "1.234s");
        assert_eq!(shown(Duration::from_nanos(2_250_400)), "2.25ms");
        assert_eq!(shown(Duration::from_nanos(12_345_678)), "12.345ms");
        assert_eq!(shown(Duration::ZERO), "0µs");
    }
}
