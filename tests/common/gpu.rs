//! Helpers of the GPU tests: opening an adapter (or skipping loudly), and running one op on
//! the GPU and the CPU backends side by side.

use llmrs::backend::cpu::backend::CpuBackend;
use llmrs::backend::gpu::{GpuBackend, Options};
use llmrs::backend::{Backend, Buf, DType};

/// Set to 1 where a GPU adapter must exist (CI, with lavapipe): a missing one fails the test
/// instead of skipping it.
pub const REQUIRE_ENV: &str = "LLMRS_REQUIRE_GPU";

fn required() -> bool {
    std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1")
}

/// The GPU backend, or None after a loud SKIPPED line when there is no adapter (a failure
/// under LLMRS_REQUIRE_GPU=1).
pub fn backend(test: &str, opts: Options) -> Option<GpuBackend> {
    match GpuBackend::open(opts) {
        Ok(b) => Some(b),
        Err(e) if required() => panic!("{test}: {REQUIRE_ENV}=1 but no usable GPU adapter: {e:#}"),
        Err(e) => {
            llmrs::testdata::skipped(
                test,
                &format!("no usable GPU adapter ({e:#}); {REQUIRE_ENV}=1 makes this a failure"),
            );
            None
        }
    }
}

/// Whether a GPU adapter is there (printing SKIPPED for `test` when not).
pub fn available(test: &str) -> bool {
    backend(test, Options::default()).is_some()
}

/// The same buffers on the CPU backend (the reference) and on the GPU.
pub struct Pair {
    pub cpu: CpuBackend,
    pub gpu: GpuBackend,
    what: String,
    rng: u64,
    /// The dtype of the tensors [`Pair::parts`] makes (f32, or bf16 for the bf16 paths).
    dtype: DType,
}

