//! Deciding requests with an Envoy-style rule file through the `Limiter` seam: the
//! same call the service, the HTTP API and the gateway make.
//!
//! Run it with `cargo run -p tollgate --example rule_file`.

use std::sync::Arc;

use tollgate::limiter::{Code, Limiter, RateLimitRequest};
use tollgate::rules::{from_str, Rules};
use tollgate::store::MemoryStore;

const RULES: &str = r#"
domain: api
descriptors:
  # Every API key: 3 per second sustained, bursts of 5 (GCRA).
  - key: api_key
    rate_limit: {unit: second, requests_per_unit: 3, algorithm: gcra, burst: 5}
    descriptors:
      # Uploads: 2 per minute on top, exact over any rolling minute.
      - key: path
        value: /upload*
        rate_limit: {unit: minute, requests_per_unit: 2, algorithm: sliding_log}
"#;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rules = Arc::new(Rules::fixed(from_str("api.yaml", RULES)?));
    let limiter = Limiter::new(rules, MemoryStore::new());

    // One request with two descriptors: the key's own limit and the upload limit.
    let upload = RateLimitRequest::new(
        "api",
        [
            vec![("api_key", "k-123")],
            vec![("api_key", "k-123"), ("path", "/upload/photo.jpg")],
        ],
    );
    for attempt in 1..=4 {
        let response = limiter.check_now(&upload)?;
        let verdict = match response.overall {
            Code::Ok => "allowed".to_string(),
            Code::OverLimit => format!(
                "rejected, retry after {:?} s",
                response
                    .statuses
                    .iter()
                    .filter_map(|s| s.retry_after_secs())
                    .max()
            ),
        };
        let remaining: Vec<u64> = response.statuses.iter().map(|s| s.remaining).collect();
        println!("upload {attempt}: {verdict}; remaining per descriptor {remaining:?}");
    }
    Ok(())
}
