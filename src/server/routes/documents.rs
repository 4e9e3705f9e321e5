//! Documents over HTTP: `POST /v1/documents` (multipart upload → an ingest job),
//! `GET /v1/jobs/{id}`, `DELETE /v1/documents/{id}`. Uploads go through the same
//! loader and [`Ingestor`] as `docent ingest`.

use std::path::Path;
use std::sync::Arc;

use actix_multipart::{Multipart, MultipartError};
use actix_web::http::StatusCode;
use actix_web::{web, HttpResponse};
use docent_ingest::load::{self, Document, SUPPORTED_EXTENSIONS};
use docent_ingest::pipeline::{Ingestor, Input, Outcome, Progress};
use docent_ingest::store::SearchFilter;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::json;

use crate::query::request;
use crate::server::error::ApiError;
use crate::server::jobs::{Jobs, Status};

/// Optional `metadata` field of an upload.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UploadMetadata {
    /// A title for every file of the upload (at most 1024 bytes), replacing the one the
    /// loader found.
    pub title: Option<String>,
    /// Tags given to every file of the upload; empty by default.
    #[serde(default)]
    pub tags: Vec<String>,
    /// The collection the files go into; their sources become `collection/file name`.
    pub collection: Option<String>,
}

/// What the document routes share: the ingest pipeline, the job registry and the upload
/// limits. Registered as app data.
pub struct Documents {
    /// The ingest pipeline (embedder and store) uploads go through.
    pub ingestor: Arc<Ingestor>,
    /// The ingest jobs started over HTTP.
    pub jobs: Jobs,
    /// Largest accepted file, bytes.
    pub max_file_bytes: usize,
    /// Lower limits for some file types (extension → bytes).
    pub type_limits: std::collections::BTreeMap<String, usize>,
    /// Ingest jobs running now (shutdown waits for them).
    pub running: std::sync::atomic::AtomicUsize,
}

impl Documents {
    /// The largest accepted file of this name's type.
    fn limit_for(&self, name: &str) -> usize {
        let ext = Path::new(name)
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .unwrap_or_default();
        self.type_limits
            .get(&ext)
            .map_or(self.max_file_bytes, |&l| l.min(self.max_file_bytes))
    }

    /// Waits until no ingest job runs, or `timeout` passes; true when none is left.
    pub async fn wait_idle(&self, timeout: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.running.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
}

/// Longest file name, in bytes.
const MAX_FILE_NAME_BYTES: usize = 255;

/// 422 unless `name` is a collection name.
pub fn check_collection(field: &str, name: &str) -> Result<(), ApiError> {
    if request::collection_name_ok(name) {
        Ok(())
    } else {
        Err(ApiError::invalid_field(
            field,
            format!(
                "{name:?} is not a collection name: {}",
                request::COLLECTION_RULE
            ),
        ))
    }
}

fn check_tag(tag: &str) -> Result<(), ApiError> {
    if request::tag_ok(tag) {
        Ok(())
    } else {
        Err(ApiError::invalid_field(
            "metadata.tags",
            format!(
                "{tag:?}: a tag is 1 to {} bytes without control characters",
                request::MAX_NAME_BYTES
            ),
        ))
    }
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::invalid_field("file", message)
}

fn unsupported(name: &str) -> ApiError {
    ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
        format!(
            "{name}: unsupported file type (supported: {})",
            SUPPORTED_EXTENSIONS.join(", ")
        ),
    )
}

fn multipart_error(e: MultipartError) -> ApiError {
    match e {
        MultipartError::ContentTypeMissing
        | MultipartError::ContentTypeParse
        | MultipartError::ContentTypeIncompatible => ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "send documents as multipart/form-data with one or more `file` fields",
        ),
        other => ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_multipart",
            other.to_string(),
        ),
    }
}

/// A store error as the HTTP error: 503 (the store failed or cannot be reached).
fn store_error(e: docent_ingest::store::Error) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "store_failed",
        e.to_string(),
    )
}

