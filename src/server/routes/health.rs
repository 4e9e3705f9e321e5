//! Operations: `GET /healthz` (the process is alive), `GET /readyz` (the models are loaded
//! and the store answers) and `GET /metrics` (Prometheus text format).

use actix_web::http::StatusCode;
use actix_web::{web, HttpResponse};
use serde_json::json;

use crate::metrics::metrics;
use crate::query::QueryEngine;
use crate::server::error::ApiError;

/// Liveness: answers while the process serves requests; touches nothing else.
pub async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(json!({ "status": "ok" }))
}

/// Readiness: the store answers and the engine's state, with what it and the safety
/// filter did. 503 `not_ready` while the store cannot be read.
pub async fn readyz(engine: web::Data<QueryEngine>) -> Result<HttpResponse, ApiError> {
    let chunks = engine.index.store.len().await.map_err(|e| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_ready",
            format!("the store does not answer: {e}"),
        )
    })?;
    Ok(HttpResponse::Ok().json(json!({
        "status": "ready",
        "chunks": chunks,
        "models": {
            "embedding": engine.index.embedder.model_sha256(),
            "generation": engine.engine().model_path().display().to_string(),
        },
        "generation": engine.engine().stats(),
        "safety": engine.safety_counts(),
    })))
}

/// Every metric, in the Prometheus text exposition format.
pub async fn prometheus(engine: web::Data<QueryEngine>) -> HttpResponse {
    let m = metrics();
    m.queue_depth.set(engine.engine().stats().active as i64);
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(m.render())
}
