//! Text generation: a KV-cached inference pass (each new token costs one position's forward),
//! the uncached reference (the whole prefix again every token), and sampling with temperature,
//! top-k and top-p.

use crate::cpu::attention::attention_forward_cached;
use crate::cpu::gelu::gelu_forward;
use crate::cpu::layernorm::layernorm_forward;
use crate::cpu::matmul::matmul_forward;
use crate::model::GPT2;
use crate::rng::random_f32;
use anyhow::{bail, Result};

/// Positions processed together when a prompt is fed into the cache.
const PREFILL_CHUNK: usize = 256;

/// Keys and values of every layer for one sequence, plus the inference pass's workspace.
pub struct KvCache {
    k: Vec<f32>, // (L, maxT, C)
    v: Vec<f32>, // (L, maxT, C)
    /// Positions already in the cache.
    pub pos: usize,
    x: Vec<f32>,          // (CH, C) residual stream of the chunk
    ln: Vec<f32>,         // (CH, C)
    mean: Vec<f32>,       // (CH)
    rstd: Vec<f32>,       // (CH)
    qkv: Vec<f32>,        // (CH, 3*C)
    atty: Vec<f32>,       // (CH, C)
    scores: Vec<f32>,     // (NH, CH, maxT)
    head_out: Vec<f32>,   // (NH, CH, HS)
    fch: Vec<f32>,        // (CH, 4*C)
    fch_gelu: Vec<f32>,   // (CH, 4*C)
    proj: Vec<f32>,       // (CH, C)
    pub logits: Vec<f32>, // (Vp) of the last position fed
}

impl KvCache {
    pub fn new(model: &GPT2) -> Self {
        let cfg = model.config;
        let (c, l, t, nh, ch) = (cfg.channels, cfg.num_layers, cfg.max_seq_len, cfg.num_heads, PREFILL_CHUNK);
        let z = |n: usize| vec![0f32; n];
        KvCache {
            k: z(l * t * c),
            v: z(l * t * c),
            pos: 0,
            x: z(ch * c),
            ln: z(ch * c),
            mean: z(ch),
            rstd: z(ch),
            qkv: z(ch * 3 * c),
            atty: z(ch * c),
            scores: z(ch * nh * t),
            head_out: z(ch * c),
            fch: z(ch * 4 * c),
            fch_gelu: z(ch * 4 * c),
            proj: z(ch * c),
            logits: z(cfg.padded_vocab_size),
        }
    }
}

fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

impl GPT2 {
    /// Feed `tokens` after the cached positions; leaves the last position's logits in
    /// `cache.logits` and returns the first V of them.
    pub fn forward_cached<'a>(&self, cache: &'a mut KvCache, tokens: &[u32]) -> Result<&'a [f32]> {
        let cfg = self.config;
        let (c, nh, v, vp, max_t) =
            (cfg.channels, cfg.num_heads, cfg.vocab_size, cfg.padded_vocab_size, cfg.max_seq_len);
        if tokens.is_empty() {
            bail!("nothing to feed");
        }
        if cache.pos + tokens.len() > max_t {
            bail!("the sequence would exceed the model's context of {max_t} tokens");
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= v) {
            bail!("token id {bad} is out of range for vocab size {v}");
        }
        let (p, lay) = (&self.params, &self.layout);
        let (wte, wpe) = (lay.wte.of(p), lay.wpe.of(p));
        for chunk in tokens.chunks(PREFILL_CHUNK) {
            let (tn, pos) = (chunk.len(), cache.pos);
            let k = &mut *cache;
            for (i, &tok) in chunk.iter().enumerate() {
                let (t, at) = (tok as usize, pos + i);
                for j in 0..c {
                    k.x[i * c + j] = wte[t * c + j] + wpe[at * c + j];
                }
            }
            for (l, w) in lay.blocks.iter().enumerate() {
                let x = &mut k.x[..tn * c];
                layernorm_forward(&mut k.ln, &mut k.mean, &mut k.rstd, x, w.ln1_w.of(p), w.ln1_b.of(p), tn, c);
                matmul_forward(&mut k.qkv, &k.ln, w.qkv_w.of(p), Some(w.qkv_b.of(p)), tn, c, 3 * c);
                let base = l * max_t * c;
                for i in 0..tn {
                    let row = &k.qkv[i * 3 * c..(i + 1) * 3 * c];
                    let at = base + (pos + i) * c;
                    k.k[at..at + c].copy_from_slice(&row[c..2 * c]);
                    k.v[at..at + c].copy_from_slice(&row[2 * c..]);
                }
                let (kc, vc) = (&k.k[base..base + max_t * c], &k.v[base..base + max_t * c]);
                attention_forward_cached(
                    &mut k.atty,
                    &mut k.scores,
                    &mut k.head_out,
                    &k.qkv,
                    kc,
                    vc,
                    pos,
                    tn,
                    c,
                    nh,
                    max_t,
                );
                matmul_forward(&mut k.proj, &k.atty, w.attn_proj_w.of(p), Some(w.attn_proj_b.of(p)), tn, c, c);
                add_inplace(x, &k.proj[..tn * c]);
                layernorm_forward(&mut k.ln, &mut k.mean, &mut k.rstd, x, w.ln2_w.of(p), w.ln2_b.of(p), tn, c);
                matmul_forward(&mut k.fch, &k.ln, w.fc_w.of(p), Some(w.fc_b.of(p)), tn, c, 4 * c);
                gelu_forward(&mut k.fch_gelu[..tn * 4 * c], &k.fch[..tn * 4 * c]);
                matmul_forward(&mut k.proj, &k.fch_gelu, w.fc_proj_w.of(p), Some(w.fc_proj_b.of(p)), tn, 4 * c, c);
                add_inplace(x, &k.proj[..tn * c]);
            }
            cache.pos += tn;
            // Only the last position's logits are needed.
            let last = &cache.x[(tn - 1) * c..tn * c];
            let (lnf_w, lnf_b) = (lay.lnf_w.of(p), lay.lnf_b.of(p));
            layernorm_forward(&mut cache.ln, &mut cache.mean, &mut cache.rstd, last, lnf_w, lnf_b, 1, c);
            matmul_forward(&mut cache.logits, &cache.ln, wte, None, 1, c, vp);
        }
        Ok(&cache.logits[..v])
    }
}

