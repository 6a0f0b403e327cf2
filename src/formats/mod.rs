//! File formats: bytes on disk into plain values and back. llm.c's files (model, state and
//! debug-state files) and llmrs's own model file ([`llmc`]), Hugging Face's safetensors
//! directories ([`hf`]), PEFT's adapter directories ([`peft`]) and a LoRA run's checkpoint
//! ([`lora`]). The model never imports a format; training and loading do.

pub mod hf;
pub mod llmc;
pub mod lora;
pub mod peft;
