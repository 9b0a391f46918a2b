//! Reloading [`Rules`] when their files change or on SIGHUP.
//!
//! The watcher watches the directories that hold the rule files (not the files: an
//! editor that writes a temporary file and renames it, and a Kubernetes ConfigMap
//! update, which swaps a `..data` symlink, both replace files rather than write them).
//! It reacts to changes only: a file created, written, renamed or removed, or its
//! metadata changed. Reading a file is not a change, so the watcher's own reloads (and
//! anyone else reading the files) do not wake it. Events are debounced for 200 ms, then
//! [`Rules::reload`] runs; it does nothing when no file's bytes changed, and reports a
//! set of files that fails once, not on every attempt.
//!
//! A metadata event alone (permissions, owner, times) reloads only when the files'
//! metadata really changed, access time aside: the kernel reports a read that updates a
//! file's access time as a metadata change, and the reload's own reads would otherwise
//! wake the watcher again.
//!
//! A path that does not exist is watched through its nearest existing ancestor, so
//! that its appearance (a directory created or renamed into place, a volume mounted)
//! reloads; the watched directories are worked out again before each reload, so a
//! directory that appeared is watched itself from then on.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use std::time::Duration;

use notify::event::{EventKind, MetadataKind, ModifyKind};
use notify::{RecursiveMode, Watcher as _};

use super::load::rule_files;
use super::reload::reload_thread;
use super::Rules;

const DEBOUNCE: Duration = Duration::from_millis(200);

/// Keeps the file watcher alive; dropping it stops watching.
pub struct Watcher {
    _watcher: Arc<Mutex<notify::RecommendedWatcher>>,
}

/// What an event asks of the watcher thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    /// Something was created, written, renamed or removed: reload.
    Change,
    /// Metadata only: reload if the files' metadata (access time aside) changed.
    Metadata,
}

/// What `kind` asks for; `None` for events that change nothing (reads).
fn wake(kind: &EventKind) -> Option<Wake> {
    match kind {
        EventKind::Access(_) => None,
        EventKind::Modify(ModifyKind::Metadata(MetadataKind::AccessTime)) => None,
        EventKind::Modify(ModifyKind::Metadata(_)) => Some(Wake::Metadata),
        EventKind::Create(_)
        | EventKind::Modify(_)
        | EventKind::Remove(_)
        | EventKind::Any
        | EventKind::Other => Some(Wake::Change),
    }
}

/// Starts reloading `rules` whenever a file in their directories changes.
pub fn watch(rules: Arc<Rules>) -> notify::Result<Watcher> {
    let dirs = directories(rules.paths());
    let (tx, rx) = mpsc::channel::<Wake>();
    let watched = Arc::new(Mutex::new(dirs.clone()));
    let seen_dirs = Arc::clone(&watched);
    let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        match event {
            Ok(event) => match wake(&event.kind) {
                // The directories' own metadata: their access time moves when they are
                // listed, which every reload does.
                Some(Wake::Metadata)
                    if {
                        let watched = seen_dirs.lock();
                        event.paths.iter().all(|p| watched.contains(p))
                    } => {}
                Some(w) => {
                    let _ = tx.send(w);
                }
                None => {}
            },
            Err(e) => tracing::warn!(error = %e, "watching the rule files"),
        }
    })?;
    let watcher = Arc::new(Mutex::new(watcher));
    for dir in &dirs {
        watcher.lock().watch(dir, RecursiveMode::NonRecursive)?;
    }
    // Weak: dropping the `Watcher` drops the notify watcher, which ends this thread.
    let handle = Arc::downgrade(&watcher);
    let mut seen = stamp(rules.paths());
    // Reloads read the files on this thread: its stack is set, not left to defaults.
    reload_thread("tollgate-rules-watch")
        .spawn(move || {
            while let Ok(first) = rx.recv() {
                // Let a burst of events (write, rename, symlink swap) settle.
                let mut change = first == Wake::Change;
                while let Ok(w) = rx.recv_timeout(DEBOUNCE) {
                    change |= w == Wake::Change;
                }
                // A path that appeared is watched itself, before the reload reads it.
                rewatch(&handle, &watched, rules.paths());
                // Before the reload, so that a change made during it is seen next time.
                let now = stamp(rules.paths());
                if change || now != seen {
                    let _ = rules.reload();
                }
                seen = now;
            }
        })
        .map_err(|e| notify::Error::generic(&e.to_string()))?;
    Ok(Watcher { _watcher: watcher })
}

