//! `docent bench`: measurements that print numbers side by side with a limit or a peer.
//!
//! - [`ingest`]: end-to-end ingest throughput vs a bare ONNX Runtime session and a Python peer.
//! - [`query`]: retrieval latency and throughput over HTTP vs a Python peer service.
//! - [`generate`]: generation speed vs llama.cpp, speculative decoding, load times.
//! - [`load`]: the server under a mixed load with keys on, then SIGKILLed and restarted.

pub mod generate;
mod http;
mod ingest;
pub mod load;
pub mod prefill;
pub mod query;

use std::path::PathBuf;

pub use ingest::{ingest, IngestBench, Row};

/// Where a Python peer runs, if wanted.
pub struct Peer {
    /// The Python interpreter of the peer's virtual environment.
    pub python: PathBuf,
    /// The peer's script (under scripts/), run with that interpreter.
    pub script: PathBuf,
}

pub(crate) use crate::eval::RemoveOnDrop;

/// Runs `client(i)` for each of `clients` on threads of its own, all at once; their
/// results in client order, or the first error (a panicking client is an error too).
pub(crate) fn on_client_threads<T: Send>(
    clients: usize,
    client: impl Fn(usize) -> anyhow::Result<T> + Sync,
) -> anyhow::Result<Vec<T>> {
    std::thread::scope(|s| {
        let client = &client;
        let handles: Vec<_> = (0..clients).map(|i| s.spawn(move || client(i))).collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a client thread panicked"))?
            })
            .collect()
    })
}
