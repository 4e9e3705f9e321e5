//! mistral.rs on a real model with an independent reference: stories260K's greedy output
//! from karpathy's llama2.c.

use docent::config::Config;
use docent::generate::Generator;

use crate::helpers::shared;

#[tokio::test]
async fn stories260k_greedy_matches_llama2c() {
    let dir = shared().join("models/stories260K");
    let reference = std::fs::read_to_string(dir.join("greedy_reference.txt")).unwrap();
    let mut c = Config::default().generation;
    c.model = dir.join("stories260K.gguf");
    c.dtype = "f32".into();
    let generator = Generator::load(&c).await.expect("load stories260K");
    // llama2.c starts from BOS (id 1) with an empty prompt and runs 200 positions.
    let g = generator.complete_tokens(vec![1], 199).await.unwrap();
    let ids = g.token_ids.clone().expect("token ids");
    let text = generator.detokenize(ids.clone()).await.unwrap();
    eprintln!(
        "ids: {ids:?}\nmistral.rs decoded: {text:?}\nengine text: {:?}\nreference: {reference:?}",
        g.text
    );
    assert_eq!(text.trim(), reference.trim_end());
}
