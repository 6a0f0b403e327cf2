#!/usr/bin/env python3
"""Generate PyTorch reference fixtures for the llm.rs GPT-2 trainer.

How to run (from the repository root):

    pip install torch numpy && python scripts/make_reference.py

The script is fully deterministic (fixed seeds, fp32 on CPU, one thread,
deterministic algorithms) and writes these files under tests/fixtures/
(all binary data little-endian):

  ref_init.bin
      A tiny GPT-2 freshly initialised with the "llm.c init" (seed 42, normal
      draws in a fixed order), saved in llm.c's model-file format (256 x int32
      header, magic 20240326, version 3 = fp32, then all parameters as fp32).
      Used to test that the Rust initialisation reproduces PyTorch bit-for-bit
      (or within fp tolerance) and that the checkpoint writer matches.

  ref_model.bin
      The same model after a deterministic perturbation (seed 1234) so that
      biases and LayerNorm weights/biases are non-trivial. Same format.
      Used as the starting model for the two fixtures below and to test the
      checkpoint reader.

  ref_debug_state.bin
      llm.c's debug-state format (256 x int32 header, magic 20240327,
      version 2, B, T), followed by inputs (B,T) int32, targets (B,T) int32,
      logits (B,T,V) fp32, the mean cross-entropy loss (1 fp32) and the
      gradients of every parameter (same order/shapes as the model file, wte
      gradient zero-padded to Vp rows), from one forward+backward pass of
      ref_model.bin. Used to test the forward and backward passes.

  ref_trajectory.json
      10 AdamW training steps from ref_model.bin with 2-way gradient
      accumulation, global-norm gradient clipping (llm.c semantics) and
      llm.c's warmup + cosine learning-rate schedule. Records the token
      batches, per-step losses, gradient norms (before clipping) and learning
      rates. Used to test the optimizer / training loop end to end.
"""

import hashlib
import json
import math
import os
import struct

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------
# Configuration

VOCAB_SIZE = 251  # V
PADDED_VOCAB_SIZE = ((VOCAB_SIZE + 127) // 128) * 128  # Vp = 256
NUM_LAYERS = 2  # L
NUM_HEADS = 3  # NH
CHANNELS = 48  # C
MAX_SEQ_LEN = 32  # maxT

B = 3  # micro-batch size
T = 13  # sequence length

INIT_SEED = 42
PERTURB_SEED = 1234
DEBUG_DATA_SEED = 7
TRAJ_DATA_SEED = 11

# Optimizer / training-loop settings for the trajectory fixture.
TRAIN_STEPS = 10
GRAD_ACCUM_STEPS = 2
MAX_LR = 1e-3
WARMUP_STEPS = 3
FINAL_LR_FRAC = 0.1
BETA1, BETA2 = 0.9, 0.95
ADAM_EPS = 1e-8
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0

MODEL_MAGIC, MODEL_VERSION = 20240326, 3
STATE_MAGIC, STATE_VERSION = 20240327, 2
HEADER_INTS = 256
LN_EPS = 1e-5

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE_DIR = os.path.join(REPO_ROOT, "tests", "fixtures")

assert PADDED_VOCAB_SIZE == 256
assert CHANNELS % NUM_HEADS == 0

# ----------------------------------------------------------------------------
# Model (nanoGPT / llm.c flavoured GPT-2, fp32)


class CausalSelfAttention(nn.Module):
    def __init__(self, C, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(C, 3 * C)  # q, k, v along the output dim
        self.c_proj = nn.Linear(C, C)

    def forward(self, x):
        Bx, Tx, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, NH, T, hs)
        q = q.view(Bx, Tx, self.n_head, hs).transpose(1, 2)
        k = k.view(Bx, Tx, self.n_head, hs).transpose(1, 2)
        v = v.view(Bx, Tx, self.n_head, hs).transpose(1, 2)
        # Explicit causal attention (no fused kernels, for clarity).
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        causal = torch.ones(Tx, Tx, dtype=torch.bool).tril()
        att = att.masked_fill(~causal, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v  # (B, NH, T, hs)
        y = y.transpose(1, 2).contiguous().view(Bx, Tx, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.c_fc = nn.Linear(C, 4 * C)
        self.c_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, C, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C, eps=LN_EPS)
        self.attn = CausalSelfAttention(C, n_head)
        self.ln_2 = nn.LayerNorm(C, eps=LN_EPS)
        self.mlp = MLP(C)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB_SIZE, CHANNELS)
        self.wpe = nn.Embedding(MAX_SEQ_LEN, CHANNELS)
        self.h = nn.ModuleList(Block(CHANNELS, NUM_HEADS) for _ in range(NUM_LAYERS))
        self.ln_f = nn.LayerNorm(CHANNELS, eps=LN_EPS)

    def forward(self, idx, targets=None):
        _, Tx = idx.shape
        pos = torch.arange(Tx, dtype=torch.long)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        logits = x @ self.wte.weight.t()  # tied LM head, (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def llmc_init(model):
    """llm.c-style init: normal draws from the global RNG in a fixed order."""
    torch.manual_seed(INIT_SEED)
    proj_std = 0.02 / math.sqrt(2 * NUM_LAYERS)
    with torch.no_grad():
        torch.nn.init.normal_(model.wte.weight, mean=0.0, std=0.02)
        torch.nn.init.normal_(model.wpe.weight, mean=0.0, std=0.02)
        for block in model.h:
            torch.nn.init.normal_(block.attn.c_attn.weight, mean=0.0, std=0.02)
            torch.nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=proj_std)
            torch.nn.init.normal_(block.mlp.c_fc.weight, mean=0.0, std=0.02)
            torch.nn.init.normal_(block.mlp.c_proj.weight, mean=0.0, std=proj_std)
        # Deterministic (non-random) parts: biases 0, LayerNorm weight 1 / bias 0.
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif _is_layernorm_weight(name):
                p.fill_(1.0)


