//! The text, Markdown and HTML loaders (encoding detection, declared charsets, HTML to
//! Markdown) on arbitrary bytes; the first byte picks the format.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let Some((&which, bytes)) = input.split_first() else {
        return;
    };
    let name = match which % 3 {
        0 => "fuzz.txt",
        1 => "fuzz.md",
        _ => "fuzz.html",
    };
    if let Ok(doc) = docent_ingest::load::load_bytes(Path::new(name), name, bytes) {
        docent_fuzz::check_document(&doc);
    }
});
