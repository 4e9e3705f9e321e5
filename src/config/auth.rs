//! `[auth]`: API keys (stored as hashes) with their scopes, and the rate limits.

use super::*;

/// What an API key may do. `write` includes everything `read` allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Query, search, list documents and jobs, metrics.
    Read,
    /// Upload and delete documents, and everything `read` allows.
    Write,
}

impl std::str::FromStr for Scope {
    type Err = String;
    fn from_str(s: &str) -> Result<Scope, String> {
        match s {
            "read" => Ok(Scope::Read),
            "write" => Ok(Scope::Write),
            other => Err(format!("unknown scope {other:?}: use read or write")),
        }
    }
}

/// One API key, stored as the SHA-256 of the key (`docent keys new` prints both).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    /// A label for logs and metrics (never the key).
    pub name: String,
    /// What the key may do.
    pub scope: Scope,
    /// `sha256:` and 64 hex digits.
    pub hash: String,
}

/// The stored form of a key: `sha256:<hex>`.
pub fn hash_key(key: &str) -> String {
    use sha2::Digest;
    format!(
        "sha256:{}",
        hex::encode(sha2::Sha256::digest(key.as_bytes()))
    )
}

/// Shortest key accepted from `DOCENT_API_KEYS`.
pub const MIN_KEY_CHARS: usize = 16;

/// `[auth]`: who may call the API. Whenever keys are configured every `/v1` route and
/// `/metrics` need one (`Authorization: Bearer <key>`); `/healthz` and `/readyz` never do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// `false` turns authentication off altogether (a warning at start). With it on and
    /// no keys, the server only listens on loopback addresses.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// The accepted keys (none by default); `DOCENT_API_KEYS` adds more.
    #[serde(default)]
    pub keys: Vec<ApiKey>,
    /// Requests per minute per key (a server without keys has no rate limit); 0 = unlimited.
    #[serde(default = "default_rate_per_minute")]
    pub rate_per_minute: u32,
    /// Requests a key may send at once above the steady rate.
    #[serde(default = "default_burst")]
    pub burst: u32,
}

fn default_rate_per_minute() -> u32 {
    600
}
fn default_burst() -> u32 {
    60
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            enabled: true,
            keys: vec![],
            rate_per_minute: default_rate_per_minute(),
            burst: default_burst(),
        }
    }
}

impl AuthConfig {
    /// Keys from `DOCENT_API_KEYS` (`key:scope` pairs, comma-separated; development),
    /// hashed on arrival.
    pub fn add_env_keys(&mut self, raw: &str) -> Result<(), ConfigError> {
        for (i, pair) in raw
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .enumerate()
        {
            let (key, scope) = pair.rsplit_once(':').ok_or_else(|| ConfigError::Invalid {
                field: "DOCENT_API_KEYS",
                message: format!("entry {} is not key:scope (scope read or write)", i + 1),
            })?;
            let scope: Scope = scope.parse().map_err(|message| ConfigError::Invalid {
                field: "DOCENT_API_KEYS",
                message: format!("entry {}: {message}", i + 1),
            })?;
            if key.chars().count() < MIN_KEY_CHARS || key.chars().any(char::is_whitespace) {
                return Err(ConfigError::Invalid {
                    field: "DOCENT_API_KEYS",
                    message: format!(
                        "entry {}: a key needs at least {MIN_KEY_CHARS} characters and no spaces (`docent keys new` makes one)",
                        i + 1
                    ),
                });
            }
            self.keys.push(ApiKey {
                name: format!("env-{}", i + 1),
                scope,
                hash: hash_key(key),
            });
        }
        Ok(())
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        for k in &self.keys {
            let hex = k.hash.strip_prefix("sha256:").unwrap_or("");
            if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(ConfigError::Invalid {
                    field: "auth.keys",
                    message: format!(
                        "key {:?}: hash must be sha256: and 64 hex digits (from `docent keys new`)",
                        k.name
                    ),
                });
            }
        }
        if self.rate_per_minute > 0 && self.burst == 0 {
            return Err(ConfigError::Invalid {
                field: "auth.burst",
                message: "must be at least 1 when auth.rate_per_minute is set".into(),
            });
        }
        Ok(())
    }
}