def _is_layernorm_weight(name):
    return name.endswith(".weight") and (".ln_" in name or name.startswith("ln_"))


def perturb(model):
    """Make biases and LayerNorm params non-trivial, with a private generator."""
    g = torch.Generator().manual_seed(PERTURB_SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if _is_layernorm_weight(name):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):  # linear biases and LayerNorm biases
                p.copy_(0.02 * torch.randn(p.shape, generator=g))


# ----------------------------------------------------------------------------
# llm.c file layout


def layout(model):
    """Parameters as [(name, tensor)] in llm.c's order, stacked over layers."""
    return _layout(model, lambda p: p.detach())


def grad_layout(model):
    """Same as layout() but for the .grad of every parameter."""
    return _layout(model, lambda p: p.grad.detach())


def _layout(model, get):
    hs = model.h

    def stack(fn):
        return torch.stack([get(fn(b)) for b in hs])

    wte = torch.zeros(PADDED_VOCAB_SIZE, CHANNELS)
    wte[:VOCAB_SIZE] = get(model.wte.weight)
    return [
        ("wte", wte),  # (Vp, C), padded rows are zero
        ("wpe", get(model.wpe.weight)),  # (maxT, C)
        ("ln1w", stack(lambda b: b.ln_1.weight)),  # (L, C)
        ("ln1b", stack(lambda b: b.ln_1.bias)),  # (L, C)
        ("qkvw", stack(lambda b: b.attn.c_attn.weight)),  # (L, 3C, C)
        ("qkvb", stack(lambda b: b.attn.c_attn.bias)),  # (L, 3C)
        ("attprojw", stack(lambda b: b.attn.c_proj.weight)),  # (L, C, C)
        ("attprojb", stack(lambda b: b.attn.c_proj.bias)),  # (L, C)
        ("ln2w", stack(lambda b: b.ln_2.weight)),  # (L, C)
        ("ln2b", stack(lambda b: b.ln_2.bias)),  # (L, C)
        ("fcw", stack(lambda b: b.mlp.c_fc.weight)),  # (L, 4C, C)
        ("fcb", stack(lambda b: b.mlp.c_fc.bias)),  # (L, 4C)
        ("fcprojw", stack(lambda b: b.mlp.c_proj.weight)),  # (L, C, 4C)
        ("fcprojb", stack(lambda b: b.mlp.c_proj.bias)),  # (L, C)
        ("lnfw", get(model.ln_f.weight)),  # (C,)
        ("lnfb", get(model.ln_f.bias)),  # (C,)
    ]


def expected_shapes():
    Vp, C, L, maxT = PADDED_VOCAB_SIZE, CHANNELS, NUM_LAYERS, MAX_SEQ_LEN
    return [
        ("wte", (Vp, C)), ("wpe", (maxT, C)),
        ("ln1w", (L, C)), ("ln1b", (L, C)),
        ("qkvw", (L, 3 * C, C)), ("qkvb", (L, 3 * C)),
        ("attprojw", (L, C, C)), ("attprojb", (L, C)),
        ("ln2w", (L, C)), ("ln2b", (L, C)),
        ("fcw", (L, 4 * C, C)), ("fcb", (L, 4 * C)),
        ("fcprojw", (L, C, 4 * C)), ("fcprojb", (L, C)),
        ("lnfw", (C,)), ("lnfb", (C,)),
    ]


NUM_PARAMS = sum(math.prod(s) for _, s in expected_shapes())


def header(values):
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[: len(values)] = values
    return h.tobytes()


def f32_bytes(t):
    return t.detach().contiguous().numpy().astype("<f4", copy=False).tobytes()


