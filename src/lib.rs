//! llm.rs: GPT-2 and Llama training from scratch in pure Rust, in the spirit of llm.c.
//!
//! The crate's layers, each a folder, from the bottom up (a layer imports only those below
//! it); docs/architecture.md draws them. Dimension names (B, T, C, NH, HS, L, V, Vp, maxT) are
//! defined in [`core::config`].

pub mod core;

pub mod backend;

pub mod models;

pub mod model;

pub mod formats;

pub mod hub;

pub mod data;

pub mod source;

pub mod train;

pub mod infer;

#[doc(hidden)]
pub mod testdata;
