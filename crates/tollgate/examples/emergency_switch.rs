//! The emergency switch: stop enforcing a domain at once, without touching its rule
//! files, and start again. Requests are still decided, counted and reported while the
//! domain is in shadow; they are only answered OK.
//!
//! Run it with `cargo run -p tollgate --example emergency_switch`. `tollgate serve` moves
//! the same switch with `POST /v1/enforcement` (docs/operations.md).

use std::sync::Arc;

use tollgate::limiter::{Code, Enforcement, Limiter, Mode, RateLimitRequest};
use tollgate::rules::{from_str, Rules};
use tollgate::store::MemoryStore;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let set = from_str(
        "api.yaml",
        "domain: api
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 3}
",
    )?;
    let switch = Arc::new(Enforcement::default());
    let limiter = Limiter::new(Arc::new(Rules::fixed(set)), MemoryStore::new())
        .with_enforcement(Arc::clone(&switch));
    let request = RateLimitRequest::new("api", [vec![("tenant", "acme")]]);

    let answers: Vec<Code> = (0..4)
        .map(|_| limiter.check_now(&request).map(|r| r.overall))
        .collect::<Result<_, _>>()?;
    println!("enforced: {answers:?}");
    assert_eq!(answers.last(), Some(&Code::OverLimit));

    // An incident: the limits are wrong. Stop enforcing `api` now.
    switch.set("api", Mode::Shadow, "the on-call engineer", 1_800_000_000)?;
    let shadowed = limiter.check_now(&request)?;
    let status = &shadowed.statuses[0];
    println!(
        "in shadow: {:?}, would have been rejected: {}, {} left",
        shadowed.overall, status.would_reject, status.remaining
    );
    assert_eq!(shadowed.overall, Code::Ok);
    assert!(status.shadow && status.would_reject);

    // Fixed: enforce every domain again.
    switch.set("*", Mode::Enforce, "the on-call engineer", 1_800_000_600)?;
    let again = limiter.check_now(&request)?;
    println!("enforced again: {:?}", again.overall);
    assert_eq!(again.overall, Code::OverLimit);
    Ok(())
}
