//! Rule matching and the full in-memory decision against a large rule set.
//!
//! The rule set is one domain, `bench`, generated in code as a YAML string and loaded
//! with [`tollgate::rules::from_str`]. It holds exactly 10,000 descriptors (the bench
//! checks the count against [`Domain::rule_count`] before it measures anything),
//! nested three levels deep, with wildcards at every level:
//!
//! - level 1, key `tenant`: 96 exact values `tenant-000`..`tenant-095`, then the
//!   wildcards `acme-*`, `*-test`, `beta*x` (in that file order), then a bare `tenant`
//!   default: 100 rules;
//! - level 2, under every one of those 100: key `user` with 8 exact values
//!   `user-0`..`user-7`, the wildcards `svc-*`, `*-bot`, `admin*ops` and a bare `user`
//!   (12 rules); key `plan` with `free`, `pro`, `enterprise`, the wildcard `trial-*`
//!   and a bare `plan` (5 rules): 1,700 rules;
//! - level 3, key `path`: under every `user` rule, 2 exact paths (`/api/v1/items`,
//!   `/api/v1/orders`) and 4 wildcards, in this file order: `/static/*`, `*/export`,
//!   `/api/v2/*`, `/api/v1/*/upload` (no bare `path`); under every `plan` rule, the
//!   exact `/billing` and a bare `path`: 100 × (12 × 6 + 5 × 2) = 8,200 rules.
//!
//! Total: 100 + 1,700 + 8,200 = 10,000 descriptors. Every level-3 rule is a fixed
//! window of 4,000,000,000 requests per hour, so the decision benches measure the
//! steady-state admission path (a run makes far fewer checks than that).
//!
//! Three-entry descriptors measured (entries built outside the timed loop):
//!
//! - `exact`: `tenant-042` / `user-3` / `/api/v1/orders`: an exact value at every level.
//! - `wildcard`: `tenant-042` / `admin-eu-ops` / `/api/v1/photos/upload`: exact at
//!   level 1, then the third `user` wildcard (`admin*ops`, after `svc-*` and `*-bot`
//!   fail) and the fourth `path` wildcard (`/api/v1/*/upload`, after `/static/*`,
//!   `*/export` and `/api/v2/*` fail).
//! - `no_match`: `tenant-042` / `user-3` / `/nowhere`: exact at levels 1 and 2, then
//!   every `path` wildcard is tried and fails, and there is no bare `path`: no rule.
//!
//! Groups:
//!
//! - `rules_match`: [`Domain::find`] for `exact`, `wildcard` and `no_match`
//!   (issue target: under 200 ns).
//! - `rules_decision`: [`Limiter::check_now`] on a [`MemoryStore`] with the system
//!   clock, for `exact` and `wildcard`, each a pre-built one-descriptor
//!   [`RateLimitRequest`] (issue target: under 500 ns).
//! - `features_decision`: the same on a one-rule domain, `plain`, against the same limit
//!   shared by priority classes with the request naming its class, `priority`; a limit
//!   that may borrow from a pool, within its own limit (`borrow_within_own`) and past it
//!   (`borrow_past_own`) (target: at most 1.3× `plain`); `two_counters`, the store work
//!   of a borrowing decision without borrowing (two limits, one of them on a key every
//!   request shares); and a token bucket, `token_bucket`, against the same with a
//!   warm-up whose key stays cold, `token_bucket_warmup` (target: at most 1.3×
//!   `token_bucket`).
//!
//! Run with:
//!
//! ```text
//! cargo bench -p tollgate --bench rules
//! cargo bench -p tollgate --bench rules -- --warm-up-time 1 --measurement-time 3
//! ```

use std::fmt::Write as _;
use std::sync::Arc;

use criterion::{black_box, Criterion};
use tollgate::limiter::{Code, Limiter, RateLimitRequest};
use tollgate::rules::{from_str, Domain, Rules};
use tollgate::store::MemoryStore;

/// The domain of the generated rule set.
const DOMAIN: &str = "bench";
/// Descriptors the generated rule set must hold.
const EXPECTED_RULES: usize = 10_000;
/// Exact `tenant` values at level 1.
const EXACT_TENANTS: usize = 96;
/// Level-1 wildcards, in file order.
const TENANT_WILDCARDS: [&str; 3] = ["acme-*", "*-test", "beta*x"];
/// Exact `user` values under every tenant rule.
const EXACT_USERS: usize = 8;
/// `user` wildcards, in file order.
const USER_WILDCARDS: [&str; 3] = ["svc-*", "*-bot", "admin*ops"];
/// Exact `plan` values.
const EXACT_PLANS: [&str; 3] = ["free", "pro", "enterprise"];
/// `plan` wildcards.
const PLAN_WILDCARDS: [&str; 1] = ["trial-*"];
/// Exact `path` values under every `user` rule.
const USER_EXACT_PATHS: [&str; 2] = ["/api/v1/items", "/api/v1/orders"];
/// `path` wildcards under every `user` rule, in file order.
const USER_PATH_WILDCARDS: [&str; 4] = ["/static/*", "*/export", "/api/v2/*", "/api/v1/*/upload"];
/// Limit of every level-3 rule: far more than a run checks.
const LEAF_LIMIT: &str = "{unit: hour, requests_per_unit: 4000000000}";

