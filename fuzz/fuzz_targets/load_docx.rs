//! The DOCX loader on arbitrary bytes: never a panic or a hang, and an accepted document
//! satisfies the loader's invariants (see docent_fuzz::check_document).
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let name = Path::new("fuzz.docx");
    if let Ok(doc) = docent_ingest::load::load_bytes(name, "/fuzz.docx", bytes) {
        docent_fuzz::check_document(&doc);
    }
});
