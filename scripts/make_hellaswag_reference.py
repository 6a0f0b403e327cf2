#!/usr/bin/env python3
"""HellaSwag reference fixture for llm.rs, scored the way llm.c does it.

This reproduces the scoring of llm.c's `dev/data/hellaswag.py` (functions
`render_example` / `evaluate`) with a Hugging Face `transformers`
`GPT2LMHeadModel`, and writes per-example losses and predictions to a JSON
fixture that the Rust HellaSwag evaluator can be checked against.

How to run (from the repository root):

    llmrs convert 2x64:4:256 /tmp/hs_model --seed 42 && \\
        python scripts/make_hellaswag_reference.py --model /tmp/hs_model

    # full form, with every option at its default except --model:
    LLMRS_DATA_DIR=../shared/data python scripts/make_hellaswag_reference.py \\
        --model /tmp/hs_model \\
        --model-desc "llmrs convert 2x64:4:256 --seed 42" \\
        --data $LLMRS_DATA_DIR/hellaswag/hellaswag_val.preprocessed.jsonl \\
        --n 300 --out tests/fixtures/hellaswag_ref.json

Requirements: torch, transformers, tiktoken, safetensors, numpy. The script is
offline: HF_HUB_OFFLINE=1, and the GPT-2 tokenizer is built from the local
files $LLMRS_DATA_DIR/gpt2_bpe/{vocab.bpe,encoder.json} (LLMRS_DATA_DIR
defaults to ../shared/data relative to the repository root).

Scoring, per example (JSON line with keys ctx, label, endings[4]):

    ctx_tokens = encode(ctx)
    for each of the 4 endings:
        end_tokens = encode(" " + ending)          # note the leading space
        row  = ctx_tokens + end_tokens
        mask = [0] * len(ctx_tokens) + [1] * len(end_tokens)
    pad the 4 rows (and masks) with 0 to the longest row -> tokens (4, N)
    logits = model(tokens).logits                  # (4, N, V)
    losses[i, t] = cross_entropy(logits[i, t], tokens[i, t + 1])   # (4, N-1)
    shift_mask   = mask[:, 1:]
    sum_loss = (losses * shift_mask).sum(1)        # (4,)
    avg_loss = sum_loss / shift_mask.sum(1)        # (4,)
    pred      = argmin(sum_loss)                   # "acc"
    pred_norm = argmin(avg_loss)                   # "acc_norm"

Padding positions never contribute: their mask is 0, and since GPT-2 is causal
the padded tail cannot influence the logits of earlier positions.
`torch.argmin` returns the first index on exact ties (the same rule as a
strict `<` scan from index 0).

Output JSON (floats written by `json` at full double precision; the losses are
float32 values converted to Python floats, so they round-trip exactly):

    {"model": <--model-desc>, "data": <basename of --data>, "n": n,
     "torch_version": ..., "transformers_version": ...,
     "examples": [{"index", "label", "ctx_tokens", "ending_tokens" (4 lists),
                   "sum_loss" (4), "avg_loss" (4), "pred", "pred_norm"}, ...],
     "acc": num_correct / n, "acc_norm": num_correct_norm / n,
     "num_correct": ..., "num_correct_norm": ...}

To keep the fixture small (< ~1 MB), if the file with all token lists would be
larger than that, "ctx_tokens"/"ending_tokens" are dropped for examples after
the first 50 (losses and predictions are always kept for every example).
"""

import os

# Must be set before transformers / huggingface_hub are imported.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import json
import sys

import tiktoken
import torch
import torch.nn.functional as F
import transformers
from gpt2_offline import gpt2_encoding  # scripts/ is on sys.path
from transformers import GPT2LMHeadModel

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Size budget for the fixture, and how many examples keep their token lists
# if the full file would exceed it.
MAX_FIXTURE_BYTES = 1_000_000
KEEP_TOKENS_FALLBACK = 50


def data_dir():
    """$LLMRS_DATA_DIR, or ../shared/data relative to the repository root."""
    d = os.environ.get("LLMRS_DATA_DIR")
    if d:
        return d
    return os.path.normpath(os.path.join(REPO_ROOT, "..", "shared", "data"))



def render_example(enc, example):
    """Tokenize one example as llm.c's render_example does.

    Returns (ctx_tokens, ending_tokens, tokens (4, N) long, mask (4, N) long,
    label).
    """
    ctx = example["ctx"]
    label = int(example["label"])
    endings = example["endings"]
    assert len(endings) == 4, "HellaSwag examples have exactly 4 endings"

    ctx_tokens = enc.encode_ordinary(ctx)
    # The ending is prepended with a space: GPT-2's tokenizer attaches the
    # space to the following word, as in running text after the context.
    ending_tokens = [enc.encode_ordinary(" " + end) for end in endings]

    rows = [ctx_tokens + end for end in ending_tokens]
    masks = [[0] * len(ctx_tokens) + [1] * len(end) for end in ending_tokens]

    # Pad every row with 0 (both tokens and mask) to the longest row.
    max_len = max(len(r) for r in rows)
    tokens = torch.zeros((4, max_len), dtype=torch.long)
    mask = torch.zeros((4, max_len), dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks)):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.long)
    return ctx_tokens, ending_tokens, tokens, mask, label


