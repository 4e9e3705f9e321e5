//! Wiring: opens the index, loads the models and binds the HTTP server. Tests use
//! [`Application::build`] with port 0 to run the real server on a random port.

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::Server;
use actix_web::{web, App, HttpServer};
use docent_ingest::embed::{Embedder, EmbedderConfig};
use docent_ingest::pipeline::Ingestor;
use docent_ingest::split::Splitter;
use docent_ingest::store::{Identity, Store};

use crate::config::Config;
use crate::query::generate::Generator;
use crate::query::prompt::Prompts;
use crate::query::retrieve::Index;
use crate::query::QueryEngine;

/// Most questions embedded in one run (see [`crate::query::embed::QueryBatcher`]).
const QUERY_BATCH: usize = 16;

/// The embedding model `[embedding]` names, its files checked first.
pub fn embedder(config: &Config) -> anyhow::Result<Embedder> {
    config.check_embedding_files()?;
    let e = &config.embedding;
    Ok(Embedder::load(EmbedderConfig {
        model_dir: e.model_dir.clone(),
        ort_library: e.ort_library.clone(),
        max_length: e.max_length,
        threads: e.threads,
        batch_size: e.batch_size,
        bm25: e.bm25,
    })?)
}

/// Opens the embedder and the store (what both ingest and query need): the embedded
/// engine in `data_dir`, or the Qdrant server `[store]` names.
pub async fn open_index(config: &Config) -> anyhow::Result<Index> {
    let embedder = Arc::new(embedder(config)?);
    let location = config.store.location(&config.data_dir);
    let engine = docent_ingest::store::open_index(&location, embedder.dim()).await?;
    let store = Arc::new(
        Store::open_with(
            engine,
            &Identity::new(embedder.model_sha256(), embedder.dim()),
            config.store.stale_after(),
        )
        .await?
        .with_ann(config.retrieval.ann),
    );
    Ok(Index {
        queries: Arc::new(crate::query::embed::QueryBatcher::new(
            embedder.clone(),
            QUERY_BATCH,
        )),
        embedder,
        store,
        mode: config.retrieval.mode,
        fusion: config.retrieval.fusion,
    })
}

/// [`open_index`] from synchronous code (tools and tests on plain or blocking threads).
pub fn open_index_blocking(config: &Config) -> anyhow::Result<Index> {
    docent_ingest::store::block_on(open_index(config))
}

/// The ingest pipeline over an open index.
pub fn ingestor(config: &Config, index: &Index) -> anyhow::Result<Ingestor> {
    ingestor_with(config, index, config.ingest.pipeline())
}

/// [`ingestor`] with other pipeline settings.
pub fn ingestor_with(
    config: &Config,
    index: &Index,
    pipeline: docent_ingest::pipeline::PipelineConfig,
) -> anyhow::Result<Ingestor> {
    let splitter = Splitter::new(
        index.embedder.sizing_tokenizer(),
        config.chunking.max_tokens,
        config.chunking.overlap,
        config.embedding.max_length,
    )?;
    Ok(Ingestor::new(
        splitter,
        index.embedder.clone(),
        index.store.clone(),
        docent_ingest::pipeline::PipelineConfig {
            headers: config.chunking.headers,
            ..pipeline
        },
    ))
}

/// The query path over an open index: loads the templates and the generation model.
pub async fn query_engine(config: &Config, index: Index) -> anyhow::Result<QueryEngine> {
    config.check_generation_files()?;
    let generator = Generator::load(&config.generation).await?;
    generator
        .attach_passage_disk(&config.data_dir.join("passages"), config.generation.passage_disk_mib)
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot keep passage blocks under {}: {e} (generation.passage_disk_mib = 0 keeps them in memory only)",
                config.data_dir.join("passages").display()
            )
        })?;
    query_engine_with(config, index, std::sync::Arc::new(generator))
}

/// The templates as the query path fills them (spotlighting and refusal phrase as configured).
pub fn prompts(config: &Config) -> anyhow::Result<Prompts> {
    Ok(Prompts::load(&config.prompts.dir)?
        .spotlight(config.safety.spotlight)
        .refusal_phrase(&config.generation.refusal_phrase))
}

/// The query path over an open index with a generation model already loaded (one model
/// serving several indexes in one process); `config.generation` is not read.
pub fn query_engine_with(
    config: &Config,
    index: Index,
    generator: crate::query::engine::SharedEngine,
) -> anyhow::Result<QueryEngine> {
    let prompts = prompts(config)?;
    let mut safety = config.safety.clone();
    if safety.embedding_check {
        // the embedding head reads vectors of the model it was trained on, only
        let head = &*crate::query::safety::dense::BUILTIN;
        let probe = index.embedder.embed_dense(&[head.probe.as_str()])?;
        if !probe.first().is_some_and(|v| head.fits(v)) {
            tracing::warn!(
                model_dir = %config.embedding.model_dir.display(),
                "safety.embedding_check is off: the embedding model is not the one the injection head was trained on (all-MiniLM-L6-v2)"
            );
            safety.embedding_check = false;
        }
    }
    Ok(QueryEngine::new(
        index,
        prompts,
        generator,
        config.limits(),
        config.generation.max_queue,
        config.generation.cache_size,
        crate::query::safety::SafetyFilter::new(safety)
            .map_err(|e| anyhow::anyhow!("safety: {e}"))?,
    ))
}

