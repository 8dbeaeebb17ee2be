#!/usr/bin/env python3
"""The PyTorch reference for `ferrotron bench`: the same Llama shapes, trained the way a PyTorch
user would (bf16 autocast over fp32 weights, SDPA flash attention, fused AdamW, optionally
torch.compile), measured and reported the same way (FLOP formula, peaks, warm-up excluded).

    python benches/torch_reference.py --config configs/smollm-135m.toml [--compile] [--json OUT]
    python benches/torch_reference.py --config configs/smollm-135m.toml --op attention

`--op attention` times one layer's attention alone, as `ferrotron bench --op attention` does:
F.scaled_dot_product_attention (causal, GQA) with the FlashAttention-2 backend and with cuDNN's,
forward and forward+backward, by CUDA events over the calls after the warm-up.

It reads a ferrotron TOML config (keys it leaves out take configs/tiny.toml's values, as in
ferrotron) and needs only PyTorch. Run it and `ferrotron bench` on the same GPU, one after the
other, and compare the tokens/s (BENCHMARKS.md).
"""
import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent

# Dense peak TFLOP/s (bf16 tensor cores, f32 CUDA cores) by a part of the GPU's name, as in
# src/commands/bench.rs; the first match wins.
PEAKS = [
    ("H100 PCIe", 756.5, 51.2),
    ("H100 NVL", 835.5, 60.0),
    ("H100", 989.4, 66.9),
    ("H200", 989.4, 66.9),
    ("A100", 312.0, 19.5),
    ("L40S", 362.1, 91.6),
    ("L40", 181.0, 90.5),
    ("RTX 4090", 165.2, 82.6),
    ("L4", 121.0, 30.3),
]


def parse_toml(text):
    """tomllib (Python 3.11+), else the subset ferrotron's configs use: [sections], key = value
    with strings, numbers and booleans, # comments."""
    try:
        import tomllib

        return tomllib.loads(text)
    except ImportError:
        pass
    cfg, section = {}, None
    for line in text.splitlines():
        line = line.split(" #")[0].strip() if not line.lstrip().startswith("#") else ""
        if line.startswith("["):
            section = cfg.setdefault(line.strip("[]"), {})
        elif "=" in line:
            key, value = (part.strip() for part in line.split("=", 1))
            section[key] = json.loads(value) if value not in ("true", "false") else value == "true"
    return cfg


def load_config(path):
    cfg = parse_toml((ROOT / "configs/tiny.toml").read_text())
    if path:
        for section, values in parse_toml(Path(path).read_text()).items():
            cfg.setdefault(section, {}).update(values)
    return cfg


