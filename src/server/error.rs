//! The one error model of the HTTP API: every failure becomes a JSON response
//! `{"error": {"code": "…", "message": "…"}}` with its status, mapped here and nowhere else.
//! Used by the HTTP routes and the document handlers (it depends on neither).

use actix_web::error::{JsonPayloadError, ResponseError};
use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse};
use serde::Serialize;
use serde_json::json;

use crate::query::generate::GenerateError;
use crate::query::prompt::PromptError;
use crate::query::QueryError;

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
