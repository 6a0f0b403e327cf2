//! Text generation: a KV-cached inference pass (each new token costs one position's forward),
//! the uncached reference (the whole prefix again every token), and sampling with temperature,
//! top-k and top-p.

use crate::core::rng::random_f32;
use crate::model::Model;
use anyhow::{bail, Result};

/// Positions fed together when a prompt goes into the KV cache.
pub const PREFILL_CHUNK: usize = 256;

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

impl SamplerConfig {
    /// Refuse settings that have no meaning (a NaN temperature would sample garbage silently).
    pub fn validate(&self) -> Result<()> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            bail!("--temperature {t}: must be a finite number >= 0 (0 = greedy)");
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            bail!("--top-p {p}: must be in (0, 1] (1 = all tokens)");
        }
        Ok(())
    }
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
#[derive(Clone, Debug)]
pub struct GenConfig {
    pub max_new_tokens: usize,
    pub sampler: SamplerConfig,
    /// Stop after emitting any of these (the model's end tokens, e.g. `<|endoftext|>`, or
    /// Llama 3 Instruct's `<|eot_id|>`); none: never stop early.
    pub stop_tokens: Vec<u32>,
    /// Use the KV cache (else recompute the whole prefix for every token).
    pub use_cache: bool,
}

/// Refuse a prompt of `n` tokens that leaves no room in a context of `max_t` positions (or
/// is empty): checked before anything is printed or computed.
pub fn check_prompt(n: usize, max_t: usize) -> Result<()> {
    if n == 0 {
        bail!("the prompt is empty (an empty text prompt starts from <|endoftext|>)");
    }
    if n >= max_t {
        bail!(
            "the prompt has {n} tokens; the model's context is {max_t} positions: shorten it to at most {} tokens",
            max_t.saturating_sub(1)
        );
    }
    Ok(())
}

/// Generate after `prompt`, calling `on_token` for every new token; returns the new tokens.
/// Stops at `max_new_tokens`, a stop token, or the model's context length.
pub fn generate(
    model: &mut Model,
    prompt: &[u32],
    g: &GenConfig,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    g.sampler.validate()?;
    let max_t = model.config.max_seq_len;
    check_prompt(prompt.len(), max_t)?;
    let mut rng = g.sampler.seed.max(1); // xorshift needs a non-zero state
    let mut scratch = Vec::with_capacity(model.config.vocab_size);
    let mut toks = prompt.to_vec();
    let mut out = vec![];
    let positions = prompt.len().saturating_add(g.max_new_tokens).min(max_t);
    let mut cache = if g.use_cache { Some(model.kv_cache(positions, PREFILL_CHUNK)?) } else { None };
    let mut feed: Vec<u32> = prompt.to_vec();
    let mut run = || -> Result<()> {
        while out.len() < g.max_new_tokens && toks.len() < max_t {
            let next = match &mut cache {
                Some(c) => sample(model.forward_cached(c, &feed)?, &g.sampler, &mut rng, &mut scratch),
                None => {
                    model.forward(&toks, None, 1, toks.len())?;
                    sample(&model.logits_at(toks.len() - 1)?, &g.sampler, &mut rng, &mut scratch)
                }
            };
            toks.push(next);
            out.push(next);
            on_token(next)?;
            if g.stop_tokens.contains(&next) {
                break;
            }
            feed.clear();
            feed.push(next);
        }
        Ok(())
    };
    let r = run();
    if let Some(c) = cache {
        model.free_kv_cache(c);
    }
    r.map(|_| out)
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
    use crate::core::config::ModelConfig;

    fn model() -> Model {
        let cfg = ModelConfig {
            vocab_size: 101,
            padded_vocab_size: 128,
            ..ModelConfig::from_descriptor("2x24:3:600").unwrap()
        };
        Model::new(crate::core::params::Weights::random(cfg, 11).unwrap(), crate::backend::Device::Cpu).unwrap()
    }

    #[test]
    fn cached_and_uncached_greedy_generation_agree() {
        let mut m = model();
        let g = GenConfig {
            max_new_tokens: 40,
            sampler: SamplerConfig { temperature: 0.0, ..Default::default() },
            stop_tokens: vec![],
            use_cache: true,
        };
        let prompt = [5u32, 17, 99, 3];
        let a = generate(&mut m, &prompt, &g, |_| Ok(())).unwrap();
        let b = generate(&mut m, &prompt, &GenConfig { use_cache: false, ..g.clone() }, |_| Ok(())).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.len(), 40);
        // Sampling: the same seed gives the same tokens, another seed other tokens.
        let s = GenConfig { sampler: SamplerConfig { temperature: 1.0, top_k: 50, top_p: 0.95, seed: 7 }, ..g.clone() };
        let x = generate(&mut m, &prompt, &s, |_| Ok(())).unwrap();
        assert_eq!(x, generate(&mut m, &prompt, &s, |_| Ok(())).unwrap());
        let y = generate(
            &mut m,
            &prompt,
            &GenConfig { sampler: SamplerConfig { seed: 8, ..s.sampler }, ..s.clone() },
            |_| Ok(()),
        )
        .unwrap();
        assert_ne!(x, y);
        // Stops at the stop token.
        let first = a[0];
        let stopped =
            generate(&mut m, &prompt, &GenConfig { stop_tokens: vec![first], ..g.clone() }, |_| Ok(())).unwrap();
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