/// n values in [-1, 1) from an xorshift generator whose state is `state` (advanced).
pub fn random_values(state: &mut u64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            ((*state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// A buffer on both backends.
pub type Two = (Buf, Buf);

impl Pair {
    pub fn new(gpu: GpuBackend, what: &str) -> Self {
        Self::with_dtype(gpu, what, DType::F32)
    }

    /// A pair whose tensors are `dtype` (bf16: every op runs on bf16 buffers on both backends).
    pub fn with_dtype(gpu: GpuBackend, what: &str, dtype: DType) -> Self {
        let what = format!("{what}, {dtype:?}");
        Pair { cpu: CpuBackend::new(false), gpu, what, rng: 0x9E37_79B9_7F4A_7C15, dtype }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    fn random(&mut self, n: usize) -> Vec<f32> {
        random_values(&mut self.rng, n)
    }

    /// Tensors of these lengths in the pair's dtype, as the parts of one allocation on each
    /// backend (on the GPU they may sit in different chunks, and bf16 ones start and end in
    /// the middle of 32-bit words), filled with the same random values in [-1, 1) (rounded
    /// alike to bf16).
    pub fn parts<const K: usize>(&mut self, lens: [usize; K]) -> [Two; K] {
        let c = self.cpu.alloc_parts(&lens, self.dtype).unwrap();
        let g = self.gpu.alloc_parts(&lens, self.dtype).unwrap();
        let data = self.random(c.len);
        self.cpu.upload(c, &data);
        self.gpu.upload(g, &data);
        let mut off = 0;
        lens.map(|n| {
            off += n;
            (c.slice(off - n..off), g.slice(off - n..off))
        })
    }

    /// Token ids on both.
    pub fn tokens(&mut self, ids: &[u32]) -> Two {
        let c = self.cpu.alloc(ids.len(), DType::U32).unwrap();
        let g = self.gpu.alloc(ids.len(), DType::U32).unwrap();
        self.cpu.upload_u32(c, ids);
        self.gpu.upload_u32(g, ids);
        (c, g)
    }

    /// Fill x with NaN on both, so that an element an op leaves unwritten shows.
    pub fn poison(&mut self, x: Two) {
        self.cpu.fill(x.0, f32::NAN);
        self.gpu.fill(x.1, f32::NAN);
    }

    /// x = f(x) on both (from the CPU's values).
    pub fn map(&mut self, x: Two, f: impl Fn(f32) -> f32) {
        let mut h = vec![0f32; x.0.len];
        self.cpu.download(x.0, &mut h).unwrap();
        h.iter_mut().for_each(|v| *v = f(*v));
        self.cpu.upload(x.0, &h);
        self.gpu.upload(x.1, &h);
    }

    pub fn scale(&mut self, x: Two, s: f32) {
        self.map(x, |v| v * s);
    }

    /// Run the same op on both backends.
    pub fn both<const N: usize>(&mut self, f: impl Fn(&mut dyn Backend, [Buf; N]), bufs: [Two; N]) {
        f(&mut self.cpu, bufs.map(|b| b.0));
        f(&mut self.gpu, bufs.map(|b| b.1));
    }

    /// [`Pair::both`] with token buffers too.
    pub fn both_t<const N: usize, const M: usize>(
        &mut self,
        f: impl Fn(&mut dyn Backend, [Buf; N], [Buf; M]),
        bufs: [Two; N],
        toks: [Two; M],
    ) {
        f(&mut self.cpu, bufs.map(|b| b.0), toks.map(|b| b.0));
        f(&mut self.gpu, bufs.map(|b| b.1), toks.map(|b| b.1));
    }

    /// Whether this pair runs with tiny memory sizes.
    pub fn tiny(&self) -> bool {
        self.what.contains("tiny")
    }

    pub fn read_gpu(&mut self, x: Two) -> Vec<f32> {
        let mut g = vec![0f32; x.1.len];
        self.gpu.download(x.1, &mut g).unwrap();
        g
    }

    /// |gpu - cpu| <= atol + rtol * |cpu| everywhere, atol = rtol of the largest |cpu| (with
    /// rtol 0: the same bits); a NaN on either side fails. In a bf16 pair each side rounds its
    /// f32 result once, so two results within that tolerance may still round a bf16 step
    /// apart: one more step (at most 2^-7 of the larger magnitude) is allowed. The GPU then
    /// takes the CPU's values, so that the ops reading them next (a backward after its
    /// forward) start from the same inputs instead of from results a step apart.
    pub fn check(&mut self, x: Two, rtol: f32, what: &str) {
        self.check_prefix(x, x.0.len, rtol, what)
    }

    /// The largest |gpu - cpu| / (rtol-style scale), for diagnostics.
    pub fn ratio(&mut self, x: Two) -> f32 {
        let n = x.0.len;
        let (mut c, mut g) = (vec![0f32; n], vec![0f32; n]);
        self.cpu.download(x.0, &mut c).unwrap();
        self.gpu.download(x.1, &mut g).unwrap();
        let scale = c.iter().fold(0f32, |m, v| m.max(v.abs()));
        g.iter().zip(&c).map(|(a, b)| (a - b).abs() / (scale + b.abs())).fold(0f32, |m, v| {
            if v.is_nan() || m.is_nan() {
                f32::NAN
            } else {
                m.max(v)
            }
        })
    }

    pub fn check_prefix(&mut self, x: Two, n: usize, rtol: f32, what: &str) {
        let (mut c, mut g) = (vec![0f32; n], vec![0f32; n]);
        self.cpu.download(x.0.prefix(n), &mut c).unwrap();
        self.gpu.download(x.1.prefix(n), &mut g).unwrap();
        let scale = c.iter().fold(0f32, |m, v| m.max(v.abs()));
        let atol = rtol * scale;
        let step = if self.dtype == DType::BF16 { 1.0 / 128.0 } else { 0.0 };
        for (i, (a, b)) in g.iter().zip(&c).enumerate() {
            let ok = if rtol == 0.0 {
                a.to_bits() == b.to_bits()
            } else {
                (a - b).abs() <= atol + rtol * b.abs() + step * a.abs().max(b.abs())
            };
            assert!(ok, "{} ({}): element {i} of {n}: gpu {a} vs cpu {b}", what, self.what);
        }
        if self.dtype == DType::BF16 && x.1.dtype == DType::BF16 {
            self.gpu.upload(x.1.prefix(n), &c);
        }
    }
}
