//! [`ServiceClient`]: asks `tollgate serve` for a decision over its `POST /v1/check`
//! API, on a pooled HTTP connection, within a per-call deadline, and with the caller's
//! [`FailurePolicy`] when the service cannot answer. With the `grpc` feature,
//! `ServiceClient::grpc` asks over Envoy's gRPC API (`ShouldRateLimit`, tonic) instead,
//! with the same [`Decision`]s.
//!
//! ```no_run
//! use std::time::Duration;
//! use tollgate_client::service::{Descriptor, FailurePolicy, ServiceClient};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let client = ServiceClient::new("http://127.0.0.1:8080")?
//!     .deadline(Duration::from_millis(50))
//!     .failure_policy(FailurePolicy::Open);
//! let user = Descriptor::new().entry("user", "alice").entry("path", "/upload");
//! let decision = client.check("api", &[user], 1).await?;
//! if !decision.allowed {
//!     println!("refused; retry after {:?}", decision.retry_after);
//! }
//! # Ok(())
//! # }
//! ```
//!
//! **What a decision is.** The service decides the descriptors of one call together:
//! the call is allowed only if every descriptor is within its limit, and a refused call
//! charges nothing. [`Decision`] carries that overall answer and, summarised, the limit
//! that binds: when refused, the over-limit descriptor that frees up last (its limit,
//! `remaining`, reset and `retry_after`); when allowed, the matched descriptor with the
//! least remaining. [`Decision::statuses`] has every descriptor's own answer.
//!
//! **No batching of separate checks.** Concurrent checks are not merged into one call:
//! the API decides a call's descriptors as one, all or nothing, so two callers' checks
//! sent as one call would refuse one caller because of the other's limit and charge
//! neither. Each `check` is its own call; the pooled connection (HTTP/1.1 keep-alive,
//! several at once) keeps that cheap. To have several descriptors decided together,
//! pass them in one `check`.
//!
//! **When the service cannot answer** (no connection, the deadline passed, a 5xx such
//! as the 503 of a service without rules; over gRPC, a status such as `UNAVAILABLE` or
//! the `UNKNOWN` of a service without rules), `check` answers from the
//! [`FailurePolicy`]: `Open` allows, `Closed` refuses, and the decision's
//! [`origin`](Decision::origin) says so and keeps the error. A request the service
//! refuses as malformed (400, 413; gRPC `INVALID_ARGUMENT`) is the caller's mistake and is returned as an
//! [`Error`], whatever the policy.
//!
//! **The answer's size is capped.** The client reads at most
//! [`DEFAULT_MAX_ANSWER_BYTES`](ServiceClient::DEFAULT_MAX_ANSWER_BYTES) (64 KiB) of an
//! answer's body, [`max_answer_bytes`](ServiceClient::max_answer_bytes) to change it: a
//! decision on the service's default request limits (64 descriptors) is well within it.
//! A larger answer is [`Error::AnswerTooLarge`], not read further; for a server error
//! (5xx) the failure policy decides, as for any other.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

#[cfg(feature = "grpc")]
mod grpc;

/// A descriptor: entries (key, value) in order. A key may repeat.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Descriptor {
    /// The entries, in order.
    pub entries: Vec<(String, String)>,
}

impl Descriptor {
    /// An empty descriptor.
    pub fn new() -> Self {
        Self::default()
    }

    /// This descriptor with one more entry.
    #[must_use]
    pub fn entry(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.entries.push((key.into(), value.into()));
        self
    }
}

impl<K: Into<String>, V: Into<String>> FromIterator<(K, V)> for Descriptor {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        Descriptor {
            entries: iter
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        }
    }
}

/// What [`ServiceClient::check`] answers when the service cannot: no connection, the
/// deadline passed, or a server error (5xx).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailurePolicy {
    /// Allow the request (Envoy's default, `failure_mode_deny: false`): an outage of the
    /// limiter does not become an outage of the API.
    #[default]
    Open,
    /// Refuse the request: the limit holds even while it cannot be checked.
    Closed,
}

