//! docent: retrieval-augmented question answering with citations people can check.
//!
//! The query path reads top to bottom as modules: [`retrieve`] → [`prompt`] → [`generate`]
//! → [`postprocess`], orchestrated by [`query`] and served by [`api`]. Ingest (load → split →
//! embed → store) lives in the `docent-ingest` crate. [`config`] is the one typed
//! configuration; [`startup`] wires everything together.

pub mod api;
pub mod bench;
pub mod config;
pub mod documents;
pub mod error;
pub mod eval;
pub mod generate;
pub mod jobs;
pub mod postprocess;
pub mod prompt;
pub mod query;
pub mod retrieve;
pub mod safety;
pub mod startup;
pub mod telemetry;
