#!/usr/bin/env python3
"""Hugging Face `tokenizers` reference fixtures for llm.rs's tokenizer.json support.

    pip install tokenizers
    LLMRS_DATA_DIR=../shared/data python scripts/make_hf_tokenizer_reference.py

Trains two small tokenizers on Tiny Shakespeare ($LLMRS_DATA_DIR/tinyshakespeare/input.txt,
default ../shared/data), in the two styles Llama-family models use, and saves them as
tokenizer.json (the file a model repository holds):

  tests/fixtures/tokenizers/bytelevel.json   byte-level BPE (GPT-2, Llama 3, SmolLM2 style),
                                             600 tokens, special <|endoftext|> (id 0) and
                                             <|begin_of_text|> (id 1)
  tests/fixtures/tokenizers/sentencepiece.json  SentencePiece-style BPE (Llama 2, TinyLlama):
                                             Metaspace pre-tokenizer and decoder, byte
                                             fallback tokens <0x00>..<0xFF>, specials <unk>,
                                             <s>, </s>; 500 tokens
  tests/fixtures/tokenizers/qwen.json        Qwen2/Qwen3 style: NFC normalizer, Qwen's Split
                                             regex pre-tokenizer then byte-level (no regex of
                                             its own), specials <|endoftext|>, <|im_start|>,
                                             <|im_end|>; 700 tokens
  tests/fixtures/tokenizers/cases.json       for each: texts, their ids from
                                             encode(text, add_special_tokens=False), and
                                             decode(ids) of them

The texts are tests/fixtures/tokenizer_cases.json's (GPT-2's cases) plus a few with characters
the training text lacks (byte fallback, emoji) and special-token text.
"""

import json
import os

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizers")
DATA = os.environ.get("LLMRS_DATA_DIR", os.path.join(ROOT, "..", "shared", "data"))


def corpus():
    with open(os.path.join(DATA, "tinyshakespeare", "input.txt"), encoding="utf-8") as f:
        text = f.read()
    return [p for p in text.split("\n\n") if p]


def bytelevel():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|begin_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    return tok


def sentencepiece():
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    return tok


# Qwen2's (and Qwen3's) pre-tokenizer regex, from their tokenizer.json.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")


def qwen():
    from tokenizers import Regex
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    return tok


def main():
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(ROOT, "tests", "fixtures", "tokenizer_cases.json"), encoding="utf-8") as f:
        texts = [c["text"] for c in json.load(f)]
    texts += ["naïve café — 🦀 ✓", "tab\there\r\nnew", "<|endoftext|> is text here", "   leading spaces", "x" * 50,
              "12345 and 3.14159", "<|im_start|>user\nhi<|im_end|>", "e\u0301 composed"]
    cases = {}
    for name, tok in [("bytelevel", bytelevel()), ("sentencepiece", sentencepiece()), ("qwen", qwen())]:
        tok.save(os.path.join(OUT, f"{name}.json"))
        back = Tokenizer.from_file(os.path.join(OUT, f"{name}.json"))
        cases[name] = []
        for t in texts:
            ids = back.encode(t, add_special_tokens=False).ids
            cases[name].append({"text": t, "ids": ids, "decoded": back.decode(ids, skip_special_tokens=False)})
        print(name, back.get_vocab_size(), "tokens")
    with open(os.path.join(OUT, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=True, indent=0)
        f.write("\n")


if __name__ == "__main__":
    main()
