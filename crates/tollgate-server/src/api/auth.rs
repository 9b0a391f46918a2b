//! The admin token (`--admin-token`, `--admin-token-file`): with one set, the admin
//! endpoints that read or change the service (`/rules`, `POST /reload`,
//! `/v1/enforcement`, `/v1/stats`, and `/metrics` with `--metrics-require-token`) answer only requests with `Authorization: Bearer
//! <token>`; the health checks stay open to the probes.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde_json::json;
use subtle::ConstantTimeEq;
use tracing::{debug, warn};

use crate::cli::AdminArgs;
use crate::service::Service;

/// Why the admin token settings stop the start.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// `--admin-token-file` cannot be read.
    #[error("cannot read --admin-token-file {}: {source}", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// `--admin-token-file` holds nothing but, maybe, line breaks.
    #[error("--admin-token-file {} is empty: it must hold the admin token", path.display())]
    EmptyFile {
        /// The file.
        path: PathBuf,
    },
    /// `--admin-token` (or `TOLLGATE_ADMIN_TOKEN`) is set, to nothing.
    #[error("--admin-token (TOLLGATE_ADMIN_TOKEN) is empty")]
    Empty,
    /// The token holds a byte a client cannot send in `Authorization: Bearer`.
    #[error(
        "the admin token from {from} holds spaces, control or non-ASCII characters: a \
         bearer token is printable ASCII without spaces"
    )]
    NotSendable {
        /// `--admin-token`, or `--admin-token-file` and the file.
        from: String,
    },
    /// `--metrics-require-token` with no token to require.
    #[error("--metrics-require-token needs an admin token (--admin-token or --admin-token-file)")]
    MetricsWithoutToken,
}

