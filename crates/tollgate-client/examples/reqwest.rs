//! Sends requests through a `reqwest-middleware` client with [`RetryMiddleware`]: each
//! `429` or `503` is retried after `Retry-After` (or the `RateLimit` reset), and the
//! pre-check waits for a reset rather than send a request the server would reject.
//!
//! ```text
//! cargo run -p tollgate-client --features reqwest --example reqwest -- http://127.0.0.1:8000/api/items 5
//! ```
//!
//! The arguments: a URL (say, behind `tollgate proxy`) and how many GETs to send in a
//! row (3 by default). Each line says the status and how long the call took, waits
//! included.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate_client::backoff::Backoff;
use tollgate_client::middleware::RetryMiddleware;
use tollgate_client::precheck::Exhausted;
use tollgate_client::{Precheck, WhenExhausted};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let Some(url) = args.next() else {
        eprintln!("usage: reqwest URL [COUNT]");
        std::process::exit(2);
    };
    let count: u32 = args.next().map_or(Ok(3), |n| n.parse())?;
    let precheck = Arc::new(Precheck::new(WhenExhausted::Wait {
        max: Duration::from_secs(5),
    }));
    let retry = RetryMiddleware::new()
        .backoff(Backoff::new(Duration::from_millis(100), Duration::from_secs(10)).max_retries(3))
        .precheck(precheck);
    let client = reqwest_middleware::ClientBuilder::new(reqwest_middleware::reqwest::Client::new())
        .with(retry)
        .build();
    for i in 1..=count {
        let start = Instant::now();
        match client.get(&url).send().await {
            Ok(response) => println!("{i}: {} after {:?}", response.status(), start.elapsed()),
            Err(reqwest_middleware::Error::Middleware(e)) if e.is::<Exhausted>() => {
                println!("{i}: held back by the pre-check: {e}");
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}
