//! Fixed windows on the real clock are aligned to the epoch: a test that counts
//! requests against a per-minute limit fails if a minute ends halfway through it.
#![allow(dead_code, clippy::unwrap_used)]

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Blocks until at least `margin` seconds are left in the current minute (of the wall
/// clock, which Redis `TIME` follows too). Call it before the first counted request;
/// the margin must cover the test from there to its last check.
pub fn away_from_a_minute_boundary(margin: u64) {
    loop {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        if 60 - now.as_secs() % 60 > margin {
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
