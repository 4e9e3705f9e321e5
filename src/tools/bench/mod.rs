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
pub mod query;

use std::path::PathBuf;

pub use ingest::{ingest, IngestBench, Row};

/// Where a Python peer runs, if wanted.
pub struct Peer {
    pub python: PathBuf,
    pub script: PathBuf,
}

pub(crate) use crate::tools::eval::RemoveOnDrop;