/// The upload and jobs service over an open index.
pub fn documents(
    config: &Config,
    index: &Index,
) -> anyhow::Result<crate::server::routes::documents::Documents> {
    Ok(crate::server::routes::documents::Documents {
        ingestor: Arc::new(ingestor(config, index)?),
        jobs: Default::default(),
        max_file_bytes: config.server.max_upload_bytes,
        type_limits: config.server.upload_limits.clone(),
        running: Default::default(),
    })
}

/// The HTTP server, bound and wired, with what it must wind down when it stops (ingest
/// jobs, the store, background passage precomputation).
pub struct Application {
    port: u16,
    server: Server,
    engine: Arc<QueryEngine>,
    documents: web::Data<crate::server::routes::documents::Documents>,
    shutdown_timeout: Duration,
    /// Passage blocks computed in the background (`generation.passage_precompute`).
    precompute: bool,
}

/// Refuses an address anyone on the network could reach while no key protects it.
fn check_exposure(config: &Config, addr: SocketAddr) -> anyhow::Result<()> {
    let auth = &config.auth;
    if !auth.enabled {
        tracing::warn!(
            address = %addr,
            "authentication is OFF (auth.enabled = false): anyone who reaches this address can read, upload and delete documents"
        );
        return Ok(());
    }
    if auth.keys.is_empty() && !addr.ip().is_loopback() {
        anyhow::bail!(
            "refusing to listen on {addr} without API keys: anyone on the network could read, upload and delete documents. \
             Add keys (`docent keys new --scope write` prints one and its [[auth.keys]] entry; or DOCENT_API_KEYS=key:scope for development), \
             listen on a loopback address (127.0.0.1), or turn authentication off with auth.enabled = false"
        );
    }
    Ok(())
}

fn cors(origins: &[String]) -> actix_cors::Cors {
    use actix_web::http::{header, Method};
    let mut c = actix_cors::Cors::default()
        .allowed_methods([Method::GET, Method::POST, Method::DELETE])
        .allowed_headers([header::AUTHORIZATION, header::CONTENT_TYPE, header::ACCEPT])
        .allowed_header(crate::server::observe::REQUEST_ID)
        .expose_headers([header::RETRY_AFTER])
        .expose_any_header()
        .max_age(3600);
    for o in origins {
        c = if o == "*" {
            c.allow_any_origin()
        } else {
            c.allowed_origin(o)
        };
    }
    c
}

impl Application {
    /// Binds `config.server.bind` (port 0 picks a free port) and prepares the server.
    pub fn build(config: &Config, engine: Arc<QueryEngine>) -> anyhow::Result<Self> {
        use crate::server::{auth, error, limits, observe};
        use actix_web::middleware::{from_fn, Condition, ErrorHandlers};

        let documents = web::Data::new(documents(config, &engine.index)?);
        let listener = TcpListener::bind(&config.server.bind)
            .map_err(|e| anyhow::anyhow!("cannot bind {}: {e}", config.server.bind))?;
        let addr = listener.local_addr()?;
        check_exposure(config, addr)?;
        if config.auth.enabled && !config.auth.keys.is_empty() {
            tracing::info!(keys = config.auth.keys.len(), "API keys required");
        }
        let access = auth::shared(&config.auth);
        let s = &config.server;
        let load = web::Data::new(limits::Limits::new(
            s.max_in_flight,
            Duration::from_secs(s.request_timeout_s),
        ));
        let engine_data = web::Data::from(engine.clone());
        let max_body = s.max_body_bytes;
        let origins = s.cors_origins.clone();
        let app_documents = documents.clone();
        let server = HttpServer::new(move || {
            App::new()
                .app_data(engine_data.clone())
                .app_data(app_documents.clone())
                .app_data(access.clone())
                .app_data(load.clone())
                .configure(|cfg| crate::server::routes::routes(cfg, max_body))
                // outermost last: observe → OpenAI's error shape on its paths → one error
                // shape → CORS → keys and rates (the load limits wrap each API resource:
                // routes::routes)
                .wrap(from_fn(auth::gate))
                .wrap(Condition::new(!origins.is_empty(), cors(&origins)))
                .wrap(ErrorHandlers::new().default_handler(error::normalise))
                .wrap(from_fn(crate::server::routes::openai::errors))
                .wrap(from_fn(observe::observe))
        })
        .client_request_timeout(Duration::from_secs(s.request_timeout_s))
        .shutdown_timeout(s.shutdown_timeout_s)
        // SIGTERM and SIGINT are handled in `run_until_stopped`: both stop gracefully
        .disable_signals()
        .listen(listener)?
        .run();
        // to disk only: without one, blocks computed ahead would push each other out of memory
        let precompute = config.generation.passage_precompute
            && config.generation.passage_disk_mib > 0
            && engine.engine().reuse_stats().is_some()
            && config.generation.passage_reuse
                == crate::query::generate::reuse::PassageReuse::Passages;
        Ok(Application {
            port: addr.port(),
            server,
            precompute,
            engine,
            documents,
            shutdown_timeout: Duration::from_secs(s.shutdown_timeout_s),
        })
    }

