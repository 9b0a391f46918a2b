//! Limits shared through Redis: two `Limiter`s (think two instances of a service) on one
//! Redis share one counter, and a rule's `failure_mode` answers when Redis is away.
//!
//! Needs a Redis: `redis-server --port 6379 &` then
//! `cargo run -p tollgate --features redis --example redis_store [redis://127.0.0.1:6379]`.

use std::sync::Arc;
use std::time::Duration;

use tollgate::limiter::{Code, Limiter, RateLimitRequest};
use tollgate::rules::{from_str, Rules};
use tollgate::store::RedisStore;

const RULES: &str = "
domain: api
failure_mode: local_fallback      # Redis down: each instance keeps half the limit
local_fallback_divisor: 2
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 5, algorithm: gcra}
";

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "redis://127.0.0.1:6379".into());
    let rules = Arc::new(Rules::fixed(from_str("api.yaml", RULES)?));
    let prefix = format!("example-{}", std::process::id());
    let mut instances = Vec::new();
    for _ in 0..2 {
        let store = RedisStore::builder(url.as_str())
            .prefix(prefix.as_str())
            .deadline(Duration::from_millis(20))
            .connect()
            .await?;
        instances.push(Limiter::new(Arc::clone(&rules), store));
    }
    let request = RateLimitRequest::new("api", [vec![("user", "alice")]]);
    for attempt in 1..=7 {
        let limiter = &instances[attempt % 2];
        let response = limiter.check(&request).await?;
        let status = &response.statuses[0];
        println!(
            "attempt {attempt} via instance {}: {:?}, remaining {}{}",
            attempt % 2,
            response.overall,
            status.remaining,
            match response.store_failure {
                Some(kind) => format!(" (Redis failed: {kind}; answered by failure_mode)"),
                None => String::new(),
            }
        );
        if response.overall == Code::OverLimit {
            println!("  retry after {:?} s", status.retry_after_secs());
        }
    }
    Ok(())
}
