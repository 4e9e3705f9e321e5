//! `docent bench load`: the real server under a mixed load, then killed and restarted.
//!
//! 1. **Load**: `clients` threads (one keep-alive connection each, API keys on) send a mix
//!    of searches, extractive and generated answers and small uploads for `seconds`.
//!    Reported per route: requests, statuses, p50/p99 latency; the server's RSS over time;
//!    5xx answers other than the explicit 503 overload answers count as failures.
//! 2. **Kill and restart**: the same load, the server SIGKILLed after `kill_after` seconds,
//!    then started again on the same index. Every upload whose job was reported `done`
//!    before the kill must be listed and found by a search for its unique marker.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::http::Connection;
use super::query::{free_addr, spawn, wait_ready, Server};
use docent::config::{ApiKey, Config, Scope};

/// What to run.
pub struct Options {
    /// The docent executable the server (and the starting ingest) runs from.
    pub docent: PathBuf,
    /// Markdown files the uploads and the starting index are made from.
    pub corpus: PathBuf,
    /// Concurrent clients, each a thread with one keep-alive connection.
    pub clients: usize,
    /// How long each of the two runs sends load.
    pub duration: Duration,
    /// How far into the second run the server is SIGKILLed; `None` skips that run.
    pub kill_after: Option<Duration>,
    /// The share of each kind of request.
    pub mix: Mix,
    /// Keep `generation.cache_size` as configured; `false` turns the answer cache off.
    pub answer_cache: bool,
}

/// The request mix, as weights (percentages by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mix {
    /// Weight of `POST /v1/search`.
    pub search: usize,
    /// Weight of `POST /v1/query` answered extractively.
    pub extractive: usize,
    /// Weight of `POST /v1/query` answered by the model (32 tokens).
    pub generated: usize,
    /// Weight of `GET /v1/documents` (20 per page).
    pub list: usize,
    /// Weight of `POST /v1/documents`: a small Markdown note with a unique marker.
    pub upload: usize,
}

impl Default for Mix {
    fn default() -> Self {
        Mix {
            search: 55,
            extractive: 20,
            generated: 12,
            list: 8,
            upload: 5,
        }
    }
}

impl std::str::FromStr for Mix {
    type Err = String;

    /// `search=55,extractive=20,generated=12,list=8,upload=5`; a kind left out gets 0.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut mix = Mix {
            search: 0,
            extractive: 0,
            generated: 0,
            list: 0,
            upload: 0,
        };
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (kind, weight) = part
                .split_once('=')
                .ok_or_else(|| format!("`{part}`: expected kind=weight"))?;
            let weight: usize = weight
                .trim()
                .parse()
                .map_err(|_| format!("`{part}`: the weight must be a whole number"))?;
            let slot = match kind.trim() {
                "search" => &mut mix.search,
                "extractive" => &mut mix.extractive,
                "generated" => &mut mix.generated,
                "list" => &mut mix.list,
                "upload" => &mut mix.upload,
                other => {
                    return Err(format!(
                        "unknown kind `{other}` (search, extractive, generated, list, upload)"
                    ))
                }
            };
            *slot = weight;
        }
        if mix.total() == 0 {
            return Err("the weights add up to 0".into());
        }
        Ok(mix)
    }
}

impl std::fmt::Display for Mix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pct = |w: usize| w as f64 * 100.0 / self.total() as f64;
        write!(
            f,
            "{:.0} % search, {:.0} % extractive answers, {:.0} % generated answers (32 tokens), {:.0} % document lists, {:.0} % uploads",
            pct(self.search),
            pct(self.extractive),
            pct(self.generated),
            pct(self.list),
            pct(self.upload)
        )
    }
}

impl Mix {
    fn total(&self) -> usize {
        self.search + self.extractive + self.generated + self.list + self.upload
    }
}

const KEY: &str = "bench-load-key-0123456789abcdef";

/// What one route saw.
#[derive(Default, Clone)]
struct Route {
    latencies_ms: Vec<f64>,
    statuses: BTreeMap<u16, usize>,
    /// Requests that got no HTTP answer (connection refused or reset).
    no_answer: usize,
    /// 503 answers that report a failure (`generation_failed`, `retrieval_failed`), not an
    /// overload or a store made unavailable on purpose: counted as failures.
    failed_503: usize,
}

/// Error codes of a 503 that reports something broken rather than "come back later".
const FAILURE_503_CODES: [&str; 2] = ["generation_failed", "retrieval_failed"];

/// How long a client waits after a 429 or 503 before its next request, as a client that
/// honours `Retry-After` would (without it, 64 clients resend rejected requests as fast as
/// the server rejects them, and the rejections take the CPU the answers need).
const BACKOFF: Duration = Duration::from_millis(100);

