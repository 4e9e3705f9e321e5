//! `docent bench query`: retrieval (query embedding + hybrid search) through `POST
//! /v1/search` over HTTP: p50/p99 latency and throughput at several client counts and index
//! sizes, side by side in the same run with Python peer services doing the same job
//! (FastAPI + uvicorn, the same ONNX model through onnxruntime + tokenizers, and either
//! qdrant-edge-py, the Python binding of the same Qdrant engine version opening the very
//! same index files, or qdrant-client's local mode loaded with the same points).
//!
//! Indexes are built once per size from the corpus (files in the order given, sorted
//! within each directory, until the size is reached) through the real ingest pipeline and
//! cached; a later run reuses them. Each server runs as its own process, one at a time;
//! the load generator (one thread and one keep-alive connection per client) is the same
//! for both.
//!
//! With `[store] kind = "qdrant"` in the configuration (or `DOCENT_STORE__KIND=qdrant` and
//! `DOCENT_STORE__URL`), each embedded index is also copied to the server (collection
//! `<store.collection>_bench_<size>`, resumable like `docent migrate`) and docent is measured
//! a second time on it: the same questions, the same points, the server's round trips added.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use docent_ingest::load;
use docent_ingest::pipeline::{Input, PipelineConfig, Silent};
use docent_ingest::store::{block_on, FusionMethod};
use serde::{Deserialize, Serialize};

use super::http::Connection;
use super::Peer;
use docent::config::{Config, StoreConfig, StoreKind};
use docent::server::startup;

/// What to measure.
pub struct Options {
    /// The docent executable the server runs from.
    pub docent: PathBuf,
    /// Directories or files the indexes are built from, taken in this order.
    pub corpus: Vec<PathBuf>,
    /// Index sizes in chunks (each reached approximately: whole files are added).
    pub sizes: Vec<usize>,
    /// Concurrent client counts, one measurement each (one keep-alive connection per client).
    pub clients: Vec<usize>,
    /// Time each measurement runs before it starts recording.
    pub warmup: Duration,
    /// Time each measurement records, after the warm-up.
    pub duration: Duration,
    /// Chunks asked for per search.
    pub top_k: usize,
    /// BEIR `queries.jsonl`: the questions, cycled.
    pub queries: PathBuf,
    /// Where the indexes are kept between runs.
    pub cache: PathBuf,
    /// The Python peer service to measure beside docent, if any.
    pub peer: Option<Peer>,
    /// Questions whose top hit is compared between docent and the peer.
    pub compare: usize,
}

/// One cell of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Measurement {
    /// Which server answered: docent (on the embedded store or a Qdrant server) or a peer.
    pub server: String,
    /// Chunks in the index searched.
    pub chunks: usize,
    /// Concurrent clients.
    pub clients: usize,
    /// Requests that finished in the measured window.
    pub requests: usize,
    /// Length of the measured window in seconds (from the end of the warm-up to the last
    /// response).
    pub seconds: f64,
    /// Throughput: `requests / seconds`.
    pub requests_per_s: f64,
    /// Median latency in milliseconds (request written to response read).
    pub p50_ms: f64,
    /// 99th-percentile latency in milliseconds.
    pub p99_ms: f64,
    /// Mean latency in milliseconds.
    pub mean_ms: f64,
}

/// An index the measurements ran on.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct IndexInfo {
    /// The size asked for, in chunks.
    pub target: usize,
    /// Chunks the index holds (whole files are added, so near `target`).
    pub chunks: usize,
    /// Files ingested into it.
    pub files: usize,
    /// Total size of those files in bytes.
    pub bytes: u64,
    /// The corpus paths (canonicalized) it was built from, in order.
    pub corpus: Vec<PathBuf>,
    /// The chunking it was built with: (max tokens per chunk, overlap in tokens).
    pub chunking: (usize, usize),
    /// The embedding model directory it was built with.
    pub model_dir: PathBuf,
    /// Seconds it took to build (ingest + optimize), when it was built.
    pub build_seconds: f64,
}

