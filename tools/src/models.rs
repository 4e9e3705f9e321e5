//! `docent models`: the generation models docent knows by name, whether they are installed,
//! and which one the configuration names.

use std::path::Path;

use serde::Serialize;

use docent::query::generate::catalog::{self, KnownModel};

/// One catalog model as `docent models` lists it (a table row, or one object of the JSON).
#[derive(Debug, Serialize)]
pub struct ModelRow {
    /// The catalog name (what `generation.model` may be set to).
    pub name: String,
    /// One line on what the model is.
    pub description: String,
    /// Where its file is, or would be, in the models directory.
    pub path: String,
    /// The pinned size in bytes, else the installed file's; `None` when neither is known.
    pub bytes: Option<u64>,
    /// The file is there.
    pub installed: bool,
    /// The configuration's `generation.model` resolves to this file.
    pub configured: bool,
    /// The model's licence, as the catalog names it.
    pub licence: String,
    /// Where the file comes from.
    pub origin: String,
    /// The file's pinned sha256 (hex), where the catalog pins one.
    pub sha256: Option<String>,
    /// How to install it.
    pub setup: String,
}

/// One row per catalog model; `configured` is `generation.model` when the configuration
/// loaded.
pub fn rows(configured: Option<&Path>) -> Vec<ModelRow> {
    let configured = configured.map(catalog::resolve);
    catalog::known()
        .iter()
        .map(|m: &KnownModel| {
            let path = m.path();
            let installed = m.installed();
            let bytes = m
                .bytes
                .or_else(|| std::fs::metadata(&path).ok().map(|md| md.len()));
            ModelRow {
                name: m.name.clone(),
                description: m.description.clone(),
                path: path.display().to_string(),
                bytes,
                installed,
                configured: configured.as_deref() == Some(path.as_path()),
                licence: m.licence.clone(),
                origin: m.origin.clone(),
                sha256: m.sha256.clone(),
                setup: m.setup_hint(),
            }
        })
        .collect()
}

/// Prints the models as a table, or as JSON.
pub fn list(configured: Option<&Path>, json: bool) -> anyhow::Result<()> {
    let rows = rows(configured);
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    for r in &rows {
        let size = r
            .bytes
            .map_or_else(|| "?".into(), |b| format!("{:.0} MB", b as f64 / 1e6));
        let state = if r.installed {
            "installed".to_string()
        } else {
            format!("not installed: {}", r.setup)
        };
        let mark = if r.configured { " (configured)" } else { "" };
        println!("{}{mark}", r.name);
        println!("  {}, {size}, {state}", r.description);
        println!("  file:    {}", r.path);
        println!("  licence: {}", r.licence);
        println!("  origin:  {}", r.origin);
    }
    if let Some(c) = configured {
        if !rows.iter().any(|r| r.configured) {
            println!("configured: {} (not a catalog model)", c.display());
        }
    }
    Ok(())
}
