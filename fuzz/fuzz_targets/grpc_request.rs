//! The native gRPC transport's protobuf decoder (a `ShouldRateLimit` message): any bytes
//! are a request within the caps or an INVALID_ARGUMENT reason, never a panic; what it
//! accepts holds no more than the caps allow.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(request) = tollgate_server::fuzzing::grpc_request(data) {
        assert!(request.descriptors.len() <= 64);
        assert!(request.descriptors.iter().all(|d| d.entries.len() <= 32));
    }
});
