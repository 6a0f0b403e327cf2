//! Precision: fp32, or bf16 parameters, gradients and activations with or without fp32 master
//! weights ([`Model::set_precision`]); and weights made in place, in the model's precision
//! (a random init, a checkpoint read in pieces: [`Model::write_params`]).

use super::*;

impl Model {
    /// Compute in `precision` ([`Precision`]). bf16: the parameters the passes read, the
    /// gradients and the activations become bf16; with `master_weights` (llm.c's `-w 1`) the
    /// f32 parameters stay as master weights that AdamW updates, and the bf16 copy is written
    /// from them after each update, rounded stochastically; without (`-w 0`) the parameters
    /// themselves are bf16 and AdamW rounds its updates into them stochastically. A LoRA
    /// run's frozen base needs no master weights. Call once, before
    /// [`Model::alloc_training_state`].
    pub fn set_precision(&mut self, precision: Precision, master_weights: bool) -> Result<()> {
        if precision == self.precision {
            return Ok(());
        }
        if self.train.is_some() || self.precision != Precision::Fp32 {
            bail!("the precision is set once, before the training state is allocated");
        }
        if !self.be.supports_bf16() {
            bail!(
                "--precision bf16 needs bf16 buffers, which this backend lacks ({}): use --precision fp32",
                self.be.describe()
            );
        }
        let keep_f32 = master_weights && self.lora.is_none();
        let bf = self.be.alloc_parts(&self.zero.parts_at(3), DType::BF16)?;
        if keep_f32 {
            Ops::new(&mut *self.be).convert(bf, self.params, None);
        } else {
            // The f32 copy goes: handed back as it is converted (a 1B model's frozen base then
            // peaks at its 5 GB of f32, not at 7.5 GB).
            Ops::new(&mut *self.be).convert_consuming(bf, self.params);
        }
        if let Some(g) = self.gathered.take() {
            // ZeRO-3 gathers the bf16 shards the passes read: a bf16 gathering buffer.
            self.be.free(g.whole);
            self.gathered = Some(Gathered::alloc(&mut *self.be, &self.zero, DType::BF16)?);
        }
        if keep_f32 {
            self.work = Some(bf);
        } else {
            self.be.free(self.params);
            self.params = bf;
        }
        self.precision = precision;
        self.remake_acts()
    }

    /// Draw the family's random init (as [`Weights::random`] with `seed`) straight into the
    /// parameters, in their precision, a piece at a time: for a model built from
    /// [`Weights::zeros`], whose zero pages were never touched, so that a bf16 model's random
    /// fp32 values never exist whole (a 1B model's frozen bf16 base then peaks at its 2.5 GB,
    /// not at the 5 GB of its fp32 values). The same values as building from
    /// `Weights::random(config, seed)`, rounded as [`Model::set_precision`] rounds them. Not
    /// under ZeRO-3, whose ranks hold shards: there, build from `Weights::random`.
    pub fn init_random(&mut self, seed: u32) -> Result<()> {
        let arch = self.arch;
        self.write_params("a random init in place", |sink| {
            arch.init(sink, &mut crate::core::rng::Mt19937::new(seed));
            Ok(())
        })
    }

    /// Write every parameter through `f` (an [`crate::core::params::InitSink`] over the
    /// parameters, in their precision; with master weights, the bf16 working copy is theirs,
    /// rounded to nearest after): a model built from zero weights of its shape gets its weights
    /// in pieces, so that a bf16 model's fp32 values never exist whole (a file read in place:
    /// [`crate::source::read_hf_into`]). Not under ZeRO-3, whose ranks hold shards; `what` names
    /// the writer in that error.
    pub fn write_params(
        &mut self,
        what: &str,
        f: impl FnOnce(&mut dyn crate::core::params::InitSink) -> Result<()>,
    ) -> Result<()> {
        if self.zero.stage == 3 {
            bail!("{what} needs the whole parameters on each rank (ZeRO 0-2)");
        }
        struct Sink<'a> {
            be: &'a mut dyn Backend,
            params: Buf,
            layout: &'a ParamLayout,
            config: &'a ModelConfig,
        }
        impl crate::core::params::InitSink for Sink<'_> {
            fn config(&self) -> &ModelConfig {
                self.config
            }
            fn layout(&self) -> &ParamLayout {
                self.layout
            }
            fn fill(&mut self, r: std::ops::Range<usize>, value: f32) {
                self.be.fill(self.params.slice(r), value)
            }
            fn write(&mut self, at: usize, x: &[f32]) {
                self.be.upload(self.params.slice(at..at + x.len()), x)
            }
        }
        let mut sink = Sink { be: &mut *self.be, params: self.params, layout: &self.layout, config: &self.config };
        f(&mut sink)?;
        if let Some(work) = self.work {
            // Master weights: the bf16 working copy is theirs, rounded to nearest.
            Ops::new(&mut *self.be).convert(work, self.params, None);
        }
        Ok(())
    }

    /// The precision ([`Model::set_precision`]) and whether there are master weights.
    pub fn precision(&self) -> (Precision, bool) {
        (self.precision, self.work.is_some())
    }

    /// The dtype of activations and gradients.
    pub(super) fn act_dtype(&self) -> DType {
        match self.precision {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A random init drawn in place (Model::init_random on zero weights) gives every family the
    /// parameters of Weights::random with the same seed: in fp32, and in bf16 with and without
    /// master weights (then rounded to nearest, as set_precision rounds them).
    #[test]
    fn random_init_in_place_equals_random_weights() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let round = |v: &[f32]| {
            v.iter().map(|&x| crate::core::bf16::to_f32(crate::core::bf16::from_f32(x))).collect::<Vec<_>>()
        };
        for desc in ["2x32:2:16", "llama:2x32:4:2", "qwen2:3x24:4:2:40:16", "qwen3:3x24:4:2:8:40:16"] {
            let cfg = ModelConfig::from_descriptor(desc).unwrap();
            let want = Weights::random(cfg, 5).unwrap();
            assert!(want.data.iter().any(|&x| x != 0.0 && x != 1.0), "{desc}: the init draws values");
            for (precision, master) in [(Precision::Fp32, true), (Precision::Bf16, true), (Precision::Bf16, false)] {
                let mut m = Model::new(Weights::zeros(cfg).unwrap(), Device::Cpu).unwrap();
                m.set_precision(precision, master).unwrap();
                m.init_random(5).unwrap();
                let w = if precision == Precision::Fp32 { want.data.clone() } else { round(&want.data) };
                assert!(bits(&m.weights().unwrap().data) == bits(&w), "{desc} {precision} -w {master}");
                if precision == Precision::Bf16 && master {
                    let p = m.read_all(Slot::Params).unwrap();
                    assert!(bits(&p) == bits(&want.data), "{desc}: the fp32 master weights");
                }
            }
        }
    }
}