def parameter_count(m):
    d, f, hd = m["hidden_size"], m["intermediate_size"], m.get("head_dim", m["hidden_size"] // m["num_attention_heads"])
    q, kv = m["num_attention_heads"] * hd, m["num_key_value_heads"] * hd
    layer = 2 * q * d + 2 * kv * d + 3 * f * d + 2 * d
    embeddings = (1 if m["tie_word_embeddings"] else 2) * m["vocab_size"] * d
    return embeddings + m["num_hidden_layers"] * layer + d


def flops_per_token(m, seq):
    """6·N + 12·L·(H·d_head)·S, N without an untied input embedding (a lookup): as src/commands/bench.rs."""
    hd = m.get("head_dim", m["hidden_size"] // m["num_attention_heads"])
    lookup = 0 if m["tie_word_embeddings"] else m["vocab_size"] * m["hidden_size"]
    return 6 * (parameter_count(m) - lookup) + 12 * m["num_hidden_layers"] * m["num_attention_heads"] * hd * seq


class Block(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        d, f = m["hidden_size"], m["intermediate_size"]
        self.h, self.kv = m["num_attention_heads"], m["num_key_value_heads"]
        self.hd = m.get("head_dim", d // self.h)
        self.eps = m["rms_norm_eps"]
        self.ln1, self.ln2 = torch.nn.Parameter(torch.ones(d)), torch.nn.Parameter(torch.ones(d))
        self.q = torch.nn.Linear(d, self.h * self.hd, bias=False)
        self.k = torch.nn.Linear(d, self.kv * self.hd, bias=False)
        self.v = torch.nn.Linear(d, self.kv * self.hd, bias=False)
        self.o = torch.nn.Linear(self.h * self.hd, d, bias=False)
        self.gate = torch.nn.Linear(d, f, bias=False)
        self.up = torch.nn.Linear(d, f, bias=False)
        self.down = torch.nn.Linear(f, d, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        xn = F.rms_norm(x, (x.shape[-1],), self.ln1, self.eps)
        q = self.q(xn).view(b, s, self.h, self.hd).transpose(1, 2)
        k = self.k(xn).view(b, s, self.kv, self.hd).transpose(1, 2)
        v = self.v(xn).view(b, s, self.kv, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        xn = F.rms_norm(x, (x.shape[-1],), self.ln2, self.eps)
        return x + self.down(F.silu(self.gate(xn)) * self.up(xn))


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)  # in q's dtype: bf16 under autocast


class Llama(torch.nn.Module):
    def __init__(self, m, seq):
        super().__init__()
        self.embed = torch.nn.Embedding(m["vocab_size"], m["hidden_size"])
        self.blocks = torch.nn.ModuleList(Block(m) for _ in range(m["num_hidden_layers"]))
        self.norm = torch.nn.Parameter(torch.ones(m["hidden_size"]))
        self.eps = m["rms_norm_eps"]
        self.head = None if m["tie_word_embeddings"] else torch.nn.Linear(m["hidden_size"], m["vocab_size"], bias=False)
        hd = self.blocks[0].hd
        inv = 1.0 / (m["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=m.get("initializer_range", 0.02))

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        x = F.rms_norm(x, (x.shape[-1],), self.norm, self.eps)
        logits = x @ (self.embed.weight if self.head is None else self.head.weight).t()
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def attention_op(cfg, args):
    """SDPA's flash and cuDNN backends on the config's attention shapes (bf16, causal, GQA)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m, t = cfg["model"], cfg["train"]
    b, s, h, kv = t["micro_batch_size"], t["seq_len"], m["num_attention_heads"], m["num_key_value_heads"]
    d = m.get("head_dim", m["hidden_size"] // h)
    flops = 4 * b * h * s * s * d / 2  # the causal half, as src/commands/bench_attention.rs
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    report = {"device": torch.cuda.get_device_name(0), "shape": [b, s, h, kv, d], "framework": f"pytorch {torch.__version__}"}

    def timed(work):
        for _ in range(args.warmup):
            work()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(args.steps):
            work()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / args.steps

    for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
        try:
            with sdpa_kernel(backend):
                sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != h)
                forward = timed(lambda: sdpa().detach())
                both = timed(lambda: torch.autograd.grad(sdpa(), (q, k, v), dout))
            report[name] = {"forward_ms": forward, "forward_tflops": flops / forward / 1e9,
                            "forward_backward_ms": both, "forward_backward_tflops": 3.5 * flops / both / 1e9}
            print(f"{name:<7} forward {forward:.3f} ms ({flops / forward / 1e9:.1f} TFLOP/s), "
                  f"forward+backward {both:.3f} ms ({3.5 * flops / both / 1e9:.1f} TFLOP/s)")
        except RuntimeError as e:  # a backend this build or GPU lacks
            print(f"{name:<7} not available: {str(e).splitlines()[0]}")
    text = json.dumps(report)
    print(f"json: {text}")
    if args.json:
        Path(args.json).write_text(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="a ferrotron TOML config")
    ap.add_argument("--steps", type=int, default=10, help="steps measured after the warm-up")
    ap.add_argument("--warmup", type=int, default=3, help="steps run first and not measured")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--dtype", choices=["bf16", "f32"], help="default: the config's device.dtype (auto: bf16 on a GPU)")
    ap.add_argument("--peak-tflops", type=float, help="peak of one device, for the MFU (default: by GPU name)")
    ap.add_argument("--json", help="also write the JSON to this file")
    ap.add_argument("--op", choices=["attention"], help="time one op alone (GPU, bf16) instead of a training step")
    args = ap.parse_args()

    cfg = load_config(args.config)
    if args.op == "attention":
        if not torch.cuda.is_available():
            raise SystemExit("error: --op attention times GPU kernels and PyTorch sees no GPU")
        return attention_op(cfg, args)
    m, t = cfg["model"], cfg["train"]
    cuda = torch.cuda.is_available()
    if cfg.get("device", {}).get("kind") == "cuda" and not cuda:
        raise SystemExit("error: this config asks for device.kind = \"cuda\" and PyTorch sees no GPU")
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = args.dtype or cfg.get("device", {}).get("dtype", "auto")
    bf16 = dtype == "bf16" or (dtype == "auto" and cuda)
    torch.backends.cuda.matmul.allow_tf32 = False  # f32 means f32, as in ferrotron
    torch.manual_seed(t["seed"])
    seq, batch, accum = t["seq_len"], t["micro_batch_size"], t["grad_accum_steps"]
    model = Llama(m, seq).to(dev)
    # as ferrotron: weight decay on matrices only, not on norm weights
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": t["weight_decay"]},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=t["lr"], betas=(t["beta1"], t["beta2"]), eps=t["adam_eps"], fused=cuda)
    step_fn = torch.compile(model) if args.compile else model
    tokens = torch.randint(0, m["vocab_size"], (accum, batch, seq + 1), device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        for micro in range(accum):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                loss = step_fn(tokens[micro, :, :-1], tokens[micro, :, 1:]) / accum
            loss.backward()
        if t["grad_clip"] > 0:  # 0: no clipping, as in ferrotron
            torch.nn.utils.clip_grad_norm_(model.parameters(), t["grad_clip"])
        opt.step()
        return loss

    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if i + 1 == args.warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
    step_s = sum(times[args.warmup:]) / args.steps
    tokens_per_step = batch * accum * seq
    flops = flops_per_token(m, seq)
    achieved = flops * tokens_per_step / step_s / 1e12
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = args.peak_tflops or next((bf if bf16 else f32 for part, bf, f32 in PEAKS if part in name), None)
    report = {
        "device": name,
        "dtype": "bf16" if bf16 else "f32",
        "framework": f"pytorch {torch.__version__}" + (" + torch.compile" if args.compile else " eager"),
        "parameters": parameter_count(m),
        "seq_len": seq,
        "tokens_per_step": tokens_per_step,
        "warmup_steps": args.warmup,
        "measured_steps": args.steps,
        "step_ms": step_s * 1e3,
        "tokens_per_s": tokens_per_step / step_s,
        "flops_per_token": flops,
        "achieved_tflops": achieved,
        "peak_tflops": peak,
        "mfu": achieved / peak if peak else None,
        "gpu_peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
    }
    rows = [
        ("device", f"{name} ({report['dtype']}, {report['framework']})"),
        ("parameters", f"{report['parameters'] / 1e6:.1f}M"),
        ("tokens per step", f"{tokens_per_step} (sequence {seq})"),
        ("step time", f"{report['step_ms']:.1f} ms (mean of {args.steps} steps after {args.warmup} warm-up)"),
        ("tokens/s", f"{report['tokens_per_s']:.0f}"),
        ("model TFLOP/s", f"{achieved:.2f} ({flops / 1e9:.3f} GFLOP per token)"),
        ("MFU", f"{100 * report['mfu']:.1f}% of {peak:.1f} TFLOP/s" if peak else "n/a"),
        ("peak memory", f"{report['gpu_peak_mib']:.0f} MiB (torch.cuda.max_memory_allocated)" if cuda else "n/a"),
    ]
    for k, v in rows:
        print(f"{k:<20} {v}")
    text = json.dumps(report)
    print(f"json: {text}")
    if args.json:
        Path(args.json).write_text(text)
    assert math.isfinite(step_s)


if __name__ == "__main__":
    main()
