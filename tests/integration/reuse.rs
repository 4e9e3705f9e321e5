//! Passage reuse (issue 55): passages' keys and values computed once and placed into later
//! prompts, on real models.

use docent::query::generate::reuse::{find_units, PassageReuse};
use docent::query::generate::{Generator, Params};
use docent::query::prompt::{ContextBlock, Prompt, Prompts};

use crate::helpers::{config, qwen_0_5b};

const PRINTER: &str = "The second-floor printer is reserved for the finance team; everyone \
    else prints on the ground floor. The office opens at 8:00 and closes at 18:00.";
const KITCHEN: &str = "The kitchen on the third floor has two coffee machines. The left one \
    makes espresso, and the right one makes filter coffee for the whole floor.";
const PARKING: &str = "Visitors park in the underground garage on level -2. Badges for the \
    garage gate are handed out at the front desk until 17:00.";

fn blocks<'a>(texts: &[&'a str]) -> Vec<ContextBlock<'a>> {
    texts
        .iter()
        .enumerate()
        .map(|(i, t)| ContextBlock {
            n: i + 1,
            title: "Office guide",
            source: "office-guide.md",
            text: t,
        })
        .collect()
}

/// A generator with passage reuse as `reuse`, whole blocks placed as computed (no
/// recomputed tokens, keys not scaled) unless `recompute` and `key_scale` say otherwise.
async fn load_with(
    model: &std::path::Path,
    reuse: PassageReuse,
    prefix_cache: bool,
    recompute: usize,
    key_scale: f32,
) -> Generator {
    let mut c = crate::helpers::generation();
    c.model = model.to_path_buf();
    c.passage_reuse = reuse;
    c.prefix_cache = prefix_cache;
    c.passage_recompute_tokens = recompute;
    c.passage_key_scale = key_scale;
    Generator::load(&c).await.unwrap()
}

async fn load(model: &std::path::Path, reuse: PassageReuse, prefix_cache: bool) -> Generator {
    load_with(model, reuse, prefix_cache, 0, 1.0).await
}

fn prompts(dir: &std::path::Path) -> Prompts {
    docent::server::startup::prompts(&config(dir)).unwrap()
}

fn prompts_with_phrase(dir: &std::path::Path, phrase: &str) -> Prompts {
    prompts(dir).refusal_phrase(phrase)
}

async fn answer(g: &Generator, prompt: &Prompt) -> String {
    let mut stream = g.stream(prompt, &Params::greedy(24)).await.unwrap();
    let mut text = String::new();
    while let Some(event) = stream.next().await {
        if let docent::query::generate::StreamEvent::Delta(d) = event.unwrap() {
            text.push_str(&d);
        }
    }
    text
}

