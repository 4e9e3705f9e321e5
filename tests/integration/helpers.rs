use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

use docent::config::Config;
use docent::server::startup;

/// The repository's root (these tests belong to the `docent-cli` package in `cli/`).
pub fn repo() -> PathBuf {
    let cli = Path::new(env!("CARGO_MANIFEST_DIR"));
    cli.parent()
        .expect("cli/ is in the repository")
        .to_path_buf()
}

/// The models fetched by `make setup`.
pub fn models() -> PathBuf {
    std::env::var_os("DOCENT_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("models"))
}

/// The file of the catalog model `name` (models.toml) in the models directory.
fn catalog_model(name: &str) -> PathBuf {
    let m = docent::query::generate::catalog::find(name)
        .unwrap_or_else(|| panic!("{name} is in the catalog"));
    models().join(&m.file)
}

/// The default generation model's file (models.toml; `make setup` installs it).
pub fn default_model() -> PathBuf {
    catalog_model(docent::query::generate::catalog::DEFAULT_MODEL)
}

/// Qwen2.5-Coder-0.5B-Instruct's file (`make test` installs it beside the default): the
/// batching tests' llama.cpp fixture is its, it drafts for the 1.5B, and the refusal and
/// safety tests' figures were measured on it (the default until issue 55).
pub fn qwen_0_5b() -> PathBuf {
    catalog_model("qwen2.5-coder-0.5b")
}

/// Qwen2.5-Coder-1.5B-Instruct's file (the default model): the 0.5B drafts for it, and the
/// injection second stage was measured to pay with it.
pub fn qwen_1_5b() -> PathBuf {
    catalog_model("qwen2.5-coder-1.5b")
}

/// Where the generation tests run: `DOCENT_TEST_DEVICE` (`cpu` by default; `cuda` in a
/// CUDA build on a GPU machine, which `scripts/gpu-check.sh` sets).
pub fn test_device() -> String {
    std::env::var("DOCENT_TEST_DEVICE").unwrap_or_else(|_| "cpu".into())
}

/// The default generation settings on the test device.
pub fn generation() -> docent::config::GenerationConfig {
    let mut c = Config::default().generation;
    c.device = test_device();
    // prompts prefilled whole, as the tests' references were made (reuse.rs sets its own)
    c.passage_reuse = docent::query::generate::reuse::PassageReuse::Off;
    c
}

/// The shared data folder beside the checkout.
pub fn shared() -> PathBuf {
    let p = std::env::var_os("DOCENT_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("../shared"));
    assert!(
        p.is_dir(),
        "shared data not found at {} (set DOCENT_SHARED_DIR)",
        p.display()
    );
    p
}

/// A config on the setup step's models, with an index in `data_dir`.
pub fn config(data_dir: &Path) -> Config {
    let m = models();
    let mut c = Config {
        data_dir: data_dir.to_path_buf(),
        ..Config::default()
    };
    c.embedding.model_dir = m.join("all-MiniLM-L6-v2");
    c.embedding.ort_library = m.join("onnxruntime/libonnxruntime.so");
    c.generation.model = m.join("smollm2/SmolLM2-135M-Instruct.Q8_0.gguf");
    c.prompts.dir = repo().join("prompts");
    c.server.bind = "127.0.0.1:0".into();
    // short prompts keep CPU prefill time down in tests
    c.chunking.max_tokens = 128;
    c.chunking.overlap = 16;
    c.retrieval.top_k = 2;
    c.generation.max_tokens = 48;
    // answers as a full prefill gives them (the figures tests compare with were taken so);
    // passage reuse, the default, is tested on its own (reuse.rs, default_model.rs)
    c.generation.passage_reuse = docent::query::generate::reuse::PassageReuse::Off;
    c
}

/// Environment that points the `docent` binary at the same models as [`config`].
pub fn docent_cmd(data_dir: &Path) -> Command {
    let c = config(data_dir);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_docent"));
    cmd.env("DOCENT_EMBEDDING__MODEL_DIR", &c.embedding.model_dir)
        .env("DOCENT_EMBEDDING__ORT_LIBRARY", &c.embedding.ort_library)
        .env("DOCENT_GENERATION__MODEL", &c.generation.model)
        .env("DOCENT_PROMPTS__DIR", &c.prompts.dir)
        .env(
            "DOCENT_CHUNKING__MAX_TOKENS",
            c.chunking.max_tokens.to_string(),
        )
        .env("DOCENT_CHUNKING__OVERLAP", c.chunking.overlap.to_string())
        .env("DOCENT_GENERATION__PASSAGE_REUSE", "off")
        .env("DOCENT_RETRIEVAL__TOP_K", c.retrieval.top_k.to_string())
        .env(
            "DOCENT_GENERATION__MAX_TOKENS",
            c.generation.max_tokens.to_string(),
        )
        .arg("--data-dir")
        .arg(data_dir)
        .current_dir(std::env::temp_dir());
    cmd
}

/// Runs a `docent` command that must succeed; its output.
pub fn run_ok(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().expect("run docent");
    assert!(
        out.status.success(),
        "docent failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

pub fn rust_book(chapter: &str) -> PathBuf {
    shared().join("data/corpus/rust-book/src").join(chapter)
}

/// The two documents the server's index holds.
pub const INSTALLATION: &str = "ch01-01-installation.md";
pub const OWNERSHIP: &str = "ch04-01-what-is-ownership.md";

pub struct TestApp {
    pub address: String,
    pub ingest_stdout: String,
    _dir: tempfile::TempDir,
}

/// One real server for the whole test binary, on a random port, with two Rust Book chapters
/// ingested through the real `docent ingest` command. It runs on its own thread and runtime
/// so that it outlives each test's runtime.
pub fn app() -> &'static TestApp {
    static APP: OnceLock<TestApp> = OnceLock::new();
    APP.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let data_dir = dir.path().join("index");
        let out = docent_cmd(&data_dir)
            .arg("ingest")
            .arg(rust_book(INSTALLATION))
            .arg(rust_book(OWNERSHIP))
            .output()
            .expect("run docent ingest");
        let ingest_stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "docent ingest failed: {ingest_stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        TestApp {
            address: serve(config(&data_dir)),
            ingest_stdout,
            _dir: dir,
        }
    })
}

