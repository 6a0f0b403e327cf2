#!/usr/bin/env python3
"""Hugging Face `transformers` Llama reference fixtures for llm.rs.

    pip install torch transformers safetensors numpy
    python scripts/make_llama_reference.py                    # mode 1: write the fixtures
    python scripts/make_llama_reference.py --check-export DIR # mode 2: check an llmrs export

Offline (HF_HUB_OFFLINE=1) and deterministic (fixed seeds, fp32 on the CPU, one thread,
deterministic algorithms, eager attention).

Mode 1 writes tests/fixtures/llama/:

  gqa/            a tiny LlamaForCausalLM (V=199, maxT=32, C=48, L=2, NH=6, KV=2 (grouped-
                  query attention), F=128, rope_theta 5e5 with Llama 3.1's `llama3`
                  rope_scaling, untied head, rms_norm_eps 1e-5): transformers' init (seed 0)
                  plus a seeded perturbation of every RMSNorm weight. save_pretrained, fp32.
  gqa_sharded/    the same model saved in shards (max_shard_size 150KB) with its index.
  gqa_bf16/       the same model cast to bfloat16.
  gqa_llmc.bin    the same model as llm.c's llama3 branch writes it (train_llama3.py's
                  write_model: magic 20240803, version 3, q and k rows in Meta's interleaved
                  layout, zero biases, up then gate in c_fc, the head in wpe's slot), with
                  multiple_of 128 and ffn_dim_multiplier 1.0 giving F = 128 (the form llmrs
                  writes: multiplier 1 and the largest power-of-two multiple_of that works).
  gqa_grads/      the gradients of the mean loss of batch 0, saved as a checkpoint of the
                  same names (so the Rust test reads them with its importer).
  gqa_after10/    the parameters after 10 AdamW steps (trajectory.json).
  tied/           a second model: tied head, attention_bias true, NH = KV = 4, no scaling.
  io.safetensors  input_ids, targets (2, 11); logits and loss of both models on them.
  trajectory.json the 10 steps (as scripts/make_reference.py's ref_trajectory.json):
                  batches, losses, gradient norms, learning rates, optimizer settings.
  greedy.json     `generate(do_sample=False)` of both models from a few prompts to maxT.

Mode 2 loads DIR with LlamaForCausalLM.from_pretrained and compares its logits on
io.safetensors' input_ids with the model whose config matches (gqa or tied): PASS when the
largest difference is below 1e-5.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import argparse
import json
import math
import shutil
import struct
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "llama")

V, MAX_T, C, L = 199, 32, 48, 2
B, T = 2, 11
STEPS, ACCUM = 10, 2
MAX_LR, WARMUP, FINAL_FRAC = 1e-3, 3, 0.1
BETA1, BETA2, EPS, WD, CLIP = 0.9, 0.95, 1e-8, 0.1, 1.0
MIN_GAP = 1e-3


def gqa_config():
    return LlamaConfig(
        vocab_size=V,
        hidden_size=C,
        intermediate_size=128,
        num_hidden_layers=L,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=MAX_T,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def tied_config():
    return LlamaConfig(
        vocab_size=V,
        hidden_size=C,
        intermediate_size=100,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=MAX_T,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build(config, seed):
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
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


def batch(gen):
    toks = torch.randint(0, V, (B, T + 1), generator=gen)
    return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


def loss_of(model, x, y):
    logits = model(input_ids=x).logits
    return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1))


def lr_at(step):
    if step < WARMUP:
        return MAX_LR * (step + 1) / WARMUP
    decay = (step - WARMUP) / (STEPS - WARMUP)
    min_lr = MAX_LR * FINAL_FRAC
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay)) * (MAX_LR - min_lr)


def save_as_checkpoint(model, tensors, path):
    """Tensors named as the model's parameters, saved with its config (for the Rust importer)."""
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    model.config.save_pretrained(path)


