//! `tollgate conformance DIR`: runs rule-engine case files (`tests/cases/README.md`
//! describes the format) with a manual clock against a store, and reports every
//! failing step.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use marked_yaml::types::MarkedMappingNode;
use marked_yaml::Node;
use tollgate::clock::{secs_f64_to_nanos, ManualClock, NANOS_PER_SEC};
use tollgate::limiter::{
    Code, Descriptor, LimitOverride, Limiter, RateLimitRequest, RateLimitResponse,
};
use tollgate::rules::{from_str, Rules, Unit};

use tollgate::store::RedisTls;

use crate::store::{AnyStore, StoreOptions};

/// The runtime the cases run on (the Redis store is async).
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("cannot start a tokio runtime: {e}"))
    })
}

/// Store options for a case file: the case's clock, keys no other run shares, and
/// `tls` for a `rediss://` store.
fn options(tls: Option<&RedisTls>) -> StoreOptions {
    static RUN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    StoreOptions {
        max_keys: 1_000_000,
        // Long: a case checks decisions, not latency, and a call that timed out would be
        // answered by the rule's failure mode (admitted, uncharged) and spoil the steps
        // after it. A busy machine's first call (a TLS handshake, the scripts' load) can
        // take seconds.
        deadline: std::time::Duration::from_secs(30),
        prefix: format!("tollgate-conformance:{}:{nanos:x}:{n}", std::process::id()),
        blocked_cache: 0,
        caller_time: true,
        tls: tls.cloned(),
        // One connection per case file's store is enough.
        shared_connection: true,
    }
}

/// The outcome of one case file.
#[derive(Debug)]
pub struct FileResult {
    /// The case file.
    pub file: PathBuf,
    /// One line per failing step (empty when the file passed).
    pub failures: Vec<String>,
}

/// Runs every `*.yaml` case file in `dir` (and its subdirectories), in name order.
pub fn run_dir(dir: &Path, store: &str, tls: Option<&RedisTls>) -> Result<Vec<FileResult>, String> {
    let mut files = Vec::new();
    collect(dir, &mut files).map_err(|e| format!("{}: {e}", dir.display()))?;
    if files.is_empty() {
        return Err(format!("{}: no case files (*.yaml) found", dir.display()));
    }
    files.sort();
    Ok(files
        .into_iter()
        .map(|file| {
            let failures = match std::fs::read_to_string(&file) {
                Ok(text) => run_case(&text, store, tls),
                Err(e) => vec![format!("cannot read: {e}")],
            };
            FileResult { file, failures }
        })
        .collect())
}

fn collect(dir: &Path, files: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect(&path, files)?;
        } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            files.push(path);
        }
    }
    Ok(())
}

