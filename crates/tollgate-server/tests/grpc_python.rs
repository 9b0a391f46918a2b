//! `tollgate serve` against a gRPC client we did not write: Python `grpcio` with the
//! stubs `xds-protos` generates from Envoy's protos (`tests/python/test_rls.py`), and
//! gRPC's own health stubs (`grpcio-health-checking`: `tests/python/test_health.py`).
//!
//! Needs a Python with `tests/python/requirements.txt` installed: `$TOLLGATE_PYTHON`,
//! else `.venv/bin/python` at the workspace root (`bash .ci/run` creates it).

#![allow(clippy::unwrap_used)] // a test may panic on a broken fixture

use std::path::PathBuf;
use std::process::Command;

/// The Python to run pytest with; panics with how to set one up when there is none.
fn python() -> PathBuf {
    if let Some(python) = std::env::var_os("TOLLGATE_PYTHON") {
        let python = PathBuf::from(python);
        assert!(
            python.is_file(),
            "TOLLGATE_PYTHON is {}, which is not a file",
            python.display()
        );
        return python;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let venv = root.join(".venv/bin/python");
    assert!(
        venv.is_file(),
        "{} is missing, and TOLLGATE_PYTHON is not set: this test needs Python with grpcio \
         and xds-protos. From the repository root run `bash .ci/run`, or \
         `python3 -m venv .venv && .venv/bin/pip install -r \
         crates/tollgate-server/tests/python/requirements.txt`",
        venv.display()
    );
    venv
}

#[test]
fn an_independent_grpc_client_grpcio_gets_envoys_rls_answers() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python");
    let python = python();
    let output = Command::new(&python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(dir.join("test_rls.py"))
        .arg(dir.join("test_health.py"))
        .env("TOLLGATE_BIN", env!("CARGO_BIN_EXE_tollgate"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .current_dir(&dir)
        .output()
        .unwrap();
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    assert!(
        output.status.success(),
        "{} -m pytest test_rls.py test_health.py failed ({}):\n{}\n{}",
        python.display(),
        output.status,
        text(&output.stdout),
        text(&output.stderr)
    );
}