def trajectory(model):
    gen = torch.Generator().manual_seed(11)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=MAX_LR, betas=(BETA1, BETA2), eps=EPS, foreach=False, fused=False)
    inputs, targets, losses, norms, lrs = [], [], [], [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(ACCUM):
            x, y = batch(gen)
            inputs.append(x.flatten().tolist())
            targets.append(y.flatten().tolist())
            _, loss = loss_of(model, x, y)
            (loss / ACCUM).backward()
            total += loss.item()
        grads = [p.grad for p in model.parameters()]
        norm = torch.sqrt(sum((g * g).sum() for g in grads))
        if norm.item() > CLIP:
            for g in grads:
                g.mul_(CLIP / norm)
        lr = lr_at(step)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        losses.append(total / ACCUM)
        norms.append(norm.item())
        lrs.append(lr)
    return {
        "B": B, "T": T, "grad_accum_steps": ACCUM, "steps": STEPS,
        "optimizer": {"lr": MAX_LR, "warmup": WARMUP, "final_frac": FINAL_FRAC, "schedule": "cosine",
                      "beta1": BETA1, "beta2": BETA2, "eps": EPS, "weight_decay": WD, "grad_clip": CLIP},
        "inputs": inputs, "targets": targets, "losses": losses, "grad_norms": norms, "lrs": lrs,
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
    }


def write_llmc(model, path):
    """train_llama3.py's write_model (version 3, fp32) for this model, from its HF weights."""
    cfg = model.config
    nh, kv, hs = cfg.num_attention_heads, cfg.num_key_value_heads, C // cfg.num_attention_heads
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}

    def unpermute(w, n_heads, dim1, dim2):  # HF's rotate_half rows -> Meta's interleaved pairs
        return w.view(n_heads, 2, dim1 // n_heads // 2, dim2).transpose(1, 2).reshape(dim1, dim2)

    ints = [0] * 256
    ints[:12] = [20240803, 3, MAX_T, V, L, nh, kv, C, 128, 1, 3, 1]
    floats = [0.0] * 256
    theta = getattr(cfg, "rope_parameters", None) or {"rope_theta": getattr(cfg, "rope_theta", None)}
    floats[:3] = [1.0, cfg.rms_norm_eps, theta["rope_theta"]]
    assert 128 * math.ceil(int(2 * 4 * C / 3) * 1.0 / 128) == cfg.intermediate_size
    parts = [sd["model.embed_tokens.weight"], sd["lm_head.weight"]]
    lay = lambda l, n: sd[f"model.layers.{l}.{n}.weight"]
    qkv = [torch.cat([unpermute(lay(l, "self_attn.q_proj"), nh, nh * hs, C),
                      unpermute(lay(l, "self_attn.k_proj"), kv, kv * hs, C),
                      lay(l, "self_attn.v_proj")]) for l in range(L)]
    ln1 = [lay(l, "input_layernorm") for l in range(L)]
    ln2 = [lay(l, "post_attention_layernorm") for l in range(L)]
    proj = [lay(l, "self_attn.o_proj") for l in range(L)]
    fc = [torch.cat([lay(l, "mlp.up_proj"), lay(l, "mlp.gate_proj")]) for l in range(L)]
    down = [lay(l, "mlp.down_proj") for l in range(L)]
    zeros_of = lambda ts, rows: [torch.zeros(t.shape[0] if rows else t.shape) for t in ts]
    for group in [ln1, zeros_of(ln1, False), qkv, zeros_of(qkv, True), proj, zeros_of(proj, True), ln2,
                  zeros_of(ln2, False), fc, zeros_of(fc, True), down, zeros_of(down, True)]:
        parts += group
    parts += [sd["model.norm.weight"], torch.zeros(C)]
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *ints))
        f.write(struct.pack("<256f", *floats))
        for p in parts:
            f.write(p.contiguous().numpy().astype("<f4").tobytes())


def greedy(model, seed):
    """Prompts whose greedy choices are all more than MIN_GAP apart (closer ones could go either
    way between two fp32 implementations)."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for n in [1, 4, 9] * 100:
        if len(cases) == 3 or (cases and len(cases[-1]["prompt"]) == n):
            continue
        prompt = torch.randint(0, V, (1, n), generator=gen)
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                 max_new_tokens=MAX_T - n, min_new_tokens=MAX_T - n, pad_token_id=0,
                                 eos_token_id=None, output_scores=True, return_dict_in_generate=True)
        gaps = [float((s[0].topk(2).values[0] - s[0].topk(2).values[1]).item()) for s in out.scores]
        if min(gaps) > MIN_GAP:
            cases.append({"prompt": prompt[0].tolist(), "new": out.sequences[0, n:].tolist(), "min_gap": min(gaps)})
    assert len(cases) == 3, "no prompts with clear greedy choices"
    return cases


def make():
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    gqa, tied = build(gqa_config(), 0), build(tied_config(), 1)
    gqa.save_pretrained(os.path.join(OUT, "gqa"), safe_serialization=True)
    gqa.save_pretrained(os.path.join(OUT, "gqa_sharded"), safe_serialization=True, max_shard_size="150KB")
    assert os.path.isfile(os.path.join(OUT, "gqa_sharded", "model.safetensors.index.json"))
    LlamaForCausalLM.from_pretrained(os.path.join(OUT, "gqa")).to(torch.bfloat16).save_pretrained(
        os.path.join(OUT, "gqa_bf16"), safe_serialization=True)
    tied.save_pretrained(os.path.join(OUT, "tied"), safe_serialization=True)
    write_llmc(gqa, os.path.join(OUT, "gqa_llmc.bin"))
    x, y = batch(torch.Generator().manual_seed(9))
    io = {"input_ids": x.to(torch.int32), "targets": y.to(torch.int32)}
    for name, m in [("gqa", gqa), ("tied", tied)]:
        m.zero_grad(set_to_none=True)
        logits, loss = loss_of(m, x, y)
        loss.backward()
        io[f"logits_{name}"] = logits.detach().float()
        io[f"loss_{name}"] = loss.detach().reshape(1)
        if name == "gqa":
            save_as_checkpoint(m, {n: p.grad for n, p in m.named_parameters()}, os.path.join(OUT, "gqa_grads"))
        m.zero_grad(set_to_none=True)
    save_file(io, os.path.join(OUT, "io.safetensors"))
    with open(os.path.join(OUT, "greedy.json"), "w") as f:
        json.dump({"gqa": greedy(gqa, 3), "tied": greedy(tied, 4)}, f)
        f.write("\n")
    traj = trajectory(gqa)
    save_as_checkpoint(gqa, {n: p.detach() for n, p in gqa.named_parameters()}, os.path.join(OUT, "gqa_after10"))
    with open(os.path.join(OUT, "trajectory.json"), "w") as f:
        json.dump(traj, f)
        f.write("\n")
    print("losses:", ", ".join(f"{v:.5f}" for v in traj["losses"]))


def check_export(path):
    io = load_file(os.path.join(OUT, "io.safetensors"))
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()
    name = "tied" if model.config.tie_word_embeddings else "gqa"
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
