//! Loading a model: where the weights come from (GGUF, safetensors, UQFF, the hub), the
//! engine's process-wide settings, the pipeline on its device, the tokenizer, and the
//! passage cache that goes with the model.

use super::*;

/// The passage cache of a model under `config` (`generation.passage_reuse`): `None` when
/// off, or, with a warning, when the model is not a GGUF file whose RoPE docent can turn.
pub(super) fn passage_cache(
    config: &GenerationConfig,
    source: &Source,
) -> Option<Arc<reuse::PassageCache>> {
    if config.passage_reuse == reuse::PassageReuse::Off {
        return None;
    }
    // blocks are placed by continuous batching's chunked prefill, and a draft model's cache
    // would not hold them
    if config.draft.is_some() || !config.continuous_batching {
        tracing::warn!(
            "generation.passage_reuse is on (the default) but needs generation.continuous_batching = true and no generation.draft: prompts are prefilled whole (set passage_reuse = \"off\" to silence this)"
        );
        return None;
    }
    let found = match source {
        Source::Gguf { dir, file } => {
            let path = dir.join(file);
            reuse::Rope::of_gguf(&path).map(|rope| (rope, path))
        }
        _ => None,
    };
    match found {
        Some((rope, path)) => {
            let mut cache = reuse::PassageCache::new(rope, config.passage_cache_mib << 20);
            cache.model_file = path;
            Some(Arc::new(cache))
        }
        None => {
            tracing::warn!(
                model = %config.model.display(),
                "generation.passage_reuse needs a GGUF model on the llama, mistral3 or qwen2 decoder: prompts are prefilled whole"
            );
            None
        }
    }
}

/// Where the weights come from.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Source {
    /// A GGUF file (quantized or not).
    Gguf { dir: PathBuf, file: String },
    /// A directory with `config.json`, `tokenizer.json` and `*.safetensors`.
    Safetensors { dir: PathBuf },
    /// A directory written by an earlier ISQ run (`generation.uqff`).
    Uqff { dir: PathBuf, files: Vec<PathBuf> },
    /// A Hugging Face model id (`hf:org/name`), downloaded when online.
    Hub { id: String },
}

/// The `*.uqff` file in `dir`, if any.
pub(super) fn uqff_file(dir: &Path) -> Option<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "uqff"))
        .collect();
    files.sort();
    files.into_iter().next()
}

pub(super) fn isq_name(isq: IsqType) -> String {
    format!("{isq:?}").to_lowercase()
}

impl Source {
    /// What `model` names. A path that does not exist is an error here: mistral.rs would
    /// take it for a Hugging Face id and go to the network. Hub ids must say `hf:`.
    fn resolve(model: &Path) -> Result<Source, GenerateError> {
        let text = model.to_string_lossy();
        if let Some(id) = text.strip_prefix("hf:") {
            return Ok(Source::Hub { id: id.to_string() });
        }
        let missing = || GenerateError::ModelMissing {
            path: model.to_path_buf(),
        };
        let bad = |message: &str| GenerateError::Load {
            path: model.to_path_buf(),
            message: message.to_string(),
        };
        let canonical = model.canonicalize().map_err(|_| missing())?;
        if canonical.is_file() {
            if canonical.extension().is_none_or(|e| e != "gguf") {
                return Err(bad(
                    "a model file must be GGUF (*.gguf); for safetensors name the directory",
                ));
            }
            let dir = canonical.parent().ok_or_else(missing)?.to_path_buf();
            let file = canonical
                .file_name()
                .ok_or_else(missing)?
                .to_string_lossy()
                .into_owned();
            return Ok(Source::Gguf { dir, file });
        }
        if let Some(uqff) = uqff_file(&canonical) {
            let name = uqff.file_name().ok_or_else(missing)?;
            return Ok(Source::Uqff {
                files: vec![PathBuf::from(name)],
                dir: canonical,
            });
        }
        let has = |name: &str| canonical.join(name).is_file();
        let safetensors = std::fs::read_dir(&canonical)
            .map_err(|_| missing())?
            .filter_map(|e| e.ok())
            .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"));
        if has("config.json") && has("tokenizer.json") && safetensors {
            return Ok(Source::Safetensors { dir: canonical });
        }
        Err(bad("a model directory needs config.json, tokenizer.json and *.safetensors (or a *.uqff written by docent)"))
    }

