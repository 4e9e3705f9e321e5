//! `[store]`: which engine holds the index (embedded or a Qdrant server) and where.

use super::*;

/// Which engine holds the index.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// Qdrant's embedded engine in `data_dir` (one process opens it at a time).
    #[default]
    Edge,
    /// A Qdrant server or cluster (any number of docent replicas share it).
    Qdrant,
}

/// `[store]`: where chunks and the document catalog live.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// Which engine: `edge` (embedded, the default) or `qdrant`.
    pub kind: StoreKind,
    /// The server's gRPC URL (`kind = "qdrant"`): `http://host:6334`, or `https://` for TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Sent as the `api-key` header (`DOCENT_STORE__API_KEY`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    /// Collection of the chunks; the catalog is `<collection>_catalog`.
    pub collection: String,
    /// Per-request timeout against the server, seconds.
    pub timeout_s: u64,
    /// On a shared store (`kind = "qdrant"`): an ingest whose writer has not written for
    /// this long is taken for a dead replica's and rolled back by the others, which look
    /// every quarter of it (at most every minute). Longer than the slowest batch write.
    pub stale_after_s: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            kind: StoreKind::Edge,
            url: None,
            api_key: None,
            collection: "docent".into(),
            timeout_s: 10,
            stale_after_s: docent_ingest::store::STALE_AFTER_SECS,
        }
    }
}

impl StoreConfig {
    /// How long an unfinished write on a shared store may go untouched.
    pub fn stale_after(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.stale_after_s)
    }

    /// The index's location under this configuration (`data_dir` for the embedded one).
    pub fn location<'a>(&self, data_dir: &'a Path) -> docent_ingest::store::Location<'a> {
        match self.kind {
            StoreKind::Edge => docent_ingest::store::Location::Edge { dir: data_dir },
            StoreKind::Qdrant => docent_ingest::store::Location::Qdrant(
                docent_ingest::store::qdrant::QdrantOptions {
                    url: self.url.clone().unwrap_or_default(),
                    api_key: self.api_key.clone().filter(|k| !k.is_empty()),
                    collection: self.collection.clone(),
                    timeout: std::time::Duration::from_secs(self.timeout_s.max(1)),
                },
            ),
        }
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field, message: String| Err(ConfigError::Invalid { field, message });
        if self.kind == StoreKind::Qdrant {
            let url = self.url.as_deref().unwrap_or("");
            if url.is_empty() {
                return invalid(
                    "store.url",
                    "is required with store.kind = \"qdrant\": the server's gRPC URL, e.g. http://localhost:6334 (DOCENT_STORE__URL)".into(),
                );
            }
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return invalid(
                    "store.url",
                    format!("must start with http:// or https:// (TLS), got {url:?}"),
                );
            }
            if url.trim_end_matches('/').ends_with(":6333") {
                return invalid(
                    "store.url",
                    format!("{url} is Qdrant's REST port; docent speaks gRPC, usually port 6334"),
                );
            }
        } else if self.url.is_some() {
            return invalid(
                "store.url",
                "is set but store.kind is \"edge\" (the embedded engine in data_dir); set store.kind = \"qdrant\" to use the server".into(),
            );
        }
        let valid_name = !self.collection.is_empty()
            && self.collection.len() <= 200
            && self
                .collection
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !valid_name {
            return invalid(
                "store.collection",
                format!(
                    "must be 1-200 letters, digits, '_' or '-', got {:?}",
                    self.collection
                ),
            );
        }
        if self.timeout_s == 0 {
            return invalid("store.timeout_s", "must be at least 1".into());
        }
        if self.stale_after_s == 0 {
            return invalid(
                "store.stale_after_s",
                "must be at least 1 (seconds without a write before another replica rolls an ingest back)".into(),
            );
        }
        Ok(())
    }
}
