//! Server-Sent Events of a streamed answer, framed by actix-web-lab's `Sse` (maintained by
//! actix-web's maintainer): one `event: <type>` with a JSON `data:` line per event, and a
//! `: keep-alive` comment whenever the stream has been quiet for the keep-alive period.

use std::convert::Infallible;
use std::time::Duration;

use actix_web::{HttpRequest, HttpResponse, Responder};
use actix_web_lab::sse::{Data, Event, Sse};
use serde_json::json;

use crate::query::QueryEvent;
use crate::server::error::ApiError;

/// The response body of a streamed answer. Dropping it (the client went away) drops the
/// receiver, which cancels the generation.
pub fn sse(
    events: tokio::sync::mpsc::Receiver<QueryEvent>,
    keep_alive: Duration,
) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    let stream = futures::stream::unfold(events, |mut events| async move {
        let e = events.recv().await?;
        Some((Ok(event(e)), events))
    });
    Sse::from_stream(stream).with_keep_alive(keep_alive)
}

/// A streamed response of `events`, with keep-alive comments. `Sse` sets the content type
/// and `Cache-Control: no-cache`; proxies such as nginx must not buffer the stream either.
pub fn respond<S>(req: &HttpRequest, events: Sse<S>) -> HttpResponse
where
    S: futures::Stream<Item = Result<Event, Infallible>> + 'static,
{
    events
        .customize()
        .insert_header(("X-Accel-Buffering", "no"))
        .respond_to(req)
        .map_into_boxed_body()
}

/// One answer event as an SSE event.
pub fn event(event: QueryEvent) -> Event {
    let (name, data) = match event {
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
    Data::new(data).event(name).into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::body::MessageBody;

    #[actix_web::test]
    async fn frames_events_and_keep_alives() {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tx.send(QueryEvent::Delta {
            text: "two\nlines".into(),
        })
        .await
        .unwrap();
        let body = sse(rx, Duration::from_millis(20));
        let waiter = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(70)).await;
            drop(tx);
        });
        let bytes = actix_web::body::to_bytes(body.boxed()).await.unwrap();
        waiter.await.unwrap();
        let text = std::str::from_utf8(&bytes).unwrap();
        assert!(
            text.starts_with("event: delta\ndata: {\"text\":\"two\\nlines\"}\n\n"),
            "{text:?}"
        );
        assert!(text.contains(": keep-alive\n\n"), "{text:?}");
    }
}
