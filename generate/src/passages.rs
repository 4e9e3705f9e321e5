//! Passage reuse on the answer path: where a prompt's passages lie, the plan that places
//! their blocks (turned to their place) or computes them, precomputing and the disk.

use super::*;

/// Where a prompt's passages lie ([`Generator::passage_units`]).
pub(super) struct PassageUnits {
    /// The tokens the blocks are computed after.
    pub(super) context: Vec<u32>,
    /// Where place 1 starts when a block there is exact (not for a fenced prompt).
    pub(super) first: Option<usize>,
    /// Each passage found: where it starts in the prompt, its tokens.
    pub(super) units: Vec<(usize, Vec<u32>)>,
}

/// `block` as a splice at `start`: its keys turned by the offset from where it was
/// computed and multiplied by `key_scale` (`generation.passage_key_scale`: what later
/// tokens' attention logits to them are multiplied by), less its first `head` tokens
/// (prefilled instead, so they read what comes before: `generation.passage_recompute_tokens`);
/// `None` when nothing is left to place.
pub(super) fn place(
    cache: &reuse::PassageCache,
    block: &reuse::Block,
    start: usize,
    head: usize,
    key_scale: f32,
    in_place: bool,
) -> mistralrs::Result<Option<mistralrs::core::KvSplice>> {
    let n = block.tokens.len();
    if head >= n {
        return Ok(None);
    }
    let delta = start as i64 - block.context_len as i64;
    let scaled = key_scale != 1.0;
    let layers = if head == 0 && delta == 0 && !scaled {
        block.layers.clone()
    } else {
        let cut = |t: &mistralrs::Tensor| -> mistralrs::Result<mistralrs::Tensor> {
            if head == 0 {
                Ok(t.clone())
            } else {
                t.narrow(2, head, n - head)?.force_contiguous()
            }
        };
        let layers = block
            .layers
            .iter()
            .map(|(k, v)| {
                let k = cache.rope.turn(&cut(k)?, delta)?;
                let k = if scaled {
                    k.affine(f64::from(key_scale), 0.0)?
                } else {
                    k
                };
                Ok((k, cut(v)?))
            })
            .collect::<mistralrs::Result<Vec<_>>>()?;
        Arc::new(layers)
    };
    Ok(Some(mistralrs::core::KvSplice {
        start: start + head,
        tokens: block.tokens[head..].to_vec(),
        layers,
        exact: in_place && block.exact && head == 0 && !scaled,
    }))
}

/// What passage reuse does for one answer's request ([`Generator::reuse_plan`]).
#[derive(Default)]
pub(super) struct ReusePlan {
    pub(super) splices: Vec<mistralrs::core::KvSplice>,
    pub(super) keep: Option<Arc<reuse::KvReader>>,
}

/// Text to token ids with the model's tokenizer.
pub(super) type Encoder = Arc<dyn Fn(&str) -> Vec<u32> + Send + Sync>;

/// Token ids to text with the model's tokenizer.
pub(super) type Decoder = Arc<dyn Fn(&[u32]) -> String + Send + Sync>;

impl Generator {
    /// Where `prompt`'s passages lie in its tokens, and the tokens their blocks are
    /// computed after: the prompt's own up to its first passage, or, for a fenced prompt
    /// (`safety.spotlight`: a fence new each request), the same prompt's in the cache's
    /// fence (never exact then: the tokens before the passages differ). `None` when no
    /// passage is found.
    async fn passage_units(
        &self,
        cache: &reuse::PassageCache,
        prompt: &Prompt,
    ) -> Result<Option<PassageUnits>, GenerateError> {
        let ids = self.prompt_ids(prompt).await?;
        let units = reuse::find_units(&ids, &prompt.passages, |t| (self.ids)(t));
        let fenced = !prompt.fence.is_empty();
        let (home_ids, home_units) = if fenced {
            let home = prompt.with_fence(&cache.fence());
            let ids = self.prompt_ids(&home).await?;
            let units = reuse::find_units(&ids, &home.passages, |t| (self.ids)(t));
            (ids, units)
        } else {
            (ids, units.clone())
        };
        let Some(first) = home_units.iter().flatten().map(|u| u.0).next() else {
            return Ok(None);
        };
        let units = units
            .into_iter()
            .zip(home_units)
            .filter_map(|(u, h)| match (u, h) {
                (Some(u), Some(h)) if u.1 == h.1 => Some(u),
                _ => None,
            })
            .collect();
        Ok(Some(PassageUnits {
            context: home_ids[..first].to_vec(),
            first: (!fenced).then_some(first),
            units,
        }))
    }

