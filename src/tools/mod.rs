//! Tools that measure docent: `docent eval` (answer and retrieval quality, safety filter
//! rates) and `docent bench` (speed beside peers). The service does not depend on them.

pub mod bench;
pub mod eval;
pub mod models;
pub mod train_citations;
pub mod train_injection;
pub mod train_refusal;
