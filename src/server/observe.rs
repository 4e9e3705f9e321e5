//! The outermost middleware: a request id per request (the client's `X-Request-Id` when it
//! is a short token, a new UUID otherwise), returned as a header and carried by a `tracing`
//! span around the handler; one log line per request; and the HTTP metrics.

use std::time::Instant;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::middleware::Next;
use actix_web::HttpMessage;
use tracing::Instrument;

use crate::metrics::metrics;

/// The `X-Request-Id` header, read from the request and set on the response.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The request's id, in its extensions.
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

/// A client's id is kept when it is 1–64 characters of `[A-Za-z0-9._:-]`.
fn usable(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// The middleware: assigns the request id, runs the handler inside a `request` span, logs
/// one line when it is done (a warning for 5xx) and records the HTTP metrics.
pub async fn observe(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let started = Instant::now();
    let id = req
        .headers()
        .get(&REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| usable(v))
        .map_or_else(|| uuid::Uuid::new_v4().to_string(), str::to_string);
    req.extensions_mut().insert(RequestId(id.clone()));
    let route = req.match_pattern().unwrap_or_else(|| "unmatched".into());
    let method = req.method().to_string();
    let span = tracing::info_span!("request", id = %id, method = %method, path = %req.path());
    let m = metrics();
    m.in_flight.inc();
    let result = next.call(req).instrument(span.clone()).await;
    m.in_flight.dec();
    let mut res = match result {
        Ok(res) => res,
        Err(e) => {
            // an error no layer turned into a response: answer it here, in the one shape
            let status = e.as_response_error().status_code();
            tracing::error!(parent: &span, status = status.as_u16(), error = %e, "request failed");
            return Err(e);
        }
    };
    let status = res.status();
    let seconds = started.elapsed().as_secs_f64();
    m.http_requests
        .with_label_values(&[&route, &method, status.as_str()])
        .inc();
    m.http_seconds.with_label_values(&[&route]).observe(seconds);
    if let Ok(v) = HeaderValue::from_str(&id) {
        res.headers_mut().insert(REQUEST_ID, v);
    }
    span.in_scope(|| {
        let ms = (seconds * 1e4).round() / 10.0;
        if status.is_server_error() {
            tracing::warn!(status = status.as_u16(), ms, "request done");
        } else {
            tracing::info!(status = status.as_u16(), ms, "request done");
        }
    });
    Ok(res)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_ids_are_kept_only_when_short_and_plain() {
        assert!(usable("abc-123_x.y:z"));
        assert!(!usable(""));
        assert!(!usable(&"a".repeat(65)));
        assert!(!usable("a b"));
        assert!(!usable("a\nb"));
        assert!(!usable("<script>"));
    }
}
