#!/usr/bin/env python3
"""Hugging Face `transformers` Qwen2 and Qwen3 reference fixtures for llm.rs.

    pip install torch transformers safetensors numpy
    python scripts/make_qwen_reference.py                    # mode 1: write the fixtures
    python scripts/make_qwen_reference.py --check-export DIR # mode 2: check an llmrs export

Offline (HF_HUB_OFFLINE=1) and deterministic (fixed seeds, fp32 on the CPU, one thread,
deterministic algorithms, eager attention).

Mode 1 writes tests/fixtures/qwen/:

  qwen2/          a tiny Qwen2ForCausalLM (V=199, maxT=32, C=48, L=2, NH=6, KV=2, F=96,
                  rope_theta 1e6, rms_norm_eps 1e-6, tied head): transformers' init (seed 0),
                  q, k and v biases and every RMSNorm weight randomised (seeded).
  qwen3/          a tiny Qwen3ForCausalLM (V=199, maxT=32, C=48, L=2, NH=4, KV=2, head_dim 16
                  so that NH * HS = 64 != C, F=80, untied head): q_norm, k_norm and every
                  RMSNorm weight randomised.
  NAME_grads/     each model's gradients of the mean loss of the batch in io.safetensors,
                  saved as a checkpoint of the same names.
  NAME_after10/   the parameters after 10 AdamW steps (trajectory_NAME.json).
  io.safetensors  input_ids, targets (2, 11); logits_NAME and loss_NAME.
  trajectory_NAME.json  the 10 steps as scripts/make_llama_reference.py records them.
  greedy.json     `generate(do_sample=False)` of both models from a few prompts to maxT.

Mode 2 loads DIR with AutoModelForCausalLM.from_pretrained and compares its logits on
io.safetensors' input_ids with those of the model of the same architecture: PASS when the largest
difference is below 1e-5.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import argparse
import importlib.util
import json
import shutil
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

# The batches, schedule, trajectory and greedy search of the Llama fixtures, shared.
spec = importlib.util.spec_from_file_location(
    "llama_ref", os.path.join(os.path.dirname(os.path.abspath(__file__)), "make_llama_reference.py"))
llama_ref = importlib.util.module_from_spec(spec)
spec.loader.exec_module(llama_ref)

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "qwen")
V, MAX_T, C, L = llama_ref.V, llama_ref.MAX_T, llama_ref.C, llama_ref.L


def qwen2_config():
    return Qwen2Config(
        vocab_size=V,
        hidden_size=C,
        intermediate_size=96,
        num_hidden_layers=L,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=MAX_T,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def qwen3_config():
    return Qwen3Config(
        vocab_size=V,
        hidden_size=C,
        intermediate_size=80,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=MAX_T,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build(cls, config, seed):
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name or "lm_head" in name:
                p.mul_(5.0)  # sharper logits: greedy choices far apart
            elif "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return model


def loss_of(model, x, y):
    logits = model(input_ids=x).logits
    return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1))


def make():
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    models = {"qwen2": build(Qwen2ForCausalLM, qwen2_config(), 0), "qwen3": build(Qwen3ForCausalLM, qwen3_config(), 1)}
    x, y = llama_ref.batch(torch.Generator().manual_seed(9))
    io = {"input_ids": x.to(torch.int32), "targets": y.to(torch.int32)}
    greedy = {}
    for i, (name, m) in enumerate(models.items()):
        m.save_pretrained(os.path.join(OUT, name), safe_serialization=True)
        m.zero_grad(set_to_none=True)
        logits, loss = loss_of(m, x, y)
        loss.backward()
        io[f"logits_{name}"] = logits.detach().float()
        io[f"loss_{name}"] = loss.detach().reshape(1)
        llama_ref.save_as_checkpoint(m, {n: p.grad for n, p in m.named_parameters()}, os.path.join(OUT, f"{name}_grads"))
        m.zero_grad(set_to_none=True)
        greedy[name] = llama_ref.greedy(m, 3 + i)
    save_file(io, os.path.join(OUT, "io.safetensors"))
    with open(os.path.join(OUT, "greedy.json"), "w") as f:
        json.dump(greedy, f)
        f.write("\n")
    for name, m in models.items():
        traj = llama_ref.trajectory(m)
        llama_ref.save_as_checkpoint(m, {n: p.detach() for n, p in m.named_parameters()},
                                     os.path.join(OUT, f"{name}_after10"))
        with open(os.path.join(OUT, f"trajectory_{name}.json"), "w") as f:
            json.dump(traj, f)
            f.write("\n")
        print(f"{name} losses:", ", ".join(f"{v:.5f}" for v in traj["losses"]))


def check_export(path):
    io = load_file(os.path.join(OUT, "io.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()
    name = model.config.model_type
    with torch.no_grad():
        logits = model(input_ids=io["input_ids"].long()).logits
    diff = (logits - io[f"logits_{name}"]).abs().max().item()
    ok = diff < 1e-5
    print(f"{name}: max |logits - reference| = {diff:.3g}: {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-export", metavar="DIR")
    a = ap.parse_args()
    if a.check_export:
        check_export(a.check_export)
    else:
        make()
