//! `GET /healthz`: the store answers, and what the engine and the safety filter did.

use actix_web::http::StatusCode;
use actix_web::{web, HttpResponse};
use serde_json::json;

use crate::query::QueryEngine;
use crate::server::error::ApiError;

pub async fn healthz(engine: web::Data<QueryEngine>) -> Result<HttpResponse, ApiError> {
    let chunks = engine.index.store.len().await.map_err(|e| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            e.to_string(),
        )
    })?;
    Ok(HttpResponse::Ok().json(json!({
        "status": "ok",
        "chunks": chunks,
        "generation": engine.generator().stats(),
        "safety": engine.safety_counts(),
    })))
}
