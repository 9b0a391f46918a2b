//! Errors in rule files: each names the file, the line and column, and the problem.

use std::fmt;

/// One problem in one rule file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}:{column}: {message}")]
pub struct ConfigError {
    /// The file, as it was named when loaded.
    pub file: String,
    /// 1-based line (0 when the problem has no place, e.g. an unreadable file).
    pub line: usize,
    /// 1-based column (0 when the problem has no place).
    pub column: usize,
    /// The problem, in plain words.
    pub message: String,
}

/// Every problem found in a rule set; never empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

impl ConfigErrors {
    /// The errors, in file and line order.
    pub fn iter(&self) -> impl Iterator<Item = &ConfigError> {
        self.0.iter()
    }
}