/// How to pick the next token from the logits.
#[derive(Clone, Copy, Debug)]
pub struct SamplerConfig {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1 = all).
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 1337 }
    }
}

/// Sample a token id from `logits (V)`; `rng` is llm.c's xorshift state. `scratch` is reused.
pub fn sample(logits: &[f32], s: &SamplerConfig, rng: &mut u64, scratch: &mut Vec<(f32, u32)>) -> u32 {
    if s.temperature <= 0.0 {
        let mut best = 0;
        for (i, &x) in logits.iter().enumerate() {
            if x > logits[best] {
                best = i;
            }
        }
        return best as u32;
    }
    let maxv = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    scratch.clear();
    scratch.extend(logits.iter().enumerate().map(|(i, &x)| (((x - maxv) / s.temperature).exp(), i as u32)));
    let filtering = (s.top_k > 0 && s.top_k < scratch.len()) || s.top_p < 1.0;
    if filtering {
        // Most likely first; ties broken by id so the order is deterministic.
        scratch.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        if s.top_k > 0 {
            scratch.truncate(s.top_k);
        }
        if s.top_p < 1.0 {
            let total: f64 = scratch.iter().map(|x| x.0 as f64).sum();
            let (mut acc, mut keep) = (0f64, scratch.len());
            for (i, x) in scratch.iter().enumerate() {
                acc += x.0 as f64 / total;
                if acc >= s.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            scratch.truncate(keep.max(1));
        }
    }
    let total: f64 = scratch.iter().map(|x| x.0 as f64).sum();
    let coin = random_f32(rng) as f64 * total;
    let mut cdf = 0f64;
    for &(p, id) in scratch.iter() {
        cdf += p as f64;
        if coin < cdf {
            return id;
        }
    }
    scratch.last().map_or(0, |x| x.1)
}

/// Generation settings.
#[derive(Clone, Copy, Debug)]
pub struct GenConfig {
    pub max_new_tokens: usize,
    pub sampler: SamplerConfig,
    /// Stop after emitting `<|endoftext|>` (this id).
    pub stop_token: Option<u32>,
    /// Use the KV cache (else recompute the whole prefix for every token).
    pub use_cache: bool,
}

/// Generate after `prompt`, calling `on_token` for every new token; returns the new tokens.
/// Stops at `max_new_tokens`, the stop token, or the model's context length.
pub fn generate(
    model: &mut GPT2,
    prompt: &[u32],
    g: &GenConfig,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        bail!("the prompt is empty (an empty text prompt starts from <|endoftext|>)");
    }
    let (v, vp, max_t) = (model.config.vocab_size, model.config.padded_vocab_size, model.config.max_seq_len);
    if prompt.len() >= max_t {
        bail!("the prompt has {} tokens; the model's context is {max_t}", prompt.len());
    }
    let mut rng = g.sampler.seed.max(1); // xorshift needs a non-zero state
    let mut scratch = Vec::with_capacity(v);
    let mut toks = prompt.to_vec();
    let mut out = vec![];
    let mut cache = g.use_cache.then(|| KvCache::new(model));
    let mut feed: Vec<u32> = prompt.to_vec();
    while out.len() < g.max_new_tokens && toks.len() < max_t {
        let logits: &[f32] = match &mut cache {
            Some(c) => model.forward_cached(c, &feed)?,
            None => {
                let t = toks.len();
                model.forward(&toks, None, 1, t)?;
                &model.acts.logits[(t - 1) * vp..(t - 1) * vp + v]
            }
        };
        let next = sample(logits, &g.sampler, &mut rng, &mut scratch);
        toks.push(next);
        out.push(next);
        on_token(next)?;
        if Some(next) == g.stop_token {
            break;
        }
        feed.clear();
        feed.push(next);
    }
    Ok(out)
}

