//! Access to the real public data for tests, through `LLMRS_DATA_DIR` (which `.ci/run` and the
//! README's test command set). Tests that need it fail with a clear message when it is unset.

use std::path::PathBuf;

pub fn data_dir() -> PathBuf {
    match std::env::var_os(crate::prepare::DATA_DIR_ENV) {
        Some(d) => PathBuf::from(d),
        None => panic!(
            "this test reads the public data set: set LLMRS_DATA_DIR to a directory with tinyshakespeare/input.txt \
             (e.g. LLMRS_DATA_DIR=../shared/data cargo test --release)"
        ),
    }
}

pub fn tinyshakespeare_text() -> String {
    let p = data_dir().join("tinyshakespeare/input.txt");
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("cannot read {}: {e}", p.display()))
}
