//! What the dashboard's hot-key sketch ([`SpaceSaving`], 64 keys of at most 96 bytes, as
//! `tollgate serve` keeps per rule) costs per offered key:
//!
//! - `same_key`: one key offered again and again (found, its count raised);
//! - `skewed`: keys drawn from a Zipf-like distribution over 10,000 (mostly found);
//! - `distinct`: a new key every time (each replaces the least counted, a copy of its
//!   40 bytes), the dearest case: a flood of distinct keys.
//!
//! ```text
//! cargo bench -p tollgate --bench sketch
//! ```

use criterion::{black_box, Criterion};
use tollgate::sketch::SpaceSaving;

fn keys(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("user={i:08x}-0123456789abcdef0123456789"))
        .collect()
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    let mut group = criterion.benchmark_group("sketch_offer");
    let distinct = keys(1 << 20);
    group.bench_function("same_key", |b| {
        let mut s = SpaceSaving::new(64, 96);
        b.iter(|| s.offer(black_box(&distinct[0]), 1));
    });
    // Ranks by inverse transform of 1/r over 10,000 keys, drawn ahead.
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let skewed: Vec<&str> = (0..1 << 16)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 11) as f64 / (1u64 << 53) as f64;
            let rank = (10_000f64.powf(u) as usize).clamp(1, 10_000) - 1;
            distinct[rank].as_str()
        })
        .collect();
    group.bench_function("skewed", |b| {
        let mut s = SpaceSaving::new(64, 96);
        let mut i = 0;
        b.iter(|| {
            s.offer(black_box(skewed[i & (skewed.len() - 1)]), 1);
            i += 1;
        });
    });
    group.bench_function("distinct", |b| {
        let mut s = SpaceSaving::new(64, 96);
        let mut i = 0;
        b.iter(|| {
            s.offer(black_box(&distinct[i & (distinct.len() - 1)]), 1);
            i += 1;
        });
    });
    group.finish();
    criterion.final_summary();
}