/// Runs the real server on `config` (its index must not be open elsewhere) on its own
/// thread and runtime, so that it outlives each test's runtime; its address. The server
/// lives until the binary ends: for the one shared by every test ([`app`]).
pub fn serve(config: Config) -> String {
    let server = serve_until_dropped(config);
    let address = server.address.clone();
    std::mem::forget(server);
    address
}

/// A server on its own thread and runtime that stops when dropped: its runtime ends, and
/// with it the server's generator and embedder, so the binary's memory does not grow with
/// every test that needs a server of its own (docs/testing.md, "Memory").
pub struct RunningServer {
    pub address: String,
    handle: actix_web::dev::ServerHandle,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        // `stop` sends its command when called; the server's thread ends once it has stopped
        drop(self.handle.stop(false));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn serve_until_dropped(config: Config) -> RunningServer {
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let index = startup::open_index(&config).await.expect("open index");
            let engine = match shared_generator(&config).await {
                Some(generator) => startup::query_engine_with(&config, index, generator),
                None => startup::query_engine(&config, index).await,
            };
            let engine = Arc::new(engine.expect("engine"));
            let app = startup::Application::build(&config, engine).expect("bind");
            tx.send((app.port(), app.handle())).expect("send port");
            app.run_until_stopped().await.expect("server");
        });
    });
    let (port, handle) = rx.recv().expect("server started");
    RunningServer {
        address: format!("http://127.0.0.1:{port}"),
        handle,
        thread: Some(thread),
    }
}

/// A test's own server and its index directory: dropping it stops the server first, then
/// removes the directory (fields drop in this order).
pub struct OwnServer {
    _server: RunningServer,
    _dir: tempfile::TempDir,
}

/// The Qwen models' generator for servers whose generation settings are equal: one copy
/// of its weights for all the servers alive at once (docs/testing.md, "Memory"); it is
/// freed with the last of them. Other models load per server. The generator's engine runs
/// on its own thread, so servers on other runtimes share it.
async fn shared_generator(config: &Config) -> Option<docent::query::generate::SharedGenerator> {
    use docent::query::generate::Generator;
    type Loaded = std::collections::HashMap<String, std::sync::Weak<Generator>>;
    static LOADED: OnceLock<tokio::sync::Mutex<Loaded>> = OnceLock::new();
    if config.generation.model != qwen_0_5b() && config.generation.model != qwen_1_5b() {
        return None;
    }
    let key = serde_json::to_string(&config.generation).expect("settings as JSON");
    let mut loaded = LOADED.get_or_init(Default::default).lock().await;
    if let Some(g) = loaded.get(&key).and_then(std::sync::Weak::upgrade) {
        return Some(g);
    }
    config
        .check_generation_files()
        .expect("the default model is installed");
    let g = Arc::new(
        Generator::load(&config.generation)
            .await
            .expect("load the default model"),
    );
    loaded.insert(key, Arc::downgrade(&g));
    Some(g)
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(300))
        .build()
        .expect("client")
}

/// A server of its own (settings changed by `adjust`) over the ownership chapter, for
/// tests that would disturb the shared one; it stops when the first value is dropped.
pub fn own_server(adjust: impl FnOnce(&mut docent::config::Config)) -> (OwnServer, String) {
    server_over(&[rust_book(OWNERSHIP)], adjust)
}

