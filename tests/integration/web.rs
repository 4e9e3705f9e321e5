//! The web page (issue 19) in a real browser: Debian's Chromium, driven by playwright-core
//! (`tests/web/e2e.mjs`), against the real server and models on a random port, over an
//! index with a Rust Book chapter. `scripts/web-test-deps.sh` (run by `make test`) installs
//! both. Screenshots go to `$CARGO_TARGET_TMPDIR/web/` (the README's `docs/web-page.png`
//! is a copy of `web-page.png`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use docent::config::{hash_key, ApiKey, Scope};

use crate::helpers::{client, own_server, repo};

/// One browser at a time: each run starts its own Chromium and asks the model.
static BROWSER: Mutex<()> = Mutex::new(());

const KEY: &str = "web-page-test-key-0123456789";

fn chromium() -> PathBuf {
    std::env::var_os("CHROMIUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"))
}

fn screenshots() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("web");
    std::fs::create_dir_all(&dir).expect("screenshot folder");
    dir
}

/// Runs the browser scenario against `base`; its output. Fails (never skips) when the
/// browser or playwright-core is missing: `make test` installs them.
fn e2e(base: &str, scenario: &str, extra: &[&str]) -> String {
    let _one = BROWSER.lock().unwrap_or_else(|e| e.into_inner());
    let web = repo().join("tests/web");
    assert!(
        chromium().exists(),
        "{} is missing: run scripts/web-test-deps.sh (apt-get install chromium) or set CHROMIUM",
        chromium().display()
    );
    assert!(
        web.join("node_modules/playwright-core/package.json")
            .exists(),
        "playwright-core is missing: run scripts/web-test-deps.sh (npm ci in tests/web)"
    );
    let out = Command::new("node")
        .arg(web.join("e2e.mjs"))
        .arg(base)
        .arg(scenario)
        .args(extra)
        .arg("--out")
        .arg(screenshots())
        .env("CHROMIUM", chromium())
        .env("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
        .output()
        .expect("run node (the browser test needs node 20 or newer)");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("{stdout}");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "the {scenario} scenario failed in the browser (screenshots in {}):\n{stdout}",
        screenshots().display()
    );
    assert!(stdout.contains(&format!("PASS {scenario}")), "{stdout}");
    stdout
}

#[test]
fn web_page_streams_an_answer_opens_a_citation_uploads_and_deletes_in_chromium() {
    // room for an answer of a few sentences, so it streams in more than one delta
    let (_dir, base) = own_server(|c| c.generation.max_tokens = 96);
    let out = e2e(&base, "answer", &[]);
    for line in [
        "ok: the citation opens its passage with a quote",
        "ok: the passage names its document and source",
        "ok: web-e2e-lighthouse.md is listed",
        "ok: web-e2e-lighthouse.md is gone from the list",
        "ok: no page errors, console errors or outside requests",
    ] {
        assert!(out.contains(line), "missing {line:?}:\n{out}");
    }
    assert!(screenshots().join("web-page.png").is_file());
}

#[test]
fn web_page_asks_for_the_api_key_when_the_server_requires_one() {
    let (_dir, base) = own_server(|c| {
        c.auth.keys.push(ApiKey {
            name: "web".into(),
            scope: Scope::Write,
            hash: hash_key(KEY),
        });
    });
    // the page and its assets are public; the API it calls is not
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = client();
        for path in ["/", "/assets/app.js", "/assets/app.css", "/assets/icon.svg"] {
            let r = c.get(format!("{base}{path}")).send().await.unwrap();
            assert_eq!(r.status(), 200, "{path}");
            let csp = r.headers()["content-security-policy"].to_str().unwrap();
            assert!(csp.starts_with("default-src 'none'"), "{path}: {csp}");
            let etag = r.headers()["etag"].to_str().unwrap().to_string();
            let again = c
                .get(format!("{base}{path}"))
                .header("if-none-match", &etag)
                .send()
                .await
                .unwrap();
            assert_eq!(again.status(), 304, "{path}");
        }
        let head = c.head(format!("{base}/")).send().await.unwrap();
        assert_eq!(head.status(), 200);
        let missing = c
            .get(format!("{base}/assets/nope.js"))
            .send()
            .await
            .unwrap();
        assert_eq!(missing.status(), 404);
        let body: serde_json::Value = missing.json().await.unwrap();
        assert_eq!(body["error"]["code"], "not_found");
        let api = c.get(format!("{base}/v1/documents")).send().await.unwrap();
        assert_eq!(api.status(), 401);
    });
    e2e(&base, "keys", &["--key", KEY]);
}
