//! The web page (`web/` at the repository root): `GET /` and `GET /assets/{name}`, compiled
//! into the binary, so nothing is fetched from elsewhere at run time. Public (no API key):
//! the page asks for a key and sends it with its own API calls. Every response carries a
//! strict Content-Security-Policy (this origin only, no inline code) and an `ETag` from the
//! content's hash, revalidated on every use (`Cache-Control: no-cache`), so a new binary
//! never serves a stale page.

use std::sync::LazyLock;

use actix_web::http::header::{self, HeaderValue};
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use sha2::{Digest, Sha256};

use crate::server::error::ApiError;

/// What the page may load and run: its own scripts, styles, images and API, nothing else;
/// no inline scripts or styles, no framing, no plugins.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self'; connect-src 'self'; form-action 'self'; \
     base-uri 'none'; frame-ancestors 'none'";

/// One embedded file.
pub struct Asset {
    /// The file's name under `web/`, as requested at `/assets/{name}`.
    pub name: &'static str,
    /// The `Content-Type` it is served with.
    pub content_type: &'static str,
    /// The file's bytes, included at compile time.
    pub body: &'static [u8],
    /// A strong validator: the first 16 bytes of the body's SHA-256, quoted.
    pub etag: String,
}

macro_rules! asset {
    ($name:literal, $content_type:literal) => {
        (
            $name,
            $content_type,
            include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/web/", $name)).as_slice(),
        )
    };
}

/// The page's files; `index.html` is served at `/`, every file at `/assets/{name}`.
static ASSETS: LazyLock<Vec<Asset>> = LazyLock::new(|| {
    [
        asset!("index.html", "text/html; charset=utf-8"),
        asset!("app.css", "text/css; charset=utf-8"),
        asset!("app.js", "text/javascript; charset=utf-8"),
        asset!("icon.svg", "image/svg+xml"),
    ]
    .into_iter()
    .map(|(name, content_type, body)| Asset {
        name,
        content_type,
        body,
        etag: format!("\"{}\"", hex::encode(&Sha256::digest(body)[..16])),
    })
    .collect()
});

/// The embedded file called `name`.
pub fn asset(name: &str) -> Option<&'static Asset> {
    ASSETS.iter().find(|a| a.name == name)
}

/// True when `If-None-Match` lists `etag` (or `*`): the client's copy is current.
fn not_modified(req: &HttpRequest, etag: &str) -> bool {
    req.headers()
        .get_all(header::IF_NONE_MATCH)
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|t| t.trim().trim_start_matches("W/"))
        .any(|t| t == etag || t == "*")
}

fn respond(req: &HttpRequest, a: &Asset) -> HttpResponse {
    let fresh = not_modified(req, &a.etag);
    let mut response = if fresh {
        HttpResponse::NotModified()
    } else {
        HttpResponse::Ok()
    };
    response
        .insert_header((header::ETAG, a.etag.as_str()))
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .insert_header((header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY))
        .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .insert_header((header::REFERRER_POLICY, "no-referrer"))
        .insert_header((header::X_FRAME_OPTIONS, "DENY"));
    if fresh {
        return response.finish();
    }
    response
        .insert_header((
            header::CONTENT_TYPE,
            HeaderValue::from_static(a.content_type),
        ))
        .body(a.body)
}

/// `GET /`: the page.
pub async fn page(req: HttpRequest) -> Result<HttpResponse, ApiError> {
    let index = asset("index.html").ok_or_else(|| missing("index.html"))?;
    Ok(respond(&req, index))
}

/// `GET /assets/{name}`: the page's scripts, styles and icon.
pub async fn file(req: HttpRequest, name: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let a = asset(&name).ok_or_else(|| missing(&name))?;
    Ok(respond(&req, a))
}

