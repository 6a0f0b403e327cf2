//! Training data: token shards and the loader that serves batches from them ([`loader`]),
//! tokenizers, and the preparation of text and corpora into shards.

pub mod corpus;
pub mod loader;
pub mod prepare;
pub mod tokenizer;
