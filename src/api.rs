//! Stage **api**: the HTTP routes and the one mapping from errors to JSON responses
//! `{"error": {"code": "…", "message": "…"}}`.

use actix_web::error::{JsonPayloadError, ResponseError};
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use serde::Serialize;
use serde_json::json;

use crate::generate::GenerateError;
use crate::prompt::PromptError;
use crate::query::{QueryEngine, QueryError, QueryEvent, QueryRequest, SearchRequest};

#[derive(Debug, Serialize)]
pub struct ApiError {
    #[serde(skip)]
    status: StatusCode,
    code: &'static str,
    message: String,
    /// Seconds for a `Retry-After` header (429).
    #[serde(skip)]
    retry_after_s: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            retry_after_s: None,
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }
    fn error_response(&self) -> HttpResponse {
        let mut response = HttpResponse::build(self.status);
        if let Some(s) = self.retry_after_s {
            response.insert_header(("Retry-After", s.to_string()));
        }
        response.json(json!({ "error": self }))
    }
}

impl From<QueryError> for ApiError {
    fn from(e: QueryError) -> Self {
        let message = e.to_string();
        match e {
            QueryError::Invalid { .. } => {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_request", message)
            }
            QueryError::Prompt(PromptError::TooLong { .. }) => {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "prompt_too_long", message)
            }
            QueryError::Generate(GenerateError::Validation(_)) => {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_request", message)
            }
            QueryError::Generate(_) => {
                tracing::error!(error = %message, "generation failed");
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "generation_failed",
                    message,
                )
            }
            QueryError::Retrieval(_) => {
                tracing::error!(error = %message, "retrieval failed");
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "retrieval_failed", message)
            }
            QueryError::Busy { retry_after_s, .. } => ApiError {
                retry_after_s: Some(retry_after_s),
                ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, "busy", message)
            },
            QueryError::Prompt(_) | QueryError::Internal(_) => {
                tracing::error!(error = %message, "internal error");
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
            }
        }
    }
}

/// Body errors (syntax, types, size, content type) as JSON errors.
pub fn json_error(err: JsonPayloadError, _req: &HttpRequest) -> actix_web::Error {
    let e = match &err {
        JsonPayloadError::OverflowKnownLength { .. } | JsonPayloadError::Overflow { .. } => {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                err.to_string(),
            )
        }
        JsonPayloadError::ContentType => ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "send the body as Content-Type: application/json",
        ),
        JsonPayloadError::Deserialize(de) if de.is_data() => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
            de.to_string(),
        ),
        _ => ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", err.to_string()),
    };
    e.into()
}

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