/// The result of `docent bench query`: the settings, the indexes and every measurement.
/// Its `Display` prints a table per index and the goals.
#[derive(Debug, Serialize)]
pub struct QueryBench {
    /// Chunks asked for per search.
    pub top_k: usize,
    /// The retrieval mode searched with (always `hybrid`).
    pub mode: &'static str,
    /// The fusion method and candidate multiplier, as text.
    pub fusion: String,
    /// ONNX Runtime threads of the embedder (`embedding.threads`).
    pub threads: usize,
    /// Seconds of warm-up per measurement.
    pub warmup_s: f64,
    /// Seconds measured per measurement.
    pub duration_s: f64,
    /// The indexes measured, one per size.
    pub indexes: Vec<IndexInfo>,
    /// Every measurement: per index, server and client count.
    pub rows: Vec<Measurement>,
    /// Per index size and peer: (chunks, peer, questions compared, same top hit as docent).
    pub agreement: Vec<(usize, String, usize, usize)>,
}

const DOCENT: &str = "docent";
const DOCENT_SERVER: &str = "docent, qdrant server store";

/// One server measured over an index.
enum Target<'a> {
    /// docent on the embedded store (the index files themselves).
    Docent,
    /// docent on a Qdrant server, over a copy of the index.
    DocentServer(StoreConfig),
    /// The Python peer on one of its stores.
    Peer(&'a Peer, &'a str),
}

/// The peer's vector stores (`--store` of scripts/bench_query_peer.py) and their names.
const PEER_STORES: &[(&str, &str)] = &[
    ("edge", "python peer, qdrant-edge-py"),
    ("client", "python peer, qdrant-client local"),
];

/// Builds (or reuses) the indexes and runs every measurement.
pub fn run(config: &Config, opts: &Options) -> anyhow::Result<QueryBench> {
    anyhow::ensure!(!opts.sizes.is_empty(), "--sizes is empty");
    anyhow::ensure!(
        opts.clients.iter().all(|&c| c > 0),
        "--clients must be positive"
    );
    let questions = read_queries(&opts.queries)?;
    let bodies: Vec<Vec<u8>> = questions
        .iter()
        .map(|q| {
            serde_json::to_vec(&serde_json::json!({
                "question": q,
                "retrieval": {"top_k": opts.top_k, "mode": "hybrid"},
            }))
        })
        .collect::<Result<_, _>>()?;
    let mut report = QueryBench {
        top_k: opts.top_k,
        mode: "hybrid",
        fusion: format!(
            "{:?} over {}x candidates",
            config.retrieval.fusion.method, config.retrieval.fusion.candidates
        ),
        threads: config.embedding.threads,
        warmup_s: opts.warmup.as_secs_f64(),
        duration_s: opts.duration.as_secs_f64(),
        indexes: Vec::new(),
        rows: Vec::new(),
        agreement: Vec::new(),
    };
    for &size in &opts.sizes {
        let (dir, info) = index_for(config, opts, size)?;
        eprintln!(
            "bench: index of {} chunks ({} files) at {}",
            info.chunks,
            info.files,
            dir.display()
        );
        let mut servers = vec![(DOCENT, Target::Docent)];
        if config.store.kind == StoreKind::Qdrant {
            let store = copy_to_server(config, &dir, size)?;
            servers.push((DOCENT_SERVER, Target::DocentServer(store)));
        }
        if let Some(peer) = &opts.peer {
            servers.extend(
                PEER_STORES
                    .iter()
                    .map(|(store, name)| (*name, Target::Peer(peer, store))),
            );
        }
        let mut top_hits: Vec<(String, Vec<(String, u64)>)> = Vec::new();
        for (server, target) in servers {
            let child = match target {
                Target::Docent => start_docent(config, opts, &dir, &StoreConfig::default())?,
                Target::DocentServer(store) => start_docent(config, opts, &dir, &store)?,
                Target::Peer(peer, store) => start_peer(config, peer, store, &dir)?,
            };
            let top = top_hits_of(child.addr, &bodies[..opts.compare.min(bodies.len())])?;
            top_hits.push((server.to_string(), top));
            for &clients in &opts.clients {
                let m = measure(child.addr, &bodies, clients, opts.warmup, opts.duration)?;
                eprintln!(
                    "bench: {server:<34} {:>7} chunks {clients:>3} clients: p50 {:.2} ms, p99 {:.2} ms, {:.1} req/s",
                    info.chunks, m.p50, m.p99, m.per_s
                );
                report.rows.push(Measurement {
                    server: server.into(),
                    chunks: info.chunks,
                    clients,
                    requests: m.requests,
                    seconds: m.seconds,
                    requests_per_s: m.per_s,
                    p50_ms: m.p50,
                    p99_ms: m.p99,
                    mean_ms: m.mean,
                });
            }
            drop(child);
        }
        if let Some(((_, ours), peers)) = top_hits.split_first() {
            for (name, theirs) in peers {
                let same = ours.iter().zip(theirs).filter(|(x, y)| x == y).count();
                report
                    .agreement
                    .push((info.chunks, name.clone(), ours.len(), same));
            }
        }
        report.indexes.push(info);
    }
    Ok(report)
}

