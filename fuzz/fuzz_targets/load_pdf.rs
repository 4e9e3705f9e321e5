//! The PDF loader on arbitrary bytes: never a panic or a hang, and an accepted document
//! satisfies the loader's invariants (see docent_fuzz::check_document).
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

fuzz_target!(
    init: {
        // pdf-extract panics on some malformed files by design, and docent's loader catches
        // those panics (a `Corrupt` error). libfuzzer-sys's hook aborts on every panic, even
        // a caught one; put back one that only reports panics from elsewhere. A panic that
        // escapes the loader still aborts (libfuzzer-sys catches it at the top).
        std::panic::set_hook(Box::new(|info| {
            let file = info.location().map(|l| l.file()).unwrap_or("");
            if !(file.contains("pdf-extract") || file.contains("lopdf")) {
                eprintln!("{info}");
            }
        }));
    },
    |bytes: &[u8]| {
    let name = Path::new("fuzz.pdf");
    if let Ok(doc) = docent_ingest::load::load_bytes(name, "/fuzz.pdf", bytes) {
        docent_fuzz::check_document(&doc);
    }
}
);
