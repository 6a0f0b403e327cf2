#!/usr/bin/env python3
"""Hugging Face `transformers` GPT-2 reference fixtures for llm.rs.

How to run (from anywhere; paths are relative to the repository root):

    pip install torch transformers safetensors numpy
    python scripts/make_hf_reference.py                       # mode 1
    python scripts/make_hf_reference.py --check-export DIR    # mode 2
    python scripts/make_hf_reference.py --check-export DIR --expect bf16weights

The script is offline (HF_HUB_OFFLINE=1, nothing is ever downloaded) and
deterministic (fixed seeds, fp32 on CPU, one thread, deterministic algorithms,
eager attention).

Mode 1 (no arguments) writes under tests/fixtures/hf/:

  gpt2_tiny_fp32/{config.json, model.safetensors}
      A tiny GPT-2 (V=251, maxT=32, C=48, L=2, NH=3, tied wte/lm_head) built
      with `transformers.GPT2LMHeadModel`, seeded init (torch seed 0) plus a
      seeded perturbation (generator seed 5) so that every LayerNorm weight
      and every bias is non-trivial. Saved with `save_pretrained`
      (safetensors) in float32. Used to test the Rust HF importer.

  gpt2_tiny_bf16/{config.json, model.safetensors}
      The same model cast to bfloat16 and saved the same way. Used to test
      importing bf16 checkpoints.

  io.safetensors
      input_ids          (2, 11) int32   token ids (generator seed 9)
      logits_fp32        (2, 11, 251) f32 logits of the fp32 model
      logits_bf16weights (2, 11, 251) f32 logits of the bf16 checkpoint,
                                          upcast to fp32 and run in fp32
      metadata: transformers_version, torch_version.

Mode 2 (--check-export DIR) loads DIR with `GPT2LMHeadModel.from_pretrained`
(local files only), casts it to float32, runs it on io.safetensors'
input_ids and compares with logits_fp32 (default) or logits_bf16weights
(--expect bf16weights). Prints the max abs difference and PASS (< 1e-5,
exit 0) or FAIL (exit 1). Intended for directories exported by the Rust tool.

Notes for the Rust side (layout of HF GPT-2 checkpoints):
  * HF GPT-2 uses `Conv1D`, whose weight is stored as (in, out), i.e.
    transposed relative to llm.c / nn.Linear's (out, in). This applies to
    attn.c_attn, attn.c_proj, mlp.c_fc and mlp.c_proj weights.
  * The inventory printed by mode 1 shows exactly which names are present
    (prefix, tied lm_head, attention-mask buffers).
"""

import os

# Must be set before transformers / huggingface_hub are imported.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import copy
import json
import shutil
import sys

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

# Keep the output readable: no progress bars / info chatter from transformers.
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

# ----------------------------------------------------------------------------
# Configuration

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_DIR = os.path.join(REPO_ROOT, "tests", "fixtures", "hf")
FP32_DIR = os.path.join(HF_DIR, "gpt2_tiny_fp32")
BF16_DIR = os.path.join(HF_DIR, "gpt2_tiny_bf16")
IO_PATH = os.path.join(HF_DIR, "io.safetensors")

VOCAB_SIZE = 251
MAX_SEQ_LEN = 32
CHANNELS = 48
NUM_LAYERS = 2
NUM_HEADS = 3

INIT_SEED = 0  # torch.manual_seed before building the model
PERTURB_SEED = 5  # generator for the LayerNorm-weight / bias perturbation
PERTURB_SCALE = 0.02
INPUT_SEED = 9  # generator for the input ids
B, T = 2, 11

PASS_TOL = 1e-5
MAX_FIXTURE_BYTES = 2 * 1024 * 1024

# Eager attention: plain matmul + softmax, the same code path every time.
ATTN_IMPL = "eager"


def setup_determinism():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


# ----------------------------------------------------------------------------
# Mode 1: build the fixtures


