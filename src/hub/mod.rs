//! Fetch a model from the Hugging Face Hub into Hugging Face's own cache.
//!
//! Models live where transformers keeps them (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, default
//! `~/.cache/huggingface/hub`): `models--owner--name/refs/REVISION` holds the commit a revision
//! points at and `models--owner--name/snapshots/COMMIT/` the files, so a model transformers
//! already downloaded is read from there without a request, and one llmrs downloads is found by
//! transformers. (llmrs writes the files into the snapshot directly, without transformers'
//! deduplicating `blobs/` links; transformers reads either.) The `hf-hub` crate was not used:
//! its client would replace the timeouts, validation, resume and locking below.
//!
//! Files are requested as the Hub serves them, `{endpoint}/{owner}/{name}/resolve/{revision}/{file}`
//! (the endpoint is `$HF_ENDPOINT`, default https://huggingface.co). A `HEAD` without following
//! redirects gives the expected size (`X-Linked-Size` / `Content-Length`) and, for large files, the
//! SHA-256 (`X-Linked-Etag`). Downloads go to `FILE.part` and resume from where they stopped with
//! an HTTP `Range` request; the file gets its final name only once size and hash check out.

pub mod download;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// The files of a model repository that llmrs needs (or the shards the index lists instead of
/// model.safetensors), then those it uses when they are there.
pub const MODEL_FILES: [&str; 2] = ["config.json", "model.safetensors"];
pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const OPTIONAL_FILES: [&str; 2] = [TOKENIZER_FILE, GENERATION_CONFIG_FILE];
/// The side files a model may have beside its weights, in the Hub's names.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// `owner/name[@revision]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubRef {
    pub repo: String,
    pub revision: String,
}

impl std::str::FromStr for HubRef {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        let (repo, revision) = s.split_once('@').unwrap_or((s, "main"));
        let ok = |x: &str| {
            !x.is_empty() && x.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) && !x.starts_with('.')
        };
        let parts: Vec<&str> = repo.split('/').collect();
        if parts.len() > 2 || !parts.iter().all(|p| ok(p)) || !ok(revision) {
            bail!("'{s}' is not a Hub model name: use owner/name or owner/name@revision (e.g. openai-community/gpt2)");
        }
        Ok(HubRef { repo: repo.to_string(), revision: revision.to_string() })
    }
}

pub fn endpoint() -> String {
    crate::core::env::text(crate::core::env::HF_ENDPOINT)
        .unwrap_or_else(|| "https://huggingface.co".into())
        .trim_end_matches('/')
        .to_string()
}

/// `$LLMRS_CACHE_DIR`, else `$XDG_CACHE_HOME/llmrs` or `~/.cache/llmrs`.
pub fn cache_dir() -> PathBuf {
    crate::core::env::get(crate::core::env::CACHE_DIR)
        .map_or_else(|| crate::core::env::cache_home().join("llmrs"), PathBuf::from)
}

/// Hugging Face's cache of Hub repositories: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
/// `~/.cache/huggingface/hub`.
pub fn hf_cache_dir() -> PathBuf {
    use crate::core::env::{get, HF_HUB_CACHE};
    get(HF_HUB_CACHE).map(PathBuf::from).unwrap_or_else(|| crate::core::env::hf_home().join("hub"))
}

/// The snapshot directory of a model in the cache, when it holds a complete model: the
/// revision's commit from `refs/`, or the revision itself when it is a commit.
fn cached_snapshot(repo_dir: &Path, revision: &str) -> Option<PathBuf> {
    let commit = std::fs::read_to_string(repo_dir.join("refs").join(revision))
        .map(|c| c.trim().to_string())
        .unwrap_or_else(|_| revision.to_string());
    let dir = repo_dir.join("snapshots").join(commit);
    complete(&dir).then_some(dir)
}

/// The snapshot directory of a complete model already in the cache, without a request.
pub fn cached_model(r: &HubRef, cache: &Path) -> Option<PathBuf> {
    cached_snapshot(&cache.join(format!("models--{}", r.repo.replace('/', "--"))), &r.revision)
}

/// Whether a directory holds config.json and every safetensors file of the model, valid.
fn complete(dir: &Path) -> bool {
    let ok = |f: &str| valid_model_file(&dir.join(f)).is_ok();
    ok("config.json")
        && (ok("model.safetensors") || shard_names(&dir.join(INDEX_FILE)).is_ok_and(|s| s.iter().all(|f| ok(f))))
}

