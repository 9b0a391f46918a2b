//! Criterion benchmarks against governor (filled in below).
fn main() {}