    /// The mistral.rs loader; `write_uqff` saves the quantized weights there.
    fn loader(&self, write_uqff: Option<PathBuf>) -> Result<Box<dyn Loader>, GenerateError> {
        let normal = |id: String, from_uqff: Option<Vec<PathBuf>>| {
            NormalLoaderBuilder::new(
                NormalSpecificConfig {
                    topology: None,
                    organization: Default::default(),
                    write_uqff: write_uqff.clone(),
                    from_uqff,
                    imatrix: None,
                    calibration_file: None,
                    hf_cache_path: None,
                    matformer_config_path: None,
                    matformer_slice_name: None,
                },
                None,
                None,
                Some(id),
                false,
                None,
            )
        };
        let (id, from_uqff) = match self {
            Source::Gguf { dir, file } => {
                return Ok(GGUFLoaderBuilder::new(
                    None,
                    None,
                    dir.to_string_lossy().into_owned(),
                    vec![file.clone()],
                    GGUFSpecificConfig { topology: None },
                    false,
                    None,
                )
                .build())
            }
            Source::Safetensors { dir } => (dir.to_string_lossy().into_owned(), None),
            Source::Uqff { dir, files } => {
                (dir.to_string_lossy().into_owned(), Some(files.clone()))
            }
            Source::Hub { id } => (id.clone(), None),
        };
        normal(id.clone(), from_uqff)
            .build(None)
            .map_err(|e| GenerateError::Load {
                path: PathBuf::from(id),
                message: format!("{e:#}"),
            })
    }
}

pub(super) fn dtype(name: &str) -> ModelDType {
    match name {
        "f16" => ModelDType::F16,
        "bf16" => ModelDType::BF16,
        "auto" => ModelDType::Auto,
        _ => ModelDType::F32,
    }
}

/// Where the weights come from (a UQFF directory written earlier replaces the safetensors
/// it was made from), the in-place quantization to apply, and the UQFF file to write.
pub(super) fn weights(
    config: &GenerationConfig,
) -> Result<(Source, Option<IsqType>, Option<PathBuf>), GenerateError> {
    let load_err = |message: String| GenerateError::Load {
        path: config.model.clone(),
        message,
    };
    let target = Source::resolve(&catalog::resolve(&config.model))?;
    let isq = config
        .isq
        .as_deref()
        .map(|s| parse_isq_value(s, None))
        .transpose()
        .map_err(load_err)?;
    let target = match (&target, &config.uqff) {
        // a UQFF directory made earlier: load the quantized weights from it
        (Source::Safetensors { .. } | Source::Hub { .. }, Some(dir))
            if uqff_file(dir).is_some() =>
        {
            Source::resolve(dir)?
        }
        _ => target,
    };
    let write_uqff = match (&target, &config.uqff, isq) {
        (Source::Safetensors { .. } | Source::Hub { .. }, Some(dir), Some(isq)) => {
            Some(dir.join(format!("{}.uqff", isq_name(isq))))
        }
        _ => None,
    };
    let isq = match target {
        Source::Uqff { .. } => None,
        _ => isq,
    };
    if isq.is_some() && matches!(target, Source::Gguf { .. }) {
        return Err(load_err(
            "generation.isq applies to safetensors models; a GGUF file is quantized already".into(),
        ));
    }
    Ok((target, isq, write_uqff))
}

/// Whether mistral.rs knows `isq` as an in-place quantization (`generation.isq`).
pub fn isq_known(isq: &str) -> bool {
    parse_isq_value(isq, None).is_ok()
}

/// The vendored engine's process-wide settings (vendor/PATCHES.md): docent's CPU kernels
/// and their threads, the prefix cache's bound, the KV cache's type and prompt-lookup
/// drafts. (Continuous batching is the pipeline's own: [`cpu_batching`].)
pub(super) fn install_engine_settings(config: &GenerationConfig) {
    cpu_kernels::init_threads(config.threads);
    // an ISQ model's weights are re-quantised after load, from the file's layout
    let repack = config.repack && config.isq.is_none();
    cpu_kernels::install(config.kernels == "docent", &config.isa, repack);
    mistralrs::core::set_prefix_cache_limit_bytes(config.prefix_cache_mib << 20);
    mistralrs::core::set_cpu_kv_cache_f16(config.kv_cache == "f16");
    // drafts are asked for per request (`Generator::send`); the proposer is the same
    mistralrs::core::set_draft_proposer(Some(lookup::propose));
}