/// Where a [`Decision`] came from.
#[derive(Debug, Clone)]
pub enum Origin {
    /// The service decided.
    Service,
    /// The service could not answer; the [`FailurePolicy`] decided, for this cause.
    Policy(Arc<Error>),
}

/// One descriptor's answer, as the service gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescriptorStatus {
    /// Within its limit (or not limited).
    pub ok: bool,
    /// A rule matched the descriptor; if not, it is not limited.
    pub matched: bool,
    /// The rule's name, if it has one.
    pub name: Option<String>,
    /// Requests per unit of the matched rule.
    pub limit: Option<u64>,
    /// The rule's unit as the service names it (`SECOND`, `MINUTE`, `HOUR`, `DAY`, …).
    pub unit: Option<String>,
    /// Requests left in the current window.
    pub remaining: u64,
    /// Time until the window resets (whole seconds, rounded up).
    pub reset: Duration,
    /// When over the limit: how long until a request can pass (whole seconds, rounded
    /// up); `None` when within it, or when it never will (a deny rule).
    pub retry_after: Option<Duration>,
    /// The rule is in shadow mode: counted and reported, never refusing.
    pub shadow: bool,
}

/// The answer to one [`ServiceClient::check`].
#[derive(Debug, Clone)]
pub struct Decision {
    /// The request may go ahead.
    pub allowed: bool,
    /// Requests per unit of the limit that binds (see the [module docs](self)); `None`
    /// when no descriptor matched a rule, or when the policy decided.
    pub limit: Option<u64>,
    /// Requests left under that limit.
    pub remaining: Option<u64>,
    /// Time until that limit's window resets.
    pub reset: Option<Duration>,
    /// When refused: how long to wait before trying again (the longest of the
    /// over-limit descriptors'); `None` when allowed, when the service gives no time
    /// (a deny rule), or when the policy decided.
    pub retry_after: Option<Duration>,
    /// Each descriptor's answer, in the order sent (empty when the policy decided).
    pub statuses: Vec<DescriptorStatus>,
    /// The service or the failure policy.
    pub origin: Origin,
}

impl Decision {
    /// Whether the [`FailurePolicy`] decided, the service being unreachable.
    pub fn from_policy(&self) -> bool {
        matches!(self.origin, Origin::Policy(_))
    }

    fn from_statuses(allowed: bool, statuses: Vec<DescriptorStatus>) -> Decision {
        let binding = if allowed {
            statuses
                .iter()
                .filter(|s| s.matched && s.limit.is_some())
                .min_by_key(|s| s.remaining)
        } else {
            // The over-limit descriptor that frees up last; a deny (no retry time) first.
            statuses
                .iter()
                .filter(|s| !s.ok)
                .max_by_key(|s| s.retry_after.map_or((1, Duration::ZERO), |d| (0, d)))
        };
        Decision {
            allowed,
            limit: binding.and_then(|s| s.limit),
            remaining: binding.map(|s| s.remaining),
            reset: binding.map(|s| s.reset),
            retry_after: if allowed {
                None
            } else {
                binding.and_then(|s| s.retry_after)
            },
            statuses,
            origin: Origin::Service,
        }
    }

    fn by_policy(policy: FailurePolicy, cause: Error) -> Decision {
        Decision {
            allowed: policy == FailurePolicy::Open,
            limit: None,
            remaining: None,
            reset: None,
            retry_after: None,
            statuses: Vec::new(),
            origin: Origin::Policy(Arc::new(cause)),
        }
    }
}