@torch.no_grad()
def score(model, tokens, mask):
    """Per-ending summed and averaged completion loss, as llm.c's evaluate."""
    logits = model(tokens).logits  # (4, N, V), float32
    V = logits.size(-1)
    # Position t predicts token t + 1.
    shift_logits = logits[:, :-1, :].contiguous()
    shift_tokens = tokens[:, 1:].contiguous()
    losses = F.cross_entropy(
        shift_logits.view(-1, V), shift_tokens.view(-1), reduction="none"
    ).view(tokens.size(0), -1)  # (4, N-1)
    # Only the ending's tokens count (the first ending token is predicted by
    # the last context position).
    shift_mask = mask[:, 1:].contiguous()
    masked = losses * shift_mask
    sum_loss = masked.sum(dim=1)
    avg_loss = sum_loss / shift_mask.sum(dim=1)
    pred = int(sum_loss.argmin().item())
    pred_norm = int(avg_loss.argmin().item())
    return sum_loss, avg_loss, pred, pred_norm


def main():
    d = data_dir()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True,
                    help="transformers GPT-2 directory (config.json + model.safetensors)")
    ap.add_argument("--data",
                    default=os.path.join(d, "hellaswag", "hellaswag_val.preprocessed.jsonl"),
                    help="HellaSwag JSONL (keys ctx, label, endings)")
    ap.add_argument("--n", type=int, default=300, help="score the first N examples")
    ap.add_argument("--out", default=os.path.join(REPO_ROOT, "tests", "fixtures", "hellaswag_ref.json"),
                    help="output JSON fixture")
    ap.add_argument("--model-desc", default="",
                    help='how the model was made, recorded in the output '
                         '(e.g. "llmrs convert 2x64:4:256 --seed 42")')
    args = ap.parse_args()

    # Deterministic, single-threaded fp32 CPU evaluation.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    enc = gpt2_encoding(d)
    model = GPT2LMHeadModel.from_pretrained(
        args.model, local_files_only=True, attn_implementation="eager",
        torch_dtype=torch.float32,
    )
    model = model.float().eval()
    n_positions = model.config.n_positions

    # Read the first n examples.
    examples = []
    with open(args.data, "r", encoding="utf-8") as f:
        for line in f:
            if len(examples) >= args.n:
                break
            if line.strip():
                examples.append(json.loads(line))
    if len(examples) < args.n:
        sys.exit(f"only {len(examples)} examples in {args.data}, asked for {args.n}")

    out_examples = []
    num_correct = 0
    num_correct_norm = 0
    max_len = 0
    for i, ex in enumerate(examples):
        ctx_tokens, ending_tokens, tokens, mask, label = render_example(enc, ex)
        if tokens.size(1) > n_positions:
            sys.exit(f"example {i} has {tokens.size(1)} tokens > n_positions {n_positions}")
        max_len = max(max_len, tokens.size(1))
        sum_loss, avg_loss, pred, pred_norm = score(model, tokens, mask)
        num_correct += int(pred == label)
        num_correct_norm += int(pred_norm == label)
        out_examples.append({
            "index": i,
            "label": label,
            "ctx_tokens": ctx_tokens,
            "ending_tokens": ending_tokens,
            # float32 -> Python float is exact; json writes the shortest
            # repr that round-trips the double.
            "sum_loss": [float(x) for x in sum_loss.tolist()],
            "avg_loss": [float(x) for x in avg_loss.tolist()],
            "pred": pred,
            "pred_norm": pred_norm,
        })

    n = len(examples)
    result = {
        "model": args.model_desc,
        "data": os.path.basename(args.data),
        "n": n,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "examples": out_examples,
        "acc": num_correct / n,
        "acc_norm": num_correct_norm / n,
        "num_correct": num_correct,
        "num_correct_norm": num_correct_norm,
    }

    text = json.dumps(result)
    if len(text.encode("utf-8")) > MAX_FIXTURE_BYTES:
        # Too big: keep token lists only for the first examples.
        for e in out_examples[KEEP_TOKENS_FALLBACK:]:
            del e["ctx_tokens"]
            del e["ending_tokens"]
        text = json.dumps(result)
        print(f"note: token lists kept only for the first {KEEP_TOKENS_FALLBACK} examples")

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
        f.write("\n")

    print(f"examples: {n}")
    print(f"acc:      {num_correct}/{n} = {result['acc']:.4f}")
    print(f"acc_norm: {num_correct_norm}/{n} = {result['acc_norm']:.4f}")
    print(f"largest example length: {max_len} tokens")
    print(f"wrote {args.out} ({len(text) + 1} bytes)")


if __name__ == "__main__":
    main()
