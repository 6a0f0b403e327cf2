//! One WGSL kernel and what it is made of: a layer's module (its file under `kernels/`, the
//! buffers it declares, its entry points and their bf16 variants) is described in its own
//! `gpu/<layer>.rs` as a [`Module`], whose kernels are [`K`]s. The pipelines are
//! [`super::pipelines`]'s; the list of every module is [`super::wgsl`]'s.

/// The helpers every module shares, prepended to each.
pub const COMMON: &str = include_str!("kernels/common.wgsl");

/// A WGSL module: one file of `kernels/`, with [`COMMON`] prepended.
pub struct Module {
    /// Its file's name (without `.wgsl`), and the module's.
    pub name: &'static str,
    pub src: &'static str,
    /// The buffers of a typed module, by name, as its f32 kernels hold them (bindings 0, 1,
    /// ...): declared by a prelude ([`prelude`]), through which the module reads and writes its
    /// f32 or bf16 buffers only (`NAME_ld(e)`, `NAME_st(e, v)`; u32 ones, token ids, as
    /// arrays), so that the same source builds the f32 kernels and each bf16 variant. Empty for
    /// a module that declares its own buffers (and has no variants).
    pub buffers: &'static [(&'static str, Io)],
    pub entries: &'static [Entry],
    /// Appended, with its own entry point `{name}_subgroup` for the entry named as the module,
    /// when the device runs this module's GEMM through subgroups ([`Context::subgroup_gemm`]):
    /// the matmul module, for CPU-run Vulkan drivers. The module is then named
    /// `{name}_subgroup`, as the file it adds.
    pub subgroup: Option<&'static str>,
}

/// One entry point of a module.
pub struct Entry {
    pub name: &'static str,
    /// Storage buffers bound at 0..n.
    pub bindings: usize,
    /// Which hold u32 (a bit per binding), and which bf16 (two a word), in the f32 kernel; the
    /// others hold f32.
    pub u32s: u8,
    pub bf16s: u8,
    /// Its bf16 variants (of a typed module): how each holds every buffer of the module, bound
    /// or not. A variant is its own module, named after it.
    pub variants: &'static [&'static [Io]],
}

impl Entry {
    /// An entry of `bindings` f32 buffers.
    pub const fn f32(name: &'static str, bindings: usize) -> Entry {
        Entry { name, bindings, u32s: 0, bf16s: 0, variants: &[] }
    }
}

/// One compute kernel: entry point `entry` of `module`, as its f32 kernel (`variant` 0) or its
/// bf16 variant `variant` (1, 2, ...).
#[derive(Clone, Copy)]
pub struct K {
    pub module: &'static Module,
    pub entry: usize,
    pub variant: usize,
}

impl K {
    /// The f32 kernel of entry `entry` of `module`.
    pub const fn of(module: &'static Module, entry: usize) -> K {
        K { module, entry, variant: 0 }
    }

    /// Its bf16 variant `v` (1, 2, ...; 0: itself).
    pub fn variant(self, v: usize) -> K {
        assert!(v <= self.spec().variants.len(), "{self:?} has no bf16 variant {v}");
        K { variant: v, ..self }
    }

    /// The kernel that does this one's work on bf16 activations, with `bf16` (an entry with
    /// one variant); else this one.
    pub fn on(self, bf16: bool) -> K {
        let n = self.spec().variants.len();
        assert!(n <= 1, "{self:?} has {n} bf16 variants: choose one");
        if bf16 && n == 1 {
            self.variant(1)
        } else {
            self
        }
    }

    pub(super) fn spec(self) -> &'static Entry {
        &self.module.entries[self.entry]
    }

    /// Who it is, as its pipeline is found: (module, entry, variant).
    fn key(self) -> (&'static str, usize, usize) {
        (self.module.name, self.entry, self.variant)
    }

    /// Its module's name as built ([`K::module_source`]).
    pub(super) fn module_name(self, subgroup_gemm: bool) -> String {
        let m = self.module;
        match self.variant {
            0 if subgroup_gemm && m.subgroup.is_some() => format!("{}_subgroup", m.name),
            0 => m.name.to_string(),
            v => format!("{}_bf16_{v}", self.spec().name),
        }
    }

    /// Its entry point as built: the subgroup GEMM's for the entry named as the module.
    pub(super) fn entry_point(self, subgroup_gemm: bool) -> &'static str {
        let (m, e) = (self.module, self.spec());
        match m.subgroup {
            Some(_) if subgroup_gemm && e.name == m.name => SUBGROUP_ENTRY,
            _ => e.name,
        }
    }
    /// Its module as built: (name, complete WGSL with [`COMMON`] prepended). With
    /// `subgroup_gemm`, a module with a subgroup GEMM carries it too, its bf16 variants too.
    pub fn module_source(self, subgroup_gemm: bool) -> (String, String) {
        let m = self.module;
        let with_gemm = |src: &str| match m.subgroup {
            Some(sg) if subgroup_gemm => format!("{src}\n{sg}"),
            _ => src.to_string(),
        };
        let names: Vec<&str> = m.buffers.iter().map(|x| x.0).collect();
        let src = match self.variant {
            0 if m.buffers.is_empty() => with_gemm(m.src),
            0 => prelude(&names, &m.buffers.iter().map(|x| x.1).collect::<Vec<_>>()) + &with_gemm(m.src),
            v => {
                let io = self.spec().variants[v - 1];
                assert!(m.buffers.len() == io.len(), "{self:?}: one Io per buffer of {}", m.name);
                let same_u32 = m.buffers.iter().zip(io).all(|(x, io)| (x.1 == Io::U32) == (*io == Io::U32));
                assert!(same_u32, "{self:?}: the u32 buffers of {} stay u32", m.name);
                prelude(&names, io) + &with_gemm(m.src)
            }
        };
        (self.module_name(subgroup_gemm), format!("{COMMON}\n{src}"))
    }
}