/// The generated YAML and the number of descriptors in it.
struct Generated {
    yaml: String,
    descriptors: usize,
}

impl Generated {
    /// One descriptor at `indent`: `key`, an optional (quoted) `value` and a limit.
    /// The caller appends its `descriptors:` children, if any.
    fn descriptor(&mut self, indent: usize, key: &str, value: Option<&str>, limit: &str) {
        let pad = " ".repeat(indent);
        writeln!(self.yaml, "{pad}- key: {key}").expect("writing to a String");
        if let Some(v) = value {
            writeln!(self.yaml, "{pad}  value: \"{v}\"").expect("writing to a String");
        }
        writeln!(self.yaml, "{pad}  rate_limit: {limit}").expect("writing to a String");
        self.descriptors += 1;
    }

    fn children(&mut self, indent: usize) {
        let pad = " ".repeat(indent);
        writeln!(self.yaml, "{pad}  descriptors:").expect("writing to a String");
    }

    /// A `user` rule and its `path` children (2 exact, 4 wildcards, no bare).
    fn user(&mut self, indent: usize, value: Option<&str>) {
        self.descriptor(
            indent,
            "user",
            value,
            "{unit: minute, requests_per_unit: 600}",
        );
        self.children(indent);
        for path in USER_EXACT_PATHS.iter().chain(&USER_PATH_WILDCARDS) {
            self.descriptor(indent + 4, "path", Some(path), LEAF_LIMIT);
        }
    }

    /// A `plan` rule and its `path` children (1 exact, 1 bare).
    fn plan(&mut self, indent: usize, value: Option<&str>) {
        self.descriptor(
            indent,
            "plan",
            value,
            "{unit: second, requests_per_unit: 50}",
        );
        self.children(indent);
        self.descriptor(indent + 4, "path", Some("/billing"), LEAF_LIMIT);
        self.descriptor(indent + 4, "path", None, LEAF_LIMIT);
    }

    /// A `tenant` rule and its whole subtree.
    fn tenant(&mut self, value: Option<&str>) {
        self.descriptor(
            2,
            "tenant",
            value,
            "{unit: second, requests_per_unit: 10000}",
        );
        self.children(2);
        for i in 0..EXACT_USERS {
            self.user(6, Some(&format!("user-{i}")));
        }
        for w in USER_WILDCARDS {
            self.user(6, Some(w));
        }
        self.user(6, None);
        for p in EXACT_PLANS.iter().chain(&PLAN_WILDCARDS) {
            self.plan(6, Some(p));
        }
        self.plan(6, None);
    }
}

/// The rule file described in the module documentation.
fn generate() -> Generated {
    let mut g = Generated {
        yaml: format!("domain: {DOMAIN}\ndescriptors:\n"),
        descriptors: 0,
    };
    for i in 0..EXACT_TENANTS {
        g.tenant(Some(&format!("tenant-{i:03}")));
    }
    for w in TENANT_WILDCARDS {
        g.tenant(Some(w));
    }
    g.tenant(None);
    g
}

/// Builds a descriptor's entries.
fn entries(tenant: &str, user: &str, path: &str) -> Vec<(String, String)> {
    vec![
        ("tenant".to_string(), tenant.to_string()),
        ("user".to_string(), user.to_string()),
        ("path".to_string(), path.to_string()),
    ]
}

/// The `stat_path` of the rule `entries` match, `None` when none does.
fn matched(domain: &Domain, entries: &[(String, String)]) -> Option<String> {
    domain.find(entries).map(|m| m.rule.stat_path.to_string())
}

