//! Runs one parser once on one hostile input, for measuring its cost per input byte
//! (`tools/check-amplification.sh` runs this under callgrind at two sizes).
//!
//! ```text
//! cargo run --release -p tollgate-server --example hostile_input -- --list
//! cargo run --release -p tollgate-server --example hostile_input -- "h2/HPACK references" 8
//! ```
//! The second argument multiplies the case's base size (default 1).

use std::process::ExitCode;

#[path = "../tests/hostile/mod.rs"]
mod hostile;

use hostile::{Case, CASES};

/// The measured part: callgrind counts the instructions of this function only
/// (`--toggle-collect`), not building the input.
#[inline(never)]
fn parse_once(case: &Case, input: &[u8]) {
    case.target.run(std::hint::black_box(input));
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let id = |c: &Case| format!("{}/{}", c.target.name(), c.name);
    let Some(wanted) = args.first().filter(|a| *a != "--list") else {
        for case in CASES {
            println!("{}", id(case));
        }
        return ExitCode::SUCCESS;
    };
    let Some(case) = CASES.iter().find(|c| id(c) == *wanted) else {
        eprintln!("no case {wanted:?}; --list lists them");
        return ExitCode::FAILURE;
    };
    let factor: usize = match args.get(1).map(|f| f.parse()) {
        None => 1,
        Some(Ok(f)) if f > 0 => f,
        Some(_) => {
            eprintln!("the size factor must be a whole number of at least 1");
            return ExitCode::FAILURE;
        }
    };
    let input = (case.make)(case.n * factor);
    parse_once(case, &input);
    println!("{}", input.len());
    ExitCode::SUCCESS
}
