"""tiktoken's "gpt2" encoding built offline from the local BPE tables (encoder.json + vocab.bpe),
shared by the reference and benchmark scripts (tiktoken would otherwise download them)."""

import os

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = 50256


def gpt2_encoding(d: str) -> tiktoken.Encoding:
    """The GPT-2 encoding from `d`/gpt2_bpe/ (d is a data directory laid out like shared/data)."""
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=os.path.join(d, "gpt2_bpe", "vocab.bpe"),
        encoder_json_file=os.path.join(d, "gpt2_bpe", "encoder.json"),
    )
    return tiktoken.Encoding(name="gpt2", mergeable_ranks=ranks, special_tokens={"<|endoftext|>": EOT}, pat_str=GPT2_PAT)
