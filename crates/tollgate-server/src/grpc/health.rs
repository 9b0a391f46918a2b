//! gRPC's health service, `grpc.health.v1.Health`, as envoyproxy/ratelimit serves it:
//! what Envoy's gRPC cluster health checks, Kubernetes' `grpc` probes and
//! `grpc_health_probe` ask.
//!
//! `Check` answers `SERVING` while the service is ready (the same readiness as
//! `/readyz`: rules loaded, on Redis warm, not draining) and `NOT_SERVING` otherwise,
//! for the names in [`SERVICES`]: `""` (the server as a whole, what a probe asks by
//! default), `ratelimit` (the name envoyproxy/ratelimit registers) and the rate limit
//! service's full name. Any other name is `NOT_FOUND`, as grpc-go's health server
//! answers.
//!
//! `Watch` (server streaming) is served by the tonic transport only: the current status,
//! then each change; for an unknown name `SERVICE_UNKNOWN`, as the health protocol asks;
//! on SIGTERM `NOT_SERVING`, then the stream ends (so that it does not hold the drain).
//! The native transport serves unary calls only, and answers `Watch` `UNIMPLEMENTED`,
//! which the protocol tells clients to take as "not supported".
//!
//! The native transport reads `HealthCheckRequest` and writes `HealthCheckResponse`
//! itself ([`request`], [`response`]), by prost's rules (tests hold both to prost).

use std::pin::Pin;
use std::sync::Arc;

