//! File utilities every format shares: whole-file reads that refuse FIFOs and directories,
//! llm.c's 256-int32 header, little-endian f32/bf16 conversion, and atomic writes (temp file in
//! the same directory, fsync, rename), so a crash never leaves a half-written file under the
//! final name.

use anyhow::{bail, Context, Result};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

/// llm.c's files start with this many little-endian int32.
pub const HEADER_INTS: usize = 256;
pub const HEADER_BYTES: usize = HEADER_INTS * 4;

/// Storage precision of a model file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    BF16,
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Dtype::F32 => "fp32",
            Dtype::BF16 => "bf16",
        })
    }
}

impl Dtype {
    pub fn version(self) -> i32 {
        match self {
            Dtype::F32 => 3,
            Dtype::BF16 => 5,
        }
    }
    pub fn bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::BF16 => 2,
        }
    }
}

/// Temporary files are `.NAME.tmpPID_N`: the PID for [`remove_dead_temps`], and a count so that
/// two threads writing one path never share a temp file (the later rename wins, whole).
static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Read a whole file, with an error that names it.
pub fn read_file(path: &Path) -> Result<Vec<u8>> {
    check_regular(path)?;
    let len = std::fs::metadata(path).map_or(0, |m| m.len());
    crate::core::mem::check_available(
        usize::try_from(len).unwrap_or(usize::MAX),
        &format!("reading {}", path.display()),
    )?;
    std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))
}

/// Bytes of a model file converted per piece by [`ModelFile::values`] (8 MiB): the file is
/// never in memory whole beside the weights it fills.
const PIECE: usize = 8 << 20;

/// A model file read front to back: its first bytes (`head`: llm.c's header and the llama3
/// branch's second one, 2 KiB, or less for a shorter file) read at open, then its values read
/// in pieces straight into the caller's buffers ([`ModelFile::values`]). Loading a model so
/// needs the model's memory and a piece, not the file's size besides.
pub struct ModelFile<'a> {
    pub head: Vec<u8>,
    /// The file's size in bytes.
    pub len: u64,
    pub path: &'a Path,
    reader: Box<dyn std::io::Read + 'a>,
    /// Bytes taken from `reader` so far (`head` included).
    pos: u64,
}

impl<'a> ModelFile<'a> {
    /// Open `path` (a regular file) and read its head.
    pub fn open(path: &'a Path) -> Result<ModelFile<'a>> {
        check_regular(path)?;
        let f = File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
        let len = f.metadata().with_context(|| format!("cannot read {}", path.display()))?.len();
        // Unbuffered: the reads are the 2 KiB head, a config, and pieces of 8 MiB.
        Self::new(Box::new(f), len, path)
    }

    /// The same over bytes in memory (tests, and files already read).
    pub fn from_bytes(bytes: &'a [u8], path: &'a Path) -> Result<ModelFile<'a>> {
        Self::new(Box::new(bytes), bytes.len() as u64, path)
    }

