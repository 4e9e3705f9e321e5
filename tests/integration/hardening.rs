//! Safe to expose: API keys and scopes, the one error shape under bad input, limits,
//! request ids, metrics and probes, against the real server on a random port.

use std::io::Write;
use std::sync::OnceLock;

use reqwest::header::{HeaderMap, HeaderValue, AUTHORIZATION, CONTENT_TYPE};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

use crate::helpers::{client, get_json, get_json_as, own_server};
use docent::config::{hash_key, ApiKey, Scope};

const READ_KEY: &str = "read-key-for-the-hardening-tests";
const WRITE_KEY: &str = "write-key-for-the-hardening-tests";
/// The per-type limit set for PDFs on the test server.
const PDF_LIMIT: usize = 4096;
/// The test server's largest upload.
const MAX_UPLOAD: usize = 1 << 20;

fn keys() -> Vec<ApiKey> {
    vec![
        ApiKey {
            name: "reader".into(),
            scope: Scope::Read,
            hash: hash_key(READ_KEY),
        },
        ApiKey {
            name: "writer".into(),
            scope: Scope::Write,
            hash: hash_key(WRITE_KEY),
        },
    ]
}

/// A server with keys over the ownership chapter, generous rates, small upload limits.
fn server() -> &'static str {
    static S: OnceLock<(crate::helpers::OwnServer, String)> = OnceLock::new();
    &S.get_or_init(|| {
        own_server(|c| {
            c.auth.keys = keys();
            c.auth.rate_per_minute = 100_000;
            c.auth.burst = 10_000;
            c.server.max_upload_bytes = MAX_UPLOAD;
            c.server.upload_limits.insert("pdf".into(), PDF_LIMIT);
        })
    })
    .1
}