use futures_util::Stream;
use tokio::sync::watch;
use tollgate_h2::grpc::{Code, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

use crate::service::{Readiness, Service};

/// The service names the health service knows: the server as a whole, the name
/// envoyproxy/ratelimit registers, and the rate limit service's full name.
pub const SERVICES: [&str; 3] = [
    "",
    "ratelimit",
    "envoy.service.ratelimit.v3.RateLimitService",
];

/// The `:path` of `Check`.
pub const CHECK_PATH: &str = "/grpc.health.v1.Health/Check";

/// The message of a `NOT_FOUND` answer (grpc-go's).
const UNKNOWN_SERVICE: &str = "unknown service";

/// The status of service `name`, `None` for a name not served.
pub fn status(service: &Service, name: &str) -> Option<ServingStatus> {
    SERVICES
        .contains(&name)
        .then(|| serving(service.readiness()))
}

/// `SERVING` when ready, else `NOT_SERVING`.
fn serving(readiness: Readiness) -> ServingStatus {
    if readiness == Readiness::Ready {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    }
}

/// A `Check` call on the native transport: the request's bytes in, the response's
/// bytes out, or the status to end the call with (`INTERNAL` for bytes that are not a
/// `HealthCheckRequest`, as tonic and grpc-go answer; `NOT_FOUND` for an unknown name).
pub fn check_call(service: &Service, message: &[u8]) -> Result<Vec<u8>, Status> {
    let name = request(message).map_err(|why| {
        Status::new(
            Code::Internal,
            format!("cannot decode the HealthCheckRequest: {why}"),
        )
    })?;
    match status(service, &name) {
        Some(status) => Ok(response(status)),
        None => Err(Status::new(Code::NotFound, UNKNOWN_SERVICE)),
    }
}

/// The tonic service.
pub struct HealthService {
    service: Arc<Service>,
}

/// The health service to mount on a tonic router.
pub fn server(service: Arc<Service>) -> HealthServer<HealthService> {
    HealthServer::new(HealthService { service })
}

/// The statuses a `Watch` call streams.
type Statuses = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl Health for HealthService {
    async fn check(
        &self,
        request: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<HealthCheckResponse>, tonic::Status> {
        match status(&self.service, &request.get_ref().service) {
            Some(status) => Ok(tonic::Response::new(HealthCheckResponse {
                status: status as i32,
            })),
            None => Err(tonic::Status::not_found(UNKNOWN_SERVICE)),
        }
    }

    type WatchStream = Statuses;

    async fn watch(
        &self,
        request: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<Statuses>, tonic::Status> {
        let known = SERVICES.contains(&request.get_ref().service.as_str());
        let changes = self.service.watch_readiness();
        Ok(tonic::Response::new(Box::pin(watch_statuses(
            changes, known,
        ))))
    }
}

/// The statuses of a `Watch` call: the current one, then each change; for an unknown
/// name `SERVICE_UNKNOWN` once. Ends when the service drains, after `NOT_SERVING`.
fn watch_statuses(
    changes: watch::Receiver<Readiness>,
    known: bool,
) -> impl Stream<Item = Result<HealthCheckResponse, tonic::Status>> + Send {
    let start = (changes, None::<ServingStatus>, false);
    futures_util::stream::unfold(start, move |(mut changes, sent, ended)| async move {
        if ended {
            return None;
        }
        loop {
            let readiness = *changes.borrow_and_update();
            let draining = readiness == Readiness::Draining;
            let status = if known {
                serving(readiness)
            } else {
                ServingStatus::ServiceUnknown
            };
            if sent != Some(status) {
                let message = HealthCheckResponse {
                    status: status as i32,
                };
                return Some((Ok(message), (changes, Some(status), draining)));
            }
            if draining || changes.changed().await.is_err() {
                return None;
            }
        }
    })
}

/// Wire types.
const VARINT: u8 = 0;
const I64: u8 = 1;
const LEN: u8 = 2;
const START_GROUP: u8 = 3;
const END_GROUP: u8 = 4;
const I32: u8 = 5;

/// prost's limit on nested groups.
const RECURSION_LIMIT: u32 = 100;

/// The `service` of a serialized `HealthCheckRequest` (`string service = 1;`), read as
/// prost reads it: unknown fields skipped (groups too), the last `service` kept, a
/// `service` of another wire type or not UTF-8 refused. `Err` says why the bytes are
/// not a `HealthCheckRequest`.
pub fn request(bytes: &[u8]) -> Result<String, &'static str> {
    let mut r = Reader { buf: bytes };
    let mut service = String::new();
    while !r.buf.is_empty() {
        match r.key()? {
            (1, LEN) => {
                service = std::str::from_utf8(r.bytes()?)
                    .map_err(|_| "invalid string value: data is not UTF-8 encoded")?
                    .to_owned();
            }
            (1, _) => return Err("invalid wire type for a known field"),
            (field, wire) => r.skip(wire, field, RECURSION_LIMIT)?,
        }
    }
    Ok(service)
}

/// A serialized `HealthCheckResponse` (`ServingStatus status = 1;`), as prost writes
/// it: nothing for the default `UNKNOWN`, else the field's key and the value.
pub fn response(status: ServingStatus) -> Vec<u8> {
    match status as i32 {
        0 => Vec::new(),
        // Every status is below 128: a one-byte varint.
        v => vec![1 << 3 | VARINT, v as u8],
    }
}

/// The unread rest of a message.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A base-128 varint of at most 10 bytes whose value fits in 64 bits.
    fn varint(&mut self) -> Result<u64, &'static str> {
        let mut value = 0u64;
        for (i, &b) in self.buf.iter().enumerate().take(10) {
            if i == 9 && b > 1 {
                return Err("invalid varint");
            }
            value |= u64::from(b & 0x7f) << (7 * i);
            if b < 0x80 {
                self.buf = &self.buf[i + 1..];
                return Ok(value);
            }
        }
        Err("invalid varint")
    }

    /// A field key: (field number, wire type).
    fn key(&mut self) -> Result<(u32, u8), &'static str> {
        let key = u32::try_from(self.varint()?).map_err(|_| "invalid key value")?;
        let wire = (key & 7) as u8;
        if wire > I32 {
            return Err("invalid wire type value");
        }
        if key >> 3 == 0 {
            return Err("invalid tag value: 0");
        }
        Ok((key >> 3, wire))
    }

    /// `n` bytes.
    fn take(&mut self, n: u64) -> Result<&'a [u8], &'static str> {
        let n = usize::try_from(n).map_err(|_| "buffer underflow")?;
        if n > self.buf.len() {
            return Err("buffer underflow");
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    /// A length-delimited field's bytes.
    fn bytes(&mut self) -> Result<&'a [u8], &'static str> {
        let n = self.varint()?;
        self.take(n)
    }

    /// Skips an unknown field, as prost's `skip_field`.
    fn skip(&mut self, wire: u8, field: u32, depth: u32) -> Result<(), &'static str> {
        if depth == 0 {
            return Err("recursion limit reached");
        }
        match wire {
            VARINT => self.varint().map(drop),
            I64 => self.take(8).map(drop),
            LEN => self.bytes().map(drop),
            I32 => self.take(4).map(drop),
            START_GROUP => loop {
                let (inner, inner_wire) = self.key()?;
                if inner_wire == END_GROUP {
                    if inner != field {
                        return Err("unexpected end group tag");
                    }
                    return Ok(());
                }
                self.skip(inner_wire, inner, depth - 1)?;
            },
            _ => Err("unexpected end group tag"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use proptest::prelude::*;
    use prost::Message;

    /// What prost makes of `bytes`: the service name, or an error (its reason not
    /// compared).
    fn prost_request(bytes: &[u8]) -> Result<String, ()> {
        HealthCheckRequest::decode(bytes)
            .map(|r| r.service)
            .map_err(drop)
    }

    fn ours(bytes: &[u8]) -> Result<String, ()> {
        request(bytes).map_err(drop)
    }

    #[test]
    fn the_response_is_what_prost_writes() {
        for status in [
            ServingStatus::Unknown,
            ServingStatus::Serving,
            ServingStatus::NotServing,
            ServingStatus::ServiceUnknown,
        ] {
            let prost = HealthCheckResponse {
                status: status as i32,
            }
            .encode_to_vec();
            assert_eq!(response(status), prost, "{status:?}");
        }
    }

    #[test]
    fn requests_read_as_prost_reads_them() {
        let cases: &[&[u8]] = &[
            b"",
            b"\x0a\x00",
            b"\x0a\x09ratelimit",
            // Twice: the last one counts.
            b"\x0a\x01a\x0a\x01b",
            // Unknown fields of every wire type, a group with a field inside.
            b"\x10\x96\x01\x19\x01\x02\x03\x04\x05\x06\x07\x08\x22\x02hi\x2d\x01\x02\x03\x04\x0a\x01x",
            b"\x1b\x08\x01\x1c\x0a\x01y",
            // Damage: the service as a varint, not UTF-8, too long, a stray end group,
            // field 0, an unfinished varint, a group ended by another field's tag.
            b"\x08\x01",
            b"\x0a\x01\xff",
            b"\x0a\x05abc",
            b"\x0c",
            b"\x00\x01",
            b"\x80",
            b"\x1b\x24",
        ];
        for bytes in cases {
            assert_eq!(ours(bytes), prost_request(bytes), "{bytes:?}");
        }
        // Groups nested past prost's recursion limit.
        let mut deep = vec![0x1b; 101];
        deep.extend([0x1c; 101]);
        assert_eq!(ours(&deep), prost_request(&deep));
        assert!(ours(&deep).is_err());
        let ok = &deep[1..deep.len() - 1];
        assert_eq!(ours(ok), prost_request(ok));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_read_as_prost_reads_them(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            prop_assert_eq!(ours(&bytes), prost_request(&bytes));
        }

        #[test]
        fn a_request_with_unknown_fields_reads_as_prost_reads_it(
            service in ".{0,20}",
            before in proptest::collection::vec(any::<u8>(), 0..8),
            number in 2u32..1000,
            value in any::<u64>(),
        ) {
            let mut bytes = Vec::new();
            // An unknown varint field, an unknown length-delimited one, then the name.
            prost::encoding::encode_key(number, prost::encoding::WireType::Varint, &mut bytes);
            prost::encoding::encode_varint(value, &mut bytes);
            prost::encoding::bytes::encode(number + 1, &before, &mut bytes);
            HealthCheckRequest { service: service.clone() }.encode(&mut bytes).unwrap();
            prop_assert_eq!(ours(&bytes), Ok(service));
            prop_assert_eq!(ours(&bytes), prost_request(&bytes));
        }
    }

    /// A service over rules from `dir` (`load_or_wait`), on the memory store.
    fn service_over(dir: &std::path::Path) -> Service {
        use crate::metrics::Metrics;
        use crate::store::AnyStore;
        use tollgate::limiter::Limiter;
        use tollgate::rules::{LoadOptions, Rules};
        use tollgate::store::MemoryStore;
        let rules = Arc::new(Rules::load_or_wait(
            vec![dir.to_path_buf()],
            LoadOptions::default(),
        ));
        let limiter = Limiter::new(rules, AnyStore::Memory(MemoryStore::new()));
        Service::new(
            Arc::new(limiter),
            Arc::new(Metrics::new(0.8)),
            tollgate::headers::HeaderSettings::default(),
        )
    }

    /// The native transport's answer to `Check` for `name`: the status, or the code.
    fn native_check(service: &Service, name: &str) -> Result<ServingStatus, Code> {
        let request = HealthCheckRequest {
            service: name.to_owned(),
        };
        let reply = check_call(service, &request.encode_to_vec()).map_err(|s| s.code)?;
        let status = HealthCheckResponse::decode(reply.as_slice())
            .unwrap()
            .status;
        Ok(ServingStatus::try_from(status).unwrap())
    }

    #[test]
    fn check_follows_readiness_rules_and_the_drain() {
        let dir = std::env::temp_dir().join(format!("tollgate-health-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let rule = "domain: h\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";
        std::fs::write(dir.join("h.yaml"), rule.replace("hour", "fortnight")).unwrap();
        let service = service_over(&dir);
        let mut changes = service.watch_readiness();
        service.set_ready(true);
        for name in SERVICES {
            assert_eq!(
                native_check(&service, name),
                Ok(ServingStatus::NotServing),
                "no rules"
            );
        }
        assert_eq!(native_check(&service, "other"), Err(Code::NotFound));
        assert_eq!(
            check_call(&service, b"\x0a\x05abc").map_err(|s| s.code),
            Err(Code::Internal)
        );
        assert!(!changes.has_changed().unwrap(), "still not ready");

        std::fs::write(dir.join("h.yaml"), rule).unwrap();
        service.limiter.rules().reload().unwrap();
        for name in SERVICES {
            assert_eq!(
                native_check(&service, name),
                Ok(ServingStatus::Serving),
                "{name:?}"
            );
        }
        service.refresh();
        assert_eq!(*changes.borrow_and_update(), Readiness::Ready);

        service.drain();
        for name in SERVICES {
            assert_eq!(
                native_check(&service, name),
                Ok(ServingStatus::NotServing),
                "{name:?}"
            );
        }
        assert_eq!(*changes.borrow_and_update(), Readiness::Draining);
        assert_eq!(native_check(&service, "other"), Err(Code::NotFound));
    }

    #[tokio::test]
    async fn watch_streams_each_change_and_ends_after_the_drain() {
        let (tx, rx) = watch::channel(Readiness::NotReady);
        let mut statuses = Box::pin(watch_statuses(rx, true));
        let next = |s: Option<Result<HealthCheckResponse, tonic::Status>>| {
            ServingStatus::try_from(s.unwrap().unwrap().status).unwrap()
        };
        assert_eq!(next(statuses.next().await), ServingStatus::NotServing);
        tx.send(Readiness::Ready).unwrap();
        assert_eq!(next(statuses.next().await), ServingStatus::Serving);
        tx.send(Readiness::Draining).unwrap();
        assert_eq!(next(statuses.next().await), ServingStatus::NotServing);
        assert!(statuses.next().await.is_none());

        // An unknown name: SERVICE_UNKNOWN, nothing for changes, the end at the drain.
        let (tx, rx) = watch::channel(Readiness::NotReady);
        let mut statuses = Box::pin(watch_statuses(rx, false));
        assert_eq!(next(statuses.next().await), ServingStatus::ServiceUnknown);
        tx.send(Readiness::Ready).unwrap();
        tx.send(Readiness::Draining).unwrap();
        assert!(statuses.next().await.is_none());
    }
}
