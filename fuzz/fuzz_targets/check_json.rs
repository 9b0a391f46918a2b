//! The check endpoints' JSON bodies (`POST /v1/check`, `POST /json`): any bytes are a
//! request within the caps or a 400 reason, never a panic; what is accepted holds no
//! more than the caps allow.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tollgate_server::fuzzing;

fuzz_target!(|data: &[u8]| {
    for read in [fuzzing::v1_check, fuzzing::envoy_json] {
        if let Ok(request) = read(data) {
            assert!(request.descriptors.len() <= 64);
            assert!(request.descriptors.iter().all(|d| d.entries.len() <= 32));
        }
    }
});