/// In the exact mode a passage's block is placed only where it was computed (place 1,
/// after the same tokens), so the answer is the full prefill's, token for token: each prompt
/// is answered once with the cache emptied (a full prefill, which keeps the block) and once
/// more with the block placed. With the prefix cache off, the placed block is the only
/// reuse. Checked on SmolLM2 (a llama GGUF: interleaved RoPE) and the Qwen 0.5B (NeoX RoPE).
#[tokio::test]
async fn exact_reuse_answers_token_for_token_as_a_full_prefill() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = prompts(dir.path());
    let smol = config(dir.path()).generation.model;
    for model in [smol, qwen_0_5b()] {
        let g = load(&model, PassageReuse::Exact, false).await;
        let placed = mistralrs::core::kv_spliced_positions();
        for (question, texts) in [
            (
                "Which team is the second-floor printer reserved for?",
                [PRINTER, PARKING],
            ),
            ("Where do visitors park?", [PRINTER, PARKING]),
            (
                "What does the right coffee machine make?",
                [PRINTER, KITCHEN],
            ),
        ] {
            let prompt = prompts.render(question, &blocks(&texts)).unwrap();
            g.clear_passages();
            let hits = g.reuse_stats().unwrap().hits;
            let want = answer(&g, &prompt).await;
            assert_eq!(g.reuse_stats().unwrap().hits, hits, "a full prefill first");
            let got = answer(&g, &prompt).await;
            assert_eq!(
                g.reuse_stats().unwrap().hits,
                hits + 1,
                "then the block placed"
            );
            eprintln!("{}: {question} -> {got:?}", model.display());
            assert!(!want.trim().is_empty());
            assert_eq!(got, want, "{}: {question}", model.display());
        }
        let after = g.reuse_stats().unwrap();
        // one block (the printer passage): the exact mode never computes one ahead
        assert_eq!((after.blocks, after.computed), (1, 0), "{after:?}");
        // the engine placed them (other tests may place theirs meanwhile: at least these)
        assert!(
            mistralrs::core::kv_spliced_positions() >= placed + 3 * after.tokens,
            "the blocks were placed, not prefilled"
        );

        // another system prompt (here: another refusal phrase) is another context: no hit
        let hits = after.hits;
        let other = prompts_with_phrase(dir.path(), "Not in the guide.")
            .render("Where do visitors park?", &blocks(&[PRINTER, PARKING]))
            .unwrap();
        answer(&g, &other).await;
        assert_eq!(g.reuse_stats().unwrap().hits, hits);
        // another text in place 1 (a replaced document) is another block: no hit
        let replaced = prompts
            .render(
                "Where do visitors park?",
                &blocks(&[&PRINTER.replace("finance", "legal"), PARKING]),
            )
            .unwrap();
        answer(&g, &replaced).await;
        assert_eq!(g.reuse_stats().unwrap().hits, hits);
    }
}