/// The entry point of the subgroup GEMM ([`Module::subgroup`]).
const SUBGROUP_ENTRY: &str = "matmul_subgroup";

impl std::fmt::Debug for K {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.variant {
            0 => write!(f, "{}::{}", self.module.name, self.spec().name),
            v => write!(f, "{}::{} (bf16 variant {v})", self.module.name, self.spec().name),
        }
    }
}

impl PartialEq for K {
    fn eq(&self, other: &K) -> bool {
        self.key() == other.key()
    }
}

impl Eq for K {}

impl std::hash::Hash for K {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.key().hash(h)
    }
}

/// How a kernel of a typed module ([`Module::buffers`]) holds one of its buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Io {
    /// f32: statistics, partial sums, tables (and every buffer of the f32 kernels).
    F32,
    /// bf16 the kernel only reads: two a word, widened as read.
    In16,
    /// bf16 the kernel writes (or updates): its words are atomic, and a thread sets its half
    /// of a word with an `and` and an `or`, so the two threads whose elements share a word do
    /// not race, and a word shared with a neighbouring tensor keeps that tensor's half. Each
    /// value is rounded to nearest even once, when stored.
    Out16,
    /// u32 (token ids), read as an array.
    U32,
}
pub use Io::{In16, Out16, F32 as F, U32};

/// The declarations of a typed module's buffers, held as `io` says, with their accessors:
/// `NAME_ld(e)`, element e as f32, `NAME_st(e, v)`, element e = v (rounded once to nearest
/// even if bf16), and `NAME_st_stochastic(e, v, seed, i)`, the same rounded stochastically
/// with the noise of (seed, i) if bf16 (kernels/bf16.wgsl's, the CPU's).
fn prelude(names: &[&str], io: &[Io]) -> String {
    let mut s = String::new();
    for (i, (name, io)) in names.iter().zip(io).enumerate() {
        let decl = |ty: &str| format!("@group(0) @binding({i}) var<storage, read_write> {name}: array<{ty}>;\n");
        s += &match io {
            Io::U32 => decl("u32"),
            Io::F32 => {
                decl("f32")
                    + &format!("fn {name}_ld(e: u32) -> f32 {{ return {name}[e]; }}\n")
                    + &format!("fn {name}_st(e: u32, v: f32) {{ {name}[e] = v; }}\n")
                    + &format!("fn {name}_st_stochastic(e: u32, v: f32, seed: u32, i: u32) {{ {name}[e] = v; }}\n")
            }
            // (A store into a bf16 input is never called: declared so that the module builds.)
            Io::In16 => {
                decl("u32")
                    + &format!("fn {name}_ld(e: u32) -> f32 {{ return half_at({name}[e >> 1u], e); }}\n")
                    + &format!("fn {name}_st(e: u32, v: f32) {{ {name}[e >> 1u] = f32_to_bf16(v); }}\n")
                    + &format!("fn {name}_st_stochastic(e: u32, v: f32, seed: u32, i: u32) {{ {name}_st(e, v); }}\n")
            }
            Io::Out16 => {
                decl("atomic<u32>")
                    + &format!("fn {name}_ld(e: u32) -> f32 {{ return half_at(atomicLoad(&{name}[e >> 1u]), e); }}\n")
                    + &format!(
                        "fn {name}_put(e: u32, bits: u32) {{ let sh = 16u * (e & 1u); \
                     atomicAnd(&{name}[e >> 1u], ~(0xffffu << sh)); atomicOr(&{name}[e >> 1u], bits << sh); }}\n"
                    )
                    + &format!("fn {name}_st(e: u32, v: f32) {{ {name}_put(e, f32_to_bf16(v)); }}\n")
                    + &format!(
                        "fn {name}_st_stochastic(e: u32, v: f32, seed: u32, i: u32) {{ \
                     {name}_put(e, f32_to_bf16_stochastic(v, seed, i)); }}\n"
                    )
            }
        };
    }
    s
}
