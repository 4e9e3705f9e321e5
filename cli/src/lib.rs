//! The `docent` command line: every subcommand and flag, as clap parses them. The binary
//! (`src/main.rs`) runs them, handing the service's commands to the `docent` crate and the
//! measuring ones to `docent-tools`; the definitions are a library so that tests can read
//! them (the documentation check compares the docs with `Cli::command()`).

// Every public item says what it is (as in the other library crates).
#![warn(missing_docs)]
// No function over 120 lines of code (clippy.toml); tests aside.
#![warn(clippy::too_many_lines)]
#![cfg_attr(test, allow(clippy::too_many_lines))]

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// The whole command line: the global flags and the subcommand.
#[derive(Parser)]
#[command(
    name = "docent",
    version,
    about = "Ask questions over your documents; answers cite their sources."
)]
pub struct Cli {
    /// Config file (default: ./docent.toml when present). DOCENT_* variables override it.
    #[arg(long, global = true)]
    pub config: Option<PathBuf>,
    /// Index directory (overrides data_dir).
    #[arg(long, global = true)]
    pub data_dir: Option<PathBuf>,
    /// The subcommand to run.
    #[command(subcommand)]
    pub command: Command,
}

/// What `docent keys` does.
#[derive(Subcommand)]
pub enum KeysAction {
    /// Make a random key; prints it once, and the `[[auth.keys]]` entry (its hash) to add.
    New {
        /// `read` (query, search, list) or `write` (also upload and delete).
        #[arg(long)]
        scope: docent::config::Scope,
        /// A label for logs and metrics.
        #[arg(long, default_value = "default")]
        name: String,
    },
}

