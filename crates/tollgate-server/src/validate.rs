//! `tollgate validate PATH...`: checks rule files (their rules and their gateway `http`
//! sections) and reports every problem.

use std::path::PathBuf;

use tollgate::rules::{load, LoadOptions};

/// Validates the rule files at `paths`; prints errors to stderr or a summary per domain
/// to stdout. Returns whether everything was valid.
pub fn run(paths: &[PathBuf], options: LoadOptions) -> bool {
    let http = match tollgate::http::config::load(paths) {
        Ok(sections) => {
            for s in &sections {
                println!(
                    "ok: gateway section of `{}`: {} routes",
                    s.domain,
                    s.routes.len()
                );
            }
            true
        }
        Err(errors) => {
            for e in errors.iter() {
                eprintln!("{e}");
            }
            false
        }
    };
    let rules = match load(paths, options) {
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
    };
    http && rules
}
