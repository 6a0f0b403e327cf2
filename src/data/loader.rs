//! llm.c token shards and the data loader that serves (B, T) batches from them.
//!
//! Shard format: a header of 256 int32 (magic 20240520, version 1, token count), then the
//! tokens as uint16; or for vocabularies past 16 bits (Llama 3's 128256) llm.c's llama3 shards,
//! magic 20240801, version 7, tokens as uint32. The loader reproduces llm.c's `DataLoader` exactly, including its shuffled
//! order (shards and samples permuted by a Mersenne Twister seeded with 42), so llmrs sees the
//! same batches as llm.c, batch for batch.

use crate::core::files::{parse_header, write_atomic, HEADER_BYTES};
use crate::core::rng::Mt19937;
use anyhow::{bail, Context, Result};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

pub const SHARD_MAGIC: i32 = 20240520;
pub const SHARD_VERSION: i32 = 1;
/// llm.c's uint32 shards (its llama3 branch).
pub const SHARD32_MAGIC: i32 = 20240801;
pub const SHARD32_VERSION: i32 = 7;

/// Write `tokens` as an llm.c uint16 shard (atomically).
pub fn write_shard(path: &Path, tokens: &[u32]) -> Result<()> {
    write_shard_as(path, tokens, false)
}

/// Write `tokens` as an llm.c shard, uint32 when `wide` (a vocabulary past 16 bits).
pub fn write_shard_as(path: &Path, tokens: &[u32], wide: bool) -> Result<()> {
    if tokens.len() >= i32::MAX as usize {
        bail!("{} tokens do not fit in one shard (the header stores an int32 count)", tokens.len());
    }
    if let Some(t) = tokens.iter().find(|&&t| t > u16::MAX as u32 && !wide) {
        bail!("token id {t} does not fit in a uint16 shard");
    }
    let mut header = [0i32; 256];
    (header[0], header[1]) = if wide { (SHARD32_MAGIC, SHARD32_VERSION) } else { (SHARD_MAGIC, SHARD_VERSION) };
    header[2] = tokens.len() as i32;
    let h: Vec<u8> = header.iter().flat_map(|x| x.to_le_bytes()).collect();
    let body: Vec<u8> = if wide {
        tokens.iter().flat_map(|&t| t.to_le_bytes()).collect()
    } else {
        tokens.iter().flat_map(|&t| (t as u16).to_le_bytes()).collect()
    };
    write_atomic(path, &[&h, &body])
}

/// An llm.c shard written as its tokens come (any number of them, in constant memory): the
/// header's count is filled in by [`ShardWriter::finish`], which puts the file in place
/// atomically; dropped unfinished, nothing is left.
pub struct ShardWriter {
    file: crate::core::files::AtomicFile,
    wide: bool,
    count: usize,
    bytes: Vec<u8>,
}

impl ShardWriter {
    /// A shard of uint16 tokens, or uint32 when `wide` (a vocabulary past 16 bits).
    pub fn create(path: &Path, wide: bool) -> Result<ShardWriter> {
        let mut file = crate::core::files::AtomicFile::create(path)?;
        std::io::Write::write_all(file.file(), &[0u8; HEADER_BYTES])?;
        Ok(ShardWriter { file, wide, count: 0, bytes: Vec::with_capacity(1 << 16) })
    }

    pub fn push(&mut self, tokens: &[u32]) -> Result<()> {
        if let Some(t) = tokens.iter().find(|&&t| t > u16::MAX as u32 && !self.wide) {
            bail!("token id {t} does not fit in a uint16 shard");
        }
        self.count += tokens.len();
        if self.count >= i32::MAX as usize {
            bail!("{} tokens do not fit in one shard (the header stores an int32 count)", self.count);
        }
        self.bytes.clear();
        if self.wide {
            self.bytes.extend(tokens.iter().flat_map(|&t| t.to_le_bytes()));
        } else {
            self.bytes.extend(tokens.iter().flat_map(|&t| (t as u16).to_le_bytes()));
        }
        std::io::Write::write_all(self.file.file(), &self.bytes).context("cannot write the shard (is the disk full?)")
    }