def build_model():
    """Seeded tiny GPT-2 with non-trivial LayerNorm weights and biases."""
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=MAX_SEQ_LEN,
        n_embd=CHANNELS,
        n_layer=NUM_LAYERS,
        n_head=NUM_HEADS,
        activation_function="gelu_new",  # tanh approximation, as in llm.c
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
    )
    config._attn_implementation = ATTN_IMPL
    torch.manual_seed(INIT_SEED)
    model = GPT2LMHeadModel(config).eval()

    # Default init leaves LayerNorm weights at 1 and all biases at 0, which
    # would hide layout bugs (e.g. a swapped bias). Perturb them, walking
    # named_parameters() in its fixed order with a dedicated generator.
    # named_parameters() de-duplicates shared tensors, so the tied
    # lm_head.weight never shows up; skip lm_head explicitly anyway.
    gen = torch.Generator().manual_seed(PERTURB_SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("lm_head"):
                continue
            is_ln = ".ln_" in name  # h.N.ln_1, h.N.ln_2, transformer.ln_f
            noise = PERTURB_SCALE * torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if name.endswith(".bias"):
                # Conv1D biases and LayerNorm biases alike.
                p.copy_(noise)
            elif is_ln and name.endswith(".weight"):
                p.add_(noise)
            # other weights (wte, wpe, Conv1D weights): keep the seeded init
    # The tie must still hold after the in-place edits.
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    return model


def save_checkpoint(model, out_dir):
    """save_pretrained (safetensors), leaving only config.json + model.safetensors."""
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    gen_cfg = os.path.join(out_dir, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)
    files = sorted(os.listdir(out_dir))
    assert files == ["config.json", "model.safetensors"], files


def inventory(path):
    """[(name, dtype, shape)] of a safetensors file, in file order of names."""
    out = []
    with safe_open(path, framework="pt") as f:
        for name in f.keys():
            sl = f.get_slice(name)
            out.append((name, sl.get_dtype(), tuple(sl.get_shape())))
        meta = f.metadata()
    return out, meta


def print_inventory(path):
    inv, meta = inventory(path)
    rel = os.path.relpath(path, REPO_ROOT)
    print(f"{rel}  ({os.path.getsize(path)} bytes, {len(inv)} tensors, metadata={meta})")
    for name, dtype, shape in inv:
        print(f"    {name:40s} {dtype:5s} {list(shape)}")
    return inv


def load_local(model_dir):
    """Load a checkpoint directory (local only), as float32, eval mode.

    from_pretrained silently random-initialises any tensor missing from the
    checkpoint (and we silenced its warnings), so check the loading info
    explicitly and refuse incomplete or mismatched checkpoints.
    """
    model, info = GPT2LMHeadModel.from_pretrained(
        model_dir,
        local_files_only=True,
        attn_implementation=ATTN_IMPL,
        output_loading_info=True,
    )
    problems = {k: sorted(v) for k, v in info.items() if v}
    if problems:
        raise SystemExit(f"FAIL: loading {model_dir}: {problems}")
    return model.to(torch.float32).eval()


@torch.no_grad()
def run_logits(model, ids):
    return model(input_ids=ids.to(torch.long)).logits.to(torch.float32).contiguous()


def canonicalize_metadata_order(path):
    """Make a safetensors file byte-for-byte reproducible.

    safetensors writes `__metadata__` from a hash map, so with several
    metadata keys their order (and hence the file bytes) changes from run to
    run. Rewrite the JSON header in place with the metadata keys sorted; the
    tensor entries keep their order, so the header length and every data
    offset are unchanged.
    """
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header_bytes = raw[8 : 8 + n]
    header = json.loads(header_bytes, object_pairs_hook=dict)
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    # Keep "__metadata__" first, as safetensors writes it.
    header = {"__metadata__": header.pop("__metadata__"), **header}
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n and len(header_bytes.rstrip(b" ")) == len(new), (
        "unexpected safetensors header layout"
    )
    new = new.ljust(n, b" ")  # same padding as the original
    with open(path, "wb") as f:
        f.write(raw[:8] + new + raw[8 + n :])


def dir_size(path):
    total = 0
    for root, _, files in os.walk(path):
        for fn in files:
            total += os.path.getsize(os.path.join(root, fn))
    return total


def make_fixtures():
    os.makedirs(HF_DIR, exist_ok=True)

    # 1. model
    model = build_model()

    # 2. checkpoints (deep copy so the fp32 model stays fp32)
    save_checkpoint(model, FP32_DIR)
    model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    save_checkpoint(model_bf16, BF16_DIR)
    assert model.transformer.wte.weight.dtype == torch.float32

    # 3. inputs and logits
    gen = torch.Generator().manual_seed(INPUT_SEED)
    ids = torch.randint(0, VOCAB_SIZE, (B, T), generator=gen)
    logits_fp32 = run_logits(model, ids)
    # Round-trip both checkpoints through from_pretrained: the fp32 one must
    # reproduce the in-memory model exactly (checks the save/load path); the
    # bf16 one is upcast to fp32 and run in fp32.
    reloaded = run_logits(load_local(FP32_DIR), ids)
    assert torch.equal(reloaded, logits_fp32), (reloaded - logits_fp32).abs().max()
    logits_bf16w = run_logits(load_local(BF16_DIR), ids)
    assert logits_fp32.shape == (B, T, VOCAB_SIZE) and logits_fp32.dtype == torch.float32
    assert logits_bf16w.shape == (B, T, VOCAB_SIZE) and logits_bf16w.dtype == torch.float32

    # 4. io.safetensors
    save_file(
        {
            "input_ids": ids.to(torch.int32).contiguous(),
            "logits_fp32": logits_fp32,
            "logits_bf16weights": logits_bf16w,
        },
        IO_PATH,
        metadata={
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
        },
    )
    canonicalize_metadata_order(IO_PATH)

    # 5. inventories and summary
    print("== tensor inventories ==")
    inv32 = print_inventory(os.path.join(FP32_DIR, "model.safetensors"))
    inv16 = print_inventory(os.path.join(BF16_DIR, "model.safetensors"))
    print_inventory(IO_PATH)
    names32 = [n for n, _, _ in inv32]
    assert names32 == [n for n, _, _ in inv16]
    assert [s for _, _, s in inv32] == [s for _, _, s in inv16]

    total = dir_size(HF_DIR)
    print("== summary ==")
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    print(f"input_ids[0] = {ids[0].tolist()}")
    print(f"logits_fp32[0,0,:4] = {logits_fp32[0, 0, :4].tolist()}")
    print(
        "max |logits_fp32 - logits_bf16weights| = "
        f"{(logits_fp32 - logits_bf16w).abs().max().item():.6g}"
    )
    print(f"lm_head.weight stored: {'lm_head.weight' in names32}")
    print(f"attn.bias / attn.masked_bias buffers stored: "
          f"{any(n.endswith(('.attn.bias', '.attn.masked_bias')) for n in names32)}")
    print(f"'transformer.' prefix: {all(n.startswith('transformer.') for n in names32)}")
    for root, _, files in sorted(os.walk(HF_DIR)):
        for fn in sorted(files):
            p = os.path.join(root, fn)
            print(f"    {os.path.relpath(p, REPO_ROOT):60s} {os.path.getsize(p):8d} bytes")
    print(f"total size of {os.path.relpath(HF_DIR, REPO_ROOT)}: {total} bytes")
    assert total < MAX_FIXTURE_BYTES, f"fixtures too large: {total} bytes"


# ----------------------------------------------------------------------------
# Mode 2: check an exported directory against the stored logits


def check_export(model_dir, expect):
    key = {"fp32": "logits_fp32", "bf16weights": "logits_bf16weights"}[expect]
    io = load_file(IO_PATH)
    ids = io["input_ids"]
    want = io[key]

    model = load_local(model_dir)
    got = run_logits(model, ids)
    if got.shape != want.shape:
        print(f"FAIL: logits shape {tuple(got.shape)} != expected {tuple(want.shape)}")
        return 1
    diff = (got - want).abs().max().item()
    print(f"{model_dir}: max |logits - {key}| = {diff:.6g}")
    if diff < PASS_TOL:
        print("PASS")
        return 0
    print(f"FAIL (tolerance {PASS_TOL:g})")
    return 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check-export", metavar="DIR",
                    help="load DIR with from_pretrained and compare its logits")
    ap.add_argument("--expect", choices=["fp32", "bf16weights"], default="fp32",
                    help="which stored logits to compare against (default fp32)")
    args = ap.parse_args()
    setup_determinism()
    if args.check_export:
        sys.exit(check_export(args.check_export, args.expect))
    if args.expect != "fp32":
        ap.error("--expect only applies with --check-export")
    make_fixtures()


if __name__ == "__main__":
    main()
