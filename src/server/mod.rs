//! The HTTP service: [`routes`] (one module per resource), [`error`] (the one error type
//! and its mapping to HTTP), [`sse`] (streamed answers), [`jobs`] (ingest jobs),
//! [`telemetry`] and [`startup`] (wiring, and the server on a port).

pub mod error;
pub mod jobs;
pub mod routes;
pub mod sse;
pub mod startup;
pub mod telemetry;
