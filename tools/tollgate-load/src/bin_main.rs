//! The `main` of the helper binaries in `src/bin/` (included with `#[path]`): the command
//! line parsed, a tokio runtime with the worker threads it asks for, the run, and its
//! error as one line on stderr with a failing exit code.

use std::future::Future;
use std::process::ExitCode;

use clap::Parser;

/// What the binaries' runs fail with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Parses the command line, then runs `run` on a multi-threaded runtime of
/// `threads(&cli)` workers (at least 1); on error prints "NAME: error: ..." and fails.
pub fn main_with<C, F>(name: &str, threads: fn(&C) -> usize, run: fn(C) -> F) -> ExitCode
where
    C: Parser,
    F: Future<Output = Result<(), BoxError>>,
{
    let cli = C::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads(&cli).max(1))
        .enable_all()
        .build();
    let result = match rt {
        Ok(rt) => rt.block_on(run(cli)),
        Err(e) => Err(e.into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: error: {e}");
            ExitCode::FAILURE
        }
    }
}
