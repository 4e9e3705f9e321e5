//! `POST /v1/query` (an answer, as JSON or streamed) and `POST /v1/search` (retrieval only).

use actix_web::{web, HttpRequest, HttpResponse, Responder};

use crate::query::{QueryEngine, QueryRequest, SearchRequest};
use crate::server::error::ApiError;
use crate::server::sse::sse;

pub async fn answer(
    req: HttpRequest,
    engine: web::Data<QueryEngine>,
    body: web::Json<QueryRequest>,
) -> Result<HttpResponse, ApiError> {
    let request = body.into_inner();
    let engine = engine.into_inner();
    if request.stream {
        let events = engine.answer_stream(request).await?;
        // Sse sets the content type and `Cache-Control: no-cache`; proxies such as nginx
        // must not buffer the stream either
        return Ok(sse(events, engine.limits().keep_alive)
            .customize()
            .insert_header(("X-Accel-Buffering", "no"))
            .respond_to(&req)
            .map_into_boxed_body());
    }
    let response = engine.answer(request).await?;
    Ok(HttpResponse::Ok().json(response))
}

pub async fn search(
    engine: web::Data<QueryEngine>,
    body: web::Json<SearchRequest>,
) -> Result<HttpResponse, ApiError> {
    let response = engine.search(body.into_inner()).await?;
    Ok(HttpResponse::Ok().json(response))
}