#[derive(Default)]
struct Tally {
    routes: BTreeMap<&'static str, Route>,
    /// Upload jobs accepted: (job id, marker).
    jobs: Vec<(String, String)>,
}

const QUESTIONS: &[&str] = &[
    "What is ownership in Rust?",
    "How do I install Rust on Linux?",
    "What does the borrow checker do?",
    "How do I create a new project with Cargo?",
    "What is a slice?",
    "How are errors handled with Result?",
    "What is a trait?",
    "How do closures capture their environment?",
];

fn multipart(name: &str, text: &str) -> (String, Vec<u8>) {
    let boundary = "docentbenchboundary7MA4YWxk";
    let body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\nContent-Type: text/markdown\r\n\r\n{text}\r\n--{boundary}--\r\n"
    );
    (
        format!("multipart/form-data; boundary={boundary}"),
        body.into_bytes(),
    )
}

/// One request of the mix.
struct Op {
    /// The row it is reported in.
    route: &'static str,
    method: &'static str,
    path: &'static str,
    content_type: String,
    body: Vec<u8>,
    /// An upload's unique marker, searched for after the restart.
    marker: Option<String>,
}

/// One client's loop until `stop`.
fn client(
    addr: std::net::SocketAddr,
    mix: Mix,
    id: usize,
    paragraphs: &[String],
    stop: &AtomicBool,
    tally: &Mutex<Tally>,
) {
    // a deterministic sequence per client
    let mut rng = fastrand::Rng::with_seed(id as u64 + 1);
    let mut conn: Option<Connection> = None;
    let mut n = 0usize;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let op = pick_op(mix, &mut rng, id, n, paragraphs);
        let Op {
            route,
            method,
            path,
            content_type,
            body,
            marker,
        } = op;
        if conn.is_none() {
            conn = Connection::open(addr).ok();
        }
        let started = Instant::now();
        let answer = match conn.as_mut() {
            Some(c) => c.send(method, path, &content_type, Some(KEY), &body),
            None => Err(std::io::Error::other("no connection")),
        };
        let ms = started.elapsed().as_secs_f64() * 1e3;
        let mut t = tally.lock().unwrap_or_else(|p| p.into_inner());
        let r = t.routes.entry(route).or_default();
        match answer {
            Ok((status, body)) => {
                r.latencies_ms.push(ms);
                *r.statuses.entry(status).or_default() += 1;
                let failure = status == 503
                    && serde_json::from_slice::<serde_json::Value>(&body).is_ok_and(|v| {
                        v["error"]["code"]
                            .as_str()
                            .is_some_and(|c| FAILURE_503_CODES.contains(&c))
                    });
                r.failed_503 += usize::from(failure);
                if status == 429 || status == 503 {
                    drop(t);
                    std::thread::sleep(BACKOFF);
                    continue;
                }
                if status == 202 {
                    if let (Some(m), Ok(v)) =
                        (marker, serde_json::from_slice::<serde_json::Value>(&body))
                    {
                        if let Some(job) = v["job_id"].as_str() {
                            t.jobs.push((job.to_string(), m));
                        }
                    }
                }
            }
            Err(_) => {
                r.no_answer += 1;
                conn = None;
                drop(t);
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// The next request of a client's mix: a search, an extractive or generated answer, a
/// document list, or an upload of a note with a marker (checked after the kill).
fn pick_op(mix: Mix, rng: &mut fastrand::Rng, id: usize, n: usize, paragraphs: &[String]) -> Op {
    let question = QUESTIONS[rng.usize(..QUESTIONS.len())];
    let roll = rng.usize(..mix.total());
    let (a, b, c, d) = (
        mix.search,
        mix.search + mix.extractive,
        mix.search + mix.extractive + mix.generated,
        mix.search + mix.extractive + mix.generated + mix.list,
    );
    let json = |route, method, path, body: serde_json::Value| Op {
        route,
        method,
        path,
        content_type: "application/json".to_string(),
        body: if body.is_null() {
            vec![]
        } else {
            body.to_string().into_bytes()
        },
        marker: None,
    };
    if roll < a {
        json(
            "POST /v1/search",
            "POST",
            "/v1/search",
            serde_json::json!({"question": question}),
        )
    } else if roll < b {
        json(
            "POST /v1/query (extractive)",
            "POST",
            "/v1/query",
            serde_json::json!({"question": question, "mode": "extractive"}),
        )
    } else if roll < c {
        json(
            "POST /v1/query (generated)",
            "POST",
            "/v1/query",
            serde_json::json!({"question": question, "generation": {"max_tokens": 32}}),
        )
    } else if roll < d {
        json(
            "GET /v1/documents",
            "GET",
            "/v1/documents?limit=20",
            serde_json::Value::Null,
        )
    } else {
        let marker = format!("zqmark{id}x{n}q");
        let text = format!(
            "# Load test note {id}-{n}\n\nThe marker of this note is {marker}.\n\n{}",
            paragraphs[rng.usize(..paragraphs.len())]
        );
        let (content_type, body) = multipart(&format!("load-{id}-{n}.md"), &text);
        Op {
            route: "POST /v1/documents",
            method: "POST",
            path: "/v1/documents",
            content_type,
            body,
            marker: Some(marker),
        }
    }
}

/// A field of `/proc/PID/status` in MiB (`VmRSS`, `RssAnon`, `RssFile`).
fn status_mib(pid: u32, field: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = status
        .lines()
        .find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

/// RSS of a process, MiB: (total, anonymous, file-backed such as the store's mmaps).
fn rss_mib(pid: u32) -> Option<(f64, f64, f64)> {
    Some((
        status_mib(pid, "VmRSS")?,
        status_mib(pid, "RssAnon")?,
        status_mib(pid, "RssFile")?,
    ))
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Paragraphs of the corpus's Markdown files, for uploads.
fn paragraphs(corpus: &Path) -> anyhow::Result<Vec<String>> {
    let mut out = vec![];
    for entry in
        std::fs::read_dir(corpus).with_context(|| format!("reading {}", corpus.display()))?
    {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "md") {
            let text = std::fs::read_to_string(&path)?;
            out.extend(
                text.split("\n\n")
                    .filter(|p| p.len() > 200 && p.len() < 1200 && !p.starts_with('#'))
                    .map(str::to_string),
            );
        }
    }
    anyhow::ensure!(!out.is_empty(), "no paragraphs in {}", corpus.display());
    Ok(out)
}

/// Starts `docent serve` on `dir` with the bench key.
fn start(opts: &Options, file: &Path) -> anyhow::Result<Server> {
    let addr = free_addr()?;
    let mut cmd = Command::new(&opts.docent);
    cmd.arg("--config")
        .arg(file)
        .arg("serve")
        .args(["--bind", &addr.to_string()]);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("DOCENT_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("RUST_LOG", "warn");
    wait_ready(spawn(cmd, "docent serve")?, addr)
}

struct RunResult {
    tally: Tally,
    /// (total, anonymous, file-backed) MiB, one sample a second.
    rss: Vec<(f64, f64, f64)>,
    seconds: f64,
    /// Jobs reported done before the end (or the kill): (job id, marker, document id).
    done: Vec<(String, String, String)>,
    /// Jobs reported failed: (job id, error).
    failed: Vec<(String, String)>,
}

/// Job ids reported done (with marker and document id) or failed (with the error).
#[derive(Default)]
struct Finished {
    done: BTreeMap<String, (String, String)>,
    failed: BTreeMap<String, String>,
}

fn poll_jobs(addr: std::net::SocketAddr, jobs: &[(String, String)], finished: &mut Finished) {
    let Ok(mut c) = Connection::open(addr) else {
        return;
    };
    for (job, marker) in jobs {
        if finished.done.contains_key(job) || finished.failed.contains_key(job) {
            continue;
        }
        if let Ok((200, body)) = c.send(
            "GET",
            &format!("/v1/jobs/{job}"),
            "application/json",
            Some(KEY),
            b"",
        ) {
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) {
                if v["status"] == "done" {
                    let doc = v["documents"][0]["id"].as_str().unwrap_or("").to_string();
                    finished.done.insert(job.clone(), (marker.clone(), doc));
                } else if v["status"] == "failed" {
                    let error = v["documents"][0]["error"].as_str().unwrap_or("?");
                    finished.failed.insert(job.clone(), error.to_string());
                }
            }
        }
    }
}

/// Runs the load for `duration`; with `kill_after`, SIGKILLs the server then.
fn run_load(
    opts: &Options,
    server: &mut Server,
    paragraphs: &[String],
    duration: Duration,
    kill_after: Option<Duration>,
) -> RunResult {
    let stop = AtomicBool::new(false);
    let tally = Mutex::new(Tally::default());
    let mut rss = vec![];
    let mut finished = Finished::default();
    let started = Instant::now();
    let addr = server.addr;
    std::thread::scope(|s| {
        for id in 0..opts.clients {
            let (stop, tally) = (&stop, &tally);
            s.spawn(move || client(addr, opts.mix, id, paragraphs, stop, tally));
        }
        let end = started + duration;
        while Instant::now() < end {
            std::thread::sleep(Duration::from_secs(1));
            if let Some(r) = rss_mib(server.child.id()) {
                rss.push(r);
            }
            let jobs = tally.lock().unwrap_or_else(|p| p.into_inner()).jobs.clone();
            poll_jobs(addr, &jobs, &mut finished);
            if kill_after.is_some_and(|k| started.elapsed() >= k) {
                let _ = server.child.kill(); // SIGKILL
                let _ = server.child.wait();
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    let seconds = started.elapsed().as_secs_f64();
    let tally = tally.into_inner().unwrap_or_else(|p| p.into_inner());
    if kill_after.is_none() {
        // let the accepted uploads finish, so that each counts as done or failed
        let deadline = Instant::now() + Duration::from_secs(120);
        while finished.done.len() + finished.failed.len() < tally.jobs.len()
            && Instant::now() < deadline
        {
            poll_jobs(addr, &tally.jobs, &mut finished);
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    RunResult {
        tally,
        rss,
        seconds,
        done: finished
            .done
            .into_iter()
            .map(|(j, (m, d))| (j, m, d))
            .collect(),
        failed: finished.failed.into_iter().collect(),
    }
}

fn report(title: &str, r: &RunResult) -> usize {
    println!("{title}: {:.0} s", r.seconds);
    println!(
        "{:<30} {:>8} {:>7} {:>7} {:>7} {:>7} {:>9} {:>9} {:>9}",
        "route", "requests", "2xx", "429", "503", "5xx", "no answer", "p50 ms", "p99 ms"
    );
    let mut bad = 0;
    for (route, data) in &r.tally.routes {
        let mut l = data.latencies_ms.clone();
        l.sort_by(f64::total_cmp);
        let count = |f: &dyn Fn(u16) -> bool| {
            data.statuses
                .iter()
                .filter(|(s, _)| f(**s))
                .map(|(_, n)| n)
                .sum::<usize>()
        };
        let other_5xx = count(&|s| s >= 500 && s != 503);
        bad += other_5xx + data.failed_503;
        println!(
            "{:<30} {:>8} {:>7} {:>7} {:>7} {:>7} {:>9} {:>9.1} {:>9.1}",
            route,
            l.len() + data.no_answer,
            count(&|s| (200..300).contains(&s)),
            count(&|s| s == 429),
            count(&|s| s == 503),
            other_5xx,
            data.no_answer,
            percentile(&l, 0.5),
            percentile(&l, 0.99)
        );
        let others: Vec<String> = data
            .statuses
            .iter()
            .filter(|(s, _)| !(200..300).contains(*s) && **s != 429 && **s < 500)
            .map(|(s, n)| format!("{s}×{n}"))
            .collect();
        if !others.is_empty() {
            println!("{:<30} other statuses: {}", "", others.join(", "));
        }
        if data.failed_503 > 0 {
            println!(
                "{:<30} 503 reporting a failure ({}): {}",
                "",
                FAILURE_503_CODES.join(", "),
                data.failed_503
            );
        }
    }
    let first = r.rss.first().map_or(f64::NAN, |r| r.0);
    let peak = r.rss.iter().map(|r| r.0).fold(f64::NAN, f64::max);
    let last = r.rss.last().map_or(f64::NAN, |r| r.0);
    println!(
        "server RSS: {first:.0} MiB after 1 s, peak {peak:.0} MiB, {last:.0} MiB at the end; uploads accepted {}, done {}, failed {}",
        r.tally.jobs.len(),
        r.done.len(),
        r.failed.len()
    );
    if let Some((job, error)) = r.failed.first() {
        println!("failed upload job {job}: {error}");
    }
    bad += r.failed.len();
    let every: Vec<String> = r
        .rss
        .iter()
        .step_by(30)
        .map(|(t, a, f)| format!("{t:.0} ({a:.0} anon + {f:.0} file)"))
        .collect();
    println!("server RSS every 30 s, MiB: {}", every.join(", "));
    bad
}

/// Builds a starting index in a temporary directory, runs the load, then (unless
/// `kill_after` is `None`) the kill-and-restart run, printing a report of each. Returns
/// whether the checks passed: no failures in the first run and, after the restart, no
/// upload acknowledged as done lost and a query answered 200.
pub fn run(config: &Config, opts: &Options) -> anyhow::Result<bool> {
    let paragraphs = paragraphs(&opts.corpus)?;
    let tmp = std::env::temp_dir().join(format!("docent-bench-load-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let _cleanup = super::RemoveOnDrop::Dir(tmp.clone());
    let mut config = config.clone();
    config.data_dir = tmp.join("index");
    config.auth.keys = vec![ApiKey {
        name: "bench".into(),
        scope: Scope::Write,
        hash: docent::config::hash_key(KEY),
    }];
    config.auth.rate_per_minute = 0;
    if !opts.answer_cache {
        config.generation.cache_size = 0;
    }
    let file = tmp.join("bench-load.toml");
    std::fs::write(&file, toml::to_string(&config)?)?;
    // a starting index: the corpus's first chapters through the CLI
    let mut first: Vec<PathBuf> = std::fs::read_dir(&opts.corpus)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    first.sort();
    first.truncate(12);
    let status = Command::new(&opts.docent)
        .arg("--config")
        .arg(&file)
        .arg("ingest")
        .args(&first)
        .env("RUST_LOG", "warn")
        .status()?;
    anyhow::ensure!(status.success(), "ingesting the starting index failed");
    println!(
        "load: {} clients, {}; API keys on; answer cache {}",
        opts.clients,
        opts.mix,
        if opts.answer_cache {
            "on (repeated questions are lookups)"
        } else {
            "off"
        }
    );

    let mut server = start(opts, &file)?;
    let load = run_load(opts, &mut server, &paragraphs, opts.duration, None);
    let bad = report("load", &load);
    drop(server);

    let Some(kill_after) = opts.kill_after else {
        return Ok(bad == 0);
    };
    let mut server = start(opts, &file)?;
    let killed = run_load(
        opts,
        &mut server,
        &paragraphs,
        opts.duration,
        Some(kill_after),
    );
    report(
        &format!(
            "kill: SIGKILL after {:.0} s of the same load",
            kill_after.as_secs_f64()
        ),
        &killed,
    );
    drop(server);
    let restarted = Instant::now();
    let server = start(opts, &file)?;
    println!(
        "restart: ready in {:.1} s",
        restarted.elapsed().as_secs_f64()
    );
    let mut c = Connection::open(server.addr)?;
    let lost = lost_uploads(&mut c, &killed.done)?;
    println!(
        "kill-restart: {} uploads acknowledged as done before the kill; {} intact and found by search; lost: {}",
        killed.done.len(),
        killed.done.len() - lost.len(),
        if lost.is_empty() { "none".to_string() } else { lost.join("; ") }
    );
    let (status, _) = c.send(
        "POST",
        "/v1/query",
        "application/json",
        Some(KEY),
        br#"{"question": "What is ownership in Rust?", "mode": "extractive"}"#,
    )?;
    println!("after the restart a query answers {status}");
    Ok(bad == 0 && lost.is_empty() && status == 200)
}

/// The uploads acknowledged as done that a restarted server lost: not listed, or not
/// found by a search for their marker.
fn lost_uploads(
    c: &mut Connection,
    done: &[(String, String, String)],
) -> anyhow::Result<Vec<String>> {
    let mut lost = vec![];
    for (_, marker, doc) in done {
        let (status, _) = c.send(
            "GET",
            &format!("/v1/documents/{doc}"),
            "application/json",
            Some(KEY),
            b"",
        )?;
        let body = serde_json::json!({"question": format!("The marker of this note is {marker}."), "retrieval": {"top_k": 3, "mode": "sparse"}});
        let (_, hits) = c.send(
            "POST",
            "/v1/search",
            "application/json",
            Some(KEY),
            body.to_string().as_bytes(),
        )?;
        let hits: serde_json::Value = serde_json::from_slice(&hits).unwrap_or_default();
        let found = hits["hits"].as_array().is_some_and(|h| {
            h.iter().any(|h| {
                h["text"]
                    .as_str()
                    .is_some_and(|t| t.contains(marker.as_str()))
            })
        });
        if status != 200 || !found {
            lost.push(format!(
                "{doc} ({marker}): GET {status}, found by search: {found}"
            ));
        }
    }
    Ok(lost)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_parses_weights_and_names_what_is_wrong() {
        let m: Mix = "search=3, upload=1".parse().unwrap();
        assert_eq!((m.search, m.upload, m.generated), (3, 1, 0));
        assert_eq!(m.total(), 4);
        assert!(m.to_string().starts_with("75 % search"), "{m}");
        assert_eq!(
            "search=55,extractive=20,generated=12,list=8,upload=5"
                .parse::<Mix>()
                .unwrap(),
            Mix::default()
        );
        for (bad, says) in [
            ("search", "kind=weight"),
            ("search=x", "whole number"),
            ("reads=1", "unknown kind `reads`"),
            ("search=0", "add up to 0"),
        ] {
            let err = bad.parse::<Mix>().unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }
}
