//! Progress bars, shown only when stderr is a terminal (logs and CI stay clean).

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;

pub fn bar(len: u64, what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    let style = ProgressStyle::with_template("{prefix:>10} [{bar:40}] {pos}/{len} {msg} ({eta})")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    pb.set_style(style);
    pb.set_prefix(what.to_string());
    pb
}
