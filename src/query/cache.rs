//! The answer cache: greedy answers are a function of the request and the index revision.

use crate::query::{QueryResponse, SearchResponse};

/// What is kept per answer: the index revision it was made on, the response, and the
/// retrieval its stream showed (so a cached answer streams the same events).
type Entry = (u64, QueryResponse, Option<SearchResponse>);

/// Greedy answers by request (its resolved options) and the index revision they were made
/// on. quick_cache's S3-FIFO eviction: a key seen once goes first, repeated questions stay.
pub(crate) struct AnswerCache(Option<quick_cache::sync::Cache<String, Entry>>);

impl AnswerCache {
    pub(crate) fn new(capacity: usize) -> Self {
        AnswerCache((capacity > 0).then(|| quick_cache::sync::Cache::new(capacity)))
    }

    pub(crate) fn get(
        &self,
        key: &str,
        version: u64,
    ) -> Option<(QueryResponse, Option<SearchResponse>)> {
        self.0
            .as_ref()?
            .get(key)
            .filter(|(v, _, _)| *v == version)
            .map(|(_, r, s)| (r, s))
    }

    pub(crate) fn put(
        &self,
        key: String,
        version: u64,
        response: QueryResponse,
        search: Option<SearchResponse>,
    ) {
        if let Some(cache) = &self.0 {
            cache.insert(key, (version, response, search));
        }
    }
}