/// The pipeline's continuous batching, chunked prefill and cohort schedule (vendor/PATCHES.md
/// 9, 10, 18), set on the pipeline before its engine starts, so two generators in one
/// process keep their own. Continuous batching needs each sequence's own cache: not with a
/// draft model, whose speculative steps manage the caches themselves (the pipeline declines
/// it anyway).
pub(super) fn cpu_batching(config: &GenerationConfig) -> mistralrs::core::CpuBatching {
    let on = config.continuous_batching && config.draft.is_none();
    mistralrs::core::CpuBatching {
        on,
        prefill_chunk: if on { config.prefill_chunk_tokens } else { 0 },
        cohort_admit_below: match config.schedule {
            Schedule::Cohort if on => COHORT_ADMIT_BELOW,
            _ => 0,
        },
    }
}

/// The engine over `pipeline`: its scheduler and prefix cache as configured.
async fn start_engine(
    config: &GenerationConfig,
    pipeline: Arc<tokio::sync::Mutex<dyn mistralrs::core::Pipeline + Send + Sync>>,
) -> Model {
    let max_num_seqs = NonZeroUsize::new(config.max_num_seqs).unwrap_or(NonZeroUsize::MIN);
    let runner = MistralRsBuilder::new(
        pipeline,
        SchedulerConfig::DefaultScheduler {
            method: DefaultSchedulerMethod::Fixed(max_num_seqs),
        },
        false,
        None,
    )
    // bounded in bytes by the patched prefix cacher (generation.prefix_cache_mib); off with
    // a draft model: mistral.rs's prefix cache keeps the target's KV only, and speculative
    // steps after a prefix hit then diverge from plain greedy decoding (seen in tests)
    .with_no_prefix_cache(!config.prefix_cache || config.draft.is_some())
    .build()
    .await;
    Model::new(runner)
}

/// The engine's pipeline for `loader` on the configured device and dtype (blocking work,
/// off the async threads).
pub(super) async fn load_pipeline(
    config: &GenerationConfig,
    loader: Box<dyn Loader>,
    isq: Option<IsqType>,
) -> Result<Arc<tokio::sync::Mutex<dyn mistralrs::core::Pipeline + Send + Sync>>, String> {
    let device_choice: device::DeviceChoice = config
        .device
        .parse()
        .map_err(|e| format!("generation.device {e}"))?;
    let dtype = dtype(&config.dtype);
    let dtype_is_f32 = config.dtype == "f32";
    tokio::task::spawn_blocking(move || {
        let device = device_choice.select()?;
        if !device.is_cpu() && dtype_is_f32 {
            tracing::warn!(
                "generation.dtype = \"f32\" on a GPU: attention and the KV cache run in F32; \
                 \"auto\" (BF16 on recent GPUs) is faster"
            );
        }
        loader
            .load_model_from_hf(
                None,
                TokenSource::None,
                &dtype,
                &device,
                true,
                DeviceMapSetting::Auto(AutoDeviceMapParams::default_text()),
                isq,
                None,
            )
            .map_err(|e| format!("{e:#}"))
    })
    .await
    .map_err(|e| e.to_string())?
}

/// The loaded model's tokenizer as docent uses it: text to ids, ids to text, its context
/// length and whether it has a chat template.
pub(super) struct Tokenizer {
    pub(super) ids: Encoder,
    pub(super) text: Decoder,
    pub(super) context_tokens: usize,
    pub(super) has_template: bool,
}

impl Tokenizer {
    fn of(p: &(dyn mistralrs::core::Pipeline + Send + Sync)) -> Result<Self, String> {
        let tokenizer = p
            .tokenizer()
            .ok_or_else(|| "the model has no tokenizer".to_string())?;
        let decoding = tokenizer.clone();
        let text: Decoder =
            Arc::new(move |ids: &[u32]| decoding.decode(ids, true).unwrap_or_default());
        let ids: Encoder = Arc::new(move |text: &str| {
            tokenizer
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        });
        Ok(Tokenizer {
            ids,
            text,
            context_tokens: p.get_metadata().max_seq_len,
            has_template: p
                .get_chat_template()
                .is_some_and(|t| t.chat_template.is_some()),
        })
    }
}

