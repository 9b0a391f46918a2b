//! The command line: every subcommand and flag, with its environment variable and default.

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

/// The subcommands. (Later issues add `serve`, `proxy`, `validate` and `conformance`.)
#[derive(Debug, Subcommand)]
pub enum Command {}
