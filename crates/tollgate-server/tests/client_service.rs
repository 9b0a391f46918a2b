//! `tollgate-client`'s `ServiceClient` against the real `tollgate serve`, over
//! `POST /v1/check` and over Envoy's gRPC API: allowed then refused with the limit,
//! remaining and retry-after right; a service that is down or stalled answered by each
//! failure policy, within about the deadline.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

mod support;

use std::time::{Duration, Instant};

use support::{free_port, tempdir, Server};
use tollgate_client::service::{Descriptor, FailurePolicy, Origin, ServiceClient};

const RULES: &str = r#"domain: svc
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 2, algorithm: fixed_window, name: two_per_hour}
"#;

fn alice() -> Descriptor {
    Descriptor::new().entry("user", "alice")
}

async fn serve(name: &str) -> Server {
    let dir = tempdir(name);
    std::fs::write(dir.join("svc.yaml"), RULES).unwrap();
    Server::start(&dir, &[]).await
}

#[tokio::test]
async fn allowed_then_refused_http() {
    let server = serve("client-service-http").await;
    let client = ServiceClient::new(&server.http).unwrap();
    allowed_then_refused(client).await;
}

#[tokio::test]
async fn allowed_then_refused_grpc() {
    let server = serve("client-service-grpc").await;
    let client = ServiceClient::grpc(&server.grpc).unwrap();
    allowed_then_refused(client).await;
}

/// No rules loaded: the service answers 503 (HTTP) or `UNKNOWN` (gRPC), and the
/// policy decides.
#[tokio::test]
async fn no_rules_each_policy() {
    let dir = tempdir("client-service-no-rules");
    std::fs::write(dir.join("svc.yaml"), "domain: [not valid").unwrap();
    let server = Server::start_probed(&dir, &[], |_| async { true }).await;
    // The listeners accept once the server has started.
    let probe = ServiceClient::new(&server.http)
        .unwrap()
        .deadline(Duration::from_secs(5));
    for _ in 0..100 {
        let d = probe.check("svc", &[alice()], 1).await.unwrap();
        if let Origin::Policy(cause) = &d.origin {
            if !matches!(**cause, tollgate_client::service::Error::Unreachable(_)) {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (policy, allowed) in [(FailurePolicy::Open, true), (FailurePolicy::Closed, false)] {
        for client in [
            ServiceClient::new(&server.http).unwrap(),
            ServiceClient::grpc(&server.grpc).unwrap(),
        ] {
            let client = client
                .deadline(Duration::from_secs(5))
                .failure_policy(policy);
            let d = client.check("svc", &[alice()], 1).await.unwrap();
            assert_eq!(d.allowed, allowed, "{d:?}");
            let Origin::Policy(cause) = &d.origin else {
                panic!("{d:?}")
            };
            let text = format!("{cause:?}");
            assert!(
                text.contains("no rate limit configuration loaded"),
                "{text}"
            );
        }
    }
}

async fn allowed_then_refused(client: ServiceClient) {
    let client = client
        .deadline(Duration::from_secs(5))
        .failure_policy(FailurePolicy::Open);

    let first = client.check("svc", &[alice()], 1).await.unwrap();
    assert!(first.allowed && !first.from_policy(), "{first:?}");
    assert_eq!((first.limit, first.remaining), (Some(2), Some(1)));
    assert_eq!(first.retry_after, None);
    let reset = first.reset.unwrap();
    assert!(reset > Duration::ZERO && reset <= Duration::from_secs(3600));

    let second = client.check("svc", &[alice()], 1).await.unwrap();
    assert!(second.allowed);
    assert_eq!(second.remaining, Some(0));

    let third = client.check("svc", &[alice()], 1).await.unwrap();
    assert!(!third.allowed && !third.from_policy(), "{third:?}");
    assert_eq!((third.limit, third.remaining), (Some(2), Some(0)));
    let retry = third.retry_after.unwrap();
    assert!(retry > Duration::ZERO && retry <= Duration::from_secs(3600));
    assert_eq!(third.statuses.len(), 1);
    assert_eq!(third.statuses[0].name.as_deref(), Some("two_per_hour"));
    assert_eq!(third.statuses[0].unit.as_deref(), Some("HOUR"));

    // Descriptors decided together: an unlimited one beside alice's does not help it.
    let other = Descriptor::new().entry("path", "/free");
    let both = client.check("svc", &[other, alice()], 1).await.unwrap();
    assert!(!both.allowed);
    assert!(both.statuses[0].ok && !both.statuses[0].matched);
    assert!(!both.statuses[1].ok);

    // Bob has his own counter.
    let bob = Descriptor::new().entry("user", "bob");
    assert!(client.check("svc", &[bob], 2).await.unwrap().allowed);

    // A malformed request is an error, not the policy's business.
    let err = client.check("svc", &[alice()], 0).await.unwrap_err();
    assert!(!err.is_unavailable(), "{err:?}");
}

/// The HTTP and the gRPC client of `addr`.
fn both(addr: &str) -> [ServiceClient; 2] {
    [
        ServiceClient::new(&format!("http://{addr}")).unwrap(),
        ServiceClient::grpc(addr).unwrap(),
    ]
}

fn unreachable(cause: &tollgate_client::service::Error) -> bool {
    use tollgate_client::service::Error;
    match cause {
        Error::Unreachable(_) => true,
        Error::Grpc(status) => status.code() == tonic::Code::Unavailable,
        _ => false,
    }
}

#[tokio::test]
async fn service_down_each_policy() {
    // Nobody listens on this port.
    let addr = format!("127.0.0.1:{}", free_port());
    for (policy, allowed) in [(FailurePolicy::Open, true), (FailurePolicy::Closed, false)] {
        for client in both(&addr) {
            let client = client
                .deadline(Duration::from_secs(5))
                .failure_policy(policy);
            let d = client.check("svc", &[alice()], 1).await.unwrap();
            assert_eq!(d.allowed, allowed, "{policy:?}");
            assert!(d.statuses.is_empty() && d.limit.is_none());
            let Origin::Policy(cause) = &d.origin else {
                panic!("{d:?}")
            };
            assert!(unreachable(cause), "{cause:?}");
        }
    }
}

#[tokio::test]
async fn stalled_service_deadline() {
    // Accepts connections and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            open.push(socket);
        }
    });
    let deadline = Duration::from_millis(300);
    for (policy, allowed) in [(FailurePolicy::Open, true), (FailurePolicy::Closed, false)] {
        for client in both(&addr.to_string()) {
            let client = client.deadline(deadline).failure_policy(policy);
            let start = Instant::now();
            let d = client.check("svc", &[alice()], 1).await.unwrap();
            let took = start.elapsed();
            assert_eq!(d.allowed, allowed, "{policy:?}");
            assert!(took >= deadline, "{took:?}");
            assert!(took < deadline + Duration::from_millis(500), "{took:?}");
            let Origin::Policy(cause) = &d.origin else {
                panic!("{d:?}")
            };
            assert!(
                matches!(**cause, tollgate_client::service::Error::Deadline(_)),
                "{cause:?}"
            );
        }
    }
    held.abort();
}
