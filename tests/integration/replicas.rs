//! Replicas (issue 31): two `docent serve` processes on one Qdrant server collection. One
//! ingests while both answer; then it is killed with SIGKILL in the middle of an ingest, and
//! the other rolls the half-written document back once it has been silent for
//! `store.stale_after_s`. No search, in either process, may ever see a half-written
//! document or two versions of one; no acknowledged document may be lost.
//!
//! Needs a Qdrant server: `QDRANT_URL` (its gRPC URL, e.g. `http://127.0.0.1:6334`). Without
//! it the test prints a SKIP line and passes (CI has no server unless `.ci/run` finds one).

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::helpers::{
    client, config, docent_cmd, drop_server_collection, get_json, listening_port, post_json,
    qdrant_url, rust_book, unique_collection,
};

/// Seconds a silent ingest may go untouched before the other replica rolls it back (a
/// live writer touches its entry every quarter of it and stops on its own after half:
/// long enough for one batch on a loaded machine).
const STALE_AFTER_S: u64 = 12;

struct Replica {
    child: Child,
    base: String,
    _dir: tempfile::TempDir,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(url: &str, collection: &str) -> Replica {
    let dir = tempfile::tempdir().unwrap();
    let mut child = docent_cmd(&dir.path().join("data"))
        .env("DOCENT_STORE__KIND", "qdrant")
        .env("DOCENT_STORE__URL", url)
        .env("DOCENT_STORE__COLLECTION", collection)
        .env("DOCENT_STORE__STALE_AFTER_S", STALE_AFTER_S.to_string())
        .args(["serve", "--bind", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.path().join("stderr.log")).unwrap())
        .spawn()
        .unwrap();
    let port = listening_port(child.stdout.take().unwrap());
    Replica {
        child,
        base: format!("http://127.0.0.1:{port}"),
        _dir: dir,
    }
}

/// Six paragraphs about zebras, each long enough to be a chunk of its own, all naming the
/// version: a search for zebras finds every chunk of the version that is shown.
fn zebra_notes(version: usize) -> String {
    let mut text = format!("# Zebra field notes, version {version}\n\n");
    for p in 0..6 {
        text.push_str(&format!(
            "Observation {p} of version {version}: zebra stripes confuse biting flies, and \
             the herd of plains zebras moved to the river at dawn while the foals stayed \
             close to their mothers. The stripes of each zebra are unique, like a \
             fingerprint, and researchers photograph the flanks to tell the animals apart \
             across seasons. The version of these notes is {version}; paragraph {p}.\n\n"
        ));
    }
    text
}

async fn upload(c: &reqwest::Client, base: &str, name: &str, body: String) -> (String, String) {
    let form = reqwest::multipart::Form::new()
        .part(
            "file",
            reqwest::multipart::Part::bytes(body.into_bytes()).file_name(name.to_string()),
        )
        .text("metadata", r#"{"collection": "field"}"#);
    let res = c
        .post(format!("{base}/v1/documents"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 202);
    let body: Value = res.json().await.unwrap();
    (
        body["job_id"].as_str().unwrap().to_string(),
        body["documents"][0]["id"].as_str().unwrap().to_string(),
    )
}

async fn job(c: &reqwest::Client, base: &str, id: &str) -> Value {
    get_json(c, &format!("{base}/v1/jobs/{id}")).await
}

async fn wait_done(c: &reqwest::Client, base: &str, id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let j = job(c, base, id).await;
        if j["status"] == "done" || j["status"] == "failed" || Instant::now() > deadline {
            return j;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the job has written batches of its document (hidden), and a little more.
async fn wait_written(c: &reqwest::Client, base: &str, job_id: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let j = job(c, base, job_id).await;
        assert_ne!(j["status"], "done", "ingested before the interruption: {j}");
        assert_ne!(j["status"], "failed", "{j}");
        if j["documents"][0]["chunks_done"].as_u64().unwrap_or(0) > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the ingest never started: {j}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // the count moves when a batch is embedded; its write follows
    tokio::time::sleep(Duration::from_millis(1500)).await;
}

/// Sends SIGSTOP, SIGCONT, … to a child process.
fn signal(child: &Child, name: &str) {
    let sent = std::process::Command::new("kill")
        .args([format!("-{name}"), child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success(), "kill -{name}");
}

/// What readers saw: for each response, the document ids of the zebra notes it held and
/// how many chunks of each; and every document id seen at all.
#[derive(Default)]
struct Seen {
    zebra: Vec<BTreeMap<String, usize>>,
    ids: BTreeSet<String>,
    searches: usize,
}

/// Searches `base` for zebras and for the book until `stop`, recording what it saw.
/// `may_die`: the replica is the writer, which is killed.
async fn read_until(base: String, may_die: bool, stop: Arc<AtomicBool>, seen: Arc<Mutex<Seen>>) {
    let c = client();
    while !stop.load(Ordering::SeqCst) {
        for question in [
            "zebra stripes field notes",
            "ownership borrowing references",
        ] {
            let res = c
                .post(format!("{base}/v1/search"))
                .json(&json!({"question": question, "retrieval": {"top_k": 20}}))
                .send()
                .await;
            let res = match res {
                Ok(res) if res.status() == 200 => res,
                // the replica is gone (killed) or busy
                _ => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let body = match res.json::<Value>().await {
                Ok(body) => body,
                // the writer, killed while it answers, cuts the body short
                Err(_) if may_die => continue,
                Err(e) => panic!("{base}: a cut answer from the replica that lives: {e}"),
            };
            let mut zebra = BTreeMap::new();
            let mut seen = seen.lock().unwrap();
            for hit in body["hits"].as_array().unwrap() {
                let id = hit["document_id"].as_str().unwrap().to_string();
                if hit["source"].as_str().unwrap().ends_with("notes.md") {
                    *zebra.entry(id.clone()).or_insert(0) += 1;
                }
                seen.ids.insert(id);
            }
            if question.starts_with("zebra") {
                seen.zebra.push(zebra);
            }
            seen.searches += 1;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_one_killed_mid_ingest_never_show_a_mixed_or_half_document() {
    let Some(url) = qdrant_url("replicas") else {
        return;
    };
    let collection = unique_collection("docent_replicas");
    let mut writer = start(&url, &collection);
    let other = start(&url, &collection);
    let c = client();

    // Phase 1: the writer replaces the notes five times while both replicas search.
    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let readers: Vec<_> = [(writer.base.clone(), true), (other.base.clone(), false)]
        .into_iter()
        .map(|(base, may_die)| tokio::spawn(read_until(base, may_die, stop.clone(), seen.clone())))
        .collect();
    let mut versions = BTreeMap::new(); // document id → chunks
    for v in 1..=5 {
        let (job_id, doc) = upload(&c, &writer.base, "notes.md", zebra_notes(v)).await;
        let j = wait_done(&c, &writer.base, &job_id).await;
        assert_eq!(j["status"], "done", "{j}");
        versions.insert(doc, j["chunks_total"].as_u64().unwrap() as usize);
    }
    let acknowledged = versions.keys().last().unwrap().clone();

    // This process's own view of the collection, to watch the catalog.
    let scratch = tempfile::tempdir().unwrap();
    let mut c_config = config(scratch.path());
    c_config.store.kind = docent::config::StoreKind::Qdrant;
    c_config.store.url = Some(url.clone());
    c_config.store.collection = collection.clone();
    let index = tokio::task::spawn_blocking(move || {
        docent::server::startup::open_index_blocking(&c_config).unwrap()
    })
    .await
    .unwrap();
    let store = index.store.clone();
    let book: String = walk_markdown(&rust_book(""))
        .into_iter()
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect();

    // Phase 2: the writer is stopped (SIGSTOP) in the middle of a large ingest for longer
    // than the stale time. The other replica rolls it back; woken up (SIGCONT), the writer
    // finds its write taken over and fails the job. Nothing of it is ever shown.
    let (job_id, big) = upload(&c, &writer.base, "book.md", book.clone()).await;
    wait_written(&c, &writer.base, &job_id).await;
    signal(&writer.child, "STOP");
    let stopped_at = Instant::now();
    // the writer's last touch of its journal entry (before it was stopped): the stale time
    // runs from there, not from the stop
    let mut last_touch = 0u64;
    loop {
        let journal = store.index().catalog_list("journal").await.unwrap();
        if journal
            .iter()
            .any(|(_, v)| v["entry"]["rolled_back"]["version"]["document_id"] == big.as_str())
        {
            break;
        }
        for (_, v) in &journal {
            if v.to_string().contains(big.as_str()) {
                last_touch = last_touch.max(v["updated_ms"].as_u64().unwrap_or(0));
            }
        }
        assert!(
            stopped_at.elapsed() < Duration::from_secs(60),
            "the stopped writer's ingest was not taken over: {journal:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let taken_over = stopped_at.elapsed();
    let since_touch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
        - last_touch;
    assert_eq!(store.chunk_count(&big).await.unwrap(), 0);
    signal(&writer.child, "CONT");
    // a fresh client: the writer closes the connections that idled past its keep-alive
    // while it was stopped, and a pooled one may be reused just as it closes it
    let c = client();
    let j = wait_done(&c, &writer.base, &job_id).await;
    assert_eq!(j["status"], "failed", "{j}");
    eprintln!(
        "stopped mid-ingest: taken over by the other replica {:.1} s after the stop ({:.1} s after the writer's last touch); woken up, the writer failed the job: {}",
        taken_over.as_secs_f64(),
        since_touch as f64 / 1e3,
        j["documents"][0]["error"]
    );
    assert!(last_touch > 0, "the writer's journal entry was never seen");
    assert!(
        since_touch >= STALE_AFTER_S * 1000,
        "taken over {since_touch} ms after the writer's last touch, before it was stale"
    );

    // Phase 3: the same ingest again, and the writer killed (SIGKILL) in the middle of it.
    let (job_id, again) = upload(&c, &writer.base, "book.md", book).await;
    assert_eq!(again, big, "the same content is the same document");
    wait_written(&c, &writer.base, &job_id).await;
    writer.child.kill().unwrap();
    writer.child.wait().unwrap();
    let killed_at = Instant::now();
    // the other replica rolls it back once it is stale, and removes what is left once the
    // rollback itself is stale; meanwhile it keeps answering
    let rolled_back = loop {
        let journal = store.index().catalog_list("journal").await.unwrap();
        let chunks = store.chunk_count(&big).await.unwrap();
        if journal.is_empty() && chunks == 0 {
            break killed_at.elapsed();
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(120),
            "not rolled back after 120 s: {journal:?}, {chunks} chunks"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!(
        "killed mid-ingest; rolled back and cleaned up by the other replica after {:.1} s",
        rolled_back.as_secs_f64()
    );
    stop.store(true, Ordering::SeqCst);
    for r in readers {
        r.await.unwrap();
    }

    // what the readers saw: every zebra response shows exactly one whole version; the
    // half-written book never
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    assert!(seen.searches > 20, "only {} searches ran", seen.searches);
    for (n, zebra) in seen.zebra.iter().enumerate() {
        assert!(zebra.len() <= 1, "search {n} mixed versions: {zebra:?}");
        for (id, count) in zebra {
            assert_eq!(
                Some(count),
                versions.get(id),
                "search {n} saw part of version {id}"
            );
        }
    }
    assert!(
        !seen.ids.contains(&big),
        "a search saw the half-written book"
    );
    eprintln!(
        "{} searches over both replicas, {} of them for the notes: none mixed or partial",
        seen.searches,
        seen.zebra.len()
    );

    // nothing acknowledged was lost: the last version is shown whole by the survivor
    let body = post_json(
        &c,
        &format!("{}/v1/search", other.base),
        &json!({"question": "zebra stripes field notes", "retrieval": {"top_k": 20}}),
    )
    .await;
    let ids: Vec<_> = body["hits"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|h| h["source"].as_str().unwrap().ends_with("notes.md"))
        .map(|h| h["document_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), versions[&acknowledged], "{body}");
    assert!(ids.iter().all(|id| *id == acknowledged), "{body}");
    assert_eq!(store.chunk_count(&big).await.unwrap(), 0);
    drop(other);
    drop(index);
    drop_server_collection(&url, &collection).await;
}

/// Every `.md` file under `dir`, in name order.
fn walk_markdown(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            out.extend(walk_markdown(&p));
        } else if p.extension().is_some_and(|e| e == "md") {
            out.push(p);
        }
    }
    out
}
