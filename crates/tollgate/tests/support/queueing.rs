//! An upstream for load-shedding tests whose latency grows with its concurrency: a pool
//! of workers, each answer taking 10 ms of one; past the pool, requests queue.
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

/// An app answering `done` on each of `paths` (GET) with `workers` workers.
pub fn queueing_app(workers: usize, paths: &[&str]) -> axum::Router {
    let pool = Arc::new(Semaphore::new(workers));
    let work = move || {
        let pool = Arc::clone(&pool);
        async move {
            let _worker = pool.acquire().await.unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
            "done"
        }
    };
    paths.iter().fold(axum::Router::new(), |app, path| {
        app.route(path, axum::routing::get(work.clone()))
    })
}