    fn new(mut reader: Box<dyn std::io::Read + 'a>, len: u64, path: &'a Path) -> Result<ModelFile<'a>> {
        let mut head = Vec::with_capacity(2 * HEADER_BYTES);
        std::io::Read::read_to_end(&mut std::io::Read::take(&mut reader, 2 * HEADER_BYTES as u64), &mut head)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let pos = head.len() as u64;
        Ok(ModelFile { head, len, path, reader, pos })
    }

    /// The `n` bytes from `offset` on, which must lie inside the head or be the next ones the
    /// file gives (offsets only go forward); an error names the file if it ends first.
    pub fn bytes(&mut self, offset: u64, n: usize) -> Result<Vec<u8>> {
        let mut out = vec![0u8; n];
        self.read_into(offset, &mut out)?;
        Ok(out)
    }

    /// `out.len()` values stored as `dtype` from byte `offset` on (offsets only go forward),
    /// read and converted a piece at a time.
    pub fn values(&mut self, offset: u64, dtype: Dtype, out: &mut [f32]) -> Result<()> {
        let per = PIECE / dtype.bytes();
        let mut buf = vec![0u8; per.min(out.len()) * dtype.bytes()];
        let mut at = offset;
        for o in out.chunks_mut(per.max(1)) {
            let b = &mut buf[..o.len() * dtype.bytes()];
            self.read_into(at, b)?;
            match dtype {
                Dtype::F32 => f32s_from_le(b, o),
                Dtype::BF16 => bf16s_from_le(b, o),
            }
            at += b.len() as u64;
        }
        Ok(())
    }

    fn read_into(&mut self, offset: u64, out: &mut [u8]) -> Result<()> {
        use std::io::Read;
        let (n, path) = (out.len(), self.path);
        let truncated = |e: std::io::Error| {
            let what = if e.kind() == std::io::ErrorKind::UnexpectedEof { "it is truncated" } else { "read error" };
            anyhow::anyhow!("{}: cannot read {n} bytes at {offset} ({what}: {e})", path.display())
        };
        let mut done = 0;
        // From the head first.
        if offset < self.head.len() as u64 {
            let h = &self.head[offset as usize..];
            done = h.len().min(out.len());
            out[..done].copy_from_slice(&h[..done]);
        }
        if done == out.len() {
            return Ok(());
        }
        let from = offset + done as u64;
        if from < self.pos {
            bail!("{}: internal error: a read at {from} after {} was read", self.path.display(), self.pos);
        }
        let skip = from - self.pos;
        let skipped =
            std::io::copy(&mut Read::take(&mut self.reader, skip), &mut std::io::sink()).map_err(truncated)?;
        self.pos += skipped;
        if skipped < skip {
            return Err(truncated(std::io::ErrorKind::UnexpectedEof.into()));
        }
        self.reader.read_exact(&mut out[done..]).map_err(truncated)?;
        self.pos += (out.len() - done) as u64;
        Ok(())
    }
}

/// Refuse anything but a regular file (after symlinks): reading a FIFO or a device would block
/// or never end, and a directory is a mistake worth naming.
pub fn check_regular(path: &Path) -> Result<()> {
    let md = std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    if !md.is_file() {
        let kind = if md.is_dir() { "a directory" } else { "not a regular file (a FIFO, socket or device?)" };
        bail!("{} is {kind}; give the path of a file", path.display());
    }
    Ok(())
}

/// Whether `path` names a file to read: false when nothing is there, and an error naming the
/// problem when something is there that cannot be read as a file (a FIFO, socket or device, a
/// directory, a link to nothing, a file without read permission), so that such a file is not
/// reported as missing, nor passed over as if it were.
pub fn present(path: &Path) -> Result<bool> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        Ok(_) => {}
    }
    if let Err(e) = std::fs::metadata(path) {
        if e.kind() == std::io::ErrorKind::NotFound {
            bail!("{} is a symbolic link to nothing; point it at the file or remove it", path.display());
        }
    }
    check_regular(path)?;
    File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(true)
}

/// Parse the 256-int header at the start of `bytes`.
pub fn parse_header(bytes: &[u8], path: &Path, what: &str) -> Result<[i32; HEADER_INTS]> {
    if bytes.len() < HEADER_BYTES {
        bail!(
            "{} is too short to be an llm.c {what} file ({} bytes, the header alone is {HEADER_BYTES}): it is truncated or not such a file",
            path.display(),
            bytes.len()
        );
    }
    Ok(std::array::from_fn(|i| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap())))
}

pub fn f32s_from_le(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes(b.try_into().unwrap());
    }
}

