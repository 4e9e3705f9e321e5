//! Integration tests on the real parts: the exported ONNX model, the embedded Qdrant engine,
//! mistral.rs with real GGUF models, the `docent` binary, and the real HTTP server on a
//! random port. One test binary (link time); needs `make setup` (the models) and `../shared`.

mod answer_path;
mod api;
mod bench;
mod citations;
mod cli;
mod crash;
mod default_model;
mod docs;
mod embedding;
mod generation;
mod hardening;
mod helpers;
mod ingest;
mod openai;
mod parsers;
mod refusal;
mod replicas;
mod reuse;
mod safety;
mod server_store;
mod streaming;
mod web;
