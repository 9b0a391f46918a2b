//! `tollgate validate PATH...`: checks rule files and reports every problem.

use std::path::PathBuf;

use tollgate::rules::{load, LoadOptions};

/// Validates the rule files at `paths`; prints errors to stderr or a summary per domain
/// to stdout. Returns whether everything was valid.
pub fn run(paths: &[PathBuf], options: LoadOptions) -> bool {
    match load(paths, options) {
        Ok(set) => {
            for domain in set.domains() {
                println!(
                    "ok: domain `{}`: {} rules, {} limits ({})",
                    domain.name,
                    domain.rule_count(),
                    domain.limit_count(),
                    domain.files.join(", ")
                );
            }
            if set.domains().is_empty() {
                println!("ok: no rule files found");
            }
            true
        }
        Err(errors) => {
            for e in errors.iter() {
                eprintln!("{e}");
            }
            eprintln!("{} error(s)", errors.0.len());
            false
        }
    }
}
