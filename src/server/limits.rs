//! Load limits in front of the routes: at most `server.max_in_flight` requests are handled
//! at once (more get 503 `overloaded` with `Retry-After`), and a request whose response
//! has not started within `server.request_timeout_s` gets 503 `timeout`. It wraps each API
//! resource (after routing: the request may be held for the timeout answer), never the
//! probes or `/metrics`, so an overloaded server can still be watched.

use std::sync::Arc;
use std::time::Duration;

use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::middleware::Next;
use actix_web::{web, ResponseError};
use tokio::sync::Semaphore;

use crate::metrics::metrics;
use crate::server::error::ApiError;

/// The shared load limits: the slots for requests in flight and the time a response has to
/// start. Registered as app data; [`limit`] passes requests through when it is absent.
pub struct Limits {
    slots: Arc<Semaphore>,
    timeout: Duration,
}

impl Limits {
    /// Limits allowing `max_in_flight` requests at once, each with `timeout` to start its
    /// response.
    pub fn new(max_in_flight: usize, timeout: Duration) -> Limits {
        Limits {
            slots: Arc::new(Semaphore::new(max_in_flight)),
            timeout,
        }
    }
}

/// The middleware: takes a slot (503 `overloaded`, `Retry-After: 1`, when none is free) and
/// answers 503 `timeout` when the handler has not responded within the timeout.
pub async fn limit(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    let Some(limits) = req.app_data::<web::Data<Limits>>().cloned() else {
        return next.call(req).await.map(|r| r.map_into_left_body());
    };
    let Ok(_slot) = limits.slots.clone().try_acquire_owned() else {
        metrics().rejected.with_label_values(&["overloaded"]).inc();
        let e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "overloaded",
            "the server is handling as many requests as it is allowed to; retry shortly",
        )
        .retry_after(1);
        return Ok(req.into_response(e.error_response()).map_into_right_body());
    };
    let http = req.request().clone();
    match tokio::time::timeout(limits.timeout, next.call(req)).await {
        Ok(res) => res.map(|r| r.map_into_left_body()),
        Err(_) => {
            metrics().rejected.with_label_values(&["timeout"]).inc();
            let e = ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "timeout",
                format!(
                    "no response within {} s (server.request_timeout_s)",
                    limits.timeout.as_secs()
                ),
            )
            .retry_after(1);
            Ok(ServiceResponse::new(http, e.error_response()).map_into_right_body())
        }
    }
}