/// Why a check failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The service's URL is not a valid `http://` URL.
    #[error("invalid service URL {url:?}")]
    InvalidUrl {
        /// The URL given.
        url: String,
        /// Why it is invalid.
        #[source]
        source: Option<http::Error>,
    },
    /// The request could not be built.
    #[error("could not build the request")]
    Request(#[source] http::Error),
    /// No connection to the service, or it broke before the answer.
    #[error("the rate limit service could not be reached")]
    Unreachable(#[source] hyper_util::client::legacy::Error),
    /// The answer's body could not be read.
    #[error("the rate limit service's answer could not be read")]
    Body(#[source] hyper::Error),
    /// The answer's body is longer than the client reads
    /// ([`ServiceClient::max_answer_bytes`]); the rest was not read.
    #[error("the rate limit service's answer ({status}) is larger than {limit} bytes")]
    AnswerTooLarge {
        /// The answer's status.
        status: StatusCode,
        /// The cap, in bytes.
        limit: usize,
        /// What the cap reported (a `http_body_util::LengthLimitError`).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// No answer within the deadline.
    #[error("the rate limit service did not answer within {0:?}")]
    Deadline(Duration),
    /// The service answered a server error (5xx), e.g. 503 while it has no rules.
    #[error("the rate limit service failed: {status} {body}")]
    Unavailable {
        /// The status.
        status: StatusCode,
        /// The body, as text.
        body: String,
    },
    /// The service refused the request as malformed (4xx other than 429): the
    /// failure policy does not apply.
    #[error("the rate limit service refused the request: {status} {body}")]
    Refused {
        /// The status.
        status: StatusCode,
        /// The body, as text (it says what is wrong).
        body: String,
    },
    /// The gRPC address is not a valid URI.
    #[cfg(feature = "grpc")]
    #[error("invalid gRPC address {addr:?}")]
    InvalidGrpcAddress {
        /// The address given.
        addr: String,
        /// Why it is invalid.
        #[source]
        source: tonic::transport::Error,
    },
    /// The gRPC call failed: unavailable (no connection, `UNAVAILABLE`, `UNKNOWN` as
    /// while the service has no rules, …) or refused (`INVALID_ARGUMENT`).
    #[cfg(feature = "grpc")]
    #[error("the rate limit service's gRPC call failed")]
    Grpc(#[source] tonic::Status),
    /// `hits` the gRPC API cannot carry: 0 (which it reads as 1) or more than
    /// `u32::MAX`.
    #[cfg(feature = "grpc")]
    #[error("hits must be from 1 to 4294967295 over gRPC, not {0}")]
    Hits(u64),
    /// The answer is not the JSON the API sends.
    #[error("the rate limit service's answer is not a decision: {0}")]
    Decode(String),
}

impl Error {
    /// Whether the service could not answer, so that the failure policy applies.
    pub fn is_unavailable(&self) -> bool {
        #[cfg(feature = "grpc")]
        if let Error::Grpc(status) = self {
            use tonic::Code;
            return !matches!(
                status.code(),
                Code::InvalidArgument
                    | Code::OutOfRange
                    | Code::Unimplemented
                    | Code::PermissionDenied
                    | Code::Unauthenticated
                    | Code::NotFound
                    | Code::FailedPrecondition
            );
        }
        matches!(
            self,
            Error::Unreachable(_) | Error::Body(_) | Error::Deadline(_) | Error::Unavailable { .. }
        ) || matches!(self, Error::AnswerTooLarge { status, .. } if status.is_server_error())
    }
}

/// A client of `tollgate serve`'s `POST /v1/check`. Cheap to clone; clones share the
/// connection pool.
#[derive(Debug, Clone)]
pub struct ServiceClient {
    transport: Transport,
    deadline: Duration,
    policy: FailurePolicy,
    max_answer_bytes: usize,
}

/// How the client reaches the service.
#[derive(Debug, Clone)]
// One per client; boxing would add an indirection to every call for a few bytes saved.
#[allow(clippy::large_enum_variant)]
enum Transport {
    /// `POST /v1/check` at `uri`.
    Http { http: HttpClient, uri: Uri },
    /// Envoy's `ShouldRateLimit`.
    #[cfg(feature = "grpc")]
    Grpc(
        envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient<
            tonic::transport::Channel,
        >,
    ),
}

impl ServiceClient {
    /// The default per-call deadline.
    pub const DEFAULT_DEADLINE: Duration = Duration::from_millis(100);

    /// The default cap on an answer's body: 64 KiB.
    pub const DEFAULT_MAX_ANSWER_BYTES: usize = 64 * 1024;

    /// A client of the service at `base` (`http://host:port`, the HTTP listener),
    /// with a deadline of [`DEFAULT_DEADLINE`](Self::DEFAULT_DEADLINE) and
    /// [`FailurePolicy::Open`]. It connects on the first check, not here.
    pub fn new(base: &str) -> Result<Self, Error> {
        let invalid = |source| Error::InvalidUrl {
            url: base.to_owned(),
            source,
        };
        let parsed: Uri = base
            .parse()
            .map_err(|e: http::uri::InvalidUri| invalid(Some(e.into())))?;
        if parsed.scheme_str() != Some("http") || parsed.authority().is_none() {
            return Err(invalid(None));
        }
        let path = parsed.path().trim_end_matches('/');
        let uri = Uri::builder()
            .scheme("http")
            .authority(parsed.authority().map_or("", |a| a.as_str()))
            .path_and_query(format!("{path}/v1/check"))
            .build()
            .map_err(|e| invalid(Some(e)))?;
        let http = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build_http();
        Ok(ServiceClient {
            transport: Transport::Http { http, uri },
            deadline: Self::DEFAULT_DEADLINE,
            policy: FailurePolicy::Open,
            max_answer_bytes: Self::DEFAULT_MAX_ANSWER_BYTES,
        })
    }

    /// A client of the service's gRPC listener at `addr` (`host:port` or
    /// `http://host:port`), over Envoy's API (`ShouldRateLimit`) on one HTTP/2
    /// connection, opened on the first check (and again after it breaks). Envoy's API
    /// gives no retry-after per descriptor: a refused decision's `retry_after` is then
    /// the time until the binding window resets.
    #[cfg(feature = "grpc")]
    pub fn grpc(addr: &str) -> Result<Self, Error> {
        Ok(ServiceClient {
            transport: Transport::Grpc(grpc::channel(addr)?),
            deadline: Self::DEFAULT_DEADLINE,
            policy: FailurePolicy::Open,
            max_answer_bytes: Self::DEFAULT_MAX_ANSWER_BYTES,
        })
    }

    /// Each call's deadline: connecting, sending and reading the answer.
    #[must_use]
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// What to answer when the service cannot.
    #[must_use]
    pub fn failure_policy(mut self, policy: FailurePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The most bytes of an answer's body the client reads (over HTTP); past it, the
    /// check fails with [`Error::AnswerTooLarge`]. The default is
    /// [`DEFAULT_MAX_ANSWER_BYTES`](Self::DEFAULT_MAX_ANSWER_BYTES); raise it for a
    /// service that allows more descriptors per call than its default 64.
    #[must_use]
    pub fn max_answer_bytes(mut self, limit: usize) -> Self {
        self.max_answer_bytes = limit;
        self
    }

    /// Asks whether `hits` requests (at least 1) described by `descriptors` of `domain`
    /// may go ahead, decided together. When the service cannot answer, the failure
    /// policy decides; `Err` only for a request the service refuses as malformed, or an
    /// answer that is not a decision.
    pub async fn check(
        &self,
        domain: &str,
        descriptors: &[Descriptor],
        hits: u64,
    ) -> Result<Decision, Error> {
        let call = async {
            match &self.transport {
                Transport::Http { http, uri } => {
                    let to = Endpoint {
                        http,
                        uri,
                        max_answer_bytes: self.max_answer_bytes,
                    };
                    ask(&to, domain, descriptors, hits).await
                }
                #[cfg(feature = "grpc")]
                Transport::Grpc(client) => {
                    grpc::ask(client.clone(), domain, descriptors, hits).await
                }
            }
        };
        let answer = tokio::time::timeout(self.deadline, call)
            .await
            .unwrap_or(Err(Error::Deadline(self.deadline)));
        match answer {
            Err(e) if e.is_unavailable() => {
                tracing::debug!(error = %e, policy = ?self.policy, "rate limit service unavailable");
                Ok(Decision::by_policy(self.policy, e))
            }
            other => other,
        }
    }
}

/// The pooled hyper client of the HTTP transport.
type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Where and how one `POST /v1/check` goes.
struct Endpoint<'a> {
    http: &'a HttpClient,
    uri: &'a Uri,
    max_answer_bytes: usize,
}

/// One `POST /v1/check`, without deadline or policy.
async fn ask(
    to: &Endpoint<'_>,
    domain: &str,
    descriptors: &[Descriptor],
    hits: u64,
) -> Result<Decision, Error> {
    let body = json!({
        "domain": domain,
        "descriptors": descriptors.iter().map(|d| &d.entries).collect::<Vec<_>>(),
        "hits": hits,
    });
    let request = Request::builder()
        .method(Method::POST)
        .uri(to.uri.clone())
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(Error::Request)?;
    let response = to.http.request(request).await.map_err(Error::Unreachable)?;
    let status = response.status();
    let limit = to.max_answer_bytes;
    let bytes = Limited::new(response.into_body(), limit)
        .collect()
        .await
        .map_err(|e| match e.downcast::<hyper::Error>() {
            Ok(e) => Error::Body(*e),
            // Limited fails only with the body's error or its own.
            Err(source) => Error::AnswerTooLarge {
                status,
                limit,
                source,
            },
        })?
        .to_bytes();
    let text = || String::from_utf8_lossy(&bytes).into_owned();
    if status.is_server_error() {
        return Err(Error::Unavailable {
            status,
            body: text(),
        });
    }
    if status != StatusCode::OK && status != StatusCode::TOO_MANY_REQUESTS {
        return Err(Error::Refused {
            status,
            body: text(),
        });
    }
    decode(&bytes)
}

/// The decision in a 200 or 429 body.
fn decode(bytes: &[u8]) -> Result<Decision, Error> {
    let bad = |what: &str| Error::Decode(what.to_owned());
    let value: Value = serde_json::from_slice(bytes).map_err(|e| Error::Decode(e.to_string()))?;
    let allowed = value["allowed"]
        .as_bool()
        .ok_or_else(|| bad("no `allowed`"))?;
    let list = value["descriptors"]
        .as_array()
        .ok_or_else(|| bad("no `descriptors`"))?;
    let secs = |v: &Value| v.as_u64().map(Duration::from_secs);
    let statuses = list
        .iter()
        .map(|d| {
            Ok(DescriptorStatus {
                ok: d["code"].as_str().ok_or_else(|| bad("no `code`"))? == "OK",
                matched: d["matched"].as_bool().unwrap_or(false),
                name: d["limit"]["name"].as_str().map(str::to_owned),
                limit: d["limit"]["requests_per_unit"].as_u64(),
                unit: d["limit"]["unit"].as_str().map(str::to_owned),
                remaining: d["remaining"].as_u64().unwrap_or(0),
                reset: secs(&d["reset_after_seconds"]).unwrap_or_default(),
                retry_after: secs(&d["retry_after_seconds"]),
                shadow: d["shadow"].as_bool().unwrap_or(false),
            })
        })
        .collect::<Result<Vec<_>, Error>>()?;
    Ok(Decision::from_statuses(allowed, statuses))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn urls() {
        let uri = |c: ServiceClient| match c.transport {
            Transport::Http { uri, .. } => uri,
            #[cfg(feature = "grpc")]
            Transport::Grpc(_) => unreachable!(),
        };
        let c = ServiceClient::new("http://127.0.0.1:8080").unwrap();
        assert_eq!(uri(c), "http://127.0.0.1:8080/v1/check");
        let c = ServiceClient::new("http://rl.internal/base/").unwrap();
        assert_eq!(uri(c), "http://rl.internal/base/v1/check");
        assert!(ServiceClient::new("https://rl.internal").is_err());
        assert!(ServiceClient::new("127.0.0.1:8080").is_err());
        assert!(ServiceClient::new("http://").is_err());
    }

    #[test]
    fn decodes_a_refusal() {
        let body = br#"{"allowed":false,"overall":"OVER_LIMIT","descriptors":[
            {"code":"OK","matched":true,"limit":{"name":"a","requests_per_unit":100,"unit":"minute"},
             "remaining":40,"reset_after_seconds":30,"retry_after_seconds":null,"shadow":false},
            {"code":"OVER_LIMIT","matched":true,"limit":{"name":"b","requests_per_unit":2,"unit":"hour"},
             "remaining":0,"reset_after_seconds":1200,"retry_after_seconds":1200,"shadow":false},
            {"code":"OK","matched":false,"limit":null,"remaining":0,"reset_after_seconds":0,
             "retry_after_seconds":null,"shadow":false}]}"#;
        let d = decode(body).unwrap();
        assert!(!d.allowed && !d.from_policy());
        assert_eq!(d.limit, Some(2));
        assert_eq!(d.remaining, Some(0));
        assert_eq!(d.retry_after, Some(Duration::from_secs(1200)));
        assert_eq!(d.statuses.len(), 3);
        assert_eq!(d.statuses[0].name.as_deref(), Some("a"));
    }

    #[test]
    fn decodes_an_allowance() {
        let body = br#"{"allowed":true,"descriptors":[
            {"code":"OK","matched":true,"limit":{"requests_per_unit":100,"unit":"minute"},
             "remaining":40,"reset_after_seconds":30},
            {"code":"OK","matched":true,"limit":{"requests_per_unit":5,"unit":"second"},
             "remaining":3,"reset_after_seconds":1},
            {"code":"OK","matched":false,"limit":null,"remaining":0,"reset_after_seconds":0}]}"#;
        let d = decode(body).unwrap();
        assert!(d.allowed);
        assert_eq!((d.limit, d.remaining), (Some(5), Some(3)));
        assert_eq!(d.reset, Some(Duration::from_secs(1)));
        assert_eq!(d.retry_after, None);
        assert!(decode(b"{}").is_err());
        assert!(decode(b"not json").is_err());
    }

    /// A server on loopback that answers every request with `status` and a decision
    /// padded with spaces to `len` bytes; its URL.
    async fn answering(status: u16, len: usize) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    // The request: its head, then a JSON body that ends with `}`.
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !seen.ends_with(b"}") {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                    }
                    let decision = br#"{"allowed":true,"descriptors":[]}"#;
                    let head = format!("HTTP/1.1 {status} X\r\ncontent-length: {len}\r\n\r\n");
                    let mut body = decision.to_vec();
                    body.resize(len.max(decision.len()), b' ');
                    for part in [head.as_bytes(), &body] {
                        if s.write_all(part).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        format!("http://{addr}")
    }

    #[tokio::test]
    async fn a_too_large_answer_is_an_error() {
        let check = |c: ServiceClient| async move {
            c.deadline(Duration::from_secs(10))
                .check("d", &[Descriptor::new().entry("k", "v")], 1)
                .await
        };
        let mib = 1024 * 1024;
        let url = answering(200, mib).await;
        let Err(Error::AnswerTooLarge { status, limit, .. }) =
            check(ServiceClient::new(&url).unwrap()).await
        else {
            panic!("a 1 MiB answer was read");
        };
        assert_eq!((status, limit), (StatusCode::OK, 64 * 1024));
        // Within the cap, or with a higher cap: a decision.
        let d = check(ServiceClient::new(&answering(200, 60 * 1024).await).unwrap()).await;
        assert!(d.unwrap().allowed);
        let higher = ServiceClient::new(&url).unwrap().max_answer_bytes(2 * mib);
        assert!(check(higher).await.unwrap().allowed);
        let lower = ServiceClient::new(&url).unwrap().max_answer_bytes(10);
        assert!(matches!(
            check(lower).await,
            Err(Error::AnswerTooLarge { limit: 10, .. })
        ));
        // A too-large server error: the failure policy decides, keeping the cause.
        let failing = ServiceClient::new(&answering(503, mib).await)
            .unwrap()
            .failure_policy(FailurePolicy::Closed);
        let d = check(failing).await.unwrap();
        assert!(!d.allowed);
        let Origin::Policy(cause) = d.origin else {
            panic!("the service decided")
        };
        assert!(matches!(*cause, Error::AnswerTooLarge { .. }), "{cause}");
    }

    #[test]
    fn policy() {
        let open = Decision::by_policy(FailurePolicy::Open, Error::Deadline(Duration::ZERO));
        assert!(open.allowed && open.from_policy());
        let closed = Decision::by_policy(FailurePolicy::Closed, Error::Deadline(Duration::ZERO));
        assert!(!closed.allowed && closed.from_policy());
    }
}
