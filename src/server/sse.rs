//! Server-Sent Events framing of a streamed answer.

use actix_web::web;
use serde_json::json;

use crate::query::QueryEvent;
use crate::server::error::ApiError;

/// Server-Sent Events: `event: <type>` and a JSON `data:` line per event; keep-alives are
/// comments. Dropping this body (the client went away) drops the receiver, which cancels
/// the generation.
pub fn sse(
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
