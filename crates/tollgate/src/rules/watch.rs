//! Reloading [`Rules`] when their files change or on SIGHUP.
//!
//! The watcher watches the directories that hold the rule files (not the files: an
//! editor that writes a temporary file and renames it, and a Kubernetes ConfigMap
//! update, which swaps a `..data` symlink, both replace files rather than write them).
//! Events are debounced for 200 ms, then [`Rules::reload`] runs; it does nothing when
//! no file's bytes changed.

use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use notify::{RecursiveMode, Watcher as _};

use super::Rules;

const DEBOUNCE: Duration = Duration::from_millis(200);

/// Keeps the file watcher alive; dropping it stops watching.
pub struct Watcher {
    _watcher: notify::RecommendedWatcher,
}

/// Starts reloading `rules` whenever a file in their directories changes.
pub fn watch(rules: Arc<Rules>) -> notify::Result<Watcher> {
    let (tx, rx) = mpsc::channel::<()>();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if event.is_ok() {
            let _ = tx.send(());
        }
    })?;
    let mut dirs: Vec<PathBuf> = rules
        .paths()
        .iter()
        .map(|p| {
            if p.is_dir() {
                p.clone()
            } else {
                p.parent().map(PathBuf::from).unwrap_or_default()
            }
        })
        .map(|p| {
            if p.as_os_str().is_empty() {
                PathBuf::from(".")
            } else {
                p
            }
        })
        .collect();
    dirs.sort();
    dirs.dedup();
    for dir in &dirs {
        watcher.watch(dir, RecursiveMode::NonRecursive)?;
    }
    thread::Builder::new()
        .name("tollgate-rules-watch".into())
        .spawn(move || {
            while rx.recv().is_ok() {
                // Let a burst of events (write, rename, symlink swap) settle.
                while rx.recv_timeout(DEBOUNCE).is_ok() {}
                let _ = rules.reload();
            }
        })
        .map_err(|e| notify::Error::generic(&e.to_string()))?;
    Ok(Watcher { _watcher: watcher })
}

/// Reloads `rules` on every SIGHUP, from a background thread, for the life of the process.
#[cfg(unix)]
pub fn reload_on_sighup(rules: Arc<Rules>) -> std::io::Result<()> {
    let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGHUP])?;
    thread::Builder::new()
        .name("tollgate-sighup".into())
        .spawn(move || {
            for _ in signals.forever() {
                tracing::info!("SIGHUP: reloading rules");
                let _ = rules.reload();
            }
        })?;
    Ok(())
}