/// Runs one case file's text; returns its failures.
pub fn run_case(text: &str, store: &str, tls: Option<&RedisTls>) -> Vec<String> {
    let case = match marked_yaml::parse_yaml(0, text) {
        Ok(Node::Mapping(m)) => m,
        Ok(_) => return vec!["the case file is not a mapping".into()],
        Err(e) => return vec![format!("the case file is not valid YAML: {e}")],
    };
    let Some(config) = case.get_scalar("config").map(|s| s.as_str().to_string()) else {
        return vec!["the case has no `config`".into()];
    };
    if let Some(expect) = case.get_mapping("expect_config_error") {
        return config_error_case(&config, expect);
    }
    let set = match from_str("config", &config) {
        Ok(set) => set,
        Err(e) => return vec![format!("the config was rejected: {e}")],
    };
    let start = case
        .get_scalar("start")
        .and_then(|s| s.as_str().parse::<u64>().ok())
        .unwrap_or(0);
    let clock = ManualClock::new(start * NANOS_PER_SEC);
    let store = match runtime().block_on(AnyStore::open(store, &options(tls))) {
        Ok(s) => s,
        Err(e) => return vec![format!("cannot open the store: {e}")],
    };
    let limiter =
        Limiter::new(Arc::new(Rules::fixed(set)), store).with_clock(Arc::new(clock.clone()));
    let mut failures = Vec::new();
    let steps = case
        .get_sequence("steps")
        .map(|s| s.iter().collect::<Vec<_>>())
        .unwrap_or_default();
    for (i, step) in steps.iter().enumerate() {
        let Some(step) = step.as_mapping() else {
            failures.push(format!("step {}: not a mapping", i + 1));
            continue;
        };
        if let Some(advance) = step
            .get_scalar("advance")
            .and_then(|s| s.as_str().parse::<f64>().ok())
        {
            clock.advance_nanos(secs_f64_to_nanos(advance));
        }
        // The project's cases may throw the emergency switch before a step's request.
        if let Some(switch) = step.get_mapping("enforcement") {
            let domain = switch.get_scalar("domain").map_or("*", |d| d.as_str());
            let mode = switch
                .get_scalar("mode")
                .map_or("", |m| m.as_str())
                .parse::<tollgate::limiter::Mode>()
                .and_then(|mode| {
                    limiter
                        .enforcement()
                        .set(domain, mode, "conformance", start)
                });
            if let Err(e) = mode {
                failures.push(format!("step {}: {e}", i + 1));
                continue;
            }
            if step.get_mapping("request").is_none() {
                continue;
            }
        }
        let repeat = step
            .get_scalar("repeat")
            .and_then(|s| s.as_str().parse::<u64>().ok())
            .unwrap_or(1);
        let request = match step.get_mapping("request").map(parse_request) {
            Some(Ok(r)) => r,
            Some(Err(e)) => {
                failures.push(format!("step {}: {e}", i + 1));
                continue;
            }
            None => {
                failures.push(format!("step {}: no request", i + 1));
                continue;
            }
        };
        for r in 1..=repeat {
            let at = if repeat > 1 {
                format!("step {} (repeat {r}/{repeat})", i + 1)
            } else {
                format!("step {}", i + 1)
            };
            match runtime().block_on(limiter.check(&request)) {
                Ok(response) => {
                    if let Some(expect) = step.get_mapping("expect") {
                        failures.extend(
                            compare(&response, expect)
                                .into_iter()
                                .map(|f| format!("{at}: {f}")),
                        );
                    }
                }
                Err(e) => failures.push(format!("{at}: {e}")),
            }
        }
    }
    failures
}

fn config_error_case(config: &str, expect: &MarkedMappingNode) -> Vec<String> {
    let errors = match from_str("config", config) {
        Ok(_) => return vec!["the config was accepted; it must be rejected".into()],
        Err(e) => e,
    };
    let contains: Vec<String> = expect
        .get_sequence("contains")
        .map(|s| {
            s.iter()
                .filter_map(|n| n.as_scalar())
                .map(|n| n.as_str().to_lowercase())
                .collect()
        })
        .unwrap_or_default();
    let lines: Vec<usize> = match expect.get_node("line") {
        Some(Node::Scalar(s)) => s.as_str().parse().ok().into_iter().collect(),
        Some(Node::Sequence(s)) => s
            .iter()
            .filter_map(|n| n.as_scalar()?.as_str().parse().ok())
            .collect(),
        _ => Vec::new(),
    };
    let fits = errors.iter().any(|e| {
        let text = e.message.to_lowercase();
        contains.iter().all(|c| text.contains(c.as_str()))
            && (lines.is_empty() || lines.contains(&e.line))
    });
    if fits {
        Vec::new()
    } else {
        let words = contains
            .iter()
            .map(|c| format!("\"{c}\""))
            .collect::<Vec<_>>()
            .join(" and ");
        let on = if lines.is_empty() {
            String::new()
        } else {
            let lines = lines.iter().map(|l| l.to_string()).collect::<Vec<_>>();
            format!(" on line {}", lines.join(" or "))
        };
        vec![format!("no error contains {words}{on}; got:\n{errors}")]
    }
}

