//! Generation's passes: a KV cache of the keys and values of the positions seen, and the
//! forward over new positions against it (each new token one position's work).

use super::*;

impl Model {
    /// A KV cache for one sequence of up to `positions` tokens (at most maxT), fed at most
    /// `chunk` tokens per call. Release it with [`Model::free_kv_cache`] when done.
    pub fn kv_cache(&mut self, positions: usize, chunk: usize) -> Result<KvCache> {
        let max_t = self.config.max_seq_len;
        if positions == 0 || positions > max_t || chunk == 0 {
            bail!("a KV cache holds 1 to {max_t} positions (asked: {positions}, chunks of {chunk})");
        }
        let dtype = self.act_dtype();
        KvCache::new(&mut *self.be, &self.config, &self.plan, positions, chunk.min(positions), dtype)
    }

    pub fn free_kv_cache(&mut self, cache: KvCache) {
        cache.wholes.iter().for_each(|&w| self.be.free(w));
        self.be.free(cache.tokens);
    }

    /// Feed `tokens` after the cached positions (in chunks); returns the first V logits of the
    /// last one, read to the host once. Under ZeRO-3 a collective, as [`Model::forward`].
    pub fn forward_cached<'a>(&mut self, cache: &'a mut KvCache, tokens: &[u32]) -> Result<&'a [f32]> {
        let (cfg, arch) = (self.config, self.arch);
        let (c, vp) = (cfg.channels, cfg.padded_vocab_size);
        if tokens.is_empty() {
            bail!("nothing to feed");
        }
        if cache.pos + tokens.len() > cache.capacity {
            bail!(
                "the sequence would exceed the KV cache's {} positions (the model's context is {})",
                cache.capacity,
                cfg.max_seq_len
            );
        }
        check_tokens(&cfg, tokens, None, 1, tokens.len())?;
        let mut tn = 0;
        let chunks = tokens.len().div_ceil(cache.chunk);
        for (i, chunk) in tokens.chunks(cache.chunk).enumerate() {
            let o = self.outer_weights()?;
            let pos = cache.pos;
            tn = chunk.len();
            let ids = cache.tokens.prefix(tn);
            self.be.upload_u32(ids, chunk);
            let s = Seq { b: 1, t: tn };
            arch.embed(&mut Ops::new(&mut *self.be), &cfg, &o, cache.stream.prefix(tn * c), ids, s, pos);
            for l in 0..cfg.num_layers {
                let w = self.block_weights(l)?;
                let (x, k, v) = cache.layer(l, tn);
                // Only the last position's logits are read: the last layer of the last chunk
                // computes the rest of its block for that position alone.
                let keep = if i + 1 == chunks && l + 1 == cfg.num_layers { 1 } else { tn };
                let attn = Attn::Cached { k, v, pos, cap: cache.capacity, keep };
                let lora = self.lora.as_ref().map(|lo| &lo.blocks[l]);
                arch.block_forward(&mut Ops::new(&mut *self.be).with_lora(lora), &cfg, &self.consts, &w, &x, tn, attn);
            }
            cache.pos += tn;
        }
        // Only the last position's logits are needed.
        let last = cache.stream.slice((tn - 1) * c..tn * c);
        let o = self.outer_weights()?;
        let mut ops = Ops::new(&mut *self.be);
        let norm = NormActs { out: cache.lnf, mean: cache.lnf_mean, rstd: cache.lnf_rstd };
        arch.final_norm(&mut ops, &cfg, &o, &norm, last, 1);
        let (logits, head) = (cache.logits, o[arch.head(&cfg)]);
        ops.charged_to(Kind::Classifier, |ops| {
            ops.matmul_forward(logits, norm.out, head, None, Mat { n: 1, c, oc: vp })
        });
        self.be.download(cache.logits.prefix(cfg.vocab_size), &mut cache.host_logits)?;
        Ok(&cache.host_logits)
    }

    // ---- host copies ------------------------------------------------------------------------
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_logits_match_the_full_forward_pass() {
        // Both families: the last layer of a prompt's last chunk runs past attention on the
        // last position alone, which must not change that position's logits.
        for desc in ["2x24:3:600", "llama:2x24:4:2:40:600"] {
            let cfg =
                ModelConfig { vocab_size: 101, padded_vocab_size: 128, ..ModelConfig::from_descriptor(desc).unwrap() };
            let mut m = Model::new(Weights::random(cfg, 11).unwrap(), Device::Cpu).unwrap();
            // 540 tokens: 530 in chunks of 256 (two whole and one partial), then single tokens.
            let toks: Vec<u32> = (0..540).map(|i| (i * 37 % 101) as u32).collect();
            let mut cache = m.kv_cache(540, 256).unwrap();
            let mut cached = vec![m.forward_cached(&mut cache, &toks[..530]).unwrap().to_vec()];
            for &t in &toks[530..] {
                cached.push(m.forward_cached(&mut cache, &[t]).unwrap().to_vec());
            }
            m.forward(&toks, None, 1, toks.len()).unwrap();
            for (j, pos) in (529..540).enumerate() {
                let full = m.logits_at(pos).unwrap();
                for (a, b) in cached[j].iter().zip(&full) {
                    assert!((a - b).abs() < 1e-5 * b.abs().max(1.0), "{desc} pos {pos}: {a} vs {b}");
                }
            }
            assert!(m.forward_cached(&mut cache, &[1]).is_err(), "past the cache's capacity");
            assert!(m.kv_cache(601, 1).is_err(), "past the model's context");
            m.free_kv_cache(cache);
        }
    }
}