    /// Passage reuse for `prompt` (`generation.passage_reuse`, [`reuse`]): the blocks the
    /// engine places into its cache, and the reader that keeps the first passage's block
    /// from this prefill when the cache lacks it (that block is exact in place 1). Nothing
    /// when off, when the prompt quotes no passage, or when none is found in its tokens; a
    /// fenced prompt's passages are computed in the cache's fence, and never in the exact
    /// mode. In a later place a block's first `generation.passage_recompute_tokens` tokens
    /// are prefilled instead, so that they read the passages before them.
    pub(super) async fn reuse_plan(&self, prompt: &Prompt) -> Result<ReusePlan, GenerateError> {
        let mut plan = ReusePlan::default();
        let Some(cache) = self
            .passages
            .as_ref()
            .filter(|_| !prompt.passages.is_empty())
        else {
            return Ok(plan);
        };
        let exact_mode = self.reuse == reuse::PassageReuse::Exact;
        if exact_mode && !prompt.fence.is_empty() {
            return Ok(plan);
        }
        let Some(found) = self.passage_units(cache, prompt).await? else {
            return Ok(plan);
        };
        let context_hash = reuse::hash_tokens(0, &found.context);
        for (i, (start, tokens)) in found.units.into_iter().enumerate() {
            let in_place = found.first == Some(start);
            if exact_mode && !in_place {
                break;
            }
            // a miss in memory may read a file: off the async threads then
            let kept = if cache.has_disk() {
                let (c, t) = (cache.clone(), tokens.clone());
                tokio::task::spawn_blocking(move || c.get(context_hash, &t))
                    .await
                    .map_err(|e| GenerateError::Engine(e.to_string()))?
            } else {
                cache.get(context_hash, &tokens)
            };
            let block = match kept {
                Some(b) => b,
                None if in_place => {
                    // prefilled in place by this request, exactly; kept from it
                    plan.keep = Some(Arc::new(reuse::KvReader::new(
                        cache.clone(),
                        found.context.clone(),
                        tokens,
                    )));
                    continue;
                }
                None => match self
                    .compute_block(cache, &found.context, tokens.clone(), false)
                    .await?
                {
                    Some(b) => b,
                    None => continue,
                },
            };
            // the first passage read only the prefix in a prefill too
            let (head, scale) = if i == 0 {
                (0, 1.0)
            } else {
                (self.recompute_tokens, self.key_scale)
            };
            if let Some(splice) = place(cache, &block, start, head, scale, in_place)
                .map_err(|e| GenerateError::Engine(e.to_string()))?
            {
                plan.splices.push(splice);
            }
        }
        Ok(plan)
    }

    /// Computes the blocks of `prompt`'s passages that neither memory nor disk holds
    /// (`docent precompute`: every chunk ahead of the questions); how many it computed.
    /// Nothing unless `generation.passage_reuse = "passages"`.
    pub async fn precompute_passages(&self, prompt: &Prompt) -> Result<usize, GenerateError> {
        let Some(cache) = self
            .passages
            .as_ref()
            .filter(|_| self.reuse == reuse::PassageReuse::Passages)
        else {
            return Ok(0);
        };
        let Some(found) = self.passage_units(cache, prompt).await? else {
            return Ok(0);
        };
        let context_hash = reuse::hash_tokens(0, &found.context);
        let mut computed = 0;
        for (_, tokens) in found.units {
            if cache.contains(context_hash, &tokens) {
                continue;
            }
            // ahead of the questions: to disk, not into the memory recent answers use
            if self
                .compute_block(cache, &found.context, tokens, true)
                .await?
                .is_some()
            {
                computed += 1;
            }
        }
        Ok(computed)
    }

