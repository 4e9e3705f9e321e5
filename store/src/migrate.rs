//! Copying an index between engines (`docent migrate`): every point with its vectors and
//! payload, then the catalog entries that describe the index.
//!
//! Resumable: after each batch the position reached is saved in the target's catalog, and
//! a later run with the same source continues from there. Points keep their ids, so a
//! batch copied twice (an interruption between the write and the saved position) is
//! simply written again.

use serde_json::json;

use crate::index::VectorIndex;
use crate::store::{EPOCH, MIGRATING};
use crate::{Error, Result};

/// What a copy did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Copied {
    /// Points written by this run.
    pub points: usize,
    /// Whether it continued an interrupted run.
    pub resumed: bool,
    /// Points in the target afterwards (equal to the source's when complete).
    pub target_points: usize,
}

/// Progress: points copied so far (this run and earlier ones) out of the source's total.
pub trait Progress: Send + Sync {
    /// The copy begins: `total` points in the source, `already` in the target.
    fn start(&self, _total: usize, _already: usize) {}
    /// `points` more were copied.
    fn advance(&self, _points: usize) {}
}

impl Progress for () {}

/// Copies every point of `from` into `to`, `batch` points at a time, then the index's
/// identity and failed versions. Refuses when the two were built with different
/// embedding models, and while `from` has unfinished writes (stop the writers first).
pub async fn copy(
    from: &dyn VectorIndex,
    to: &dyn VectorIndex,
    batch: usize,
    progress: &dyn Progress,
) -> Result<Copied> {
    let identity = from.catalog_get("meta", "identity").await?;
    if let (Some(a), Some(b)) = (&identity, to.catalog_get("meta", "identity").await?) {
        if *a != b {
            return Err(Error::Incompatible(format!(
                "the target ({}) holds an index built with another embedding model or format: {b}; the source has {a}",
                to.describe()
            )));
        }
    }
    let unfinished = from.catalog_list("journal").await?.len();
    if unfinished > 0 {
        return Err(Error::Incompatible(format!(
            "the source ({}) has {unfinished} unfinished write(s): stop the processes writing to it (or open it once with docent to roll them back), then migrate",
            from.describe()
        )));
    }
    let cursor_name = crate::store::hash_name(&[&from.describe()]);
    let saved = to.catalog_get("migrate", &cursor_name).await?;
    let resumed = saved.is_some();
    let mut offset = saved.as_ref().and_then(|v| v["next"].as_u64());
    let mut done = saved
        .as_ref()
        .and_then(|v| v["copied"].as_u64())
        .unwrap_or(0) as usize;
    let total = from.count(&crate::Filter::default()).await?;
    progress.start(total, done);
    // the identity first: a target that is interrupted is still recognisably this index
    if let Some(id) = &identity {
        to.catalog_put("meta", "identity", id.clone()).await?;
    }
    // searches of the target fail as unavailable until the copy is complete: no reader
    // sees part of a document (or of the index)
    to.catalog_put("hidden", MIGRATING, json!({})).await?;
    let mut points_written = 0;
    if !(resumed && offset.is_none()) {
        loop {
            let (points, next) = from.scroll_points(batch.max(1), offset).await?;
            let n = points.len();
            to.upsert(points).await?;
            points_written += n;
            done += n;
            progress.advance(n);
            to.catalog_put(
                "migrate",
                &cursor_name,
                json!({ "next": next, "copied": done }),
            )
            .await?;
            match next {
                Some(n) => offset = Some(n),
                None => break,
            }
        }
    }
    for (name, value) in from.catalog_list("failed").await? {
        to.catalog_put("failed", &name, value).await?;
    }
    to.flush().await?;
    to.catalog_delete("hidden", MIGRATING).await?;
    to.catalog_put("meta", EPOCH, json!(cursor_name)).await?;
    // readers of the target (and their answer caches) see a new revision
    to.catalog_put("meta", "revision", json!(cursor_name))
        .await?;
    to.catalog_delete("migrate", &cursor_name).await?;
    let target_points = to.count(&crate::Filter::default()).await?;
    Ok(Copied {
        points: points_written,
        resumed,
        target_points,
    })
}
