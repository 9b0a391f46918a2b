//! The live dashboard: `GET /dashboard`, a page embedded in the binary that polls
//! `GET /v1/stats` every second and draws its charts itself (no CDN, no network), on
//! the listener that serves the admin endpoints. The page holds no data: it is served
//! to anyone who reaches the admin endpoints; `/v1/stats` answers only as `/rules`
//! does (with an admin token, only requests that carry it, which the page takes from
//! its URL's fragment, `#token=…`).
//!
//! - `hot.rs`: each rule's hottest keys (a Space-Saving sketch).
//! - `tally.rs`: the counters the metrics keep for it, and the per-second history.
//! - `stats.rs`: the `/v1/stats` document.
//! - `page.html`: the page.

mod hot;
pub(crate) mod stats;
mod tally;

pub(crate) use hot::HotKeys;
pub(crate) use tally::{tick, RuleCount, Tally};

use axum::http::header;
use axum::response::IntoResponse;

/// Rules that keep hot keys and a history of their own (the first that count): a bound
/// on the memory whatever `detailed_metric` makes of the rules' paths.
pub(crate) const SKETCHED_RULES: usize = 256;

/// The page.
const PAGE: &str = include_str!("page.html");

/// `GET /dashboard`.
pub(crate) async fn page() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            // Everything the page needs is in it; it fetches only its own origin.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                 connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
                 frame-ancestors 'none'",
            ),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        PAGE,
    )
}