    /// A passage's block computed after `context` (one greedy step over both; the
    /// context's own keys and values come from the prefix cache after the first time).
    async fn compute_block(
        &self,
        cache: &Arc<reuse::PassageCache>,
        context: &[u32],
        tokens: Vec<u32>,
        disk_only: bool,
    ) -> Result<Option<Arc<reuse::Block>>, GenerateError> {
        let started = Instant::now();
        let ids = [context, &tokens].concat();
        let reader = reuse::KvReader::new(cache.clone(), context.to_vec(), tokens);
        let reader = Arc::new(if disk_only {
            reader.disk_only()
        } else {
            reader
        });
        self.one_step(RequestMessage::CompletionTokens(ids), reader.clone())
            .await?;
        cache.note_computed(started.elapsed());
        Ok(reader.take())
    }

    /// Keeps passage blocks on disk under `root` too (`generation.passage_disk_mib`), in a
    /// folder of this model's own (named by a hash of its file): blocks written by an
    /// earlier run of the same model and prompt are read instead of computed. Nothing
    /// unless `generation.passage_reuse = "passages"`, nor when `limit_mib` is 0.
    pub async fn attach_passage_disk(&self, root: &Path, limit_mib: usize) -> std::io::Result<()> {
        // the exact mode places only a prefill's own keys and values, never 8-bit ones
        let Some(cache) = self
            .passages
            .clone()
            .filter(|_| limit_mib > 0 && self.reuse == reuse::PassageReuse::Passages)
        else {
            return Ok(());
        };
        let (root, model) = (root.to_path_buf(), cache.model_file.clone());
        let salt = format!("{:?}", cache.rope);
        let started = Instant::now();
        let blocks = tokio::task::spawn_blocking(move || {
            let dir = reuse::disk::model_dir(&root, &model, &salt)?;
            reuse::disk::DiskBlocks::open(&dir, (limit_mib as u64) << 20)
        })
        .await
        .map_err(std::io::Error::other)??;
        let stats = blocks.stats();
        tracing::info!(dir = %blocks.dir().display(), files = stats.files, bytes = stats.bytes, ms = started.elapsed().as_millis() as u64, "passage blocks on disk");
        cache.attach_disk(blocks);
        Ok(())
    }

    /// Waits until every passage block kept so far is written to disk.
    pub async fn flush_passages(&self) {
        if let Some(cache) = self.passages.clone() {
            let _ = tokio::task::spawn_blocking(move || cache.flush_disk()).await;
        }
    }

    /// The fence fenced prompts' passages are computed in (`None` without reuse).
    pub fn reuse_fence(&self) -> Option<String> {
        self.passages.as_ref().map(|c| c.fence())
    }

    /// Forgets every passage block (measurements of cold prefills).
    pub fn clear_passages(&self) {
        if let Some(c) = &self.passages {
            c.clear();
        }
    }

    /// The token ids the engine reads for `prompt` (its chat template applied).
    pub async fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<u32>, GenerateError> {
        self.model
            .tokenize(
                either::Either::Left(text_messages(prompt)),
                None,
                true,
                true,
                None,
            )
            .await
            .map_err(|e| GenerateError::Engine(e.to_string()))
    }

    /// The keys and values of every position of `prompt`, per layer (1, kv heads,
    /// positions, head dim), as its prefill leaves them in the cache: with passage reuse as
    /// configured when `reuse`, else a full prefill (checks and measurements).
    pub async fn prompt_kv(
        &self,
        prompt: &Prompt,
        reuse: bool,
    ) -> Result<Option<Vec<(mistralrs::Tensor, mistralrs::Tensor)>>, GenerateError> {
        let plan = if reuse {
            self.reuse_plan(prompt).await?
        } else {
            ReusePlan::default()
        };
        let snapshot = Arc::new(reuse::KvSnapshot::default());
        let mut processors: Vec<Arc<dyn mistralrs::CustomLogitsProcessor>> = vec![snapshot.clone()];
        if let Some(keep) = plan.keep {
            processors.push(keep);
        }
        let response = self
            .request_once(
                messages(prompt),
                sampling(&Params::greedy(1)),
                false,
                Some(processors),
                Drafts::NONE,
                plan.splices,
            )
            .await?;
        match response {
            Response::Done(_) | Response::CompletionDone(_) => Ok(snapshot.take()),
            other => Err(response_error(other)),
        }
    }

    /// What passage reuse has done since the model loaded (`None` when off).
    pub fn reuse_stats(&self) -> Option<reuse::ReuseStats> {
        self.passages.as_ref().map(|c| c.stats())
    }
}
