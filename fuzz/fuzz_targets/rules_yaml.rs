//! The rule-file reader: any text is a rule set or errors with positions, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    match tollgate::rules::from_str("fuzz.yaml", &text) {
        Ok(set) => {
            // A set that loads can be matched against.
            for domain in set.domains() {
                let _ = domain.find(&[("key", "value")]);
            }
        }
        Err(errors) => {
            // Every error renders (file, line, column, message).
            let _ = errors.to_string();
        }
    }
});
