//! A token bucket with an overdraft, through a rule file and the `Limiter`: once its
//! bucket is empty a tenant may still borrow a few requests; those are flagged
//! `overdraft` and report nothing left, and refills repay the debt before anything is
//! left again. The clock is a manual one, so the output is the same on every run, and
//! the example checks it.
//!
//! Run it with `cargo run -p tollgate --example overdraft`.

use std::sync::Arc;
use std::time::Duration;

use tollgate::clock::ManualClock;
use tollgate::limiter::{Code, Limiter, RateLimitRequest};
use tollgate::rules::{from_str, Rules};
use tollgate::store::MemoryStore;

const RULES: &str = r#"
domain: reports
descriptors:
  # 2 reports a second, bursts of 4, and 2 more on credit once the bucket is empty.
  - key: tenant
    rate_limit:
      unit: second
      requests_per_unit: 2
      algorithm: token_bucket
      burst: 4
      overdraft: 2
      name: per_tenant
"#;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let clock = ManualClock::new(1_700_000_000_000_000_000);
    let rules = Arc::new(Rules::fixed(from_str("reports.yaml", RULES)?));
    let limiter = Limiter::new(rules, MemoryStore::new()).with_clock(Arc::new(clock.clone()));
    let report = RateLimitRequest::new("reports", [vec![("tenant", "acme")]]);

    let mut lines = Vec::new();
    let mut decide = |at: &str| -> Result<(), Box<dyn std::error::Error>> {
        let response = limiter.check_now(&report)?;
        let s = &response.statuses[0];
        let verdict = match (response.overall, s.overdraft) {
            (Code::Ok, false) => "allowed".to_string(),
            (Code::Ok, true) => "allowed in overdraft".to_string(),
            (Code::OverLimit, _) => {
                format!("rejected, retry after {} ms", s.retry_after / 1_000_000)
            }
        };
        let line = format!(
            "{at}: {verdict}; remaining {}, full in {} ms",
            s.remaining,
            s.reset_after / 1_000_000
        );
        println!("{line}");
        lines.push(line);
        Ok(())
    };

    // The bucket's 4, then 2 on credit, then a refusal: all at once.
    for _ in 0..7 {
        decide("t=0 ms")?;
    }
    // 500 ms refill one token: it repays half the debt, and is borrowed again.
    clock.advance(Duration::from_millis(500));
    decide("t=500 ms")?;
    // 1 s more repays the debt of 2: nothing is left yet, and one more is on credit.
    clock.advance(Duration::from_millis(1_000));
    decide("t=1500 ms")?;
    // 3 s later the debt is repaid and the bucket is full again.
    clock.advance(Duration::from_millis(3_000));
    decide("t=4500 ms")?;

    let expected = [
        "t=0 ms: allowed; remaining 3, full in 500 ms",
        "t=0 ms: allowed; remaining 2, full in 1000 ms",
        "t=0 ms: allowed; remaining 1, full in 1500 ms",
        "t=0 ms: allowed; remaining 0, full in 2000 ms",
        "t=0 ms: allowed in overdraft; remaining 0, full in 2500 ms",
        "t=0 ms: allowed in overdraft; remaining 0, full in 3000 ms",
        "t=0 ms: rejected, retry after 500 ms; remaining 0, full in 3000 ms",
        "t=500 ms: allowed in overdraft; remaining 0, full in 3000 ms",
        "t=1500 ms: allowed in overdraft; remaining 0, full in 2500 ms",
        "t=4500 ms: allowed; remaining 3, full in 500 ms",
    ];
    assert_eq!(lines, expected, "the decisions this example documents");
    Ok(())
}
