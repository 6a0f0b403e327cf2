//! llm.rs: GPT-2 and Llama training from scratch in pure Rust, in the spirit of llm.c.
//!
//! Dimension names (B, T, C, NH, HS, L, V, Vp, maxT) are defined in [`config`].

pub mod acts;
pub mod backend;
pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod corpus;
pub mod cpu;
pub mod data;
pub mod download;
pub mod env;
pub mod files;
pub mod generate;
pub mod gpu;
pub mod hellaswag;
pub mod hf;
pub mod hub;
pub mod lora;
pub mod mem;
pub mod model;
pub mod models;
pub mod optim;
pub mod params;
pub mod plot;
pub mod prepare;
pub mod profile;
pub mod progress;
pub mod rng;
pub mod rundir;
pub mod schedule;
pub mod source;
#[doc(hidden)]
pub mod testdata;
pub mod tokenizer;
pub mod train;
pub mod zero;
