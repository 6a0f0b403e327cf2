//! The CPU backend: one file per layer, forward and backward side by side (fp32, all cores
//! through the thread team of [`team`]). A CUDA backend mirrors these file names.

pub mod adamw;
pub mod attention;
pub mod backend;
pub mod bf16;
pub mod bgemm;
pub mod classifier;
pub mod encoder;
pub mod gelu;
pub mod gemm;
pub mod layernorm;
pub mod lora;
pub mod math;
pub mod matmul;
pub mod peak;
pub mod residual;
pub mod rmsnorm;
pub mod rope;
pub mod sgemm;
pub mod simd;
pub mod swiglu;
pub mod team;
pub mod wide;

#[cfg(test)]
pub mod testutil;