/// Turns a stream of token byte strings into UTF-8 text, holding back an incomplete character
/// until its remaining bytes arrive.
#[derive(Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(), // incomplete at the end: wait
            Err(_) => {
                // Truly invalid bytes: emit them replaced.
                let s = String::from_utf8_lossy(&self.pending).into_owned();
                self.pending.clear();
                return s;
            }
        };
        let s = String::from_utf8(self.pending[..valid].to_vec()).unwrap_or_default();
        self.pending.drain(..valid);
        s
    }
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GPT2Config;

    fn model() -> GPT2 {
        let cfg = GPT2Config {
            vocab_size: 101,
            padded_vocab_size: 128,
            ..GPT2Config::from_descriptor("2x24:3:600").unwrap()
        };
        GPT2::random(cfg, 11).unwrap()
    }

    #[test]
    fn cached_logits_match_the_full_forward_pass() {
        let mut m = model();
        // 530 tokens: more than two prefill chunks, then single tokens.
        let toks: Vec<u32> = (0..540).map(|i| (i * 37 % 101) as u32).collect();
        let mut cache = KvCache::new(&m);
        let mut cached = vec![];
        cached.push(m.forward_cached(&mut cache, &toks[..530]).unwrap().to_vec());
        for &t in &toks[530..] {
            cached.push(m.forward_cached(&mut cache, &[t]).unwrap().to_vec());
        }
        m.forward(&toks, None, 1, toks.len()).unwrap();
        let vp = 128;
        for (j, pos) in (529..540).enumerate() {
            let full = &m.acts.logits[pos * vp..pos * vp + 101];
            for (a, b) in cached[j].iter().zip(full) {
                assert!((a - b).abs() < 1e-5 * b.abs().max(1.0), "pos {pos}: {a} vs {b}");
            }
        }
        assert!(m.forward_cached(&mut cache, &[1; 61]).is_err(), "past the context");
    }

    #[test]
    fn cached_and_uncached_greedy_generation_agree() {
        let mut m = model();
        let g = GenConfig {
            max_new_tokens: 40,
            sampler: SamplerConfig { temperature: 0.0, ..Default::default() },
            stop_token: None,
            use_cache: true,
        };
        let prompt = [5u32, 17, 99, 3];
        let a = generate(&mut m, &prompt, &g, |_| Ok(())).unwrap();
        let b = generate(&mut m, &prompt, &GenConfig { use_cache: false, ..g }, |_| Ok(())).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.len(), 40);
        // Sampling: the same seed gives the same tokens, another seed other tokens.
        let s = GenConfig { sampler: SamplerConfig { temperature: 1.0, top_k: 50, top_p: 0.95, seed: 7 }, ..g };
        let x = generate(&mut m, &prompt, &s, |_| Ok(())).unwrap();
        assert_eq!(x, generate(&mut m, &prompt, &s, |_| Ok(())).unwrap());
        let y =
            generate(&mut m, &prompt, &GenConfig { sampler: SamplerConfig { seed: 8, ..s.sampler }, ..s }, |_| Ok(()))
                .unwrap();
        assert_ne!(x, y);
        // Stops at the stop token.
        let first = a[0];
        let stopped = generate(&mut m, &prompt, &GenConfig { stop_token: Some(first), ..g }, |_| Ok(())).unwrap();
        assert_eq!(stopped, vec![first]);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_choice() {
        let logits = [0.0f32, 3.0, 2.9, -1.0, 1.0];
        let mut rng = 42u64;
        let mut scratch = vec![];
        let s = SamplerConfig { temperature: 1.0, top_k: 2, top_p: 1.0, seed: 0 };
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..200 {
            seen.insert(sample(&logits, &s, &mut rng, &mut scratch));
        }
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![1, 2]);
        let s = SamplerConfig { top_k: 0, top_p: 0.3, ..s }; // token 1 alone has p ~ 0.46
        for _ in 0..50 {
            assert_eq!(sample(&logits, &s, &mut rng, &mut scratch), 1);
        }
        let g = SamplerConfig { temperature: 0.0, ..s };
        assert_eq!(sample(&logits, &g, &mut rng, &mut scratch), 1);
    }

    #[test]
    fn utf8_stream_holds_back_partial_characters() {
        let mut u = Utf8Stream::default();
        let crab = "🦀".as_bytes();
        assert_eq!(u.push(&crab[..2]), "");
        assert_eq!(u.push(&crab[2..]), "🦀");
        assert_eq!(u.push(b"ok"), "ok");
        assert_eq!(u.push(&[0xe2, 0x82]), "");
        assert_eq!(u.finish(), "\u{fffd}");
    }
}
