//! Fetch a public file over HTTP(S) into a local path, verified by SHA-256, written atomically.

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

/// A public file we know the exact contents of.
pub struct Remote {
    pub url: &'static str,
    pub sha256: &'static str,
}

/// Tiny Shakespeare, from karpathy/char-rnn (the file llm.c's tinyshakespeare.py downloads).
pub const TINY_SHAKESPEARE: Remote = Remote {
    url: "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
    sha256: "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
};

/// How long a connection may take to open, and a response or any read of its body may stall,
/// before a download fails (with a message saying to run again) instead of hanging.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
pub const STALL_TIMEOUT: Duration = Duration::from_secs(60);

#[cfg(test)]
thread_local! {
    /// Tests shorten the stall timeout on their own thread.
    pub(crate) static STALL_OVERRIDE: std::cell::Cell<Option<Duration>> = const { std::cell::Cell::new(None) };
}

/// How long a response or a read of its body may stall ([`STALL_TIMEOUT`]; tests shorten it).
pub fn stall_timeout() -> Duration {
    #[cfg(test)]
    if let Some(d) = STALL_OVERRIDE.with(|o| o.get()) {
        return d;
    }
    STALL_TIMEOUT
}

/// The HTTP client of every download: timeouts on connecting and on stalls (a server that
/// accepts and never answers must not hang llmrs), redirects followed or not.
pub fn agent(follow_redirects: bool) -> ureq::Agent {
    let stall = stall_timeout();
    ureq::Agent::config_builder()
        .max_redirects(if follow_redirects { 10 } else { 0 })
        .http_status_as_error(follow_redirects)
        .timeout_connect(Some(CONNECT_TIMEOUT))
        .timeout_recv_response(Some(stall))
        .timeout_per_read(Some(stall))
        .build()
        .into()
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Download `url` to `dest`, checking `sha256` (hex) when given. Shows a progress bar on a
/// terminal. Nothing is left under `dest` unless the whole file arrived and matched.
pub fn download(url: &str, dest: &Path, sha256: Option<&str>) -> Result<()> {
    eprintln!("downloading {url}");
    let resp = agent(true).get(url).call().with_context(|| {
        format!(
            "cannot download {url}; if this machine is offline, put the file at {} (or set LLMRS_DATA_DIR)",
            dest.display()
        )
    })?;
    let total = resp.body().content_length();
    let mut reader = resp.into_body().into_reader();
    let bar = crate::core::progress::bar(total.unwrap_or(0), "download");
    let mut bytes = Vec::with_capacity(total.unwrap_or(0).min(1 << 30) as usize);
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = reader.read(&mut buf).with_context(|| format!("download of {url} was interrupted"))?;
        if n == 0 {
            break;
        }
        bytes.extend_from_slice(&buf[..n]);
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    if let Some(want) = sha256 {
        let got = sha256_hex(&bytes);
        if got != want {
            bail!("{url}: SHA-256 is {got}, expected {want}: the download is corrupt or the file changed upstream");
        }
    }
    crate::core::files::write_atomic(dest, &[&bytes])?;
    std::io::stderr().flush().ok();
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::BufRead;
    use std::net::TcpListener;

    /// Serve `body` at every path for `requests` requests on a loopback port; returns the base URL.
    pub fn serve(body: Vec<u8>, requests: usize) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming().take(requests) {
                let mut s = stream.unwrap();
                let mut r = std::io::BufReader::new(s.try_clone().unwrap());
                let mut line = String::new();
                let mut path = String::new();
                while r.read_line(&mut line).unwrap() > 0 {
                    if path.is_empty() {
                        path = line.split_whitespace().nth(1).unwrap_or("").to_string();
                    }
                    if line == "\r\n" {
                        break;
                    }
                    line.clear();
                }
                let (status, b): (&str, &[u8]) =
                    if path.contains("missing") { ("404 Not Found", b"") } else { ("200 OK", &body) };
                write!(s, "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", b.len()).unwrap();
                s.write_all(b).unwrap();
            }
        });
        format!("http://{addr}")
    }

    #[test]
    fn downloads_and_verifies_from_a_local_server() {
        let body = b"First Citizen:\nBefore we proceed any further, hear me speak.\n".to_vec();
        let sha = sha256_hex(&body);
        let url = serve(body.clone(), 3);
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("sub/input.txt");
        download(&format!("{url}/input.txt"), &dest, Some(&sha)).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), body);
        // A hash mismatch leaves nothing behind.
        let dest2 = dir.path().join("bad.txt");
        let e = download(&format!("{url}/input.txt"), &dest2, Some(&"0".repeat(64))).unwrap_err();
        assert!(format!("{e:#}").contains("SHA-256"));
        assert!(!dest2.exists());
        let e = download(&format!("{url}/missing.txt"), &dest2, None).unwrap_err();
        assert!(format!("{e:#}").contains("cannot download"));
        assert!(!dest2.exists());
    }
}
