//! Stage **api**: the HTTP routes (errors become JSON through [`crate::error`]).

use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::json;

use crate::error::{json_error, ApiError};
use crate::query::{QueryEngine, QueryEvent, QueryRequest, SearchRequest};

async fn query(
    engine: web::Data<QueryEngine>,
    body: web::Json<QueryRequest>,
) -> Result<HttpResponse, ApiError> {
    let request = body.into_inner();
    if request.stream {
        let events = engine.into_inner().answer_stream(request).await?;
        return Ok(HttpResponse::Ok()
            .content_type("text/event-stream")
            .insert_header(("Cache-Control", "no-cache"))
            .insert_header(("X-Accel-Buffering", "no"))
            .streaming(sse(events)));
    }
    let response = engine.answer(request).await?;
    Ok(HttpResponse::Ok().json(response))
}

/// Server-Sent Events: `event: <type>` and a JSON `data:` line per event; keep-alives are
/// comments. Dropping this body (the client went away) drops the receiver, which cancels
/// the generation.
fn sse(
    events: tokio::sync::mpsc::Receiver<QueryEvent>,
) -> impl futures::Stream<Item = Result<web::Bytes, actix_web::Error>> {
    futures::stream::unfold(events, |mut events| async move {
        let event = events.recv().await?;
        Some((Ok(web::Bytes::from(sse_frame(event))), events))
    })
}

pub fn sse_frame(event: QueryEvent) -> String {
    let (name, data) = match event {
        QueryEvent::KeepAlive => return ": keep-alive\n\n".to_string(),
        QueryEvent::Retrieval(r) => ("retrieval", serde_json::to_string(&r)),
        QueryEvent::Delta { text } => ("delta", serde_json::to_string(&json!({ "text": text }))),
        QueryEvent::Citation(c) => ("citation", serde_json::to_string(&c)),
        QueryEvent::Done(r) => ("done", serde_json::to_string(&r)),
        QueryEvent::Error(e) => (
            "error",
            serde_json::to_string(&json!({ "error": ApiError::from(e) })),
        ),
    };
    let data = data.unwrap_or_else(|e| {
        json!({ "error": { "code": "internal", "message": e.to_string() } }).to_string()
    });
    format!("event: {name}\ndata: {data}\n\n")
}

async fn search(
    engine: web::Data<QueryEngine>,
    body: web::Json<SearchRequest>,
) -> Result<HttpResponse, ApiError> {
    let response = engine.search(body.into_inner()).await?;
    Ok(HttpResponse::Ok().json(response))
}

async fn healthz(engine: web::Data<QueryEngine>) -> Result<HttpResponse, ApiError> {
    let store = engine.index.store.clone();
    let chunks = web::block(move || store.len())
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                e.to_string(),
            )
        })?
        .map_err(|e| {
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

async fn not_found(req: HttpRequest) -> Result<HttpResponse, ApiError> {
    Err(ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no route for {} {}", req.method(), req.path()),
    ))
}

async fn method_not_allowed(req: HttpRequest) -> Result<HttpResponse, ApiError> {
    Err(ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{} is not allowed on {}", req.method(), req.path()),
    ))
}

/// Every route of the service.
pub fn routes(cfg: &mut web::ServiceConfig, max_body_bytes: usize) {
    cfg.app_data(
        web::JsonConfig::default()
            .limit(max_body_bytes)
            .error_handler(json_error),
    )
    .app_data(web::QueryConfig::default().error_handler(|err, _req| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
            err.to_string(),
        )
        .into()
    }))
    .service(
        web::resource("/v1/query")
            .route(web::post().to(query))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/v1/search")
            .route(web::post().to(search))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/v1/documents")
            .route(web::post().to(crate::documents::upload))
            .route(web::get().to(crate::documents::list))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/v1/documents/{id}")
            .route(web::delete().to(crate::documents::delete))
            .route(web::get().to(crate::documents::get))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/v1/jobs/{id}")
            .route(web::get().to(crate::documents::job))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/healthz")
            .route(web::get().to(healthz))
            .default_service(web::to(method_not_allowed)),
    )
    .default_service(web::to(not_found));
}
