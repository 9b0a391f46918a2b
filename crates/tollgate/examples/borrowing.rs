//! Borrowing from a shared pool, through a rule file and the `Limiter`: two tenants are
//! each guaranteed 2 requests a second and may go up to 5 while the domain's pool (6 a
//! second) has room. The first tenant bursts past its guarantee from the pool; the
//! second still gets its guarantee once the pool is spent, but may not borrow. The clock
//! is a manual one, so the output is the same on every run, and the example checks it.
//!
//! Run it with `cargo run -p tollgate --example borrowing`.

use std::sync::Arc;

use tollgate::clock::ManualClock;
use tollgate::limiter::{Code, Limiter, RateLimitRequest};
use tollgate::rules::{from_str, Rules};
use tollgate::store::MemoryStore;

const RULES: &str = r#"
domain: saas
pools:
  - {name: shared, rate_limit: {unit: second, requests_per_unit: 6}}
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 2, borrow: {from: shared, up_to: 5}}
"#;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // On a whole second: the fixed windows start here.
    let clock = ManualClock::new(1_700_000_000_000_000_000);
    let rules = Arc::new(Rules::fixed(from_str("saas.yaml", RULES)?));
    let limiter = Limiter::new(rules, MemoryStore::new()).with_clock(Arc::new(clock));

    let mut lines = Vec::new();
    let mut send = |tenant: &str, n: usize| -> Result<(), Box<dyn std::error::Error>> {
        let request = RateLimitRequest::new("saas", [vec![("tenant", tenant)]]);
        let mut verdicts = Vec::new();
        for _ in 0..n {
            let response = limiter.check_now(&request)?;
            let s = &response.statuses[0];
            verdicts.push(match (response.overall, s.over_soft_limit) {
                (Code::Ok, false) => "own",
                (Code::Ok, true) => "borrowed",
                (Code::OverLimit, _) => "refused",
            });
        }
        let line = format!("{tenant}: {}", verdicts.join(", "));
        println!("{line}");
        lines.push(line);
        Ok(())
    };

    // acme: its 2, then 3 from the pool (5 in all), then refused: past `up_to`.
    send("acme", 6)?;
    // globex: the pool has 1 left, so its guarantee of 2 is served (the second charged
    // to the spent pool), and borrowing is refused.
    send("globex", 3)?;

    let expected = [
        "acme: own, own, borrowed, borrowed, borrowed, refused",
        "globex: own, own, refused",
    ];
    assert_eq!(lines, expected, "the decisions this example documents");
    Ok(())
}
