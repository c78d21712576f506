"""Train -> generation resharding of a Qwen2.5-7B-shaped model (random bf16 weights) on N GPUs.

    torchrun --nproc_per_node=4 benchmarks/bench_reshard.py [--quick]

For each training layout (tp=N; tp=N/2 x pp=2) and each generation tp_g that needs a reshard, it
times entering and leaving `Resharder.generation()` (median of a few rounds, both ending in a CUDA
sync), counts the bytes each rank receives, and times one plain NCCL all-gather of the same bytes
in the same micro-DP groups in the same run: the bound the reshard is measured against. Memory: "extra"
is what is allocated during generation beyond the training state (the training shard is released,
so with tp_g <= tp it is gen - train), "peak extra" the allocator's peak above it. The
first round also checks that the training shards come back bit for bit.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import ModelConfig, Transformer  # noqa: E402
from parallel import init_distributed, make_layout, world_all_reduce  # noqa: E402
from reshard import Resharder, valid_generation_tp  # noqa: E402

QWEN7B = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064, hidden_size=3584,
              intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
              max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)
GB = 1e9


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def bench(cfg, tp, pp, tp_g, rounds, dev):
    lay = make_layout(tp, pp)
    model = Transformer(cfg, lay, dtype=torch.bfloat16, device=dev)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    train_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    r = Resharder(model, lay, tp_g)
    # warm-up round (communicators, allocator) with the bit-for-bit check
    before = [p.detach().clone() for p in model.parameters()]
    with r.generation():
        pass
    same = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    del before
    torch.cuda.empty_cache()
    enter, leave, peak, steady = [], [], [], []
    for _ in range(rounds):
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        with r.generation():
            steady.append(torch.cuda.memory_allocated(dev) - base)
        enter.append(r.stats["enter_s"])
        leave.append(r.stats["exit_s"])
        peak.append(torch.cuda.max_memory_allocated(dev) - base)
    # the bound: one flat in-place all-gather of the same bytes in the same groups
    m, recv = len(r.micro_ranks), r.stats["recv_bytes"]
    bound = []
    if m > 1:  # (ranks of different stages receive different bytes: every rank gathers the largest share)
        per = (int(world_all_reduce(torch.tensor(recv, device=dev), dist.ReduceOp.MAX)) // (m - 1)) // 2
        buf = torch.empty(m * per, dtype=torch.bfloat16, device=dev)
        mine = buf[r.me * per:(r.me + 1) * per]
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        for _ in range(rounds + 1):
            bound.append(timed(lambda: gather(buf, mine, group=r.group)))
        bound = bound[1:]
        del buf, mine
    row = dict(train=f"tp{tp} pp{pp}", tp_g=tp_g, m=m, buckets=r.stats["buckets"], recv_gb=recv / GB,
               enter_ms=1e3 * statistics.median(enter), exit_ms=1e3 * statistics.median(leave),
               bound_ms=1e3 * statistics.median(bound) if bound else 0.0,
               train_gb=train_bytes / GB, gen_gb=r.stats["gen_bytes"] / GB, steady_gb=max(steady) / GB,
               peak_gb=max(peak) / GB, bitwise=same)
    # the slowest rank decides: gather every rank's row
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    del r, model
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="4 layers, 2 rounds")
    args = ap.parse_args()
    dev, rank, world = init_distributed("cuda")
    cfg = ModelConfig.from_hf(dict(QWEN7B, num_hidden_layers=4) if args.quick else QWEN7B)
    rounds = 2 if args.quick else 5
    layouts = [(world, 1)] + ([(world // 2, 2)] if world >= 4 else [(1, 2)] if world == 2 else [])
    out = []
    for tp, pp in layouts:
        for tp_g in valid_generation_tp(world, tp, pp):
            if tp_g == tp and pp == 1:  # nothing moves (tp_g > num_kv_heads replicates the KV heads)
                continue
            rows = bench(cfg, tp, pp, tp_g, rounds, dev)
            worst = max(rows, key=lambda x: x["enter_ms"])
            out.append(dict(worst, peak_gb=max(x["peak_gb"] for x in rows), bitwise=all(x["bitwise"] for x in rows)))
    if rank == 0:
        print(f"\nQwen2.5-7B shapes{' (4 layers)' if args.quick else ''}, bf16, {world}x "
              f"{torch.cuda.get_device_name()}; times are the slowest rank's medians")
        head = ("train", "tp_g", "m", "buckets", "recv GB/rank", "enter ms", "exit ms", "all-gather ms",
                "enter/bound", "GB/s", "train GB", "gen GB", "extra GB", "peak extra GB", "bitwise")
        print(" | ".join(head))
        for x in out:
            bw = x["recv_gb"] / (x["enter_ms"] / 1e3) if x["enter_ms"] else 0.0
            ratio = x["enter_ms"] / x["bound_ms"] if x["bound_ms"] else float("nan")
            print(" | ".join([x["train"], str(x["tp_g"]), str(x["m"]), str(x["buckets"]), f"{x['recv_gb']:.2f}",
                              f"{x['enter_ms']:.1f}", f"{x['exit_ms']:.1f}", f"{x['bound_ms']:.1f}", f"{ratio:.2f}",
                              f"{bw:.0f}", f"{x['train_gb']:.2f}", f"{x['gen_gb']:.2f}", f"{x['steady_gb']:.2f}",
                              f"{x['peak_gb']:.2f}", str(x["bitwise"])]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
