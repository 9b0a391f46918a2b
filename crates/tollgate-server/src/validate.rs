//! `tollgate validate PATH...`: checks rule files (their rules and their gateway `http`
//! sections) and reports every problem.

use std::path::PathBuf;

use tollgate::rules::{load, ConfigError, LoadOptions};

/// Validates the rule files at `paths`; prints errors to stderr or a summary per domain
/// (and per gateway section) to stdout. Returns whether everything was valid.
///
/// One reader reads the rules and the `http` sections, so each problem is printed once.
pub fn run(paths: &[PathBuf], options: LoadOptions) -> bool {
    let mut errors: Vec<ConfigError> = Vec::new();
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
            for s in set.http() {
                println!(
                    "ok: gateway section of `{}`: {} routes",
                    s.domain,
                    s.routes.len()
                );
            }
            if set.domains().is_empty() {
                println!("ok: no rule files found");
            }
        }
        Err(e) => errors.extend(e.0),
    }
    if errors.is_empty() {
        return true;
    }
    errors.sort_by(|a, b| {
        (&a.file, a.line, a.column, &a.message).cmp(&(&b.file, b.line, b.column, &b.message))
    });
    errors.dedup();
    for e in &errors {
        eprintln!("{e}");
    }
    eprintln!("{} error(s)", errors.len());
    false
}
