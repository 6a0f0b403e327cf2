//! A run's output directory (`-o`): one run at a time, no mixing of two runs' checkpoints, and
//! nothing left behind by a run that was killed.

use anyhow::{bail, Context, Result};
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

const LOCK: &str = ".llmrs.lock";

/// The output directory, locked (flock) for as long as this value lives: a second run on the
/// same directory is refused at start-up instead of overwriting the first one's files.
pub struct RunDir {
    pub path: PathBuf,
    _lock: File,
}

/// What a fresh run may do with checkpoints it finds in its directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Existing {
    /// Refuse to start (the default): they belong to another run.
    Refuse,
    /// Delete them first (`--overwrite`).
    Delete,
}

impl RunDir {
    /// Create and lock `path`, and remove the temporary files of writes that a killed run
    /// left (none can be in flight: the lock is ours). A fresh run (not `resuming`) over
    /// another run's checkpoints follows `existing`.
    pub fn open(path: &Path, resuming: bool, existing: Existing) -> Result<RunDir> {
        std::fs::create_dir_all(path).with_context(|| format!("cannot create output directory {}", path.display()))?;
        let lock_path = path.join(LOCK);
        let mut lock = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .with_context(|| format!("cannot create {}", lock_path.display()))?;
        // SAFETY: flock on a descriptor this function owns; it touches no memory.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let mut pid = String::new();
            let _ = lock.read_to_string(&mut pid);
            bail!(
                "{} is in use by another llmrs run (pid {}); wait for it to finish or choose another output directory (-o)",
                path.display(),
                pid.trim()
            );
        }
        lock.set_len(0)?;
        lock.rewind()?;
        write!(lock, "{}", std::process::id())?;
        let dir = RunDir { path: path.to_path_buf(), _lock: lock };
        dir.remove_leftovers()?;
        if !resuming {
            {
                let old = dir.checkpoint_files()?;
                if !old.is_empty() {
                    if existing == Existing::Refuse {
                        bail!(
                            "{} holds checkpoints of an earlier run ({} files, e.g. {}); resume it with -y 1, choose \
                             another output directory (-o), or pass --overwrite to delete them",
                            path.display(),
                            old.len(),
                            old[0].file_name().unwrap_or_default().to_string_lossy()
                        );
                    }
                    // DONE markers first, so that a checkpoint is never complete without its files.
                    let mut old = old;
                    old.sort_by_key(|p| !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("DONE_")));
                    for p in old {
                        std::fs::remove_file(&p).with_context(|| format!("cannot remove {}", p.display()))?;
                    }
                }
            }
        }
        Ok(dir)
    }

    /// `.NAME.tmpPID_N` files of atomic writes that never finished (a kill, a full disk).
    fn remove_leftovers(&self) -> Result<()> {
        for e in std::fs::read_dir(&self.path)? {
            let name = e?.file_name().to_string_lossy().into_owned();
            if name.starts_with('.')
                && name.rsplit_once(".tmp").is_some_and(|(_, n)| crate::core::files::temp_pid(n).is_some())
            {
                let _ = std::fs::remove_file(self.path.join(&name));
            }
        }
        Ok(())
    }

    /// Model, state and DONE files of checkpoints.
    fn checkpoint_files(&self) -> Result<Vec<PathBuf>> {
        let mut out = vec![];
        for e in std::fs::read_dir(&self.path)? {
            let name = e?.file_name().to_string_lossy().into_owned();
            let is_ckpt = ["DONE_", "model_", "state_"].iter().any(|p| name.starts_with(p));
            if is_ckpt {
                out.push(self.path.join(name));
            }
        }
        out.sort();
        Ok(out)
    }

    /// Keep the log lines of steps before `step` (the resumed run logs `step` on again), and
    /// drop a torn last line that a kill left.
    pub fn trim_log(&self, step: usize) -> Result<()> {
        let p = self.path.join("log.jsonl");
        let Ok(text) = std::fs::read_to_string(&p) else { return Ok(()) };
        let kept: String = text
            .lines()
            .filter(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v["step"].as_u64())
                    .is_some_and(|s| (s as usize) < step)
            })
            .flat_map(|l| [l, "\n"])
            .collect();
        if kept != text {
            crate::core::files::write_atomic(&p, &[kept.as_bytes()])?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_run_per_directory_and_nothing_stale_survives() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("out");
        let first = RunDir::open(&d, false, Existing::Refuse).unwrap();
        let e = RunDir::open(&d, false, Existing::Refuse).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("in use by another llmrs run") && e.contains(&std::process::id().to_string()), "{e}");
        drop(first);
        // Checkpoints of an earlier run: refused, or deleted with --overwrite.
        for f in ["model_00000005.bin", "state_00000005_00000.bin", "DONE_00000005", ".model_00000006.bin.tmp4242_0"] {
            std::fs::write(d.join(f), b"x").unwrap();
        }
        let e = RunDir::open(&d, false, Existing::Refuse).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("holds checkpoints of an earlier run") && e.contains("--overwrite"), "{e}");
        assert!(!d.join(".model_00000006.bin.tmp4242_0").exists(), "a killed write's temp file was left");
        assert!(d.join("DONE_00000005").exists(), "refusing deleted something");
        drop(RunDir::open(&d, false, Existing::Delete).unwrap());
        let left: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, [std::ffi::OsString::from(LOCK)]);
        // Resuming at step 2 keeps the log of steps 0 and 1 and drops a torn last line.
        let log = "{\"step\":0,\"val_loss\":5}\n{\"step\":0,\"train_loss\":5}\n{\"step\":1,\"train_loss\":4}\n\
                   {\"step\":2,\"val_loss\":3}\n{\"step\":2,\"train_lo";
        std::fs::write(d.join("log.jsonl"), log).unwrap();
        RunDir::open(&d, true, Existing::Refuse).unwrap().trim_log(2).unwrap();
        let kept = std::fs::read_to_string(d.join("log.jsonl")).unwrap();
        assert_eq!(kept, "{\"step\":0,\"val_loss\":5}\n{\"step\":0,\"train_loss\":5}\n{\"step\":1,\"train_loss\":4}\n");
    }
}
