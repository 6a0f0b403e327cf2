//! Device memory: logical allocations made of chunks, and the windows kernels bind.
//!
//! A [`Buf`] addresses elements of one logical allocation, densely, exactly as on the CPU. On
//! the device an allocation is one or more `wgpu::Buffer` chunks, because a driver caps both
//! a buffer (wgpu: 2 GiB on many) and what one binding may see (lavapipe: 128 MiB, while GPT-2
//! 124M's wte alone is 154 MB). The model names the tensors of an allocation when it makes it
//! ([`crate::backend::Backend::alloc_parts`]) and chunks break only between them, so no tensor
//! straddles two buffers. Chunks hold up to one binding's worth; a tensor larger than that gets
//! a chunk of its own and is bound through windows: aligned ranges of at most the binding
//! limit, with the element offset passed to the kernel. Ops split their work so that each
//! dispatch's operands fit their windows ([`Memory::fit`]).

use super::kernel::{Entry, In16, Module, Out16, F, K};
use crate::backend::{Buf, DType};
use anyhow::{bail, Result};
use std::ops::Range;

/// One device buffer: elements start..start+len of its allocation.
pub struct Chunk {
    /// Unique over the backend's life (bind groups are cached by it).
    pub id: u64,
    pub buf: wgpu::Buffer,
    pub start: usize,
    pub len: usize,
}

pub struct Alloc {
    pub dtype: DType,
    pub len: usize,
    /// In order, tiling 0..len.
    pub chunks: Vec<Chunk>,
}

/// A binding: bytes byte_off..byte_off+byte_len of a chunk, and where an operand starts in it.
#[derive(Clone, Debug)]
pub struct Win {
    pub chunk: u64,
    pub buf: wgpu::Buffer,
    pub byte_off: u64,
    pub byte_len: u64,
    /// The operand's first element, counted from the window's start.
    pub off: u32,
    /// The operand's element type (the dummy's is F32).
    pub dtype: DType,
}

/// How memory is laid out, from the adapter's limits (smaller in tests, to put tensors at
/// chunk boundaries and make ops split their work on tiny shapes).
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    /// Largest chunk that holds several tensors.
    pub chunk_bytes: u64,
    /// Largest binding.
    pub max_binding: u64,
    /// Largest buffer (a tensor larger than this does not fit).
    pub max_buffer: u64,
    /// Binding offsets are multiples of this.
    pub align: u64,
}

pub struct Memory {
    allocs: Vec<Option<Alloc>>,
    next_chunk: u64,
    pub sizes: Sizes,
    /// Bytes held now.
    pub held: u64,
    /// Refuse allocations past this many bytes (tests of the out-of-memory path).
    pub limit: Option<u64>,
    /// For a buffer too small to matter: bound where an op has no operand.
    pub dummy: Win,
}

/// Bytes per element: f32 and u32 take 4, bf16 2 (two to a 32-bit word, the first in the low
/// half: WGSL has no 16-bit storage type, so kernels read bf16 as `array<u32>`).
fn elem(dtype: DType) -> u64 {
    dtype.bytes() as u64
}

impl Memory {
    pub fn new(device: &wgpu::Device, sizes: Sizes, limit: Option<u64>) -> Self {
        let buf = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("dummy"),
            size: 256,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let dummy = Win { chunk: 0, buf, byte_off: 0, byte_len: 256, off: 0, dtype: DType::F32 };
        Memory { allocs: vec![], next_chunk: 1, sizes, held: 0, limit, dummy }
    }