/// The shard files a `model.safetensors.index.json` lists.
fn shard_names(index: &Path) -> Result<Vec<String>> {
    let text = crate::core::files::read_file(index)?;
    let v: serde_json::Value = serde_json::from_slice(&text).context("not a safetensors index")?;
    let mut files: Vec<String> = v["weight_map"]
        .as_object()
        .context("the index has no weight_map")?
        .values()
        .filter_map(|f| f.as_str().map(String::from))
        .collect();
    files.sort();
    files.dedup();
    if files.is_empty() || files.iter().any(|f| f.contains('/') || f.contains("..") || !f.ends_with(".safetensors")) {
        bail!("{}: weight_map must name .safetensors files beside it", index.display());
    }
    Ok(files)
}

/// The commit a revision names, from the Hub's `X-Repo-Commit` (the revision itself when the
/// server does not say). A server that cannot be reached, or does not answer within the stall
/// timeout, is an error here, so that a dead endpoint costs one timeout, not one per request.
fn resolve_commit(url: &str, revision: &str) -> Result<String> {
    let resp = with_token(crate::hub::download::agent(false).head(url)).call().with_context(|| {
        format!(
            "cannot reach {url} (no answer within {} s); check the network or set HF_ENDPOINT",
            crate::hub::download::stall_timeout().as_secs()
        )
    })?;
    let commit = resp.headers().get("x-repo-commit").and_then(|v| v.to_str().ok()).map(String::from);
    Ok(commit
        .filter(|c| c.len() == 40 && c.chars().all(|x| x.is_ascii_hexdigit()))
        .unwrap_or_else(|| revision.to_string()))
}

/// A request to the Hub with the user's token ([`crate::core::env::hf_token`]) when there is one, as
/// `huggingface_hub` sends it: gated repositories (meta-llama/*) need it. ureq drops the header
/// when a redirect leaves for another host (the Hub's file CDN).
fn with_token<B>(req: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
    match crate::core::env::hf_token() {
        Some(t) => req.header("Authorization", &format!("Bearer {t}")),
        None => req,
    }
}

/// The model's files from the cache, or downloaded into it: config.json, the weights (one
/// file, or the index and its shards), and tokenizer.json and generation_config.json when the
/// repository has them. Returns the snapshot directory.
pub fn fetch_model(r: &HubRef, endpoint: &str, cache: &Path) -> Result<PathBuf> {
    let repo_dir = cache.join(format!("models--{}", r.repo.replace('/', "--")));
    if let Some(dir) = cached_snapshot(&repo_dir, &r.revision) {
        return Ok(dir);
    }
    let url = |f: &str| format!("{endpoint}/{}/resolve/{}/{f}", r.repo, r.revision);
    let commit = resolve_commit(&url("config.json"), &r.revision)?;
    let dir = repo_dir.join("snapshots").join(&commit);
    let get = |f: &str| -> Result<()> {
        let dest = dir.join(f);
        // A cached file that no longer checks out (damaged, or cut short) is fetched again.
        if dest.is_file() && valid_model_file(&dest).is_err() {
            eprintln!("the cached {} is broken; fetching it again", dest.display());
            std::fs::remove_file(&dest).with_context(|| format!("cannot remove {}", dest.display()))?;
        }
        if !dest.is_file() {
            fetch_file(&url(f), &dest, &valid_model_file)
                .with_context(|| format!("cannot fetch {f} of {}@{}", r.repo, r.revision))?;
        }
        Ok(())
    };
    get("config.json")?;
    if let Err(single) = get("model.safetensors") {
        // Large models come in shards: model.safetensors.index.json lists them.
        if get(INDEX_FILE).is_err() {
            return Err(single);
        }
        for f in shard_names(&dir.join(INDEX_FILE))? {
            get(&f)?;
        }
    }
    for f in OPTIONAL_FILES {
        if !dir.join(f).is_file() && head(&url(f)).is_ok() {
            get(f)?;
        }
    }
    let refs = repo_dir.join("refs");
    std::fs::create_dir_all(&refs).with_context(|| format!("cannot create {}", refs.display()))?;
    crate::core::files::write_atomic(&refs.join(&r.revision), &[commit.as_bytes()])?;
    Ok(dir)
}

