//! Who may call the API, and how often: API keys with scopes (`Authorization: Bearer`),
//! compared in constant time against their SHA-256 hashes, and per-key rate limits
//! (`governor`). Keys never reach the logs: only a key's name does.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::{header, Method, StatusCode};
use actix_web::middleware::Next;
use actix_web::{web, HttpMessage, ResponseError};
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::{AuthConfig, Scope};
use crate::metrics::metrics;
use crate::server::error::ApiError;

/// The caller of a request, in its extensions once authenticated.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The key's name; `anonymous` when auth is off or the route is public.
    pub name: String,
    /// What the caller may do: the key's scope; `write` when auth is off or the route is
    /// public.
    pub scope: Scope,
}

struct Key {
    name: String,
    scope: Scope,
    hash: [u8; 32],
}

/// The keys and the rate limiter, shared by every worker.
pub struct Access {
    enabled: bool,
    keys: Vec<Key>,
    limiter: Option<DefaultKeyedRateLimiter<String>>,
    checks: AtomicU64,
}

/// Routes anyone may call: liveness and readiness probes, and the web page with its
/// assets (the page asks for a key and sends it with its API calls).
fn public(path: &str) -> bool {
    matches!(path, "/healthz" | "/readyz" | "/") || path.starts_with("/assets/")
}

/// The scope a request needs: `write` to change the index, `read` for the rest.
pub fn required_scope(method: &Method, path: &str) -> Scope {
    let changes = (method == Method::POST && path == "/v1/documents")
        || (method == Method::DELETE && path.starts_with("/v1/documents/"));
    if changes {
        Scope::Write
    } else {
        Scope::Read
    }
}

impl Access {
    /// The keys and rate limit of `[auth]`. Keys whose hash is not `sha256:` and 64 hex
    /// digits are skipped; a `rate_per_minute` of 0 means no rate limit.
    pub fn new(config: &AuthConfig) -> Access {
        let keys = config
            .keys
            .iter()
            .filter_map(|k| {
                let mut hash = [0u8; 32];
                hex::decode_to_slice(k.hash.strip_prefix("sha256:")?, &mut hash).ok()?;
                Some(Key {
                    name: k.name.clone(),
                    scope: k.scope,
                    hash,
                })
            })
            .collect();
        let limiter = NonZeroU32::new(config.rate_per_minute).map(|rate| {
            let burst = NonZeroU32::new(config.burst).unwrap_or(NonZeroU32::MIN);
            RateLimiter::keyed(Quota::per_minute(rate).allow_burst(burst))
        });
        Access {
            enabled: config.enabled,
            keys,
            limiter,
            checks: AtomicU64::new(0),
        }
    }

    /// Keys are configured and required.
    pub fn required(&self) -> bool {
        self.enabled && !self.keys.is_empty()
    }

    /// The key a bearer token is, compared against every key in constant time.
    fn lookup(&self, token: &str) -> Option<&Key> {
        let presented: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let mut found = None;
        for k in &self.keys {
            if bool::from(k.hash.ct_eq(&presented)) {
                found = Some(k);
            }
        }
        found
    }