    /// Tokens pushed so far.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Write the header and put the shard in place.
    pub fn finish(mut self) -> Result<usize> {
        use std::io::{Seek, Write};
        let mut header = [0i32; 256];
        (header[0], header[1]) =
            if self.wide { (SHARD32_MAGIC, SHARD32_VERSION) } else { (SHARD_MAGIC, SHARD_VERSION) };
        header[2] = self.count as i32;
        let h: Vec<u8> = header.iter().flat_map(|x| x.to_le_bytes()).collect();
        let f = self.file.file();
        f.seek(SeekFrom::Start(0)).context("cannot write the shard header")?;
        f.write_all(&h).context("cannot write the shard header")?;
        let n = self.count;
        self.file.commit()?;
        Ok(n)
    }
}

/// Read a whole shard into memory (for tools and tests; training streams batches instead).
pub fn read_shard(path: &Path) -> Result<Vec<u32>> {
    let bytes = crate::core::files::read_file(path)?;
    let (ntok, width) = check_shard_header(&bytes[..bytes.len().min(HEADER_BYTES)], bytes.len() as u64, path)?;
    Ok(bytes[HEADER_BYTES..HEADER_BYTES + width * ntok].chunks_exact(width).map(token).collect())
}

/// A little-endian token of 2 or 4 bytes.
fn token(b: &[u8]) -> u32 {
    if b.len() == 2 {
        u16::from_le_bytes([b[0], b[1]]) as u32
    } else {
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

/// Validate a shard header against the file size; returns the token count and the bytes per
/// token.
fn check_shard_header(header: &[u8], file_len: u64, path: &Path) -> Result<(usize, usize)> {
    let h = parse_header(header, path, "token shard")?;
    let width = match h[0] {
        SHARD_MAGIC => 2,
        SHARD32_MAGIC => 4,
        m => bail!(
            "{}: bad magic {m} in token shard (expected {SHARD_MAGIC}, or {SHARD32_MAGIC} for uint32 tokens); is this \
             an llm.c .bin token file? Re-run `llmrs prepare`",
            path.display()
        ),
    };
    let version = if width == 2 { SHARD_VERSION } else { SHARD32_VERSION };
    if h[1] != version {
        bail!(
            "{}: token shard version {} is not supported (expected {version}); re-run `llmrs prepare`",
            path.display(),
            h[1]
        );
    }
    let ntok = usize::try_from(h[2])
        .ok()
        .filter(|&n| n > 0)
        .with_context(|| format!("{}: token count {} is invalid", path.display(), h[2]))?;
    let want = (HEADER_BYTES + width * ntok) as u64;
    if file_len != want {
        bail!(
            "{}: file is {file_len} bytes but its header promises {ntok} tokens ({want} bytes): the shard is truncated or corrupt",
            path.display()
        );
    }
    Ok((ntok, width))
}

/// Refuse a shard holding a token id of `vocab_size` or more, naming the file, the position
/// of the first such token and its id. Read in pieces of 8 MiB; a piece's maximum is taken
/// first (a loop the compiler vectorises) and searched only when it is out of range.
pub fn check_token_ids(path: &Path, vocab_size: usize) -> Result<()> {
    let mut f = File::open(path).with_context(|| format!("cannot open token shard {}", path.display()))?;
    let len = f.metadata()?.len();
    let mut header = vec![0u8; HEADER_BYTES.min(len as usize)];
    f.read_exact(&mut header).with_context(|| format!("cannot read {}", path.display()))?;
    let (ntok, width) = check_shard_header(&header, len, path)?;
    if width == 2 && vocab_size > u16::MAX as usize {
        return Ok(()); // every uint16 id fits
    }
    let mut buf = vec![0u8; (8 << 20) / width * width];
    let mut at = 0usize;
    while at < ntok {
        let n = (ntok - at).min(buf.len() / width);
        let piece = &mut buf[..n * width];
        f.read_exact(piece).with_context(|| format!("cannot read {}", path.display()))?;
        let max = piece.chunks_exact(width).map(token).max().unwrap_or(0);
        if max as usize >= vocab_size {
            let (i, id) =
                piece.chunks_exact(width).map(token).enumerate().find(|&(_, x)| x as usize >= vocab_size).unwrap();
            bail!(
                "{}: token id {id} at position {} (of {ntok}) is out of range for the model's vocab size {vocab_size}: \
                 the data was tokenized for another vocabulary (or the shard is damaged)",
                path.display(),
                at + i
            );
        }
        at += n;
    }
    Ok(())
}

/// Expand a file name or glob pattern into a sorted list of shards (as C's glob does).
pub fn expand_pattern(pattern: &str) -> Result<Vec<PathBuf>> {
    let paths: Vec<PathBuf> = glob::glob(pattern)
        .with_context(|| format!("bad file pattern '{pattern}'"))?
        .filter_map(|p| p.ok())
        .filter(|p| p.is_file())
        .collect();
    if paths.is_empty() {
        bail!("no token files match '{pattern}': run `llmrs prepare tinyshakespeare` or pass -i/-j with your shards");
    }
    Ok(paths)
}

/// The position of a loader in its data, as saved in llm.c's training-state file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoaderState {
    pub current_shard_idx: usize,
    pub current_sample_idx: usize,
    /// Only with shuffling:
    pub shard_indices: Vec<i32>,
    pub shard_num_samples: usize,
    pub intra_shard_indices: Vec<i32>,
    pub rng: Option<Mt19937>,
}

/// Which part of every batch a process reads: llm.c's split of a batch of
/// `world * B * T` tokens, rank r taking the r-th run of B*T (plus one) tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    pub rank: usize,
    pub world: usize,
}

