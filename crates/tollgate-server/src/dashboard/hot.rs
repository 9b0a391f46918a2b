//! [`HotKeys`]: one rule's hottest keys, as the dashboard shows them: a
//! [`SpaceSaving`] sketch of the descriptors' entries (`key=value, …`), behind a lock.

use std::cell::RefCell;

use parking_lot::Mutex;
use tollgate::sketch::{HeavyHitter, SpaceSaving};

/// Keys each rule's sketch holds.
pub(crate) const HOT_CAPACITY: usize = 64;

/// Bytes of a key kept: longer keys are shown (and counted) truncated.
pub(crate) const MAX_KEY_BYTES: usize = 96;

/// One rule's sketch: at most [`HOT_CAPACITY`] keys of at most [`MAX_KEY_BYTES`].
pub(crate) struct HotKeys(Mutex<SpaceSaving>);

thread_local! {
    /// The key being written, reused from one decision to the next.
    static KEY: RefCell<String> = RefCell::new(String::with_capacity(MAX_KEY_BYTES + 8));
}

impl HotKeys {
    pub(crate) fn new() -> Self {
        Self(Mutex::new(SpaceSaving::new(HOT_CAPACITY, MAX_KEY_BYTES)))
    }

    /// Counts `hits` for the descriptor of `entries`. Writes at most a few bytes past
    /// [`MAX_KEY_BYTES`] (the sketch then marks the key truncated), whatever the
    /// entries' length. A decision never waits for the sketch: while another thread
    /// holds it, this offer is skipped (the sketch samples, it does not count exactly).
    pub(crate) fn offer(&self, entries: &[(String, String)], hits: u64) {
        if hits == 0 {
            return;
        }
        KEY.with(|key| {
            let Ok(mut key) = key.try_borrow_mut() else {
                return;
            };
            key.clear();
            for (i, (k, v)) in entries.iter().enumerate() {
                if i > 0 {
                    push_capped(&mut key, ", ");
                }
                push_capped(&mut key, k);
                push_capped(&mut key, "=");
                push_capped(&mut key, v);
            }
            if let Some(mut sketch) = self.0.try_lock() {
                sketch.offer(&key, hits);
            }
        });
    }

    /// The `n` hottest keys, hottest first.
    pub(crate) fn top(&self, n: usize) -> Vec<HeavyHitter> {
        self.0.lock().top(n)
    }
}

/// Appends as much of `text` as fits in `MAX_KEY_BYTES + 4` bytes, whole characters
/// only: while `key` holds at most [`MAX_KEY_BYTES`], at least one more character fits,
/// so a key with text left over always ends longer than [`MAX_KEY_BYTES`].
fn push_capped(key: &mut String, text: &str) {
    let room = (MAX_KEY_BYTES + 4).saturating_sub(key.len());
    if text.len() <= room {
        key.push_str(text);
        return;
    }
    let mut end = room;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    key.push_str(&text[..end]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn keys_are_the_entries_truncated() {
        let hot = HotKeys::new();
        hot.offer(&entries(&[("remote_address", "10.0.0.1")]), 3);
        hot.offer(&entries(&[("api_key", "a"), ("path", "/x")]), 1);
        let long = "é".repeat(200);
        hot.offer(&entries(&[("user", &long)]), 2);
        let top = hot.top(10);
        assert_eq!(top[0].key, "remote_address=10.0.0.1");
        assert!(!top[0].truncated);
        assert_eq!(top[1].key, format!("user={}", "é".repeat(45)));
        assert!(top[1].truncated && top[1].key.len() <= MAX_KEY_BYTES);
        assert_eq!(top[2].key, "api_key=a, path=/x");
    }
}