/// A file name from an upload, reduced to its last path component; none when nothing
/// usable is left, or it has control characters (NUL included) or is over 255 bytes.
fn file_name(raw: &str) -> Option<String> {
    let name = raw.rsplit(['/', '\\']).next()?.trim();
    let usable = !name.is_empty()
        && name != "."
        && name != ".."
        && name.len() <= MAX_FILE_NAME_BYTES
        && !name.chars().any(char::is_control);
    usable.then(|| name.to_string())
}

async fn read_field(
    field: &mut actix_multipart::Field,
    limit: usize,
    name: &str,
) -> Result<Vec<u8>, ApiError> {
    let mut buf = Vec::new();
    while let Some(chunk) = field.next().await {
        let chunk = chunk.map_err(multipart_error)?;
        if buf.len() + chunk.len() > limit {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                format!("{name}: larger than the {limit}-byte limit"),
            ));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf)
}

/// `POST /v1/documents`: parses every file first (a bad file fails the whole request and
/// nothing is stored), then embeds and stores them in a background job.
pub async fn upload(
    docs: web::Data<Documents>,
    mut payload: Multipart,
) -> Result<HttpResponse, ApiError> {
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    let mut meta = UploadMetadata::default();
    while let Some(field) = payload.next().await {
        let mut field = field.map_err(multipart_error)?;
        match field.name().unwrap_or("") {
            "file" => {
                let name = field
                    .content_disposition()
                    .and_then(|cd| cd.get_filename())
                    .and_then(file_name)
                    .ok_or_else(|| {
                        ApiError::invalid_field(
                            "file",
                            "every `file` field needs a file name: 1 to 255 bytes, no control characters, not `.` or `..`",
                        )
                    })?;
                if !load::is_supported(Path::new(&name)) {
                    return Err(unsupported(&name));
                }
                let bytes = read_field(&mut field, docs.limit_for(&name), &name).await?;
                files.push((name, bytes));
            }
            "metadata" => {
                let bytes = read_field(&mut field, 64 * 1024, "metadata").await?;
                meta = serde_json::from_slice(&bytes)
                    .map_err(|e| ApiError::invalid_field("metadata", format!("metadata: {e}")))?;
                if let Some(c) = &meta.collection {
                    check_collection("metadata.collection", c)?;
                }
                for t in &meta.tags {
                    check_tag(t)?;
                }
                if meta.title.as_ref().is_some_and(|t| t.len() > 1024) {
                    return Err(ApiError::invalid_field(
                        "metadata.title",
                        "a title is at most 1024 bytes",
                    ));
                }
            }
            other => {
                return Err(invalid(format!(
                    "unknown field {other:?}: send `file` (repeatable) and optionally `metadata`"
                )))
            }
        }
    }
    if files.is_empty() {
        return Err(invalid("no `file` field in the upload"));
    }
    let parsed: Vec<Document> = web::block(move || {
        files
            .into_iter()
            .map(|(name, bytes)| {
                let source = match &meta.collection {
                    Some(c) => format!("{c}/{name}"),
                    None => name.clone(),
                };
                let mut doc = load::load_bytes(Path::new(&name), &source, &bytes)?;
                if let Some(t) = &meta.title {
                    doc.title = t.clone();
                }
                doc.collection = meta.collection.clone();
                doc.tags = meta.tags.clone();
                Ok(doc)
            })
            .collect::<Result<Vec<_>, docent_ingest::Error>>()
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?
    .map_err(|e| match e {
        docent_ingest::Error::UnsupportedType { path, .. } => {
            unsupported(&path.display().to_string())
        }
        docent_ingest::Error::TooLarge { .. } => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            e.to_string(),
        ),
        other => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "unreadable_document",
            other.to_string(),
        ),
    })?;

    let listed: Vec<(String, String)> = parsed
        .iter()
        .map(|d| (d.id.clone(), d.source.clone()))
        .collect();
    let job_id = docs.jobs.create(&listed);
    let worker = docs.clone().into_inner();
    let job = job_id.clone();
    crate::metrics::metrics()
        .ingest_jobs
        .with_label_values(&["accepted"])
        .inc();
    docs.running
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    tokio::task::spawn_blocking(move || {
        run_job(&worker, &job, parsed);
        worker
            .running
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    });
    Ok(HttpResponse::Accepted().json(json!({
        "job_id": job_id,
        "documents": listed.iter().map(|(id, source)| json!({"id": id, "source": source})).collect::<Vec<_>>(),
    })))
}