/// A model's side files without its weights (tokenizer.json, generation_config.json and
/// config.json, those the repository has), from the cache or downloaded into it: what
/// `--tokenizer hf:owner/name` needs. Returns the snapshot directory (a complete cached model's
/// when there is one).
pub fn fetch_side_files(r: &HubRef, endpoint: &str, cache: &Path) -> Result<PathBuf> {
    let repo_dir = cache.join(format!("models--{}", r.repo.replace('/', "--")));
    if let Some(dir) = cached_snapshot(&repo_dir, &r.revision) {
        return Ok(dir);
    }
    let known = std::fs::read_to_string(repo_dir.join("refs").join(&r.revision)).map(|c| c.trim().to_string());
    let cached = repo_dir.join("snapshots").join(known.as_deref().unwrap_or(&r.revision));
    if cached.join(TOKENIZER_FILE).is_file() {
        return Ok(cached);
    }
    let url = |f: &str| format!("{endpoint}/{}/resolve/{}/{f}", r.repo, r.revision);
    let commit = resolve_commit(&url(TOKENIZER_FILE), &r.revision)?;
    let dir = repo_dir.join("snapshots").join(&commit);
    for f in [TOKENIZER_FILE, GENERATION_CONFIG_FILE, "config.json"] {
        let dest = dir.join(f);
        if !dest.is_file() && head_if_there(&url(f))?.is_some() {
            fetch_file(&url(f), &dest, &json_file)
                .with_context(|| format!("cannot fetch {f} of {}@{}", r.repo, r.revision))?;
        }
    }
    let refs = repo_dir.join("refs");
    std::fs::create_dir_all(&refs).with_context(|| format!("cannot create {}", refs.display()))?;
    crate::core::files::write_atomic(&refs.join(&r.revision), &[commit.as_bytes()])?;
    Ok(dir)
}

/// Accept a file that parses as JSON.
fn json_file(path: &Path) -> Result<()> {
    let text = crate::core::files::read_file(path)?;
    serde_json::from_slice::<serde_json::Value>(&text)
        .with_context(|| format!("{} is not JSON", path.display()))
        .map(|_| ())
}

/// Files of a dataset repository under `dir` (the Hub's tree API), sorted by path.
pub fn list_dataset_files(repo: &str, revision: &str, dir: &str, endpoint: &str) -> Result<Vec<String>> {
    let url = format!("{endpoint}/api/datasets/{repo}/tree/{revision}/{dir}");
    let mut resp =
        with_token(crate::hub::download::agent(true).get(&url)).call().with_context(|| format!("cannot list {url}"))?;
    let v: serde_json::Value =
        serde_json::from_reader(resp.body_mut().as_reader()).with_context(|| format!("{url}: not a file listing"))?;
    let mut files: Vec<String> = v
        .as_array()
        .with_context(|| format!("{url}: not a file listing"))?
        .iter()
        .filter(|e| e["type"] == "file")
        .filter_map(|e| e["path"].as_str().map(str::to_string))
        .collect();
    files.sort();
    Ok(files)
}

/// Download dataset files (paths as listed by [`list_dataset_files`]) into the cache; returns
/// their local paths in the same order. Already complete files are not fetched again.
pub fn fetch_dataset_files(
    repo: &str,
    revision: &str,
    files: &[String],
    endpoint: &str,
    cache: &Path,
) -> Result<Vec<PathBuf>> {
    let base = cache.join("datasets").join(repo.replace('/', "--")).join(revision);
    files
        .iter()
        .map(|f| {
            if f.split('/').any(|c| c == ".." || c.is_empty()) {
                bail!("refusing the listed path '{f}'");
            }
            let dest = base.join(f);
            if !dest.is_file() {
                fetch_file(&format!("{endpoint}/datasets/{repo}/resolve/{revision}/{f}"), &dest, &any_file)?;
            }
            Ok(dest)
        })
        .collect()
}

/// What the Hub says about a file before we download it.
struct Meta {
    size: Option<u64>,
    sha256: Option<String>,
}

fn head(url: &str) -> Result<Meta> {
    head_if_there(url)?.with_context(|| format!("{url}: HTTP 404: no such model or file"))
}