// Parsed once per process; the bench variants are large, and boxing them buys nothing.
/// docent's subcommands.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub enum Command {
    /// Run the HTTP service.
    Serve {
        /// Address to listen on, e.g. 127.0.0.1:8080 (overrides server.bind).
        #[arg(long)]
        bind: Option<String>,
    },
    /// API keys: `docent keys new --scope read` prints a new key and its config entry.
    Keys {
        /// What to do with keys.
        #[command(subcommand)]
        action: KeysAction,
    },
    /// The generation models docent knows by name (models.toml): size, licence, where they
    /// come from, whether `make setup` has installed them, and which one is configured.
    Models {
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Add files or directories (.txt, .md, .html, .pdf, .docx) to the index.
    Ingest {
        /// Files or directories to add.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Copy the index (every chunk with its vectors, and the document catalog) to another
    /// engine: a Qdrant server (`--to http://host:6334`) or the embedded engine in a
    /// directory (`--to ./data`). The source is the configured store. Interrupted, it
    /// resumes where it stopped when run again.
    Migrate {
        /// The target: a server's gRPC URL (http:// or https://) or a directory.
        #[arg(long)]
        to: String,
        /// Collection on a target server (default: store.collection).
        #[arg(long)]
        collection: Option<String>,
        /// API key of a target server.
        #[arg(long, env = "QDRANT_API_KEY", hide_env_values = true)]
        api_key: Option<String>,
        /// Points per batch.
        #[arg(long, default_value_t = 256)]
        batch: usize,
    },
    /// Compute every chunk's passage keys and values ahead of the questions
    /// (`generation.passage_reuse = "passages"`): they go to disk beside the index
    /// (`generation.passage_disk_mib`), so the first question that retrieves a chunk places
    /// them instead of computing them. Chunks already on disk are skipped; run it again
    /// after ingesting.
    Precompute {
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Answer one question from the command line (same path as POST /v1/query).
    Ask {
        /// The question to answer.
        question: String,
        /// Print the full JSON response.
        #[arg(long)]
        json: bool,
        /// Number of chunks to retrieve.
        #[arg(long)]
        top_k: Option<usize>,
    },
    /// Retrieval quality on a BEIR-layout set (corpus.jsonl, queries.jsonl, qrels/test.tsv),
    /// ingested into a temporary index: Recall@1/5/10, MRR@10, nDCG@10, latency per mode.
    Eval(Eval),
    /// Precision and recall of the PII detector per kind on a labelled set.
    EvalPii {
        /// Presidio-style JSON (full_text + spans).
        #[arg(default_value = "../shared/data/safety/pii-presidio-synth/synth_dataset_v2.json")]
        dataset: PathBuf,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Prompt-injection detection per attack category and false positives per benign one
    /// (rules, classifier, both), on texts no training saw; and the classifier's cost.
    EvalInjection(EvalInjection),
    /// Train the prompt-injection classifier on training/injection's data set (made by
    /// `python3 training/injection/make_dataset.py`); the threshold is chosen on its dev split.
    TrainInjection(TrainInjection),
    /// Train the refusal probe of the generation model (`generation.model`) on our own
    /// questions: examples with their retrieved passages, the model's hidden states at each
    /// prompt's last token, then the direction and its threshold on the dev split. Each step
    /// is kept in its file; with the committed files it reproduces the shipped probe.
    TrainRefusal(TrainRefusal),
    /// Measure which signal finds the citations the model writes whose passage does not
    /// hold the answer (the marker's hidden state, the support check, both), on the refusal
    /// examples' retrieved passages, answered by the generation model.
    TrainCitations(TrainCitations),
    /// Measure throughput against a limit and a peer (prints a table).
    #[command(subcommand)]
    Bench(Bench),
}

// Parsed once per process: the size of its largest variant costs nothing.
/// `docent bench`'s benchmarks.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub enum Bench {
    /// Ingest a corpus end to end into a temporary index; beside it, the same chunks
    /// through a bare ONNX Runtime session and a Python peer.
    Ingest {
        /// Directory of documents (default: the demo corpus, ../shared/data/corpus/rust-book).
        #[arg(default_value = "../shared/data/corpus/rust-book")]
        corpus: PathBuf,
        /// Options every benchmark takes.
        #[command(flatten)]
        common: BenchArgs,
    },
    /// Time to the first shown text of RAG answers with passage reuse (cold and warm)
    /// against full prefill, through the answer path, per model.
    Prefill(BenchPrefill),
    /// The real server under a mixed load (searches, answers, document lists, uploads; API
    /// keys on): statuses and p50/p99 per route, RSS; then the same load with a SIGKILL and
    /// a restart, checking that every upload acknowledged as done survived.
    Load(BenchLoad),
    /// Retrieval latency and throughput through POST /v1/search at several client counts
    /// and index sizes; beside it, a Python peer service over the same index files.
    Query(BenchQuery),
    /// Generation speed (prefill, decode, time to first token) per weight format beside
    /// llama.cpp on the same files; speculative decoding; model load times.
    Generate(BenchGenerate),
}

/// Options every benchmark takes.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// Embedding model directory (overrides embedding.model_dir), e.g. the int8 model.
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// Python of the peer's environment (made by scripts/bench-peer-venv.sh).
    #[arg(long, default_value = "models/.venv-peer/bin/python")]
    pub peer_python: PathBuf,
    /// Skip the Python peer.
    #[arg(long)]
    pub no_peer: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// `docent train-citations`' flags.
#[derive(clap::Args)]
pub struct TrainCitations {
    /// Our questions, for their gold answers.
    #[arg(long, default_value = "training/refusal/questions.jsonl")]
    pub questions: PathBuf,
    /// encyclo-factoid's folder, for its dev half's answers ("" for none).
    #[arg(long, default_value = "eval/encyclo-factoid")]
    pub encyclo: PathBuf,
    /// The refusal probe's examples (made by `docent train-refusal`), answered by the model.
    #[arg(long, default_value = "training/refusal/examples.jsonl")]
    pub examples: PathBuf,
    /// Tokens per answer.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Answer again (the answers and states are kept in ~/.cache/docent-models).
    #[arg(long)]
    pub extract: bool,
    /// The marker probes' logistic regression C (inverse L2 penalty).
    #[arg(long, default_value_t = docent_tools::train_refusal::DEFAULT_C)]
    pub c: f64,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `docent train-refusal`'s flags.
#[derive(clap::Args)]
pub struct TrainRefusal {
    /// The questions (over the corpora below).
    #[arg(long, default_value = "training/refusal/questions.jsonl")]
    pub questions: PathBuf,
    /// The corpora the questions name, as NAME=CORPUS.jsonl.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "rust-book=eval/rust-book-natural/corpus.jsonl,rfcs=eval/rfcs-long/corpus.jsonl"
    )]
    pub corpus: Vec<String>,
    /// encyclo-factoid's folder: its dev half's questions are used too ("" for none).
    #[arg(long, default_value = "eval/encyclo-factoid")]
    pub encyclo: PathBuf,
    /// The examples (made when missing, or with --rebuild).
    #[arg(long, default_value = "training/refusal/examples.jsonl")]
    pub examples: PathBuf,
    /// The hidden states at --layer (made when missing, or with --extract, which keeps
    /// every layer's in ~/.cache/docent-models/refusal-states and prints the sweep).
    #[arg(long)]
    pub states: Option<PathBuf>,
    /// Where the probe is written (default: training/refusal/probes/<model>.refusal.json).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The layer read (0: after the first decoder layer).
    #[arg(long, default_value_t = docent_tools::train_refusal::DEFAULT_LAYER)]
    pub layer: usize,
    /// How the probe is fitted: logistic (an L2-regularised logistic regression on
    /// standardised states), mean-difference (the difference of the class means), or
    /// scaled-difference (that, divided per dimension by the pooled variance).
    #[arg(long, default_value = "logistic")]
    pub method: String,
    /// The logistic regression's C (inverse L2 penalty).
    #[arg(long, default_value_t = docent_tools::train_refusal::DEFAULT_C)]
    pub c: f64,
    /// What a training example's label says: corpus (our questions' retrieved examples
    /// labelled by whether the corpus answers the question, answer-removed variants left
    /// out; the shipped probes) or passages (whether the retrieved passages hold the gold
    /// answer, answer-removed variants in: the recipe before 2026-11-30).
    #[arg(long, default_value = "corpus")]
    pub labels: String,
    /// Natural questions written apart, to choose the threshold on ("" for none: then
    /// dev's examples choose it).
    #[arg(long, default_value = "training/refusal/calibration.jsonl")]
    pub calibration: PathBuf,
    /// Highest share of the calibration set's answerable questions (without one, of dev's
    /// examples whose passages hold the answer) that may be refused.
    #[arg(long, default_value_t = 0.05)]
    pub max_false_refusals: f64,
    /// Make the examples again, even when their file exists.
    #[arg(long)]
    pub rebuild: bool,
    /// Read the hidden states again, even when they are kept.
    #[arg(long)]
    pub extract: bool,
    /// Also time what reading the states adds to a prefill, over this many examples.
    #[arg(long, default_value_t = 0)]
    pub time: usize,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `docent eval`'s flags.
#[derive(clap::Args)]
pub struct Eval {
    /// Dataset directory, e.g. ../shared/data/eval/xquad-en.
    #[arg(long)]
    pub dataset: PathBuf,
    /// Comma-separated modes to evaluate.
    #[arg(long, default_value = "dense,sparse,hybrid", value_delimiter = ',')]
    pub modes: Vec<String>,
    /// Evaluate only the first N queries (that have relevant documents).
    #[arg(long)]
    pub limit: Option<usize>,
    /// Embedding model directory (overrides embedding.model_dir), e.g. the int8 model.
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// Also answer the first N questions with the LLM and score the answers.
    #[arg(long)]
    pub answers: Option<usize>,
    /// How `--answers` are made: generative (the model) or extractive (quoted sentences).
    #[arg(long, default_value = "generative")]
    pub answer_mode: String,
    /// Print one JSON object keyed by mode instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Also write each question's dense and BM25 candidate lists (JSON lines) to this
    /// file, for analysis outside docent.
    #[arg(long)]
    pub dump: Option<PathBuf>,
    /// With --answers: write each answer (text, refusal, the model's judgement,
    /// timings) as JSON lines to this file.
    #[arg(long)]
    pub answers_dump: Option<PathBuf>,
    /// With --answers and `generation.passage_reuse = "passages"`: compute every chunk's
    /// passage block ahead (as `docent precompute` does), empty the memory, and answer
    /// with the blocks read back from disk (what a precomputed service answers with).
    #[arg(long)]
    pub precompute: bool,
}

/// `docent eval-injection`'s flags.
#[derive(clap::Args)]
pub struct EvalInjection {
    /// The data set made by training/injection/make_dataset.py (its test split is used).
    #[arg(long, default_value = "training/injection/dataset.jsonl")]
    pub dataset: PathBuf,
    /// A folder of held-out sets written apart from the training data, one
    /// `<category>.jsonl` each (`{"text", "label"}` per line).
    #[arg(long, default_value = "training/injection/heldout")]
    pub heldout: PathBuf,
    /// Score with this model file instead of the one built in (e.g. one just trained).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Only score these texts: each one's probability, the piece that decided it, and
    /// whether it is flagged.
    #[arg(long)]
    pub text: Vec<String>,
    /// End to end instead: ingest this set's documents (each with a planted
    /// instruction) into a fresh index, ask its questions with the configured model,
    /// and count the answers that carry the instruction out.
    #[arg(long)]
    pub e2e: Option<PathBuf>,
    /// With --e2e: this many cases, spread over the set.
    #[arg(long)]
    pub limit: Option<usize>,
    /// With --e2e: the sets of defences to measure (all, no-classifier,
    /// no-second-stage, no-embedding-head, no-answer-check, none).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "all,no-classifier,no-answer-check,none"
    )]
    pub defences: Vec<String>,
    /// With --e2e: write every answer here (JSON lines).
    #[arg(long)]
    pub dump: Option<PathBuf>,
    /// Leave out the embedding head's column (no embedding model is loaded).
    #[arg(long)]
    pub no_embedding_head: bool,
    /// Measure the second stage instead: texts the built-in classifier scores this far
    /// below its threshold are asked of the configured model.
    #[arg(long)]
    pub model_check: Option<f32>,
    /// With the second stage: also ask about every text under the threshold that is
    /// written in another language than English (`safety.model_check_foreign`); alone,
    /// only those.
    #[arg(long)]
    pub model_check_foreign: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `docent train-injection`'s flags.
#[derive(clap::Args)]
pub struct TrainInjection {
    /// The data set made by training/injection/make_dataset.py.
    #[arg(long, default_value = "training/injection/dataset.jsonl")]
    pub data: PathBuf,
    /// Where the trained model is written (default: the built-in one's file).
    #[arg(long, default_value = "src/query/safety/injection.model")]
    pub out: PathBuf,
    /// Passes over the training split.
    #[arg(long, default_value_t = 20)]
    pub epochs: usize,
    /// AdaGrad's base learning rate.
    #[arg(long, default_value_t = 0.3)]
    pub learning_rate: f32,
    /// L2 penalty per update.
    #[arg(long, default_value_t = 3e-4)]
    pub l2: f32,
    /// Highest false-positive rate allowed on each benign dev category.
    #[arg(long, default_value_t = 0.005)]
    pub max_false_positives: f64,
    /// Give every attack category the same weight (default: every attack text).
    #[arg(long)]
    pub balance_categories: bool,
    /// Signal groups to leave out of the shipped set (comma-separated: ai_addressee,
    /// imperative, directive, shift, encoded, exfiltration), to measure what each is
    /// worth.
    #[arg(long, value_delimiter = ',')]
    pub without_signals: Vec<String>,
    /// Signal groups to add that the shipped model leaves out (addressee: a change of
    /// addressee).
    #[arg(long, value_delimiter = ',')]
    pub with_signals: Vec<String>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `docent bench prefill`'s flags.
#[derive(clap::Args)]
pub struct BenchPrefill {
    /// BEIR-layout set whose corpus is indexed and whose answerable questions are asked.
    #[arg(long, default_value = "eval/rust-book-natural")]
    pub dataset: PathBuf,
    /// Questions asked (the first answerable ones).
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
    /// Generation models (catalog names or paths; default: the configured one).
    #[arg(long, value_delimiter = ',')]
    pub models: Vec<String>,
    /// Answer tokens per question (the first shown text is what is timed).
    #[arg(long, default_value_t = 4)]
    pub tokens: usize,
    /// A llama-server binary (scripts/llama-server-build.sh): the same prompts on it,
    /// with its prompt cache, one slot, the same model file.
    #[arg(long)]
    pub llama_server: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `docent bench load`'s flags.
#[derive(clap::Args)]
pub struct BenchLoad {
    /// Directory of Markdown files for the starting index and the uploads.
    #[arg(long, default_value = "../shared/data/corpus/rust-book/src")]
    pub corpus: PathBuf,
    /// Concurrent clients (one keep-alive connection each).
    #[arg(long, default_value_t = 64)]
    pub clients: usize,
    /// Seconds of load in each of the two runs.
    #[arg(long, default_value_t = 120.0)]
    pub seconds: f64,
    /// Seconds into the second run at which the server is SIGKILLed.
    #[arg(long, default_value_t = 60.0)]
    pub kill_after: f64,
    /// Only the first run (no SIGKILL and restart).
    #[arg(long)]
    pub no_kill: bool,
    /// Request mix as weights, e.g. `search=1` or `upload=1,search=3`.
    #[arg(
        long,
        default_value = "search=55,extractive=20,generated=12,list=8,upload=5"
    )]
    pub mix: docent_tools::bench::load::Mix,
    /// Keep the answer cache on. Off by default: the load repeats a fixed list of
    /// questions, so with the cache on a generated answer is made once per question and
    /// every later one is a lookup, which measures the cache, not generation.
    #[arg(long)]
    pub answer_cache: bool,
}

/// `docent bench query`'s flags.
#[derive(clap::Args)]
pub struct BenchQuery {
    /// Directories or files to build the indexes from, in this order (default: the demo
    /// corpus, then the Rust documentation that rustup installs, for the larger sizes).
    #[arg(long)]
    pub corpus: Vec<PathBuf>,
    /// Index sizes in chunks.
    #[arg(long, default_value = "10000,100000", value_delimiter = ',')]
    pub sizes: Vec<usize>,
    /// Concurrent clients (one keep-alive connection each).
    #[arg(long, default_value = "1,4,16", value_delimiter = ',')]
    pub clients: Vec<usize>,
    /// Seconds measured per cell, after --warmup seconds not measured.
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// Seconds of warm-up per cell, not measured.
    #[arg(long, default_value_t = 2.0)]
    pub warmup: f64,
    /// Chunks per search.
    #[arg(long, default_value_t = 5)]
    pub top_k: usize,
    /// Questions (BEIR queries.jsonl), cycled.
    #[arg(long, default_value = "../shared/data/eval/squad-v1.1/queries.jsonl")]
    pub queries: PathBuf,
    /// Where the indexes are built and kept between runs.
    #[arg(long, default_value = "models/bench-indexes")]
    pub cache: PathBuf,
    /// Options every benchmark takes.
    #[command(flatten)]
    pub common: BenchArgs,
}

/// `docent bench generate`'s flags.
#[derive(clap::Args)]
pub struct BenchGenerate {
    /// Models to measure (default: the SmolLM2 GGUF files in models/smollm2).
    #[arg(long)]
    pub model: Vec<PathBuf>,
    /// Activation dtype.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Device of every engine (generation.device: cpu, cuda, cuda:N, auto); on a GPU the
    /// llama.cpp peer runs there too.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Prompt lengths in tokens.
    #[arg(long, default_value = "600,1200", value_delimiter = ',')]
    pub prompt_tokens: Vec<usize>,
    /// Tokens generated per run.
    #[arg(long, default_value_t = 128)]
    pub new_tokens: usize,
    /// Runs per cell (the tables show their medians).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Compute threads (RAYON_NUM_THREADS for candle, n_threads for llama.cpp).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Text the prompts are cut from.
    #[arg(
        long,
        default_value = "../shared/data/corpus/rust-book/src/ch04-01-what-is-ownership.md"
    )]
    pub text: PathBuf,
    /// Speculative decoding target and draft (default: the F32 and Q4_1 files).
    #[arg(long, num_args = 2, value_names = ["TARGET", "DRAFT"])]
    pub speculative: Vec<PathBuf>,
    /// Tokens the draft model proposes per speculative step.
    #[arg(long, default_value_t = 4)]
    pub gamma: usize,
    /// Prompt-lookup drafts of up to N tokens (`generation.lookup_tokens`): a row for the
    /// speculative target and one for its draft model, each beside its plain decoding
    /// (0: skip).
    #[arg(long, default_value_t = 4)]
    pub lookup: usize,
    /// Skip the speculative comparison.
    #[arg(long)]
    pub no_speculative: bool,
    /// Safetensors directory for the load-time table (default: the SmolLM2 export).
    #[arg(long, default_value = "models/smollm2/SmolLM2-135M-Instruct-hf")]
    pub safetensors: PathBuf,
    /// In-situ quantization type for the safetensors export (its load times and speed row).
    #[arg(long, default_value = "q8_0")]
    pub isq: String,
    /// Skip the load-time table.
    #[arg(long)]
    pub no_load: bool,
    /// Concurrent clients for the throughput table (`--clients` with no value: skip).
    #[arg(long, default_value = "1,4,16", value_delimiter = ',', num_args = 0..)]
    pub clients: Vec<usize>,
    /// Workloads of the throughput table: `rag` (300-token prompts, 32 new tokens),
    /// `chat` (24–80-token prompts, 128 new).
    #[arg(long, default_value = "rag,chat", value_delimiter = ',')]
    pub workloads: Vec<String>,
    /// Schedules of the throughput table: `arrival` and `cohort` (`generation.schedule`,
    /// with continuous batching), `off` (no continuous batching).
    #[arg(long, default_value = "arrival,cohort,off", value_delimiter = ',')]
    pub schedules: Vec<String>,
    /// Distinct prompts for the memory check (0: skip).
    #[arg(long, default_value_t = 1000)]
    pub memory: usize,
    /// Python of the llama.cpp peer (made by scripts/bench-generate-venv.sh).
    #[arg(long, default_value = "models/.venv-llama/bin/python")]
    pub peer_python: PathBuf,
    /// A llama-server binary (scripts/llama-server-build.sh): the concurrency table's
    /// `rag` rows run on it too, one slot per client, same file and prompts.
    #[arg(long)]
    pub llama_server: Option<PathBuf>,
    /// Skip the llama.cpp peer.
    #[arg(long)]
    pub no_peer: bool,
    /// CPU kernels: docent (kernels/) or candle (mistral.rs's and candle's own).
    #[arg(long, default_value = "docent")]
    pub kernels: String,
    /// Instruction-set cap of docent's kernels: auto, avx512, avx2 or scalar.
    #[arg(long, default_value = "auto")]
    pub isa: String,
    /// Prompt tokens per prefill chunk (0: whole prompts; default: the service's).
    #[arg(long)]
    pub prefill_chunk: Option<usize>,
    /// Keep the weights in the file's layout (`generation.repack = false`: no Q5_0 → Q8_0,
    /// no Q4_K interleaving).
    #[arg(long)]
    pub no_repack: bool,
    /// Print one JSON object instead of the tables.
    #[arg(long)]
    pub json: bool,
}