    /// Who is calling, or the 401/403 to answer.
    pub fn authenticate(
        &self,
        method: &Method,
        path: &str,
        authorization: Option<&str>,
    ) -> Result<Caller, ApiError> {
        if !self.required() || public(path) {
            return Ok(Caller {
                name: "anonymous".into(),
                scope: Scope::Write,
            });
        }
        let token = authorization
            .and_then(|h| {
                let (scheme, token) = h.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
            })
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "unauthorized",
                    "send an API key as `Authorization: Bearer <key>`",
                )
            })?;
        let key = self.lookup(token).ok_or_else(|| {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "the API key is not valid",
            )
        })?;
        let needed = required_scope(method, path);
        if key.scope < needed {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!(
                    "key {:?} has scope {:?}; {method} {path} needs {:?}",
                    key.name, key.scope, needed
                ),
            )
            .with_details(serde_json::json!({ "required_scope": needed, "scope": key.scope })));
        }
        Ok(Caller {
            name: key.name.clone(),
            scope: key.scope,
        })
    }

    /// Takes one request from `who`'s allowance, or the 429 to answer.
    pub fn rate_limit(&self, who: &str) -> Result<(), ApiError> {
        let Some(limiter) = &self.limiter else {
            return Ok(());
        };
        // forget idle callers now and then, so client addresses cannot grow the table
        if self.checks.fetch_add(1, Ordering::Relaxed) % 4096 == 4095 {
            limiter.retain_recent();
        }
        limiter.check_key(&who.to_string()).map_err(|not_until| {
            let wait = not_until.wait_time_from(DefaultClock::default().now());
            let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            metrics().rejected.with_label_values(&["rate"]).inc();
            ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                format!("too many requests for {who}; retry in {seconds} s"),
            )
            .retry_after(seconds.max(1))
        })
    }
}

/// The middleware: authenticates, checks the scope and the rate, and records the caller.
pub async fn gate(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    let Some(access) = req.app_data::<web::Data<Access>>().cloned() else {
        return next.call(req).await.map(|r| r.map_into_left_body());
    };
    // CORS preflights carry no credentials; the CORS layer answers them
    if req.method() == Method::OPTIONS {
        return next.call(req).await.map(|r| r.map_into_left_body());
    }
    let path = req.path().to_string();
    let authorization = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let checked = access
        .authenticate(req.method(), &path, authorization)
        .and_then(|caller| {
            // rates are per key: a server without keys (loopback, or auth off) has none
            if access.required() && !public(&path) {
                access.rate_limit(&format!("key:{}", caller.name))?;
            }
            Ok(caller)
        });
    match checked {
        Ok(caller) => {
            req.extensions_mut().insert(caller);
            next.call(req).await.map(|r| r.map_into_left_body())
        }
        Err(e) => {
            if e.status_code() != StatusCode::TOO_MANY_REQUESTS {
                tracing::warn!(path = %path, code = e.code(), "request refused");
            }
            Ok(req.into_response(e.error_response()).map_into_right_body())
        }
    }
}

/// A new random key (32 bytes, hex) and its config entry.
pub fn new_key(name: &str, scope: Scope) -> anyhow::Result<(String, String)> {
    let mut bytes = [0u8; 32];
    getrandom::getrandom(&mut bytes).map_err(|e| anyhow::anyhow!("no randomness: {e}"))?;
    let key = format!("dk_{}", hex::encode(bytes));
    let scope_name = match scope {
        Scope::Read => "read",
        Scope::Write => "write",
    };
    let line = format!(
        "[[auth.keys]]\nname = {name:?}\nscope = \"{scope_name}\"\nhash = \"{}\"",
        crate::config::hash_key(&key)
    );
    Ok((key, line))
}