def write_tensors(f, tensors):
    for (name, t), (ename, shape) in zip(tensors, expected_shapes()):
        assert name == ename and tuple(t.shape) == shape, (name, tuple(t.shape), shape)
        f.write(f32_bytes(t))


def write_model(model, path):
    with open(path, "wb") as f:
        f.write(header([MODEL_MAGIC, MODEL_VERSION, MAX_SEQ_LEN, VOCAB_SIZE,
                        NUM_LAYERS, NUM_HEADS, CHANNELS, PADDED_VOCAB_SIZE]))
        write_tensors(f, layout(model))


def read_model(path):
    """Parse an llm.c model file back into a fresh GPT (round-trip check)."""
    data = open(path, "rb").read()
    hdr = np.frombuffer(data, dtype="<i4", count=HEADER_INTS)
    assert list(hdr[:8]) == [MODEL_MAGIC, MODEL_VERSION, MAX_SEQ_LEN, VOCAB_SIZE,
                             NUM_LAYERS, NUM_HEADS, CHANNELS, PADDED_VOCAB_SIZE]
    assert not hdr[8:].any()
    flat = np.frombuffer(data, dtype="<f4", offset=4 * HEADER_INTS)
    assert flat.size == NUM_PARAMS
    tensors, off = {}, 0
    for name, shape in expected_shapes():
        n = math.prod(shape)
        tensors[name] = torch.from_numpy(flat[off:off + n].copy()).view(shape)
        off += n
    assert not tensors["wte"][VOCAB_SIZE:].any(), "padded wte rows must be zero"

    model = GPT()
    with torch.no_grad():
        model.wte.weight.copy_(tensors["wte"][:VOCAB_SIZE])
        model.wpe.weight.copy_(tensors["wpe"])
        model.ln_f.weight.copy_(tensors["lnfw"])
        model.ln_f.bias.copy_(tensors["lnfb"])
        for l, b in enumerate(model.h):
            b.ln_1.weight.copy_(tensors["ln1w"][l])
            b.ln_1.bias.copy_(tensors["ln1b"][l])
            b.attn.c_attn.weight.copy_(tensors["qkvw"][l])
            b.attn.c_attn.bias.copy_(tensors["qkvb"][l])
            b.attn.c_proj.weight.copy_(tensors["attprojw"][l])
            b.attn.c_proj.bias.copy_(tensors["attprojb"][l])
            b.ln_2.weight.copy_(tensors["ln2w"][l])
            b.ln_2.bias.copy_(tensors["ln2b"][l])
            b.mlp.c_fc.weight.copy_(tensors["fcw"][l])
            b.mlp.c_fc.bias.copy_(tensors["fcb"][l])
            b.mlp.c_proj.weight.copy_(tensors["fcprojw"][l])
            b.mlp.c_proj.bias.copy_(tensors["fcprojb"][l])
    return model


def assert_models_equal(a, b):
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb), f"round-trip mismatch in {na}"


# ----------------------------------------------------------------------------
# Data, schedule


def sample_batch(gen):
    """One (B, T+1) random token block -> inputs x = [:, :-1], targets y = [:, 1:]."""
    tokens = torch.randint(0, VOCAB_SIZE, (B, T + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lr_at(step):
    """llm.c's linear-warmup + cosine-decay schedule (step is 0-based)."""
    if step < WARMUP_STEPS:
        return MAX_LR * (step + 1) / WARMUP_STEPS
    decay = (step - WARMUP_STEPS) / (TRAIN_STEPS - WARMUP_STEPS)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay))
    min_lr = MAX_LR * FINAL_LR_FRAC
    return min_lr + coeff * (MAX_LR - min_lr)


# ----------------------------------------------------------------------------
# Fixture writers


def write_debug_state(model, path):
    gen = torch.Generator().manual_seed(DEBUG_DATA_SEED)
    x, y = sample_batch(gen)
    model.zero_grad(set_to_none=True)
    logits, loss = model(x, y)
    loss.backward()
    assert logits.shape == (B, T, VOCAB_SIZE)
    with open(path, "wb") as f:
        f.write(header([STATE_MAGIC, STATE_VERSION, B, T]))
        f.write(x.numpy().astype("<i4").tobytes())
        f.write(y.numpy().astype("<i4").tobytes())
        f.write(f32_bytes(logits))
        f.write(struct.pack("<f", loss.item()))
        write_tensors(f, grad_layout(model))
    return loss.item()


