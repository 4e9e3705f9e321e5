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

async fn load(model: &std::path::Path, reuse: PassageReuse, prefix_cache: bool) -> Generator {
    let mut c = crate::helpers::generation();
    c.model = model.to_path_buf();
    c.passage_reuse = reuse;
    c.prefix_cache = prefix_cache;
    Generator::load(&c).await.unwrap()
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

    // the answer from the placed blocks still reads the parking passage
    let text = answer(&reusing, &prompt).await;
    eprintln!("passage mode: {text:?}");
    assert!(
        text.contains("-2") || text.to_lowercase().contains("underground"),
        "{text}"
    );
    assert!(reusing.reuse_stats().unwrap().hits >= 2);
}
