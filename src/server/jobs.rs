//! Ingest jobs started over HTTP: what each one is doing, for `GET /v1/jobs/{id}`.
//! Kept in memory; a restart forgets finished jobs (the documents stay in the index), and
//! only the latest [`KEPT_FINISHED`] finished jobs are kept, so that a long-running server's
//! memory does not grow with every upload.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use serde::Serialize;

/// Where a job or one of its documents stands; serialized in lowercase (`"queued"`…).
/// A job is only ever `queued`, `running`, `done` or `failed`; the other values are
/// per-document outcomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Accepted, not started yet.
    Queued,
    /// Being embedded and stored.
    Running,
    /// Stored (for a job: every document finished and none failed).
    Done,
    /// This exact content was already stored under this source; nothing was written.
    Unchanged,
    /// The content was already stored under another source; this one was added to it.
    Deduplicated,
    /// Ingest failed (for a job: at least one document failed); see the document's `error`.
    Failed,
}

/// One document of an ingest job and its progress.
#[derive(Debug, Clone, Serialize)]
pub struct JobDocument {
    /// The document's id: the hex SHA-256 of its text.
    pub id: String,
    /// The document's source name (`collection/file name` when uploaded into a collection).
    pub source: String,
    /// Where this document stands.
    pub status: Status,
    /// Chunks embedded and stored so far.
    pub chunks_done: usize,
    /// Chunks the document was split into; 0 until embedding starts.
    pub chunks_total: usize,
    /// Why ingest failed, when it did; omitted otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// An ingest job as `GET /v1/jobs/{id}` returns it; its status and chunk counts are
/// derived from its documents.
#[derive(Debug, Clone, Serialize)]
pub struct Job {
    /// The job's id: a random UUID as 32 hex digits, no hyphens.
    pub job_id: String,
    /// `queued` until a document starts, `running`, then `done` or (when any document
    /// failed) `failed`.
    pub status: Status,
    /// Chunks stored so far, summed over the documents.
    pub chunks_done: usize,
    /// Chunks to store, summed over the documents that have started.
    pub chunks_total: usize,
    /// The job's documents, in upload order.
    pub documents: Vec<JobDocument>,
}

impl Job {
    fn finished(&self) -> bool {
        matches!(self.status, Status::Done | Status::Failed)
    }
}

/// Finished jobs kept for `GET /v1/jobs/{id}`; older ones are forgotten (404).
pub const KEPT_FINISHED: usize = 10_000;

#[derive(Default)]
struct Table {
    jobs: HashMap<String, Job>,
    /// Finished jobs, oldest first.
    finished: VecDeque<String>,
}

/// The in-memory registry of ingest jobs, shared by the document routes and their
/// background workers. Thread-safe; by default it keeps [`KEPT_FINISHED`] finished jobs.
pub struct Jobs {
    table: Mutex<Table>,
    keep: usize,
}

impl Default for Jobs {
    fn default() -> Self {
        Jobs::keeping(KEPT_FINISHED)
    }
}

/// A job id: a random (v4) UUID.
fn new_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

impl Jobs {
    /// A table that keeps the latest `keep` finished jobs.
    pub fn keeping(keep: usize) -> Self {
        Jobs {
            table: Mutex::default(),
            keep,
        }
    }

    /// Registers a queued job for documents `(id, source)` and returns the job's id.
    pub fn create(&self, documents: &[(String, String)]) -> String {
        let id = new_id();
        let job = Job {
            job_id: id.clone(),
            status: Status::Queued,
            chunks_done: 0,
            chunks_total: 0,
            documents: documents
                .iter()
                .map(|(id, source)| JobDocument {
                    id: id.clone(),
                    source: source.clone(),
                    status: Status::Queued,
                    chunks_done: 0,
                    chunks_total: 0,
                    error: None,
                })
                .collect(),
        };
        self.lock().jobs.insert(id.clone(), job);
        id
    }

    /// A copy of job `id`, or `None` when it is unknown or was forgotten.
    pub fn get(&self, id: &str) -> Option<Job> {
        self.lock().jobs.get(id).cloned()
    }