/// A request body.
enum Body {
    None,
    Json(Value),
    Raw(&'static str, Vec<u8>),
    /// A multipart upload: (field, file name, bytes); file name None for a plain field.
    Multipart(Vec<(&'static str, Option<String>, Vec<u8>)>),
}

struct Case {
    name: &'static str,
    method: Method,
    path: String,
    key: Option<&'static str>,
    body: Body,
    status: u16,
    code: &'static str,
    /// The `details.field` the error must name.
    field: Option<&'static str>,
}

fn case(
    name: &'static str,
    method: Method,
    path: &str,
    body: Body,
    status: u16,
    code: &'static str,
) -> Case {
    Case {
        name,
        method,
        path: path.into(),
        key: Some(READ_KEY),
        body,
        status,
        code,
        field: None,
    }
}

impl Case {
    fn key(mut self, key: Option<&'static str>) -> Case {
        self.key = key;
        self
    }
    fn field(mut self, field: &'static str) -> Case {
        self.field = Some(field);
        self
    }
}

fn query(body: Value) -> Body {
    Body::Json(body)
}

fn raw_json(text: &str) -> Body {
    Body::Raw("application/json", text.as_bytes().to_vec())
}

fn file(name: &str, bytes: Vec<u8>) -> Body {
    Body::Multipart(vec![("file", Some(name.to_string()), bytes)])
}

/// A DOCX whose document part inflates to 100 MB of spaces (compressed ~100 KB).
fn zip_bomb() -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    {
        let mut z = zip::ZipWriter::new(&mut out);
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated)
            .large_file(true);
        z.start_file("[Content_Types].xml", opts).unwrap();
        z.write_all(br#"<?xml version="1.0"?><Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types"/>"#).unwrap();
        z.start_file("word/document.xml", opts).unwrap();
        z.write_all(b"<?xml version=\"1.0\"?><w:document xmlns:w=\"http://schemas.openxmlformats.org/wordprocessingml/2006/main\"><w:body><w:p><w:r><w:t>").unwrap();
        let block = vec![b' '; 1 << 20];
        for _ in 0..100 {
            z.write_all(&block).unwrap();
        }
        z.write_all(b"</w:t></w:r></w:p></w:body></w:document>")
            .unwrap();
        z.finish().unwrap();
    }
    out.into_inner()
}

/// A PDF whose page tree contains itself and whose objects reference each other in a ring,
/// with a correct cross-reference table (so the parser walks the graph).
pub fn recursive_pdf() -> Vec<u8> {
    let objects = [
        "<< /Type /Catalog /Pages 2 0 R >>",
        "<< /Type /Pages /Kids [2 0 R 3 0 R] /Count 2 /Parent 2 0 R >>",
        "<< /Type /Page /Parent 2 0 R /Contents 4 0 R /Resources 5 0 R /MediaBox [0 0 612 792] >>",
        "<< /Length 44 >>\nstream\nBT /F1 12 Tf 72 712 Td (Hello loop) Tj ET\nendstream",
        "<< /Font << /F1 6 0 R >> /Self 5 0 R /XObject 7 0 R >>",
        "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Parent 5 0 R >>",
        "<< /Im1 7 0 R /Next 5 0 R >>",
    ];
    let mut pdf = b"%PDF-1.4\n".to_vec();
    let mut offsets = vec![];
    for (i, o) in objects.iter().enumerate() {
        offsets.push(pdf.len());
        pdf.extend_from_slice(format!("{} 0 obj\n{o}\nendobj\n", i + 1).as_bytes());
    }
    let xref = pdf.len();
    pdf.extend_from_slice(
        format!("xref\n0 {}\n0000000000 65535 f \n", objects.len() + 1).as_bytes(),
    );
    for off in offsets {
        pdf.extend_from_slice(format!("{off:010} 00000 n \n").as_bytes());
    }
    pdf.extend_from_slice(
        format!(
            "trailer\n<< /Size {} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n",
            objects.len() + 1
        )
        .as_bytes(),
    );
    pdf
}

fn cases() -> Vec<Case> {
    use Method as M;
    let q = "/v1/query";
    let s = "/v1/search";
    let d = "/v1/documents";
    let ok_q = |extra: Value| {
        let mut b = json!({"question": "What is ownership?", "mode": "extractive"});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        query(b)
    };
    vec![
        // malformed and truncated JSON
        case("malformed json", M::POST, q, raw_json("{\"question\": "), 400, "invalid_json"),
        case("truncated json", M::POST, q, raw_json("{\"question\": \"what is own"), 400, "invalid_json"),
        case("not json", M::POST, q, raw_json("hello"), 400, "invalid_json"),
        case("empty body", M::POST, q, raw_json(""), 400, "invalid_json"),
        case("trailing garbage", M::POST, q, raw_json("{\"question\": \"x\"} }"), 400, "invalid_json"),
        case("NaN literal", M::POST, q, raw_json("{\"question\": \"x\", \"generation\": {\"temperature\": NaN}}"), 400, "invalid_json"),
        case("invalid utf-8", M::POST, q, Body::Raw("application/json", b"{\"question\": \"caf\xff\xfe\"}".to_vec()), 400, "invalid_json"),
        case("deeply nested arrays", M::POST, q, raw_json(&format!("{{\"question\": {}{}}}", "[".repeat(5000), "]".repeat(5000))), 422, "invalid_request"),
        case("deeply nested, unterminated", M::POST, q, raw_json(&"[".repeat(60_000)), 422, "invalid_request"),
        // wrong types and shapes
        case("array body", M::POST, q, raw_json("[]"), 422, "invalid_request"),
        case("null body", M::POST, q, raw_json("null"), 422, "invalid_request"),
        case("question is a number", M::POST, q, query(json!({"question": 5})), 422, "invalid_request"),
        case("no question", M::POST, q, query(json!({})), 422, "invalid_request"),
        case("unknown field", M::POST, q, query(json!({"question": "x", "bogus": 1})), 422, "invalid_request"),
        case("top_k is a string", M::POST, q, query(json!({"question": "x", "retrieval": {"top_k": "3"}})), 422, "invalid_request"),
        case("temperature is a word", M::POST, q, query(json!({"question": "x", "generation": {"temperature": "hot"}})), 422, "invalid_request"),
        case("history is a string", M::POST, q, query(json!({"question": "x", "history": "hi"})), 422, "invalid_request"),
        case("mode unknown", M::POST, q, query(json!({"question": "x", "mode": "poetry"})), 422, "invalid_request"),
        case("mode refusal", M::POST, q, query(json!({"question": "x", "mode": "refusal"})), 422, "invalid_request").field("mode"),
        // huge and negative numbers
        case("top_k negative", M::POST, q, query(json!({"question": "x", "retrieval": {"top_k": -1}})), 422, "invalid_request"),
        case("top_k huge", M::POST, q, raw_json("{\"question\": \"x\", \"retrieval\": {\"top_k\": 100000000000000000000000}}"), 422, "invalid_request"),
        case("top_k zero", M::POST, q, query(json!({"question": "x", "retrieval": {"top_k": 0}})), 422, "invalid_request").field("retrieval.top_k"),
        case("top_k over the limit", M::POST, q, query(json!({"question": "x", "retrieval": {"top_k": 100000}})), 422, "invalid_request").field("retrieval.top_k"),
        case("max_tokens zero", M::POST, q, query(json!({"question": "x", "generation": {"max_tokens": 0}})), 422, "invalid_request").field("generation.max_tokens"),
        case("max_tokens huge", M::POST, q, query(json!({"question": "x", "generation": {"max_tokens": 1_000_000_000u64}})), 422, "invalid_request").field("generation.max_tokens"),
        case("max_tokens negative", M::POST, q, query(json!({"question": "x", "generation": {"max_tokens": -5}})), 422, "invalid_request"),
        case("temperature negative", M::POST, q, query(json!({"question": "x", "generation": {"temperature": -1.0}})), 422, "invalid_request").field("generation.temperature"),
        case("temperature huge", M::POST, q, query(json!({"question": "x", "generation": {"temperature": 1e300}})), 422, "invalid_request").field("generation.temperature"),
        case("repetition penalty 9", M::POST, q, query(json!({"question": "x", "generation": {"repetition_penalty": 9}})), 422, "invalid_request").field("generation.repetition_penalty"),
        case("dry multiplier negative", M::POST, q, query(json!({"question": "x", "generation": {"dry_multiplier": -1}})), 422, "invalid_request").field("generation.dry_multiplier"),
        case("top_p zero", M::POST, q, query(json!({"question": "x", "generation": {"top_p": 0}})), 422, "invalid_request").field("generation.top_p"),
        case("min_score 5", M::POST, q, query(json!({"question": "x", "retrieval": {"min_score": 5}})), 422, "invalid_request").field("retrieval.min_score"),
        case("neighbors 99", M::POST, q, query(json!({"question": "x", "retrieval": {"neighbors": 99}})), 422, "invalid_request").field("retrieval.neighbors"),
        case("too many stops", M::POST, q, query(json!({"question": "x", "generation": {"stop": ["a","b","c","d","e","f","g","h","i"]}})), 422, "invalid_request").field("generation.stop"),
        case("empty stop", M::POST, q, query(json!({"question": "x", "generation": {"stop": [""]}})), 422, "invalid_request").field("generation.stop"),
        case("seed", M::POST, q, query(json!({"question": "x", "generation": {"seed": 1}})), 422, "invalid_request").field("generation.seed"),
        case("a draft model the server lacks", M::POST, q, query(json!({"question": "x", "generation": {"draft_model": true}})), 422, "invalid_request").field("generation.draft_model"),
        // empty, huge and odd questions
        case("empty question", M::POST, q, query(json!({"question": ""})), 422, "invalid_request").field("question"),
        case("blank question", M::POST, q, query(json!({"question": " \n\t "})), 422, "invalid_request").field("question"),
        case("1 MB question", M::POST, q, query(json!({"question": "a".repeat(1 << 20)})), 413, "payload_too_large"),
        case("question over the length limit", M::POST, q, query(json!({"question": "why ".repeat(1000)})), 422, "invalid_request").field("question"),
        case("NUL in the question", M::POST, q, query(json!({"question": "what\u{0}is ownership"})), 422, "invalid_request").field("question"),
        case("escape characters in the question", M::POST, q, query(json!({"question": "what\u{1b}[2J is ownership"})), 422, "invalid_request").field("question"),
        // path traversal in collection names
        case("collection ../x", M::POST, q, query(json!({"question": "x", "retrieval": {"filter": {"collection": "../x"}}})), 422, "invalid_request").field("retrieval.filter.collection"),
        case("collection /etc", M::POST, s, query(json!({"question": "x", "retrieval": {"filter": {"collection": "/etc"}}})), 422, "invalid_request").field("retrieval.filter.collection"),
        case("collection empty", M::POST, s, query(json!({"question": "x", "retrieval": {"filter": {"collection": ""}}})), 422, "invalid_request").field("retrieval.filter.collection"),
        case("1000 tags", M::POST, s, query(json!({"question": "x", "retrieval": {"filter": {"tags": vec!["t"; 1000]}}})), 422, "invalid_request").field("retrieval.filter.tags"),
        case("list collection ../x", M::GET, &format!("{d}?collection=..%2Fx"), Body::None, 422, "invalid_request").field("collection"),
        // wrong content types
        case("text/plain body", M::POST, q, Body::Raw("text/plain", b"{\"question\": \"x\"}".to_vec()), 415, "unsupported_media_type"),
        case("xml body", M::POST, q, Body::Raw("application/xml", b"<question>x</question>".to_vec()), 415, "unsupported_media_type"),
        case("no content type", M::POST, s, Body::Raw("", b"{\"question\": \"x\"}".to_vec()), 415, "unsupported_media_type"),
        case("json to the upload route", M::POST, d, query(json!({"file": "x"})), 415, "unsupported_media_type").key(Some(WRITE_KEY)),
        // search
        case("search malformed", M::POST, s, raw_json("{"), 400, "invalid_json"),
        case("search top_k zero", M::POST, s, query(json!({"question": "x", "retrieval": {"top_k": 0}})), 422, "invalid_request").field("retrieval.top_k"),
        // unknown routes and methods
        case("unknown route", M::GET, "/nope", Body::None, 404, "not_found"),
        case("encoded traversal route", M::GET, "/v1/%2e%2e/%2e%2e/etc/passwd", Body::None, 404, "not_found"),
        case("GET on query", M::GET, q, Body::None, 405, "method_not_allowed"),
        case("PUT on documents", M::PUT, d, Body::None, 405, "method_not_allowed"),
        case("PATCH on a document", M::PATCH, &format!("{d}/abc"), Body::None, 405, "method_not_allowed"),
        case("unknown document", M::GET, &format!("{d}/0000000000000000"), Body::None, 404, "not_found"),
        case("delete unknown document", M::DELETE, &format!("{d}/0000000000000000"), Body::None, 404, "not_found").key(Some(WRITE_KEY)),
        case("unknown job", M::GET, "/v1/jobs/nope", Body::None, 404, "not_found"),
        // list parameters
        case("list limit zero", M::GET, &format!("{d}?limit=0"), Body::None, 422, "invalid_request").field("limit"),
        case("list limit word", M::GET, &format!("{d}?limit=abc"), Body::None, 422, "invalid_request"),
        case("list unknown parameter", M::GET, &format!("{d}?bogus=1"), Body::None, 422, "invalid_request"),
        case("list bad status", M::GET, &format!("{d}?status=weird"), Body::None, 422, "invalid_request").field("status"),
        // uploads
        case("upload with no file", M::POST, d, Body::Multipart(vec![("metadata", None, b"{}".to_vec())]), 422, "invalid_request").key(Some(WRITE_KEY)).field("file"),
        case("upload named ..", M::POST, d, file("..", b"text".to_vec()), 422, "invalid_request").key(Some(WRITE_KEY)).field("file"),
        case("upload with a control character in the name", M::POST, d, file("a\u{7}b.md", b"text".to_vec()), 400, "invalid_multipart").key(Some(WRITE_KEY)),
        case("upload with NUL in the name", M::POST, d, Body::Raw("multipart/form-data; boundary=xyz", b"--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\x00b.md\"\r\n\r\ntext\r\n--xyz--\r\n".to_vec()), 400, "invalid_multipart").key(Some(WRITE_KEY)),
        case("upload with only an extended file name", M::POST, d, Body::Raw("multipart/form-data; boundary=xyz", b"--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename*=UTF-8''a%00b.md\r\n\r\ntext\r\n--xyz--\r\n".to_vec()), 422, "invalid_request").key(Some(WRITE_KEY)).field("file"),
        case("upload of an .exe", M::POST, d, file("setup.exe", b"MZ".to_vec()), 415, "unsupported_media_type").key(Some(WRITE_KEY)),
        case("upload over the pdf limit", M::POST, d, file("big.pdf", vec![b'%'; PDF_LIMIT + 1]), 413, "payload_too_large").key(Some(WRITE_KEY)),
        case("upload over the size limit", M::POST, d, file("big.txt", vec![b'a'; MAX_UPLOAD + 1]), 413, "payload_too_large").key(Some(WRITE_KEY)),
        case("zip bomb as docx", M::POST, d, file("bomb.docx", zip_bomb()), 413, "payload_too_large").key(Some(WRITE_KEY)),
        case("recursive pdf", M::POST, d, file("loop.pdf", recursive_pdf()), 422, "unreadable_document").key(Some(WRITE_KEY)),
        case("garbage pdf", M::POST, d, file("junk.pdf", b"%PDF-1.7\n\x00\x01garbage".to_vec()), 422, "unreadable_document").key(Some(WRITE_KEY)),
        case("docx that is no zip", M::POST, d, file("junk.docx", b"PK\x03\x04 not really".to_vec()), 422, "unreadable_document").key(Some(WRITE_KEY)),
        case("binary as txt", M::POST, d, file("bin.txt", vec![0u8; 4096]), 422, "unreadable_document").key(Some(WRITE_KEY)),
        case("empty file", M::POST, d, file("empty.md", vec![]), 422, "unreadable_document").key(Some(WRITE_KEY)),
        case("metadata not json", M::POST, d, Body::Multipart(vec![("file", Some("a.md".into()), b"# A\ntext".to_vec()), ("metadata", None, b"{nope".to_vec())]), 422, "invalid_request").key(Some(WRITE_KEY)).field("metadata"),
        case("metadata collection ../x", M::POST, d, Body::Multipart(vec![("metadata", None, br#"{"collection": "../x"}"#.to_vec()), ("file", Some("a.md".into()), b"# A\ntext".to_vec())]), 422, "invalid_request").key(Some(WRITE_KEY)).field("metadata.collection"),
        case("metadata unknown field", M::POST, d, Body::Multipart(vec![("metadata", None, br#"{"owner": "me"}"#.to_vec())]), 422, "invalid_request").key(Some(WRITE_KEY)).field("metadata"),
        case("unknown multipart field", M::POST, d, Body::Multipart(vec![("attachment", Some("a.md".into()), b"x".to_vec())]), 422, "invalid_request").key(Some(WRITE_KEY)),
        case("broken multipart", M::POST, d, Body::Raw("multipart/form-data; boundary=xyz", b"--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.md\"\r\n\r\nunterminated".to_vec()), 400, "invalid_multipart").key(Some(WRITE_KEY)),
        // access
        case("no key", M::POST, q, ok_q(json!({})), 401, "unauthorized").key(None),
        case("wrong key", M::POST, q, ok_q(json!({})), 401, "unauthorized").key(Some("not-a-key-of-this-server")),
        case("read key uploads", M::POST, d, file("a.md", b"# A\ntext".to_vec()), 403, "forbidden"),
        case("read key deletes", M::DELETE, &format!("{d}/0000000000000000"), Body::None, 403, "forbidden"),
        case("metrics without a key", M::GET, "/metrics", Body::None, 401, "unauthorized").key(None),
        case("basic auth instead of bearer", M::POST, q, ok_q(json!({})), 401, "unauthorized").key(Some(BASIC)),
    ]
}

/// Sent as `Authorization: Basic …` instead of a bearer key.
const BASIC: &str = "basic";

async fn send(c: &reqwest::Client, base: &str, case: &Case) -> reqwest::Response {
    let mut headers = HeaderMap::new();
    match case.key {
        Some(BASIC) => {
            headers.insert(
                AUTHORIZATION,
                HeaderValue::from_static("Basic d3JpdGVyOnNlY3JldA=="),
            );
        }
        Some(k) => {
            headers.insert(
                AUTHORIZATION,
                HeaderValue::from_str(&format!("Bearer {k}")).unwrap(),
            );
        }
        None => {}
    }
    let url = format!("{base}{}", case.path);
    let mut rb = c.request(case.method.clone(), url).headers(headers);
    rb = match &case.body {
        Body::None => rb,
        Body::Json(v) => rb.json(v),
        Body::Raw(ct, bytes) => {
            let rb = rb.body(bytes.clone());
            if ct.is_empty() {
                rb
            } else {
                rb.header(CONTENT_TYPE, *ct)
            }
        }
        Body::Multipart(fields) => {
            let mut form = reqwest::multipart::Form::new();
            for (name, file_name, bytes) in fields {
                let mut part = reqwest::multipart::Part::bytes(bytes.clone());
                if let Some(f) = file_name {
                    part = part.file_name(f.clone());
                }
                form = form.part(*name, part);
            }
            rb.multipart(form)
        }
    };
    rb.send().await.unwrap()
}

async fn get_status(c: &reqwest::Client, url: &str) -> u16 {
    c.get(url).send().await.unwrap().status().as_u16()
}

/// The server answers a normal question (the extractive path: retrieval, support, citations).
async fn still_answers(c: &reqwest::Client, base: &str, after: &str) {
    let res = c
        .post(format!("{base}/v1/query"))
        .bearer_auth(READ_KEY)
        .json(&json!({"question": "What is ownership in Rust?", "mode": "extractive"}))
        .send()
        .await
        .unwrap_or_else(|e| panic!("after {after:?}: the server does not answer: {e}"));
    assert_eq!(res.status(), 200, "after {after:?}");
    let body: Value = res.json().await.unwrap();
    assert!(
        !body["citations"].as_array().unwrap().is_empty(),
        "after {after:?}: {body}"
    );
}

#[tokio::test]
async fn bad_input_gets_the_right_status_and_error_and_loses_nothing() {
    let base = server();
    let c = client();
    let documents = format!("{base}/v1/documents");
    let before = get_json_as(&c, &documents, READ_KEY).await;
    assert_eq!(before["documents"].as_array().unwrap().len(), 1, "{before}");
    let cases = cases();
    assert!(cases.len() >= 60, "{} cases", cases.len());
    let mut failures = vec![];
    for case in &cases {
        let res = send(&c, base, case).await;
        let status = res.status();
        let content_type = res
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let has_id = res.headers().contains_key("x-request-id");
        let text = res.text().await.unwrap();
        let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let err = &body["error"];
        let field_ok = case
            .field
            .is_none_or(|f| err["details"]["field"].as_str() == Some(f));
        let shape_ok = err["code"].is_string()
            && err["message"].as_str().is_some_and(|m| !m.is_empty())
            && err.as_object().is_some_and(|o| o.contains_key("details"))
            && content_type.starts_with("application/json");
        if status.as_u16() != case.status
            || err["code"] != case.code
            || !field_ok
            || !shape_ok
            || !has_id
        {
            failures.push(format!(
                "{}: expected {} {}{}, got {status} {text:.300}",
                case.name,
                case.status,
                case.code,
                case.field
                    .map(|f| format!(" (field {f})"))
                    .unwrap_or_default(),
            ));
        }
        still_answers(&c, base, case.name).await;
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    // nothing was lost, and nothing half-written appeared
    let after = get_json_as(&c, &documents, READ_KEY).await;
    assert_eq!(before["documents"], after["documents"], "{after}");
}

#[tokio::test]
async fn request_ids_are_returned_and_kept_when_usable() {
    let base = server();
    let c = client();
    let res = c
        .get(format!("{base}/healthz"))
        .header("x-request-id", "client-id-42")
        .send()
        .await
        .unwrap();
    assert_eq!(res.headers()["x-request-id"], "client-id-42");
    let res = c
        .get(format!("{base}/healthz"))
        .header("x-request-id", "bad id with spaces")
        .send()
        .await
        .unwrap();
    let id = res.headers()["x-request-id"].to_str().unwrap().to_string();
    assert_ne!(id, "bad id with spaces");
    assert!(uuid::Uuid::parse_str(&id).is_ok(), "{id}");
}

#[tokio::test]
async fn probes_are_public_and_metrics_count_requests_and_stages() {
    let base = server();
    let c = client();
    let live = c.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(live.status(), 200);
    let ready = get_json(&c, &format!("{base}/readyz")).await;
    assert_eq!(ready["status"], "ready", "{ready}");
    assert!(ready["chunks"].as_u64().unwrap() > 0, "{ready}");
    // one generated answer, then the metrics
    let res = c
        .post(format!("{base}/v1/query"))
        .bearer_auth(READ_KEY)
        .json(&json!({"question": "What is ownership in Rust?", "generation": {"max_tokens": 24}}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let res = c
        .get(format!("{base}/metrics"))
        .bearer_auth(READ_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert!(res.headers()[CONTENT_TYPE]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    let text = res.text().await.unwrap();
    let value = |prefix: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
    };
    assert!(
        value("docent_http_requests_total{method=\"POST\",route=\"/v1/query\",status=\"200\"}")
            >= 1.0
    );
    for stage in docent::metrics::STAGES {
        assert!(
            value(&format!(
                "docent_stage_duration_seconds_count{{stage=\"{stage}\"}}"
            )) >= 1.0,
            "stage {stage} not recorded"
        );
    }
    assert!(value("docent_generation_tokens_per_second_count") >= 1.0);
    assert!(value("docent_generated_tokens_total") >= 1.0);
    for family in [
        "docent_http_request_duration_seconds_bucket",
        "docent_generation_queue_depth",
        "docent_ingest_jobs_total",
        "docent_ingest_chunks_total",
        "docent_safety_decisions_total",
        "docent_answer_cache_total",
        "docent_http_in_flight",
    ] {
        assert!(text.contains(family), "{family} missing");
    }
}

#[tokio::test]
async fn rate_limits_answer_429_with_retry_after_per_key() {
    let (_dir, base) = own_server(|c| {
        c.auth.keys = keys();
        c.auth.rate_per_minute = 6;
        c.auth.burst = 3;
    });
    let c = client();
    let search = |key: &'static str| {
        c.post(format!("{base}/v1/search"))
            .bearer_auth(key)
            .json(&json!({"question": "ownership"}))
            .send()
    };
    for _ in 0..3 {
        assert_eq!(search(READ_KEY).await.unwrap().status(), 200);
    }
    let res = search(READ_KEY).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry: u64 = res.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=10).contains(&retry), "Retry-After {retry}");
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limited");
    // the other key has its own allowance; probes are never limited
    assert_eq!(search(WRITE_KEY).await.unwrap().status(), 200);
    assert_eq!(get_status(&c, &format!("{base}/healthz")).await, 200);
}

#[tokio::test]
async fn concurrency_limit_answers_503_with_retry_after() {
    let (_dir, base) = own_server(|c| {
        c.server.max_in_flight = 1;
    });
    let c = client();
    let active = || async {
        get_json(&c, &format!("{base}/readyz")).await["generation"]["active"]
            .as_u64()
            .unwrap()
    };
    // a generated answer holds the only slot while it runs; once the engine reports it
    // generating, any other API request is refused
    let slow = {
        let c = c.clone();
        let base = base.clone();
        tokio::spawn(async move {
            let res = c
                .post(format!("{base}/v1/query"))
                .json(&json!({"question": "What is ownership in Rust?", "generation": {"max_tokens": 64}}))
                .send()
                .await
                .unwrap();
            (res.status(), res.text().await.unwrap())
        })
    };
    let mut generating = false;
    for _ in 0..500 {
        if active().await > 0 {
            generating = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(
        generating,
        "the answer never started: {:?}",
        slow.await.unwrap()
    );
    let res = c
        .post(format!("{base}/v1/search"))
        .json(&json!({"question": "ownership"}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "1");
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["error"]["code"], "overloaded");
    // the probes stay open whatever the load
    assert_eq!(get_status(&c, &format!("{base}/healthz")).await, 200);
    let (status, body) = slow.await.unwrap();
    assert_eq!(status, 200, "{body}");
    // and once the answer is done the slot is free again
    let res = c
        .post(format!("{base}/v1/search"))
        .json(&json!({"question": "ownership"}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
}

#[tokio::test]
async fn cors_is_off_by_default_and_answers_configured_origins() {
    let c = client();
    let preflight = |base: String| {
        c.request(Method::OPTIONS, format!("{base}/v1/query"))
            .header("origin", "https://app.example")
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization, content-type",
            )
            .send()
    };
    let res = preflight(server().to_string()).await.unwrap();
    assert!(
        !res.headers().contains_key("access-control-allow-origin"),
        "CORS answered while off: {:?}",
        res.headers()
    );
    let (_dir, base) = own_server(|c| c.server.cors_origins = vec!["https://app.example".into()]);
    let res = preflight(base.clone()).await.unwrap();
    assert!(res.status().is_success(), "{}", res.status());
    assert_eq!(
        res.headers()["access-control-allow-origin"],
        "https://app.example"
    );
    let res = c
        .request(Method::OPTIONS, format!("{base}/v1/query"))
        .header("origin", "https://evil.example")
        .header("access-control-request-method", "POST")
        .send()
        .await
        .unwrap();
    assert!(!res.headers().contains_key("access-control-allow-origin"));
}

#[test]
fn sigterm_finishes_in_flight_answers_flushes_and_exits_0_and_keys_stay_out_of_the_logs() {
    use crate::helpers::{docent_cmd, listening_port, run_ok, rust_book, OWNERSHIP};
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("index");
    run_ok(docent_cmd(&data).arg("ingest").arg(rust_book(OWNERSHIP)));
    let wrong = "wrong-key-that-must-not-be-logged-0123";
    let stderr_path = dir.path().join("stderr.log");
    let mut child = docent_cmd(&data)
        .env("DOCENT_API_KEYS", format!("{WRITE_KEY}:write"))
        .env("DOCENT_SERVER__LOG_FORMAT", "json")
        .env("DOCENT_SERVER__SHUTDOWN_TIMEOUT_S", "60")
        .args(["serve", "--bind", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    let port = listening_port(child.stdout.take().unwrap());
    let base = format!("http://127.0.0.1:{port}");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = client();
        let res = c.post(format!("{base}/v1/search")).bearer_auth(wrong).json(&json!({"question": "ownership"})).send().await.unwrap();
        assert_eq!(res.status(), 401);
        let res = c
            .post(format!("{base}/v1/search"))
            .bearer_auth(WRITE_KEY)
            .header("x-request-id", "shutdown-test-1")
            .json(&json!({"question": "ownership"}))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        // a streamed answer in flight when SIGTERM arrives
        let mut res = c
            .post(format!("{base}/v1/query"))
            .bearer_auth(WRITE_KEY)
            .json(&json!({"question": "What is ownership in Rust?", "stream": true, "generation": {"max_tokens": 64}}))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        let first = res.chunk().await.unwrap().expect("a first event");
        let killed = std::process::Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(killed.success());
        let mut body = String::from_utf8_lossy(&first).into_owned();
        while let Some(chunk) = res.chunk().await.unwrap() {
            body.push_str(&String::from_utf8_lossy(&chunk));
        }
        assert!(body.contains("event: done"), "the answer in flight was cut: {body}");
        // no new connections once it stops accepting
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let late = c.get(format!("{base}/healthz")).send().await;
        assert!(late.is_err(), "a request after SIGTERM was served: {late:?}");
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "docent did not exit after SIGTERM"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let log = std::fs::read_to_string(&stderr_path).unwrap();
    assert!(status.success(), "exit {status:?}\n{log}");
    assert!(
        log.contains("SIGTERM") && log.contains("the store is flushed"),
        "{log}"
    );
    assert!(
        !log.contains(WRITE_KEY) && !log.contains(wrong),
        "a key reached the logs:\n{log}"
    );
    // JSON lines, the request id in the request's span
    let tagged: Vec<Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["span"]["id"] == "shutdown-test-1")
        .collect();
    assert!(
        tagged.iter().any(|v| v["fields"]["status"] == 200),
        "no JSON log line of request shutdown-test-1 with its status:\n{log}"
    );
}

#[test]
fn refuses_a_public_address_without_keys() {
    use crate::helpers::docent_cmd;
    let dir = tempfile::tempdir().unwrap();
    let out = docent_cmd(&dir.path().join("index"))
        .args(["serve", "--bind", "0.0.0.0:0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("refusing to listen on 0.0.0.0") && err.contains("docent keys new"),
        "{err}"
    );
}