fn missing(name: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no asset named {name:?}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::body::MessageBody;
    use actix_web::test::TestRequest;

    fn header(r: &HttpResponse, name: header::HeaderName) -> &str {
        r.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
    }

    fn body(r: HttpResponse) -> Vec<u8> {
        r.into_body()
            .try_into_bytes()
            .map(|b| b.to_vec())
            .unwrap_or_default()
    }

    #[actix_web::test]
    async fn the_page_is_html_with_a_strict_policy() {
        let r = page(TestRequest::get().uri("/").to_http_request())
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(header(&r, header::CONTENT_TYPE), "text/html; charset=utf-8");
        let csp = header(&r, header::CONTENT_SECURITY_POLICY);
        assert!(csp.starts_with("default-src 'none'"), "{csp}");
        assert!(!csp.contains("unsafe"), "{csp}");
        assert!(!csp.contains("http"), "only this origin: {csp}");
        assert_eq!(header(&r, header::X_CONTENT_TYPE_OPTIONS), "nosniff");
        assert_eq!(header(&r, header::CACHE_CONTROL), "no-cache");
        let html = String::from_utf8(body(r)).unwrap();
        assert!(html.starts_with("<!doctype html>"));
        assert!(html.contains(r#"<script type="module" src="/assets/app.js">"#));
    }

    #[actix_web::test]
    async fn each_asset_has_its_type_and_unknown_names_are_404() {
        for (name, content_type) in [
            ("app.js", "text/javascript; charset=utf-8"),
            ("app.css", "text/css; charset=utf-8"),
            ("icon.svg", "image/svg+xml"),
        ] {
            let req = TestRequest::get()
                .uri(&format!("/assets/{name}"))
                .to_http_request();
            let r = file(req, web::Path::from(name.to_string())).await.unwrap();
            assert_eq!(r.status(), StatusCode::OK, "{name}");
            assert_eq!(header(&r, header::CONTENT_TYPE), content_type, "{name}");
            assert!(!body(r).is_empty(), "{name}");
        }
        for name in ["nope.js", "../Cargo.toml", "", "index.html/"] {
            let req = TestRequest::get().uri("/assets/x").to_http_request();
            let e = file(req, web::Path::from(name.to_string()))
                .await
                .unwrap_err();
            assert_eq!(e.code(), "not_found", "{name:?}");
        }
    }

    #[actix_web::test]
    async fn a_current_copy_is_not_sent_again() {
        let etag = asset("app.js").unwrap().etag.clone();
        assert_eq!(etag.len(), 34, "{etag}");
        for sent in [
            etag.clone(),
            format!("W/{etag}"),
            format!("\"other\", {etag}"),
            "*".into(),
        ] {
            let req = TestRequest::get()
                .insert_header((header::IF_NONE_MATCH, sent.as_str()))
                .to_http_request();
            let r = file(req, web::Path::from("app.js".to_string()))
                .await
                .unwrap();
            assert_eq!(r.status(), StatusCode::NOT_MODIFIED, "{sent}");
            assert_eq!(header(&r, header::ETAG), etag);
            assert!(body(r).is_empty());
        }
        let req = TestRequest::get()
            .insert_header((header::IF_NONE_MATCH, "\"stale\""))
            .to_http_request();
        let r = file(req, web::Path::from("app.js".to_string()))
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(header(&r, header::ETAG), etag);
    }

    #[test]
    fn etags_differ_per_file_and_the_page_uses_only_embedded_assets() {
        let tags: std::collections::HashSet<_> = ASSETS.iter().map(|a| &a.etag).collect();
        assert_eq!(tags.len(), ASSETS.len());
        // every local reference of the page is an embedded asset; nothing is external
        let html = std::str::from_utf8(asset("index.html").unwrap().body).unwrap();
        for part in html.split(['"', '\'']) {
            if let Some(name) = part.strip_prefix("/assets/") {
                assert!(asset(name).is_some(), "index.html names {part}");
            }
            assert!(!part.starts_with("http"), "external reference {part}");
            assert!(!part.starts_with("//"), "external reference {part}");
        }
        // no inline script or style (the policy would block it)
        assert!(!html.contains("<style"));
        assert!(!html.contains(" style="));
        for (at, _) in html.match_indices("<script") {
            assert!(
                html[at..].starts_with(r#"<script type="module" src="/assets/"#),
                "inline script at {at}"
            );
        }
    }
}
