//! Work per input byte is bounded for every parser that reads untrusted bytes (the five
//! fuzz targets: the HTTP/2 receive path, the protobuf request decoder, `/v1/check` and
//! `/json` bodies, the rule-file reader, the client-address headers).
//!
//! "Work" here is what a counting allocator (`allocation-counter`, per thread) sees:
//! bytes allocated and allocations made, both deterministic, so the bounds cannot
//! flake on a busy machine. Each parser is fed the inputs that amplify best
//! (`hostile/`: a header block that references one large field over and over,
//! SETTINGS floods over many open streams, rapid resets, nesting past every recursion
//! limit, YAML aliases, requests past every cap) at two sizes, and random bytes; for
//! each, allocation per input byte must stay under the parser's bound, and eight
//! times the input must not cost more than about eight times the work. The CPU side
//! of the same property (instructions per input byte, under callgrind) is
//! `tools/check-amplification.sh`, a measurement rather than a test.

use hostile::{Target, CASES};
use proptest::prelude::*;

mod hostile;

/// `tollgate validate` itself: its source, compiled into this test, so that whatever it
/// does beyond the one load (a second parse of the `http` sections, say) is measured.
#[path = "../src/validate.rs"]
mod validate;

/// What one run of a parser cost, on this thread.
#[derive(Debug, Clone, Copy)]
struct Work {
    allocs: u64,
    bytes: u64,
    peak: u64,
}

fn measure(f: impl FnOnce()) -> Work {
    let info = allocation_counter::measure(f);
    Work {
        allocs: info.count_total,
        bytes: info.bytes_total,
        peak: info.bytes_max,
    }
}

/// A parser's bound: at most `bytes_per_byte` bytes allocated and one allocation per
/// `allocs_per_kib` allocations per KiB of input, beyond a fixed `slack` (buffers set up
/// once).
#[derive(Debug, Clone, Copy)]
struct Bound {
    bytes_per_byte: u64,
    allocs_per_kib: u64,
    slack_bytes: u64,
    slack_allocs: u64,
}

impl Bound {
    fn check(&self, what: &str, input: usize, work: Work) {
        let input = input as u64;
        assert!(
            work.bytes <= self.bytes_per_byte * input + self.slack_bytes,
            "{what}: {} input bytes made {} bytes of allocation (bound {} per byte + {})",
            input,
            work.bytes,
            self.bytes_per_byte,
            self.slack_bytes
        );
        assert!(
            work.allocs <= input * self.allocs_per_kib / 1024 + self.slack_allocs,
            "{what}: {} input bytes made {} allocations (bound {} per KiB + {})",
            input,
            work.allocs,
            self.allocs_per_kib,
            self.slack_allocs
        );
    }
}

/// Runs `parse` on `make(n)` and `make(8 n)`: both within `bound`, and the larger
/// input at most about eight times the work of the smaller (linear, not worse).
fn linear(
    what: &str,
    bound: Bound,
    n: usize,
    make: impl Fn(usize) -> Vec<u8>,
    parse: impl Fn(&[u8]),
) {
    let (small, large) = (make(n), make(8 * n));
    let w1 = measure(|| parse(&small));
    let w8 = measure(|| parse(&large));
    eprintln!(
        "{what}: {} B in: {} allocations, {} B allocated ({:.1}/B), peak {} B; {} B in: {} allocations, {} B ({:.1}/B), peak {} B",
        small.len(), w1.allocs, w1.bytes, w1.bytes as f64 / small.len() as f64, w1.peak,
        large.len(), w8.allocs, w8.bytes, w8.bytes as f64 / large.len() as f64, w8.peak,
    );
    bound.check(what, small.len(), w1);
    bound.check(what, large.len(), w8);
    let ratio = large.len() as f64 / small.len().max(1) as f64;
    let allowed = |w: u64, slack: u64| (w as f64 * ratio * 1.5) as u64 + slack;
    assert!(
        w8.bytes <= allowed(w1.bytes, bound.slack_bytes),
        "{what}: {}× the input allocated {} bytes against {} (more than linear)",
        ratio,
        w8.bytes,
        w1.bytes
    );
    assert!(
        w8.allocs <= allowed(w1.allocs, bound.slack_allocs),
        "{what}: {}× the input made {} allocations against {} (more than linear)",
        ratio,
        w8.allocs,
        w1.allocs
    );
}

// ---- the bounds, one per parser ----

/// Allocation per input byte on the receive path: about what holding the input costs
/// (the connection keeps up to a message and a header block per stream); beyond that,
/// a fixed buffer set.
const H2: Bound = Bound {
    bytes_per_byte: 8,
    allocs_per_kib: 128,
    slack_bytes: 1 << 20,
    slack_allocs: 256,
};

/// The decoder copies what it keeps (at most the caps' worth) and little else.
const PROTOBUF: Bound = Bound {
    bytes_per_byte: 4,
    allocs_per_kib: 256,
    slack_bytes: 64 << 10,
    slack_allocs: 64,
};

