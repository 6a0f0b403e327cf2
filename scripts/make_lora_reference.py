#!/usr/bin/env python3
"""Hugging Face PEFT LoRA reference fixtures for llm.rs.

    pip install torch transformers peft safetensors numpy
    python scripts/make_lora_reference.py                                   # mode 1: write the fixtures
    python scripts/make_lora_reference.py --check-export DIR --base llama   # mode 2: check an llmrs adapter
    python scripts/make_lora_reference.py --check-merged DIR --base gpt2    # mode 2: check a merged export

Offline (HF_HUB_OFFLINE=1) and deterministic (fixed seeds, fp32 on the CPU, one thread,
deterministic algorithms, eager attention).

The base models are existing fixtures, read, never rewritten:
  llama: tests/fixtures/llama/gqa/          (V=199, C=48, L=2, NH=6, KV=2, F=128, untied head)
  gpt2:  tests/fixtures/hf/gpt2_tiny_fp32/  (V=251, C=48, L=2, NH=3, maxT=32, tied head)

Every adapter is PEFT's LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, bias="none",
task_type="CAUSAL_LM"), so PEFT scales B @ A by lora_alpha / r = 2 (no rslora, no DoRA), on
  llama: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (nn.Linear: A is
         (r, in), B is (out, r));
  gpt2:  c_attn, c_proj, c_fc with fan_in_fan_out=True (GPT-2's Conv1D stores its weight as
         (in, out); "c_proj" matches both attn.c_proj and mlp.c_proj). A and B are plain
         nn.Linear all the same, A (r, in) and B (out, r): fan_in_fan_out only transposes
         B @ A when merging into the (in, out) Conv1D weight.
get_peft_model under torch.manual_seed(0) (A: PEFT's kaiming-uniform init), then every lora_B,
which PEFT initialises to zero, replaced by 0.02 * randn (generator seed 1, named_parameters
order) so that the adapter changes the logits.

Mode 1 writes tests/fixtures/lora/, for M in llama and gpt2:

  M_adapter0/       the adapter before training: PeftModel.save_pretrained (adapter_config.json,
                    adapter_model.safetensors, PEFT's README.md), tensors named like
                    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight (llama) and
                    base_model.model.transformer.h.0.attn.c_attn.lora_B.weight (gpt2); the
                    base named by its path relative to the repository (base_model_name_or_path,
                    README.md) and target_modules written in the order above.
  M_adapter20/      the adapter after the 20 training steps of M_trajectory.json, saved the same way.
  M_merged0/        merge_and_unload() of base + M_adapter0: a plain LlamaForCausalLM /
                    GPT2LMHeadModel directory (save_pretrained, fp32).
  M_trajectory.json 20 AdamW steps on the adapter only (the base frozen, as PEFT leaves it), in
                    the layout of llama/trajectory.json (tests/common/trajectory.rs reads it):
                    B=2, T=16, one micro-batch a step, batches of seeded token ids in [0, V) (V
                    the base's vocabulary; generator seed 11 for llama, 12 for gpt2) with the
                    targets the next tokens, mean cross-entropy, torch.optim.AdamW over the
                    trainable parameters (lr 1e-3 constant, betas (0.9, 0.95), eps 1e-8,
                    weight_decay 0.1 on every LoRA matrix), clip_grad_norm_ at 1.0 before each
                    step (grad_norms are the norms before clipping); plus "lora" (r, alpha,
                    scaling, targets, fan_in_fan_out, dropout, bias, the trainable parameters'
                    names and count) and "peft_version".
  io.safetensors    input_ids, targets (2, 11) int32 (those of tests/fixtures/llama/io.safetensors,
                    all below both vocabularies), and for each M, fp32:
                      M_lora0_logits   (2, 11, V)  base + M_adapter0 (PeftModel, unmerged)
                      M_lora20_logits  (2, 11, V)  base + M_adapter20 (PeftModel, unmerged)
                      M_merged0_logits (2, 11, V)  M_merged0 loaded with AutoModelForCausalLM
                      M_lora0_loss, M_lora20_loss (1,) mean cross-entropy against targets
                    metadata: versions (torch, transformers and peft).

Mode 2:
  --check-export DIR --base M  loads the base M plus the PEFT adapter in DIR with
      PeftModel.from_pretrained and compares its logits on io.safetensors' input_ids with
      M_lora20_logits: PASS when the largest difference is below 1e-4.
  --check-merged DIR --base M  loads DIR with AutoModelForCausalLM and compares its logits with
      M_merged0_logits: PASS when the largest difference is below 1e-5.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import argparse
import json
import shutil
import sys
import warnings

import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()
warnings.filterwarnings("ignore", category=FutureWarning)
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "lora")
BASES = {"llama": "tests/fixtures/llama/gqa", "gpt2": "tests/fixtures/hf/gpt2_tiny_fp32"}
TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
}
BATCH_SEED = {"llama": 11, "gpt2": 12}

R, ALPHA, DROPOUT = 4, 8, 0.0
INIT_SEED, B_SEED, B_SCALE = 0, 1, 0.02
B, T, STEPS = 2, 16, 20
LR, BETA1, BETA2, EPS, WD, CLIP = 1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0
EXPORT_TOL, MERGED_TOL = 1e-4, 1e-5


def load_base(name):
    model, info = AutoModelForCausalLM.from_pretrained(
        os.path.join(ROOT, BASES[name]), attn_implementation="eager", local_files_only=True,
        output_loading_info=True)
    problems = {k: sorted(v) for k, v in info.items() if v}
    assert not problems, f"loading {BASES[name]}: {problems}"
    # Named relative to the repository, not by this machine's absolute path: PEFT copies the name
    # into adapter_config.json's base_model_name_or_path and into its README.md.
    model.name_or_path = model.config._name_or_path = BASES[name]
    return model.float().eval()


def lora_config(name):
    return LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS[name], lora_dropout=DROPOUT, bias="none",
                      task_type="CAUSAL_LM", fan_in_fan_out=(name == "gpt2"))


def load_adapter(name, path):
    model = PeftModel.from_pretrained(load_base(name), path, is_trainable=False)
    return model.float().eval()


def logits_of(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits.detach().float()


def loss_of(logits, y):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def batch(gen, vocab):
    toks = torch.randint(0, vocab, (B, T + 1), generator=gen)
    return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


def save_adapter(model, name, path):
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "adapter_config.json")) as f:
        cfg = json.load(f)
    assert cfg["base_model_name_or_path"] == BASES[name], cfg["base_model_name_or_path"]


def make_adapter(name):
    base = load_base(name)
    torch.manual_seed(INIT_SEED)
    model = get_peft_model(base, lora_config(name))
    # PEFT keeps target_modules as a set, which json would write in an order that changes from
    # run to run (string hashing): save them in the order given.
    model.peft_config["default"].target_modules = list(TARGETS[name])
    gen = torch.Generator().manual_seed(B_SEED)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(B_SCALE * torch.randn(p.shape, generator=gen))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable
    return model.eval()


def train(model, name):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    vocab = model.get_base_model().config.vocab_size
    opt = torch.optim.AdamW(params, lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD, foreach=False,
                            fused=False)
    gen = torch.Generator().manual_seed(BATCH_SEED[name])
    inputs, targets, losses, norms, lrs = [], [], [], [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = batch(gen, vocab)
        inputs.append(x.flatten().tolist())
        targets.append(y.flatten().tolist())
        loss = loss_of(model(input_ids=x).logits, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=False)
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
        lrs.append(LR)
    cfg = model.peft_config["default"]
    return {
        "B": B, "T": T, "grad_accum_steps": 1, "steps": STEPS,
        "optimizer": {"lr": LR, "warmup": 0, "final_frac": 1.0, "schedule": "constant",
                      "beta1": BETA1, "beta2": BETA2, "eps": EPS, "weight_decay": WD, "grad_clip": CLIP},
        "inputs": inputs, "targets": targets, "losses": losses, "grad_norms": norms, "lrs": lrs,
        "lora": {"r": cfg.r, "alpha": cfg.lora_alpha, "scaling": cfg.lora_alpha / cfg.r,
                 "targets": TARGETS[name], "fan_in_fan_out": cfg.fan_in_fan_out, "dropout": cfg.lora_dropout,
                 "bias": cfg.bias, "base": BASES[name], "vocab_size": vocab,
                 "trainable": [n for n, _ in named], "num_trainable_params": sum(p.numel() for p in params)},
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "peft_version": peft.__version__,
    }


def make():
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    ref = load_file(os.path.join(ROOT, "tests", "fixtures", "llama", "io.safetensors"))
    x, y = ref["input_ids"].long(), ref["targets"].long()
    io = {"input_ids": x.to(torch.int32), "targets": y.to(torch.int32)}
    for name in ["llama", "gpt2"]:
        a0, a20, m0 = (os.path.join(OUT, f"{name}_{s}") for s in ["adapter0", "adapter20", "merged0"])
        model = make_adapter(name)
        lora0 = logits_of(model, x)
        save_adapter(model, name, a0)
        traj = train(model, name)
        model.eval()
        lora20_mem = logits_of(model, x)
        save_adapter(model, name, a20)
        with open(os.path.join(OUT, f"{name}_trajectory.json"), "w") as f:
            json.dump(traj, f)
            f.write("\n")
        del model
        # What the saved adapters give when loaded back (the same bits as in memory).
        assert torch.equal(logits_of(load_adapter(name, a0), x), lora0), f"{name}: adapter0 reloaded"
        lora20 = logits_of(load_adapter(name, a20), x)
        assert torch.equal(lora20, lora20_mem), f"{name}: adapter20 reloaded"
        merged = load_adapter(name, a0).merge_and_unload()
        assert type(merged).__name__ in ("LlamaForCausalLM", "GPT2LMHeadModel"), type(merged)
        merged.float().save_pretrained(m0, safe_serialization=True)
        del merged
        merged0 = logits_of(AutoModelForCausalLM.from_pretrained(m0, attn_implementation="eager").float().eval(), x)
        io[f"{name}_lora0_logits"] = lora0
        io[f"{name}_lora20_logits"] = lora20
        io[f"{name}_merged0_logits"] = merged0
        io[f"{name}_lora0_loss"] = loss_of(lora0, y).reshape(1)
        io[f"{name}_lora20_loss"] = loss_of(lora20, y).reshape(1)
        base = logits_of(load_base(name), x)
        print(f"{name}: max |lora0 - base| = {(lora0 - base).abs().max().item():.3g}, "
              f"|merged0 - lora0| = {(merged0 - lora0).abs().max().item():.3g}, "
              f"|lora20 - lora0| = {(lora20 - lora0).abs().max().item():.3g}")
        print(f"{name} losses:", ", ".join(f"{v:.6f}" for v in traj["losses"]))
        print(f"{name} grad norms:", ", ".join(f"{v:.5f}" for v in traj["grad_norms"]))
    # One metadata key: safetensors writes a map of several in an order that changes between runs.
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}"
    save_file({k: v.contiguous() for k, v in io.items()}, os.path.join(OUT, "io.safetensors"),
              metadata={"versions": versions})


def report(what, name, logits, want, tol):
    diff = (logits - want).abs().max().item()
    ok = logits.shape == want.shape and diff < tol
    print(f"{name} {what}: max |logits - reference| = {diff:.3g} (tolerance {tol:g}): {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)


def check_export(path, name):
    io = load_file(os.path.join(OUT, "io.safetensors"))
    logits = logits_of(load_adapter(name, path), io["input_ids"].long())
    report("adapter", name, logits, io[f"{name}_lora20_logits"], EXPORT_TOL)


def check_merged(path, name):
    io = load_file(os.path.join(OUT, "io.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", local_files_only=True)
    logits = logits_of(model.float().eval(), io["input_ids"].long())
    report("merged", name, logits, io[f"{name}_merged0_logits"], MERGED_TOL)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-export", metavar="DIR")
    ap.add_argument("--check-merged", metavar="DIR")
    ap.add_argument("--base", choices=sorted(BASES))
    a = ap.parse_args()
    if (a.check_export or a.check_merged) and not a.base:
        ap.error("--check-export and --check-merged need --base llama|gpt2")
    if a.check_export:
        check_export(a.check_export, a.base)
    elif a.check_merged:
        check_merged(a.check_merged, a.base)
    else:
        make()
