#!/usr/bin/env python3
"""Greedy generation by Hugging Face `transformers` for llm.rs's tests.

    pip install torch transformers safetensors
    python scripts/make_generate_reference.py

Loads the tiny GPT-2 of tests/fixtures/hf/gpt2_tiny_fp32 (made by
scripts/make_hf_reference.py; V=251, maxT=32) with GPT2LMHeadModel, and for a
few prompts runs `model.generate(do_sample=False)` (greedy, with the KV cache)
up to the model's context. Writes tests/fixtures/hf/greedy.json: per prompt,
the prompt ids, the new token ids, and the smallest gap between the two
largest logits over the steps (a greedy choice closer than fp32 rounding
between implementations could go either way; the prompts kept have every gap
above 1e-3). Offline, fp32 on the CPU, one thread, eager attention.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json

import torch
import transformers
from transformers import GPT2LMHeadModel

transformers.logging.set_verbosity_error()
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "tests", "fixtures", "hf", "gpt2_tiny_fp32")
OUT = os.path.join(ROOT, "tests", "fixtures", "hf", "greedy.json")
MIN_GAP = 1e-3


def main():
    model = GPT2LMHeadModel.from_pretrained(MODEL, attn_implementation="eager").float().eval()
    max_t = model.config.n_positions
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(11)
    cases = []
    tries = 0
    while len(cases) < 4 and tries < 200:
        tries += 1
        n = [1, 3, 7, 12][len(cases)]
        prompt = torch.randint(0, vocab, (1, n), generator=gen)
        with torch.no_grad():
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=max_t - n,
                min_new_tokens=max_t - n,
                pad_token_id=0,
                eos_token_id=None,
                output_scores=True,
                return_dict_in_generate=True,
            )
        gaps = [float(torch.topk(s[0], 2).values[0] - torch.topk(s[0], 2).values[1]) for s in out.scores]
        if min(gaps) < MIN_GAP:
            continue
        cases.append({
            "prompt": prompt[0].tolist(),
            "new_tokens": out.sequences[0, n:].tolist(),
            "min_logit_gap": min(gaps),
        })
    assert len(cases) == 4, "could not find prompts with clear greedy choices"
    meta = {"transformers_version": transformers.__version__, "torch_version": torch.__version__, "model": "gpt2_tiny_fp32"}
    with open(OUT, "w") as f:
        json.dump({"meta": meta, "cases": cases}, f, indent=1)
    for c in cases:
        print(f"prompt {c['prompt']}: {len(c['new_tokens'])} tokens, min gap {c['min_logit_gap']:.4f}")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
