//! The command line: every subcommand and flag, with its environment variable and default.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// Tollgate: an exact, fast rate limiter.
///
/// One binary for the rate limit service (Envoy's gRPC API and an HTTP API), the HTTP
/// gateway, and tools to validate rule files and run conformance cases.
#[derive(Debug, Parser)]
#[command(name = "tollgate", version, about, long_about)]
pub struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Check rule files (files or directories); print every problem with its file,
    /// line and column, or a one-line summary per domain. Exits non-zero on any error.
    Validate {
        /// Rule files, or directories of `*.yaml` / `*.yml` rule files.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// Let several files define the same domain (their descriptors are combined).
        #[arg(long, env = "TOLLGATE_MERGE_DOMAINS")]
        merge_domains: bool,
    },
    /// Run rule-engine case files (the format of shared/cases/README.md) with a manual
    /// clock; print every failing step and `N passed, M failed` (files). Exits
    /// non-zero on any failure.
    Conformance {
        /// Directory of case files (searched recursively).
        dir: PathBuf,
        /// The store to run against: `memory` (the only one so far).
        #[arg(long, env = "TOLLGATE_STORE", default_value = "memory")]
        store: String,
    },
}