    /// The port the server listens on (the one picked when the configured port was 0).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A handle that stops the server as a signal does (tests use it).
    pub fn handle(&self) -> actix_web::dev::ServerHandle {
        self.server.handle()
    }

    /// Serves until SIGTERM or SIGINT (or [`Application::handle`]'s `stop`): then stops
    /// accepting, lets in-flight requests and ingest jobs finish within
    /// `server.shutdown_timeout_s`, and flushes the store.
    pub async fn run_until_stopped(self) -> anyhow::Result<()> {
        let handle = self.server.handle();
        let signals = tokio::spawn(async move {
            let name = wait_for_signal().await;
            tracing::info!(
                signal = name,
                "shutting down: no new connections; finishing in-flight requests"
            );
            handle.stop(true).await;
        });
        let store = &self.engine.index.store;
        let shared = !store.index().exclusive();
        let sweeper = shared.then(|| tokio::spawn(sweep(store.clone())));
        let precomputer = self
            .precompute
            .then(|| tokio::spawn(precompute(self.engine.clone())));
        self.server.await?;
        signals.abort();
        if let Some(p) = precomputer {
            p.abort();
        }
        if let Some(sweeper) = sweeper {
            sweeper.abort();
        }
        if !self.documents.wait_idle(self.shutdown_timeout).await {
            tracing::warn!(
                "ingest jobs still running after the shutdown timeout; their documents are rolled back at the next start"
            );
        }
        self.engine.index.store.flush().await?;
        tracing::info!("stopped; the store is flushed");
        Ok(())
    }
}

/// Every chunk's passage block computed while no answer is being made
/// (`generation.passage_precompute`), at start and again whenever the index changed.
async fn precompute(engine: Arc<QueryEngine>) {
    let mut done_at = None;
    loop {
        let revision = engine.index.store.revision().await.ok();
        if revision.is_some() && revision != done_at {
            match engine.precompute_passages_when_idle().await {
                Ok(p) => {
                    if p.computed > 0 || p.failed > 0 {
                        tracing::info!(
                            computed = p.computed,
                            failed = p.failed,
                            chunks = p.chunks,
                            seconds = p.seconds,
                            disk_bytes = p.disk_bytes,
                            "passage blocks computed in the background"
                        );
                    }
                    // again when the index changes (a full disk waits for that too)
                    done_at = revision;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "passage blocks not computed ahead; trying again in a minute");
                    tokio::time::sleep(Duration::from_secs(50)).await;
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
}

/// On a shared store, rolls back what dead replicas left half written, looking every
/// quarter of its stale time (at most every minute, at least every second).
async fn sweep(store: Arc<Store>) {
    let every = (store.stale_after() / 4).clamp(Duration::from_secs(1), Duration::from_secs(60));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        // each rollback is logged by the store
        if let Err(e) = store.sweep().await {
            tracing::warn!(error = %e, "could not check for unfinished ingests");
        }
    }
}

/// The first of SIGTERM and SIGINT (Ctrl-C).
async fn wait_for_signal() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut term), Ok(mut int)) => tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            },
            _ => {
                let _ = tokio::signal::ctrl_c().await;
                "SIGINT"
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        "Ctrl-C"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_addresses_need_keys_unless_auth_is_off() {
        let mut c = Config::default();
        let public: SocketAddr = "0.0.0.0:8080".parse().unwrap();
        let lan: SocketAddr = "192.168.1.5:8080".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let local6: SocketAddr = "[::1]:8080".parse().unwrap();
        assert!(check_exposure(&c, public).is_err());
        assert!(check_exposure(&c, lan).is_err());
        assert!(check_exposure(&c, local).is_ok());
        assert!(check_exposure(&c, local6).is_ok());
        c.auth.keys.push(crate::config::ApiKey {
            name: "k".into(),
            scope: crate::config::Scope::Read,
            hash: crate::config::hash_key("k"),
        });
        assert!(check_exposure(&c, public).is_ok());
        c.auth.keys.clear();
        c.auth.enabled = false;
        assert!(check_exposure(&c, public).is_ok());
    }
}
