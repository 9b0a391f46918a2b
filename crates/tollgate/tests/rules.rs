//! The rule engine: every kind of config error with its exact position, matching,
//! Tollgate's extensions through the limiter, and reloading.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

use std::sync::Arc;
use std::time::Duration;

use tollgate::clock::{ManualClock, NANOS_PER_SEC};
use tollgate::limiter::{Code, Descriptor, LimitOverride, Limiter, RateLimitRequest, Settings};
use tollgate::rules::{from_str, load, ConfigError, LoadOptions, ReloadOutcome, Rules, Unit};
use tollgate::store::MemoryStore;

const T0: u64 = 1_699_920_000 * NANOS_PER_SEC;

/// The errors of a rule file that must be rejected, as `line:column: message`.
fn errors(text: &str) -> Vec<String> {
    match from_str("f.yaml", text) {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(e) => e
            .iter()
            .map(|e: &ConfigError| format!("{}:{}: {}", e.line, e.column, e.message))
            .collect(),
    }
}

fn limiter(text: &str) -> (Limiter, ManualClock) {
    let clock = ManualClock::new(T0);
    let rules = Arc::new(Rules::fixed(from_str("f.yaml", text).unwrap()));
    (
        Limiter::new(rules, MemoryStore::new()).with_clock(Arc::new(clock.clone())),
        clock,
    )
}

fn req(domain: &str, entries: &[(&str, &str)]) -> RateLimitRequest {
    RateLimitRequest::new(
        domain,
        [entries.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>()],
    )
}

mod errors {
    use super::errors;

    #[test]
    fn a_failure_mode_must_be_known_and_a_divisor_needs_local_fallback() {
        let e = errors("domain: d\nfailure_mode: fail_sometimes\ndescriptors:\n  - key: k\n    local_fallback_divisor: 3\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: j\n    failure_mode: local_fallback\n    local_fallback_divisor: 0\n");
        assert_eq!(
            e,
            [
                "2:15: unknown failure_mode `fail_sometimes` (expected fail_open, fail_closed or local_fallback)",
                "5:29: `local_fallback_divisor` needs `failure_mode: local_fallback` beside it or above it",
                "9:29: `local_fallback_divisor` must be at least 1",
            ]
        );
    }

    #[test]
    fn consistency_settings_are_checked_with_their_place() {
        let e = errors("domain: d\nconsistency: eventually\nlease_period: 0ms\ndescriptors:\n  - key: k\n    sync_interval: 2m\n    rate_limit: {unit: second, requests_per_unit: 1}\n");
        assert_eq!(
            e,
            [
                "2:14: unknown consistency `eventually` (expected exact, leased or synced)",
                "3:15: `lease_period` must be a duration from 1ms to 60s, such as 50ms, 100ms or 1s",
                "6:20: `sync_interval` must be a duration from 1ms to 60s, such as 50ms, 100ms or 1s",
            ]
        );
    }

    #[test]
    fn scope_and_regions_are_checked_with_their_place() {
        let e = errors("domain: d\nconsistency: synced\nregions: 2\ndescriptors:\n  - key: a\n    scope: global\n    rate_limit: {unit: second, requests_per_unit: 1}\n    descriptors:\n      - key: b\n        rate_limit: {unit: second, requests_per_unit: 1}\n  - key: c\n    scope: everywhere\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: d\n    scope: global\n    failure_mode: local_fallback\n    regions: 0\n    rate_limit: {unit: second, requests_per_unit: 1, algorithm: sliding_log}\n");
        assert_eq!(
            e,
            [
                "3:10: `regions` needs `failure_mode: local_fallback` beside it or above it",
                // Once for its place, though `b` inherits it too.
                "6:12: `scope: global` limits are leased from the global store, so they cannot be `consistency: synced`; write `consistency: leased` (or nothing) beside `scope: global`",
                "12:12: unknown scope `everywhere` (expected region or global)",
                "15:12: `scope: global` limits are leased from the global store, so they cannot be `consistency: synced`; write `consistency: leased` (or nothing) beside `scope: global`",
                "17:14: `regions` must be at least 1",
            ]
        );
        // A global limit is leased: one that cannot be says so.
        let e = errors("domain: d\ndescriptors:\n  - key: a\n    scope: global\n    rate_limit: {unit: second, requests_per_unit: 1, algorithm: sliding_log}\n");
        assert_eq!(
            e,
            ["5:18: `consistency: leased` cannot count this sliding_log limit: a sliding_log keeps each request's instant, which a count taken elsewhere cannot keep; give it `consistency: exact` (on its descriptor)"]
        );
    }

    #[test]
    fn limits_that_cannot_be_leased_or_synced_say_why_where_they_are() {
        let e = errors(
            "domain: d\nconsistency: leased\ndescriptors:\n  - key: log\n    rate_limit: {unit: second, requests_per_unit: 5, algorithm: sliding_log}\n  - key: window\n    consistency: synced\n    rate_limit: {unit: second, requests_per_unit: 5, algorithm: sliding_window}\n  - key: queue\n    rate_limit: {unit: second, requests_per_unit: 5, algorithm: leaky_bucket, mode: queue}\n  - key: lockout\n    rate_limit: {unit: second, requests_per_unit: 5, block_duration: 1m}\n  - key: fine\n    consistency: exact\n    rate_limit: {unit: second, requests_per_unit: 5, algorithm: sliding_log}\n",
        );
        assert_eq!(
            e,
            [
                "5:18: `consistency: leased` cannot count this sliding_log limit: a sliding_log keeps each request's instant, which a count taken elsewhere cannot keep; give it `consistency: exact` (on its descriptor)",
                "8:18: `consistency: synced` cannot count this sliding_window limit: a sliding_window weighs counts by when they were made, which a count taken elsewhere cannot keep; give it `consistency: exact` (on its descriptor)",
                "10:18: `consistency: leased` cannot count this leaky_bucket limit: a queue's delay is decided on the shared state, request by request; give it `consistency: exact` (on its descriptor)",
                "12:18: `consistency: leased` cannot count this fixed_window limit: a lockout (`block_duration`) starts on one shared rejection; give it `consistency: exact` (on its descriptor)",
            ]
        );
    }

    #[test]
    fn charge_rejected_and_metadata_are_checked() {
        let e = errors("domain: d\ncharge_rejected: sometimes\ndescriptors:\n  - key: k\n    charge_rejected: [all]\n    metadata: just text\n");
        assert_eq!(
            e,
            [
                "2:18: `charge_rejected` must be none, over_limit or all",
                "5:22: `charge_rejected` must be none, over_limit or all",
                "6:15: `metadata` must be a mapping",
            ]
        );
    }

    #[test]
    fn an_unknown_key_is_named_with_its_place() {
        let e = errors("domain: d\ndescriptors:\n  - key: k\n    ratelimit: {unit: second, requests_per_unit: 1}\n");
        assert_eq!(e, ["4:5: unknown key `ratelimit` in a descriptor (expected one of: key, value, rate_limit, rate_limits, shadow_mode, detailed_metric, value_to_metric, share_threshold, quota_mode, metadata, descriptors, failure_mode, local_fallback_divisor, regions, charge_rejected, consistency, lease_period, sync_interval, scope)"]);
    }

    #[test]
    fn every_error_in_a_file_is_reported() {
        let e = errors(
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n  - key: \"\"\n    rate_limit: {unit: second, requests_per_unit: -2}\n  - key: c\n    rate_limit: {unit: second, requests_per_unit: 1, algorithm: magic}\n",
        );
        assert_eq!(
            e,
            [
                "4:24: unknown unit `fortnight` (expected second, minute, hour, day, week, month or year)",
                "5:10: a descriptor's `key` is empty",
                "6:51: `requests_per_unit` must be a whole number from 0 to 4294967295, got `-2`",
                "8:65: unknown algorithm `magic` (expected one of: fixed_window, sliding_window, sliding_log, token_bucket, gcra, leaky_bucket)",
            ]
        );
    }

    #[test]
    fn a_duplicate_descriptor_points_at_the_second_one() {
        let e =
            errors("domain: d\ndescriptors:\n  - key: k\n    value: v\n  - key: k\n    value: v\n");
        assert_eq!(e, ["5:5: duplicate descriptor: key `k` with value `v` is already defined at this level of domain `d`"]);
    }

    #[test]
    fn unlimited_with_numbers_is_rejected() {
        let e = errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unlimited: true\n      unit: second\n");
        assert_eq!(
            e,
            ["6:13: an `unlimited` rate limit cannot also have a `unit`"]
        );
    }

    #[test]
    fn a_file_without_a_domain_is_rejected() {
        assert_eq!(
            errors("descriptors: []\n"),
            ["1:1: the file has no `domain`: every rule file names its domain"]
        );
        assert_eq!(
            errors("domain: \"\"\n"),
            ["1:9: `domain` is empty: every rule file names its domain"]
        );
    }

    #[test]
    fn broken_yaml_is_reported_with_its_place() {
        let e = errors("domain: d\ndescriptors:\n  - key: [unclosed\n");
        assert_eq!(e.len(), 1);
        assert!(e[0].contains("not valid YAML"), "{e:?}");
        assert!(e[0].starts_with("4:") || e[0].starts_with("3:"), "{e:?}");
    }