impl Split {
    /// One process reads whole batches.
    pub const SINGLE: Split = Split { rank: 0, world: 1 };
}

/// Serves (B, T) batches of inputs and next-token targets, as llm.c's `DataLoader`.
pub struct DataLoader {
    pub b: usize,
    pub t: usize,
    split: Split,
    files: Vec<PathBuf>,
    vocab_size: usize,
    pub num_tokens: usize,
    should_shuffle: bool,
    rng: Mt19937,
    shard_indices: Vec<i32>,
    intra_shard_indices: Vec<i32>,
    current_shard_idx: usize,
    current_sample_idx: usize,
    shard_num_samples: usize,
    file: Option<(File, PathBuf)>,
    /// Bytes per token of the open shard (2 or 4).
    width: usize,
    buffer: Vec<u8>,       // (B*T + 1) tokens of up to 4 bytes
    pub inputs: Vec<u32>,  // (B, T)
    pub targets: Vec<u32>, // (B, T)
}

impl DataLoader {
    /// Open every shard matching `pattern`, validate them all, and position at the start.
    /// Token ids must be below `vocab_size`.
    pub fn new(pattern: &str, b: usize, t: usize, vocab_size: usize, should_shuffle: bool) -> Result<Self> {
        Self::new_split(pattern, b, t, vocab_size, should_shuffle, Split::SINGLE)
    }

