//! The `docent` command: runs the subcommands defined in `docent_cli` (`serve`, `ingest`,
//! `ask`, `eval`, `bench`, …).

// No function over 120 lines of code (clippy.toml); tests aside.
#![warn(clippy::too_many_lines)]
#![cfg_attr(test, allow(clippy::too_many_lines))]

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use docent::config::Config;
use docent::query::{QueryRequest, RetrievalOptions};
use docent::server::{startup, telemetry};
use docent_cli::{self as cli, Bench, BenchArgs, Cli, Command, KeysAction};
use docent_ingest::pipeline::{Outcome, Progress};
use docent_ingest::store::SearchMode;
use indicatif::{ProgressBar, ProgressStyle};

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Keys {
        action: KeysAction::New { scope, name },
    } = &cli.command
    {
        return match docent::server::auth::new_key(name, *scope) {
            Ok((key, line)) => {
                println!("key (shown once; give it to the client): {key}");
                println!();
                println!("add to docent.toml:");
                println!("{line}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    if let Command::Models { json } = &cli.command {
        // listed even when the configuration does not load (it may name an unknown model)
        let configured = Config::load(cli.config.as_deref())
            .map(|c| c.generation.model)
            .ok();
        return match docent_tools::models::list(configured.as_deref(), *json) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let config = match Config::load(cli.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    telemetry::init(config.server.log_format);
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
    match runtime.block_on(run(cli, config)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Hands each command to its own function.
async fn run(cli: Cli, mut config: Config) -> anyhow::Result<ExitCode> {
    if let Some(d) = cli.data_dir {
        config.data_dir = d;
    }
    match cli.command {
        // handled before the config loads
        Command::Keys { .. } | Command::Models { .. } => Ok(ExitCode::SUCCESS),
        Command::Serve { bind } => serve(config, bind).await,
        Command::Migrate {
            to,
            collection,
            api_key,
            batch,
        } => {
            migrate(&config, &to, collection, api_key, batch).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Ingest { paths } => ingest(&config, paths).await,
        Command::EvalInjection(a) => eval_injection(config, a).await,
        Command::TrainInjection(a) => train_injection(a),
        Command::TrainRefusal(a) => train_refusal(&config, a).await,
        Command::TrainCitations(a) => train_citations(&config, a).await,
        Command::EvalPii { dataset, json } => {
            print_report(&docent_tools::eval::safety::run(&dataset)?, json)
        }
        Command::Eval(a) => eval(config, a).await,
        Command::Bench(Bench::Ingest { corpus, common }) => {
            let (peer, json) = bench_setup(common, &mut config, "scripts/bench_ingest_peer.py")?;
            let result = tokio::task::spawn_blocking(move || {
                docent_tools::bench::ingest(&config, &corpus, peer.as_ref())
            })
            .await??;
            print_report(&result, json)
        }
        Command::Bench(Bench::Prefill(a)) => bench_prefill(&config, a).await,
        Command::Bench(Bench::Load(a)) => bench_load(&config, a),
        Command::Bench(Bench::Query(a)) => bench_query(config, a).await,
        Command::Bench(Bench::Generate(a)) => bench_generate(a).await,
        Command::Precompute { json } => precompute(&config, json).await,
        Command::Ask {
            question,
            json,
            top_k,
        } => ask(&config, question, json, top_k).await,
    }
}

/// `docent serve`: the index, the query engine and the HTTP service, until stopped.
async fn serve(mut config: Config, bind: Option<String>) -> anyhow::Result<ExitCode> {
    if let Some(b) = bind {
        config.server.bind = b;
    }
    let index = startup::open_index(&config).await?;
    let engine = Arc::new(startup::query_engine(&config, index).await?);
    let app = startup::Application::build(&config, engine)?;
    tracing::info!(port = app.port(), data_dir = %config.data_dir.display(), "docent is listening");
    println!("docent is listening on port {}", app.port());
    app.run_until_stopped().await?;
    Ok(ExitCode::SUCCESS)
}

/// `docent ingest`: files and folders into the index, with a progress bar; exit code 2 when
/// a document failed.
async fn ingest(config: &Config, paths: Vec<PathBuf>) -> anyhow::Result<ExitCode> {
    let index = startup::open_index(config).await?;
    for v in index.store.recovered() {
        println!(
            "rolled back {} (an earlier ingest was interrupted); ingesting it again if listed",
            v.source
        );
    }
    let ingestor = startup::ingestor(config, &index)?;
    let bar = Bar::new();
    let report = tokio::task::spawn_blocking(move || {
        let r = ingestor.ingest_paths(&paths, &bar);
        bar.finish();
        r
    })
    .await??;
    println!(
        "ingested {} document(s) ({} chunks), {} unchanged, {} deduplicated (content already stored under another path), {} failed",
        report.ingested.len(),
        report.chunks_written(),
        report.unchanged.len(),
        report.deduplicated.len(),
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

/// `docent ask`: one question through the answer path, printed with its citations.
async fn ask(
    config: &Config,
    question: String,
    json: bool,
    top_k: Option<usize>,
) -> anyhow::Result<ExitCode> {
    let index = startup::open_index(config).await?;
    let engine = Arc::new(startup::query_engine(config, index).await?);
    let response = engine
        .answer(QueryRequest {
            question,
            retrieval: RetrievalOptions {
                top_k,
                ..Default::default()
            },
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

/// `docent eval-injection`: the second stage, the end-to-end run, single texts, or (by
/// default) the detectors on the data set's test split and the held-out sets.
async fn eval_injection(config: Config, a: cli::EvalInjection) -> anyhow::Result<ExitCode> {
    if a.model_check.is_some() || a.model_check_foreign {
        let generator = docent::query::generate::Generator::load(&config.generation).await?;
        let report = docent_tools::eval::safety::second_stage(
            &a.dataset,
            &a.heldout,
            &generator,
            a.model_check.unwrap_or(0.0),
            a.model_check_foreign,
        )
        .await?;
        return print_report(&report, a.json);
    }
    if let Some(path) = &a.e2e {
        return eval_injection_e2e(config, path, &a).await;
    }
    if !a.text.is_empty() {
        return score_injection_texts(&config, &a);
    }
    let embedder = if a.no_embedding_head {
        None
    } else {
        Some(startup::embedder(&config)?)
    };
    let report = docent_tools::eval::safety::injection(
        &a.dataset,
        &a.heldout,
        a.model.as_deref(),
        embedder.as_ref(),
    )?;
    print_report(&report, a.json)
}

/// `docent eval-injection --e2e`: planted instructions through the answer path, per set of
/// defences; every answer written to `--dump` when given.
async fn eval_injection_e2e(
    config: Config,
    path: &std::path::Path,
    a: &cli::EvalInjection,
) -> anyhow::Result<ExitCode> {
    use docent_tools::eval::injection_e2e as e2e;
    let defences = a
        .defences
        .iter()
        .map(|d| {
            e2e::Defences::parse(d.trim()).ok_or_else(|| {
                anyhow::anyhow!(
                    "--defences: no {d:?} ({})",
                    e2e::Defences::ALL.map(e2e::Defences::key).join(", ")
                )
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let cases = e2e::cases(path, a.limit)?;
    let report =
        tokio::task::spawn_blocking(move || e2e::run(&config, &cases, &defences)).await??;
    if let Some(d) = &a.dump {
        let mut out = String::new();
        for (row, outcomes) in report.rows.iter().zip(&report.outcomes) {
            for o in outcomes {
                let mut v = serde_json::to_value(o)?;
                v["defences"] = serde_json::json!(row.defences.key());
                out.push_str(&v.to_string());
                out.push('\n');
            }
        }
        std::fs::write(d, out).map_err(|e| anyhow::anyhow!("writing {}: {e}", d.display()))?;
    }
    print_report(&report, a.json)
}

/// `docent eval-injection --text …`: each text's score, the piece that decided it, and the
/// embedding head's verdict as the service reads a question.
fn score_injection_texts(config: &Config, a: &cli::EvalInjection) -> anyhow::Result<ExitCode> {
    let m = match &a.model {
        Some(p) => docent_tools::eval::safety::load_model(p)?,
        None => docent::query::safety::classifier::BUILTIN.clone(),
    };
    let vectors = if a.no_embedding_head {
        None
    } else {
        let refs: Vec<&str> = a.text.iter().map(String::as_str).collect();
        Some(startup::embedder(config)?.embed_dense(&refs)?)
    };
    let verdict = |flagged: bool| if flagged { "flagged" } else { "clean" };
    let head = &*docent::query::safety::dense::BUILTIN;
    for (i, t) in a.text.iter().enumerate() {
        let (score, piece) = m.score_with_piece(t);
        println!(
            "{score:.4} {} (threshold {:.3}): {piece}",
            verdict(score >= m.threshold),
            m.threshold
        );
        if let Some(z) = vectors.as_ref().and_then(|v| head.logit(&v[i])) {
            println!(
                "  embedding head: {z:.3} {} (threshold {:.3})",
                verdict(z >= head.threshold),
                head.threshold
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `docent train-injection`: the signal groups chosen by name, then the training run.
fn train_injection(a: cli::TrainInjection) -> anyhow::Result<ExitCode> {
    use docent::query::safety::signals::{Signal, SHIPPED_SIGNALS};
    let parse = |flag: &str, name: &str| {
        Signal::parse(name).ok_or_else(|| {
            let names: Vec<&str> = Signal::ALL.iter().map(|s| s.name()).collect();
            anyhow::anyhow!("--{flag}: no signal {name:?} (one of {})", names.join(", "))
        })
    };
    let mut signals = SHIPPED_SIGNALS;
    for name in &a.without_signals {
        signals &= !parse("without-signals", name)?.bit();
    }
    for name in &a.with_signals {
        signals |= parse("with-signals", name)?.bit();
    }
    let settings = docent_tools::train_injection::Settings {
        epochs: a.epochs,
        learning_rate: a.learning_rate,
        l2: a.l2,
        max_false_positives: a.max_false_positives,
        balance_categories: a.balance_categories,
        signals,
    };
    let report = docent_tools::train_injection::run(&a.data, &a.out, settings)?;
    print_report(&report, a.json)
}

/// `docent train-citations`: the flags as the tool's settings, then the run.
async fn train_citations(config: &Config, a: cli::TrainCitations) -> anyhow::Result<ExitCode> {
    let settings = docent_tools::train_citations::Settings {
        questions: a.questions,
        encyclo: (!a.encyclo.as_os_str().is_empty()).then_some(a.encyclo),
        examples: a.examples,
        max_tokens: a.max_tokens,
        extract: a.extract,
        c: a.c,
    };
    let report = docent_tools::train_citations::run(config, &settings).await?;
    print_report(&report, a.json)
}

/// `docent eval`: retrieval per mode on a temporary index, then (with `--answers N`) the
/// configured answer path over the first N questions.
async fn eval(mut config: Config, a: cli::Eval) -> anyhow::Result<ExitCode> {
    let answer_mode = match a.answer_mode.as_str() {
        "generative" => docent::query::AnswerMode::Generative,
        "extractive" => docent::query::AnswerMode::Extractive,
        other => anyhow::bail!("--answer-mode {other:?}: use generative or extractive"),
    };
    anyhow::ensure!(
        !a.precompute || a.answers.is_some_and(|n| n > 0),
        "--precompute goes with --answers N (it computes the blocks the answers read)"
    );
    if let Some(d) = a.model_dir {
        config.embedding.model_dir = d;
    }
    let modes = a
        .modes
        .iter()
        .map(|m| {
            SearchMode::ALL
                .into_iter()
                .find(|x| x.name() == m.trim())
                .ok_or_else(|| anyhow::anyhow!("unknown mode {m:?}: use dense, sparse or hybrid"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let data = Arc::new(docent_tools::eval::Dataset::load(&a.dataset)?);
    let d = data.clone();
    let (limit, dump) = (a.limit, a.dump);
    let evaluated = tokio::task::spawn_blocking(move || {
        docent_tools::eval::run(&config, &d, &modes, limit, dump.as_deref())
    })
    .await??;
    let mut report = evaluated.report;
    if let Some(n) = a.answers.filter(|&n| n > 0) {
        // the configured answer path, attribution and guards included (the sweep
        // re-attributes the answers it gave)
        let mut config = evaluated.config.clone();
        // the model's judgement is recorded and the configured threshold applied
        // afterwards: one run gives every threshold (see eval::answers)
        let mut threshold = config.generation.refusal_threshold;
        let probe_threshold = config.generation.refusal_probe_threshold;
        config.generation.refusal_threshold = 1.0;
        config.generation.refusal_probe_threshold = Some(f32::INFINITY);
        let engine = Arc::new(startup::query_engine(&config, evaluated.index.clone()).await?);
        if a.precompute {
            precompute_for_eval(&config, &engine).await?;
        }
        // the probe decides at its own threshold (its file's unless configured)
        if let Some((probe, _)) = engine.generator().and_then(|g| g.probe()) {
            threshold = probe_threshold.unwrap_or(probe.file.threshold);
        }
        report.answers = Some(
            docent_tools::eval::answers(
                &engine,
                &data,
                n,
                answer_mode,
                threshold,
                a.answers_dump.as_deref(),
            )
            .await?,
        );
    }
    print_report(&report, a.json)
}

/// `docent bench prefill`: first shown text with passage reuse beside full prefill (and
/// llama-server when given).
async fn bench_prefill(config: &Config, a: cli::BenchPrefill) -> anyhow::Result<ExitCode> {
    let opts = docent_tools::bench::prefill::Options {
        limit: a.limit,
        models: a.models,
        answer_tokens: a.tokens.max(1),
        llama_server: a.llama_server,
    };
    let report = docent_tools::bench::prefill::run(config, &a.dataset, &opts).await?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        docent_tools::bench::prefill::print(&report);
    }
    Ok(ExitCode::SUCCESS)
}

/// `docent bench load`: the real server under a mixed load, then killed and restarted;
/// exit code 2 when a check failed.
fn bench_load(config: &Config, a: cli::BenchLoad) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        a.clients > 0 && a.seconds > 0.0,
        "--clients and --seconds must be positive"
    );
    anyhow::ensure!(
        a.no_kill || (a.kill_after > 0.0 && a.kill_after < a.seconds),
        "--kill-after must be within --seconds (or pass --no-kill)"
    );
    let ok = docent_tools::bench::load::run(
        config,
        &docent_tools::bench::load::Options {
            docent: std::env::current_exe()?,
            corpus: a.corpus,
            clients: a.clients,
            duration: std::time::Duration::from_secs_f64(a.seconds),
            kill_after: (!a.no_kill).then(|| std::time::Duration::from_secs_f64(a.kill_after)),
            mix: a.mix,
            answer_cache: a.answer_cache,
        },
    )?;
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    })
}

/// `docent bench query`: searches over HTTP at several sizes and client counts, beside the
/// Python peer.
async fn bench_query(mut config: Config, a: cli::BenchQuery) -> anyhow::Result<ExitCode> {
    let (peer, json) = bench_setup(a.common, &mut config, "scripts/bench_query_peer.py")?;
    anyhow::ensure!(
        a.seconds > 0.0 && a.warmup >= 0.0,
        "--seconds must be positive and --warmup not negative"
    );
    let corpus = if a.corpus.is_empty() {
        default_query_corpus()
    } else {
        a.corpus
    };
    let opts = docent_tools::bench::query::Options {
        docent: std::env::current_exe()?,
        corpus,
        sizes: a.sizes,
        clients: a.clients,
        warmup: std::time::Duration::from_secs_f64(a.warmup),
        duration: std::time::Duration::from_secs_f64(a.seconds),
        top_k: a.top_k,
        queries: a.queries,
        cache: a.cache,
        peer,
        compare: 50,
    };
    let result =
        tokio::task::spawn_blocking(move || docent_tools::bench::query::run(&config, &opts))
            .await??;
    print_report(&result, json)
}

/// `docent bench generate`: the models (default: SmolLM2's GGUF files), the speculative
/// pair and the llama.cpp peer chosen from the flags, then the run.
async fn bench_generate(a: cli::BenchGenerate) -> anyhow::Result<ExitCode> {
    // candle computes on rayon's global pool: size it before anything uses it
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", a.threads.to_string());
    }
    let smollm =
        |kind: &str| PathBuf::from(format!("models/smollm2/SmolLM2-135M-Instruct.{kind}.gguf"));
    let models: Vec<PathBuf> = if a.model.is_empty() {
        ["F32", "F16", "Q8_0", "Q6_K", "Q4_K_M", "Q4_0", "Q4_1"]
            .iter()
            .map(|k| smollm(k))
            .filter(|p| p.is_file())
            .collect()
    } else {
        a.model
    };
    anyhow::ensure!(
        !models.is_empty(),
        "no model to measure: run `make setup` or pass --model"
    );
    let speculative = match a.speculative.as_slice() {
        _ if a.no_speculative => None,
        [t, d] => Some((t.clone(), d.clone(), a.gamma)),
        _ => Some((smollm("F32"), smollm("Q4_1"), a.gamma))
            .filter(|(t, d, _)| t.is_file() && d.is_file()),
    };
    let peer = python_peer(
        a.no_peer,
        a.peer_python,
        "scripts/bench_generate_peer.py",
        "scripts/bench-generate-venv.sh (or `make bench-generate`)",
    )?;
    let opts = docent_tools::bench::generate::Options {
        models,
        device: a.device,
        dtype: a.dtype,
        prompt_tokens: a.prompt_tokens,
        new_tokens: a.new_tokens,
        repeat: a.repeat,
        threads: a.threads,
        text: a.text,
        speculative,
        lookup: a.lookup,
        load: (!a.no_load && a.safetensors.is_dir()).then_some((a.safetensors, a.isq)),
        clients: a.clients.into_iter().filter(|&c| c > 0).collect(),
        workloads: a.workloads,
        schedules: a.schedules,
        memory_queries: a.memory,
        peer,
        kernels: a.kernels,
        isa: a.isa,
        prefill_chunk: a
            .prefill_chunk
            .unwrap_or(Config::default().generation.prefill_chunk_tokens),
        repack: !a.no_repack,
        llama_server: a.llama_server,
    };
    let result = docent_tools::bench::generate::run(&opts).await?;
    print_report(&result, a.json)
}

/// Applies a benchmark's `--model-dir`; returns the Python peer running `script` (unless
/// `--no-peer`; its environment must exist) and whether to print JSON.
fn bench_setup(
    args: BenchArgs,
    config: &mut Config,
    script: &str,
) -> anyhow::Result<(Option<docent_tools::bench::Peer>, bool)> {
    if let Some(d) = args.model_dir {
        config.embedding.model_dir = d;
    }
    let peer = python_peer(
        args.no_peer,
        args.peer_python,
        script,
        "scripts/bench-peer-venv.sh (or `make bench`)",
    )?;
    Ok((peer, args.json))
}

/// The Python peer running `script` in the environment of `python`, unless `--no-peer`;
/// the environment must exist (`setup` says how to make it).
fn python_peer(
    no_peer: bool,
    python: PathBuf,
    script: &str,
    setup: &str,
) -> anyhow::Result<Option<docent_tools::bench::Peer>> {
    if no_peer {
        return Ok(None);
    }
    anyhow::ensure!(
        python.is_file(),
        "{} not found: run {setup}, or pass --no-peer",
        python.display()
    );
    Ok(Some(docent_tools::bench::Peer {
        python,
        script: script.into(),
    }))
}

/// A report as its table, or as one JSON object with `--json`.
fn print_report<T: serde::Serialize + std::fmt::Display>(
    report: &T,
    json: bool,
) -> anyhow::Result<ExitCode> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        print!("{report}");
    }
    Ok(ExitCode::SUCCESS)
}

/// The demo corpus, then the Rust documentation of the active toolchain (rustup's
/// `rust-docs` component) when it is installed.
fn default_query_corpus() -> Vec<PathBuf> {
    let mut corpus = vec![PathBuf::from("../shared/data/corpus")];
    let sysroot = std::process::Command::new("rustc")
        .args(["--print", "sysroot"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    if let Some(html) = sysroot.map(|s| s.join("share/doc/rust/html")) {
        // books first, then the API documentation (std), then the other guides and
        // the other crates' documentation (core is large: mostly CPU intrinsics)
        for part in [
            "book",
            "reference",
            "nomicon",
            "cargo",
            "rust-by-example",
            "std",
            "edition-guide",
            "rustc",
            "rustdoc",
            "error_codes",
            "unstable-book",
            "embedded-book",
            "alloc",
            "core",
        ] {
            if html.join(part).is_dir() {
                corpus.push(html.join(part));
            }
        }
    }
    corpus
}

/// `docent migrate`: the configured store copied to `to`, with a progress bar.
async fn migrate(
    config: &Config,
    to: &str,
    collection: Option<String>,
    api_key: Option<String>,
    batch: usize,
) -> anyhow::Result<()> {
    use docent::config::{StoreConfig, StoreKind};
    let target = if to.starts_with("http://") || to.starts_with("https://") {
        StoreConfig {
            kind: StoreKind::Qdrant,
            url: Some(to.to_string()),
            api_key,
            collection: collection.unwrap_or_else(|| config.store.collection.clone()),
            ..config.store.clone()
        }
    } else {
        StoreConfig {
            kind: StoreKind::Edge,
            url: None,
            ..StoreConfig::default()
        }
    };
    let target_dir = PathBuf::from(to);
    if target
        .location(&target_dir)
        .same_as(&config.store.location(&config.data_dir))
    {
        anyhow::bail!(
            "--to names the configured store itself; give another URL, collection or directory"
        );
    }
    let index = startup::open_index(config).await?;
    let location = target.location(&target_dir);
    let destination = docent_ingest::store::open_index(&location, index.embedder.dim()).await?;
    println!(
        "copying {} chunks from {} to {}",
        index.store.len().await?,
        index.store.index().describe(),
        destination.describe()
    );
    let bar = MigrateBar(ProgressBar::new(0));
    bar.0.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} chunks, ETA {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let copied =
        docent_ingest::store::migrate::copy(&**index.store.index(), &*destination, batch, &bar)
            .await?;
    bar.0.finish_and_clear();
    // as after an ingest: the embedded engine builds its vector index when told (a server's
    // optimizer does it on its own)
    if destination.optimize().await? {
        println!("built the target's vector index");
    }
    println!(
        "copied {} chunks{}; the target holds {} chunks. Point [store] at it to use it.",
        copied.points,
        if copied.resumed {
            " (resumed an interrupted copy)"
        } else {
            ""
        },
        copied.target_points
    );
    Ok(())
}

struct MigrateBar(ProgressBar);

impl docent_ingest::store::migrate::Progress for MigrateBar {
    fn start(&self, total: usize, already: usize) {
        self.0.set_length(total as u64);
        self.0.set_position(already as u64);
    }
    fn advance(&self, points: usize) {
        self.0.inc(points as u64);
    }
}

/// The ingest progress bar (hidden when stderr is not a terminal): bytes of input, files,
/// chunks, chunks per second and the estimated time left.
struct Bar {
    bar: ProgressBar,
    files: std::sync::atomic::AtomicUsize,
    total_files: std::sync::atomic::AtomicUsize,
    chunks: std::sync::atomic::AtomicUsize,
    started: std::time::Instant,
}

impl Bar {
    fn new() -> Self {
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:30} {binary_bytes}/{binary_total_bytes} {msg}, ETA {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Bar {
            bar,
            files: Default::default(),
            total_files: Default::default(),
            chunks: Default::default(),
            started: std::time::Instant::now(),
        }
    }
    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl Bar {
    fn refresh(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        let chunks = self.chunks.load(Relaxed);
        let rate = chunks as f64 / self.started.elapsed().as_secs_f64().max(1e-3);
        self.bar.set_message(format!(
            "| {}/{} files | {chunks} chunks, {rate:.0}/s",
            self.files.load(Relaxed),
            self.total_files.load(Relaxed)
        ));
    }
}

impl Progress for Bar {
    fn start(&self, files: usize, bytes: u64) {
        self.total_files
            .store(files, std::sync::atomic::Ordering::Relaxed);
        self.bar.set_length(bytes);
        self.refresh();
    }
    fn advance(&self, _item: usize, chunks: usize, _total: usize, bytes: u64) {
        self.chunks
            .fetch_add(chunks, std::sync::atomic::Ordering::Relaxed);
        self.bar.inc(bytes);
        self.refresh();
    }
    fn done(&self, _item: usize, _name: &str, result: &Result<Outcome, String>) {
        self.files
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.refresh();
        if let Err(e) = result {
            self.bar.println(format!("failed: {e}"));
        }
    }
}

/// `docent train-refusal`: the flags as the tool's settings, then the run.
async fn train_refusal(config: &Config, a: cli::TrainRefusal) -> anyhow::Result<ExitCode> {
    use docent_tools::train_refusal::{Calibration, Labels, Method, Settings};
    let model = config.generation.model.display().to_string();
    let stem = model.rsplit('/').next().unwrap_or(&model).to_string();
    let corpora = a
        .corpus
        .iter()
        .map(|c| {
            c.split_once('=')
                .map(|(n, p)| (n.to_string(), PathBuf::from(p)))
                .ok_or_else(|| anyhow::anyhow!("--corpus {c:?}: write NAME=FILE"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let method = match a.method.as_str() {
        "logistic" => Method::Logistic { c: a.c },
        "mean-difference" => Method::MeanDifference { scaled: false },
        "scaled-difference" => Method::MeanDifference { scaled: true },
        other => {
            anyhow::bail!("--method {other:?}: logistic, mean-difference or scaled-difference")
        }
    };
    let labels = match a.labels.as_str() {
        "corpus" => Labels::Corpus,
        "passages" => Labels::Passages,
        other => anyhow::bail!("--labels {other:?}: corpus or passages"),
    };
    let settings = Settings {
        labels,
        questions: a.questions,
        corpora,
        encyclo: (!a.encyclo.as_os_str().is_empty()).then_some(a.encyclo),
        examples: a.examples,
        states: a
            .states
            .unwrap_or_else(|| format!("training/refusal/{stem}.states").into()),
        out: a
            .out
            .unwrap_or_else(|| format!("training/refusal/probes/{stem}.refusal.json").into()),
        layer: a.layer,
        method,
        max_false_refusals: a.max_false_refusals,
        rebuild: a.rebuild,
        extract: a.extract,
        time: a.time,
        calibration: (!a.calibration.as_os_str().is_empty()).then(|| Calibration {
            examples: a.calibration.with_file_name("calibration-examples.jsonl"),
            states: format!("training/refusal/{stem}.calibration.states").into(),
            questions: a.calibration,
        }),
    };
    let report = docent_tools::train_refusal::run(config, &settings).await?;
    print_report(&report, a.json)
}

/// `docent eval --precompute`: every chunk's block computed and the memory emptied, so that
/// the answers read their blocks back from disk.
async fn precompute_for_eval(
    config: &docent::config::Config,
    engine: &docent::query::QueryEngine,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        engine.engine().reuse_stats().is_some(),
        "--precompute: passage reuse is not possible with this model (see the warning above)"
    );
    anyhow::ensure!(
        config.generation.passage_reuse == docent::query::generate::reuse::PassageReuse::Passages
            && config.generation.passage_disk_mib > 0,
        "--precompute needs generation.passage_reuse = \"passages\" and passage_disk_mib > 0"
    );
    // on disk once this returns (it waits for the writes)
    let done = engine.precompute_passages(&|_, _| {}).await?;
    engine.engine().clear_passages();
    eprintln!(
        "eval: {} passage blocks computed ahead in {:.0} s ({} bytes on disk); the answers read them back",
        done.computed, done.seconds, done.disk_bytes
    );
    Ok(())
}

/// `docent precompute`: every chunk's passage block, to disk beside the index.
async fn precompute(config: &docent::config::Config, json: bool) -> anyhow::Result<ExitCode> {
    use docent::query::generate::reuse::PassageReuse;
    if config.generation.passage_reuse != PassageReuse::Passages {
        anyhow::bail!(
            "docent precompute computes passages' keys and values for generation.passage_reuse = \"passages\" (now {:?}): set it in docent.toml or DOCENT_GENERATION__PASSAGE_REUSE=passages",
            config.generation.passage_reuse
        );
    }
    if config.generation.passage_disk_mib == 0 {
        tracing::warn!("generation.passage_disk_mib = 0: the blocks stay in this process's memory and are lost when it ends");
    }
    let index = startup::open_index(config).await?;
    let engine = startup::query_engine(config, index).await?;
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} chunks, {elapsed} ({eta} left)",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let report = engine
        .precompute_passages(&|done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        })
        .await?;
    bar.finish_and_clear();
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "{} chunks of {} documents: {} computed, {} already kept, {} left to the questions (not clean for the safety filter) in {:.1} s; on disk {} blocks, {:.1} MiB",
            report.chunks,
            report.documents,
            report.computed,
            report.chunks - report.computed - report.skipped,
            report.skipped,
            report.seconds,
            report.disk_files,
            report.disk_bytes as f64 / (1 << 20) as f64
        );
    }
    Ok(ExitCode::SUCCESS)
}
