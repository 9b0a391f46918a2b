//! Rate limiting inside your own process: per-user GCRA plus a login lockout, on the
//! in-memory store, with the system clock.
//!
//! Run it with `cargo run -p tollgate --example in_process`.

use std::time::Duration;

use tollgate::algorithm::{Algorithm, FixedWindow, Gcra, InvalidLimit, Limit};
use tollgate::clock::{Clock, SystemClock};
use tollgate::store::{Check, MemoryStore};

fn main() -> Result<(), InvalidLimit> {
    let store = MemoryStore::builder().max_keys(1_000_000).build();
    let clock = SystemClock;

    // 5 requests per second per user, bursts of 10.
    let api = Limit::new(Algorithm::Gcra(
        Gcra::new(5, Duration::from_secs(1)).with_burst(10),
    ))?;
    let mut admitted = 0;
    for _ in 0..15 {
        let decision = store.check_one(clock.now(), &Check::new(&api, "user:42", 1));
        if decision.allowed {
            admitted += 1;
        } else {
            println!(
                "user:42 rejected: retry in {:?}, {} left",
                Duration::from_nanos(decision.retry_after),
                decision.remaining
            );
            break;
        }
    }
    println!("user:42 got {admitted} requests through at once");

    // 3 login attempts per minute, then locked out for 15 minutes.
    let login = Limit::new(Algorithm::FixedWindow(FixedWindow::new(
        3,
        Duration::from_secs(60),
    )))?
    .with_lockout(Duration::from_secs(15 * 60));
    for attempt in 1..=5 {
        let d = store.check_one(clock.now(), &Check::new(&login, "login:alice", 1));
        match d.retry_after_secs() {
            None => println!("login attempt {attempt}: allowed, {} left", d.remaining),
            Some(secs) => println!("login attempt {attempt}: locked out, Retry-After: {secs}"),
        }
    }
    Ok(())
}