    /// [`DataLoader::new`] for one process of several: this process reads its part of every
    /// batch. Every rank shuffles with the seed 42, so the ranks permute the same samples and
    /// together read exactly the batches one process reads with B * world. (llm.c seeds rank r
    /// with 42 + r, so its ranks' parts of a batch come from different samples; a resumed llm.c
    /// run keeps its order, which its state files carry.)
    pub fn new_split(
        pattern: &str,
        b: usize,
        t: usize,
        vocab_size: usize,
        should_shuffle: bool,
        split: Split,
    ) -> Result<Self> {
        let files = expand_pattern(pattern)?;
        if b == 0 || t == 0 {
            bail!("batch size and sequence length must be positive (got B={b}, T={t})");
        }
        if split.world == 0 || split.rank >= split.world {
            bail!("process rank {} is not below the number of processes {}", split.rank, split.world);
        }
        // One batch of every process, plus the last target: checked, so that an absurd -b or -t
        // is an error naming the data rather than an overflow or a huge allocation.
        let need = split.world.checked_mul(b).and_then(|x| x.checked_mul(t)).and_then(|x| x.checked_add(1));
        let n = files.len();
        let mut dl = DataLoader {
            b,
            t,
            split,
            files,
            vocab_size,
            num_tokens: 0,
            should_shuffle,
            rng: Mt19937::new(42),
            shard_indices: (0..n as i32).collect(),
            intra_shard_indices: vec![],
            current_shard_idx: 0,
            current_sample_idx: 0,
            shard_num_samples: 0,
            file: None,
            width: 2,
            // (Allocated once every shard is known to hold a batch.)
            buffer: vec![],
            inputs: vec![],
            targets: vec![],
        };
        for i in 0..n {
            let ntok = dl.load_shard(i)?;
            if need.is_none_or(|need| ntok < need) {
                bail!(
                    "{} holds {ntok} tokens, fewer than one batch needs (processes*B*T+1 = {}): use a smaller -b/-t or more data",
                    dl.file_name(),
                    need.map_or(format!("{} x {b} x {t} + 1", split.world), |x| x.to_string())
                );
            }
            dl.num_tokens += ntok;
        }
        // Every token checked now, not when its batch arrives (a bad id deep in a shard would
        // otherwise stop a run hours in): a sequential read, all cores over the shards.
        use rayon::prelude::*;
        dl.files.par_iter().try_for_each(|p| check_token_ids(p, vocab_size))?;
        dl.buffer = vec![0u8; 4 * (b * t + 1)];
        dl.inputs = vec![0; b * t];
        dl.targets = vec![0; b * t];
        dl.reset()?;
        Ok(dl)
    }

    fn file_name(&self) -> String {
        self.file.as_ref().map_or_else(String::new, |f| f.1.display().to_string())
    }

    pub fn num_shards(&self) -> usize {
        self.files.len()
    }

    fn load_shard(&mut self, shard: usize) -> Result<usize> {
        let idx = if self.should_shuffle { self.shard_indices[shard] as usize } else { shard };
        let path = self.files.get(idx).context("shard index out of range")?.clone();
        crate::core::files::check_regular(&path)?;
        let mut f = File::open(&path).with_context(|| format!("cannot open token shard {}", path.display()))?;
        let len = f.metadata()?.len();
        let mut header = vec![0u8; HEADER_BYTES.min(len as usize)];
        f.read_exact(&mut header)?;
        let (ntok, width) = check_shard_header(&header, len, &path)?;
        self.width = width;
        // One sample is B*T tokens per process; the last needs one extra token for its final target.
        self.shard_num_samples = (ntok - 1) / (self.split.world * self.b * self.t);
        self.file = Some((f, path));
        Ok(ntok)
    }

    fn prepare_intra_shard_indices(&mut self) {
        self.intra_shard_indices = (0..self.shard_num_samples as i32).collect();
        self.rng.permute(&mut self.intra_shard_indices);
    }

    /// Back to the first batch of the (next) epoch; with shuffling this draws a new order.
    pub fn reset(&mut self) -> Result<()> {
        self.current_shard_idx = 0;
        self.current_sample_idx = 0;
        if self.should_shuffle {
            self.rng.permute(&mut self.shard_indices);
        }
        self.load_shard(0)?;
        if self.should_shuffle {
            self.prepare_intra_shard_indices();
        }
        Ok(())
    }

