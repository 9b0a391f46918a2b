//! A GCRA with a warm-up, through a rule file and the `Limiter`: a key that has been
//! idle starts cold, at a third of its rate, and reaches the full rate after `warmup`
//! of use. A client here asks every 10 ms; the example prints how many of its requests
//! pass in each second from cold, then after an idle spell that cools the key again.
//! The clock is a manual one, so the output is the same on every run, and the example
//! checks it.
//!
//! Run it with `cargo run -p tollgate --example warmup`.

use std::sync::Arc;
use std::time::Duration;

use tollgate::clock::ManualClock;
use tollgate::limiter::{Code, Limiter, RateLimitRequest};
use tollgate::rules::{from_str, Rules};
use tollgate::store::MemoryStore;

const RULES: &str = r#"
domain: search
descriptors:
  # 20 searches a second per tenant, one at a time; an idle tenant warms up over 5 s.
  - key: tenant
    rate_limit:
      unit: second
      requests_per_unit: 20
      algorithm: gcra
      burst: 1
      warmup: 5s
"#;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let clock = ManualClock::new(1_700_000_000_000_000_000);
    let rules = Arc::new(Rules::fixed(from_str("search.yaml", RULES)?));
    let limiter = Limiter::new(rules, MemoryStore::new()).with_clock(Arc::new(clock.clone()));
    let search = RateLimitRequest::new("search", [vec![("tenant", "acme")]]);

    // Admissions in each of `seconds` seconds, asking every 10 ms.
    let run = |seconds: usize| -> Result<Vec<usize>, Box<dyn std::error::Error>> {
        let mut counts = vec![0; seconds];
        for count in counts.iter_mut() {
            for _ in 0..100 {
                if limiter.check_now(&search)?.overall == Code::Ok {
                    *count += 1;
                }
                clock.advance(Duration::from_millis(10));
            }
        }
        Ok(counts)
    };

    let cold = run(8)?;
    for (second, n) in cold.iter().enumerate() {
        println!("second {second}: {n} admitted of 100 asked (rate 20/s)");
    }
    // Idle: the tenant's key is cold again once its bucket is full and the warm-up has
    // passed.
    clock.advance(Duration::from_secs(10));
    let again = run(2)?;
    println!("after 10 s idle: {again:?} in the next two seconds");

    // A cold second runs near a third of the rate, then the key warms: the full rate
    // after 5 s of use (the time between a request's instant and the next ask, up to
    // 10 ms here, is within the grace of two intervals: it does not cool the key).
    assert_eq!(cold, [7, 8, 8, 10, 13, 19, 20, 20]);
    assert_eq!(again, cold[..2], "cold again");
    Ok(())
}