/// The directories to watch for `paths`: a directory itself, a file's directory, and
/// for a path that does not exist its nearest existing ancestor.
fn directories(paths: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = paths
        .iter()
        .map(|p| {
            let mut dir = if p.is_dir() {
                p.clone()
            } else {
                p.parent().map(PathBuf::from).unwrap_or_default()
            };
            while !dir.as_os_str().is_empty() && !dir.is_dir() {
                dir = dir.parent().map(PathBuf::from).unwrap_or_default();
            }
            if dir.as_os_str().is_empty() {
                PathBuf::from(".")
            } else {
                dir
            }
        })
        .collect();
    dirs.sort();
    dirs.dedup();
    dirs
}

/// Watches the directories `paths` need now and stops watching those they no longer
/// need (a path that appeared is watched itself instead of its ancestor).
fn rewatch(
    handle: &Weak<Mutex<notify::RecommendedWatcher>>,
    watched: &Mutex<Vec<PathBuf>>,
    paths: &[PathBuf],
) {
    let Some(watcher) = handle.upgrade() else {
        return;
    };
    let wanted = directories(paths);
    // Not held while watching: notify's event thread takes it in the event handler,
    // and `watch` waits for that thread. Only this thread changes the list.
    let before = watched.lock().clone();
    if before == wanted {
        return;
    }
    let mut now = Vec::with_capacity(wanted.len());
    let mut watcher = watcher.lock();
    for dir in &wanted {
        if before.contains(dir) {
            now.push(dir.clone());
            continue;
        }
        // One that cannot be watched now is tried again after the next event.
        match watcher.watch(dir, RecursiveMode::NonRecursive) {
            Ok(()) => {
                tracing::info!(dir = %dir.display(), "watching a new rule directory");
                now.push(dir.clone());
            }
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot watch a rule directory")
            }
        }
    }
    for dir in before.iter().filter(|d| !wanted.contains(d)) {
        // A directory that went away is no longer watched anyway.
        let _ = watcher.unwatch(dir);
    }
    drop(watcher);
    *watched.lock() = now;
}

/// The rule files' metadata as a reload cares about it (followed through symlinks):
/// which files, their identity, size, permissions, owner, and modification and status
/// change times, but not their access time. Taken without opening any file.
fn stamp(paths: &[PathBuf]) -> Vec<(PathBuf, Option<FileStamp>)> {
    rule_files(paths, &mut Vec::new())
        .into_iter()
        .map(|file| {
            let meta = file_stamp(&file);
            (file, meta)
        })
        .collect()
}

#[cfg(unix)]
type FileStamp = (u64, u64, u64, u32, u32, u32, i64, i64, i64, i64);

#[cfg(unix)]
fn file_stamp(file: &Path) -> Option<FileStamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(file).ok()?;
    Some((
        m.dev(),
        m.ino(),
        m.size(),
        m.mode(),
        m.uid(),
        m.gid(),
        m.mtime(),
        m.mtime_nsec(),
        m.ctime(),
        m.ctime_nsec(),
    ))
}

#[cfg(not(unix))]
type FileStamp = (u64, bool, Option<std::time::SystemTime>);

#[cfg(not(unix))]
fn file_stamp(file: &Path) -> Option<FileStamp> {
    let m = std::fs::metadata(file).ok()?;
    Some((m.len(), m.permissions().readonly(), m.modified().ok()))
}

/// Reloads `rules` on every SIGHUP, from a background thread, for the life of the process.
#[cfg(unix)]
pub fn reload_on_sighup(rules: Arc<Rules>) -> std::io::Result<()> {
    let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGHUP])?;
    reload_thread("tollgate-sighup").spawn(move || {
        for _ in signals.forever() {
            tracing::info!("SIGHUP: reloading rules");
            let _ = rules.reload();
        }
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use notify::event::{AccessKind, AccessMode, CreateKind, DataChange, RemoveKind, RenameMode};

    #[test]
    fn reads_are_not_changes_and_writes_renames_and_removals_are() {
        assert_eq!(wake(&EventKind::Access(AccessKind::Read)), None);
        assert_eq!(
            wake(&EventKind::Access(AccessKind::Close(AccessMode::Write))),
            None
        );
        assert_eq!(
            wake(&EventKind::Modify(ModifyKind::Metadata(
                MetadataKind::AccessTime
            ))),
            None
        );
        assert_eq!(
            wake(&EventKind::Modify(ModifyKind::Metadata(MetadataKind::Any))),
            Some(Wake::Metadata)
        );
        for kind in [
            EventKind::Create(CreateKind::File),
            EventKind::Modify(ModifyKind::Data(DataChange::Any)),
            EventKind::Modify(ModifyKind::Name(RenameMode::Both)),
            EventKind::Remove(RemoveKind::File),
            EventKind::Other,
        ] {
            assert_eq!(wake(&kind), Some(Wake::Change), "{kind:?}");
        }
    }
}
