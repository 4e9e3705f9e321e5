//! `POST /v1/query` (an answer, as JSON or streamed) and `POST /v1/search` (retrieval only).

use actix_web::{web, HttpRequest, HttpResponse};

use crate::query::{QueryEngine, QueryRequest, SearchRequest};
use crate::server::error::ApiError;
use crate::server::sse;

/// `POST /v1/query`: answers the question with citations, as one JSON response or, when
/// the request sets `stream`, as Server-Sent Events.
pub async fn answer(
    req: HttpRequest,
    engine: web::Data<QueryEngine>,
    body: web::Json<QueryRequest>,
) -> Result<HttpResponse, ApiError> {
    let request = body.into_inner();
    let engine = engine.into_inner();
    if request.stream {
        let events = engine.answer_stream(request).await?;
        return Ok(sse::respond(
            &req,
            sse::sse(events, engine.limits().keep_alive),
        ));
    }
    let response = engine.answer(request).await?;
    Ok(HttpResponse::Ok().json(response))
}

/// `POST /v1/search`: the retrieved chunks for the question, without generating an answer.
pub async fn search(
    engine: web::Data<QueryEngine>,
    body: web::Json<SearchRequest>,
) -> Result<HttpResponse, ApiError> {
    let response = engine.search(body.into_inner()).await?;
    Ok(HttpResponse::Ok().json(response))
}
