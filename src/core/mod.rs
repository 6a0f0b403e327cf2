//! The bottom layer: plain data and utilities every other layer uses: model shapes
//! ([`config`]), where parameters live ([`params`]), number formats ([`bf16`]), files, memory,
//! random numbers, the environment, profiling kinds and progress bars. Imports nothing above it.

pub mod bf16;
pub mod config;
pub mod env;
pub mod files;
pub mod mem;
pub mod params;
pub mod profile;
pub mod progress;
pub mod rng;