/// A server of its own over `files`, settings changed by `adjust`; it stops when the first
/// value is dropped.
pub fn server_over(
    files: &[PathBuf],
    adjust: impl FnOnce(&mut docent::config::Config),
) -> (OwnServer, String) {
    let dir = tempfile::tempdir().unwrap();
    let server = server_in(&dir.path().join("index"), files, adjust);
    let address = server.address.clone();
    (
        OwnServer {
            _server: server,
            _dir: dir,
        },
        address,
    )
}

/// A server over `files` indexed in `data_dir` (the caller's folder), settings changed by
/// `adjust`; it stops when dropped (before the caller's folder goes).
pub fn server_in(
    data_dir: &Path,
    files: &[PathBuf],
    adjust: impl FnOnce(&mut docent::config::Config),
) -> RunningServer {
    let mut config = config(data_dir);
    adjust(&mut config);
    {
        let index = docent::server::startup::open_index_blocking(&config).unwrap();
        let ingestor = docent::server::startup::ingestor(&config, &index).unwrap();
        let report = ingestor
            .ingest_paths(files, &docent_ingest::pipeline::Silent)
            .unwrap();
        assert_eq!(report.ingested.len(), files.len());
    }
    serve_until_dropped(config)
}

pub async fn get_json(c: &reqwest::Client, url: &str) -> serde_json::Value {
    c.get(url).send().await.unwrap().json().await.unwrap()
}

/// `GET url` with an API key, as JSON.
pub async fn get_json_as(c: &reqwest::Client, url: &str, key: &str) -> serde_json::Value {
    c.get(url)
        .bearer_auth(key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// `POST url` with a JSON body, the answer as JSON (whatever the status).
pub async fn post_json(
    c: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> serde_json::Value {
    c.post(url)
        .json(body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The port `docent serve` printed on its stdout; stdout is drained afterwards so the
/// server never blocks on it.
pub fn listening_port(stdout: std::process::ChildStdout) -> u16 {
    use std::io::BufRead;
    let mut lines = std::io::BufReader::new(stdout).lines();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(p) = line.strip_prefix("docent is listening on port ") {
            let port = p.trim().parse().unwrap();
            // keep draining stdout so the server never blocks on it
            std::thread::spawn(move || for _ in lines {});
            return port;
        }
    }
    panic!("docent serve ended without listening");
}

/// A Qdrant server's gRPC URL from `QDRANT_URL` (`scripts/with-qdrant.sh` starts one and
/// sets it when a server binary is built), or `None` after printing a SKIP line for `test`.
pub fn qdrant_url(test: &str) -> Option<String> {
    let url = std::env::var("QDRANT_URL").ok().filter(|u| !u.is_empty());
    if url.is_none() {
        println!("SKIP {test}: QDRANT_URL is not set (no Qdrant server to test against)");
    }
    url
}

/// A collection name no other test run uses.
pub fn unique_collection(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{prefix}_{nanos}")
}

/// Drops a server collection and its catalog (a test's cleanup).
pub async fn drop_server_collection(url: &str, collection: &str) {
    use docent_ingest::store::qdrant::{QdrantIndex, QdrantOptions};
    let options = QdrantOptions {
        url: url.to_string(),
        api_key: None,
        collection: collection.to_string(),
        timeout: std::time::Duration::from_secs(10),
    };
    if let Ok(index) = QdrantIndex::connect(&options, 1).await {
        let _ = index.drop_collections().await;
    }
}

/// A streamed answer's `done` event, checking that it streamed exactly one delta (a
/// refusal: the refusal text, nothing of the model's before it).
pub async fn streamed_refusal(
    c: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> serde_json::Value {
    let mut res = c.post(url).json(body).send().await.unwrap();
    let mut raw = String::new();
    while let Some(chunk) = res.chunk().await.unwrap() {
        raw.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert_eq!(raw.matches("event: delta").count(), 1, "{raw}");
    let done = raw
        .split("event: done\ndata: ")
        .nth(1)
        .expect("a done event");
    serde_json::from_str(done.trim()).unwrap()
}

/// A one-passage context (an office guide) that answers [`OFFICE_ANSWERED`] and not
/// [`OFFICE_NOT_ANSWERED`].
pub fn office_guide() -> [docent::query::prompt::ContextBlock<'static>; 1] {
    [docent::query::prompt::ContextBlock {
        n: 1,
        title: "Office guide",
        source: "office-guide.md",
        text: "The second-floor printer is reserved for the finance team; everyone else \
               prints on the ground floor. The office opens at 8:00 and closes at 18:00.",
    }]
}

pub const OFFICE_ANSWERED: &str = "Which team is the second-floor printer reserved for?";
pub const OFFICE_NOT_ANSWERED: &str = "What is the password of the guest wifi?";
