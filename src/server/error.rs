//! The one error model of the HTTP API: every failure becomes a JSON response
//! `{"error": {"code": "…", "message": "…", "details": …}}` with its status, mapped here
//! and nowhere else (`details` is null or an object, e.g. `{"field": "top_k"}`).
//! Used by the HTTP routes and the document handlers (it depends on neither).

use actix_web::error::{JsonPayloadError, ResponseError};
use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse};
use serde::Serialize;
use serde_json::json;

use crate::query::generate::GenerateError;
use crate::query::prompt::PromptError;
use crate::query::QueryError;

/// An HTTP API error: its status, a stable machine-readable `code` (`invalid_request`,
/// `busy`, `not_found`…), a message for people, optional details and an optional
/// `Retry-After`. Serialized as the inner object of `{"error": …}`.
#[derive(Debug, Serialize)]
pub struct ApiError {
    #[serde(skip)]
    status: StatusCode,
    code: &'static str,
    message: String,
    /// Machine-readable specifics (the offending field, the scope needed…), or null.
    details: Option<Box<serde_json::Value>>,
    /// Seconds for a `Retry-After` header (429).
    #[serde(skip)]
    retry_after_s: Option<u64>,
}

impl ApiError {
    /// An error with this status, code and message, without details or `Retry-After`.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            details: None,
            retry_after_s: None,
        }
    }

    /// A 422 naming the field to fix.
    pub fn invalid_field(field: &str, message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_request", message)
            .with_details(json!({ "field": field }))
    }

    /// Sets the `details` object (replacing any set before).
    pub fn with_details(mut self, details: serde_json::Value) -> Self {
        self.details = Some(Box::new(details));
        self
    }

    /// Adds `Retry-After: seconds`.
    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after_s = Some(seconds);
        self
    }

    /// The error's machine-readable code, e.g. `invalid_request`.
    pub fn code(&self) -> &'static str {
        self.code
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
            QueryError::Invalid { field, .. } => ApiError::invalid_field(field, message),
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
            QueryError::Busy { retry_after_s, .. } => {
                crate::metrics::metrics()
                    .rejected
                    .with_label_values(&["queue"])
                    .inc();
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "busy", message)
                    .retry_after(retry_after_s)
            }
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

/// The code of an error response made outside docent's handlers (actix's own).
fn code_for(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => "bad_request",
        401 => "unauthorized",
        403 => "forbidden",
        404 => "not_found",
        405 => "method_not_allowed",
        408 => "timeout",
        413 => "payload_too_large",
        414 => "uri_too_long",
        415 => "unsupported_media_type",
        422 => "invalid_request",
        429 => "rate_limited",
        431 => "headers_too_large",
        503 => "unavailable",
        s if s >= 500 => "internal",
        _ => "bad_request",
    }
}

/// Error-response hook: any 4xx/5xx that is not already docent's JSON error (an actix
/// extractor's or router's plain-text error) is rewritten into the one shape.
pub fn normalise<B: actix_web::body::MessageBody + 'static>(
    res: actix_web::dev::ServiceResponse<B>,
) -> actix_web::Result<actix_web::middleware::ErrorHandlerResponse<B>> {
    use actix_web::http::header;
    let is_json = res
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json {
        return Ok(actix_web::middleware::ErrorHandlerResponse::Response(
            res.map_into_left_body(),
        ));
    }
    let status = res.status();
    let message = res
        .response()
        .error()
        .map(|e| e.to_string())
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| {
            status
                .canonical_reason()
                .unwrap_or("request failed")
                .to_string()
        });
    let (req, old) = res.into_parts();
    let mut new = ApiError::new(status, code_for(status), message).error_response();
    keep_headers(old.headers(), &mut new);
    Ok(actix_web::middleware::ErrorHandlerResponse::Response(
        actix_web::dev::ServiceResponse::new(req, new).map_into_right_body(),
    ))
}

/// Copies the headers of a response being replaced by a new body (`Retry-After`, request
/// id…) onto the new one, except the body's own content type and length.
pub fn keep_headers(old: &actix_web::http::header::HeaderMap, new: &mut HttpResponse) {
    use actix_web::http::header;
    for (name, value) in old {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            new.headers_mut().insert(name.clone(), value.clone());
        }
    }
}