fn run_job(docs: &Documents, job: &str, parsed: Vec<Document>) {
    /// Reports the pipeline's progress into the job registry.
    struct JobProgress<'a> {
        jobs: &'a Jobs,
        job: &'a str,
    }
    impl Progress for JobProgress<'_> {
        fn advance(&self, item: usize, chunks: usize, total: usize, _bytes: u64) {
            if total > 0 {
                self.jobs.update(self.job, item, |d| {
                    d.status = Status::Running;
                    d.chunks_total = total;
                    d.chunks_done += chunks;
                })
            }
        }
        fn done(&self, item: usize, _name: &str, result: &Result<Outcome, String>) {
            self.jobs.update(self.job, item, |d| match result {
                Ok(Outcome::Ingested { .. }) => d.status = Status::Done,
                Ok(Outcome::Unchanged { .. }) => d.status = Status::Unchanged,
                Ok(Outcome::Deduplicated { .. }) => d.status = Status::Deduplicated,
                Err(e) => {
                    d.status = Status::Failed;
                    d.error = Some(e.clone());
                }
            });
        }
    }
    if !parsed.is_empty() {
        docs.jobs.update(job, 0, |d| d.status = Status::Running);
    }
    let inputs = parsed.into_iter().map(Input::Document).collect();
    let results = docs.ingestor.ingest(
        inputs,
        &JobProgress {
            jobs: &docs.jobs,
            job,
        },
    );
    let m = crate::metrics::metrics();
    let failed = results.iter().any(Result::is_err);
    for r in &results {
        if let Ok(Outcome::Ingested { chunks, .. }) = r {
            m.ingest_chunks.inc_by(*chunks as u64);
        }
    }
    m.ingest_jobs
        .with_label_values(&[if failed { "failed" } else { "done" }])
        .inc();
}

/// Query string of `GET /v1/documents`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// Only documents in this collection.
    pub collection: Option<String>,
    /// Only documents with this tag.
    pub tag: Option<String>,
    /// `ready`, `ingesting` or `failed`.
    pub status: Option<String>,
    /// Page size (1..=1000, default 100).
    pub limit: Option<usize>,
    /// The `next` value of the previous page.
    pub after: Option<String>,
}

fn job_entry(d: &crate::server::jobs::JobDocument) -> serde_json::Value {
    json!({
        "id": d.id, "source": d.source,
        "status": if d.status == Status::Failed { "failed" } else { "ingesting" },
        "chunks": d.chunks_done, "error": d.error,
    })
}

