//! The HTTP routes, one module per resource; every error becomes JSON through
//! [`crate::server::error`].
//!
//! | route | module |
//! |---|---|
//! | `POST /v1/query`, `POST /v1/search` | [`query`] |
//! | `/v1/documents`, `/v1/documents/{id}`, `/v1/jobs/{id}` | [`documents`] |
//! | `GET /healthz`, `GET /readyz`, `GET /metrics` | [`health`] |
//! | `POST /v1/chat/completions`, `GET /v1/models`, `GET /v1/models/{model}` | [`openai`] |
//! | `GET /`, `GET /assets/{name}` (the web page; public) | [`webpage`] |

pub mod documents;
pub mod health;
pub mod openai;
pub mod query;
pub mod webpage;

use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};

use actix_web::middleware::from_fn;

use crate::server::error::{json_error, ApiError};
use crate::server::limits;

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

/// Every route of the service. The API routes run under the load limits ([`limits`]),
/// per resource: the probes and `/metrics` stay answerable under any load.
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
    .app_data(web::PathConfig::default().error_handler(|err, _req| {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", err.to_string()).into()
    }))
    .service(
        web::resource("/v1/query")
            .wrap(from_fn(limits::limit))
            .route(web::post().to(query::answer))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/v1/search")
            .wrap(from_fn(limits::limit))
            .route(web::post().to(query::search))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/v1/documents")
            .wrap(from_fn(limits::limit))
            .route(web::post().to(documents::upload))
            .route(web::get().to(documents::list))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/v1/documents/{id}")
            .wrap(from_fn(limits::limit))
            .route(web::delete().to(documents::delete))
            .route(web::get().to(documents::get))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/v1/jobs/{id}")
            .wrap(from_fn(limits::limit))
            .route(web::get().to(documents::job))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/v1/chat/completions")
            .wrap(from_fn(limits::limit))
            .route(web::post().to(openai::chat_completions))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/v1/models")
            .wrap(from_fn(limits::limit))
            .route(web::get().to(openai::models))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/v1/models/{model}")
            .wrap(from_fn(limits::limit))
            .route(web::get().to(openai::model))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/healthz")
            .route(web::get().to(health::healthz))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/readyz")
            .route(web::get().to(health::readyz))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/metrics")
            .route(web::get().to(health::prometheus))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/")
            .route(web::get().to(webpage::page))
            .route(web::head().to(webpage::page))
            .default_service(web::to(method_not_allowed)),
    )
    .service(
        web::resource("/assets/{name}")
            .route(web::get().to(webpage::file))
            .route(web::head().to(webpage::file))
            .default_service(web::to(method_not_allowed)),
    )
    .default_service(web::to(not_found));
}
