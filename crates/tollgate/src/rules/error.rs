//! Errors in rule files: each names the file, the line and column, and the problem.

use std::fmt;

/// One problem in one rule file.
///
/// Written `file:line:column: message`, or `file: message` for a problem with no place
/// in the file (a file that cannot be read).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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

impl ConfigError {
    /// `message` about `file` at the start of `span`.
    pub(crate) fn at(
        file: impl Into<String>,
        span: &marked_yaml::Span,
        message: impl Into<String>,
    ) -> Self {
        let (line, column) = span.start().map_or((0, 0), |m| (m.line(), m.column()));
        Self {
            file: file.into(),
            line,
            column,
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.line, self.column) {
            (0, _) => write!(f, "{}: {}", self.file, self.message),
            (line, 0) => write!(f, "{}:{line}: {}", self.file, self.message),
            (line, column) => write!(f, "{}:{line}:{column}: {}", self.file, self.message),
        }
    }
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