    fn advance(&mut self) -> Result<()> {
        if self.current_shard_idx == self.files.len() - 1 {
            return self.reset(); // end of epoch
        }
        self.current_shard_idx += 1;
        self.current_sample_idx = 0;
        self.load_shard(self.current_shard_idx)?;
        if self.should_shuffle {
            self.prepare_intra_shard_indices();
        }
        Ok(())
    }

    /// Load the next batch into `inputs` and `targets`.
    pub fn next_batch(&mut self) -> Result<()> {
        if self.current_sample_idx >= self.shard_num_samples {
            self.advance()?;
        }
        let idx = if self.should_shuffle {
            self.intra_shard_indices[self.current_sample_idx] as usize
        } else {
            self.current_sample_idx
        };
        let bt = self.b * self.t;
        let w = self.width;
        let offset = HEADER_BYTES + (idx * self.split.world + self.split.rank) * bt * w;
        let (f, path) = self.file.as_mut().context("data loader has no open shard")?;
        f.seek(SeekFrom::Start(offset as u64))?;
        let buf = &mut self.buffer[..(bt + 1) * w];
        f.read_exact(buf).with_context(|| format!("cannot read a batch from {}", path.display()))?;
        for i in 0..bt {
            self.inputs[i] = token(&buf[i * w..(i + 1) * w]);
            self.targets[i] = token(&buf[(i + 1) * w..(i + 2) * w]);
        }
        if let Some(&bad) = self.inputs.iter().chain(&self.targets).find(|&&x| x as usize >= self.vocab_size) {
            bail!(
                "{}: token id {bad} is out of range for the model's vocab size {}: the data was tokenized for another vocabulary",
                path.display(),
                self.vocab_size
            );
        }
        self.current_sample_idx += 1;
        Ok(())
    }

    pub fn state(&self) -> LoaderState {
        LoaderState {
            current_shard_idx: self.current_shard_idx,
            current_sample_idx: self.current_sample_idx,
            shard_indices: if self.should_shuffle { self.shard_indices.clone() } else { vec![] },
            shard_num_samples: self.shard_num_samples,
            intra_shard_indices: if self.should_shuffle { self.intra_shard_indices.clone() } else { vec![] },
            rng: self.should_shuffle.then(|| self.rng.clone()),
        }
    }

    /// Continue from a saved position (llm.c's `dataloader_resume` plus the shuffle state).
    pub fn restore(&mut self, s: &LoaderState) -> Result<()> {
        if s.current_shard_idx >= self.files.len() {
            bail!("saved data position is in shard {} but only {} shards match: pass the same -i as the run being resumed", s.current_shard_idx, self.files.len());
        }
        if self.should_shuffle {
            if s.shard_indices.len() != self.files.len() {
                bail!(
                    "saved shuffle state covers {} shards but {} match now: pass the same -i as the run being resumed",
                    s.shard_indices.len(),
                    self.files.len()
                );
            }
            self.shard_indices = s.shard_indices.clone();
            self.rng = s.rng.clone().context("saved state has no shuffle RNG")?;
        }
        self.current_shard_idx = s.current_shard_idx;
        self.load_shard(s.current_shard_idx)?;
        if self.should_shuffle {
            if s.shard_num_samples != self.shard_num_samples || s.intra_shard_indices.len() != self.shard_num_samples {
                bail!("saved shuffle state does not fit the current shard (different data or -b/-t than the run being resumed)");
            }
            self.intra_shard_indices = s.intra_shard_indices.clone();
        }
        self.current_sample_idx = s.current_sample_idx;
        Ok(())
    }

