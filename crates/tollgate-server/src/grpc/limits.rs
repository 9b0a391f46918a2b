//! Limits on request bytes that both gRPC transports keep: the native transport
//! (`native.rs`) and tonic's, through `conn/grpc_bodies.rs`. A leaf module, so that the
//! connection layer can read them without depending on a transport.

/// Request bytes of unfinished calls held per connection: one message of the largest
/// size (4 MiB, gRPC's default) and room for others.
pub const MAX_BUFFERED: usize = (4 << 20) + (64 << 10);

/// Request bytes of unfinished calls held by all connections of a transport together;
/// past it, a stream that would hold more is answered `RESOURCE_EXHAUSTED`. On the native
/// transport a message that arrives whole in one read (every rate limit request) never
/// counts.
pub const MAX_BUFFERED_TOTAL: usize = 256 << 20;