    /// A new allocation of the given parts, each of which stays in one chunk.
    pub fn alloc(&mut self, ctx: &super::context::Context, parts: &[usize], dtype: DType) -> Result<Buf> {
        let len = parts.iter().try_fold(0usize, |a, &p| a.checked_add(p));
        let Some(len) = len else { bail!("an allocation of more than usize::MAX elements") };
        let groups = self.group(ctx, parts, dtype)?;
        let total: u64 = groups.iter().map(|g| chunk_bytes(g.len(), dtype)).sum();
        if self.limit.is_some_and(|limit| self.held + total > limit) {
            bail!(out_of_memory(&ctx.name(), total, self.held, "the limit set for this run"));
        }
        let scope = ctx.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let chunks: Vec<Chunk> = groups
            .into_iter()
            .map(|g| {
                let id = self.next_chunk;
                self.next_chunk += 1;
                let buf = ctx.device.create_buffer(&wgpu::BufferDescriptor {
                    label: None,
                    size: chunk_bytes(g.len(), dtype),
                    usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                Chunk { id, buf, start: g.start, len: g.len() }
            })
            .collect();
        if let Some(e) = pollster::block_on(scope.pop()) {
            bail!(out_of_memory(&ctx.name(), total, self.held, &super::context::one_line(&e.to_string())));
        }
        self.held += total;
        let id = u32::try_from(self.allocs.len()).ok().filter(|&i| i != u32::MAX);
        let Some(alloc) = id else { bail!("too many allocations") };
        self.allocs.push(Some(Alloc { dtype, len, chunks }));
        Ok(Buf { alloc, off: 0, len, dtype })
    }

    /// The element ranges of an allocation's chunks: consecutive parts together up to the
    /// chunk size, a larger part alone.
    fn group(&self, ctx: &super::context::Context, parts: &[usize], dtype: DType) -> Result<Vec<Range<usize>>> {
        let s = self.sizes;
        let eb = elem(dtype);
        let mut groups = vec![];
        let (mut start, mut cur) = (0usize, 0usize);
        for &p in parts {
            let bytes = p as u64 * eb;
            if bytes > s.max_buffer {
                bail!(
                    "a tensor of {:.1} MB does not fit in one buffer of {} (at most {:.1} MB): lower the batch \
                     size (-b) or sequence length (-t), or run on the CPU with --device cpu",
                    bytes as f64 / 1e6,
                    ctx.name(),
                    s.max_buffer as f64 / 1e6
                );
            }
            if cur > 0 && (cur + p) as u64 * eb > s.chunk_bytes {
                groups.push(start..start + cur);
                start += cur;
                cur = 0;
            }
            cur += p;
        }
        if cur > 0 {
            groups.push(start..start + cur);
        }
        Ok(groups)
    }

    pub fn free(&mut self, b: Buf) {
        if let Some(slot) = self.allocs.get_mut(b.alloc as usize) {
            if let Some(a) = slot.take() {
                self.held -= a.chunks.iter().map(|c| chunk_bytes(c.len, a.dtype)).sum::<u64>();
            }
        }
    }

    fn alloc_of(&self, b: Buf) -> &Alloc {
        match self.allocs.get(b.alloc as usize).and_then(Option::as_ref) {
            Some(a) if a.dtype == b.dtype && b.off + b.len <= a.len => a,
            Some(_) => panic!("buffer {b:?} is not a range of its allocation"),
            None => panic!("buffer {b:?} is not an allocation of this backend (freed, or from another one)"),
        }
    }

    /// The chunk holding element `at` of b's allocation.
    fn chunk_at(&self, b: Buf, at: usize) -> &Chunk {
        let a = self.alloc_of(b);
        let i = a.chunks.partition_point(|c| c.start + c.len <= at);
        &a.chunks[i]
    }

    /// The window an operand starting at element `at` of its allocation is bound through: the
    /// whole chunk when a binding may see it all, else the largest aligned range from just
    /// before `at`.
    fn window_at(&self, b: Buf, at: usize) -> (Win, usize) {
        let c = self.chunk_at(b, at);
        let s = self.sizes;
        let eb = elem(b.dtype);
        let bytes = chunk_bytes(c.len, b.dtype);
        // Windows start at a multiple of the alignment (a whole number of 32-bit words, so a
        // bf16 element keeps its half of a word) and end at a whole word.
        let (byte_off, byte_len) = if bytes <= s.max_binding {
            (0, bytes)
        } else {
            let rel = (at - c.start) as u64 * eb;
            let off = rel / s.align * s.align;
            (off, (bytes - off).min(s.max_binding / 4 * 4))
        };
        let first = c.start + (byte_off / eb) as usize; // the window's first element
        let end = first + (byte_len / eb) as usize; // one past its last
        let win = Win { chunk: c.id, buf: c.buf.clone(), byte_off, byte_len, off: (at - first) as u32, dtype: b.dtype };
        (win, end.min(c.start + c.len))
    }

    /// How many elements from `from` on of b fit in one window with b's element `from`.
    pub fn fit(&self, b: Buf, from: usize) -> usize {
        if from >= b.len {
            return 0;
        }
        let (_, end) = self.window_at(b, b.off + from);
        (end - (b.off + from)).min(b.len - from)
    }

    /// The window b is bound through. b must fit one (see [`Memory::fit`]); an empty b binds
    /// the dummy buffer.
    pub fn win(&self, b: Buf) -> Win {
        if b.len == 0 {
            return self.dummy.clone();
        }
        let (w, end) = self.window_at(b, b.off);
        assert!(b.off + b.len <= end, "GPU buffer {b:?} does not fit one binding window: the op must split its work");
        w
    }

    /// The pieces of 0..n such that every buf's elements of a piece fit one window (bufs are
    /// indexed alike, e.g. the operands of an elementwise op).
    pub fn pieces(&self, bufs: &[Buf], n: usize) -> Vec<Range<usize>> {
        self.row_pieces(n, &bufs.iter().map(|&b| (b, 1)).collect::<Vec<_>>())
    }

    /// The pieces of rows 0..rows such that, for every (buf, row_len), its rows of a piece fit
    /// one window. Every single row must fit one (a tensor's rows are far smaller than a
    /// binding).
    pub fn row_pieces(&self, rows: usize, bufs: &[(Buf, usize)]) -> Vec<Range<usize>> {
        let mut out = vec![];
        let mut r = 0;
        while r < rows {
            let mut take = rows - r;
            // Rows of no elements (a zero dimension) fit anywhere.
            for &(b, rl) in bufs.iter().filter(|x| x.1 > 0) {
                take = take.min(self.fit(b, r * rl) / rl);
            }
            assert!(take > 0, "a row of a GPU tensor does not fit one binding window");
            out.push(r..r + take);
            r += take;
        }
        out
    }

    /// The pieces of planes 0..planes (`inner` per batch: attention's heads), of at most `most`
    /// planes, such that every per-plane (buf, len)'s planes of a piece fit one window, and
    /// every per-batch (buf, len)'s batches that the piece touches fit one window. None when a
    /// single plane does not fit.
    pub fn plane_pieces(
        &self,
        planes: usize,
        inner: usize,
        most: usize,
        per_plane: &[(Buf, usize)],
        per_batch: &[(Buf, usize)],
    ) -> Option<Vec<Range<usize>>> {
        let mut out = vec![];
        let mut z = 0;
        while z < planes {
            let mut take = (planes - z).min(most);
            for &(b, len) in per_plane {
                take = take.min(self.fit(b, z * len) / len);
            }
            let first = z / inner;
            for &(b, len) in per_batch {
                let batches = self.fit(b, first * len) / len;
                take = take.min((batches * inner).saturating_sub(z - first * inner));
            }
            if take == 0 {
                return None;
            }
            out.push(z..z + take);
            z += take;
        }
        Some(out)
    }

    /// Each chunk's part of elements range of b: (chunk buffer, byte offset, elements range of
    /// b), for copies to and from the host.
    pub fn spans(&self, b: Buf) -> Vec<(wgpu::Buffer, u64, Range<usize>)> {
        let mut out = vec![];
        let mut at = b.off;
        while at < b.off + b.len {
            let c = self.chunk_at(b, at);
            let end = (c.start + c.len).min(b.off + b.len);
            out.push((c.buf.clone(), (at - c.start) as u64 * elem(b.dtype), at - b.off..end - b.off));
            at = end;
        }
        out
    }
}

/// The one message for memory the device cannot give: how much, and what to do.
pub fn out_of_memory(adapter: &str, needed: u64, held: u64, detail: &str) -> String {
    format!(
        "out of GPU memory on {adapter}: {:.1} MB more needed with {:.1} MB in use ({detail}): lower the batch \
         size (-b) or sequence length (-t), or run on the CPU with --device cpu",
        needed as f64 / 1e6,
        held as f64 / 1e6
    )
}

/// Bytes of a chunk of `len` elements (wgpu buffers are multiples of 4 bytes and not empty).
fn chunk_bytes(len: usize, dtype: DType) -> u64 {
    (len as u64 * elem(dtype)).div_ceil(4).max(1) * 4
}

// ---- kernels -------------------------------------------------------------------------------------

/// Filling, copying and summing the columns of f32 buffers (kernels/memory.wgsl).
pub(super) const MODULE: Module = Module {
    name: "memory",
    src: include_str!("kernels/memory.wgsl"),
    buffers: &[("x", F), ("y", F)],
    entries: &[
        Entry { name: "fill", bindings: 1, u32s: 0, bf16s: 0, variants: &[] },
        Entry { name: "copy_rows", bindings: 2, u32s: 0, bf16s: 0, variants: &[&[Out16, In16]] },
        Entry { name: "column_sums", bindings: 2, u32s: 0, bf16s: 0, variants: &[] },
    ],
    subgroup: None,
};
pub(super) const FILL: K = K::of(&MODULE, 0);
pub(super) const COPY_ROWS: K = K::of(&MODULE, 1);
pub(super) const COLUMN_SUMS: K = K::of(&MODULE, 2);
