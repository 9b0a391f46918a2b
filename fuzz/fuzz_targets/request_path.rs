//! Request path normalization: any path is normalized or refused, never a panic; what
//! is normalized is a fixed point, has no segment an upstream would resolve, and each
//! route form of it is well defined.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tollgate::http::path::{normalize, Form, RequestPath};

fuzz_target!(|data: &[u8]| {
    let Ok(raw) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(normal) = normalize(raw) else {
        return;
    };
    assert_eq!(normalize(&normal).as_deref(), Ok(normal.as_str()));
    if normal != "*" {
        assert!(normal.starts_with('/') && !normal.contains("//"), "{normal}");
        for segment in normal.split('/') {
            let name = segment.split(';').next().unwrap_or("");
            assert!(name != "." && name != "..", "{normal}");
        }
    }
    let path = RequestPath::parse(raw).expect("normalized once");
    for case_sensitive in [false, true] {
        for keep_parameters in [false, true] {
            let _ = path.get(Form {
                case_sensitive,
                keep_parameters,
            });
        }
    }
});