/// [`head`], with None for a file the server says is not there (404); other failures (no
/// answer, no access) are errors.
fn head_if_there(url: &str) -> Result<Option<Meta>> {
    let resp = with_token(crate::hub::download::agent(false).head(url))
        .call()
        .with_context(|| format!("cannot reach {url}; check the network or set HF_ENDPOINT"))?;
    let status = resp.status().as_u16();
    if status == 404 {
        return Ok(None);
    }
    if status == 401 || status == 403 {
        let login = if crate::core::env::hf_token().is_some() {
            "or the token in HF_TOKEN (or $HF_HOME/token) has no access to it"
        } else {
            "or it is gated or private: set HF_TOKEN to a Hugging Face access token that may read it"
        };
        bail!("{url}: HTTP {status}: no such model or file, {login}");
    }
    if status >= 400 {
        bail!("{url}: HTTP {status}");
    }
    let h = |k: &str| {
        resp.headers()
            .get(k)
            .and_then(|v| v.to_str().ok())
            .map(|s| s.trim_matches('"').trim_start_matches("W/").trim_matches('"').to_string())
    };
    let size = h("x-linked-size")
        .or_else(|| if status == 200 { h("content-length") } else { None })
        .and_then(|s| s.parse().ok());
    let etag = h("x-linked-etag").or_else(|| h("etag"));
    let sha256 =
        etag.filter(|e| e.len() == 64 && e.chars().all(|c| c.is_ascii_hexdigit())).map(|e| e.to_ascii_lowercase());
    Ok(Some(Meta { size, sha256 }))
}

/// Download `url` to `dest`, resuming `dest.part` if an earlier attempt stopped. Processes
/// fetching the same file take turns (a lock beside it): the second finds it complete.
/// `valid` checks the whole file before it gets its final name (for files the Hub sends
/// without a hash).
pub fn fetch_file(url: &str, dest: &Path, valid: &dyn Fn(&Path) -> Result<()>) -> Result<()> {
    let dir = dest.parent().context("destination has no directory")?;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let name = dest.file_name().context("destination has no file name")?.to_string_lossy();
    let lock_path = dest.with_file_name(format!(".{name}.lock"));
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .with_context(|| format!("cannot create {}", lock_path.display()))?;
    // SAFETY: flock on a descriptor owned here; it touches no memory.
    if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        eprintln!("waiting for another llmrs process downloading {name}");
        // SAFETY: as above.
        if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) } != 0 {
            bail!("cannot lock {}", lock_path.display());
        }
    }
    if dest.is_file() {
        return Ok(()); // the other process finished it
    }
    let meta = head(url)?;
    let part = dest.with_file_name(format!("{name}.part"));
    let mut offset = std::fs::metadata(&part).map(|m| m.len()).unwrap_or(0);
    if meta.size.is_some_and(|s| offset > s) {
        offset = 0; // a stale partial from another version of the file
    }
    // The agent's timeouts: a body that stops arriving fails after the stall timeout.
    let mut req = with_token(crate::hub::download::agent(true).get(url));
    if offset > 0 {
        req = req.header("Range", &format!("bytes={offset}-"));
    }
    let resp = req.call().with_context(|| format!("cannot download {url}"))?;
    if resp.status().as_u16() != 206 {
        offset = 0; // the server sent the whole file
    }
    let total = meta.size.or_else(|| resp.body().content_length().map(|n| n + offset));
    if offset > 0 {
        eprintln!("resuming {url} at byte {offset}");
    } else {
        eprintln!("downloading {url}");
    }
    let mut file = OpenOptions::new().create(true).write(true).append(offset > 0).truncate(offset == 0).open(&part)?;
    let bar = crate::core::progress::bar(total.unwrap_or(0), "download");
    bar.set_position(offset);
    let mut reader = resp.into_body().into_reader();
    let mut buf = vec![0u8; 1 << 16];
    let mut received = offset;
    loop {
        // On an error the partial file stays for the next attempt to resume.
        let n = reader.read(&mut buf).with_context(|| {
            format!(
                "download of {url} stopped at byte {} (no data for up to {} s, or the connection broke); run again to resume",
                received,
                crate::hub::download::stall_timeout().as_secs()
            )
        })?;
        if n == 0 {
            break;
        }
        file.write_all(&buf[..n]).with_context(|| format!("cannot write {} (disk full?)", part.display()))?;
        received += n as u64;
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    file.sync_all()?;
    drop(file);
    let got = std::fs::metadata(&part)?.len();
    if let Some(t) = total {
        if got != t {
            bail!("{url}: got {got} of {t} bytes; run again to resume");
        }
    }
    if let Some(want) = &meta.sha256 {
        let mut h = Sha256::new();
        let mut f = std::fs::File::open(&part)?;
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        let got: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        if &got != want {
            let _ = std::fs::remove_file(&part);
            bail!("{url}: SHA-256 {got} does not match the Hub's {want}; the partial download was removed, run again");
        }
    }
    if let Err(e) = valid(&part) {
        let _ = std::fs::remove_file(&part);
        return Err(e.context(format!("{url} served a broken file; it was removed, run again")));
    }
    std::fs::rename(&part, dest).with_context(|| format!("cannot move {} into place", part.display()))?;
    Ok(())
}

