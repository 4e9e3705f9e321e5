//! The HTTP service: [`routes`] (one module per resource), [`error`] (the one error type
//! and its mapping to HTTP), the middleware layers ([`observe`]: request ids, logs and
//! metrics; [`auth`]: keys, scopes and rate limits; [`limits`]: concurrency and timeouts),
//! [`sse`] (streamed answers), [`openai_wire`] (the OpenAI-compatible wire format and its
//! mapping), [`jobs`] (ingest jobs), [`telemetry`] and [`startup`] (wiring, the server on a
//! port, graceful shutdown).

pub mod auth;
pub mod error;
pub mod jobs;
pub mod limits;
pub mod observe;
pub mod openai_wire;
pub mod routes;
pub mod sse;
pub mod startup;
pub mod telemetry;
