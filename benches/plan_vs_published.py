#!/usr/bin/env python3
"""Where `ferrotron plan` ranks the layouts published runs used (BENCHMARKS.md, "plan against
published runs"): for each run, the default search on its cluster and batch, the best-ranked
layout of the published cut (tp, pp, cp, dp, ep) among those that fit, its tokens/s against the
search's pick, and the pick. Run from the repository root after `cargo build --release`:

    python3 benches/plan_vs_published.py

It prints one Markdown row a run; nothing is assumed beyond the cut (the schedule, ZeRO stage,
recomputation and micro-batch are the search's best for that cut)."""
import json, subprocess, sys, tempfile, os

# (run, fixture, gpus, gpu, seq, sequences, published cut (tp, pp, cp, dp, ep))
RUNS = [
    ("Llama-3.1-8B, 128 seqs", "llama-3-8b", 8, "h100", 8192, 128, (1, 1, 2, 4, 1)),
    ("Llama-3.1-8B, 2048 seqs", "llama-3-8b", 128, "h100", 8192, 2048, (1, 1, 2, 64, 1)),
    ("Llama-3.1-70B, 128 seqs", "llama-3-70b", 64, "h100", 8192, 128, (4, 4, 2, 2, 1)),
    ("Llama-3.1-70B, 4096 seqs", "llama-3-70b", 2048, "h100", 8192, 4096, (4, 4, 2, 64, 1)),
    ("Llama-3.1-405B, 252 seqs", "llama-3.1-405b", 576, "h100", 8192, 252, (8, 9, 2, 4, 1)),
    ("Llama-3.1-405B, 1008 seqs", "llama-3.1-405b", 2304, "h100", 8192, 1008, (8, 9, 2, 16, 1)),
    ("Llama-3.1-405B, 16M tokens", "llama-3.1-405b", 8192, "h100", 8192, 2048, (8, 16, 1, 64, 1)),
    ("Llama-3.1-405B, 16M tokens", "llama-3.1-405b", 16384, "h100", 8192, 2048, (8, 16, 1, 128, 1)),
    ("Llama-3-8B, FSDP", "llama-3-8b", 64, "a100", 8192, 64, (1, 1, 1, 64, 1)),
    ("Llama-3-70B, FSDP", "llama-3-70b", 64, "a100", 8192, 64, (1, 1, 1, 64, 1)),
    ("Llama-3.1-70B, FSDP + cp", "llama-3-70b", 64, "h100", 8192, 128, (1, 1, 2, 32, 1)),
    ("Mixtral-8x22B", "mixtral-8x22b", 128, "h100", 4096, 256, (2, 8, 1, 8, 8)),
]


def cut(l):
    s = l["pp_schedule"] if l["pp"] > 1 else ""
    v = f" ×{l['pp_virtual_stages']}" if l["pp_virtual_stages"] > 1 else ""
    z = f"{l['zero_stage']}" + (f"h{l['dp_shard']}" if l["dp_shard"] else "") + ("o" if l["zero_reduce"] == "once" else "")
    return (f"dp {l['dp']} × tp {l['tp']}{' sp' if l['sequence_parallel'] else ''} × pp {l['pp']} {s}{v} × cp {l['cp']}"
            + (f" × ep {l['ep']}" if l["ep"] > 1 else "") + f", ZeRO {z}, mbs {l['micro_batch_size']}, {l['recompute']}")


def main():
    binary = os.path.join("target", "release", "ferrotron")
    print("| run | GPUs | published cut: rank, best variant | its tokens/s / pick's | pick (MFU) | / best without zero bubble |")
    print("| --- | --- | --- | ---: | --- | ---: |")
    for name, fixture, gpus, gpu, seq, seqs, (tp, pp, cp, dp, ep) in RUNS:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "plan.json")
            args = [binary, "plan", "--config", f"tests/fixtures/plan/{fixture}.json", "--gpus", str(gpus), "--gpu", gpu,
                    "--seq-len", str(seq), "--global-batch-tokens", str(seq * seqs), "--top", "1", "--json", out]
            subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
            layouts = [l for l in json.load(open(out))["layouts"] if l["fits"]]
        pick = layouts[0]
        # the schedules a 2024 framework ran (Megatron's 1F1B and interleaved): zero bubble aside
        older = next(l for l in layouts if l["pp"] == 1 or l["pp_schedule"] not in ("zb-h1", "zbv"))
        same = [(i, l) for i, l in enumerate(layouts) if (l["tp"], l["pp"], l["cp"], l["dp"], l["ep"]) == (tp, pp, cp, dp, ep)]
        if same:
            i, l = same[0]
            ours = f"{i + 1} of {len(layouts)}: {cut(l)}"
            ratio = f"{l['tokens_per_s'] / pick['tokens_per_s']:.2f}"
            against = f"{l['tokens_per_s'] / older['tokens_per_s']:.2f} ({cut(older)})"
        else:
            ours, ratio, against = f"does not fit (of {len(layouts)} that do)", "–", "–"
        print(f"| {name} | {gpus} {gpu.upper()} | {ours} | {ratio} | {cut(pick)} ({100 * pick['mfu']:.1f} %) | {against} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