/// Relative difference of two runs of keys or values, at positions `at` of one layer.
fn rel_diff(a: &mistralrs::Tensor, b: &mistralrs::Tensor, at: std::ops::Range<usize>) -> f32 {
    let part = |t: &mistralrs::Tensor| {
        t.narrow(2, at.start, at.len())
            .unwrap()
            .to_dtype(mistralrs::DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let (x, y) = (part(a), part(b));
    let diff: f32 = x.iter().zip(&y).map(|(p, q)| (p - q) * (p - q)).sum();
    let norm: f32 = y.iter().map(|q| q * q).sum();
    (diff / norm).sqrt()
}

/// In the passage mode a block computed after the prefix is placed in place 2 with its
/// keys turned by the RoPE offset. The first layer's keys and values depend only on the
/// token and its position, so there they must equal a full prefill's at those positions
/// (the turn is right, the block lies where its tokens are); in the last layer they differ,
/// since the block never read the passage before it (what the mode gives up). The passage in
/// place 1 equals the full prefill's in every layer.
#[tokio::test]
async fn a_placed_passage_has_a_full_prefills_first_layer_at_its_place() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = prompts(dir.path());
    // the prefix cache off: the full prefill's sequence would otherwise cover the prompt
    let reusing = load(&qwen_0_5b(), PassageReuse::Passages, false).await;
    let prompt = prompts
        .render("Where do visitors park?", &blocks(&[PRINTER, PARKING]))
        .unwrap();
    let ids = reusing.prompt_ids(&prompt).await.unwrap();
    let units = find_units(&ids, &prompt.passages, |t| reusing.encode(t));
    let (p1, u1) = units[0].clone().expect("place 1 found");
    let (p2, u2) = units[1].clone().expect("place 2 found");
    let (one, two) = (p1..p1 + u1.len(), p2..p2 + u2.len());
    let want = reusing
        .prompt_kv(&prompt, false)
        .await
        .unwrap()
        .expect("kv");
    let got = reusing.prompt_kv(&prompt, true).await.unwrap().expect("kv");
    let stats = reusing.reuse_stats().unwrap();
    // place 1 kept from this prefill, place 2 computed ahead and placed
    assert_eq!(stats.computed, 1, "{stats:?}");
    let last = want.len() - 1;
    let (k0, v0) = (
        rel_diff(&got[0].0, &want[0].0, two.clone()),
        rel_diff(&got[0].1, &want[0].1, two.clone()),
    );
    let (kl, vl) = (
        rel_diff(&got[last].0, &want[last].0, two.clone()),
        rel_diff(&got[last].1, &want[last].1, two.clone()),
    );
    let place1 = (0..want.len())
        .map(|l| {
            rel_diff(&got[l].0, &want[l].0, one.clone()).max(rel_diff(
                &got[l].1,
                &want[l].1,
                one.clone(),
            ))
        })
        .fold(0f32, f32::max);
    eprintln!("place 2, layer 0: keys {k0:.2e} values {v0:.2e}; last layer: keys {kl:.2e} values {vl:.2e}; place 1, any layer: {place1:.2e}");
    assert!(
        k0 < 1e-4 && v0 < 1e-4,
        "the first layer at place 2: {k0} {v0}"
    );
    assert!(kl > 1e-3 || vl > 1e-3, "the last layer differs: {kl} {vl}");
    assert!(place1 < 1e-4, "place 1: {place1}");

    // with `passage_recompute_tokens` the first tokens of place 2 are prefilled: they read
    // place 1 and equal the full prefill's in the last layer too; the rest stay placed
    let head = 16;
    assert!(u2.len() > head + 4);
    // (and `passage_key_scale` 0.5: the placed rest's keys halved, values as they were)
    let recomputing = load_with(&qwen_0_5b(), PassageReuse::Passages, false, head, 0.5).await;
    recomputing.prompt_kv(&prompt, true).await.unwrap();
    let mixed = recomputing
        .prompt_kv(&prompt, true)
        .await
        .unwrap()
        .expect("kv");
    let (read, placed) = (p2..p2 + head, p2 + head..p2 + u2.len());
    let (kr, vr) = (
        rel_diff(&mixed[last].0, &want[last].0, read.clone()),
        rel_diff(&mixed[last].1, &want[last].1, read),
    );
    let (kp, vp) = (
        rel_diff(&mixed[last].0, &want[last].0, placed.clone()),
        rel_diff(&mixed[last].1, &want[last].1, placed),
    );
    eprintln!("place 2 with {head} recomputed, last layer: those keys {kr:.2e} values {vr:.2e}; the placed rest keys {kp:.2e} values {vp:.2e}");
    assert!(kr < 1e-3 && vr < 1e-3, "recomputed tokens: {kr} {vr}");
    let rest = p2 + head..p2 + u2.len();
    let (k0, v0) = (
        rel_diff(&mixed[0].0, &want[0].0, rest.clone()),
        rel_diff(&mixed[0].1, &want[0].1, rest),
    );
    eprintln!("the placed rest at key scale 0.5, layer 0: keys {k0:.4} values {v0:.2e}");
    assert!((k0 - 0.5).abs() < 1e-3 && v0 < 1e-4, "{k0} {v0}");
    assert!(kp > 1e-3 || vp > 1e-3, "the placed rest: {kp} {vp}");
    drop(recomputing);

    // the answer from the placed blocks still reads the parking passage
    let text = answer(&reusing, &prompt).await;
    eprintln!("passage mode: {text:?}");
    assert!(
        text.contains("-2") || text.to_lowercase().contains("underground"),
        "{text}"
    );
    assert!(reusing.reuse_stats().unwrap().hits >= 2);
}

/// Waits until the passage writer has `files` blocks on disk (it writes on a thread of its
/// own); the stats then.
async fn wait_for_files(g: &Generator, files: usize) -> docent::query::generate::reuse::ReuseStats {
    for _ in 0..600 {
        let s = g.reuse_stats().unwrap();
        if s.disk.is_some_and(|d| d.files >= files) {
            return s;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("{files} blocks were not written: {:?}", g.reuse_stats());
}

/// Blocks on disk (`generation.passage_disk_mib`): written once computed, read back after
/// the memory is emptied (a restart's view) within 8-bit's error of the prefill's, a
/// truncated file detected, deleted and its block computed again, never served; another
/// model file is another folder; memory and disk stay within their bounds while answers
/// run at once. On SmolLM2 (the disk is the model's bytes, whatever the model).
#[tokio::test]
async fn blocks_on_disk_are_read_back_and_damaged_ones_computed_again() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = prompts(dir.path());
    let smol = config(dir.path()).generation.model;
    let mut c = crate::helpers::generation();
    c.model = smol.clone();
    c.passage_reuse = PassageReuse::Passages;
    c.prefix_cache = false;
    c.passage_cache_mib = 8;
    c.passage_recompute_tokens = 0;
    c.passage_key_scale = 1.0;
    let g = Generator::load(&c).await.unwrap();
    let root = dir.path().join("passages");
    g.attach_passage_disk(&root, 2).await.unwrap();
    let prompt = prompts
        .render(
            "Where do visitors park?",
            &blocks(&[PRINTER, PARKING, KITCHEN]),
        )
        .unwrap();

    // computed: place 1 kept from the prefill, places 2 and 3 computed ahead
    let in_memory = g.prompt_kv(&prompt, true).await.unwrap().expect("kv");
    let s = wait_for_files(&g, 3).await;
    assert_eq!((s.computed, s.disk_hits), (2, 0), "{s:?}");
    let folder: Vec<_> = std::fs::read_dir(&root).unwrap().collect();
    assert_eq!(folder.len(), 1, "one folder for the model");
    let model_dir = folder[0].as_ref().unwrap().path();

    // the memory emptied: every block read from disk, nothing computed
    g.clear_passages();
    let from_disk = g.prompt_kv(&prompt, true).await.unwrap().expect("kv");
    let s = g.reuse_stats().unwrap();
    assert_eq!((s.computed, s.disk_hits), (2, 3), "{s:?}");
    let ids = g.prompt_ids(&prompt).await.unwrap();
    let units = find_units(&ids, &prompt.passages, |t| g.encode(t));
    for (at, unit) in units.iter().flatten() {
        let range = *at..at + unit.len();
        for l in [0, in_memory.len() - 1] {
            let (k, v) = (
                rel_diff(&from_disk[l].0, &in_memory[l].0, range.clone()),
                rel_diff(&from_disk[l].1, &in_memory[l].1, range.clone()),
            );
            eprintln!("disk vs memory, place at {at}, layer {l}: keys {k:.2e} values {v:.2e}");
            // 8-bit keys: about 1 % (relative); 4-bit values: about 6 %; and not the same
            // numbers
            assert!(k < 0.02 && v < 0.20, "{k} {v}");
            assert!(k > 0.0 || v > 0.0, "read from disk, not memory");
        }
    }

    // a truncated file: detected, deleted, its block computed (or prefilled) again
    let victim = std::fs::read_dir(&model_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "kv"))
        .unwrap();
    let len = std::fs::metadata(&victim).unwrap().len();
    std::fs::File::options()
        .write(true)
        .open(&victim)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    g.clear_passages();
    let again = g.prompt_kv(&prompt, true).await.unwrap().expect("kv");
    let s = wait_for_files(&g, 3).await;
    let d = s.disk.unwrap();
    assert_eq!((d.corrupt, s.disk_hits), (1, 5), "{s:?}");
    assert_eq!(
        std::fs::metadata(&victim).unwrap().len(),
        len,
        "written again"
    );
    assert_eq!(again.len(), in_memory.len());

    // another model file is another folder; the same file the same one
    let salt = format!("{:?}", "x");
    let a = docent::query::generate::reuse::disk::model_dir(&root, &smol, &salt).unwrap();
    let b = docent::query::generate::reuse::disk::model_dir(&root, &smol, &salt).unwrap();
    let stories = crate::helpers::shared().join("models/stories260K/stories260K.gguf");
    let other = docent::query::generate::reuse::disk::model_dir(&root, &stories, &salt).unwrap();
    assert_eq!(a, b);
    assert_ne!(a, other);

    // answers at once over many passages: memory (8 MiB) and disk (2 MiB) stay bounded
    let texts: Vec<String> = (0..8)
        .map(|i| format!("Room {i} on floor {} has {} desks and a window facing the {} courtyard, used by team {i} on weekdays.", i % 4, 4 + i, ["north", "south"][i % 2]))
        .collect();
    let asks = (0..4).map(|i| {
        let blocks = blocks(&[&texts[2 * i], &texts[2 * i + 1], PRINTER]);
        let p = prompts
            .render("Which room has the most desks?", &blocks)
            .unwrap();
        let g = &g;
        async move { answer(g, &p).await }
    });
    let answers = futures::future::join_all(asks).await;
    assert!(answers.iter().all(|a| !a.trim().is_empty()));
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let s = g.reuse_stats().unwrap();
    eprintln!("after concurrent answers: {s:?}");
    assert!(s.bytes <= 8 << 20, "{s:?}");
    assert!(s.disk.unwrap().bytes <= 2 << 20, "{s:?}");
    assert!(s.blocks >= 2, "{s:?}");
}

/// Spotlighting (`safety.spotlight`) quotes passages in a fence that is new for each
/// request; the passages are computed once in the cache's own fence and placed into every
/// request's prompt, whose fence stays new: the second request with the same passages
/// places all three (the later two less their first 16 tokens, keys scaled as by default)
/// and computes none, and its answer still reads them.
#[tokio::test]
async fn fenced_prompts_reuse_their_passages_across_requests() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = prompts(dir.path()).spotlight(true);
    let d = docent::config::Config::default().generation;
    let g = load_with(
        &qwen_0_5b(),
        PassageReuse::Passages,
        false,
        16,
        d.passage_key_scale,
    )
    .await;
    let question = "Where do visitors park?";
    // the parking passage first: with it in place 2 the 0.5B answers from the printer
    // passage even with a full prefill of the fenced prompt (measured)
    let texts = [PARKING, PRINTER, KITCHEN];
    let first = prompts.render(question, &blocks(&texts)).unwrap();
    let second = prompts.render(question, &blocks(&texts)).unwrap();
    assert_ne!(first.fence, second.fence, "a new fence per request");
    assert!(!first.user.contains(&g.reuse_fence().unwrap()));
    answer(&g, &first).await;
    let s = g.reuse_stats().unwrap();
    assert_eq!(
        (s.computed, s.hits),
        (3, 0),
        "computed in the cache's fence: {s:?}"
    );
    let placed = mistralrs::core::kv_spliced_positions();
    let text = answer(&g, &second).await;
    let s = g.reuse_stats().unwrap();
    assert_eq!((s.computed, s.hits), (3, 3), "all placed: {s:?}");
    let spliced = mistralrs::core::kv_spliced_positions() - placed;
    assert!(spliced >= s.tokens - 2 * 16, "{spliced} of {}", s.tokens);
    eprintln!("fenced, placed: {text:?}");
    assert!(
        text.contains("-2") || text.to_lowercase().contains("underground"),
        "{text}"
    );
    assert!(!text.contains(&second.fence), "{text}");
}

