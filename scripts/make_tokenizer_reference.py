#!/usr/bin/env python3
"""Generate GPT-2 tokenizer reference fixtures for llm.rs, using OpenAI's tiktoken.

How to run (from the repository root):

    pip install tiktoken && LLMRS_DATA_DIR=../shared/data python scripts/make_tokenizer_reference.py

LLMRS_DATA_DIR defaults to ../shared/data (relative to the repository root).
It must contain:

  gpt2_bpe/encoder.json, gpt2_bpe/vocab.bpe   the original GPT-2 BPE files
  tinyshakespeare/input.txt                   the Tiny Shakespeare text

tiktoken normally downloads its BPE tables; here the GPT-2 encoding is built
offline from the two local files above, so no network access is needed.

Outputs (under tests/fixtures/):

  tokenizer_cases.json
      A list of {"text": ..., "ids": [...]} produced by enc.encode_ordinary
      (special tokens are NOT recognised, so "<|endoftext|>" is encoded as
      plain text). ASCII-only JSON (non-ASCII text is \\u-escaped).

  tinyshakespeare_shards.json
      sha256 / size / token count of the two llm.c token shards that
      llm.c's dev/data/tinyshakespeare.py would write
      (tiny_shakespeare_val.bin and tiny_shakespeare_train.bin).
      The shards themselves are not written into the repository.
"""

import hashlib
import json
import os
import random
import struct
import sys

import numpy as np
import tiktoken
from gpt2_offline import EOT, gpt2_encoding  # scripts/ is on sys.path

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO_ROOT, "tests", "fixtures")

# GPT-2 pre-tokenisation regex (identical to tiktoken's "gpt2" encoding).

# llm.c shard format: 256 x int32 header, then the tokens as uint16.
SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256

# Expected outputs of llm.c's dev/data/tinyshakespeare.py.
EXPECTED_VAL_TOKENS = 32768
EXPECTED_TRAIN_TOKENS = 305260


def data_dir() -> str:
    """Data directory from $LLMRS_DATA_DIR, default ../shared/data from the repo root."""
    d = os.environ.get("LLMRS_DATA_DIR", os.path.join("..", "shared", "data"))
    if not os.path.isabs(d):
        d = os.path.join(REPO_ROOT, d)
    return os.path.normpath(d)


build_gpt2_encoding = gpt2_encoding


def tokenize_tinyshakespeare(enc: tiktoken.Encoding, text: str) -> list:
    """Exactly what llm.c's dev/data/tinyshakespeare.py does.

    The text is split into sections on blank lines; each section is preceded
    by <|endoftext|> and (except the last) gets its "\\n\\n" back before it is
    encoded.
    """
    sections = text.split("\n\n")
    tokens = []
    for i, s in enumerate(sections):
        tokens.append(EOT)
        spad = s + "\n\n" if i != len(sections) - 1 else s
        tokens.extend(enc.encode_ordinary(spad))
    return tokens