/// The admin token. Its `Debug` does not print it.
#[derive(Clone)]
struct Token(Arc<[u8]>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Token {
    /// Whether `presented` is the token, in time that does not depend on where they
    /// differ (`subtle`: no early exit, behind an optimisation barrier). A length
    /// that differs answers at once: the token's length is not a secret worth the
    /// cost of hiding it, its bytes are.
    fn is(&self, presented: &[u8]) -> bool {
        self.0.ct_eq(presented).into()
    }
}

/// Who may call the admin endpoints: cheap to clone (one per router).
#[derive(Debug, Clone, Default)]
pub struct AdminAccess {
    /// `None`: open to anyone who reaches the listener.
    token: Option<Token>,
    /// `/metrics` requires the token too.
    metrics_require_token: bool,
}

impl AdminAccess {
    /// The access the flags ask for: the token of `--admin-token` or the file of
    /// `--admin-token-file` (read now, its trailing line breaks dropped), or none.
    pub fn from_args(args: &AdminArgs) -> Result<Self, TokenError> {
        let token = match (&args.admin_token, &args.admin_token_file) {
            (Some(token), _) => {
                if token.0.is_empty() {
                    return Err(TokenError::Empty);
                }
                Some(sendable(token.0.as_bytes(), || "--admin-token".into())?)
            }
            (None, Some(path)) => {
                let bytes = std::fs::read(path).map_err(|source| TokenError::Unreadable {
                    path: path.clone(),
                    source,
                })?;
                let end = bytes
                    .iter()
                    .rposition(|b| !matches!(b, b'\n' | b'\r'))
                    .map_or(0, |last| last + 1);
                if end == 0 {
                    return Err(TokenError::EmptyFile { path: path.clone() });
                }
                Some(sendable(&bytes[..end], || {
                    format!("--admin-token-file {}", path.display())
                })?)
            }
            (None, None) => None,
        };
        if args.metrics_require_token && token.is_none() {
            return Err(TokenError::MetricsWithoutToken);
        }
        Ok(AdminAccess {
            token,
            metrics_require_token: args.metrics_require_token,
        })
    }

    /// Whether the admin endpoints require a token.
    pub fn token_required(&self) -> bool {
        self.token.is_some()
    }

    /// Whether `/metrics` requires the token.
    pub(super) fn metrics_guarded(&self) -> bool {
        self.token.is_some() && self.metrics_require_token
    }

    /// `router`'s routes (added so far) answer only requests with the token; `router`
    /// as it is without one.
    pub(super) fn guard(&self, router: Router<Arc<Service>>) -> Router<Arc<Service>> {
        match &self.token {
            Some(token) => {
                router.route_layer(middleware::from_fn_with_state(token.clone(), require))
            }
            None => router,
        }
    }

    /// Logs a warning when `POST /reload` answers anyone who reaches `addr`: no token,
    /// and an address other than loopback.
    pub fn warn_if_open(&self, addr: SocketAddr) {
        if self.token.is_none() && !addr.ip().to_canonical().is_loopback() {
            warn!(
                %addr,
                "the admin endpoints (POST /reload, /rules, /v1/stats with clients' keys) answer anyone who reaches {addr}, \
                 and the emergency switch (POST /v1/enforcement) is off: set --admin-token or \
                 --admin-token-file, or serve them on a loopback or private --admin-listen"
            );
        }
    }
}

/// `bytes` as a token, if a client can send it: printable ASCII without spaces.
fn sendable(bytes: &[u8], from: impl FnOnce() -> String) -> Result<Token, TokenError> {
    if bytes.iter().all(|b| b.is_ascii_graphic()) {
        Ok(Token(bytes.into()))
    } else {
        Err(TokenError::NotSendable { from: from() })
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// No `Authorization: Bearer` header.
    Missing,
    /// A bearer token, not the admin token.
    Wrong,
}

/// The bearer token of `headers` checked against `token`.
fn authorize(token: &Token, headers: &HeaderMap) -> Result<(), Refusal> {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Err(Refusal::Missing);
    };
    let value = value.as_bytes();
    // `Bearer` is case-insensitive (RFC 9110 §11.1), then one or more spaces.
    let Some(space) = value.iter().position(|&b| b == b' ') else {
        return Err(Refusal::Missing);
    };
    if !value[..space].eq_ignore_ascii_case(b"bearer") {
        return Err(Refusal::Missing);
    }
    let rest = &value[space..];
    let start = rest.iter().position(|&b| b != b' ').unwrap_or(rest.len());
    if token.is(&rest[start..]) {
        Ok(())
    } else {
        Err(Refusal::Wrong)
    }
}

/// The middleware: the request goes on with the token, else 401.
async fn require(State(token): State<Token>, request: Request, next: Next) -> Response {
    match authorize(&token, request.headers()) {
        Ok(()) => next.run(request).await,
        Err(refusal) => {
            debug!(path = %request.uri().path(), ?refusal, "admin request refused");
            unauthorized(refusal)
        }
    }
}

/// 401 with `WWW-Authenticate: Bearer` (RFC 6750 §3: `error="invalid_token"` for a
/// wrong token) and a problem body (RFC 9457).
fn unauthorized(refusal: Refusal) -> Response {
    let (challenge, detail) = match refusal {
        Refusal::Missing => (
            "Bearer",
            "this admin endpoint requires `Authorization: Bearer <admin token>`",
        ),
        Refusal::Wrong => (
            "Bearer error=\"invalid_token\"",
            "the bearer token is not the admin token",
        ),
    };
    let body = json!({
        "type": "https://tollgate.dev/problems/unauthorized",
        "title": "Unauthorized",
        "status": 401,
        "detail": detail,
    });
    (
        StatusCode::UNAUTHORIZED,
        [
            (
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(challenge),
            ),
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/problem+json"),
            ),
        ],
        body.to_string(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(authorization: &[u8]) -> HeaderMap {
        let mut map = HeaderMap::new();
        map.insert(
            header::AUTHORIZATION,
            HeaderValue::from_bytes(authorization).unwrap(),
        );
        map
    }

    fn token(text: &str) -> Token {
        Token(text.as_bytes().into())
    }

    #[test]
    fn only_the_bearer_token_passes() {
        let t = token("s3cret-Token");
        assert_eq!(authorize(&t, &HeaderMap::new()), Err(Refusal::Missing));
        assert_eq!(authorize(&t, &headers(b"Bearer s3cret-Token")), Ok(()));
        assert_eq!(authorize(&t, &headers(b"bearer  s3cret-Token")), Ok(()));
        assert_eq!(authorize(&t, &headers(b"BEARER s3cret-Token")), Ok(()));
        for wrong in [
            &b"Bearer s3cret-Toke"[..],
            b"Bearer s3cret-Token2",
            b"Bearer S3CRET-TOKEN",
            b"Bearer ",
        ] {
            assert_eq!(authorize(&t, &headers(wrong)), Err(Refusal::Wrong));
        }
        for missing in [
            &b"Basic czNjcmV0"[..],
            b"s3cret-Token",
            b"Bearers3cret-Token",
        ] {
            assert_eq!(authorize(&t, &headers(missing)), Err(Refusal::Missing));
        }
    }

    #[test]
    fn the_token_comes_from_the_flag_or_the_file() {
        let dir = std::env::temp_dir().join(format!("tollgate-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let args = |token: Option<&str>, file: Option<PathBuf>, metrics: bool| AdminArgs {
            admin_token: token.map(|t| crate::cli::Secret(t.into())),
            admin_token_file: file,
            metrics_require_token: metrics,
        };
        let none = AdminAccess::from_args(&args(None, None, false));
        assert!(none.is_ok_and(|a| !a.token_required()));
        let flag = AdminAccess::from_args(&args(Some("abc"), None, true));
        assert!(flag.is_ok_and(|a| a.metrics_guarded()));
        assert!(matches!(
            AdminAccess::from_args(&args(Some(""), None, false)),
            Err(TokenError::Empty)
        ));
        assert!(matches!(
            AdminAccess::from_args(&args(Some("a b"), None, false)),
            Err(TokenError::NotSendable { .. })
        ));
        assert!(matches!(
            AdminAccess::from_args(&args(None, None, true)),
            Err(TokenError::MetricsWithoutToken)
        ));

        let file = dir.join("token");
        std::fs::write(&file, "from-file\r\n\n").unwrap();
        let access = AdminAccess::from_args(&args(None, Some(file.clone()), false));
        let Ok(access) = access else {
            panic!("{access:?}");
        };
        let Some(token) = &access.token else {
            panic!("no token");
        };
        assert!(token.is(b"from-file"));
        assert!(!token.is(b"from-file\n"));
        assert!(!format!("{access:?}").contains("from-file"));

        std::fs::write(&file, "\n").unwrap();
        let empty = AdminAccess::from_args(&args(None, Some(file.clone()), false));
        assert!(matches!(empty, Err(TokenError::EmptyFile { .. })));
        let missing = dir.join("missing");
        let Err(e) = AdminAccess::from_args(&args(None, Some(missing.clone()), false)) else {
            panic!("a missing file gave a token");
        };
        let said = e.to_string();
        assert!(said.contains("--admin-token-file") && said.contains(&*missing.to_string_lossy()));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
