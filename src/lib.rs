//! docent: retrieval-augmented question answering with citations people can check.
//!
//! The source tree reads as the path of a request:
//!
//! - [`query`]: what happens to a question: [`query::embed`] (the question embedded) →
//!   [`query::retrieve`] (hybrid search in the store) → [`query::prompt`] (the template
//!   rendered) → [`query::generate`] (the model) → [`query::postprocess`] (stop
//!   sequences cut, citations checked) with [`query::safety`] around it; [`query`]'s
//!   `QueryEngine` is the one orchestration for JSON and streamed answers.
//! - [`server`]: HTTP: [`server::routes`] (one module per resource), [`server::error`]
//!   (the one error type and its mapping to HTTP), the middleware ([`server::observe`],
//!   [`server::auth`], [`server::limits`]), jobs, telemetry and [`server::startup`]
//!   (wiring and graceful shutdown).
//! - [`config`]: the one typed configuration.
//! - [`metrics`]: the Prometheus metrics every stage records (`GET /metrics`).
//!
//! Ingest (load → split → embed → store) is the `docent-ingest` crate; the store (one
//! interface, an embedded and a server engine) is the `docent-store` crate. The `docent`
//! command is the `docent-cli` crate (`cli/`), and what measures the service (`docent eval`,
//! `docent bench`, `docent train-*`) is the `docent-tools` crate (`tools/`): this crate
//! depends on neither.

// Every public item says what it is (as in docent-ingest, docent-store and the kernels).
#![warn(missing_docs)]
// No function over 120 lines of code (clippy.toml); tests aside.
#![warn(clippy::too_many_lines)]
#![cfg_attr(test, allow(clippy::too_many_lines))]

pub mod config;
pub mod metrics;
pub mod query;
pub mod server;