fn read_queries(path: &Path) -> anyhow::Result<Vec<String>> {
    let questions = crate::eval::questions(path)?;
    anyhow::ensure!(
        !questions.is_empty(),
        "{} holds no questions",
        path.display()
    );
    Ok(questions)
}

/// The cached index of about `size` chunks, built if missing or made differently.
fn index_for(config: &Config, opts: &Options, size: usize) -> anyhow::Result<(PathBuf, IndexInfo)> {
    let model = config
        .embedding
        .model_dir
        .file_name()
        .map_or("model".into(), |n| n.to_string_lossy().to_string());
    let chunking = (config.chunking.max_tokens, config.chunking.overlap);
    let dir = opts.cache.join(format!(
        "query-{size}-{}x{}-{model}",
        chunking.0, chunking.1
    ));
    let marker = dir.join("bench-index.json");
    let corpus: Vec<PathBuf> = opts
        .corpus
        .iter()
        .map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()))
        .collect();
    // A finished index is reused when it was built the same way from the start of this
    // corpus list (files are taken in order, so a longer list begins with the same files);
    // an unfinished one (no marker: interrupted, or the corpus was too small) is resumed:
    // its files are found unchanged and skipped.
    if let Ok(text) = std::fs::read_to_string(&marker) {
        let info = serde_json::from_str::<IndexInfo>(&text).ok();
        match info {
            Some(info)
                if corpus.starts_with(&info.corpus)
                    && info.target == size
                    && info.chunking == chunking
                    && info.model_dir == config.embedding.model_dir =>
            {
                return Ok((dir, info));
            }
            _ => std::fs::remove_dir_all(&dir)
                .with_context(|| format!("removing {}", dir.display()))?,
        }
    }
    let found = load::discover(&corpus)?;
    anyhow::ensure!(
        !found.files.is_empty(),
        "no supported files under {corpus:?}"
    );
    let mut config = config.clone();
    config.data_dir = dir.clone();
    // built embedded, where it is cached; a server store gets a copy (copy_to_server)
    config.store = StoreConfig::default();
    let index = startup::open_index_blocking(&config)?;
    let ingestor = startup::ingestor_with(
        &config,
        &index,
        PipelineConfig {
            optimize: false,
            ..config.ingest.pipeline()
        },
    )?;
    let started = Instant::now();
    let (mut files, mut bytes) = (0, 0u64);
    for batch in found.files.chunks(32) {
        let chunks = block_on(index.store.len())?;
        if chunks >= size {
            break;
        }
        eprintln!(
            "bench: building the {size}-chunk index: {chunks} chunks from {files} files, {:.0} s",
            started.elapsed().as_secs_f64()
        );
        let results = ingestor.ingest(batch.iter().cloned().map(Input::File).collect(), &Silent);
        for (f, r) in batch.iter().zip(results) {
            if r.is_ok() {
                files += 1;
                bytes += std::fs::metadata(f).map_or(0, |m| m.len());
            }
        }
    }
    eprintln!("bench: building the vector index (HNSW)");
    block_on(index.store.optimize())?;
    let chunks = block_on(index.store.len())?;
    anyhow::ensure!(
        chunks * 10 >= size * 9,
        "the corpus gives only {chunks} chunks, fewer than {size}: pass more --corpus directories or smaller --sizes"
    );
    let info = IndexInfo {
        target: size,
        chunks,
        files,
        bytes,
        corpus,
        chunking,
        model_dir: config.embedding.model_dir.clone(),
        build_seconds: started.elapsed().as_secs_f64(),
    };
    drop(ingestor);
    drop(index);
    std::fs::write(&marker, serde_json::to_vec_pretty(&info)?)?;
    Ok((dir, info))
}