    /// Applies `f` to document `doc` of job `id` and recomputes the job's totals.
    pub fn update(&self, id: &str, doc: usize, f: impl FnOnce(&mut JobDocument)) {
        let mut table = self.lock();
        let Some(job) = table.jobs.get_mut(id) else {
            return;
        };
        let was_finished = job.finished();
        if let Some(d) = job.documents.get_mut(doc) {
            f(d);
        }
        job.chunks_done = job.documents.iter().map(|d| d.chunks_done).sum();
        job.chunks_total = job.documents.iter().map(|d| d.chunks_total).sum();
        let all = |s: &[Status]| job.documents.iter().all(|d| s.contains(&d.status));
        job.status = if all(&[Status::Queued]) {
            Status::Queued
        } else if all(&[
            Status::Done,
            Status::Unchanged,
            Status::Deduplicated,
            Status::Failed,
        ]) {
            if job.documents.iter().any(|d| d.status == Status::Failed) {
                Status::Failed
            } else {
                Status::Done
            }
        } else {
            Status::Running
        };
        if job.finished() && !was_finished {
            table.finished.push_back(id.to_string());
            while table.finished.len() > self.keep {
                if let Some(old) = table.finished.pop_front() {
                    table.jobs.remove(&old);
                }
            }
        }
    }

    /// Whether any unfinished job holds document `id`.
    pub fn in_progress(&self, id: &str) -> bool {
        self.lock().jobs.values().any(|j| {
            j.documents
                .iter()
                .any(|d| d.id == id && matches!(d.status, Status::Queued | Status::Running))
        })
    }

    /// Documents of all jobs that are queued, running or failed (the latest entry per id).
    pub fn unfinished_or_failed(&self) -> Vec<JobDocument> {
        let table = self.lock();
        let mut out: Vec<JobDocument> = Vec::new();
        for d in table.jobs.values().flat_map(|j| j.documents.iter()) {
            if matches!(d.status, Status::Queued | Status::Running | Status::Failed) {
                out.retain(|o| o.id != d.id);
                out.push(d.clone());
            }
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_status_follows_its_documents() {
        let jobs = Jobs::default();
        let id = jobs.create(&[("a".into(), "x".into()), ("b".into(), "y".into())]);
        assert_eq!(jobs.get(&id).unwrap().status, Status::Queued);
        assert!(jobs.in_progress("a"));
        jobs.update(&id, 0, |d| {
            d.status = Status::Running;
            d.chunks_total = 4;
            d.chunks_done = 2;
        });
        let j = jobs.get(&id).unwrap();
        assert_eq!(
            (j.status, j.chunks_done, j.chunks_total),
            (Status::Running, 2, 4)
        );
        jobs.update(&id, 0, |d| d.status = Status::Done);
        jobs.update(&id, 1, |d| {
            d.status = Status::Failed;
            d.error = Some("boom".into())
        });
        assert_eq!(jobs.get(&id).unwrap().status, Status::Failed);
        assert!(!jobs.in_progress("a"));
        assert!(jobs.get("nope").is_none());
    }

    #[test]
    fn only_the_latest_finished_jobs_are_kept() {
        let jobs = Jobs::keeping(2);
        let ids: Vec<String> = (0..4)
            .map(|i| jobs.create(&[(format!("d{i}"), "s".into())]))
            .collect();
        jobs.update(&ids[3], 0, |d| d.status = Status::Running);
        for id in &ids[..3] {
            jobs.update(id, 0, |d| d.status = Status::Done);
        }
        // the oldest finished job is forgotten; the running one is never dropped
        assert!(jobs.get(&ids[0]).is_none());
        assert!(jobs.get(&ids[1]).is_some() && jobs.get(&ids[2]).is_some());
        assert_eq!(jobs.get(&ids[3]).unwrap().status, Status::Running);
        // a finished job updated again is not counted twice
        jobs.update(&ids[2], 0, |d| d.chunks_done = 1);
        assert!(jobs.get(&ids[1]).is_some());
        jobs.update(&ids[3], 0, |d| d.status = Status::Failed);
        assert!(jobs.get(&ids[1]).is_none() && jobs.get(&ids[3]).is_some());
    }
}