    pub fn should_shuffle(&self) -> bool {
        self.should_shuffle
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(dir: &Path, name: &str, tokens: &[u32]) -> PathBuf {
        let p = dir.join(name);
        write_shard(&p, tokens).unwrap();
        p
    }

    #[test]
    fn sequential_batches_and_epochs() {
        let dir = tempfile::tempdir().unwrap();
        let toks: Vec<u32> = (0..25).collect();
        shard(dir.path(), "a.bin", &toks);
        let mut dl = DataLoader::new(dir.path().join("a.bin").to_str().unwrap(), 2, 3, 100, false).unwrap();
        // (25 - 1) / 6 = 4 samples per epoch.
        for epoch in 0..2 {
            for s in 0..4u32 {
                dl.next_batch().unwrap();
                assert_eq!(dl.inputs, (6 * s..6 * s + 6).collect::<Vec<_>>(), "epoch {epoch}");
                assert_eq!(dl.targets, (6 * s + 1..6 * s + 7).collect::<Vec<_>>());
            }
        }
        assert_eq!(read_shard(&dir.path().join("a.bin")).unwrap().len(), 25);
    }

    /// uint32 shards (llm.c's llama3 format) hold ids past 16 bits and serve the same batches.
    #[test]
    fn uint32_shards_hold_large_ids() {
        let dir = tempfile::tempdir().unwrap();
        let toks: Vec<u32> = (0..25).map(|i| 100_000 + i).collect();
        assert!(write_shard(&dir.path().join("x.bin"), &toks).unwrap_err().to_string().contains("uint16"));
        let p = dir.path().join("w.bin");
        write_shard_as(&p, &toks, true).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!((&bytes[..4], bytes.len()), (&SHARD32_MAGIC.to_le_bytes()[..], HEADER_BYTES + 4 * 25));
        assert_eq!(read_shard(&p).unwrap(), toks);
        let mut dl = DataLoader::new(p.to_str().unwrap(), 2, 3, 200_000, false).unwrap();
        dl.next_batch().unwrap();
        dl.next_batch().unwrap();
        assert_eq!(dl.inputs, (100_006..100_012).collect::<Vec<_>>());
        assert_eq!(dl.targets, (100_007..100_013).collect::<Vec<_>>());
        let e = DataLoader::new(p.to_str().unwrap(), 2, 3, 50_000, false).and_then(|mut d| d.next_batch());
        assert!(e.unwrap_err().to_string().contains("out of range"));
    }

    #[test]
    fn shuffled_order_visits_every_sample_once_per_epoch_and_resumes() {
        let dir = tempfile::tempdir().unwrap();
        shard(dir.path(), "s0.bin", &(0..41).collect::<Vec<_>>());
        shard(dir.path(), "s1.bin", &(1000..1033).collect::<Vec<_>>());
        let pat = dir.path().join("s*.bin");
        let mut dl = DataLoader::new(pat.to_str().unwrap(), 1, 4, 5000, true).unwrap();
        assert_eq!((dl.num_shards(), dl.num_tokens), (2, 74));
        let mut firsts = vec![];
        for _ in 0..18 {
            dl.next_batch().unwrap();
            firsts.push(dl.inputs[0]);
        }
        let mut epoch: Vec<u32> = firsts[..18].to_vec();
        epoch.sort();
        // 10 samples from s0 ((41-1)/4) and 8 from s1 ((33-1)/4), each exactly once.
        let want: Vec<u32> = (0..10).map(|i| 4 * i).chain((0..8).map(|i| 1000 + 4 * i)).collect();
        assert_eq!(epoch, want);
        assert_ne!(firsts[..10], want[..10], "the order is shuffled");
        // Save mid-epoch, continue, then restore into a fresh loader: same batches.
        let mut dl = DataLoader::new(pat.to_str().unwrap(), 1, 4, 5000, true).unwrap();
        for _ in 0..7 {
            dl.next_batch().unwrap();
        }
        let st = dl.state();
        let mut a = vec![];
        for _ in 0..25 {
            dl.next_batch().unwrap();
            a.push(dl.inputs.clone());
        }
        let mut dl2 = DataLoader::new(pat.to_str().unwrap(), 1, 4, 5000, true).unwrap();
        dl2.restore(&st).unwrap();
        for x in &a {
            dl2.next_batch().unwrap();
            assert_eq!(&dl2.inputs, x);
        }
    }

    #[test]
    fn bad_shards_give_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = shard(dir.path(), "x.bin", &(0..100).collect::<Vec<_>>());
        let good = std::fs::read(&p).unwrap();
        let err = |bytes: &[u8], b: usize, v: usize| {
            std::fs::write(&p, bytes).unwrap();
            let r = DataLoader::new(p.to_str().unwrap(), b, 4, v, false).and_then(|mut d| d.next_batch());
            format!("{:#}", r.expect_err("must fail"))
        };
        assert!(err(&good[..good.len() - 2], 1, 1000).contains("truncated"));
        assert!(err(&good[..10], 1, 1000).contains("too short"));
        let mut m = good.clone();
        m[0] ^= 1;
        assert!(err(&m, 1, 1000).contains("bad magic"));
        let mut v = good.clone();
        v[4] = 2;
        assert!(err(&v, 1, 1000).contains("version 2"));
        assert!(err(&good, 30, 1000).contains("fewer than one batch"));
        assert!(err(&good, 1, 3).contains("out of range"));
        // A bad id deep in the shard is found when the shard is opened, by position.
        let mut deep: Vec<u32> = (0..100).map(|i| i % 50).collect();
        deep[87] = 77;
        shard(dir.path(), "x.bin", &deep);
        let e = format!("{:#}", DataLoader::new(p.to_str().unwrap(), 1, 4, 50, false).err().unwrap());
        assert!(e.contains("token id 77 at position 87 (of 100)") && e.contains("x.bin"), "{e}");
        let big: Vec<u32> = (0..20).map(|i| if i == 13 { 70_000 } else { i }).collect();
        write_shard_as(&p, &big, true).unwrap();
        let e = format!("{:#}", DataLoader::new(p.to_str().unwrap(), 1, 4, 50_000, false).err().unwrap());
        assert!(e.contains("token id 70000 at position 13"), "{e}");
        DataLoader::new(p.to_str().unwrap(), 1, 4, 70_001, false).unwrap();
        assert!(format!("{:#}", DataLoader::new("/nonexistent/*.bin", 1, 1, 1, false).err().unwrap())
            .contains("no token files"));
    }