/// A server process, killed when dropped.
pub(crate) struct Server {
    pub(crate) child: Child,
    pub(crate) addr: SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn free_addr() -> anyhow::Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// The embedded index in `dir` copied to the configured Qdrant server, in a collection of
/// its own per size; an earlier complete copy is kept, an interrupted one resumed.
fn copy_to_server(config: &Config, dir: &Path, size: usize) -> anyhow::Result<StoreConfig> {
    let store = StoreConfig {
        collection: format!("{}_bench_{size}", config.store.collection),
        ..config.store.clone()
    };
    let mut local = config.clone();
    local.data_dir = dir.to_path_buf();
    local.store = StoreConfig::default();
    let index = startup::open_index_blocking(&local)?;
    let location = store.location(dir);
    eprintln!(
        "bench: copying the index to {} (collection {})",
        store.url.as_deref().unwrap_or(""),
        store.collection
    );
    let copied = block_on(async {
        let target = docent_ingest::store::open_index(&location, index.embedder.dim()).await?;
        docent_ingest::store::migrate::copy(&**index.store.index(), &*target, 256, &()).await
    })
    .with_context(|| {
        format!(
            "copying the bench index to {} (collection {})",
            store.url.as_deref().unwrap_or(""),
            store.collection
        )
    })?;
    eprintln!(
        "bench: the server collection holds {} chunks ({} copied now)",
        copied.target_points, copied.points
    );
    Ok(store)
}

fn start_docent(
    config: &Config,
    opts: &Options,
    dir: &Path,
    store: &StoreConfig,
) -> anyhow::Result<Server> {
    let addr = free_addr()?;
    // the server runs on exactly this configuration (DOCENT_* variables are cleared so
    // they cannot override it differently than they did here)
    let mut config = config.clone();
    config.data_dir = dir.to_path_buf();
    config.store = StoreConfig {
        // the key goes through the environment, not into the file
        api_key: None,
        ..store.clone()
    };
    config.server.bind = addr.to_string();
    let file = dir.join("bench-serve.toml");
    std::fs::write(&file, toml::to_string(&config)?)?;
    let mut cmd = Command::new(&opts.docent);
    cmd.arg("--config").arg(&file).arg("serve");
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("DOCENT_") {
            cmd.env_remove(k);
        }
    }
    if let Some(key) = &store.api_key {
        cmd.env("DOCENT_STORE__API_KEY", key);
    }
    cmd.env("RUST_LOG", "warn");
    wait_ready(spawn(cmd, "docent serve")?, addr)
}

fn start_peer(config: &Config, peer: &Peer, store: &str, dir: &Path) -> anyhow::Result<Server> {
    let addr = free_addr()?;
    let f = &config.retrieval.fusion;
    let mut cmd = Command::new(&peer.python);
    cmd.arg(&peer.script)
        .arg("--shard")
        .arg(dir.join("qdrant"))
        .arg("--model-dir")
        .arg(&config.embedding.model_dir)
        .args(["--threads", &config.embedding.threads.to_string()])
        .args(["--max-length", &config.embedding.max_length.to_string()])
        .args(["--port", &addr.port().to_string()])
        .args(["--candidates", &f.candidates.to_string()])
        .args([
            "--fusion",
            match f.method {
                FusionMethod::Dbsf => "dbsf",
                FusionMethod::Rrf => "rrf",
            },
        ])
        .args(["--rrf-k", &f.rrf_k.to_string()])
        .args(["--store", store]);
    wait_ready(spawn(cmd, "the Python peer")?, addr)
}