fn main() {
    let generated = generate();
    assert_eq!(
        generated.descriptors, EXPECTED_RULES,
        "the generator's own count"
    );
    let set = from_str("bench.yaml", &generated.yaml).expect("the generated rules load");
    let domain = Arc::clone(set.domain(DOMAIN).expect("the bench domain"));
    assert_eq!(
        domain.rule_count(),
        EXPECTED_RULES,
        "descriptors in the loaded domain"
    );

    let exact = entries("tenant-042", "user-3", "/api/v1/orders");
    let wildcard = entries("tenant-042", "admin-eu-ops", "/api/v1/photos/upload");
    let no_match = entries("tenant-042", "user-3", "/nowhere");
    assert_eq!(
        matched(&domain, &exact).as_deref(),
        Some("tenant_tenant-042.user_user-3.path_/api/v1/orders")
    );
    assert_eq!(
        matched(&domain, &wildcard).as_deref(),
        Some("tenant_tenant-042.user_admin*ops.path_/api/v1/*/upload")
    );
    assert_eq!(matched(&domain, &no_match), None);

    let limiter = Limiter::new(Arc::new(Rules::fixed(set)), MemoryStore::new());
    let exact_request = RateLimitRequest::new(DOMAIN, [exact.clone()]);
    let wildcard_request = RateLimitRequest::new(DOMAIN, [wildcard.clone()]);
    for request in [&exact_request, &wildcard_request] {
        let response = limiter.check_now(request).expect("a decision");
        assert_eq!(response.overall, Code::Ok);
        assert!(response.statuses[0].limit.is_some(), "a rule limits it");
    }

    let mut criterion = Criterion::default().configure_from_args();

    let mut group = criterion.benchmark_group("rules_match");
    for (name, descriptor) in [
        ("exact", &exact),
        ("wildcard", &wildcard),
        ("no_match", &no_match),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| domain.find(black_box(descriptor.as_slice())).is_some());
        });
    }
    group.finish();

    let mut group = criterion.benchmark_group("rules_decision");
    for (name, request) in [("exact", &exact_request), ("wildcard", &wildcard_request)] {
        group.bench_function(name, |b| {
            b.iter(|| {
                limiter
                    .check_now(black_box(request))
                    .expect("a decision")
                    .overall
            });
        });
    }
    group.finish();

    // Traffic-control features against the same limit without them: one descriptor
    // `tenant` (+ its class entry), a fixed window far from its limit.
    let plain_rules = "domain: tc\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: hour, requests_per_unit: 4000000000}\n";
    let priority_rules = plain_rules.replace(
        "requests_per_unit: 4000000000}",
        "requests_per_unit: 4000000000, priority: {from: priority, shares: {critical: 100%, sheddable: 50%}, default_class: sheddable}}",
    );
    let small = |text: &str| {
        let set = from_str("tc.yaml", text).expect("the traffic-control rules load");
        Limiter::new(Arc::new(Rules::fixed(set)), MemoryStore::new())
    };
    let (plain, classes) = (small(plain_rules), small(&priority_rules));
    // Borrowing: within the key's own limit (one store call, the pool checked beside
    // it), and past it (a second call with the borrowed counter and the pool).
    let pooled = |own: &str| {
        plain_rules
            .replace("descriptors:", "pools:\n  - {name: shared, rate_limit: {unit: hour, requests_per_unit: 4000000000}}\ndescriptors:")
            .replace(
                "requests_per_unit: 4000000000}\n",
                &format!("requests_per_unit: {own}, borrow: {{from: shared, up_to: 4000000000}}}}\n"),
            )
    };
    let (guaranteed, borrowing) = (small(&pooled("3000000000")), small(&pooled("1")));
    // The same store work without borrowing: the key's limit and a second counter
    // shared by every key (`rate_limits` on two descriptors of the request).
    let two_counters = small(&format!(
        "{plain_rules}  - key: all\n    rate_limit: {{unit: hour, requests_per_unit: 4000000000}}\n"
    ));
    let two_request = RateLimitRequest::new("tc", [vec![("tenant", "acme")], vec![("all", "x")]]);
    // A token bucket far from its limit, without and with a warm-up (the key stays
    // cold for the whole run: every admission computes the warm-up's extra time).
    let bucket_rules = plain_rules.replace(
        "requests_per_unit: 4000000000}",
        "requests_per_unit: 4000000000, algorithm: token_bucket}",
    );
    let warm_rules = plain_rules.replace(
        "requests_per_unit: 4000000000}",
        "requests_per_unit: 4000000000, algorithm: token_bucket, warmup: 1h}",
    );
    let (bucket, warm) = (small(&bucket_rules), small(&warm_rules));
    let plain_request = RateLimitRequest::new("tc", [vec![("tenant", "acme")]]);
    let class_request =
        RateLimitRequest::new("tc", [vec![("tenant", "acme"), ("priority", "critical")]]);
    let mut group = criterion.benchmark_group("features_decision");
    group.bench_function("plain", |b| {
        b.iter(|| {
            plain
                .check_now(black_box(&plain_request))
                .expect("a decision")
                .overall
        });
    });
    group.bench_function("priority", |b| {
        b.iter(|| {
            classes
                .check_now(black_box(&class_request))
                .expect("a decision")
                .overall
        });
    });
    group.bench_function("two_counters", |b| {
        b.iter(|| {
            two_counters
                .check_now(black_box(&two_request))
                .expect("a decision")
                .overall
        });
    });
    group.bench_function("borrow_within_own", |b| {
        b.iter(|| {
            guaranteed
                .check_now(black_box(&plain_request))
                .expect("a decision")
                .overall
        });
    });
    group.bench_function("borrow_past_own", |b| {
        b.iter(|| {
            borrowing
                .check_now(black_box(&plain_request))
                .expect("a decision")
                .overall
        });
    });
    group.bench_function("token_bucket", |b| {
        b.iter(|| {
            bucket
                .check_now(black_box(&plain_request))
                .expect("a decision")
                .overall
        });
    });
    group.bench_function("token_bucket_warmup", |b| {
        b.iter(|| {
            warm.check_now(black_box(&plain_request))
                .expect("a decision")
                .overall
        });
    });
    group.finish();

    // Still the admission path at the end of the run.
    for request in [&exact_request, &wildcard_request] {
        let response = limiter.check_now(request).expect("a decision");
        assert_eq!(response.overall, Code::Ok, "every check was admitted");
    }

    criterion.final_summary();
}