def run_trajectory(model, path):
    gen = torch.Generator().manual_seed(TRAJ_DATA_SEED)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() == 2 else no_decay).append(p)
    # 2-D params are exactly wte, wpe and the Linear weights.
    assert len(decay) == 2 + 4 * NUM_LAYERS
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=MAX_LR, betas=(BETA1, BETA2), eps=ADAM_EPS, foreach=False, fused=False)

    inputs, targets, losses, grad_norms, lrs = [], [], [], [], []
    for step in range(TRAIN_STEPS):
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for _ in range(GRAD_ACCUM_STEPS):
            x, y = sample_batch(gen)
            inputs.append(x.flatten().tolist())
            targets.append(y.flatten().tolist())
            _, loss = model(x, y)
            (loss / GRAD_ACCUM_STEPS).backward()  # accumulated grads = mean
            step_loss += loss.item()
        # Global L2 norm of all gradients, fp32, plain sum of squares.
        grads = [p.grad for p in model.parameters()]
        norm = torch.sqrt(sum((g * g).sum() for g in grads))
        if norm.item() > GRAD_CLIP:  # llm.c: scale = clip / norm
            scale = GRAD_CLIP / norm
            for g in grads:
                g.mul_(scale)
        lr = lr_at(step)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        losses.append(step_loss / GRAD_ACCUM_STEPS)
        grad_norms.append(norm.item())
        lrs.append(lr)

    out = {
        "config": {
            "max_seq_len": MAX_SEQ_LEN,
            "vocab_size": VOCAB_SIZE,
            "padded_vocab_size": PADDED_VOCAB_SIZE,
            "num_layers": NUM_LAYERS,
            "num_heads": NUM_HEADS,
            "channels": CHANNELS,
        },
        "B": B,
        "T": T,
        "grad_accum_steps": GRAD_ACCUM_STEPS,
        "optimizer": {
            "lr": MAX_LR, "warmup": WARMUP_STEPS, "final_frac": FINAL_LR_FRAC,
            "schedule": "cosine", "beta1": BETA1, "beta2": BETA2, "eps": ADAM_EPS,
            "weight_decay": WEIGHT_DECAY, "grad_clip": GRAD_CLIP,
        },
        "steps": TRAIN_STEPS,
        "inputs": inputs,
        "targets": targets,
        "losses": losses,
        "grad_norms": grad_norms,
        "lrs": lrs,
        "torch_version": torch.__version__,
    }
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    return losses, grad_norms, lrs


# ----------------------------------------------------------------------------


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)
    os.makedirs(FIXTURE_DIR, exist_ok=True)
    p = lambda name: os.path.join(FIXTURE_DIR, name)

    # Build the model, consuming no RNG beyond the llm.c init draws.
    model = GPT()
    llmc_init(model)
    write_model(model, p("ref_init.bin"))
    assert_models_equal(model, read_model(p("ref_init.bin")))

    perturb(model)
    write_model(model, p("ref_model.bin"))
    # Round trip: everything below runs on the model *read back* from disk.
    model = read_model(p("ref_model.bin"))
    write_model(model, p("ref_model_rt.tmp"))
    with open(p("ref_model.bin"), "rb") as a, open(p("ref_model_rt.tmp"), "rb") as b:
        assert a.read() == b.read(), "ref_model.bin round trip is not byte-exact"
    os.remove(p("ref_model_rt.tmp"))

    ref_loss = write_debug_state(model, p("ref_debug_state.bin"))

    losses, grad_norms, lrs = run_trajectory(read_model(p("ref_model.bin")),
                                             p("ref_trajectory.json"))

    # Size checks.
    model_bytes = 4 * HEADER_INTS + 4 * NUM_PARAMS
    state_bytes = (4 * HEADER_INTS + 2 * 4 * B * T + 4 * B * T * VOCAB_SIZE + 4
                   + 4 * NUM_PARAMS)
    for name, size in [("ref_init.bin", model_bytes), ("ref_model.bin", model_bytes),
                       ("ref_debug_state.bin", state_bytes)]:
        actual = os.path.getsize(p(name))
        assert actual == size, f"{name}: {actual} bytes, expected {size}"
    total = sum(os.path.getsize(p(n)) for n in
                ["ref_init.bin", "ref_model.bin", "ref_debug_state.bin", "ref_trajectory.json"])
    assert total < 2 * 1024 * 1024, total

    print(f"torch {torch.__version__}, {NUM_PARAMS} params (padded)")
    for name in ["ref_init.bin", "ref_model.bin", "ref_debug_state.bin", "ref_trajectory.json"]:
        digest = hashlib.sha256(open(p(name), "rb").read()).hexdigest()[:16]
        print(f"  tests/fixtures/{name}: {os.path.getsize(p(name))} bytes sha256:{digest}")
    print(f"debug-state loss: {ref_loss!r}")
    print("trajectory losses:", ", ".join(f"{l:.6f}" for l in losses[:5]), "...")
    print("grad norms:", ", ".join(f"{g:.4f}" for g in grad_norms[:5]), "...")
    print("lrs:", ", ".join(f"{lr:.3g}" for lr in lrs))


if __name__ == "__main__":
    main()
