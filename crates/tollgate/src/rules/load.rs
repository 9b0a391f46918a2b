//! Loading a [`RuleSet`] from files, directories or strings.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use super::compile::compile;
use super::draft::{DraftDomain, DraftReader};
use super::error::{ConfigError, ConfigErrors};
use super::read::MAX_MAX_DEPTH;
use super::tree::RuleSet;

/// How deep `descriptors` lists may nest unless [`LoadOptions::max_depth`] says
/// otherwise: far beyond any real rule tree, and bounded so that reading a file cannot
/// exhaust a thread's stack.
pub const DEFAULT_MAX_DEPTH: usize = 64;

/// How a rule set is assembled from several files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOptions {
    /// Let several files define the same domain; their descriptors are combined (a
    /// descriptor defined twice is still an error). Off: a domain in two files is an error.
    pub merge_domains: bool,
    /// How many `descriptors` lists deep a file may nest (the domain's own list is the
    /// first); deeper is an error at the list that passes it. [`DEFAULT_MAX_DEPTH`];
    /// at most [`MAX_MAX_DEPTH`] (a larger value counts as that).
    pub max_depth: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            merge_domains: false,
            max_depth: DEFAULT_MAX_DEPTH,
        }
    }
}

/// Loads every rule file named by `paths`: files as they are, directories by their
/// `*.yaml` and `*.yml` entries (not recursive; names starting with `.` are skipped,
/// which also skips the `..data` folders of a Kubernetes ConfigMap mount, whose files
/// appear at the top as symlinks). Every problem in every file is reported.
pub fn load(paths: &[impl AsRef<Path>], options: LoadOptions) -> Result<RuleSet, ConfigErrors> {
    let mut errors = Vec::new();
    let mut texts = Vec::new();
    for file in rule_files(paths, &mut errors) {
        match std::fs::read_to_string(&file) {
            Ok(text) => texts.push((file, text)),
            Err(e) => errors.push(no_place(&file, format!("cannot read the file: {e}"))),
        }
    }
    let named: Vec<(String, &str)> = texts
        .iter()
        .map(|(p, t)| (p.display().to_string(), t.as_str()))
        .collect();
    let result = build(&named, options, errors);
    result.map(|mut set| {
        set.files = texts.into_iter().map(|(p, _)| p).collect();
        set.loaded_at = Some(SystemTime::now());
        set
    })
}

/// Builds a rule set from one file's text; `file` names it in error messages.
pub fn from_str(file: &str, text: &str) -> Result<RuleSet, ConfigErrors> {
    build(
        &[(file.to_string(), text)],
        LoadOptions::default(),
        Vec::new(),
    )
}

/// The rule files `paths` name, in a stable order.
pub fn rule_files(paths: &[impl AsRef<Path>], errors: &mut Vec<ConfigError>) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for path in paths {
        let path = path.as_ref();
        if path.is_dir() {
            match std::fs::read_dir(path) {
                Ok(entries) => {
                    let mut found: Vec<PathBuf> = entries
                        .filter_map(Result::ok)
                        .map(|e| e.path())
                        .filter(|p| is_rule_file(p))
                        .collect();
                    found.sort();
                    files.extend(found);
                }
                Err(e) => errors.push(no_place(path, format!("cannot read the directory: {e}"))),
            }
        } else if path.exists() {
            files.push(path.to_path_buf());
        } else {
            errors.push(no_place(path, "no such file or directory".to_string()));
        }
    }
    files
}

fn is_rule_file(p: &Path) -> bool {
    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or(".");
    !name.starts_with('.') && (name.ends_with(".yaml") || name.ends_with(".yml")) && p.is_file()
    // follows symlinks
}

fn no_place(path: &Path, message: String) -> ConfigError {
    ConfigError {
        file: path.display().to_string(),
        line: 0,
        column: 0,
        message,
    }
}

/// At most one `http` section of a rule set may set `system_protection`: it is the
/// whole gateway's. A second one is an error at its place.
#[cfg(feature = "tower")]
fn one_system_protection(http: &[crate::http::HttpRules], errors: &mut Vec<ConfigError>) {
    let mut set = http.iter().filter_map(|h| h.system_protection.as_ref());
    let Some(first) = set.next() else {
        return;
    };
    for again in set {
        errors.push(ConfigError {
            file: again.file.clone(),
            line: again.line,
            column: 0,
            message: format!(
                "http.system_protection: already set in {}:{}; it protects the whole gateway, so one file sets it",
                first.file, first.line
            ),
        });
    }
}

fn build(
    files: &[(String, &str)],
    options: LoadOptions,
    mut errors: Vec<ConfigError>,
) -> Result<RuleSet, ConfigErrors> {
    let mut by_domain: BTreeMap<String, Vec<DraftDomain>> = BTreeMap::new();
    #[cfg(feature = "tower")]
    let mut http = Vec::new();
    for (name, text) in files {
        let mut reader = DraftReader::with_max_depth(name, options.max_depth.min(MAX_MAX_DEPTH));
        let draft = reader.read(text);
        errors.extend(reader.into_errors());
        if let Some(draft) = draft {
            #[cfg(feature = "tower")]
            let mut draft = draft;
            #[cfg(feature = "tower")]
            http.extend(draft.http.take());
            let same = by_domain.entry(draft.name.clone()).or_default();
            if let (Some(first), false) = (same.first(), options.merge_domains) {
                errors.push(draft.error(format!(
                    "domain `{}` is already defined in {}; one file per domain (or turn on merging)",
                    draft.name, first.file
                )));
                continue;
            }
            same.push(draft);
        }
    }
    let mut set = RuleSet::default();
    #[cfg(feature = "tower")]
    {
        one_system_protection(&http, &mut errors);
        set.http = http;
    }
    for (name, drafts) in by_domain {
        if let Some(domain) = compile(drafts, &mut errors) {
            set.domains.insert(name, std::sync::Arc::new(domain));
        }
    }
    if errors.is_empty() {
        Ok(set)
    } else {
        errors.sort_by(|a, b| (&a.file, a.line, a.column).cmp(&(&b.file, b.line, b.column)));
        Err(ConfigErrors(errors))
    }
}
