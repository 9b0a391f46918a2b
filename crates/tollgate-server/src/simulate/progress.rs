//! A progress line on stderr for long simulations, shown only when stderr is a
//! terminal and redrawn at most ten times a second.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Counts decisions made out of the total and redraws the line now and then.
#[derive(Debug)]
pub struct Progress {
    total: u64,
    done: u64,
    shown: Option<Instant>,
    enabled: bool,
}

impl Progress {
    /// For `total` decisions; silent unless stderr is a terminal.
    pub fn new(total: u64) -> Self {
        Self {
            total: total.max(1),
            done: 0,
            shown: None,
            enabled: std::io::stderr().is_terminal(),
        }
    }

    /// One more decision, made by `algorithm`.
    pub fn tick(&mut self, algorithm: &str) {
        self.done += 1;
        if !self.enabled || self.done % 4096 != 0 {
            return;
        }
        let now = Instant::now();
        if self
            .shown
            .is_some_and(|t| now.duration_since(t) < Duration::from_millis(100))
        {
            return;
        }
        self.shown = Some(now);
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\rsimulating {:>3}%  {} of {} decisions  ({algorithm})\x1b[K",
            self.done * 100 / self.total,
            self.done,
            self.total
        );
        let _ = err.flush();
    }

    /// Clears the line, if one was drawn.
    pub fn finish(&mut self) {
        if self.shown.take().is_some() {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[K");
            let _ = err.flush();
        }
    }
}
