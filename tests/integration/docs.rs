//! The documentation says only what is true: every `docent` subcommand and flag that the
//! README and `docs/` name exists (checked against the command-line definitions,
//! `docent_cli::Cli`), every configuration key they name exists in the typed config, every
//! TOML example reads into it, and every curl example of the README and `docs/api.md` gets
//! the status its `# status: NNN` line shows from a real server.

use std::path::{Path, PathBuf};

use clap::CommandFactory;
use serde_json::Value;

use crate::helpers::{repo, rust_book, server_over, INSTALLATION, OWNERSHIP};

/// The README and the user documents (not the design notes under `docs/plans/` and
/// `docs/research/`).
fn documents() -> Vec<PathBuf> {
    let mut files = vec![repo().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(repo().join("docs"))
        .expect("docs/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

fn name(path: &Path) -> String {
    path.strip_prefix(repo())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// A fenced code block: its language and its lines (with 1-based line numbers).
struct Block {
    lang: String,
    lines: Vec<(usize, String)>,
}

/// The fenced code blocks of a Markdown text, and its inline code spans outside them.
fn split(text: &str) -> (Vec<Block>, Vec<(usize, String)>) {
    let (mut blocks, mut spans) = (Vec::new(), Vec::new());
    let mut open: Option<Block> = None;
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let trimmed = line.trim_start();
        if let Some(rest) = trimmed.strip_prefix("```") {
            match open.take() {
                Some(block) => blocks.push(block),
                None => {
                    open = Some(Block {
                        lang: rest.trim().to_string(),
                        lines: Vec::new(),
                    })
                }
            }
            continue;
        }
        match open.as_mut() {
            Some(block) => block.lines.push((n, line.to_string())),
            None => {
                let parts: Vec<&str> = line.split('`').collect();
                // odd pieces are inside backticks (a line with an unmatched one: none)
                if parts.len() % 2 == 1 {
                    spans.extend(parts.iter().skip(1).step_by(2).map(|s| (n, s.to_string())));
                }
            }
        }
    }
    (blocks, spans)
}

/// The code a reader might run: inline spans and the lines of shell blocks (`sh`, `bash`,
/// `console` or unlabelled; `text` blocks hold diagrams and placeholders).
fn command_snippets(text: &str) -> Vec<(usize, String)> {
    let (blocks, mut spans) = split(text);
    for b in blocks {
        if ["sh", "bash", "console", "shell", ""].contains(&b.lang.as_str()) {
            spans.extend(b.lines);
        }
    }
    spans
}

/// `NAME=value`, as a shell command's prefix.
fn env_assignment(word: &str) -> bool {
    word.split_once('=').is_some_and(|(name, _)| {
        !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
    })
}

/// Long flag names of a command, including the global ones it inherits.
fn long_flags(cmd: &clap::Command) -> Vec<String> {
    cmd.get_arguments()
        .filter_map(|a| a.get_long().map(str::to_string))
        .collect()
}

/// Problems with one `docent …` command line (`words` after `docent`), or none.
fn check_command(root: &clap::Command, words: &[&str]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut cmd = root;
    let mut path = vec!["docent".to_string()];
    for raw in words {
        // shell punctuation ends the command (a pipe, a comment, another command)
        if ["|", "&&", ";", ">", "2>&1"].contains(raw) || raw.starts_with('#') {
            break;
        }
        let word = raw.trim_matches(|c| "[](){}`,'\"".contains(c));
        if let Some(flag) = word.strip_prefix("--") {
            let flag = flag.split('=').next().unwrap_or_default();
            let flag = flag.trim_end_matches(|c: char| !(c.is_ascii_alphanumeric() || c == '-'));
            if !flag.is_empty() && !long_flags(cmd).iter().any(|f| f == flag) {
                problems.push(format!("`{}` has no flag --{flag}", path.join(" ")));
            }
            continue;
        }
        if word.is_empty() || word.starts_with('-') || !cmd.has_subcommands() {
            continue; // a short flag, a value or an argument
        }
        match cmd.find_subcommand(word) {
            Some(sub) => {
                cmd = sub;
                path.push(word.to_string());
            }
            None => {
                if word.chars().all(|c| c.is_ascii_lowercase() || c == '-') {
                    problems.push(format!("`{} {word}` is no subcommand", path.join(" ")));
                }
                break; // a placeholder (`COMMAND`, `…`): nothing more to check
            }
        }
    }
    problems
}

#[test]
fn every_docent_command_and_flag_named_in_the_docs_exists() {
    let mut root = docent_cli::Cli::command();
    root.build();
    let mut problems = Vec::new();
    let mut checked = 0;
    for file in documents() {
        let text = std::fs::read_to_string(&file).expect("read");
        for (line, snippet) in command_snippets(&text) {
            // a command is a line (or the part after `&&`, `;` or `$(`) that starts with
            // `docent `, after environment assignments and a `$ ` prompt
            for part in snippet.split("&&").flat_map(|p| p.split(';')) {
                let part = part.rsplit("$(").next().unwrap_or(part);
                let mut words = part.split_whitespace().peekable();
                while words.peek().is_some_and(|w| *w == "$" || env_assignment(w)) {
                    words.next();
                }
                if words.next() != Some("docent") {
                    continue;
                }
                let words: Vec<&str> = words.collect();
                if words.is_empty() {
                    continue;
                }
                checked += 1;
                for p in check_command(&root, &words) {
                    problems.push(format!("{}:{line}: {p}", name(&file)));
                }
            }
        }
    }
    eprintln!("{checked} docent command lines checked");
    assert!(checked > 50, "too few command lines found: {checked}");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The typed configuration with every optional part filled in, as JSON: the tree of keys
/// that exist.
fn config_tree() -> Value {
    let mut c = docent::config::Config::default();
    c.generation.draft = Some(docent::config::DraftConfig {
        model: "draft.gguf".into(),
        gamma: 4,
    });
    c.store.url = Some("http://qdrant:6334".into());
    c.store.api_key = Some("key".into());
    c.retrieval.fusion.mmr_lambda = Some(0.5);
    serde_json::to_value(&c).expect("config as JSON")
}

/// A `POST /v1/query` body with every optional part filled in, as JSON (its `retrieval.…`
/// and `generation.…` fields share names with the configuration's).
fn request_tree() -> Value {
    let request: docent::query::QueryRequest = serde_json::from_value(serde_json::json!({
        "question": "q",
        "retrieval": {"top_k": 1, "mode": "hybrid", "min_score": 0.1, "neighbors": 0,
                      "filter": {"collection": "c"}},
        "generation": {"max_tokens": 1, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                       "repetition_penalty": 1.0, "dry_multiplier": 0.0, "stop": ["x"],
                       "seed": 1, "lookup_tokens": 0, "draft_model": false},
    }))
    .expect("a request");
    serde_json::to_value(&request).expect("request as JSON")
}

/// Whether `path` (keys from the top) exists in `tree`. A key whose value is empty (an
/// option left out, an empty list of tables) holds whatever its documentation says.
fn key_exists(tree: &Value, path: &[&str]) -> bool {
    let mut at = tree;
    for key in path {
        match at {
            // a map (kind → setting, extension → limit): any key
            Value::Object(map) if map.is_empty() => return true,
            Value::Object(map) => match map.get(*key) {
                Some(v) => at = v,
                None => return false,
            },
            Value::Null => return true,
            Value::Array(items) => match items.first() {
                Some(first) => return key_exists(first, std::slice::from_ref(key)),
                None => return true,
            },
            _ => return false,
        }
    }
    true
}

/// Every key path of a TOML value.
fn toml_paths(value: &toml::Value, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match value {
        toml::Value::Table(t) => {
            for (k, v) in t {
                prefix.push(k.clone());
                out.push(prefix.clone());
                toml_paths(v, prefix, out);
                prefix.pop();
            }
        }
        toml::Value::Array(items) => {
            for v in items.iter().filter(|v| v.is_table()) {
                toml_paths(v, prefix, out);
            }
        }
        _ => {}
    }
}

/// File names that look like keys (`safety.rs`).
const FILE_ENDINGS: &[&str] = &[".rs", ".md", ".toml", ".json", ".jsonl", ".py", ".sh"];

#[test]
fn every_config_key_named_in_the_docs_exists() {
    let tree = config_tree();
    let request = request_tree();
    let sections: Vec<String> = tree
        .as_object()
        .expect("an object")
        .keys()
        .cloned()
        .collect();
    let dotted = regex::Regex::new(r"^[a-z_]+(\.[a-z0-9_]+)+$").unwrap();
    let env = regex::Regex::new(r"\bDOCENT_([A-Z0-9_]+)").unwrap();
    let mut problems = Vec::new();
    let mut checked = 0;
    for file in documents() {
        let text = std::fs::read_to_string(&file).expect("read");
        let (blocks, spans) = split(&text);
        // `section.key` in inline code
        for (line, span) in &spans {
            let span = span.split(['=', ' ']).next().unwrap_or_default().trim();
            if !dotted.is_match(span) || FILE_ENDINGS.iter().any(|e| span.ends_with(e)) {
                continue;
            }
            let path: Vec<&str> = span.split('.').collect();
            if !sections.iter().any(|s| s == path[0]) {
                continue;
            }
            checked += 1;
            if !key_exists(&tree, &path) && !key_exists(&request, &path) {
                problems.push(format!("{}:{line}: no config key `{span}`", name(&file)));
            }
        }
        // DOCENT_SECTION__KEY anywhere
        for (i, line) in text.lines().enumerate() {
            for m in env.captures_iter(line) {
                let var = m[1].to_ascii_lowercase();
                let path: Vec<&str> = var.split("__").collect();
                if path.iter().any(|k| k.is_empty()) {
                    continue; // a pattern (`DOCENT_STORE__*`)
                }
                let top_level_key = path.len() == 1 && sections.iter().any(|s| s == path[0]);
                if path.len() < 2 && !top_level_key {
                    continue; // the setup's and the tests' own variables
                }
                if path.len() >= 2 && !sections.iter().any(|s| s == path[0]) {
                    problems.push(format!(
                        "{}:{}: DOCENT_{} names no config section",
                        name(&file),
                        i + 1,
                        &m[1]
                    ));
                    continue;
                }
                checked += 1;
                if !key_exists(&tree, &path) {
                    problems.push(format!(
                        "{}:{}: DOCENT_{} names no config key",
                        name(&file),
                        i + 1,
                        &m[1]
                    ));
                }
            }
        }
        // TOML examples: every key exists
        for block in blocks.iter().filter(|b| b.lang == "toml") {
            let body: String = block.lines.iter().map(|(_, l)| format!("{l}\n")).collect();
            let first = block.lines.first().map_or(0, |(n, _)| *n);
            let value: toml::Value = match toml::from_str(&body) {
                Ok(v) => v,
                Err(e) => {
                    problems.push(format!("{}:{first}: TOML does not parse: {e}", name(&file)));
                    continue;
                }
            };
            let mut paths = Vec::new();
            toml_paths(&value, &mut Vec::new(), &mut paths);
            for path in paths {
                checked += 1;
                let path: Vec<&str> = path.iter().map(String::as_str).collect();
                if !key_exists(&tree, &path) {
                    problems.push(format!(
                        "{}:{first}: TOML example sets `{}`, no such key",
                        name(&file),
                        path.join(".")
                    ));
                }
            }
        }
    }
    eprintln!("{checked} configuration keys checked");
    assert!(checked > 100, "too few keys found: {checked}");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Every key of the typed config is in docs/configuration.md.
#[test]
fn configuration_md_lists_every_key() {
    let text = std::fs::read_to_string(repo().join("docs/configuration.md")).expect("read");
    let (_, spans) = split(&text);
    let named: std::collections::HashSet<String> = spans.into_iter().map(|(_, s)| s).collect();
    let mut missing = Vec::new();
    fn leaves(v: &Value, prefix: &str, out: &mut Vec<String>) {
        match v {
            Value::Object(map) if !map.is_empty() => {
                for (k, v) in map {
                    let p = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    leaves(v, &p, out);
                }
            }
            _ => out.push(prefix.to_string()),
        }
    }
    let mut keys = Vec::new();
    leaves(&config_tree(), "", &mut keys);
    for key in &keys {
        // a key is documented under its full path, or its table is (`auth.keys`)
        let documented = named.contains(key)
            || key
                .rsplit_once('.')
                .is_some_and(|(table, _)| named.contains(table));
        if !documented {
            missing.push(key.clone());
        }
    }
    assert!(keys.len() > 80, "{} keys", keys.len());
    assert!(
        missing.is_empty(),
        "not in docs/configuration.md: {}",
        missing.join(", ")
    );
}

/// One curl example: where it is, the status it shows and the command.
struct Example {
    at: String,
    status: u16,
    command: String,
}

fn curl_examples(file: &Path) -> (Vec<Example>, Vec<String>) {
    let text = std::fs::read_to_string(file).expect("read");
    let (blocks, _) = split(&text);
    let (mut examples, mut unmarked) = (Vec::new(), Vec::new());
    for block in blocks.iter().filter(|b| b.lang == "sh") {
        let mut status: Option<u16> = None;
        let mut lines = block.lines.iter().peekable();
        while let Some((n, line)) = lines.next() {
            let t = line.trim();
            if let Some(s) = t.strip_prefix("# status:") {
                status = s.trim().parse().ok();
                continue;
            }
            if !t.starts_with("curl ") {
                continue;
            }
            let mut command = t.trim_end_matches('\\').to_string();
            let mut continued = t.ends_with('\\');
            while continued {
                let Some((_, next)) = lines.next() else { break };
                let next = next.trim();
                continued = next.ends_with('\\');
                command.push(' ');
                command.push_str(next.trim_end_matches('\\'));
            }
            let at = format!("{}:{n}", name(file));
            match status.take() {
                Some(status) => examples.push(Example {
                    at,
                    status,
                    command,
                }),
                None => unmarked.push(at),
            }
        }
    }
    (examples, unmarked)
}

#[tokio::test]
async fn every_curl_example_gets_the_status_it_shows() {
    let (_dir, address) = server_over(&[rust_book(INSTALLATION), rust_book(OWNERSHIP)], |_| {});
    let mut examples = Vec::new();
    for file in [repo().join("README.md"), repo().join("docs/api.md")] {
        let (found, unmarked) = curl_examples(&file);
        assert!(
            unmarked.is_empty(),
            "curl examples without a `# status: NNN` line: {unmarked:?}"
        );
        examples.extend(found);
    }
    assert!(examples.len() >= 20, "{} examples", examples.len());
    let mut failures = Vec::new();
    for ex in &examples {
        let command = ex.command.replace("http://127.0.0.1:8080", &address);
        let out = tokio::process::Command::new("bash")
            .arg("-c")
            .arg(format!(
                "{command} --max-time 300 -o /dev/null -w '%{{http_code}}'"
            ))
            .current_dir(repo())
            .output()
            .await
            .expect("run bash");
        let got = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if got != ex.status.to_string() {
            failures.push(format!(
                "{}: expected {}, got {got:?} ({}; stderr {})",
                ex.at,
                ex.status,
                ex.command,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    eprintln!("{} curl examples run", examples.len());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