/// `GET /v1/documents`: stored documents sorted by id, paginated with `after`/`next`; on
/// the first page also the documents that are being ingested or failed.
pub async fn list(
    docs: web::Data<Documents>,
    query: web::Query<ListQuery>,
) -> Result<HttpResponse, ApiError> {
    let q = query.into_inner();
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::invalid_field(
            "limit",
            format!("limit must be between 1 and 1000, got {limit}"),
        ));
    }
    let status = q.status.as_deref();
    if !matches!(status, None | Some("ready" | "ingesting" | "failed")) {
        return Err(ApiError::invalid_field(
            "status",
            "status must be ready, ingesting or failed",
        ));
    }
    if let Some(c) = &q.collection {
        check_collection("collection", c)?;
    }
    if let Some(t) = &q.tag {
        check_tag(t)?;
    }
    let mut out: Vec<serde_json::Value> = Vec::new();
    if q.after.is_none() && status != Some("ready") {
        out.extend(
            docs.jobs
                .unfinished_or_failed()
                .iter()
                .map(job_entry)
                .filter(|e| status.is_none_or(|s| e["status"] == s)),
        );
        if status != Some("ingesting") {
            let failed = docs.ingestor.store().failed().await.map_err(store_error)?;
            out.extend(failed.into_iter().map(|v| {
                json!({"id": v.document_id, "source": v.source, "status": "failed", "chunks": 0,
                       "error": "interrupted: the process stopped while ingesting it; ingest it again"})
            }));
        }
    }
    let mut next = None;
    if matches!(status, None | Some("ready")) {
        let only = SearchFilter {
            collection: q.collection.clone(),
            tags: q.tag.clone().into_iter().collect(),
            document_ids: vec![],
        };
        let (page, more) = docs
            .ingestor
            .store()
            .documents(&only, q.after.as_deref(), limit)
            .await
            .map_err(store_error)?;
        if more {
            next = page.last().map(|d| d.id.clone());
        }
        out.extend(page.into_iter().map(|d| {
            let mut v = json!(d);
            v["status"] = json!("ready");
            v
        }));
    }
    Ok(HttpResponse::Ok().json(json!({"documents": out, "next": next})))
}

/// `GET /v1/documents/{id}`.
pub async fn get(
    docs: web::Data<Documents>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let id = id.into_inner();
    if let Some(d) = docs
        .jobs
        .unfinished_or_failed()
        .iter()
        .find(|d| d.id == id && d.status != Status::Failed)
    {
        return Ok(HttpResponse::Ok().json(job_entry(d)));
    }
    let found = docs
        .ingestor
        .store()
        .document(&id)
        .await
        .map_err(store_error)?;
    match found {
        Some(d) => {
            let mut v = json!(d);
            v["status"] = json!("ready");
            Ok(HttpResponse::Ok().json(v))
        }
        None => match docs.jobs.unfinished_or_failed().iter().find(|d| d.id == id) {
            Some(d) => Ok(HttpResponse::Ok().json(job_entry(d))),
            None => Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("no document {id}"),
            )),
        },
    }
}

/// `GET /v1/jobs/{id}`.
pub async fn job(
    docs: web::Data<Documents>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    docs.jobs
        .get(&id)
        .map(|j| HttpResponse::Ok().json(j))
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no job {id}")))
}

/// `DELETE /v1/documents/{id}`: removes every chunk of the document.
pub async fn delete(
    docs: web::Data<Documents>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let id = id.into_inner();
    if docs.jobs.in_progress(&id) {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            format!("document {id} is being ingested; retry when its job is done"),
        ));
    }
    let store = docs.ingestor.store();
    let removed = store.chunk_count(&id).await.map_err(store_error)?;
    if removed > 0 {
        store.delete_document(&id).await.map_err(store_error)?;
        store.flush().await.map_err(store_error)?;
    }
    if removed == 0 {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no document {id}"),
        ));
    }
    Ok(HttpResponse::Ok().json(json!({"id": id, "deleted_chunks": removed})))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_lose_their_directories() {
        assert_eq!(file_name("../../etc/passwd").as_deref(), Some("passwd"));
        assert_eq!(file_name("C:\\docs\\a.md").as_deref(), Some("a.md"));
        assert_eq!(file_name(".."), None);
        assert_eq!(file_name(""), None);
        assert_eq!(file_name("a\0b.md"), None);
        assert_eq!(file_name("a\u{7}b.md"), None);
        assert_eq!(file_name(&"x".repeat(256)), None);
        assert_eq!(file_name(&"x".repeat(255)).map(|n| n.len()), Some(255));
    }
}
