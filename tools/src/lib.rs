//! What measures docent and trains its small models: `docent eval` (answer and retrieval
//! quality, the safety filter's rates, the refusal probe's curve), `docent bench` (speed beside
//! a peer or a limit: ingest, query, generate, prefill, load) and `docent train-refusal`,
//! `train-injection`, `train-citations` (the probes and classifiers the service ships).
//!
//! Not for serving: the service crate (`docent`) does not depend on this one, and nothing
//! here runs in `docent serve`. The tools call the service's public interface (the answer
//! path, the configuration, `server::startup` for a real server on a port) as a user's
//! program would; the `docent` command (`docent-cli`) hands its subcommands to them.

// Every public item says what it is (as in the other library crates).
#![warn(missing_docs)]
// No function over 120 lines of code (clippy.toml); tests aside.
#![warn(clippy::too_many_lines)]
#![cfg_attr(test, allow(clippy::too_many_lines))]

pub mod bench;
pub mod eval;
pub mod models;
pub mod train_citations;
pub mod train_injection;
pub mod train_refusal;
