//! The OpenAI-compatible routes: `POST /v1/chat/completions` (an answer over the index, as
//! one completion or a stream of chunks ending in `data: [DONE]`), `GET /v1/models` and
//! `GET /v1/models/{model}`, and [`errors`], which gives every error on these paths OpenAI's
//! shape. The wire format and its mapping are in [`crate::server::openai_wire`].

use std::collections::VecDeque;
use std::convert::Infallible;

use actix_web::body::{BoxBody, EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::Next;
use actix_web::{web, HttpRequest, HttpResponse};
use actix_web_lab::sse::{Data, Event, Sse};
use serde_json::{json, Value};
use tokio::sync::mpsc::Receiver;

use crate::query::{QueryEngine, QueryEvent};
use crate::server::error::{keep_headers, ApiError};
use crate::server::openai_wire::{self, ChatError, ChatRequest, ChunkWriter, ModelCard, Reply};
use crate::server::sse;

fn served(engine: &QueryEngine) -> ModelCard {
    ModelCard::of(engine.engine().model_path())
}

/// `GET /v1/models`: the one model this server answers with.
pub async fn models(engine: web::Data<QueryEngine>) -> HttpResponse {
    HttpResponse::Ok().json(json!({ "object": "list", "data": [served(&engine)] }))
}

/// `GET /v1/models/{model}`: the served model by its id or alias, else 404.
pub async fn model(
    engine: web::Data<QueryEngine>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let card = served(&engine);
    if !card.answers_to(&id) {
        return Err(ChatError::ModelNotFound(id.into_inner()).into());
    }
    Ok(HttpResponse::Ok().json(card))
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    req: HttpRequest,
    engine: web::Data<QueryEngine>,
    body: web::Json<ChatRequest>,
) -> Result<HttpResponse, ApiError> {
    let chat = body.into_inner();
    let card = served(&engine);
    if !card.answers_to(&chat.model) {
        return Err(ChatError::ModelNotFound(chat.model).into());
    }
    let mut mapped = chat.into_query()?;
    let query = std::mem::take(&mut mapped.query);
    let engine = engine.into_inner();
    let max_tokens = query
        .generation
        .max_tokens
        .unwrap_or(engine.limits().default_max_tokens);
    let reply = Reply::new(card.id, max_tokens);
    if mapped.stream {
        let events = engine
            .answer_stream(query)
            .await
            .map_err(|e| mapped.error(e))?;
        let chunks = Sse::from_stream(chunks(
            events,
            ChunkWriter::new(reply, mapped.include_usage),
        ))
        .with_keep_alive(engine.limits().keep_alive);
        return Ok(sse::respond(&req, chunks));
    }
    let response = engine.answer(query).await.map_err(|e| mapped.error(e))?;
    Ok(HttpResponse::Ok().json(reply.completion(response)))
}

/// The answer's events as OpenAI's `data:` payloads. Dropping the stream (the client went
/// away) drops the receiver, which cancels the generation.
fn chunks(
    events: Receiver<QueryEvent>,
    writer: ChunkWriter,
) -> impl futures::Stream<Item = Result<Event, Infallible>> {
    let pending = VecDeque::from([writer.start()]);
    futures::stream::unfold(
        (events, writer, pending),
        |(mut events, mut writer, mut pending)| async move {
            loop {
                if let Some(data) = pending.pop_front() {
                    let event: Event = Data::new(data).into();
                    return Some((Ok(event), (events, writer, pending)));
                }
                if writer.finished() {
                    return None;
                }
                match events.recv().await {
                    Some(e) => pending.extend(writer.event(e)),
                    None => pending.extend(writer.end()),
                }
            }
        },
    )
}

/// Middleware (outside the error normaliser and the key check): on the OpenAI paths, every
/// error response, whoever made it (keys, rates, load limits, body parsing, handlers), is
/// rewritten from docent's `{"error": {"code", "message", "details"}}` into OpenAI's
/// `{"error": {"message", "type", "param", "code"}}`, headers (`Retry-After`) kept.
pub async fn errors(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody, BoxBody>>, actix_web::Error> {
    let openai = openai_wire::is_openai_path(req.path());
    let res = next.call(req).await?;
    let status = res.status();
    if !openai || !(status.is_client_error() || status.is_server_error()) {
        return Ok(res.map_into_left_body());
    }
    let (req, res) = res.into_parts();
    let (head, body) = res.into_parts();
    let docent = match actix_web::body::to_bytes(body).await {
        Ok(bytes) => serde_json::from_slice::<Value>(&bytes)
            .ok()
            .and_then(|v| v.get("error").cloned())
            .unwrap_or(Value::Null),
        Err(_) => Value::Null,
    };
    let (status, error) = openai_wire::error_body(status, &docent);
    let mut new = HttpResponse::build(status).json(json!({ "error": error }));
    keep_headers(head.headers(), &mut new);
    Ok(ServiceResponse::new(req, new).map_into_right_body())
}