impl Generator {
    /// Loads the model named in `config`, with its draft model when speculative decoding
    /// is configured (blocking work; call before serving).
    pub async fn load(config: &GenerationConfig) -> Result<Self, GenerateError> {
        let path = config.model.clone();
        let load_err = |message: String| GenerateError::Load {
            path: path.clone(),
            message,
        };
        let (target, isq, write_uqff) = weights(config)?;
        let passages = passage_cache(config, &target);
        // the refusal probe first: one for another model file stops the start-up at once
        let (refusal_check, probe) = refusal_signal(config).map_err(load_err)?;
        let loader = target.loader(write_uqff.clone())?;
        let loader: Box<dyn Loader> = match &config.draft {
            Some(draft) => Box::new(SpeculativeLoader {
                target: loader,
                draft: Source::resolve(&catalog::resolve(&draft.model))?.loader(None)?,
                config: SpeculativeConfig { gamma: draft.gamma },
            }),
            None => loader,
        };
        install_engine_settings(config);
        let started = Instant::now();
        let pipeline = load_pipeline(config, loader, isq).await.map_err(load_err)?;
        let load_ms = started.elapsed().as_secs_f64() * 1e3;
        tracing::info!(
            model = %config.model.display(),
            load_ms,
            isq = ?isq,
            uqff_written = ?write_uqff,
            draft = ?config.draft.as_ref().map(|d| &d.model),
            "generation model loaded"
        );
        let (tokenizer, ragged) = {
            let mut p = pipeline.lock().await;
            p.set_cpu_batching(cpu_batching(config));
            (Tokenizer::of(&*p).map_err(load_err)?, p.ragged_batching())
        };
        let passages = placeable(config, passages, ragged);
        let model = start_engine(config, pipeline).await;
        // a model without a chat template (a base model) only serves raw completions
        let count = tokenizer.ids.clone();
        let encode = move |text: &str| {
            let n = count(text).len();
            // an encoding failure still has to count: assume a token per byte
            if n == 0 {
                text.len()
            } else {
                n
            }
        };
        let tokens = if tokenizer.has_template {
            template_overhead(&model, encode)
                .await
                .map_err(|e| load_err(format!("measuring the chat template: {e}")))?
        } else {
            TokenCounter::new(encode, 0, 0)
        };
        let context_tokens = match config.context_tokens {
            0 => tokenizer.context_tokens,
            n => n.min(tokenizer.context_tokens),
        };
        let ids = tokenizer.ids;
        let word_tokens = |words: &[&str]| {
            let mut t: Vec<u32> = words
                .iter()
                .flat_map(|w| first_tokens(w, ids.as_ref()))
                .collect();
            t.sort_unstable();
            t.dedup();
            t
        };
        Ok(Generator {
            model,
            path,
            tokens,
            context_tokens,
            counters: Arc::default(),
            load_ms,
            refusal_tokens: first_tokens(&config.refusal_phrase, ids.as_ref()),
            refusal_threshold: config.refusal_threshold,
            refusal_check,
            probe,
            lead_masked: if config.lead_with_marker {
                Vec::new()
            } else {
                word_tokens(&["[", "[1]", "[[", "[\n"])
            },
            yes_tokens: word_tokens(&["yes", "Yes", "YES"]),
            no_tokens: word_tokens(&["no", "No", "NO"]),
            ids,
            text: tokenizer.text,
            // by default a draft model's pipeline runs its own steps; drafts of both kinds
            // never mix in one request
            drafts: Drafts {
                lookup_tokens: if config.draft.is_some() {
                    0
                } else {
                    config.lookup_tokens
                },
                draft_model: config.draft.is_some(),
            },
            reuse: config.passage_reuse,
            recompute_tokens: config.passage_recompute_tokens,
            key_scale: config.passage_key_scale,
            passages,
        })
    }
}

/// `passages`, unless the pipeline does not batch raggedly: blocks are placed only on the
/// CPU's continuous-batching path (a GGUF llama-family model on the CPU), and elsewhere (a
/// GPU) they would be computed and never placed, so reuse is off there, with a warning.
fn placeable(
    config: &GenerationConfig,
    passages: Option<Arc<reuse::PassageCache>>,
    ragged: bool,
) -> Option<Arc<reuse::PassageCache>> {
    if passages.is_some() && !ragged {
        tracing::warn!(
            device = %config.device,
            "generation.passage_reuse needs a GGUF model on the CPU (blocks are placed by its continuous batching): prompts are prefilled whole (set passage_reuse = \"off\" to silence this)"
        );
        return None;
    }
    passages
}