pub(crate) fn spawn(mut cmd: Command, what: &str) -> anyhow::Result<Child> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {what}"))
}

/// Waits until `GET /healthz` answers 200 (model loading takes seconds; the qdrant-client
/// peer first loads every point).
pub(crate) fn wait_ready(child: Child, addr: SocketAddr) -> anyhow::Result<Server> {
    wait_ready_at(child, addr, "/healthz")
}

/// [`wait_ready`] on another health path.
pub(crate) fn wait_ready_at(child: Child, addr: SocketAddr, path: &str) -> anyhow::Result<Server> {
    let mut server = Server { child, addr };
    let deadline = Instant::now() + Duration::from_secs(1800);
    loop {
        if let Some(status) = server.child.try_wait()? {
            anyhow::bail!("the server on {addr} exited before it was ready ({status})");
        }
        if let Ok(mut c) = Connection::open(addr) {
            if matches!(c.request("GET", path, b""), Ok((200, _))) {
                return Ok(server);
            }
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the server on {addr} was not ready after 30 minutes"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// (document id, chunk index) of each question's top hit.
fn top_hits_of(addr: SocketAddr, bodies: &[Vec<u8>]) -> anyhow::Result<Vec<(String, u64)>> {
    let mut c = Connection::open(addr)?;
    bodies
        .iter()
        .map(|b| {
            let (status, body) = c.request("POST", "/v1/search", b)?;
            anyhow::ensure!(
                status == 200,
                "search answered {status}: {}",
                String::from_utf8_lossy(&body)
            );
            let v: serde_json::Value = serde_json::from_slice(&body)?;
            let top = &v["hits"][0];
            Ok((
                top["document_id"].as_str().unwrap_or_default().to_string(),
                top["chunk_index"].as_u64().unwrap_or(u64::MAX),
            ))
        })
        .collect()
}

struct Stats {
    requests: usize,
    seconds: f64,
    per_s: f64,
    p50: f64,
    p99: f64,
    mean: f64,
}

/// `clients` threads, each with its own connection, send questions back to back for
/// `warmup` (not recorded) and then `duration` (longer if a client has not finished one
/// request sent after the warm-up by then). Latency: from writing the request to having
/// read the whole response.
fn measure(
    addr: SocketAddr,
    bodies: &[Vec<u8>],
    clients: usize,
    warmup: Duration,
    duration: Duration,
) -> anyhow::Result<Stats> {
    let next = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(std::sync::Barrier::new(clients));
    let results = super::on_client_threads(
        clients,
        |_| -> anyhow::Result<(Vec<f64>, Instant, Instant)> {
            let mut conn = Connection::open(addr)?;
            barrier.wait();
            let start = Instant::now();
            let (from, end) = (start + warmup, start + warmup + duration);
            let mut lat = Vec::new();
            let mut last = from;
            loop {
                let sent = Instant::now();
                // a server slower than the window still gets one measured request
                // per client
                if sent >= end && !lat.is_empty() {
                    break;
                }
                let body = &bodies[next.fetch_add(1, Ordering::Relaxed) % bodies.len()];
                let (status, answer) = conn.request("POST", "/v1/search", body)?;
                anyhow::ensure!(
                    status == 200,
                    "search answered {status}: {}",
                    String::from_utf8_lossy(&answer)
                );
                let done = Instant::now();
                if sent >= from {
                    lat.push((done - sent).as_secs_f64() * 1e3);
                    last = last.max(done);
                }
            }
            Ok((lat, from, last))
        },
    )?;
    let from = results.iter().map(|r| r.1).min().context("no clients")?;
    let last = results.iter().map(|r| r.2).max().context("no clients")?;
    let mut lat: Vec<f64> = results.into_iter().flat_map(|r| r.0).collect();
    anyhow::ensure!(
        !lat.is_empty(),
        "no request finished in the measured window"
    );
    lat.sort_by(f64::total_cmp);
    let seconds = (last - from).as_secs_f64().max(1e-9);
    Ok(Stats {
        requests: lat.len(),
        seconds,
        per_s: lat.len() as f64 / seconds,
        p50: crate::eval::percentile(&lat, 50.0),
        p99: crate::eval::percentile(&lat, 99.0),
        mean: lat.iter().sum::<f64>() / lat.len() as f64,
    })
}

impl std::fmt::Display for QueryBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "query benchmark: POST /v1/search, top_k {}, {} ({}), {} ONNX Runtime threads; {:.0} s warm-up + {:.0} s per cell",
            self.top_k, self.mode, self.fusion, self.threads, self.warmup_s, self.duration_s
        )?;
        for info in &self.indexes {
            writeln!(
                f,
                "\nindex: {} chunks ({} files, {:.1} MB, chunks of {} tokens / {} overlap, model {}), built in {:.0} s",
                info.chunks,
                info.files,
                info.bytes as f64 / 1e6,
                info.chunking.0,
                info.chunking.1,
                info.model_dir.display(),
                info.build_seconds
            )?;
            writeln!(
                f,
                "{:>7}  {:<34} {:>8} {:>8} {:>9} {:>12}",
                "clients", "server", "p50 ms", "p99 ms", "req/s", "docent is"
            )?;
            let mut rows: Vec<&Measurement> = self
                .rows
                .iter()
                .filter(|r| r.chunks == info.chunks)
                .collect();
            rows.sort_by_key(|r| r.clients);
            for r in rows {
                let docent = self
                    .rows
                    .iter()
                    .find(|d| d.server == DOCENT && d.chunks == r.chunks && d.clients == r.clients);
                let ratio = match docent {
                    Some(d) if r.server != DOCENT => {
                        format!("{:.2}x", d.requests_per_s / r.requests_per_s)
                    }
                    _ => String::new(),
                };
                writeln!(
                    f,
                    "{:>7}  {:<34} {:>8.2} {:>8.2} {:>9.1} {:>12}",
                    r.clients, r.server, r.p50_ms, r.p99_ms, r.requests_per_s, ratio
                )?;
            }
            for (_, name, n, same) in self.agreement.iter().filter(|a| a.0 == info.chunks) {
                writeln!(
                    f,
                    "same top hit from docent and the {name}: {same} of {n} questions"
                )?;
            }
        }
        // the goals, on the smallest index with one client
        if let Some(d) = self
            .rows
            .iter()
            .find(|r| r.server == DOCENT && r.clients == 1)
        {
            let met = |ok: bool| if ok { "met" } else { "NOT met" };
            write!(
                f,
                "\ngoals at {} chunks, 1 client: p50 {:.2} ms < 10 ({}), p99 {:.2} ms < 30 ({})",
                d.chunks,
                d.p50_ms,
                met(d.p50_ms < 10.0),
                d.p99_ms,
                met(d.p99_ms < 30.0)
            )?;
            // throughput against each peer, at every size and client count
            for (_, name) in PEER_STORES {
                let ratios: Vec<String> = self
                    .rows
                    .iter()
                    .filter(|p| p.server == *name)
                    .filter_map(|p| {
                        let d = self.rows.iter().find(|d| {
                            d.server == DOCENT && d.chunks == p.chunks && d.clients == p.clients
                        })?;
                        Some(format!("{:.2}x", d.requests_per_s / p.requests_per_s))
                    })
                    .collect();
                if !ratios.is_empty() {
                    write!(
                        f,
                        "\nthroughput vs the {name} (>= 3x wanted), per size and client count: {}",
                        ratios.join(", ")
                    )?;
                }
            }
            writeln!(f)?;
        }
        Ok(())
    }
}
