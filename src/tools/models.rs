//! `docent models`: the generation models docent knows by name, whether they are installed,
//! and which one the configuration names.

use std::path::Path;

use serde::Serialize;

use crate::query::generate::catalog::{self, KnownModel};

#[derive(Debug, Serialize)]
pub struct ModelRow {
    pub name: String,
    pub description: String,
    pub path: String,
    /// The pinned size, else the installed file's.
    pub bytes: Option<u64>,
    pub installed: bool,
    pub configured: bool,
    pub licence: String,
    pub origin: String,
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