    #[test]
    fn extension_keys_are_checked() {
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, burst: 5}\n"),
            ["4:61: `burst` applies only to token_bucket, gcra and leaky_bucket"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, block_duration: soon}\n"),
            ["4:70: `block_duration` must be a duration such as 900s, 15m, 1h or 1d"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    value: exact\n    share_threshold: true\n"),
            ["5:22: `share_threshold` needs a wildcard `value` (one with `*`) to share"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, replaces: [{name: nobody}]}\n"),
            ["4:72: `replaces` names `nobody`, but no rate limit in domain `d` has that name"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, mode: queue}\n"),
            ["4:60: `mode` is `meter` or `queue`, and only with `algorithm: leaky_bucket`"]
        );
    }

    #[test]
    fn a_domain_in_two_files_is_an_error_unless_merging() {
        let dir = tempdir("two-files");
        std::fs::write(dir.join("a.yaml"), "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n").unwrap();
        std::fs::write(dir.join("b.yaml"), "domain: d\ndescriptors:\n  - key: b\n    rate_limit: {unit: second, requests_per_unit: 2}\n").unwrap();
        let err = super::load(&[&dir], super::LoadOptions::default()).unwrap_err();
        assert!(
            err.to_string()
                .contains("b.yaml:1:9: domain `d` is already defined in"),
            "{err}"
        );
        let set = super::load(
            &[&dir],
            super::LoadOptions {
                merge_domains: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(set.domain("d").unwrap().rule_count(), 2);
    }

    #[test]
    fn a_limit_that_replaces_itself_is_refused_with_its_line() {
        // As Envoy's service refuses it ("replaces should not contain name of same
        // descriptor"): the limit would skip itself and limit nothing.
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      name: me\n      replaces:\n        - name: me\n      unit: second\n      requests_per_unit: 5\n"),
            ["7:17: rate limit `me` names itself in `replaces`: a limit replaces other limits, never itself"]
        );
        // In a `rate_limits:` list each limit is judged on its own.
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limits:\n      - {name: a, unit: second, requests_per_unit: 5}\n      - {name: b, unit: hour, requests_per_unit: 50, replaces: [{name: b}]}\n  - key: j\n    rate_limit: {name: c, unit: second, requests_per_unit: 1, replaces: [{name: a}]}\n"),
            ["6:72: rate limit `b` names itself in `replaces`: a limit replaces other limits, never itself"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      name: me\n      replaces:\n        - name:\n      unit: second\n      requests_per_unit: 5\n"),
            ["7:11: empty `replaces` entry: give the `name` of the rate limit it replaces"]
        );
    }

    #[test]
    fn a_control_character_is_an_error_with_its_place_not_the_end_of_the_file() {
        // Before, the YAML reader stopped at the NUL: `b` and its lockout vanished and
        // the file loaded.
        let text = "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n\0  - key: b\n    rate_limit: {unit: second, requests_per_unit: 1, block_duration: 1h}\n";
        assert_eq!(
            errors(text),
            ["5:1: a control character (U+0000) where text was expected: a rule file is text; remove it"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: a\u{7}b\n"),
            ["3:11: a control character (U+0007) where text was expected: a rule file is text; remove it"]
        );
        // Tabs, CR LF line ends and other scripts are text.
        let fine = "domain: d\r\ndescriptors:\r\n  - key: \"é\t\"\r\n    rate_limit: {unit: second, requests_per_unit: 1}\r\n";
        assert!(super::from_str("f.yaml", fine).is_ok());
        // The gateway's sections come from the same read.
        #[cfg(feature = "tower")]
        assert_eq!(
            tollgate::http::config::from_str("f.yaml", text)
                .unwrap_err()
                .0[0]
                .line,
            5
        );
    }

    /// A rule file whose descriptors nest `depth` levels deep.
    fn nested(depth: usize) -> String {
        let mut text = String::from("domain: d\ndescriptors:\n");
        for level in 0..depth {
            let pad = "  ".repeat(level * 2 + 1);
            text.push_str(&format!("{pad}- key: k{level}\n{pad}  descriptors:\n"));
        }
        let pad = "  ".repeat(depth * 2 + 1);
        text.push_str(&format!(
            "{pad}- key: leaf\n{pad}  rate_limit: {{unit: second, requests_per_unit: 1}}\n"
        ));
        text
    }

    #[test]
    fn descriptors_nest_at_most_the_depth_cap() {
        // 64 levels below the domain (the default cap) load; 65 are refused where the
        // 65th begins.
        assert!(super::from_str("f.yaml", &nested(63)).is_ok());
        let e = errors(&nested(64));
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(
            e[0].ends_with("descriptors nest more than 64 levels deep (the rule files' limit)"),
            "{e:?}"
        );
        assert!(e[0].starts_with("131:259:"), "{e:?}");
    }

    #[test]
    fn the_nesting_estimate_skips_quotes_comments_and_block_scalars() {
        let deep = |s: &str| "[".repeat(200) + s;
        let fine = format!(
            "domain: d\ndescriptors:\n  - key: k  # {c}\n    metadata:\n      quoted: \"{q}\"\n      single: '{q}'\n      text: |\n{b}\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n",
            c = deep(""),
            q = deep(""),
            b = (1..300).map(|i| format!("{}x\n", " ".repeat(6 + i))).collect::<String>()
        );
        assert!(super::from_str("f.yaml", &fine).is_ok(), "{fine}");
        // Lists opened inside one line count, one level each.
        let dashes = format!("domain: d\ndescriptors:\n  {}x\n", "- ".repeat(300));
        let e = errors(&dashes);
        assert_eq!(
            e,
            ["3:3: the YAML nests more than 232 levels deep (the rule files' limit)"]
        );
    }

    #[test]
    fn a_deep_file_is_an_error_on_a_small_stack_not_a_crash() {
        // 1,200 levels (2.9 MB) crashed a reload on a tokio worker's 2 MiB stack. The
        // whole load runs here on such a stack: an overflow would abort the test binary.
        let text = nested(1200);
        let dir = tempdir("deep");
        std::fs::write(dir.join("deep.yaml"), &text).unwrap();
        // The deepest a file may be, with the cap at its maximum, reads on such a stack.
        let deepest = tempdir("deepest");
        std::fs::write(
            deepest.join("deepest.yaml"),
            nested(tollgate::rules::MAX_MAX_DEPTH - 1),
        )
        .unwrap();
        let flow = format!(
            "domain: d\ndescriptors:\n  - key: k\n    metadata: {}{}\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n",
            "[".repeat(225),
            "]".repeat(225)
        );
        let loaded = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || {
                let from_text = super::from_str("deep.yaml", &text).map(|_| ());
                let from_dir = super::load(&[&dir], super::LoadOptions::default()).map(|_| ());
                let widest = super::LoadOptions {
                    max_depth: tollgate::rules::MAX_MAX_DEPTH,
                    ..Default::default()
                };
                let deepest = super::load(&[&deepest], widest);
                let flow = super::from_str("flow.yaml", &flow).map(|_| ());
                (from_text, from_dir, deepest.map(|_| ()), flow)
            })
            .unwrap()
            .join()
            .unwrap();
        for result in [loaded.0, loaded.1] {
            let e = result.unwrap_err();
            assert!(
                e.to_string()
                    .contains("levels deep (the rule files' limit)"),
                "{e}"
            );
        }
        assert_eq!(loaded.2, Ok(()));
        // Nesting inside `metadata` is the YAML's own: just within its limit, it is read
        // (and refused for what it is, not for its depth).
        let e = loaded.3.unwrap_err().to_string();
        assert!(e.contains("`metadata` must be a mapping"), "{e}");
    }

    #[test]
    fn compact_and_mixed_nesting_is_caught_before_parsing() {
        // Collections opened inside one line (`- `, `? ` complex keys, `: ` their
        // values), and block nesting continued in flow style: each counts, so each of
        // these is an error with its place, on a 2 MiB stack, and not an overflow.
        let block = (0..150)
            .map(|i| format!("{}k{i}:\n", " ".repeat(i)))
            .collect::<String>();
        let files = [
            format!("domain: d\ndescriptors:\n{}x\n", "? ".repeat(20_000)),
            format!("domain: d\ndescriptors:\n{}x\n", "- ? ".repeat(10_000)),
            format!("domain: d\n? x\n: {}x\n", "- ".repeat(20_000)),
            format!(
                "domain: d\ndescriptors:\n{}{}\n",
                "- ".repeat(150),
                "[".repeat(20_000)
            ),
            format!(
                "domain: d\nx:\n{block}{}y: {}\n",
                " ".repeat(150),
                "{a: [".repeat(10_000)
            ),
        ];
        let found = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || files.map(|text| errors(&text)))
            .unwrap()
            .join()
            .unwrap();
        let line = |e: &[String]| e.first().map(|e| e.split(':').next().unwrap().to_string());
        for (i, (e, at)) in found.iter().zip(["3", "3", "3", "3", "153"]).enumerate() {
            assert_eq!(e.len(), 1, "file {i}: {e:?}");
            assert!(
                e[0].ends_with("the YAML nests more than 232 levels deep (the rule files' limit)"),
                "file {i}: {e:?}"
            );
            assert_eq!(line(e).as_deref(), Some(at), "file {i}: {e:?}");
        }
    }

    #[test]
    fn a_lockout_is_at_most_a_year() {
        let rule = |block: &str| {
            format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{unit: second, requests_per_unit: 1, block_duration: {block}}}\n")
        };
        assert!(super::from_str("f.yaml", &rule("365d")).is_ok());
        for longer in ["366d", "8785h", "99999999999d"] {
            assert_eq!(
                errors(&rule(longer)),
                ["4:70: `block_duration` may be at most 365d (a lockout is a key kept that long, and its Retry-After must stay a number a client can use)"],
                "{longer}"
            );
        }
    }

    /// A queue at 1 a year holding 4,294,967,295 requests put instants past what the
    /// state holds: delays and remaining went backwards. Bucket numbers are bounded, with
    /// the largest burst that works named.
    #[test]
    fn bucket_numbers_are_bounded_with_the_reason() {
        let rule = |limit: &str| {
            format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{{limit}}}\n")
        };
        // The error is placed at the `burst` value.
        let at_burst = |limit: &str, message: &str| {
            let line = format!("    rate_limit: {{{limit}}}");
            let column = line.find("burst: ").unwrap() + "burst: ".len() + 1;
            assert_eq!(errors(&rule(limit)), [format!("4:{column}: {message}")]);
        };
        at_burst(
            "unit: year, requests_per_unit: 1, algorithm: leaky_bucket, mode: queue, burst: 4294967295",
            "a bucket of 4294967295 draining 1 per year takes more than 100 years to drain: make `burst` at most 100 (its state is an instant, kept exact within a century)",
        );
        at_burst(
            "unit: year, requests_per_unit: 1, algorithm: token_bucket, burst: 101",
            "a bucket of 101 draining 1 per year takes more than 100 years to drain: make `burst` at most 100 (its state is an instant, kept exact within a century)",
        );
        assert!(super::from_str(
            "f.yaml",
            &rule("unit: year, requests_per_unit: 1, algorithm: gcra, burst: 100")
        )
        .is_ok());
        // A queue holds a request at most a day.
        at_burst(
            "unit: hour, requests_per_unit: 2, algorithm: leaky_bucket, mode: queue, burst: 50",
            "a queue of 50 leaving 2 per hour holds its last request more than a day: make `burst` at most 49 (a queued request waits in memory, and no client waits that long)",
        );
        assert!(super::from_str(
            "f.yaml",
            &rule(
                "unit: hour, requests_per_unit: 2, algorithm: leaky_bucket, mode: queue, burst: 49"
            )
        )
        .is_ok());
        // Windows have no such state; a bucket's default burst is its limit.
        assert!(
            super::from_str("f.yaml", &rule("unit: year, requests_per_unit: 4294967295")).is_ok()
        );
        assert!(super::from_str(
            "f.yaml",
            &rule("unit: year, requests_per_unit: 1, algorithm: token_bucket")
        )
        .is_ok());
    }

    #[test]
    fn a_byte_order_mark_is_skipped() {
        let text = "\u{feff}domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n";
        let set = super::from_str("f.yaml", text).unwrap();
        assert_eq!(set.domains().len(), 1);
        assert_eq!(
            errors("\u{feff}domain: d\nextra: 1\n"),
            ["2:1: unknown key `extra` in the top level (expected one of: domain, descriptors, http, failure_mode, local_fallback_divisor, regions, charge_rejected, consistency, lease_period, sync_interval, scope, pools)"]
        );
        #[cfg(feature = "tower")]
        assert!(tollgate::http::config::from_str("f.yaml", text)
            .unwrap()
            .is_none());
    }

    #[test]
    fn a_yaml_syntax_error_is_reported_once_with_its_line() {
        let dir = tempdir("syntax");
        std::fs::write(
            dir.join("bad.yaml"),
            "domain: d\ndescriptors:\n  - key: \"unclosed\n",
        )
        .unwrap();
        let file = dir.join("bad.yaml").display().to_string();
        let rules = super::load(&[&dir], super::LoadOptions::default()).unwrap_err();
        assert_eq!(
            rules.to_string(),
            format!("{file}:3:10: not valid YAML: while scanning a quoted scalar, found unexpected end of stream")
        );
        // The gateway's sections come from the same read: the same problem, once.
        #[cfg(feature = "tower")]
        assert_eq!(
            tollgate::http::config::load(&[&dir], super::LoadOptions::default()).unwrap_err(),
            rules
        );
    }

    /// A directory of its own for one test, removed when the test ends.
    pub(super) struct TempDir(std::path::PathBuf);

    impl std::ops::Deref for TempDir {
        type Target = std::path::PathBuf;
        fn deref(&self) -> &std::path::PathBuf {
            &self.0
        }
    }

    impl AsRef<std::path::Path> for TempDir {
        fn as_ref(&self) -> &std::path::Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    pub(super) fn tempdir(name: &str) -> TempDir {
        let dir =
            std::env::temp_dir().join(format!("tollgate-rules-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

mod matching {
    use super::*;

    const TREE: &str = "domain: m
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: k
    value: a*
    rate_limit: {unit: second, requests_per_unit: 2}
  - key: k
    value: ab*
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: k
    value: abc
    rate_limit: {unit: second, requests_per_unit: 4}
  - key: k
    value: trusted
  - key: parent
    descriptors:
      - key: child
        rate_limit: {unit: second, requests_per_unit: 5}
";

    fn rpu(entries: &[(&str, &str)]) -> Option<u64> {
        let set = from_str("t.yaml", TREE).unwrap();
        let m = set.domain("m").unwrap().find(entries)?;
        m.rule.limits.first().map(|l| l.requests_per_unit)
    }

    #[test]
    fn exact_beats_wildcard_beats_bare_key_and_the_first_wildcard_wins() {
        assert_eq!(rpu(&[("k", "abc")]), Some(4));
        assert_eq!(rpu(&[("k", "abd")]), Some(2), "a* comes first in the file");
        assert_eq!(rpu(&[("k", "xyz")]), Some(1));
        assert_eq!(
            rpu(&[("k", "")]),
            Some(1),
            "an empty value goes to the bare key"
        );
        assert_eq!(rpu(&[("k", "trusted")]), None, "allow-list entry");
    }

    #[test]
    fn only_the_rule_at_the_request_depth_applies() {
        assert_eq!(rpu(&[("parent", "p"), ("child", "c")]), Some(5));
        assert_eq!(rpu(&[("parent", "p")]), None);
        assert_eq!(
            rpu(&[("parent", "p"), ("child", "c"), ("deeper", "x")]),
            None
        );
        assert_eq!(rpu(&[("k", "abc"), ("child", "c")]), None);
    }
}

mod null_values {
    use super::*;

    /// A domain with no rules: every descriptor passes, unlimited by no rule.
    fn limits_nothing(text: &str) {
        let set = from_str("f.yaml", text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(set.domain("d").unwrap().rule_count(), 0, "{text}");
        let (l, _) = limiter(text);
        let r = l.check_now(&req("d", &[("k", "v")])).unwrap();
        assert_eq!(r.overall, Code::Ok, "{text}");
        assert!(r.statuses[0].limit.is_none(), "{text}");
    }

    #[test]
    fn a_domain_whose_descriptors_are_null_empty_or_missing_loads_with_no_rules() {
        // `descriptors:` with nothing after it is YAML's null, as in Envoy's own test
        // files; Envoy's service reads it (and `[]`, `~`, or no key) as no descriptors.
        for text in [
            "domain: d\ndescriptors:\n",
            "domain: d\ndescriptors: ~\n",
            "domain: d\ndescriptors: null\n",
            "domain: d\ndescriptors: []\n",
            "domain: d\n",
        ] {
            limits_nothing(text);
        }
    }

    #[test]
    fn a_descriptor_whose_descriptors_are_null_keeps_its_own_limit() {
        let text = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n    descriptors:\n";
        let (l, _) = limiter(text);
        assert_eq!(
            l.check_now(&req("d", &[("k", "v")])).unwrap().overall,
            Code::Ok
        );
        assert_eq!(
            l.check_now(&req("d", &[("k", "v")])).unwrap().overall,
            Code::OverLimit
        );
    }

    #[test]
    fn a_null_rate_limit_or_flag_is_not_given() {
        // Envoy's service reads YAML's null as "not given": no limit (an allow-list
        // rule), a flag that is off.
        let text = "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n    shadow_mode:\n  - key: j\n    detailed_metric: ~\n    rate_limit: {unit: second, requests_per_unit: 1}\n";
        let (l, _) = limiter(text);
        let r = l.check_now(&req("d", &[("k", "v")])).unwrap();
        assert!(r.statuses[0].limit.is_none());
        assert_eq!(
            l.check_now(&req("d", &[("j", "v")])).unwrap().overall,
            Code::Ok
        );
        let r = l.check_now(&req("d", &[("j", "v")])).unwrap();
        assert_eq!(r.overall, Code::OverLimit, "not in shadow mode");
    }

    #[test]
    fn a_quoted_empty_string_is_not_a_list() {
        // `""` is text, not null: Envoy's service refuses it too.
        assert_eq!(
            super::errors("domain: d\ndescriptors: \"\"\n"),
            ["2:14: `descriptors` must be a list"]
        );
    }
}

mod extensions {
    use super::*;

    #[test]
    fn a_years_lockout_answers_with_a_numeric_retry_after_of_a_year() {
        let (l, clock) = limiter("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, block_duration: 365d}\n");
        assert_eq!(
            l.check_now(&req("d", &[("k", "v")])).unwrap().overall,
            Code::Ok
        );
        let year = 365 * 86_400;
        for (after, left) in [(0, year), (86_400, year - 86_400)] {
            clock.advance(Duration::from_secs(after));
            let r = l.check_now(&req("d", &[("k", "v")])).unwrap();
            assert_eq!(r.overall, Code::OverLimit);
            let fields =
                tollgate::headers::headers(&r, tollgate::headers::HeaderSettings::default());
            let retry = fields
                .iter()
                .find(|(name, _)| *name == "Retry-After")
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| panic!("no Retry-After: {fields:?}"));
            let secs: u64 = retry
                .parse()
                .unwrap_or_else(|_| panic!("Retry-After {retry:?}"));
            assert!(
                (left - 1..=left + 1).contains(&secs),
                "{secs} s, not about {left}"
            );
        }
    }

    #[test]
    fn charge_rejected_is_inherited_until_a_descriptor_sets_its_own() {
        let (l, _) = limiter(
            "domain: c
charge_rejected: all
descriptors:
  - key: team
    descriptors:
      - key: user
        rate_limit: {unit: minute, requests_per_unit: 2}
  - key: spared
    charge_rejected: none
    rate_limit: {unit: minute, requests_per_unit: 2}
",
        );
        let cost = |entries: &[(&str, &str)], hits: u64| {
            let mut r = req("c", entries);
            r.hits_addend = hits;
            l.check_now(&r).unwrap()
        };
        // The domain's `all` reaches the nested rule: the refused 3 are charged.
        let team = [("team", "t"), ("user", "u")];
        let r = cost(&team, 3);
        assert_eq!((r.overall, r.statuses[0].remaining), (Code::OverLimit, 0));
        assert_eq!(cost(&team, 1).overall, Code::OverLimit);
        // `none` on a descriptor wins: refused, charged nothing, 2 still left.
        let spared = [("spared", "s")];
        let r = cost(&spared, 3);
        assert_eq!((r.overall, r.statuses[0].remaining), (Code::OverLimit, 2));
        assert_eq!(cost(&spared, 2).overall, Code::Ok);
    }

    #[test]
    fn replaces_skips_the_named_limit_of_other_descriptors() {
        let (l, _) = limiter(
            "domain: r
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 1, name: per_user}
  - key: plan
    value: gold
    rate_limit: {unit: minute, requests_per_unit: 100, name: gold, replaces: [{name: per_user}]}
",
        );
        let mut both = req("r", &[("user", "u")]);
        both.descriptors
            .push(req("r", &[("plan", "gold")]).descriptors.remove(0));
        for _ in 0..5 {
            let r = l.check_now(&both).unwrap();
            assert_eq!(r.overall, Code::Ok);
            assert_eq!(
                r.statuses[0].limit, None,
                "the per-user limit is not checked"
            );
        }
        // Alone, the user limit applies and was never charged.
        assert_eq!(
            l.check_now(&req("r", &[("user", "u")])).unwrap().statuses[0].remaining,
            0
        );
        assert_eq!(
            l.check_now(&req("r", &[("user", "u")])).unwrap().overall,
            Code::OverLimit
        );
    }

    #[test]
    fn share_threshold_makes_every_matching_value_share_one_counter() {
        let (l, _) = limiter(
            "domain: s
descriptors:
  - key: path
    value: /api/*
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: path
    value: /own/*
    rate_limit: {unit: minute, requests_per_unit: 2}
",
        );
        assert_eq!(
            l.check_now(&req("s", &[("path", "/api/a")]))
                .unwrap()
                .overall,
            Code::Ok
        );
        assert_eq!(
            l.check_now(&req("s", &[("path", "/api/b")]))
                .unwrap()
                .overall,
            Code::Ok
        );
        assert_eq!(
            l.check_now(&req("s", &[("path", "/api/c")]))
                .unwrap()
                .overall,
            Code::OverLimit
        );
        for v in ["/own/a", "/own/b", "/own/c"] {
            assert_eq!(
                l.check_now(&req("s", &[("path", v)])).unwrap().overall,
                Code::Ok,
                "{v} has its own counter"
            );
        }
    }

    #[test]
    fn a_request_override_replaces_the_numbers_and_keeps_the_counter() {
        let (l, _) = limiter("domain: o\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 3}\n");
        for _ in 0..2 {
            assert_eq!(
                l.check_now(&req("o", &[("k", "v")])).unwrap().overall,
                Code::Ok
            );
        }
        let mut overridden = req("o", &[("k", "v")]);
        overridden.descriptors[0].limit = Some(LimitOverride {
            requests_per_unit: 5,
            unit: Unit::Minute,
        });
        let r = l.check_now(&overridden).unwrap();
        assert_eq!(
            r.statuses[0].remaining, 2,
            "the 2 already counted still count"
        );
        assert_eq!(r.statuses[0].limit.as_ref().unwrap().requests_per_unit, 5);
    }

    #[test]
    fn several_limits_report_the_one_that_rejected_or_the_least_remaining() {
        let (l, clock) = limiter(
            "domain: m\ndescriptors:\n  - key: u\n    rate_limits:\n      - {unit: second, requests_per_unit: 2, name: burst}\n      - {unit: hour, requests_per_unit: 3, name: hourly}\n",
        );
        let name = |r: &tollgate::limiter::RateLimitResponse| {
            r.statuses[0].limit.as_ref().unwrap().name.clone().unwrap()
        };
        let r = l.check_now(&req("m", &[("u", "x")])).unwrap();
        assert_eq!((name(&r), r.statuses[0].remaining), ("burst".into(), 1));
        l.check_now(&req("m", &[("u", "x")])).unwrap();
        let r = l.check_now(&req("m", &[("u", "x")])).unwrap();
        assert_eq!((r.overall, name(&r)), (Code::OverLimit, "burst".into()));
        clock.advance(Duration::from_secs(1));
        let r = l.check_now(&req("m", &[("u", "x")])).unwrap();
        assert_eq!(
            (r.overall, name(&r), r.statuses[0].remaining),
            (Code::Ok, "hourly".into(), 0)
        );
        clock.advance(Duration::from_secs(1));
        let r = l.check_now(&req("m", &[("u", "x")])).unwrap();
        assert_eq!((r.overall, name(&r)), (Code::OverLimit, "hourly".into()));
    }

    #[test]
    fn an_overdraft_admits_into_debt_and_flags_it_until_repaid() {
        let (l, clock) = limiter("domain: o\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 5, overdraft: 3}\n");
        let statuses: Vec<_> = (0..9)
            .map(|_| l.check_now(&req("o", &[("k", "v")])).unwrap().statuses[0].clone())
            .collect();
        for (i, s) in statuses.iter().enumerate() {
            match i {
                0..=4 => assert!(
                    s.code == Code::Ok && !s.overdraft && s.remaining == 4 - i as u64,
                    "{i}: {s:?}"
                ),
                5..=7 => assert!(
                    s.code == Code::Ok && s.overdraft && s.remaining == 0,
                    "{i}: {s:?}"
                ),
                _ => assert!(s.code == Code::OverLimit && !s.overdraft, "{i}: {s:?}"),
            }
        }
        // Full again 800 ms later: 5 tokens plus the debt of 3.
        assert_eq!(statuses[7].reset_after, 800_000_000);
        clock.advance(Duration::from_millis(300));
        let s = &l.check_now(&req("o", &[("k", "v")])).unwrap().statuses[0];
        assert!(
            s.code == Code::Ok && s.overdraft,
            "debt repaid, the bucket empty: {s:?}"
        );
        clock.advance(Duration::from_millis(200));
        let s = &l.check_now(&req("o", &[("k", "v")])).unwrap().statuses[0];
        assert!(
            s.code == Code::Ok && !s.overdraft && s.remaining == 0,
            "{s:?}"
        );
    }

    #[test]
    fn overdraft_is_checked() {
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, overdraft: 5}\n"),
            ["4:65: `overdraft` applies only to token_bucket and gcra (a bucket that may go into debt)"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, algorithm: leaky_bucket, overdraft: 5}\n"),
            ["4:90: `overdraft` applies only to token_bucket and gcra (a bucket that may go into debt)"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, algorithm: gcra, overdraft: -1}\n"),
            ["4:82: `overdraft` must be a whole number from 0 to 4294967295, got `-1`"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, algorithm: gcra, overdraft: 2.5}\n"),
            ["4:82: `overdraft` must be a whole number from 0 to 4294967295, got `2.5`"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: year, requests_per_unit: 1, algorithm: token_bucket, burst: 50, overdraft: 60}\n"),
            ["4:99: a bucket of 50 with an overdraft of 60 refilling 1 per year takes more than 100 years to repay and refill: make `burst` + `overdraft` at most 100 (its state is an instant, kept exact within a century)"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true, overdraft: 1}\n"),
            ["4:46: an `unlimited` rate limit cannot also have an `overdraft`"]
        );
        assert_eq!(
            errors("domain: d\nconsistency: leased\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 5, algorithm: gcra, overdraft: 2}\n  - key: fine\n    rate_limit: {unit: second, requests_per_unit: 5, algorithm: gcra, overdraft: 0}\n"),
            ["5:18: `consistency: leased` cannot count this gcra limit: an `overdraft` is a debt decided and flagged on the shared state, admission by admission, which units taken ahead cannot keep; give it `consistency: exact` (on its descriptor)"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    scope: global\n    rate_limit: {unit: second, requests_per_unit: 5, algorithm: token_bucket, overdraft: 2}\n"),
            ["5:18: `consistency: leased` cannot count this token_bucket limit: an `overdraft` is a debt decided and flagged on the shared state, admission by admission, which units taken ahead cannot keep; give it `consistency: exact` (on its descriptor)"]
        );
        // Accepted: the buckets, 0, and the largest.
        for ok in [
            "{unit: second, requests_per_unit: 1, algorithm: token_bucket, overdraft: 0}",
            "{unit: minute, requests_per_unit: 60, algorithm: gcra, burst: 10, overdraft: 30}",
            "{unit: second, requests_per_unit: 1000, algorithm: gcra, overdraft: 4294967295}",
        ] {
            let text = format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {ok}\n");
            assert!(from_str("f.yaml", &text).is_ok(), "{ok}");
        }
    }

    #[test]
    fn a_warm_up_starts_a_cold_key_at_a_third_of_the_rate() {
        // 10 per second, burst 1, warm-up 3 s: after the first request the next fits
        // 293,333,334 ns later (nearly three intervals), not 100 ms.
        let (l, clock) = limiter("domain: w\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 10, algorithm: gcra, burst: 1, warmup: 3s}\n");
        let code = |l: &Limiter| l.check_now(&req("w", &[("k", "v")])).unwrap().statuses[0].code;
        assert_eq!(code(&l), Code::Ok);
        clock.advance(Duration::from_millis(100));
        assert_eq!(code(&l), Code::OverLimit);
        clock.advance(Duration::from_nanos(193_333_333));
        assert_eq!(code(&l), Code::OverLimit);
        clock.advance(Duration::from_nanos(1));
        assert_eq!(code(&l), Code::Ok);
    }

    #[test]
    fn warmup_is_checked() {
        let rule =
            |limit: &str| format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {limit}\n");
        for (limit, want) in [
            (
                "{unit: second, requests_per_unit: 1, warmup: 30s}",
                "4:62: `warmup` applies only to token_bucket and gcra (a bucket whose idle keys start cold)",
            ),
            (
                "{unit: second, requests_per_unit: 1, algorithm: leaky_bucket, warmup: 30s}",
                "4:87: `warmup` applies only to token_bucket and gcra (a bucket whose idle keys start cold)",
            ),
            (
                "{unit: second, requests_per_unit: 1, algorithm: sliding_window, warmup: 30s}",
                "4:89: `warmup` applies only to token_bucket and gcra (a bucket whose idle keys start cold)",
            ),
            (
                "{unit: second, requests_per_unit: 1, algorithm: gcra, warmup: 0s}",
                "4:79: `warmup` must be longer than zero (leave it out for no warm-up)",
            ),
            (
                "{unit: second, requests_per_unit: 1, algorithm: gcra, warmup: soon}",
                "4:79: `warmup` must be a duration such as 500ms, 30s, 5m or 1h",
            ),
            (
                "{unit: second, requests_per_unit: 1, algorithm: gcra, warmup: 2d}",
                "4:79: `warmup` may be at most 1d (a cold key is kept that long after its last request)",
            ),
            (
                "{unit: second, requests_per_unit: 1, algorithm: gcra, overdraft: 2, warmup: 30s}",
                "4:93: `warmup` cannot be combined with `overdraft`: a cold key admits at a third of the rate, a debt admits beyond the bucket",
            ),
            (
                "{unlimited: true, warmup: 30s}",
                "4:43: an `unlimited` rate limit cannot also have a `warmup`",
            ),
            (
                "{unit: second, requests_per_unit: 4294967291, algorithm: token_bucket, warmup: 86399999ms}",
                "4:96: a warm-up of 86399999 ms is too long for 4294967291 per 1000 ms with a burst of 4294967291: the stored permits of a cold key (warm-up × rate) would not stay exact; shorten `warmup`",
            ),
            (
                "{unit: second, requests_per_unit: 5, algorithm: gcra, warmup: 30s, block_duration: 30d}",
                "4:79: `warmup` cannot be combined with a `block_duration` above 26d",
            ),
            (
                "{unit: second, requests_per_unit: 5, algorithm: gcra, warmup: 30s, priority: {from: p, shares: {a: 100%, b: 50%}, default_class: b}}",
                "4:79: `warmup` cannot be combined with `priority`: the classes share one counter, and how warm it is would be each class's",
            ),
        ] {
            assert_eq!(errors(&rule(limit)), [want], "{limit}");
        }
        assert_eq!(
            errors("domain: d\nconsistency: leased\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 5, algorithm: gcra, warmup: 30s}\n"),
            ["5:18: `consistency: leased` cannot count this gcra limit: a `warmup` slows each admission by how warm the key is on the shared state, which units taken ahead cannot keep; give it `consistency: exact` (on its descriptor)"]
        );
        assert_eq!(
            errors("domain: d\nconsistency: synced\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 5, algorithm: token_bucket, warmup: 30s}\n"),
            ["5:18: `consistency: synced` cannot count this token_bucket limit: a `warmup` slows each admission by how warm the key is on the shared state, which units taken ahead cannot keep; give it `consistency: exact` (on its descriptor)"]
        );
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: k\n    scope: global\n    rate_limit: {unit: second, requests_per_unit: 5, algorithm: token_bucket, warmup: 1m}\n"),
            ["5:18: `consistency: leased` cannot count this token_bucket limit: a `warmup` slows each admission by how warm the key is on the shared state, which units taken ahead cannot keep; give it `consistency: exact` (on its descriptor)"]
        );
        // Accepted: the buckets, in every duration syntax, up to a day.
        for ok in [
            "{unit: second, requests_per_unit: 1, algorithm: token_bucket, warmup: 30}",
            "{unit: minute, requests_per_unit: 60, algorithm: gcra, burst: 10, warmup: 500ms}",
            "{unit: second, requests_per_unit: 1000, algorithm: gcra, warmup: 1d}",
            "{unit: hour, requests_per_unit: 7, algorithm: token_bucket, warmup: 15m, overdraft: 0}",
        ] {
            let text = format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {ok}\n");
            assert!(from_str("f.yaml", &text).is_ok(), "{ok}");
        }
    }

    #[test]
    fn soft_throttling_admits_the_overage_and_flags_it() {
        let (l, _) = limiter("domain: s\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 10, overage_percent: 50}\n");
        let results: Vec<_> = (0..16)
            .map(|_| l.check_now(&req("s", &[("k", "v")])).unwrap())
            .collect();
        for (i, r) in results.iter().enumerate() {
            let s = &r.statuses[0];
            match i {
                0..=9 => assert!(
                    s.code == Code::Ok && !s.over_soft_limit && s.remaining == 9 - i as u64,
                    "{i}: {s:?}"
                ),
                10..=14 => assert!(
                    s.code == Code::Ok && s.over_soft_limit && s.remaining == 0,
                    "{i}: {s:?}"
                ),
                _ => assert_eq!(s.code, Code::OverLimit),
            }
            assert_eq!(s.limit.as_ref().unwrap().requests_per_unit, 10);
        }
    }

    #[test]
    fn global_shadow_mode_reports_statuses_but_answers_ok() {
        let clock = ManualClock::new(T0);
        let rules = Arc::new(Rules::fixed(from_str("f", "domain: g\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1}\n").unwrap()));
        let l = Limiter::new(rules, MemoryStore::new())
            .with_clock(Arc::new(clock))
            .with_settings(Settings {
                global_shadow_mode: true,
                ..Settings::default()
            });
        l.check_now(&req("g", &[("k", "v")])).unwrap();
        let r = l.check_now(&req("g", &[("k", "v")])).unwrap();
        assert_eq!((r.overall, r.statuses[0].code), (Code::Ok, Code::OverLimit));
    }

    #[test]
    fn a_leaky_bucket_queue_rule_reports_the_delay() {
        let (l, _) = limiter("domain: q\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 4, algorithm: leaky_bucket, mode: queue, burst: 2}\n");
        let delays: Vec<_> = (0..3)
            .map(|_| l.check_now(&req("q", &[("k", "v")])).unwrap().statuses[0].delay)
            .collect();
        assert_eq!(delays[..2], [0, 250_000_000]);
        assert_eq!(
            l.check_now(&req("q", &[("k", "v")])).unwrap().overall,
            Code::OverLimit
        );
    }

    #[test]
    fn malformed_requests_are_refused_with_a_reason() {
        let (l, _) = limiter("domain: d\n");
        let cases = [
            (
                req("", &[("k", "v")]),
                "rate limit domain must not be empty",
            ),
            (
                RateLimitRequest {
                    domain: "d".into(),
                    ..Default::default()
                },
                "rate limit descriptor list must not be empty",
            ),
            (
                req("d", &[("", "v")]),
                "descriptor 0, entry 0 has an empty key",
            ),
        ];
        for (r, why) in cases {
            assert_eq!(
                l.check_now(&r).unwrap_err().to_string(),
                format!("invalid request: {why}")
            );
        }
    }

    #[test]
    fn a_descriptor_without_entries_is_ok_with_no_limit() {
        // As Envoy's service answers it; beside a limited descriptor, which is charged.
        let (l, _) =
            limiter("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 2}\n");
        let r = RateLimitRequest {
            domain: "d".into(),
            descriptors: vec![
                Descriptor::default(),
                req("d", &[("k", "v")]).descriptors[0].clone(),
            ],
            hits_addend: 0,
        };
        let answer = l.check_now(&r).unwrap();
        assert_eq!(answer.overall, Code::Ok);
        assert_eq!(answer.statuses[0].limit, None);
        assert_eq!(answer.statuses[0].code, Code::Ok);
        assert_eq!(answer.statuses[1].remaining, 1);
    }

    #[test]
    fn metric_paths_follow_the_rule_unless_detailed() {
        let (l, _) = limiter("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 9}\n  - key: b\n    detailed_metric: true\n    rate_limit: {unit: minute, requests_per_unit: 9}\n");
        let path = |k: &str| {
            l.check_now(&req("d", &[(k, "runtime")])).unwrap().statuses[0]
                .metric
                .clone()
                .unwrap()
                .path
        };
        assert_eq!(&*path("a"), "a");
        assert_eq!(&*path("b"), "b_runtime");
    }
}

mod reload {
    use super::errors::tempdir;
    use super::*;

    const V1: &str =
        "domain: r\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 3}\n";

    #[test]
    fn a_reload_that_only_changes_numbers_keeps_the_counters() {
        let dir = tempdir("numbers");
        std::fs::write(dir.join("r.yaml"), V1).unwrap();
        let rules = Arc::new(Rules::load(vec![dir.clone()], LoadOptions::default()).unwrap());
        let l = Limiter::new(Arc::clone(&rules), MemoryStore::new())
            .with_clock(Arc::new(ManualClock::new(T0)));
        for _ in 0..3 {
            assert_eq!(
                l.check_now(&req("r", &[("k", "v")])).unwrap().overall,
                Code::Ok
            );
        }
        std::fs::write(dir.join("r.yaml"), V1.replace("3}", "4}")).unwrap();
        rules.reload().unwrap();
        assert_eq!(
            l.check_now(&req("r", &[("k", "v")])).unwrap().overall,
            Code::Ok,
            "one more under the new limit"
        );
        assert_eq!(
            l.check_now(&req("r", &[("k", "v")])).unwrap().overall,
            Code::OverLimit,
            "not four more"
        );
    }

    #[test]
    fn an_invalid_reload_keeps_the_old_rules_serving() {
        let dir = tempdir("invalid");
        std::fs::write(dir.join("r.yaml"), V1).unwrap();
        let rules = Rules::load(vec![dir.clone()], LoadOptions::default()).unwrap();
        std::fs::write(dir.join("r.yaml"), V1.replace("hour", "fortnight")).unwrap();
        let err = rules.reload().unwrap_err().to_string();
        assert!(
            err.contains("r.yaml:4:24: unknown unit `fortnight`"),
            "{err}"
        );
        assert_eq!(rules.load_failures(), 1);
        assert!(rules.last_error().is_some());
        let current = rules.current();
        let limit = &current.domain("r").unwrap().rules()[0].limits[0];
        assert_eq!(limit.unit, Unit::Hour, "the old rules serve");
        std::fs::write(dir.join("r.yaml"), V1).unwrap();
        rules.reload().unwrap();
        assert!(rules.last_error().is_none());
    }

    #[test]
    fn rules_that_do_not_load_at_first_wait_for_their_files_to_be_fixed() {
        let dir = tempdir("wait-invalid");
        std::fs::write(dir.join("r.yaml"), V1.replace("hour", "fortnight")).unwrap();
        assert!(Rules::load(vec![dir.clone()], LoadOptions::default()).is_err());
        let rules = Rules::load_or_wait(vec![dir.clone()], LoadOptions::default());
        assert!(!rules.is_loaded());
        assert!(rules.current().domains().is_empty(), "nothing in force");
        let err = rules.last_error().unwrap().to_string();
        assert!(err.contains("unknown unit `fortnight`"), "{err}");
        assert_eq!(
            counters(&rules),
            (0, 0, 1),
            "(attempts, successes, failures)"
        );
        // The same files again: the same errors, not counted twice.
        assert_eq!(rules.reload().unwrap_err().to_string(), err);
        assert_eq!(counters(&rules), (1, 0, 1));
        std::fs::write(dir.join("r.yaml"), V1).unwrap();
        assert_eq!(rules.reload().unwrap(), ReloadOutcome::Reloaded);
        assert!(rules.is_loaded());
        assert!(rules.last_error().is_none());
        assert_eq!(counters(&rules), (2, 1, 1));
        assert!(rules.current().domain("r").is_some());
        // Loaded once, a broken edit keeps the rules in force.
        std::fs::write(dir.join("r.yaml"), "domain: [").unwrap();
        assert!(rules.reload().is_err());
        assert!(rules.is_loaded());
        assert!(rules.current().domain("r").is_some());
    }

    #[test]
    fn a_missing_directory_is_not_loaded_until_it_appears_even_empty() {
        let dir = tempdir("wait-missing");
        let rules_dir = dir.join("rules");
        let rules = Rules::load_or_wait(vec![rules_dir.clone()], LoadOptions::default());
        assert!(!rules.is_loaded());
        let err = rules.last_error().unwrap().to_string();
        assert!(err.contains("no such file or directory"), "{err}");
        std::fs::create_dir(&rules_dir).unwrap();
        assert_eq!(rules.reload().unwrap(), ReloadOutcome::Reloaded);
        assert!(
            rules.is_loaded(),
            "an empty directory is a valid, empty rule set"
        );
    }

    #[test]
    fn the_watcher_sees_a_missing_directory_appear_and_then_its_files() {
        let dir = tempdir("watch-missing");
        let rules_dir = dir.join("a/rules");
        let rules = Arc::new(Rules::load_or_wait(
            vec![rules_dir.clone()],
            LoadOptions::default(),
        ));
        let _w = tollgate::rules::watch(Arc::clone(&rules)).unwrap();
        std::fs::create_dir(dir.join("staging")).unwrap();
        std::fs::write(dir.join("staging/r.yaml"), V1).unwrap();
        std::fs::create_dir(dir.join("a")).unwrap();
        std::fs::rename(dir.join("staging"), &rules_dir).unwrap();
        assert!(wait_for(&rules, 3));
        assert!(rules.is_loaded());
        // Its own files are watched from then on.
        std::fs::write(rules_dir.join("r.yaml"), V1.replace("3}", "6}")).unwrap();
        assert!(wait_for(&rules, 6));
    }

    #[test]
    fn the_before_swap_hook_sees_each_new_set_while_the_old_one_serves() {
        let dir = tempdir("before-swap");
        std::fs::write(dir.join("r.yaml"), V1).unwrap();
        let rules = Arc::new(Rules::load(vec![dir.clone()], LoadOptions::default()).unwrap());
        let rpu = |set: &tollgate::rules::RuleSet| {
            set.domain("r").unwrap().rules()[0].limits[0].requests_per_unit
        };
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (serving, seen_by_hook) = (Arc::downgrade(&rules), Arc::clone(&seen));
        rules.before_swap(move |new| {
            let old = serving.upgrade().map(|r| rpu(&r.current()));
            seen_by_hook.lock().unwrap().push((rpu(new), old));
        });
        std::fs::write(dir.join("r.yaml"), V1.replace("3}", "4}")).unwrap();
        rules.reload().unwrap();
        // Unchanged files and an invalid set do not call it.
        rules.reload().unwrap();
        std::fs::write(dir.join("r.yaml"), V1.replace("hour", "fortnight")).unwrap();
        assert!(rules.reload().is_err());
        assert_eq!(*seen.lock().unwrap(), [(4, Some(3))]);
        assert_eq!(rpu(&rules.current()), 4, "swapped in after the hook");
    }

    fn wait_for(rules: &Rules, rpu: u64) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while std::time::Instant::now() < deadline {
            let n = rules
                .current()
                .domain("r")
                .map(|d| d.rules()[0].limits[0].requests_per_unit);
            if n == Some(rpu) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    #[test]
    fn the_watcher_picks_up_an_editor_style_rename_within_two_seconds() {
        let dir = tempdir("watch-rename");
        std::fs::write(dir.join("r.yaml"), V1).unwrap();
        let rules = Arc::new(Rules::load(vec![dir.clone()], LoadOptions::default()).unwrap());
        let _w = tollgate::rules::watch(Arc::clone(&rules)).unwrap();
        std::fs::write(dir.join(".r.yaml.swp"), V1.replace("3}", "7}")).unwrap();
        std::fs::rename(dir.join(".r.yaml.swp"), dir.join("r.yaml")).unwrap();
        assert!(wait_for(&rules, 7));
    }

    #[cfg(unix)]
    #[test]
    fn the_watcher_follows_a_configmap_symlink_swap() {
        use std::os::unix::fs::symlink;
        let dir = tempdir("watch-configmap");
        // The layout of a Kubernetes ConfigMap volume.
        std::fs::create_dir(dir.join("..v1")).unwrap();
        std::fs::write(dir.join("..v1/r.yaml"), V1).unwrap();
        symlink("..v1", dir.join("..data")).unwrap();
        symlink("..data/r.yaml", dir.join("r.yaml")).unwrap();
        let rules = Arc::new(Rules::load(vec![dir.clone()], LoadOptions::default()).unwrap());
        let _w = tollgate::rules::watch(Arc::clone(&rules)).unwrap();
        std::fs::create_dir(dir.join("..v2")).unwrap();
        std::fs::write(dir.join("..v2/r.yaml"), V1.replace("3}", "9}")).unwrap();
        symlink("..v2", dir.join("..data_tmp")).unwrap();
        std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
        assert!(wait_for(&rules, 9));
    }

    /// (attempts, successes, failures) of `rules`.
    fn counters(rules: &Rules) -> (u64, u64, u64) {
        (
            rules.reload_attempts(),
            rules.load_successes(),
            rules.load_failures(),
        )
    }

    #[test]
    fn a_watcher_over_unchanged_files_reads_nothing() {
        let dir = tempdir("watch-idle");
        std::fs::write(dir.join("r.yaml"), V1).unwrap();
        let rules = Arc::new(Rules::load(vec![dir.clone()], LoadOptions::default()).unwrap());
        let _w = tollgate::rules::watch(Arc::clone(&rules)).unwrap();
        // Reading the files (a reload) must not itself look like a change.
        rules.reload().unwrap();
        std::thread::sleep(Duration::from_secs(3));
        assert_eq!(
            counters(&rules),
            (1, 1, 0),
            "(attempts, successes, failures)"
        );
    }

    #[test]
    fn a_broken_edit_counts_one_failure_and_is_not_read_again_until_it_changes() {
        let dir = tempdir("watch-broken");
        std::fs::write(dir.join("r.yaml"), V1).unwrap();
        let rules = Arc::new(Rules::load(vec![dir.clone()], LoadOptions::default()).unwrap());
        let _w = tollgate::rules::watch(Arc::clone(&rules)).unwrap();
        std::fs::write(dir.join("r.yaml"), V1.replace("hour", "fortnight")).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while rules.load_failures() == 0 {
            assert!(std::time::Instant::now() < deadline, "not noticed in 2 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_secs(3));
        assert_eq!(
            counters(&rules),
            (1, 1, 1),
            "(attempts, successes, failures)"
        );
        // Asking again for the same bytes answers the same errors, without counting.
        assert!(rules.reload().is_err());
        assert_eq!(rules.load_failures(), 1);
        // A new change that still fails is a new failure; a fix is a success.
        std::fs::write(dir.join("r.yaml"), V1.replace("hour", "fortnights")).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while rules.load_failures() == 1 {
            assert!(std::time::Instant::now() < deadline, "not noticed in 2 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        std::fs::write(dir.join("r.yaml"), V1.replace("3}", "5}")).unwrap();
        assert!(wait_for(&rules, 5));
        std::thread::sleep(Duration::from_secs(1));
        assert_eq!(rules.load_failures(), 2);
        assert_eq!(rules.load_successes(), 2);
        assert!(rules.last_error().is_none());
    }

    #[test]
    fn one_edit_is_one_reload() {
        let dir = tempdir("watch-once");
        std::fs::write(dir.join("r.yaml"), V1).unwrap();
        let rules = Arc::new(Rules::load(vec![dir.clone()], LoadOptions::default()).unwrap());
        let _w = tollgate::rules::watch(Arc::clone(&rules)).unwrap();
        std::fs::write(dir.join("r.yaml"), V1.replace("3}", "8}")).unwrap();
        assert!(wait_for(&rules, 8));
        std::thread::sleep(Duration::from_secs(2));
        assert_eq!(
            counters(&rules),
            (1, 2, 0),
            "(attempts, successes, failures)"
        );
    }

    #[cfg(unix)]
    #[test]
    fn a_permission_change_alone_is_a_change() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempdir("watch-chmod");
        std::fs::write(dir.join("r.yaml"), V1).unwrap();
        let rules = Arc::new(Rules::load(vec![dir.clone()], LoadOptions::default()).unwrap());
        let _w = tollgate::rules::watch(Arc::clone(&rules)).unwrap();
        let mode = |m: u32| {
            std::fs::set_permissions(dir.join("r.yaml"), std::fs::Permissions::from_mode(m))
                .unwrap()
        };
        mode(0o600);
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while rules.reload_attempts() == 0 {
            assert!(std::time::Instant::now() < deadline, "not noticed in 2 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        mode(0o644);
    }

    #[cfg(unix)]
    #[test]
    fn sighup_reloads() {
        let dir = tempdir("sighup");
        std::fs::write(dir.join("r.yaml"), V1).unwrap();
        let rules = Arc::new(Rules::load(vec![dir.clone()], LoadOptions::default()).unwrap());
        tollgate::rules::reload_on_sighup(Arc::clone(&rules)).unwrap();
        std::fs::write(dir.join("r.yaml"), V1.replace("3}", "11}")).unwrap();
        signal_hook::low_level::raise(signal_hook::consts::SIGHUP).unwrap();
        assert!(wait_for(&rules, 11));
    }
}

/// `consistency`, `lease_period` and `sync_interval` are inherited like `failure_mode`:
/// a descriptor's own settings win, the rest come from above.
#[test]
fn consistency_is_inherited_by_nested_descriptors() {
    use tollgate::algorithm::Consistency;
    let set = from_str(
        "f.yaml",
        "domain: d\nconsistency: leased\nlease_period: 50ms\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 10}\n    descriptors:\n      - key: b\n        consistency: synced\n        rate_limit: {unit: second, requests_per_unit: 10}\n        descriptors:\n          - key: c\n            consistency: exact\n            rate_limit: {unit: second, requests_per_unit: 10}\n  - key: d\n    lease_period: 1s\n    rate_limit: {unit: second, requests_per_unit: 10, algorithm: gcra}\n",
    )
    .unwrap();
    let domain = set.domains()[0];
    let of = |key: &str| {
        domain
            .rules()
            .iter()
            .find(|r| r.key == key)
            .map(|r| r.limits[0].limit.consistency())
            .unwrap()
    };
    const MS: u64 = 1_000_000;
    assert_eq!(of("a"), Consistency::Leased { period: 50 * MS });
    assert_eq!(of("b"), Consistency::Synced { interval: 100 * MS });
    assert_eq!(of("c"), Consistency::Exact);
    assert_eq!(of("d"), Consistency::Leased { period: 1_000 * MS });
}

/// `scope` is inherited like `consistency`; a global limit is leased (with its
/// `lease_period`) and, in fallback, divided by `local_fallback_divisor × regions`; a
/// regional one by `local_fallback_divisor` alone.
#[test]
fn scope_is_inherited_and_a_global_limit_falls_back_to_its_regions_share() {
    use tollgate::algorithm::{Consistency, Scope};
    let set = from_str(
        "f.yaml",
        "domain: d\nscope: global\nlease_period: 50ms\nfailure_mode: local_fallback\nlocal_fallback_divisor: 2\nregions: 3\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 600}\n    descriptors:\n      - key: b\n        scope: region\n        consistency: synced\n        rate_limit: {unit: minute, requests_per_unit: 600}\n",
    )
    .unwrap();
    let domain = set.domains()[0];
    let of = |key: &str| {
        domain
            .rules()
            .iter()
            .find(|r| r.key == key)
            .map(|r| r.limits[0].clone())
            .unwrap()
    };
    const MS: u64 = 1_000_000;
    let a = of("a");
    assert_eq!(a.limit.scope(), Scope::Global);
    assert_eq!(
        a.limit.consistency(),
        Consistency::Leased { period: 50 * MS }
    );
    assert_eq!(a.fallback.limit(), 100);
    let b = of("b");
    assert_eq!(b.limit.scope(), Scope::Region);
    assert_eq!(
        b.limit.consistency(),
        Consistency::Synced { interval: 100 * MS }
    );
    assert_eq!(b.fallback.limit(), 300);
}

/// `local_fallback_divisor` and `regions` are inherited one by one: a descriptor that
/// restates `failure_mode: local_fallback` with its own divisor keeps the regions from
/// above, and `regions` alone under an inherited `local_fallback` is accepted.
#[test]
fn fallback_divisor_and_regions_are_inherited_one_by_one() {
    let set = from_str(
        "f.yaml",
        "domain: d\nfailure_mode: local_fallback\nlocal_fallback_divisor: 2\nregions: 3\nscope: global\ndescriptors:\n  - key: a\n    failure_mode: local_fallback\n    local_fallback_divisor: 4\n    rate_limit: {unit: minute, requests_per_unit: 600}\n  - key: b\n    regions: 5\n    rate_limit: {unit: minute, requests_per_unit: 600}\n  - key: c\n    failure_mode: fail_closed\n    descriptors:\n      - key: d\n        failure_mode: local_fallback\n        rate_limit: {unit: minute, requests_per_unit: 600}\n",
    )
    .unwrap();
    let domain = set.domains()[0];
    let fallback = |key: &str| {
        domain
            .rules()
            .iter()
            .find(|r| r.key == key)
            .map(|r| r.limits[0].fallback.limit())
            .unwrap()
    };
    assert_eq!(fallback("a"), 600 / (4 * 3));
    assert_eq!(fallback("b"), 600 / (2 * 5));
    // Under a `fail_closed`, a `local_fallback` starts again from 1 and 1.
    assert_eq!(fallback("d"), 600);
}

/// A quota group is judged over the whole request: it cannot span a global limit (in the
/// global store) and regional ones, so `quota_mode` on a global descriptor is refused.
#[test]
fn quota_mode_on_a_global_limit_is_refused_with_its_place() {
    let e = from_str(
        "f.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    scope: global\n    quota_mode: true\n    rate_limit: {unit: minute, requests_per_unit: 600}\n",
    )
    .unwrap_err();
    assert_eq!(
        e.to_string().lines().next().unwrap(),
        "f.yaml:3:5: `quota_mode` cannot go with `scope: global`: a quota group is judged over the whole request, and a global limit is counted in another store than the region's"
    );
}

/// `priority` refused with its place for each way it can be wrong.
#[test]
fn priority_misuses_are_refused_with_their_place() {
    let limit = |priority: &str| {
        format!(
            "domain: d\ndescriptors:\n  - key: tenant\n    rate_limit:\n      unit: minute\n      requests_per_unit: 10\n      priority: {priority}\n"
        )
    };
    let cases = [
        ("critical", "`priority` must be"),
        ("{shares: {a: 100%}, default_class: a}", "needs `from`"),
        ("{from: p, default_class: a}", "needs `shares`"),
        ("{from: p, shares: {a: 100%}}", "needs `default_class`"),
        (
            "{from: p, shares: {a: 100%}, default_class: a, weight: 2}",
            "unknown key `weight`",
        ),
        (
            "{from: p, shares: {a: half}, default_class: a}",
            "class `a`: a share is a percentage",
        ),
        ("{from: p, shares: {}, default_class: a}", "names no class"),
    ];
    for (priority, wanted) in cases {
        let errs = errors(&limit(priority));
        assert!(
            errs.iter()
                .any(|e| e.contains(wanted) && e.starts_with("7:")),
            "{priority}: {errs:?}"
        );
    }
    // Not with a lockout: the classes would share it.
    let errs = errors(
        &limit("{from: p, shares: {a: 100%}, default_class: a}").replace(
            "requests_per_unit: 10\n",
            "requests_per_unit: 10\n      block_duration: 15m\n",
        ),
    );
    assert!(
        errs.iter()
            .any(|e| e.contains("cannot be combined with `block_duration`")),
        "{errs:?}"
    );
    // A rule on the key that names the class would never match.
    let errs = errors(&format!(
        "{}  - key: p\n    rate_limit: {{unit: minute, requests_per_unit: 1}}\n",
        limit("{from: p, shares: {a: 100%}, default_class: a}")
    ));
    assert!(
        errs.iter()
            .any(|e| e.starts_with("8:") && e.contains("key `p` would never match")),
        "{errs:?}"
    );
    // Not beside `unlimited`.
    let errs = errors("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true, priority: {from: p, shares: {a: 1%}, default_class: a}}\n");
    assert!(
        errs.iter()
            .any(|e| e.contains("cannot also have a `priority`")),
        "{errs:?}"
    );
    // A 0% share is never admitted, on a bucket as on a window.
    for algorithm in ["fixed_window", "gcra"] {
        let (l, _clock) = limiter(
            &limit("{from: p, shares: {a: 100%, none: 0%}, default_class: a}").replace(
                "requests_per_unit: 10\n",
                &format!("requests_per_unit: 10\n      algorithm: {algorithm}\n"),
            ),
        );
        let none = req("d", &[("tenant", "t"), ("p", "none")]);
        assert_eq!(
            l.check_now(&none).unwrap().overall,
            Code::OverLimit,
            "{algorithm}"
        );
        let a = req("d", &[("tenant", "t"), ("p", "a")]);
        assert_eq!(l.check_now(&a).unwrap().overall, Code::Ok, "{algorithm}");
    }
}

/// Two limits of one domain taking their classes from different keys: each reads its
/// own, and neither key is matched or counted.
#[test]
fn each_limit_reads_its_own_priority_key() {
    let (l, _clock) = limiter(
        "domain: d
descriptors:
  - key: tenant
    rate_limit:
      unit: minute
      requests_per_unit: 4
      priority: {from: tier, shares: {gold: 100%, tin: 25%}, default_class: tin}
  - key: region
    rate_limit:
      unit: minute
      requests_per_unit: 4
      priority: {from: lane, shares: {fast: 100%, slow: 50%}, default_class: slow}
",
    );
    let tin = req("d", &[("tenant", "a"), ("lane", "fast"), ("tier", "tin")]);
    let r = l.check_now(&tin).unwrap();
    assert_eq!(r.statuses[0].limit.as_ref().unwrap().requests_per_unit, 1);
    assert!(!l.check_now(&tin).unwrap().statuses[0].code.eq(&Code::Ok));
    let slow = req("d", &[("region", "eu"), ("tier", "gold")]);
    assert_eq!(l.check_now(&slow).unwrap().statuses[0].remaining, 1);
    let gold = req("d", &[("tier", "gold"), ("tenant", "a")]);
    assert_eq!(l.check_now(&gold).unwrap().statuses[0].remaining, 2);
    // A request's own limit, where no rule matches, keeps one counter whatever class
    // it names.
    let mut own = req("d", &[("path", "/x"), ("tier", "gold")]);
    own.descriptors[0].limit = Some(LimitOverride {
        requests_per_unit: 1,
        unit: Unit::Minute,
    });
    assert_eq!(l.check_now(&own).unwrap().overall, Code::Ok);
    for class in ["tin", "other", "gold"] {
        own.descriptors[0].entries[1].1 = class.to_string();
        assert_eq!(
            l.check_now(&own).unwrap().overall,
            Code::OverLimit,
            "{class}"
        );
    }
}

/// `pools` and `borrow` refused with their place for each way they can be wrong.
#[test]
fn borrowing_misuses_are_refused_with_their_place() {
    let file = |pools: &str, extra: &str, borrow: &str| {
        format!(
            "domain: d\npools:\n{pools}\ndescriptors:\n  - key: tenant\n{extra}    rate_limit:\n      unit: minute\n      requests_per_unit: 10\n      borrow: {borrow}\n"
        )
    };
    let shared = "  - {name: shared, rate_limit: {unit: minute, requests_per_unit: 100}}";
    // The borrow line is line 9 (10 with one line of `extra`).
    let cases: &[(&str, &str, &str, &str, &str)] = &[
        (shared, "", "shared", "9:", "`borrow` must be"),
        (shared, "", "{up_to: 20}", "9:", "needs `from`"),
        (shared, "", "{from: shared}", "9:", "needs `up_to`"),
        (shared, "", "{from: shared, up_to: 20, share: 1}", "9:", "unknown key `share`"),
        (shared, "", "{from: shared, up_to: 10}", "9:", "must be above the limit's own `requests_per_unit` (10)"),
        (shared, "", "{from: shared, up_to: x}", "9:", "up_to"),
        (shared, "", "{from: other, up_to: 20}", "9:", "has no pool of that name (its pools: shared)"),
        ("  []", "", "{from: shared, up_to: 20}", "9:", "it has no `pools` at all"),
        (shared, "    quota_mode: true\n", "{from: shared, up_to: 20}", "10:", "cannot go with `quota_mode`"),
        (shared, "    consistency: leased\n", "{from: shared, up_to: 20}", "10:", "needs a limit counted exactly"),
        // A pool's own misuses, at the pool's line (3).
        ("  - {rate_limit: {unit: minute, requests_per_unit: 100}}", "", "{from: shared, up_to: 20}", "3:", "a pool needs a `name`"),
        ("  - {name: shared}", "", "{from: shared, up_to: 20}", "3:", "a pool needs a `rate_limit`"),
        ("  - {name: shared, rate_limit: {unit: minute, requests_per_unit: 100, priority: {from: p, shares: {a: 50%}, default_class: a}}}", "", "{from: shared, up_to: 20}", "3:", "a pool's rate limit cannot have `priority`"),
        ("  - {name: shared, rate_limit: {unit: minute, requests_per_unit: 100, borrow: {from: shared, up_to: 200}}}", "", "{from: shared, up_to: 20}", "3:", "cannot have `borrow`"),
        ("  - {name: shared, rate_limit: {unit: minute, requests_per_unit: 100}, size: 3}", "", "{from: shared, up_to: 20}", "3:", "unknown key `size`"),
        ("  shared", "", "{from: shared, up_to: 20}", "3:", "`pools` must be a list"),
    ];
    for (pools, extra, borrow, line, wanted) in cases {
        let text = file(pools, extra, borrow);
        let errs = errors(&text);
        assert!(
            errs.iter()
                .any(|e| e.contains(wanted) && e.starts_with(line)),
            "{borrow} / {pools}: wanted {line} {wanted}, got {errs:?}\n{text}"
        );
    }
    // Not with a lockout, priority classes or soft throttling on the same limit.
    for (beside, wanted) in [
        (
            "      block_duration: 15m\n",
            "cannot be combined with `block_duration`",
        ),
        (
            "      priority: {from: p, shares: {a: 50%}, default_class: a}\n",
            "cannot be combined with `priority`",
        ),
        (
            "      overage_percent: 10\n",
            "cannot be combined with `overage_percent`",
        ),
    ] {
        let text = file(shared, "", "{from: shared, up_to: 20}").replace(
            "requests_per_unit: 10\n",
            &format!("requests_per_unit: 10\n{beside}"),
        );
        let errs = errors(&text);
        assert!(errs.iter().any(|e| e.contains(wanted)), "{errs:?}");
    }
    // Two pools of one name in one file, and across two files of a merged domain.
    let twice = file(
        &format!("{shared}\n{shared}"),
        "",
        "{from: shared, up_to: 20}",
    );
    assert!(errors(&twice)
        .iter()
        .any(|e| e.starts_with("4:") && e.contains("duplicate pool `shared`")));
}

/// A limit may borrow from a pool that another file of its (merged) domain defines.
#[test]
fn a_pool_may_come_from_another_file_of_the_domain() {
    let dir = tempfile_dir("pools");
    std::fs::write(
        dir.join("a.yaml"),
        "domain: d\npools:\n  - {name: shared, rate_limit: {unit: minute, requests_per_unit: 5}}\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("b.yaml"),
        "domain: d\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: minute, requests_per_unit: 1, borrow: {from: shared, up_to: 2}}\n",
    )
    .unwrap();
    let merged = LoadOptions {
        merge_domains: true,
        ..LoadOptions::default()
    };
    let set = load(&[&dir], merged).unwrap();
    let d = set.domain("d").unwrap();
    assert_eq!(d.pools.len(), 1);
    // The same pool defined in both files is refused, naming the domain.
    std::fs::write(
        dir.join("c.yaml"),
        "domain: d\npools:\n  - {name: shared, rate_limit: {unit: minute, requests_per_unit: 9}}\n",
    )
    .unwrap();
    let err = load(&[&dir], merged).unwrap_err().to_string();
    assert!(
        err.contains("domain `d` already has a pool of that name"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A fresh directory under the system's temporary directory.
fn tempfile_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("tollgate-rules-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A reload that changes a limit's numbers keeps its counters, but for a limit with a
/// warm-up, which keeps how warm a key is in units of its rate: new numbers, or adding
/// or removing the warm-up, start its keys afresh rather than misread them.
#[test]
fn a_warm_up_limit_starts_afresh_when_its_numbers_change() {
    let id = |limit: &str| {
        let text = format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {limit}\n");
        from_str("f.yaml", &text)
            .unwrap()
            .domain("d")
            .unwrap()
            .rules()[0]
            .limits[0]
            .limit
            .id()
    };
    let plain = "{unit: second, requests_per_unit: 10, algorithm: token_bucket}";
    assert_eq!(id(plain), id(&plain.replace("10,", "1000,")), "kept");
    let warm = "{unit: second, requests_per_unit: 10, algorithm: token_bucket, warmup: 60s}";
    assert_eq!(id(warm), id(warm), "the same rule keeps its counter");
    for other in [
        warm.replace("10,", "1000,"),
        warm.replace("second", "minute"),
        warm.replace("60s", "30s"),
        warm.replace("}", ", burst: 20}"),
        plain.to_string(),
    ] {
        assert_ne!(id(warm), id(&other), "{other}");
    }
}
