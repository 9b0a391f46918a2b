//! Calling the scripts as Redis Functions: `FCALL`, the library loaded again when
//! Redis lost it, and the errors that turn the store to `EVALSHA` for good (Redis
//! without functions, or an ACL forbidding them).

use std::sync::atomic::Ordering;

use super::client::Connection;
use super::script;
use super::Shared;

/// Sends `fcall`: when Redis no longer has the function (a restart, a failover,
/// `FUNCTION FLUSH`), loads the library and sends it again. `None` when Redis cannot
/// run functions at all (no `FCALL` or `FUNCTION LOAD`, or its ACL forbids them): the
/// store then turns to `EVALSHA` for good, and the caller sends this call that way.
pub(super) async fn call_function(
    shared: &Shared,
    conn: &mut Connection,
    built: &script::Built,
    fcall: &redis::Cmd,
) -> Option<redis::RedisResult<redis::Value>> {
    let first = fcall.query_async::<redis::Value>(conn).await;
    let missing = match &first {
        Err(e) if functions_unusable(e) => {
            give_up_functions(shared, e);
            return None;
        }
        Err(e) => function_missing(e),
        Ok(_) => false,
    };
    if !missing {
        return Some(first);
    }
    let loading = shared.warming.begin();
    let loaded = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(&built.library)
        .query_async::<redis::Value>(conn)
        .await;
    drop(loading);
    match loaded {
        Ok(_) => Some(fcall.query_async::<redis::Value>(conn).await),
        // Redis refused the library itself (no FUNCTION, an ACL, or a library it
        // cannot compile): EVALSHA still works.
        Err(e) if functions_unusable(&e) || library_refused(&e) => {
            give_up_functions(shared, &e);
            None
        }
        // Anything else (a transport failure, a cluster in flux, Redis still loading
        // its data) fails this call only; the next one tries again.
        Err(e) => Some(Err(e)),
    }
}

/// Whether `FUNCTION LOAD` failed on the library's code (Redis answers "Error
/// registering functions" or "Error compiling function"): a fault of this build that a
/// retry cannot mend.
pub(super) fn library_refused(e: &redis::RedisError) -> bool {
    refused_code(e.code(), e.detail())
}

/// [`library_refused`] on an error's code and text.
fn refused_code(code: Option<&str>, detail: Option<&str>) -> bool {
    code == Some("ERR")
        && detail.is_some_and(|d| {
            d.starts_with("Error registering functions") || d.starts_with("Error compiling")
        })
}

/// Whether Redis answered that the called function does not exist.
pub(super) fn function_missing(e: &redis::RedisError) -> bool {
    refusal(e.code(), e.detail()) == Refusal::Missing
}

/// Whether Redis cannot run `FCALL` at all: an unknown command (before 7.0) or an ACL
/// refusal.
pub(super) fn functions_unusable(e: &redis::RedisError) -> bool {
    refusal(e.code(), e.detail()) == Refusal::Unusable
}

/// What an error answered to `FCALL` says about functions.
#[derive(Debug, PartialEq, Eq)]
enum Refusal {
    /// The function is not loaded: load the library and call again.
    Missing,
    /// Functions cannot be used here: use `EVALSHA`.
    Unusable,
    /// Anything else: a failure of this call.
    Other,
}

/// Reads a Redis error by its code (`ERR`, `NOPERM`...) and the text after it.
fn refusal(code: Option<&str>, detail: Option<&str>) -> Refusal {
    let detail = detail.unwrap_or_default();
    match code {
        Some("ERR") if detail.starts_with("Function not found") => Refusal::Missing,
        Some("ERR") if detail.to_ascii_lowercase().starts_with("unknown command") => {
            Refusal::Unusable
        }
        Some("NOPERM") => Refusal::Unusable,
        _ => Refusal::Other,
    }
}

/// Turns the store to `EVALSHA` for good, saying why once.
pub(super) fn give_up_functions(shared: &Shared, e: &redis::RedisError) {
    if shared.functions.swap(false, Ordering::Relaxed) {
        tracing::warn!(
            error = %e,
            "Redis cannot run Tollgate's scripts as functions (FCALL); using EVALSHA, \
             which costs Redis more per call"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fcall_refusals_are_read_by_code_and_text() {
        assert_eq!(
            refusal(Some("ERR"), Some("Function not found")),
            Refusal::Missing
        );
        // Redis 6 has no FCALL (the text's quotes vary between versions).
        assert_eq!(
            refusal(
                Some("ERR"),
                Some("unknown command 'FCALL', with args beginning with: 'tollgate_ab' ")
            ),
            Refusal::Unusable
        );
        assert_eq!(
            refusal(Some("ERR"), Some("Unknown command `FUNCTION`")),
            Refusal::Unusable
        );
        assert_eq!(
            refusal(
                Some("NOPERM"),
                Some("User nofn has no permissions to run the 'fcall' command")
            ),
            Refusal::Unusable
        );
        // A failure inside the script, or of the call, is the call's own.
        assert_eq!(
            refusal(Some("ERR"), Some("user_script:1: Script attempted ...")),
            Refusal::Other
        );
        assert_eq!(refusal(Some("BUSY"), Some("Redis is busy")), Refusal::Other);
        assert_eq!(refusal(None, None), Refusal::Other);
        // FUNCTION LOAD's answers to a library Redis cannot take (as Redis 7.0 words
        // them), against one it may take later (still loading its data).
        assert!(refused_code(
            Some("ERR"),
            Some("Error registering functions: ERR user_function:2: Script attempted to access nonexistent global variable 'math'")
        ));
        assert!(refused_code(
            Some("ERR"),
            Some("Error compiling function: user_function:2: <name> expected")
        ));
        assert!(!refused_code(
            Some("LOADING"),
            Some("Redis is loading the dataset in memory")
        ));
    }
}
