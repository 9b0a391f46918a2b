//! [`SimulateError`]: everything `tollgate simulate` refuses, each one line naming
//! what was wrong and where.

use std::path::PathBuf;

/// Why a simulation could not run or write its report.
#[derive(Debug, thiserror::Error)]
pub enum SimulateError {
    /// `--pattern` is not one of the patterns, or its numbers are wrong.
    #[error("pattern `{pattern}`: {reason}")]
    Pattern {
        /// The pattern as given.
        pattern: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A replay file could not be opened or read.
    #[error("cannot read the replay file {}: {source}", file.display())]
    ReplayRead {
        /// The file.
        file: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A line of a replay file is malformed or over a bound.
    #[error("{}:{line}: {reason}", file.display())]
    ReplayLine {
        /// The file.
        file: PathBuf,
        /// The 1-based line.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A replay file as a whole is over a bound (size, keys).
    #[error("{}: {reason}", file.display())]
    ReplayFile {
        /// The file.
        file: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The traffic would take more requests than a run may simulate.
    #[error("the traffic makes more than {max} requests; shorten --duration or lower the rate")]
    TooManyRequests {
        /// The most a run simulates.
        max: usize,
    },
    /// `--duration` is missing or out of range.
    #[error("--duration: {0}")]
    Duration(String),
    /// `--descriptor` is not `key=value[,key=value]`.
    #[error("--descriptor `{descriptor}`: {reason}")]
    Descriptor {
        /// The descriptor as given.
        descriptor: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The rule file did not load.
    #[error("the rule file does not load: {0}")]
    Config(String),
    /// The rule files have no such domain.
    #[error("no domain `{domain}` in {}", file.display())]
    UnknownDomain {
        /// The domain asked for.
        domain: String,
        /// The rule file.
        file: PathBuf,
    },
    /// No rule of the domain matches the descriptor, or it has no limit.
    #[error("--descriptor `{descriptor}`: {reason} in domain `{domain}`")]
    NoRule {
        /// The descriptor as given.
        descriptor: String,
        /// The domain.
        domain: String,
        /// No rule, or a rule without a limit.
        reason: String,
    },
    /// The traffic's descriptors do not all match one rule: a run simulates one.
    #[error(
        "replay values `{first}` and `{other}` match different rules: `{first}` matches \
         {first_rule}, `{other}` matches {other_rule}; simulate one rule at a time \
         (filter the replay to the values of one rule)"
    )]
    MixedRules {
        /// The first value of the traffic.
        first: String,
        /// The rule it matches (`key[=value]` and where).
        first_rule: String,
        /// A value matching another rule.
        other: String,
        /// That rule, or `no rule`.
        other_rule: String,
    },
    /// The matched limit cannot be run under an algorithm (the exact reference or one
    /// of `--algorithms all`).
    #[error("cannot run {requests_per_unit} per {unit} as {algorithm}: {reason}")]
    Algorithm {
        /// The algorithm.
        algorithm: String,
        /// The limit's number.
        requests_per_unit: u64,
        /// The limit's unit.
        unit: String,
        /// Why not.
        reason: String,
    },
    /// The limiter refused a request (a descriptor over the request size limits).
    #[error("the limiter refused a request: {0}")]
    Limiter(String),
    /// The report could not be written.
    #[error("cannot write {}: {source}", path.display())]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}