fn parse_request(m: &MarkedMappingNode) -> Result<RateLimitRequest, String> {
    let number = |m: &MarkedMappingNode, k: &str| {
        m.get_scalar(k).and_then(|s| s.as_str().parse::<u64>().ok())
    };
    let mut request = RateLimitRequest {
        domain: m
            .get_scalar("domain")
            .map(|s| s.as_str().to_string())
            .unwrap_or_default(),
        descriptors: Vec::new(),
        hits_addend: number(m, "hits_addend").unwrap_or(0),
    };
    for d in m
        .get_sequence("descriptors")
        .map(|s| s.iter().collect::<Vec<_>>())
        .unwrap_or_default()
    {
        let d = d.as_mapping().ok_or("a descriptor is not a mapping")?;
        let mut descriptor = Descriptor {
            hits_addend: number(d, "hits_addend"),
            ..Descriptor::default()
        };
        for e in d
            .get_sequence("entries")
            .map(|s| s.iter().collect::<Vec<_>>())
            .unwrap_or_default()
        {
            let pair = e
                .as_sequence()
                .ok_or("an entry is not a [key, value] pair")?;
            let text = |i: usize| {
                pair.get_scalar(i)
                    .map(|s| s.as_str().to_string())
                    .unwrap_or_default()
            };
            descriptor.entries.push((text(0), text(1)));
        }
        if let Some(l) = d.get_mapping("limit") {
            let unit = l
                .get_scalar("unit")
                .and_then(|u| Unit::parse(u.as_str()))
                .ok_or("a limit override needs a valid unit")?;
            let requests_per_unit =
                number(l, "requests_per_unit").ok_or("a limit override needs requests_per_unit")?;
            descriptor.limit = Some(LimitOverride {
                requests_per_unit,
                unit,
            });
        }
        request.descriptors.push(descriptor);
    }
    Ok(request)
}

fn code_name(c: Code) -> &'static str {
    match c {
        Code::Ok => "OK",
        Code::OverLimit => "OVER_LIMIT",
    }
}

/// Compares a response with an `expect` mapping; any field left out is not checked.
fn compare(response: &RateLimitResponse, expect: &MarkedMappingNode) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(overall) = expect.get_scalar("overall") {
        if overall.as_str() != code_name(response.overall) {
            out.push(format!(
                "overall {}, expected {}",
                code_name(response.overall),
                overall.as_str()
            ));
        }
    }
    let Some(statuses) = expect.get_sequence("statuses") else {
        return out;
    };
    if statuses.len() != response.statuses.len() {
        out.push(format!(
            "{} statuses, expected {}",
            response.statuses.len(),
            statuses.len()
        ));
    }
    for (i, (want, got)) in statuses.iter().zip(&response.statuses).enumerate() {
        let Some(want) = want.as_mapping() else {
            continue;
        };
        let n = |k: &str| {
            want.get_scalar(k)
                .and_then(|s| s.as_str().parse::<u64>().ok())
        };
        if let Some(code) = want.get_scalar("code") {
            if code.as_str() != code_name(got.code) {
                out.push(format!(
                    "status {i}: code {}, expected {}",
                    code_name(got.code),
                    code.as_str()
                ));
            }
        }
        if let Some(rem) = n("remaining") {
            if rem != got.remaining {
                out.push(format!(
                    "status {i}: remaining {}, expected {rem}",
                    got.remaining
                ));
            }
        }
        if let Some(flag) = want.get_scalar("overdraft") {
            let wanted = flag.as_str() == "true";
            if wanted != got.overdraft {
                out.push(format!(
                    "status {i}: overdraft {}, expected {}",
                    got.overdraft,
                    flag.as_str()
                ));
            }
        }
        if let Some(flag) = want.get_scalar("shadow") {
            let wanted = flag.as_str() == "true";
            if wanted != got.shadow {
                out.push(format!(
                    "status {i}: shadow {}, expected {}",
                    got.shadow,
                    flag.as_str()
                ));
            }
        }
        if let Some(flag) = want.get_scalar("overage") {
            let wanted = flag.as_str() == "true";
            if wanted != got.over_soft_limit {
                out.push(format!(
                    "status {i}: overage {}, expected {}",
                    got.over_soft_limit,
                    flag.as_str()
                ));
            }
        }
        if let Some(reset) = n("reset_seconds") {
            if reset != got.reset_after_secs() {
                out.push(format!(
                    "status {i}: reset_seconds {}, expected {reset}",
                    got.reset_after_secs()
                ));
            }
        }
        match want.get_node("limit") {
            None => {}
            Some(Node::Mapping(l)) => {
                let rpu = l
                    .get_scalar("requests_per_unit")
                    .and_then(|s| s.as_str().parse::<u64>().ok());
                let unit = l.get_scalar("unit").map(|s| s.as_str().to_uppercase());
                let matches = got.limit.as_ref().is_some_and(|g| {
                    Some(g.requests_per_unit) == rpu && Some(g.unit.name().to_string()) == unit
                });
                if !matches {
                    let got = got.limit.as_ref().map_or_else(
                        || "none".to_string(),
                        |g| format!("{} per {}", g.requests_per_unit, g.unit.name()),
                    );
                    let rpu = rpu.map_or_else(|| "?".to_string(), |n| n.to_string());
                    let unit = unit.as_deref().unwrap_or("?");
                    out.push(format!(
                        "status {i}: limit {got}, expected {rpu} per {unit}"
                    ));
                }
            }
            Some(_) if got.limit.is_some() => {
                out.push(format!("status {i}: a limit applies, expected none"));
            }
            Some(_) => {}
        }
    }
    out
}