/// The `.kv` files of every model folder under `root` (`<data_dir>/passages`).
fn block_files(root: &std::path::Path) -> usize {
    std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|model| {
            std::fs::read_dir(model.path())
                .into_iter()
                .flatten()
                .flatten()
        })
        .filter(|f| f.path().extension().is_some_and(|e| e == "kv"))
        .count()
}

/// Polls until `root` holds `n` block files (at most `secs`); the count at the end.
async fn wait_for_block_files(root: &std::path::Path, n: usize, secs: u64) -> usize {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while block_files(root) < n && std::time::Instant::now() < until {
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    block_files(root)
}

/// A short answer to a question the ownership chapter answers; it must succeed.
async fn ask_ownership(c: &reqwest::Client, address: &str) {
    let res = c
        .post(format!("{address}/v1/query"))
        .json(&serde_json::json!({"question": "What is ownership in Rust?", "generation": {"max_tokens": 4}}))
        .send()
        .await
        .unwrap();
    let status = res.status();
    assert_eq!(status, 200, "{}", res.text().await.unwrap());
}

async fn chunks_listed(c: &reqwest::Client, address: &str) -> usize {
    let list = crate::helpers::get_json(c, &format!("{address}/v1/documents?limit=100")).await;
    list["documents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["chunks"].as_u64().unwrap() as usize)
        .sum()
}

/// `docent serve` in the passage mode computes every chunk's block in the background
/// (`generation.passage_precompute`), answers meanwhile, and computes an uploaded
/// document's blocks after its job; with the setting off it computes none ahead.
#[tokio::test]
async fn the_server_computes_every_chunks_block_in_the_background() {
    use crate::helpers::{client, rust_book, server_in, OWNERSHIP};
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("index");
    let root = data.join("passages");
    let server = server_in(&data, &[rust_book(OWNERSHIP)], |c| {
        c.generation.passage_reuse = PassageReuse::Passages;
        c.generation.passage_precompute = true;
    });
    let c = client();
    // an answer while the blocks are being computed
    ask_ownership(&c, &server.address).await;
    let chunks = chunks_listed(&c, &server.address).await;
    assert!(chunks > 5, "{chunks}");
    assert_eq!(wait_for_block_files(&root, chunks, 300).await, chunks);

    // an upload: its chunk's block follows once the job is done (the next round)
    let form = reqwest::multipart::Form::new().part(
        "file",
        reqwest::multipart::Part::bytes(
            b"# Zebras\n\nZebras have black and white stripes that confuse biting flies.\n"
                .to_vec(),
        )
        .file_name("zebras.md"),
    );
    let res = c
        .post(format!("{}/v1/documents", server.address))
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 202);
    let mut now = chunks;
    for _ in 0..120 {
        now = chunks_listed(&c, &server.address).await;
        if now > chunks {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    assert_eq!(now, chunks + 1, "the upload is listed");
    assert_eq!(wait_for_block_files(&root, now, 120).await, now);
    drop(server);

    // off: nothing computed ahead, only the blocks of the answer's own passages
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("index");
    let server = server_in(&data, &[rust_book(OWNERSHIP)], |c| {
        c.generation.passage_reuse = PassageReuse::Passages;
        c.generation.passage_precompute = false;
    });
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    assert_eq!(block_files(&data.join("passages")), 0);
    ask_ownership(&c, &server.address).await;
    // top_k 2 in the tests' settings
    let written = wait_for_block_files(&data.join("passages"), 2, 30).await;
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert_eq!((written, block_files(&data.join("passages"))), (2, 2));
    drop(server);
}

/// Passage reuse is on by default, and off (with a warning) where it cannot place blocks:
/// without continuous batching (a draft model likewise), so such settings still start.
/// Continuous batching is each generator's own setting: a generator loaded later without it
/// leaves the first one placing its passages (it was process-wide once, and a test loading
/// without it turned reuse off in another test loading at the same time).
#[tokio::test]
async fn reuse_is_off_without_continuous_batching() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = crate::helpers::generation();
    c.model = config(dir.path()).generation.model;
    c.passage_reuse = docent::config::Config::default().generation.passage_reuse;
    assert_eq!(c.passage_reuse, PassageReuse::Passages);
    // every block of the second answer placed, none served by the prefix cache
    c.prefix_cache = false;
    let g = Generator::load(&c).await.unwrap();
    assert!(g.reuse_stats().is_some());
    c.continuous_batching = false;
    let off = Generator::load(&c).await.unwrap();
    assert!(off.reuse_stats().is_none());

    let prompts = prompts(dir.path());
    let prompt = prompts
        .render("Where do visitors park?", &blocks(&[PARKING, PRINTER]))
        .unwrap();
    answer(&g, &prompt).await;
    let placed = mistralrs::core::kv_spliced_positions();
    answer(&g, &prompt).await;
    let s = g.reuse_stats().unwrap();
    assert!(s.hits >= 2, "{s:?}");
    // the counter is the process's: other tests place blocks too, so the bound is the
    // passages' own tokens (less those prefilled again after the first), not just "more"
    let spliced = mistralrs::core::kv_spliced_positions() - placed;
    assert!(
        spliced + 2 * c.passage_recompute_tokens >= s.tokens,
        "the first generator still places its blocks: {spliced} of {}",
        s.tokens
    );
    drop(off);
}
