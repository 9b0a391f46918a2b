//! `tollgate`: the rate limit service, gateway and tools. See `tollgate --help`.

use std::process::ExitCode;

/// mimalloc instead of glibc's allocator: hyper and the limiter allocate a few small
/// buffers per request, which mimalloc serves more cheaply (the A/B figures are in
/// docs/benchmarks.md, "the gateway").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    tollgate_server::run()
}