/// Shared for the app data.
pub fn shared(config: &AuthConfig) -> web::Data<Access> {
    web::Data::from(Arc::new(Access::new(config)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{hash_key, ApiKey};

    fn access(rate: u32) -> Access {
        Access::new(&AuthConfig {
            enabled: true,
            keys: vec![
                ApiKey {
                    name: "reader".into(),
                    scope: Scope::Read,
                    hash: hash_key("read-key-0123456789"),
                },
                ApiKey {
                    name: "writer".into(),
                    scope: Scope::Write,
                    hash: hash_key("write-key-0123456789"),
                },
            ],
            rate_per_minute: rate,
            burst: 2,
        })
    }

    fn status(r: Result<Caller, ApiError>) -> u16 {
        match r {
            Ok(_) => 200,
            Err(e) => e.status_code().as_u16(),
        }
    }

    #[test]
    fn scopes_and_keys() {
        let a = access(0);
        let get = Method::GET;
        let post = Method::POST;
        let bearer = |k: &str| format!("Bearer {k}");
        assert_eq!(status(a.authenticate(&post, "/v1/query", None)), 401);
        assert_eq!(
            status(a.authenticate(&post, "/v1/query", Some("Basic abc"))),
            401
        );
        assert_eq!(
            status(a.authenticate(&post, "/v1/query", Some(&bearer("nope")))),
            401
        );
        let ok = a
            .authenticate(&post, "/v1/query", Some(&bearer("read-key-0123456789")))
            .unwrap();
        assert_eq!((ok.name.as_str(), ok.scope), ("reader", Scope::Read));
        assert_eq!(
            status(a.authenticate(&post, "/v1/documents", Some(&bearer("read-key-0123456789")))),
            403
        );
        assert_eq!(
            status(a.authenticate(
                &Method::DELETE,
                "/v1/documents/abc",
                Some(&bearer("read-key-0123456789"))
            )),
            403
        );
        assert_eq!(
            status(a.authenticate(
                &post,
                "/v1/documents",
                Some(&bearer("write-key-0123456789"))
            )),
            200
        );
        assert_eq!(
            status(a.authenticate(&get, "/v1/documents", Some(&bearer("read-key-0123456789")))),
            200
        );
        // probes are public; metrics are not
        assert_eq!(status(a.authenticate(&get, "/healthz", None)), 200);
        assert_eq!(status(a.authenticate(&get, "/readyz", None)), 200);
        assert_eq!(status(a.authenticate(&get, "/metrics", None)), 401);
    }

    #[test]
    fn the_web_page_is_public_and_its_api_calls_are_not() {
        let a = access(0);
        let get = Method::GET;
        assert_eq!(status(a.authenticate(&get, "/", None)), 200);
        assert_eq!(status(a.authenticate(&get, "/assets/app.js", None)), 200);
        assert_eq!(status(a.authenticate(&get, "/assets/nope", None)), 200);
        // only those paths: not a prefix match on `/`, nor `/assets` under /v1
        for path in [
            "/v1/documents",
            "/index.html",
            "/assets",
            "/v1/assets/x",
            "//",
        ] {
            assert_eq!(status(a.authenticate(&get, path, None)), 401, "{path}");
        }
    }

    #[test]
    fn no_keys_or_disabled_lets_everyone_in() {
        let none = Access::new(&AuthConfig::default());
        assert!(!none.required());
        assert_eq!(
            status(none.authenticate(&Method::POST, "/v1/documents", None)),
            200
        );
        let mut off = AuthConfig {
            enabled: false,
            ..AuthConfig::default()
        };
        off.keys.push(ApiKey {
            name: "k".into(),
            scope: Scope::Read,
            hash: hash_key("k"),
        });
        assert_eq!(
            status(Access::new(&off).authenticate(&Method::POST, "/v1/documents", None)),
            200
        );
    }

    #[test]
    fn rate_limit_allows_the_burst_then_429_with_retry_after() {
        let a = access(1);
        assert!(a.rate_limit("key:reader").is_ok());
        assert!(a.rate_limit("key:reader").is_ok());
        let e = a.rate_limit("key:reader").unwrap_err();
        assert_eq!(e.status_code(), StatusCode::TOO_MANY_REQUESTS);
        let r = e.error_response();
        let retry: u64 = r
            .headers()
            .get("retry-after")
            .unwrap()
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=60).contains(&retry), "{retry}");
        // another key has its own allowance
        assert!(a.rate_limit("key:writer").is_ok());
    }

    #[test]
    fn new_keys_verify_against_their_line() {
        let (key, line) = new_key("ci", Scope::Read).unwrap();
        assert!(key.starts_with("dk_") && key.len() == 67);
        let parsed: toml::Value = toml::from_str(&line).unwrap();
        let entry = &parsed["auth"]["keys"][0];
        assert_eq!(entry["hash"].as_str().unwrap(), hash_key(&key));
        assert_eq!(entry["scope"].as_str().unwrap(), "read");
        let (other, _) = new_key("ci", Scope::Read).unwrap();
        assert_ne!(key, other);
    }
}
