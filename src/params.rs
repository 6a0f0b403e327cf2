//! Named views into one contiguous parameter buffer.
//!
//! All parameters (and, with the same layout, their gradients and the AdamW moments) live in a
//! single `Vec<f32>` in llm.c's order, so the optimizer, checkpoints and (later) collectives work
//! on one flat buffer. Code reaches a tensor by name, `layout.blocks[l].qkv_w.of(&params)`, never
//! by an offset computed at the call site.

use crate::config::GPT2Config;
use std::ops::Range;

/// A named tensor's place in the flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span(pub Range<usize>);

impl Span {
    #[inline]
    pub fn of<'a>(&self, buf: &'a [f32]) -> &'a [f32] {
        &buf[self.0.clone()]
    }
    #[inline]
    pub fn of_mut<'a>(&self, buf: &'a mut [f32]) -> &'a mut [f32] {
        &mut buf[self.0.clone()]
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The per-layer tensors of one transformer block.
#[derive(Clone, Debug)]
pub struct BlockSpans {
    pub ln1_w: Span,       // (C)
    pub ln1_b: Span,       // (C)
    pub qkv_w: Span,       // (3*C, C)
    pub qkv_b: Span,       // (3*C)
    pub attn_proj_w: Span, // (C, C)
    pub attn_proj_b: Span, // (C)
    pub ln2_w: Span,       // (C)
    pub ln2_b: Span,       // (C)
    pub fc_w: Span,        // (4*C, C)
    pub fc_b: Span,        // (4*C)
    pub fc_proj_w: Span,   // (C, 4*C)
    pub fc_proj_b: Span,   // (C)
}

/// llm.c's 16 parameter tensors, in file order. Per-layer tensors are stacked over layers,
/// e.g. `qkvw` is (L, 3*C, C).
pub const TENSOR_NAMES: [&str; 16] = [
    "wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb", "ln2w", "ln2b", "fcw", "fcb", "fcprojw",
    "fcprojb", "lnfw", "lnfb",
];

/// Where every parameter lives.
#[derive(Clone, Debug)]
pub struct ParamLayout {
    pub wte: Span,   // (Vp, C)
    pub wpe: Span,   // (maxT, C)
    pub lnf_w: Span, // (C)
    pub lnf_b: Span, // (C)
    pub blocks: Vec<BlockSpans>,
    /// The 16 stacked tensors in llm.c order (e.g. all layers' `qkvw` as one span).
    pub tensors: [Span; 16],
    /// Whether AdamW applies weight decay to each of the 16 tensors (the 2-D weights only, as
    /// llm.c's train_gpt2.cu does).
    pub decay: [bool; 16],
    pub num_parameters: usize,
}

impl ParamLayout {
    pub fn new(cfg: &GPT2Config) -> Self {
        let (vp, c, l, maxt) = (cfg.padded_vocab_size, cfg.channels, cfg.num_layers, cfg.max_seq_len);
        // Elements of each of the 16 tensors, per layer for the stacked ones.
        let per_layer = [c, c, 3 * c * c, 3 * c, c * c, c, c, c, 4 * c * c, 4 * c, 4 * c * c, c];
        let mut sizes = [0usize; 16];
        sizes[0] = vp * c;
        sizes[1] = maxt * c;
        for (i, n) in per_layer.iter().enumerate() {
            sizes[2 + i] = n * l;
        }
        sizes[14] = c;
        sizes[15] = c;
        let mut off = 0;
        let tensors: [Span; 16] = std::array::from_fn(|i| {
            let s = Span(off..off + sizes[i]);
            off += sizes[i];
            s
        });
        let layer = |i: usize, l: usize| {
            let n = per_layer[i - 2];
            let start = tensors[i].0.start + l * n;
            Span(start..start + n)
        };
        let blocks = (0..l)
            .map(|l| BlockSpans {
                ln1_w: layer(2, l),
                ln1_b: layer(3, l),
                qkv_w: layer(4, l),
                qkv_b: layer(5, l),
                attn_proj_w: layer(6, l),
                attn_proj_b: layer(7, l),
                ln2_w: layer(8, l),
                ln2_b: layer(9, l),
                fc_w: layer(10, l),
                fc_b: layer(11, l),
                fc_proj_w: layer(12, l),
                fc_proj_b: layer(13, l),
            })
            .collect();
        let decay = std::array::from_fn(|i| matches!(i, 0 | 1 | 4 | 6 | 10 | 12));
        ParamLayout {
            wte: tensors[0].clone(),
            wpe: tensors[1].clone(),
            lnf_w: tensors[14].clone(),
            lnf_b: tensors[15].clone(),
            blocks,
            tensors,
            decay,
            num_parameters: off,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_124m_parameter_count() {
        // llm.c prints num_parameters: 124475904 for GPT-2 124M with the padded vocab.
        let lay = ParamLayout::new(&GPT2Config::from_descriptor("d12").unwrap());
        assert_eq!(lay.num_parameters, 124_475_904);
        assert_eq!(lay.tensors[15].0.end, lay.num_parameters);
        // Per-layer views tile their stacked tensor exactly.
        assert_eq!(lay.blocks[0].qkv_w.0.start, lay.tensors[4].0.start);
        assert_eq!(lay.blocks[11].qkv_w.0.end, lay.tensors[4].0.end);
    }
}
