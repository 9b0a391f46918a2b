//! `check` and `http` modes: HTTP/1.1 requests with a keep-alive connection pool
//! (one connection per worker at most).

use std::future::Future;
use std::time::Duration;

use reqwest::{Client, StatusCode, Url};

use crate::cli::KeyArgs;
use crate::engine::{Outcome, Target};
use crate::error_chain;

/// Builds the shared HTTP client.
fn client(concurrency: u32, connect_timeout: Duration) -> Result<Client, String> {
    Client::builder()
        .pool_max_idle_per_host(concurrency as usize)
        .tcp_nodelay(true)
        .connect_timeout(connect_timeout)
        .build()
        .map_err(|e| format!("cannot create HTTP client: {}", error_chain(&e)))
}

/// Parses and checks a target URL.
fn parse_url(url: &str) -> Result<Url, String> {
    let parsed = Url::parse(url).map_err(|e| format!("invalid URL `{url}`: {e}"))?;
    match parsed.scheme() {
        "http" => Ok(parsed),
        "https" => Err(format!(
            "invalid URL `{url}`: https is not supported (this build has no TLS)"
        )),
        other => Err(format!("invalid URL `{url}`: unsupported scheme `{other}`")),
    }
}

/// Maps an HTTP status to an outcome; `ok` says which statuses count as allowed.
fn classify(status: StatusCode, ok: fn(StatusCode) -> bool) -> Outcome {
    if ok(status) {
        Outcome::Ok
    } else if status == StatusCode::TOO_MANY_REQUESTS {
        Outcome::OverLimit
    } else if status.is_server_error() {
        Outcome::Error(format!("HTTP {status}"))
    } else {
        Outcome::Other
    }
}

/// Sends a prepared request, reads the whole body (so the connection is reused) and
/// classifies the answer.
async fn send(req: reqwest::RequestBuilder, ok: fn(StatusCode) -> bool) -> Outcome {
    match req.send().await {
        Ok(resp) => {
            let status = resp.status();
            match resp.bytes().await {
                Ok(_) => classify(status, ok),
                Err(e) => Outcome::Error(format!("reading body: {}", error_chain(&e))),
            }
        }
        Err(e) => Outcome::Error(error_chain(&e)),
    }
}

/// `POST`s check requests to Tollgate's `/v1/check`.
pub struct CheckTarget {
    client: Client,
    url: Url,
    /// The JSON body up to the key number: `{"domain":D,"descriptors":[{KEY:"u`.
    body_prefix: String,
    /// Number of distinct keys.
    keys: u64,
}

/// The rest of the body after the key number.
const BODY_SUFFIX: &str = r#""}],"hits":1}"#;

impl CheckTarget {
    /// Prepares a client for `url`.
    pub fn new(
        url: &str,
        keys: KeyArgs,
        concurrency: u32,
        connect_timeout: Duration,
    ) -> Result<Self, String> {
        // JSON-encode (quote and escape) the domain and the entry key once.
        let domain = serde_json::Value::from(keys.domain);
        let key = serde_json::Value::from(keys.key);
        Ok(Self {
            client: client(concurrency, connect_timeout)?,
            url: parse_url(url)?,
            body_prefix: format!(r#"{{"domain":{domain},"descriptors":[{{{key}:"u"#),
            keys: keys.keys,
        })
    }

    /// The JSON body of request `seq`.
    fn body(&self, seq: u64) -> String {
        format!("{}{}{BODY_SUFFIX}", self.body_prefix, seq % self.keys)
    }
}

impl Target for CheckTarget {
    fn call(&self, seq: u64) -> impl Future<Output = Outcome> + Send {
        let req = self
            .client
            .post(self.url.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(self.body(seq));
        send(req, |s| s == StatusCode::OK)
    }
}

/// `GET`s one URL.
pub struct GetTarget {
    client: Client,
    url: Url,
}

impl GetTarget {
    /// Prepares a client for `url`.
    pub fn new(url: &str, concurrency: u32, connect_timeout: Duration) -> Result<Self, String> {
        Ok(Self {
            client: client(concurrency, connect_timeout)?,
            url: parse_url(url)?,
        })
    }
}

impl Target for GetTarget {
    fn call(&self, _seq: u64) -> impl Future<Output = Outcome> + Send {
        send(self.client.get(self.url.clone()), |s| s.is_success())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(domain: &str, key: &str, n: u64) -> KeyArgs {
        KeyArgs {
            keys: n,
            domain: domain.to_owned(),
            key: key.to_owned(),
        }
    }

    #[test]
    fn check_body_is_the_documented_json() -> Result<(), String> {
        let t = CheckTarget::new(
            "http://127.0.0.1:1/v1/check",
            keys("bench", "user", 10_000),
            4,
            Duration::from_secs(1),
        )?;
        assert_eq!(
            t.body(10_123),
            r#"{"domain":"bench","descriptors":[{"user":"u123"}],"hits":1}"#
        );
        Ok(())
    }

    #[test]
    fn check_body_escapes_strings() -> Result<(), String> {
        let t = CheckTarget::new(
            "http://127.0.0.1:1/v1/check",
            keys("a\"b", "k\\", 5),
            4,
            Duration::from_secs(1),
        )?;
        let v: serde_json::Value = serde_json::from_str(&t.body(7)).map_err(|e| e.to_string())?;
        assert_eq!(
            v,
            serde_json::json!({"domain": "a\"b", "descriptors": [{"k\\": "u2"}], "hits": 1})
        );
        Ok(())
    }

    #[test]
    fn urls() {
        assert!(parse_url("http://127.0.0.1:8080/").is_ok());
        assert!(parse_url("https://127.0.0.1/").is_err_and(|e| e.contains("no TLS")));
        assert!(parse_url("127.0.0.1:8080").is_err());
        assert!(parse_url("not a url").is_err_and(|e| e.starts_with("invalid URL")));
    }

    #[test]
    fn statuses() {
        let check = |s: StatusCode| s == StatusCode::OK;
        assert_eq!(classify(StatusCode::OK, check), Outcome::Ok);
        assert_eq!(classify(StatusCode::NO_CONTENT, check), Outcome::Other);
        assert_eq!(
            classify(StatusCode::TOO_MANY_REQUESTS, check),
            Outcome::OverLimit
        );
        assert_eq!(classify(StatusCode::NOT_FOUND, check), Outcome::Other);
        assert!(matches!(
            classify(StatusCode::SERVICE_UNAVAILABLE, check),
            Outcome::Error(_)
        ));
        assert_eq!(
            classify(StatusCode::NO_CONTENT, |s| s.is_success()),
            Outcome::Ok
        );
    }
}
