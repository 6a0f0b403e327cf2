//! Where tests find the real public data: `$LLMRS_DATA_DIR` when set (CI points it at a shared
//! copy), else the clone's own `data/`, where the first README command (`llmrs train`) puts
//! `tinyshakespeare/input.txt`. Everything else the tests need ships in `tests/fixtures`.

use std::path::{Path, PathBuf};

/// The data directory: `$LLMRS_DATA_DIR`, else `<repository>/data`.
pub fn data_dir() -> PathBuf {
    crate::core::env::data_dir().unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("data"))
}

/// Tiny Shakespeare's text, with a message saying how to get it when it is missing.
pub fn tinyshakespeare_text() -> String {
    let p = data_dir().join("tinyshakespeare/input.txt");
    std::fs::read_to_string(&p).unwrap_or_else(|e| {
        panic!(
            "cannot read {}: {e}. The tests read Tiny Shakespeare: run `cargo run --release -- prepare \
             tinyshakespeare` (or the README's train command) once, or set LLMRS_DATA_DIR to a directory \
             holding tinyshakespeare/input.txt",
            p.display()
        )
    })
}

/// `data_dir()`, after checking that it holds Tiny Shakespeare (same message as above).
pub fn data_dir_with_tinyshakespeare() -> PathBuf {
    tinyshakespeare_text();
    data_dir()
}

/// Say loudly that a test did not check what it exists for (data or an ISA this host lacks).
/// Written to the process's stderr directly rather than through `eprintln!`, which the test
/// harness captures and hides for tests that pass.
pub fn skipped(test: &str, why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}
