//! Every environment variable llmrs reads, in one place: its name, what it means, and the one
//! function that reads it. Flags are the interface; these are for paths a machine decides
//! (data and cache directories), launchers (MPI ranks) and test hooks.

use std::ffi::OsString;
use std::path::PathBuf;

/// A directory laid out like the project's shared data (`tinyshakespeare/input.txt`,
/// `gpt2_bpe/`, `hellaswag/hellaswag_val.preprocessed.jsonl`), read instead of downloading.
pub const DATA_DIR: &str = "LLMRS_DATA_DIR";
/// Where llmrs caches downloads of its own (default `$XDG_CACHE_HOME/llmrs`, `~/.cache/llmrs`).
pub const CACHE_DIR: &str = "LLMRS_CACHE_DIR";
/// `1`: the CPU backend's NaN-checking mode (see [`crate::backend::cpu::backend`]): every op's outputs
/// are filled with NaN before it runs, and an op that leaves one unwritten, or lets one reach
/// its outputs, stops the program.
pub const NAN_CHECK: &str = "LLMRS_NAN_CHECK";
/// `avx512`, `avx2` or `portable`: the CPU kernels' instruction set (default: the best this CPU has).
pub const CPU_ISA: &str = "LLMRS_CPU_ISA";
/// `amx`, `avx512bf16` or `widen`: the tiles of the CPU's bf16 x bf16 GEMMs (default: AMX where
/// the host runs it, else `vdpbf16ps` on AMD, else bf16 widened into the fp32 GEMM; see
/// [`crate::backend::cpu::bgemm::model_engine`]).
pub const BF16_GEMM: &str = "LLMRS_BF16_GEMM";
/// `blocks` or `runs`: how the CPU's fp32 GEMM walks k when C is wide (default: runs for the
/// AVX-512 tile on Intel CPUs, blocks elsewhere; both give the same bits; see
/// [`crate::backend::cpu::sgemm::Order`]).
pub const SGEMM_ORDER: &str = "LLMRS_SGEMM_ORDER";
/// `tiled`: the GPU's GEMM runs as the tiled kernel (kernels/matmul.wgsl) on every adapter;
/// `auto` (the default): as the subgroup one (kernels/matmul_subgroup.wgsl) on Vulkan drivers
/// that run on the CPU (lavapipe), where it is faster. Both give the same bits (but for the sign
/// of a sum that underflows to zero: kernels/matmul_subgroup.wgsl).
pub const GPU_GEMM: &str = "LLMRS_GPU_GEMM";
/// Test hook: `lose-device-after=N` or `memory-limit=BYTES` makes the GPU backend fail on cue.
pub const GPU_TEST_FAULT: &str = "LLMRS_GPU_TEST_FAULT";
/// The Hugging Face Hub's address (default https://huggingface.co), as `huggingface_hub` reads it.
pub const HF_ENDPOINT: &str = "HF_ENDPOINT";
/// Hugging Face's cache of Hub repositories, then its home (`$HF_HOME/hub`), as transformers reads them.
pub const HF_HUB_CACHE: &str = "HF_HUB_CACHE";
pub const HF_HOME: &str = "HF_HOME";
/// A Hugging Face access token, sent to the Hub for gated and private repositories, as
/// `huggingface_hub` reads it: `HF_TOKEN` (or the older `HUGGING_FACE_HUB_TOKEN`), else the file
/// `HF_TOKEN_PATH` names, else `$HF_HOME/token` (what `huggingface-cli login` writes).
pub const HF_TOKEN: [&str; 2] = ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"];
pub const HF_TOKEN_PATH: &str = "HF_TOKEN_PATH";
/// How launchers tell a process the job's size and its rank (Open MPI, MPICH/Hydra, PMIx/Slurm).
pub const WORLD_SIZE: [&str; 3] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"];
pub const WORLD_RANK: [&str; 3] = ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"];

/// A variable's value, None when unset or empty (an empty value means "not set" everywhere).
pub fn get(name: &str) -> Option<OsString> {
    std::env::var_os(name).filter(|v| !v.is_empty())
}

/// A variable's value as UTF-8 text, None when unset, empty or not UTF-8.
pub fn text(name: &str) -> Option<String> {
    get(name).and_then(|v| v.into_string().ok())
}

/// `$LLMRS_DATA_DIR`.
pub fn data_dir() -> Option<PathBuf> {
    get(DATA_DIR).map(PathBuf::from)
}

/// Whether `$LLMRS_NAN_CHECK` is on (set, and not `0`).
pub fn nan_check() -> bool {
    get(NAN_CHECK).is_some_and(|v| v != "0")
}

/// The first launcher variable of `names` that holds a number.
pub fn launcher_number(names: &[&str]) -> Option<usize> {
    names.iter().find_map(|v| text(v)?.parse().ok())
}

/// `$XDG_CACHE_HOME`, else `~/.cache`, else `.cache`: the base of the cache directories.
pub fn cache_home() -> PathBuf {
    get("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| get("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"))
}

/// `$HF_HOME`, else `~/.cache/huggingface` (`$XDG_CACHE_HOME/huggingface`).
pub fn hf_home() -> PathBuf {
    get(HF_HOME).map_or_else(|| cache_home().join("huggingface"), PathBuf::from)
}

/// The Hugging Face token, as `huggingface_hub` finds it ([`HF_TOKEN`]); None when there is
/// none. Never printed.
pub fn hf_token() -> Option<String> {
    if let Some(t) = HF_TOKEN.iter().find_map(|v| text(v)) {
        return Some(t.trim().to_string()).filter(|t| !t.is_empty());
    }
    let path = get(HF_TOKEN_PATH).map_or_else(|| hf_home().join("token"), PathBuf::from);
    let t = std::fs::read_to_string(path).ok()?;
    Some(t.trim().to_string()).filter(|t| !t.is_empty())
}