/// Accept any file (those checked by size and hash, or read later with their own checks).
pub fn any_file(_: &Path) -> Result<()> {
    Ok(())
}

/// What [`fetch_model`] accepts for each model file: `config.json` must be a config llmrs
/// runs, JSON files must parse, and safetensors files must have a readable header (the Hub
/// sends small files without a hash).
fn valid_model_file(path: &Path) -> Result<()> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    if name.starts_with("config.json") {
        let text = String::from_utf8(crate::core::files::read_file(path)?).context("config.json is not UTF-8")?;
        crate::models::parse_config(&text, path)?;
    } else if name.contains(".json") {
        let text = crate::core::files::read_file(path)?;
        serde_json::from_slice::<serde_json::Value>(&text).with_context(|| format!("{name} is not JSON"))?;
    } else {
        let mut f = std::fs::File::open(path)?;
        let mut n = [0u8; 8];
        f.read_exact(&mut n).context("too short for a safetensors file")?;
        let len = u64::from_le_bytes(n);
        if len == 0 || len > 100 << 20 {
            bail!("not a safetensors file (header length {len})");
        }
        let mut header = vec![0u8; len as usize];
        f.read_exact(&mut header).context("safetensors header cut short")?;
        serde_json::from_slice::<serde_json::Value>(&header).context("safetensors header is not JSON")?;
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::BufRead;
    use std::net::TcpListener;
    use std::sync::{Arc, Mutex};

    /// A loopback server answering the Hub's URLs: `files` maps full paths (e.g.
    /// `/owner/name/resolve/main/config.json`) to bodies. Large files (.safetensors, .parquet) get
    /// `X-Linked-Etag`/`X-Linked-Size` as the Hub sends; `cut_first_get` makes the first GET of
    /// one stop halfway (to test resuming). Serves `max_requests` requests.
    pub fn hub_server(
        files: Vec<(String, Vec<u8>)>,
        cut_first_get: bool,
        max_requests: usize,
    ) -> (String, Arc<Mutex<Vec<String>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let log = Arc::new(Mutex::new(vec![]));
        let log2 = log.clone();
        std::thread::spawn(move || {
            let mut cut = cut_first_get;
            for stream in listener.incoming().take(max_requests) {
                let mut s = stream.unwrap();
                let mut r = std::io::BufReader::new(s.try_clone().unwrap());
                let (mut first, mut range) = (String::new(), None::<u64>);
                let mut line = String::new();
                while r.read_line(&mut line).unwrap_or(0) > 0 && line != "\r\n" {
                    if first.is_empty() {
                        first = line.trim().to_string();
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("range: bytes=") {
                        range = v.trim().trim_end_matches('-').parse().ok();
                    }
                    line.clear();
                }
                log2.lock().unwrap().push(format!("{first} range={range:?}"));
                let mut it = first.split_whitespace();
                let (method, path) = (it.next().unwrap_or(""), it.next().unwrap_or(""));
                let file = files.iter().find(|(n, _)| n == path);
                let Some((name, body)) = file else {
                    let _ = write!(s, "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                    continue;
                };
                let sha = crate::hub::download::sha256_hex(body);
                let large = name.ends_with(".safetensors") || name.ends_with(".parquet");
                let etag = if large {
                    format!("X-Linked-Etag: \"{sha}\"\r\nX-Linked-Size: {}\r\n", body.len())
                } else {
                    String::new()
                };
                if method == "HEAD" {
                    let _ = write!(
                        s,
                        "HTTP/1.1 200 OK\r\n{etag}Content-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    );
                    continue;
                }
                let start = range.unwrap_or(0) as usize;
                let status = if start > 0 { "206 Partial Content" } else { "200 OK" };
                let rest = &body[start..];
                let _ = write!(s, "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", rest.len());
                if cut && large {
                    cut = false;
                    let _ = s.write_all(&rest[..rest.len() / 2]);
                    continue; // connection drops mid-body
                }
                let _ = s.write_all(rest);
            }
        });
        (base, log)
    }

    fn model_files(repo: &str) -> (crate::core::params::Weights, Vec<(String, Vec<u8>)>) {
        let dir = tempfile::tempdir().unwrap();
        let m = crate::core::params::Weights::random(
            crate::core::config::ModelConfig::from_descriptor("1x16:2:8").unwrap(),
            3,
        )
        .unwrap();
        crate::formats::hf::save_hf(&m, dir.path(), crate::core::files::Dtype::F32).unwrap();
        let files = MODEL_FILES
            .iter()
            .map(|f| (format!("/{repo}/resolve/main/{f}"), std::fs::read(dir.path().join(f)).unwrap()))
            .collect();
        (m, files)
    }

    #[test]
    fn fetches_a_model_in_the_hubs_layout_and_caches_it() {
        let (m, files) = model_files("someone/tiny-gpt2");
        let (base, log) = hub_server(files, false, 7);
        let cache = tempfile::tempdir().unwrap();
        let r: HubRef = "someone/tiny-gpt2".parse().unwrap();
        let dir = fetch_model(&r, &base, cache.path()).unwrap();
        let back = crate::formats::hf::load_hf(&dir).unwrap();
        assert_eq!(back, m);
        // The commit HEAD, HEAD + GET per file, a HEAD for each optional file (absent here).
        assert_eq!(log.lock().unwrap().len(), 7, "{:?}", log.lock().unwrap());
        assert_eq!(dir, cache.path().join("models--someone--tiny-gpt2/snapshots/main"));
        assert_eq!(std::fs::read_to_string(cache.path().join("models--someone--tiny-gpt2/refs/main")).unwrap(), "main");
        // Cached: no further requests (the server would not answer them).
        fetch_model(&r, &base, cache.path()).unwrap();
        let e = fetch_model(&"someone/other".parse().unwrap(), &base, cache.path()).unwrap_err();
        assert!(format!("{e:#}").contains("cannot"), "{e:#}");
    }

    #[test]
    fn an_interrupted_download_resumes_with_a_range_request() {
        let (m, files) = model_files("a/b");
        let (base, log) = hub_server(files, true, 20);
        let cache = tempfile::tempdir().unwrap();
        let r: HubRef = "a/b".parse().unwrap();
        let e = fetch_model(&r, &base, cache.path()).unwrap_err();
        assert!(format!("{e:#}").contains("resume"), "{e:#}");
        let part = cache.path().join("models--a--b/snapshots/main/model.safetensors.part");
        let half = std::fs::metadata(&part).unwrap().len();
        assert!(half > 0);
        let dir = fetch_model(&r, &base, cache.path()).unwrap();
        assert_eq!(crate::formats::hf::load_hf(&dir).unwrap(), m);
        assert!(!part.exists());
        let log = log.lock().unwrap();
        assert!(log.iter().any(|l| l.starts_with("GET") && l.ends_with(&format!("range=Some({half})"))), "{log:?}");
    }

    #[test]
    fn lists_and_fetches_dataset_files_with_resume() {
        let pq = b"PAR1 pretend parquet bytes PAR1".repeat(50);
        let listing = serde_json::json!([
            {"type": "directory", "path": "sample/10BT/sub"},
            {"type": "file", "path": "sample/10BT/001_00000.parquet", "size": pq.len()},
            {"type": "file", "path": "sample/10BT/000_00000.parquet", "size": pq.len()},
        ]);
        let d = "/datasets/HuggingFaceFW/fineweb/resolve/main/sample/10BT";
        let files = vec![
            ("/api/datasets/HuggingFaceFW/fineweb/tree/main/sample/10BT".to_string(), listing.to_string().into_bytes()),
            (format!("{d}/000_00000.parquet"), pq.clone()),
            (format!("{d}/001_00000.parquet"), pq.clone()),
        ];
        let (base, _log) = hub_server(files, true, 20);
        let names = list_dataset_files("HuggingFaceFW/fineweb", "main", "sample/10BT", &base).unwrap();
        assert_eq!(names, ["sample/10BT/000_00000.parquet", "sample/10BT/001_00000.parquet"]);
        let cache = tempfile::tempdir().unwrap();
        let repo = "HuggingFaceFW/fineweb";
        assert!(fetch_dataset_files(repo, "main", &names, &base, cache.path()).is_err(), "first GET is cut");
        let paths = fetch_dataset_files(repo, "main", &names, &base, cache.path()).unwrap();
        for p in &paths {
            assert_eq!(std::fs::read(p).unwrap(), pq);
        }
        assert!(fetch_dataset_files("a/b", "main", &["../x".into()], &base, cache.path()).is_err());
    }

    #[test]
    fn a_server_that_never_answers_fails_the_download_instead_of_hanging() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let accepted = Arc::new(Mutex::new(0usize));
        let counter = accepted.clone();
        std::thread::spawn(move || {
            let mut held = vec![];
            for s in listener.incoming().take(10) {
                *counter.lock().unwrap() += 1;
                held.push(s); // accept, never answer
            }
        });
        crate::hub::download::STALL_OVERRIDE.with(|o| o.set(Some(std::time::Duration::from_millis(300))));
        let cache = tempfile::tempdir().unwrap();
        let t0 = std::time::Instant::now();
        let e = fetch_model(&"a/b".parse().unwrap(), &base, cache.path()).unwrap_err();
        crate::hub::download::STALL_OVERRIDE.with(|o| o.set(None));
        assert!(t0.elapsed().as_secs() < 10, "took {:?}", t0.elapsed());
        assert!(format!("{e:#}").contains("cannot reach") && format!("{e:#}").contains("no answer"), "{e:#}");
        // One request waited out its timeout; none was tried after it (60 s, not 120 s).
        assert_eq!(*accepted.lock().unwrap(), 1);
    }

    /// A server that sends the headers and part of a body, then nothing (also one whose
    /// Content-Length promises more than it sends): the download fails after the stall timeout
    /// without progress, keeping the part for a resume, instead of waiting forever.
    #[test]
    fn a_download_that_stalls_mid_body_fails_and_keeps_its_part() {
        for promise_more in [false, true] {
            let body: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let base = format!("http://{}", listener.local_addr().unwrap());
            let sent = body.clone();
            std::thread::spawn(move || {
                let mut held = vec![];
                for stream in listener.incoming().take(3) {
                    let mut s = stream.unwrap();
                    let mut r = std::io::BufReader::new(s.try_clone().unwrap());
                    let (mut first, mut line) = (String::new(), String::new());
                    while r.read_line(&mut line).unwrap_or(0) > 0 && line != "\r\n" {
                        if first.is_empty() {
                            first = line.clone();
                        }
                        line.clear();
                    }
                    let len = if promise_more { 2 * sent.len() } else { sent.len() };
                    let _ = write!(s, "HTTP/1.1 200 OK\r\nContent-Length: {len}\r\n\r\n");
                    if first.starts_with("GET") {
                        let part = if promise_more { &sent[..] } else { &sent[..sent.len() / 3] };
                        let _ = s.write_all(part);
                        let _ = s.flush();
                    }
                    held.push(s); // then silence, with the connection open
                }
                std::thread::sleep(std::time::Duration::from_secs(30));
            });
            crate::hub::download::STALL_OVERRIDE.with(|o| o.set(Some(std::time::Duration::from_millis(300))));
            let dir = tempfile::tempdir().unwrap();
            let dest = dir.path().join("model.safetensors");
            let t0 = std::time::Instant::now();
            let e = fetch_file(&format!("{base}/a/b/resolve/main/model.safetensors"), &dest, &any_file).unwrap_err();
            crate::hub::download::STALL_OVERRIDE.with(|o| o.set(None));
            assert!(t0.elapsed().as_secs() < 10, "took {:?}", t0.elapsed());
            let e = format!("{e:#}");
            assert!(e.contains("stopped at byte") && e.contains("run again to resume"), "{e}");
            assert!(!dest.exists());
            let part = std::fs::metadata(dir.path().join("model.safetensors.part")).unwrap().len();
            assert_eq!(part as usize, if promise_more { body.len() } else { body.len() / 3 });
        }
    }

    #[test]
    fn a_broken_config_is_never_cached_and_a_cached_one_is_fetched_again() {
        let (m, mut files) = model_files("a/b");
        let good_config = files[0].1.clone();
        files[0].1 = b"<html>rate limited</html>".to_vec();
        let (base, _) = hub_server(files.clone(), false, 4);
        let cache = tempfile::tempdir().unwrap();
        let r: HubRef = "a/b".parse().unwrap();
        let e = fetch_model(&r, &base, cache.path()).unwrap_err();
        assert!(format!("{e:#}").contains("broken file"), "{e:#}");
        let cached = cache.path().join("models--a--b/snapshots/main/config.json");
        assert!(!cached.exists() && !cached.with_file_name("config.json.part").exists());
        // A broken file already in the cache (from an older llmrs) is replaced.
        std::fs::write(&cached, b"{not json").unwrap();
        files[0].1 = good_config;
        let (base, _) = hub_server(files, false, 10);
        let dir = fetch_model(&r, &base, cache.path()).unwrap();
        assert_eq!(crate::formats::hf::load_hf(&dir).unwrap(), m);
    }

    #[test]
    fn two_fetches_of_one_model_take_turns() {
        let (m, files) = model_files("a/b");
        let (base, log) = hub_server(files, false, 20);
        let cache = tempfile::tempdir().unwrap();
        let r: HubRef = "a/b".parse().unwrap();
        std::thread::scope(|s| {
            let a = s.spawn(|| fetch_model(&r, &base, cache.path()));
            let b = s.spawn(|| fetch_model(&r, &base, cache.path()));
            for h in [a, b] {
                assert_eq!(crate::formats::hf::load_hf(&h.join().unwrap().unwrap()).unwrap(), m);
            }
        });
        let log = log.lock().unwrap();
        assert_eq!(log.iter().filter(|l| l.starts_with("GET")).count(), 2, "each file downloaded once: {log:?}");
    }

    /// A model transformers already downloaded (refs/main naming a commit whose snapshot holds
    /// the files) is read from Hugging Face's cache without a request; a sharded one with its
    /// tokenizer is downloaded into that layout, commit from X-Repo-Commit aside.
    #[test]
    fn reads_and_writes_hugging_faces_cache_layout() {
        let cache = tempfile::tempdir().unwrap();
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let repo = cache.path().join("models--HuggingFaceTB--tiny");
        let m = crate::core::params::Weights::random(
            crate::core::config::ModelConfig::from_descriptor("llama:1x16:2:1").unwrap(),
            3,
        )
        .unwrap();
        crate::formats::hf::save_hf(&m, &repo.join("snapshots").join(commit), crate::core::files::Dtype::F32).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), commit).unwrap();
        let dir = fetch_model(&"HuggingFaceTB/tiny".parse().unwrap(), "http://127.0.0.1:9", cache.path()).unwrap();
        assert_eq!(crate::formats::hf::load_hf(&dir).unwrap(), m, "read from the cache, no request");
        // Shards: the index and each file it lists; the tokenizer when the repository has one.
        let src = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/gqa_sharded");
        let mut files = vec![];
        for e in std::fs::read_dir(&src).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            files.push((format!("/o/sharded/resolve/main/{name}"), std::fs::read(&p).unwrap()));
        }
        files.push(("/o/sharded/resolve/main/tokenizer.json".into(), b"{\"model\": {}}".to_vec()));
        let (base, _) = hub_server(files, false, 40);
        let dir = fetch_model(&"o/sharded".parse().unwrap(), &base, cache.path()).unwrap();
        assert_eq!(crate::formats::hf::load_hf(&dir).unwrap(), crate::formats::hf::load_hf(&src).unwrap());
        assert!(dir.join("tokenizer.json").is_file() && dir.join(INDEX_FILE).is_file());
        assert!(cached_snapshot(&cache.path().join("models--o--sharded"), "main").is_some());
    }

    #[test]
    fn hub_names() {
        assert_eq!(
            "openai-community/gpt2@v1.0".parse::<HubRef>().unwrap(),
            HubRef { repo: "openai-community/gpt2".into(), revision: "v1.0".into() }
        );
        assert_eq!("gpt2".parse::<HubRef>().unwrap().revision, "main");
        for bad in ["", "a/b/c", "../x", "a/b@", "a b/c"] {
            assert!(bad.parse::<HubRef>().is_err(), "{bad}");
        }
    }
}
