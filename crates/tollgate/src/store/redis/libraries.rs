//! The Redis Functions libraries of other Tollgate versions. Each build loads its
//! libraries as `tollgate_<SHA-1 of the script>` on first use and never deletes one, so
//! that instances of two versions sharing a Redis during an upgrade never replace each
//! other's code. After the upgrade the old versions' libraries are dead weight:
//! [`RedisStore::delete_stale_libraries`](super::RedisStore::delete_stale_libraries)
//! (`tollgate redis-prune`) deletes them.

use std::collections::HashSet;

use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
use redis::Value;

use super::client::Connection;
use super::Shared;
use crate::store::Error;

/// Every library name this build can load (one per set of algorithms).
fn current(shared: &Shared) -> HashSet<String> {
    (1..64u8)
        .map(|mask| shared.scripts.get(mask).function.clone())
        .collect()
}

/// Whether `name` is a Tollgate library's: `tollgate_` and 40 lowercase hex digits.
fn is_tollgate(name: &str) -> bool {
    name.strip_prefix("tollgate_").is_some_and(|h| {
        h.len() == 40
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// The library names in a `FUNCTION LIST` reply (RESP2 arrays of field, value pairs, or
/// RESP3 maps).
fn names(reply: &Value) -> Vec<String> {
    let Value::Array(libraries) = reply else {
        return Vec::new();
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    libraries
        .iter()
        .filter_map(|library| match library {
            Value::Array(fields) => fields
                .chunks(2)
                .find(|p| p.len() == 2 && text(&p[0]).as_deref() == Some("library_name"))
                .and_then(|p| text(&p[1])),
            Value::Map(pairs) => pairs
                .iter()
                .find(|(k, _)| text(k).as_deref() == Some("library_name"))
                .and_then(|(_, v)| text(v)),
            _ => None,
        })
        .collect()
}

/// Deletes every `tollgate_<SHA-1>` library on `conn` that this build does not load;
/// returns their names, sorted. Other libraries are left alone. On a cluster the list
/// comes from every master and each `FUNCTION DELETE` goes to every master; on a Redis
/// without functions (6.x) there is nothing to delete.
pub(super) async fn delete_stale(shared: &Shared, conn: &Connection) -> Result<Vec<String>, Error> {
    let mut conn = conn.clone();
    let backend = |e| shared.failed(e);
    let mut list = redis::cmd("FUNCTION");
    // LIBRARYNAME takes a glob pattern.
    list.arg("LIST").arg("LIBRARYNAME").arg("tollgate_*");
    let reply = match &mut conn {
        // Every master: a library may be missing from some (a master added later).
        Connection::Cluster(cluster) => {
            cluster
                .route_command(
                    list,
                    RoutingInfo::MultiNode((
                        MultipleNodeRoutingInfo::AllMasters,
                        Some(ResponsePolicy::CombineArrays),
                    )),
                )
                .await
        }
        Connection::Single(_) => list.query_async::<Value>(&mut conn).await,
    };
    let reply = match reply {
        Ok(reply) => reply,
        // Redis 6 has no functions, so nothing to delete.
        Err(e)
            if e.code() == Some("ERR")
                && e.detail()
                    .is_some_and(|d| d.to_ascii_lowercase().starts_with("unknown")) =>
        {
            return Ok(Vec::new())
        }
        Err(e) => return Err(backend(e)),
    };
    let keep = current(shared);
    let mut stale: Vec<String> = names(&reply)
        .into_iter()
        .filter(|n| is_tollgate(n) && !keep.contains(n))
        .collect();
    stale.sort();
    stale.dedup();
    for name in &stale {
        let deleted = redis::cmd("FUNCTION")
            .arg("DELETE")
            .arg(name)
            .query_async::<Value>(&mut conn)
            .await;
        match deleted {
            Ok(_) => {}
            // Already gone (another instance pruned it, or a master never had it).
            Err(e) if e.to_string().contains("Library not found") => {}
            Err(e) => return Err(backend(e)),
        }
    }
    Ok(stale)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn library_names_are_read_from_both_protocols() {
        let resp2 = Value::Array(vec![
            Value::Array(vec![
                bulk("library_name"),
                bulk("a"),
                bulk("engine"),
                bulk("LUA"),
            ]),
            Value::Array(vec![
                bulk("engine"),
                bulk("LUA"),
                bulk("library_name"),
                bulk("b"),
            ]),
        ]);
        assert_eq!(names(&resp2), ["a", "b"]);
        let resp3 = Value::Array(vec![Value::Map(vec![(
            Value::SimpleString("library_name".into()),
            bulk("c"),
        )])]);
        assert_eq!(names(&resp3), ["c"]);
        assert!(names(&Value::Nil).is_empty());
    }

    #[test]
    fn only_tollgate_sha1_names_are_ours() {
        assert!(is_tollgate(&format!(
            "tollgate_{}",
            "0123456789abcdef".repeat(3)[..40].to_owned()
        )));
        assert!(!is_tollgate("tollgate_abc"));
        assert!(!is_tollgate(&format!("tollgate_{}", "A".repeat(40))));
        assert!(!is_tollgate(&format!("mylib_{}", "a".repeat(40))));
    }
}
