//! The prompt as the engine receives it: the rendered conversation ([`Prompt`]), its turns,
//! the token counter the prompt budget uses, and the fence that quotes the context. The
//! answer path renders and fits it (docent's `query::prompt`); an engine only reads it.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Who said a turn of the conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The person asking.
    User,
    /// The model answering.
    Assistant,
}

/// An earlier turn of the conversation (`history` of a query).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Turn {
    /// Who said it.
    pub role: Role,
    /// What was said (not empty).
    pub content: String,
}

/// Counts tokens as the model will: its tokenizer for the text of a message, plus what its
/// chat template adds around the messages.
#[derive(Clone)]
pub struct TokenCounter {
    encode: Arc<dyn Fn(&str) -> usize + Send + Sync>,
    /// Template tokens: `base + per_message * messages` (with the generation prompt).
    base: usize,
    per_message: usize,
}

impl TokenCounter {
    /// A counter with the tokenizer `encode` and the template's overhead: `base` tokens
    /// (generation prompt included) plus `per_message` for each message.
    pub fn new(
        encode: impl Fn(&str) -> usize + Send + Sync + 'static,
        base: usize,
        per_message: usize,
    ) -> Self {
        TokenCounter {
            encode: Arc::new(encode),
            base,
            per_message,
        }
    }

    /// Tokens of one message's text.
    pub fn text(&self, text: &str) -> usize {
        (self.encode)(text)
    }

    /// Tokens the template adds for `messages` messages.
    pub fn template(&self, messages: usize) -> usize {
        self.base + self.per_message * messages
    }
}

/// The rendered conversation: system prompt, earlier turns, then the question with its
/// context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    /// The rendered system prompt.
    pub system: String,
    /// The earlier turns that fit, oldest first.
    pub history: Vec<Turn>,
    /// The rendered user message: the question with its numbered context blocks.
    pub user: String,
    /// The yes/no pre-question asked after `user` when `generation.refusal` is
    /// `question` (`answer_check.jinja`; empty: none).
    pub check: String,
    /// The tag the context is quoted in (`doc-…`).
    pub fence: String,
    /// The context blocks' texts as `user` quotes them, in order (passage reuse finds their
    /// tokens in the prompt; empty when the prompt quotes none).
    pub passages: Vec<String>,
}

impl Prompt {
    /// The same prompt quoted in `fence` instead of its own (passage reuse computes a
    /// fenced prompt's passages in a fence of its own: the request's fence stays new and
    /// unknown to documents, the passages' keys and values stay the same across requests).
    pub fn with_fence(&self, fence: &str) -> Prompt {
        if self.fence.is_empty() {
            return self.clone();
        }
        let swap = |s: &str| s.replace(&self.fence, fence);
        Prompt {
            system: swap(&self.system),
            history: self.history.clone(),
            user: swap(&self.user),
            check: swap(&self.check),
            fence: fence.to_string(),
            passages: self.passages.clone(),
        }
    }

    /// The prompt's own markup, which an answer must not repeat: the fence tags.
    pub fn markup(&self) -> Vec<String> {
        if self.fence.is_empty() {
            return Vec::new();
        }
        vec![format!("<{}>", self.fence), format!("</{}>", self.fence)]
    }
}

/// A fence for one prompt's quoted context: `doc-` and 8 random hex digits, new for each
/// request, so no document can write the closing tag in advance.
pub fn fence() -> String {
    let mut b = [0u8; 4];
    // without randomness the fence is still there, only guessable
    let _ = getrandom::getrandom(&mut b);
    format!("doc-{}", hex::encode(b))
}
