//! The BEIR layout `docent eval` reads: `corpus.jsonl`, `queries.jsonl` (with optional
//! metadata), `qrels/test.tsv` and the optional `answers.jsonl`.

use super::*;

/// One document of a BEIR corpus (`corpus.jsonl`).
#[derive(Deserialize)]
pub struct CorpusLine {
    /// The document's id (`_id`), as the qrels name it.
    #[serde(rename = "_id")]
    pub id: String,
    /// The document's title; empty when the line has none.
    #[serde(default)]
    pub title: String,
    /// The document's text.
    pub text: String,
}

#[derive(Deserialize)]
pub(crate) struct QueryLine {
    #[serde(rename = "_id")]
    pub(crate) id: String,
    pub(crate) text: String,
    #[serde(default)]
    pub(super) metadata: QueryMeta,
}

#[derive(Deserialize)]
pub(super) struct QueryMeta {
    #[serde(default = "yes")]
    pub(super) answerable: bool,
}

impl Default for QueryMeta {
    fn default() -> Self {
        QueryMeta { answerable: true }
    }
}

pub(super) fn yes() -> bool {
    true
}

#[derive(Deserialize)]
pub(super) struct AnswerLine {
    #[serde(rename = "query-id")]
    pub(super) query_id: String,
    #[serde(default)]
    pub(super) answers: Vec<String>,
}

/// A BEIR-layout evaluation set.
pub struct Dataset {
    /// The set's name: its folder's name.
    pub name: String,
    pub(crate) corpus: Vec<CorpusLine>,
    pub(crate) queries: Vec<QueryLine>,
    /// Query id → relevant corpus ids.
    pub(crate) qrels: HashMap<String, HashSet<String>>,
    /// Query id → gold answer strings (`answers.jsonl`, optional).
    pub(super) answers: HashMap<String, Vec<String>>,
}

pub(crate) fn jsonl<T: for<'de> Deserialize<'de>>(path: &Path) -> anyhow::Result<Vec<T>> {
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    std::io::BufReader::new(f)
        .lines()
        .enumerate()
        .filter(|(_, l)| l.as_ref().map_or(true, |l| !l.trim().is_empty()))
        .map(|(n, l)| {
            let l = l?;
            serde_json::from_str(&l)
                .with_context(|| format!("{} line {}: not a valid record", path.display(), n + 1))
        })
        .collect()
}

impl Dataset {
    /// Every question: id, text, whether it has relevant documents (answerable), its gold
    /// answers.
    pub(crate) fn questions(&self) -> Vec<(String, String, bool, Vec<String>)> {
        self.queries
            .iter()
            .map(|q| {
                (
                    q.id.clone(),
                    q.text.clone(),
                    self.qrels.contains_key(&q.id),
                    self.answers.get(&q.id).cloned().unwrap_or_default(),
                )
            })
            .collect()
    }

    /// Reads the set in `dir`: `corpus.jsonl`, `queries.jsonl`, `qrels/test.tsv` (pairs
    /// with a positive score; a `query-id` header line skipped) and `answers.jsonl` when it
    /// is there. Errors name the file and line.
    pub fn load(dir: &Path) -> anyhow::Result<Self> {
        let corpus = jsonl(&dir.join("corpus.jsonl"))?;
        let queries = jsonl(&dir.join("queries.jsonl"))?;
        let qrels_file = dir.join("qrels").join("test.tsv");
        let text = std::fs::read_to_string(&qrels_file)
            .with_context(|| format!("cannot read {}", qrels_file.display()))?;
        let mut qrels: HashMap<String, HashSet<String>> = HashMap::new();
        for (n, line) in text.lines().enumerate() {
            let cols: Vec<&str> = line.split('\t').collect();
            if n == 0 && cols.first() == Some(&"query-id") {
                continue;
            }
            match cols.as_slice() {
                [q, c, score, ..] if score.trim().parse::<f64>().is_ok_and(|s| s > 0.0) => {
                    qrels
                        .entry(q.to_string())
                        .or_default()
                        .insert(c.to_string());
                }
                [_, _, _, ..] => {}
                _ => anyhow::bail!(
                    "{} line {}: expected query-id, corpus-id, score",
                    qrels_file.display(),
                    n + 1
                ),
            }
        }
        let answers_file = dir.join("answers.jsonl");
        let answers = if answers_file.is_file() {
            jsonl::<AnswerLine>(&answers_file)?
                .into_iter()
                .map(|a| (a.query_id, a.answers))
                .collect()
        } else {
            HashMap::new()
        };
        Ok(Dataset {
            answers,
            name: dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            corpus,
            queries,
            qrels,
        })
    }
}

/// The questions of a BEIR `queries.jsonl`, in file order.
pub fn questions(path: &Path) -> anyhow::Result<Vec<String>> {
    Ok(jsonl::<QueryLine>(path)?
        .into_iter()
        .map(|q| q.text)
        .collect())
}
