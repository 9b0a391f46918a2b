//! `tollgate`: the rate limit service, gateway and tools. See `tollgate --help`.

mod cli;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = cli::Cli::parse();
    match cli.command {
        None => {
            // No subcommand yet does work: show what there is.
            let _ = <cli::Cli as clap::CommandFactory>::command().print_help();
            std::process::ExitCode::SUCCESS
        }
    }
}
