//! Stage **prompt**: fills the templates in `prompts/` with the question and the numbered
//! context blocks.

use std::path::Path;

use minijinja::{context, Environment};
use serde::Serialize;

/// Template files the query path needs, relative to `prompts.dir`.
pub const TEMPLATES: &[&str] = &[SYSTEM, USER, REFUSAL];
const SYSTEM: &str = "answer_system.jinja";
const USER: &str = "answer_user.jinja";
const REFUSAL: &str = "refusal.jinja";

#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    #[error("prompt template {name}: {message}")]
    Template { name: String, message: String },
}

/// One numbered context block as the template sees it.
#[derive(Debug, Clone, Serialize)]
pub struct ContextBlock<'a> {
    pub n: usize,
    pub title: &'a str,
    pub source: &'a str,
    pub text: &'a str,
}

/// The rendered conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    pub system: String,
    pub user: String,
}

pub struct Prompts {
    env: Environment<'static>,
}

impl Prompts {
    /// Reads and compiles every template in `dir`.
    pub fn load(dir: &Path) -> Result<Self, PromptError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        for name in TEMPLATES {
            let path = dir.join(name);
            let source = std::fs::read_to_string(&path).map_err(|e| PromptError::Template {
                name: path.display().to_string(),
                message: e.to_string(),
            })?;
            env.add_template_owned(name.to_string(), source)
                .map_err(|e| PromptError::Template {
                    name: path.display().to_string(),
                    message: e.to_string(),
                })?;
        }
        Ok(Prompts { env })
    }

    /// The answer given without calling the model when nothing relevant was retrieved.
    pub fn refusal(&self, question: &str) -> Result<String, PromptError> {
        self.env
            .get_template(REFUSAL)
            .and_then(|t| t.render(context! { question }))
            .map(|s| s.trim().to_string())
            .map_err(|e| PromptError::Template {
                name: REFUSAL.to_string(),
                message: e.to_string(),
            })
    }

    pub fn render(
        &self,
        question: &str,
        contexts: &[ContextBlock<'_>],
    ) -> Result<Prompt, PromptError> {
        let render = |name: &str| {
            self.env
                .get_template(name)
                .and_then(|t| t.render(context! { question, contexts }))
                .map_err(|e| PromptError::Template {
                    name: name.to_string(),
                    message: e.to_string(),
                })
        };
        Ok(Prompt {
            system: render(SYSTEM)?.trim().to_string(),
            user: render(USER)?.trim().to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shipped() -> Prompts {
        Prompts::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("prompts")).unwrap()
    }

    #[test]
    fn renders_numbered_blocks_and_question() {
        let p = shipped()
            .render(
                "  What is a crate? ",
                &[
                    ContextBlock {
                        n: 1,
                        title: "Packages",
                        source: "/a.md",
                        text: "A crate is a compilation unit.\n",
                    },
                    ContextBlock {
                        n: 2,
                        title: "Other",
                        source: "/b.md",
                        text: "Unrelated.",
                    },
                ],
            )
            .unwrap();
        assert!(p.system.contains("[1]"), "system asks for [n] citations");
        assert!(
            p.user
                .contains("[1] A crate is a compilation unit.\n\n[2] Unrelated."),
            "{}",
            p.user
        );
        assert!(
            p.user.starts_with("Question: What is a crate?"),
            "{}",
            p.user
        );
        assert!(
            p.user.contains("answer the question \"What is a crate?\""),
            "{}",
            p.user
        );
    }

    #[test]
    fn broken_template_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(SYSTEM), "ok").unwrap();
        std::fs::write(dir.path().join(REFUSAL), "no").unwrap();
        std::fs::write(dir.path().join(USER), "{% for x in %}").unwrap();
        let e = Prompts::load(dir.path()).err().unwrap().to_string();
        assert!(e.contains(USER), "{e}");
    }
}
