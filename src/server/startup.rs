//! Wiring: opens the index, loads the models and binds the HTTP server. Tests use
//! [`Application::build`] with port 0 to run the real server on a random port.

use std::net::TcpListener;
use std::sync::Arc;

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

/// Opens the embedder and the store (what both ingest and query need): the embedded
/// engine in `data_dir`, or the Qdrant server `[store]` names.
pub async fn open_index(config: &Config) -> anyhow::Result<Index> {
    config.check_embedding_files()?;
    let e = &config.embedding;
    let embedder = Arc::new(Embedder::load(EmbedderConfig {
        model_dir: e.model_dir.clone(),
        ort_library: e.ort_library.clone(),
        max_length: e.max_length,
        threads: e.threads,
        batch_size: e.batch_size,
    })?);
    let location = config.store.location(&config.data_dir);
    let engine = docent_ingest::store::open_index(&location, embedder.dim()).await?;
    let store = Arc::new(
        Store::open(
            engine,
            &Identity::new(embedder.model_sha256(), embedder.dim()),
        )
        .await?,
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
        pipeline,
    ))
}

/// The query path over an open index: loads the templates and the generation model.
pub async fn query_engine(config: &Config, index: Index) -> anyhow::Result<QueryEngine> {
    config.check_generation_files()?;
    let prompts = Prompts::load(&config.prompts.dir)?;
    let generator = Generator::load(&config.generation).await?;
    Ok(QueryEngine::new(
        index,
        prompts,
        generator,
        config.limits(),
        config.generation.max_queue,
        config.generation.cache_size,
        crate::query::safety::Filter::new(config.safety.clone())
            .map_err(|e| anyhow::anyhow!("safety: {e}"))?,
    ))
}

pub struct Application {
    port: u16,
    server: Server,
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
    })
}

impl Application {
    /// Binds `config.server.bind` (port 0 picks a free port) and prepares the server.
    pub fn build(config: &Config, engine: Arc<QueryEngine>) -> anyhow::Result<Self> {
        let documents = web::Data::new(documents(config, &engine.index)?);
        let listener = TcpListener::bind(&config.server.bind)
            .map_err(|e| anyhow::anyhow!("cannot bind {}: {e}", config.server.bind))?;
        let port = listener.local_addr()?.port();
        let engine = web::Data::from(engine);
        let max_body = config.server.max_body_bytes;
        let server = HttpServer::new(move || {
            App::new()
                .wrap(tracing_actix())
                .app_data(engine.clone())
                .app_data(documents.clone())
                .configure(|cfg| crate::server::routes::routes(cfg, max_body))
        })
        .listen(listener)?
        .run();
        Ok(Application { port, server })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub async fn run_until_stopped(self) -> std::io::Result<()> {
        self.server.await
    }
}

fn tracing_actix() -> actix_web::middleware::Logger {
    actix_web::middleware::Logger::new("%r %s %Dms")
}