pub fn f32s_to_le(vals: &[f32], out: &mut Vec<u8>) {
    out.reserve(vals.len() * 4);
    for v in vals {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// Little-endian bf16 values to f32 (exact).
pub fn bf16s_from_le(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

/// f32 values as little-endian bf16 (round to nearest even, as PyTorch's `.bfloat16()`).
pub fn f32s_to_bf16_le(vals: &[f32], out: &mut Vec<u8>) {
    out.reserve(vals.len() * 2);
    for v in vals {
        out.extend_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
    }
}

/// Write `chunks` to `path` atomically: temp file in the same directory, fsync, rename.
pub fn write_atomic(path: &Path, chunks: &[&[u8]]) -> Result<()> {
    write_atomic_with(path, |w| chunks.iter().try_for_each(|c| w.write_all(c)))
}

/// Write what `fill` writes to `path` atomically: temp file in the same directory, fsync,
/// rename, so a crash or a full disk never leaves a half-written file under the final name.
pub fn write_atomic_with(path: &Path, fill: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) -> Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create directory {}", dir.display()))?;
    let name = path.file_name().context("output path has no file name")?.to_string_lossy();
    remove_dead_temps(dir, &name);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.tmp{}_{n}", std::process::id()));
    let result = (|| -> Result<()> {
        let mut f = BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
        fill(&mut f)?;
        let f = f.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        Ok(())
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(e.context(format!("cannot write {} (is the disk full?)", path.display())));
    }
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()));
    }
    // Make the rename itself durable (best effort: not every filesystem lets a directory be synced).
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// A file written in place under a temporary name and renamed into place by [`AtomicFile::commit`]
/// (after an fsync), for writers that need to seek (a header patched at the end) or that
/// stream more than fits in memory; dropped without commit, the temporary file is removed.
pub struct AtomicFile {
    path: std::path::PathBuf,
    tmp: std::path::PathBuf,
    file: Option<BufWriter<File>>,
}

impl AtomicFile {
    pub fn create(path: &Path) -> Result<AtomicFile> {
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create directory {}", dir.display()))?;
        let name = path.file_name().context("output path has no file name")?.to_string_lossy();
        remove_dead_temps(dir, &name);
        let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = dir.join(format!(".{name}.tmp{}_{n}", std::process::id()));
        let f = File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        Ok(AtomicFile { path: path.to_path_buf(), tmp, file: Some(BufWriter::with_capacity(1 << 20, f)) })
    }

    /// The file being written (positioned at its end until the caller seeks).
    pub fn file(&mut self) -> &mut BufWriter<File> {
        self.file.as_mut().expect("not committed")
    }

    /// Flush, fsync and rename into place.
    pub fn commit(mut self) -> Result<()> {
        let f = self.file.take().expect("committed once");
        let what = || format!("cannot write {} (is the disk full?)", self.path.display());
        let f = f.into_inner().map_err(|e| e.into_error()).with_context(what)?;
        f.sync_all().with_context(what)?;
        drop(f);
        if let Err(e) = std::fs::rename(&self.tmp, &self.path) {
            let _ = std::fs::remove_file(&self.tmp);
            return Err(e).with_context(|| format!("cannot rename {} to {}", self.tmp.display(), self.path.display()));
        }
        if let Some(d) = self.path.parent().filter(|d| !d.as_os_str().is_empty()).and_then(|d| File::open(d).ok()) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// The writer's PID from the part of a temp file's name after `.tmp` (`PID_N`, or `PID` from
/// older llmrs), or None for a name write_atomic_with never makes.
pub fn temp_pid(suffix: &str) -> Option<i32> {
    suffix.split_once('_').map_or(suffix, |(pid, n)| if n.parse::<u64>().is_ok() { pid } else { "" }).parse().ok()
}

/// Remove `.NAME.tmpPID_N` files in `dir` left by write_atomic_with in processes that no longer
/// run (killed mid-write, or by SIGXFSZ on a full disk); a live process's write is left alone.
pub fn remove_dead_temps(dir: &Path, name: &str) {
    let prefix = format!(".{name}.tmp");
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let f = e.file_name();
        let Some(pid) = f.to_str().and_then(|f| f.strip_prefix(&prefix)).and_then(temp_pid) else {
            continue;
        };
        // SAFETY: kill with signal 0 only checks whether the process exists.
        let gone = pid > 0
            && unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values read in pieces from any offset past the head, across the head's end and past
    /// a piece (8 MiB), in both dtypes, equal the whole-buffer conversion; a file that ends
    /// first and a read behind the last one are errors naming the file.
    #[test]
    fn model_files_are_read_in_pieces_as_a_whole() {
        let n = PIECE / 4 * 2 + 37; // f32s: two pieces and a bit
        let vals: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut bytes = vec![7u8; 1500]; // "headers": the values start inside the 2 KiB head
        f32s_to_le(&vals, &mut bytes);
        f32s_to_bf16_le(&vals, &mut bytes);
        let path = Path::new("m.bin");
        let mut f = ModelFile::from_bytes(&bytes, path).unwrap();
        assert_eq!((f.head.len(), f.len), (2 * HEADER_BYTES, bytes.len() as u64));
        assert_eq!(f.bytes(1496, 4).unwrap(), &bytes[1496..1500]);
        let mut got = vec![0f32; n];
        f.values(1500, Dtype::F32, &mut got).unwrap();
        assert!(got == vals);
        let mut want16 = vec![0f32; n];
        bf16s_from_le(&bytes[1500 + 4 * n..], &mut want16);
        let mut got16 = vec![0f32; n];
        f.values((1500 + 4 * n) as u64, Dtype::BF16, &mut got16).unwrap();
        assert!(got16 == want16);
        // Skipping forward: the last 3 values of the f32 part from a fresh file.
        let mut f = ModelFile::from_bytes(&bytes, path).unwrap();
        let mut tail = [0f32; 3];
        f.values((1500 + 4 * (n - 3)) as u64, Dtype::F32, &mut tail).unwrap();
        assert_eq!(&tail[..], &vals[n - 3..]);
        let e = f.values(4096, Dtype::F32, &mut tail).unwrap_err().to_string();
        assert!(e.contains("m.bin"), "{e}");
        // A file shorter than its values, and one shorter than the head.
        let short = &bytes[..bytes.len() - 1];
        let mut f = ModelFile::from_bytes(short, path).unwrap();
        let e = f.values((1500 + 4 * n) as u64, Dtype::BF16, &mut got16).unwrap_err().to_string();
        assert!(e.contains("m.bin") && e.contains("truncated"), "{e}");
        let f = ModelFile::from_bytes(&bytes[..100], path).unwrap();
        assert_eq!((f.head.len(), f.len), (100, 100));
    }

    #[test]
    fn temporary_files_of_dead_writers_are_removed_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let stale = [format!(".x.bin.tmp{dead}_3"), format!(".x.bin.tmp{dead}")].map(|n| dir.path().join(n));
        let live = dir.path().join(".x.bin.tmp1_0"); // pid 1 always runs
        let other = dir.path().join(format!(".x.bin.tmp{dead}_z")); // not a name we write
        for (p, what) in [(&stale[0], "half"), (&stale[1], "half"), (&live, "init's write"), (&other, "?")] {
            std::fs::write(p, what).unwrap();
        }
        write_atomic(&dir.path().join("x.bin"), &[b"whole"]).unwrap();
        assert!(!stale[0].exists() && !stale[1].exists() && live.exists() && other.exists());
        assert_eq!(std::fs::read(dir.path().join("x.bin")).unwrap(), b"whole");
        // Two threads writing one path never share a temp file: both renames land whole.
        std::thread::scope(|s| {
            for i in 0..4u8 {
                let p = dir.path().join("y.bin");
                s.spawn(move || (0..50).for_each(|_| write_atomic(&p, &[&[i; 4096]]).unwrap()));
            }
        });
        let y = std::fs::read(dir.path().join("y.bin")).unwrap();
        assert!(y.len() == 4096 && y.iter().all(|&b| b == y[0]));
    }
}