    #[test]
    fn processes_split_each_batch_as_llmc() {
        // Two processes with B*T = 6 read the halves of one process's B*T = 12 batches.
        let dir = tempfile::tempdir().unwrap();
        let p = shard(dir.path(), "a.bin", &(0..40).collect::<Vec<_>>());
        let p = p.to_str().unwrap();
        let mut whole = DataLoader::new(p, 2, 6, 100, false).unwrap();
        let mut parts: Vec<_> =
            (0..2).map(|rank| DataLoader::new_split(p, 1, 6, 100, false, Split { rank, world: 2 }).unwrap()).collect();
        for _ in 0..7 {
            whole.next_batch().unwrap();
            for (r, part) in parts.iter_mut().enumerate() {
                part.next_batch().unwrap();
                assert_eq!(part.inputs, whole.inputs[6 * r..6 * r + 6]);
                assert_eq!(part.targets, whole.targets[6 * r..6 * r + 6]);
            }
        }
        assert!(DataLoader::new_split(p, 1, 6, 100, false, Split { rank: 2, world: 2 }).is_err());
        assert!(DataLoader::new_split(p, 4, 6, 100, false, Split { rank: 0, world: 2 }).is_err(), "too few tokens");
        // A batch no data holds is the data's error, before any buffer is made for it (an
        // abort in the allocator, or an overflow, before).
        for (b, t) in [(1 << 32, 7), (usize::MAX, 7), (usize::MAX / 2, 3)] {
            let Err(e) = DataLoader::new_split(p, b, t, 100, false, Split { rank: 0, world: 2 }) else {
                panic!("B={b} T={t} was taken")
            };
            let e = e.to_string();
            assert!(e.contains("fewer than one batch needs"), "B={b} T={t}: {e}");
        }
    }
}
