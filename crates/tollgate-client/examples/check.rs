//! Asks a running `tollgate serve` for a decision over `POST /v1/check`.
//!
//! ```text
//! cargo run -p tollgate-client --example check -- http://127.0.0.1:8080 api user=alice path=/upload
//! ```
//!
//! The arguments: the service's HTTP URL, the domain, then the entries of one
//! descriptor as `key=value`. With the service down, the failure policy (open) answers.

use std::time::Duration;

use tollgate_client::service::{Descriptor, FailurePolicy, ServiceClient};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(url), Some(domain)) = (args.next(), args.next()) else {
        eprintln!("usage: check URL DOMAIN KEY=VALUE...");
        std::process::exit(2);
    };
    let descriptor: Descriptor = args
        .map(|entry| match entry.split_once('=') {
            Some((k, v)) => (k.to_owned(), v.to_owned()),
            None => (entry, String::new()),
        })
        .collect();
    let client = ServiceClient::new(&url)?
        .deadline(Duration::from_millis(200))
        .failure_policy(FailurePolicy::Open);
    let d = client.check(&domain, &[descriptor], 1).await?;
    println!(
        "allowed: {} (from {}), limit: {:?}, remaining: {:?}, reset: {:?}, retry after: {:?}",
        d.allowed,
        if d.from_policy() {
            "the failure policy"
        } else {
            "the service"
        },
        d.limit,
        d.remaining,
        d.reset,
        d.retry_after,
    );
    Ok(())
}
