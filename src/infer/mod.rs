//! Using a model: text generation and HellaSwag evaluation.

pub mod generate;
pub mod hellaswag;
