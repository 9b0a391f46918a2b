//! The `tollgate` command as a user runs it: `validate` and `conformance`.

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

use std::path::PathBuf;
use std::process::{Command, Output};

fn tollgate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(args)
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The repository's case files: the shared Envoy and Tollgate cases (kept identical to
/// `shared/cases`), and the project's own.
fn cases() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/cases")
}

fn tempdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tollgate-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn every_shared_case_passes_conformance_on_the_memory_store() {
    let out = tollgate(&["conformance", cases().to_str().unwrap()]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    let last = stdout.lines().last().unwrap();
    let files = stdout.lines().filter(|l| l.starts_with("ok ")).count();
    assert_eq!(last, format!("{files} passed, 0 failed"));
    assert!(files >= 24, "{stdout}");
}

#[test]
fn conformance_reports_a_failing_step_and_exits_non_zero() {
    let dir = tempdir("failing-case");
    let case = std::fs::read_to_string(cases().join("envoy/03-counting-window.yaml")).unwrap();
    std::fs::write(
        dir.join("broken.yaml"),
        case.replace("requests_per_unit: 20}", "requests_per_unit: 21}"),
    )
    .unwrap();
    let out = tollgate(&["conformance", dir.to_str().unwrap()]);
    let stdout = text(&out.stdout);
    assert!(!out.status.success());
    assert!(stdout.contains("FAIL  broken.yaml"), "{stdout}");
    assert!(
        stdout.contains("step 1: status 0: remaining 20, expected 19"),
        "{stdout}"
    );
    assert!(stdout.ends_with("0 passed, 1 failed\n"), "{stdout}");
}

#[test]
fn validate_prints_every_error_with_file_line_and_column() {
    let dir = tempdir("validate-bad");
    std::fs::write(
        dir.join("bad.yaml"),
        "domain: d\ndescriptors:\n  - key: a\n    ratelimit: {}\n  - key: b\n    rate_limit: {unit: weekly, requests_per_unit: 1}\n",
    )
    .unwrap();
    let out = tollgate(&["validate", dir.to_str().unwrap()]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    let file = dir.join("bad.yaml").display().to_string();
    assert!(
        stderr.contains(&format!("{file}:4:5: unknown key `ratelimit`")),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("{file}:6:24: unknown unit `weekly`")),
        "{stderr}"
    );
    assert!(stderr.ends_with("2 error(s)\n"), "{stderr}");
}

#[test]
fn validate_reports_a_yaml_syntax_error_once_as_a_yaml_error() {
    let dir = tempdir("validate-syntax");
    std::fs::write(
        dir.join("bad.yaml"),
        "domain: d\ndescriptors:\n  - key: \"unclosed\n",
    )
    .unwrap();
    let out = tollgate(&["validate", dir.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let file = dir.join("bad.yaml").display().to_string();
    assert_eq!(
        text(&out.stderr),
        format!("{file}:3:10: not valid YAML: while scanning a quoted scalar, found unexpected end of stream\n1 error(s)\n")
    );
}

#[test]
fn validate_summarises_each_valid_domain() {
    let dir = tempdir("validate-good");
    std::fs::write(
        dir.join("api.yaml"),
        "domain: api\ndescriptors:\n  - key: user\n    rate_limits:\n      - {unit: second, requests_per_unit: 5}\n      - {unit: hour, requests_per_unit: 500}\n",
    )
    .unwrap();
    let out = tollgate(&["validate", dir.join("api.yaml").to_str().unwrap()]);
    assert!(out.status.success());
    assert!(
        text(&out.stdout).starts_with("ok: domain `api`: 1 rules, 2 limits ("),
        "{}",
        text(&out.stdout)
    );
}

#[test]
fn validate_holds_descriptors_to_max_rule_depth() {
    let dir = tempdir("validate-depth");
    let file = dir.join("deep.yaml");
    std::fs::write(
        &file,
        "domain: api\ndescriptors:\n  - key: a\n    descriptors:\n      - key: b\n        rate_limit: {unit: second, requests_per_unit: 5}\n",
    )
    .unwrap();
    let path = file.to_str().unwrap();
    assert!(tollgate(&["validate", path]).status.success());
    let out = tollgate(&["validate", "--max-rule-depth", "1", path]);
    assert!(!out.status.success());
    assert_eq!(
        text(&out.stdout) + &text(&out.stderr),
        format!("{path}:5:7: descriptors nest more than 1 levels deep (the rule files' limit)\n1 error(s)\n")
    );
}

#[test]
fn validate_names_a_missing_path() {
    let out = tollgate(&["validate", "/nonexistent/rules.yaml"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        "/nonexistent/rules.yaml: no such file or directory\n1 error(s)\n",
        "once, though both readers find it"
    );
}

#[test]
fn the_example_rule_files_are_valid() {
    let examples = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    let out = tollgate(&["validate", examples.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    // Ten domains, and the gateway sections of three of them.
    assert_eq!(stdout.lines().count(), 13, "{stdout}");
    assert!(
        stdout.contains("ok: gateway section of `gateway`: 3 routes"),
        "{stdout}"
    );
    assert!(
        stdout.contains("ok: gateway section of `uploads`: 1 routes"),
        "{stdout}"
    );
}

#[test]
fn validate_checks_the_gateway_section_with_file_and_line() {
    let dir = std::env::temp_dir().join(format!("tollgate-cli-http-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("edge.yaml");
    std::fs::write(
        &file,
        "domain: edge\nhttp:\n  trusted_proxies: [10.0.0.0/8]\n  routes:\n    - match: {path_prefix: /}\n      rate_limits:\n        - actions: [{remote_adress: {}}]\n",
    )
    .unwrap();
    let out = tollgate(&["validate", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!("{}:7:", file.display())) && err.contains("remote_adress"),
        "{err}"
    );
}

#[test]
fn redis_script_prints_the_lua_of_the_named_algorithms() {
    let out = tollgate(&["redis-script", "gcra", "fixed_window"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lua = text(&out.stdout);
    assert!(lua.contains("ALG[5] = ") && lua.contains("ALG[1] = "));
    assert!(!lua.contains("ALG[2] = "), "only the named algorithms");
    let bad = tollgate(&["redis-script", "magic"]);
    assert!(!bad.status.success());
    assert!(text(&bad.stderr).contains("unknown algorithm `magic`"));
}

#[test]
fn conformance_names_a_store_it_cannot_open() {
    let out = tollgate(&[
        "conformance",
        cases().to_str().unwrap(),
        "--store",
        "postgres://x",
    ]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("unknown store `postgres://x`"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn serve_on_redis_refuses_a_limit_the_scripts_cannot_compute_exactly() {
    let dir = tempdir("redis-range");
    std::fs::write(
        dir.join("big.yaml"),
        "domain: big\ndescriptors:\n  - key: k\n    rate_limit: {unit: year, requests_per_unit: 4000000007, algorithm: gcra}\n",
    )
    .unwrap();
    // Redis connects lazily: nothing needs to listen on port 1 for this check.
    let out = tollgate(&[
        "serve",
        "--config",
        dir.to_str().unwrap(),
        "--store",
        "redis://127.0.0.1:1",
        "--grpc-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
    ]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("big.yaml:3: domain `big`: 4000000007 per year"),
        "{err}"
    );
    assert!(err.contains("not starting"), "{err}");
}

/// The repository carries copies of the shared cases so that a bare clone passes its
/// tests; where the shared folder sits beside the repository, the copies must match it.
#[test]
fn the_case_copies_match_the_shared_cases() {
    let shared = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/cases");
    if !shared.is_dir() {
        eprintln!("{} is absent: nothing to compare", shared.display());
        return;
    }
    let mut compared = 0;
    let mut pending = vec![PathBuf::new()];
    while let Some(rel) = pending.pop() {
        for entry in std::fs::read_dir(shared.join(&rel)).unwrap() {
            let entry = entry.unwrap();
            let name = rel.join(entry.file_name());
            if entry.file_type().unwrap().is_dir() {
                pending.push(name);
                continue;
            }
            let theirs = std::fs::read(shared.join(&name)).unwrap();
            let ours = std::fs::read(cases().join(&name))
                .unwrap_or_else(|e| panic!("tests/cases/{} is missing: {e}", name.display()));
            assert!(
                theirs == ours,
                "tests/cases/{} differs from the shared case: copy it again",
                name.display()
            );
            compared += 1;
        }
    }
    assert!(compared >= 25, "only {compared} shared files compared");
}

/// docs/configuration.md lists every flag of every command, as the commands define them:
/// the table between its `flags` markers is generated (`TOLLGATE_WRITE_DOCS=1 cargo test
/// -p tollgate-server --test cli` writes it), and a flag added, renamed or described
/// differently without the doc fails here.
#[test]
fn the_configuration_doc_lists_every_flag() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/configuration.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let (start, end) = (
        "<!-- flags: generated from the commands' definitions -->\n",
        "<!-- /flags -->",
    );
    let a = doc.find(start).expect("the start marker") + start.len();
    let b = doc.find(end).expect("the end marker");
    let want = tollgate_server::flags_reference();
    if std::env::var_os("TOLLGATE_WRITE_DOCS").is_some() {
        std::fs::write(&path, format!("{}{want}{}", &doc[..a], &doc[b..])).unwrap();
        return;
    }
    assert!(
        doc[a..b] == want,
        "docs/configuration.md's flag tables differ from the commands' flags; run \
         `TOLLGATE_WRITE_DOCS=1 cargo test -p tollgate-server --test cli the_configuration_doc` \
         and review the diff"
    );
}
