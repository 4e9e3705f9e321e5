//! Logging set-up in one place. `RUST_LOG` overrides the default filter, which keeps the
//! engines' own chatter (mistral.rs, ONNX Runtime glue) at warnings. `json` writes one
//! JSON object per line, with the request span's fields (the request id among them).

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Installs the global `tracing` subscriber, writing to stderr in `format` (ANSI colours
/// only when stderr is a terminal). A second call does nothing.
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        EnvFilter::new(
            "info,mistralrs_core=warn,mistralrs_quant=warn,mistralrs=warn,candle_core=warn,toktrie_hf_tokenizers=error,ort=warn,qdrant_edge=error",
        )
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder.json().with_current_span(true).try_init(),
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
    };
}