/// The bodies are read as they stream: what is kept (at most the caps' worth, each
/// string measured before it is copied) and serde_json's scratch for one string.
const JSON: Bound = Bound {
    bytes_per_byte: 4,
    allocs_per_kib: 256,
    slack_bytes: 64 << 10,
    slack_allocs: 1024,
};

/// The reader keeps a node tree of the file and then the rules; errors carry positions.
/// A rule keeps its whole path from the domain (its stat key), so a tree nested `d`
/// deep allocates in proportion to `d` per byte: the depth cap (64) bounds it.
const RULES: Bound = Bound {
    bytes_per_byte: 256,
    allocs_per_kib: 2048,
    slack_bytes: 256 << 10,
    slack_allocs: 1024,
};

/// `validate`: the reader's work, and the report: every error once more as text, to
/// sort and print (and the test harness keeps what is printed).
const VALIDATE: Bound = Bound {
    bytes_per_byte: 512,
    ..RULES
};

/// `HeaderMap` holds the values (the input again, one allocation per line: most of
/// the figure is the map the test builds) and the hops parsed from them.
const CLIENT_IP: Bound = Bound {
    bytes_per_byte: 32,
    allocs_per_kib: 128,
    slack_bytes: 16 << 10,
    slack_allocs: 64,
};

#[test]
fn the_http2_receive_path_works_in_proportion_to_its_input() {
    for case in CASES.iter().filter(|c| c.target == Target::H2) {
        linear(case.name, H2, case.n, case.make, |input| {
            case.target.run(input)
        });
    }
}

#[test]
fn the_protobuf_decoder_works_in_proportion_to_its_input() {
    for case in CASES.iter().filter(|c| c.target == Target::Protobuf) {
        linear(case.name, PROTOBUF, case.n, case.make, |input| {
            case.target.run(input)
        });
    }
}

#[test]
fn the_json_bodies_cost_in_proportion_to_their_length() {
    for case in CASES.iter().filter(|c| c.target == Target::Json) {
        linear(case.name, JSON, case.n, case.make, |input| {
            case.target.run(input)
        });
    }
}

#[test]
fn the_rule_file_reader_works_in_proportion_to_the_file() {
    for case in CASES.iter().filter(|c| c.target == Target::Rules) {
        linear(case.name, RULES, case.n, case.make, |input| {
            case.target.run(input)
        });
    }
}

/// A gateway section, in flow style as the rest, to put in front of `descriptors`.
const HTTP_SECTION: &str = "http: {routes: [{match: {path_prefix: /api/}, rate_limits: [{actions: [{remote_address: {}}]}]}]}\n";

/// The flow-style rule trees of the reader's case, with an `http` section.
fn flow_trees_with_http(n: usize) -> Vec<u8> {
    let text = String::from_utf8_lossy(&hostile::flow_trees(n)).into_owned();
    text.replacen("descriptors:", &format!("{HTTP_SECTION}descriptors:"), 1)
        .into_bytes()
}

/// One flow-style line of descriptors, every one of them wrong, after an `http`
/// section: each error is placed on that line (placing each by going over the line
/// again made `validate` take 18 s on 100 KB).
fn flow_errors_with_http(n: usize) -> Vec<u8> {
    let mut out = format!("domain: api\n{HTTP_SECTION}descriptors: [");
    let mut i = 0;
    while out.len() < n {
        out.push_str(&format!("{{key: k{i}, ratelimit: 1}}, "));
        i += 1;
    }
    out.push_str("]\n");
    out.into_bytes()
}

#[test]
fn validate_works_in_proportion_to_a_flow_style_file() {
    let dir = std::env::temp_dir().join(format!("tollgate-amp-validate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("flow.yaml");
    type Make = fn(usize) -> Vec<u8>;
    let cases: [(&str, Make, bool); 2] = [
        (
            "validate: flow-style rule trees and an http section",
            flow_trees_with_http,
            true,
        ),
        (
            "validate: flow-style errors on one line",
            flow_errors_with_http,
            false,
        ),
    ];
    for (what, make, valid) in cases {
        linear(what, VALIDATE, 16 << 10, make, |input| {
            std::fs::write(&file, input).unwrap();
            let ok = validate::run(std::slice::from_ref(&file), Default::default());
            assert_eq!(ok, valid, "{what}");
        });
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_client_address_costs_in_proportion_to_the_headers() {
    for case in CASES.iter().filter(|c| c.target == Target::ClientIp) {
        linear(case.name, CLIENT_IP, case.n, case.make, |input| {
            case.target.run(input)
        });
    }
}

// ---- random inputs, every parser ----

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn random_bytes_stay_within_every_bound(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
        H2.check("h2, random", bytes.len(), measure(|| Target::H2.run(&bytes)));
        PROTOBUF.check("protobuf, random", bytes.len(), measure(|| Target::Protobuf.run(&bytes)));
        JSON.check("json, random", bytes.len(), measure(|| Target::Json.run(&bytes)));
        RULES.check("rules, random", bytes.len(), measure(|| Target::Rules.run(&bytes)));
        CLIENT_IP.check("client address, random", bytes.len(), measure(|| Target::ClientIp.run(&bytes)));
    }
}