def shard_bytes(tokens: list) -> bytes:
    """Serialise tokens in llm.c's shard format (all little-endian)."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0] = SHARD_MAGIC
    header[1] = SHARD_VERSION
    header[2] = len(tokens)
    toks = np.asarray(tokens, dtype=np.int64)
    assert toks.min() >= 0 and toks.max() < 2**16, "token ids must fit in uint16"
    return header.tobytes() + toks.astype("<u2").tobytes()


def shard_info(tokens: list) -> dict:
    b = shard_bytes(tokens)
    assert len(b) == HEADER_INTS * 4 + 2 * len(tokens)
    return {"tokens": len(tokens), "bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}


def tokenizer_case_texts(text: str) -> list:
    """Varied strings to pin down the tokenizer's behaviour."""
    cases = [
        # plain English
        "Hello world",
        "The quick brown fox jumps over the lazy dog.",
        "hello",
        " hello",
        "Hello, World!",
        # Shakespeare
        "First Citizen:\nBefore we proceed any further, hear me speak.",
        "To be, or not to be, that is the question:",
        "O Romeo, Romeo! wherefore art thou Romeo?",
        "ROMEO:\nBut, soft! what light through yonder window breaks?\n\n",
        # numbers
        "12345 3.14159",
        "1,000,000 and 2024-05-20; 0x1F 007",
        # contractions (GPT-2 only splits lower-case ones)
        "I'm can't we'll they've you'd",
        "I'M CAN'T WE'LL THEY'VE YOU'D",
        "it's John's 'tis o'er",
        # punctuation runs
        "Wait... what?!?! (yes) [no] {maybe} <ok>",
        "!!!???...,,,;;;:::---___***",
        "--- === +++ ### @@@ $$$ %%% ^^^ &&& |||",
        # whitespace runs
        "a  b   c\t\td\n\n\ne",
        "   leading",
        "trailing   ",
        "\n\n\n",
        " ",
        "\t",
        "line1\r\nline2\r\n",
        "  \n  \n",
        # unicode
        "café naïve résumé",
        "e\u0301",
        "cafe\u0301 nai\u0308ve",
        "日本語のテキスト",
        "Привет, мир! Как дела?",
        "مرحبا بالعالم",
        "Ελληνικά και עברית",
        "🦀🚀 👍🏽 👨‍👩‍👧",
        "👩‍💻 🏳️‍🌈 ❤️‍🔥",
        "a\u200bb\u00a0c\ufeffd",
        # special token text, encoded ordinarily
        "<|endoftext|>",
        "Hello<|endoftext|>World",
        # empty string
        "",
        # a long paragraph
        text[:2000],
    ]
    # Five random substrings of input.txt, length 100-500, reproducibly chosen.
    rng = random.Random(0)
    for _ in range(5):
        n = rng.randint(100, 500)
        start = rng.randint(0, len(text) - n)
        cases.append(text[start:start + n])
    return cases


def write_json(path: str, obj) -> int:
    s = json.dumps(obj, ensure_ascii=True, indent=1) + "\n"
    with open(path, "w", encoding="ascii", newline="\n") as f:
        f.write(s)
    return len(s)


def main() -> int:
    d = data_dir()
    enc = build_gpt2_encoding(d)

    # Sanity: well-known GPT-2 ids.
    assert enc.encode_ordinary("Hello world") == [15496, 995], enc.encode_ordinary("Hello world")
    assert enc.n_vocab == 50257

    with open(os.path.join(d, "tinyshakespeare", "input.txt"), "r", encoding="utf-8") as f:
        text = f.read()

    # --- llm.c shards -------------------------------------------------------
    tokens = tokenize_tinyshakespeare(enc, text)
    val, train = tokens[:32768], tokens[32768:]
    val_info, train_info = shard_info(val), shard_info(train)
    assert val_info["tokens"] == EXPECTED_VAL_TOKENS, val_info
    assert train_info["tokens"] == EXPECTED_TRAIN_TOKENS, train_info
    assert val_info["bytes"] == 66560, val_info
    assert train_info["bytes"] == 611544, train_info

    os.makedirs(FIXTURES, exist_ok=True)
    shards = {"val": val_info, "train": train_info, "tiktoken_version": tiktoken.__version__}
    p = os.path.join(FIXTURES, "tinyshakespeare_shards.json")
    n = write_json(p, shards)
    print(f"wrote {p} ({n} bytes)")
    print(json.dumps(shards, indent=1))

    # --- tokenizer cases ----------------------------------------------------
    cases = []
    for t in tokenizer_case_texts(text):
        ids = enc.encode_ordinary(t)
        assert enc.decode(ids) == t  # round-trip (all cases are valid UTF-8)
        cases.append({"text": t, "ids": ids})
    p = os.path.join(FIXTURES, "tokenizer_cases.json")
    n = write_json(p, cases)
    print(f"wrote {p} ({len(cases)} cases, {n} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
