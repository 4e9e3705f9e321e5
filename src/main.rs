//! The `docent` command: `serve`, `ingest`, `ask`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use docent::config::Config;
use docent::query::{QueryRequest, RetrievalOptions};
use docent::{startup, telemetry};
use docent_ingest::pipeline::{Outcome, Progress};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Parser)]
#[command(
    name = "docent",
    version,
    about = "Ask questions over your documents; answers cite their sources."
)]
struct Cli {
    /// Config file (default: ./docent.toml when present). DOCENT_* variables override it.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// Index directory (overrides data_dir).
    #[arg(long, global = true)]
    data_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the HTTP service.
    Serve {
        /// Address to listen on, e.g. 127.0.0.1:8080 (overrides server.bind).
        #[arg(long)]
        bind: Option<String>,
    },
    /// Add files or directories (.txt, .md, .html, .pdf, .docx) to the index.
    Ingest {
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Answer one question from the command line (same path as POST /v1/query).
    Ask {
        question: String,
        /// Print the full JSON response.
        #[arg(long)]
        json: bool,
        /// Number of chunks to retrieve.
        #[arg(long)]
        top_k: Option<usize>,
    },
}

fn main() -> ExitCode {
    telemetry::init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let mut config = Config::load(cli.config.as_deref())?;
    if let Some(d) = cli.data_dir {
        config.data_dir = d;
    }
    match cli.command {
        Command::Serve { bind } => {
            if let Some(b) = bind {
                config.server.bind = b;
            }
            let index = startup::open_index(&config)?;
            let engine = Arc::new(startup::query_engine(&config, index).await?);
            let app = startup::Application::build(&config, engine)?;
            tracing::info!(port = app.port(), data_dir = %config.data_dir.display(), "docent is listening");
            app.run_until_stopped().await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Ingest { paths } => {
            let index = startup::open_index(&config)?;
            let ingestor = startup::ingestor(&config, &index)?;
            let bar = Bar::new();
            let report = tokio::task::spawn_blocking(move || {
                let r = ingestor.ingest_paths(&paths, &bar);
                bar.finish();
                r
            })
            .await??;
            println!(
                "ingested {} document(s) ({} chunks), {} unchanged, {} failed",
                report.ingested.len(),
                report.chunks_written(),
                report.unchanged.len(),
                report.failed.len()
            );
            for (_, error) in &report.failed {
                println!("  failed: {error}");
            }
            if !report.skipped.is_empty() {
                println!(
                    "skipped {} file(s) of unsupported types (supported: {})",
                    report.skipped.len(),
                    docent_ingest::load::SUPPORTED_EXTENSIONS.join(", ")
                );
            }
            Ok(if report.failed.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(2)
            })
        }
        Command::Ask {
            question,
            json,
            top_k,
        } => {
            let index = startup::open_index(&config)?;
            let engine = startup::query_engine(&config, index).await?;
            let response = engine
                .answer(QueryRequest {
                    question,
                    retrieval: RetrievalOptions { top_k },
                    ..Default::default()
                })
                .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&response)?);
            } else {
                println!("{}\n", response.answer);
                for c in &response.citations {
                    println!(
                        "[{}] {} ({}, bytes {}..{})\n    \"{}\"",
                        c.n, c.title, c.source, c.span.start, c.span.end, c.quote
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The ingest progress bar (hidden when stderr is not a terminal).
struct Bar(ProgressBar);

impl Bar {
    fn new() -> Self {
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} files, ETA {eta} {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Bar(bar)
    }
    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

impl Progress for Bar {
    fn start(&self, files: usize) {
        self.0.set_length(files as u64);
    }
    fn file_done(&self, path: &Path, result: &Result<Outcome, String>) {
        self.0.inc(1);
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        match result {
            Ok(Outcome::Ingested { chunks, .. }) => {
                self.0.set_message(format!("{name}: {chunks} chunks"))
            }
            Ok(Outcome::Unchanged { .. }) => self.0.set_message(format!("{name}: unchanged")),
            Err(e) => self.0.println(format!("failed: {e}")),
        }
    }
}
