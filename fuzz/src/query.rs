//! `docent::query`'s text modules, compiled from docent's own files.

#[path = "../../src/query/safety/mod.rs"]
pub mod safety;

#[path = "../../src/query/postprocess/mod.rs"]
pub mod postprocess;

#[path = "../../src/query/embed.rs"]
pub mod embed;