/// Runs `dir` against `store` (with `tls` for `rediss://`) and prints the report;
/// returns whether every file passed.
pub fn report(dir: &Path, store: &str, tls: Option<&RedisTls>) -> bool {
    if let Err(e) = runtime().block_on(AnyStore::open(store, &options(tls))) {
        eprintln!("cannot open the store `{store}`: {e}");
        return false;
    }
    let results = match run_dir(dir, store, tls) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{e}");
            return false;
        }
    };
    let failed = results.iter().filter(|r| !r.failures.is_empty()).count();
    for r in &results {
        let name = r
            .file
            .strip_prefix(dir)
            .unwrap_or(&r.file)
            .display()
            .to_string();
        if r.failures.is_empty() {
            println!("ok    {name}");
        } else {
            println!("FAIL  {name}");
            for f in &r.failures {
                println!("      {f}");
            }
        }
    }
    println!("{} passed, {failed} failed", results.len() - failed);
    failed == 0
}

#[cfg(test)]
mod tests {
    use super::run_case;

    /// A case whose expected limit differs from the rule's.
    const WRONG_LIMIT: &str = "config: |
  domain: test
  descriptors:
    - key: k
      rate_limit: {unit: minute, requests_per_unit: 5}
steps:
  - request: {domain: test, descriptors: [{entries: [[k, v]]}]}
    expect: {statuses: [{limit: {requests_per_unit: 6, unit: MINUTE}}]}
  - request: {domain: test, descriptors: [{entries: [[other, v]]}]}
    expect: {statuses: [{limit: {requests_per_unit: 6, unit: MINUTE}}]}
";

    #[test]
    fn a_wrong_limit_is_reported_in_words() {
        let failures = run_case(WRONG_LIMIT, "memory", None);
        assert_eq!(failures.len(), 2, "{failures:?}");
        assert!(
            failures[0].ends_with("status 0: limit 5 per MINUTE, expected 6 per MINUTE"),
            "{failures:?}"
        );
        assert!(
            failures[1].ends_with("status 0: limit none, expected 6 per MINUTE"),
            "{failures:?}"
        );
    }
}
