"""Actor-update throughput: forward + backward + ZeRO-1 AdamW step of a Qwen2.5-7B-shaped random model.

    torchrun --nproc_per_node=K benchmarks/bench_train.py --tp T --pp P [--layers N] [--grad-ckpt] [--quick]

bf16 compute weights, fp32 gradient buffer, fp32 master weights and Adam moments sharded over DP,
packed micro-batches of random sequences of 512-2048 tokens, a token-mean log-prob loss through
the vocab-parallel log-softmax, gradient clipping, and the 1F1B schedule when pp > 1.

MFU = (6 * N + attention FLOPs) * tokens / time / (989e12 * GPUs), where N is the parameter count
without the input embedding (ModelConfig.num_params(with_embedding=False): the LM head counts) and
the attention of one sequence of s tokens costs 6 * 2 * L * h * d * s^2 / 2 FLOPs (QK^T and PV are
2 * h * d * s^2 FLOPs each forward, the backward twice that, the causal mask halves it). Recomputation
under gradient checkpointing is not counted: MFU measures useful model FLOPs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import ModelConfig, Transformer  # noqa: E402
from parallel import (ShardedAdamW, init_distributed, make_layout, pipeline_forward_backward,  # noqa: E402
                      validate_layout, vocab_parallel_logprobs)

PEAK = 989e12  # dense bf16 FLOP/s of an H100/H200 SXM


def qwen25_7b(layers: int) -> ModelConfig:
    return ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=layers,
                       num_heads=28, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                       attention_bias=True, tie_word_embeddings=False, max_position_embeddings=32768,
                       architecture="Qwen2ForCausalLM")


def micro_batches(step: int, dp: int, n_mb: int, budget: int, lo: int, hi: int) -> list:
    """Every DP rank's packed micro-batches of this step (the same on every rank, so the global token
    count is known locally); sequences of lo..hi tokens, at most `budget` tokens per micro-batch."""
    g = torch.Generator().manual_seed(1000 + step)
    per_rank = []
    for _ in range(dp):
        mbs = []
        for _ in range(n_mb):
            lens = []
            while True:
                n = int(torch.randint(lo, hi + 1, (1,), generator=g))
                if lens and sum(lens) + n > budget:
                    break
                lens.append(min(n, budget))
            mbs.append(lens)
        per_rank.append(mbs)
    return per_rank


def to_device(lens: list[int], vocab: int, denom: float, device) -> dict:
    T = sum(lens)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    pos = torch.cat([torch.arange(n) for n in lens])
    return {"input_ids": torch.randint(0, vocab, (T,), device=device), "position_ids": pos.to(device),
            "cu_seqlens": cu.to(device), "max_seqlen": max(lens),
            "targets": torch.randint(0, vocab, (T,), device=device), "denom": denom}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--micro-batches", type=int, default=8, help="per DP rank and step")
    ap.add_argument("--tokens-per-micro-batch", type=int, default=8192)
    ap.add_argument("--min-len", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--quick", action="store_true", help="4 layers, 2 timed steps, 2*pp micro-batches")
    a = ap.parse_args()
    if a.quick:
        a.layers, a.steps, a.warmup, a.micro_batches = 4, 2, 1, 2 * a.pp

    if not torch.cuda.is_available():
        sys.exit("bench_train.py needs CUDA GPUs (run under torchrun on a GPU machine)")
    dev, _, world = init_distributed("cuda")
    cfg = qwen25_7b(a.layers)
    validate_layout(cfg, a.tp, a.pp, world, name="Qwen2.5-7B shapes")
    lay = make_layout(a.tp, a.pp)

    model = Transformer(cfg, lay, dtype=torch.bfloat16, device=dev)
    torch.manual_seed(lay.pp_rank * 1000 + lay.tp_rank)  # DP replicas start equal
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else (p.normal_(0.0, 0.02) if p.dim() > 1 else p.zero_())
    model.gradient_checkpointing = a.grad_ckpt
    model.train()
    opt = ShardedAdamW(model, lay, lr=1e-6)

    def loss_fn(m, hidden, mb):
        logp, _ = vocab_parallel_logprobs(m.logits(hidden), mb["targets"], lay.tp_group)
        loss = -logp.sum() / mb["denom"]
        return loss, {"loss": loss}

    L, h, d = cfg.num_layers, cfg.num_heads, cfg.head_dim
    n_params = cfg.num_params(with_embedding=False)
    times, fb_times, tokens_done, flops_done = [], [], 0, 0.0
    for step in range(a.warmup + a.steps):
        lens = micro_batches(step, lay.dp, a.micro_batches, a.tokens_per_micro_batch, a.min_len, a.max_len)
        total = sum(sum(sum(mb) for mb in r) for r in lens)
        mbs = [to_device(mb, cfg.vocab_size, float(total), dev) for mb in lens[lay.dp_rank]]
        torch.cuda.synchronize()
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        opt.expect_backwards(len(mbs))
        pipeline_forward_backward(model, lay, mbs, loss_fn)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        opt.reduce_gradients()
        opt.clip_grad_norm(1.0)
        opt.step()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if step >= a.warmup:
            times.append(t2 - t0)
            fb_times.append(t1 - t0)
            tokens_done += total
            seq = [s for r in lens for mb in r for s in mb]
            flops_done += 6 * n_params * total + sum(6 * 2 * L * h * d * s * s / 2 for s in seq)

    step_s = statistics.mean(times)
    tok_s_gpu = tokens_done / sum(times) / world
    mfu = flops_done / sum(times) / (PEAK * world)
    mem = torch.cuda.max_memory_allocated() / 2**30
    mems = [torch.zeros(1, device=dev) + mem]
    if dist.is_initialized():
        dist.all_reduce(mems[0], op=dist.ReduceOp.MAX)
    if lay.rank == 0:
        name = torch.cuda.get_device_name(dev)
        print(f"# bench_train  {name} x{world}  Qwen2.5-7B shapes, {L} layers, N={n_params / 1e9:.2f}B "
              f"(no input embedding), bf16 + fp32 master, ZeRO-1, grad_ckpt={a.grad_ckpt}")
        print(f"# {a.micro_batches} micro-batches/DP rank of <= {a.tokens_per_micro_batch} tokens, "
              f"sequences {a.min_len}-{a.max_len}, {a.steps} timed steps after {a.warmup} warmup")
        print("| tp | pp | dp | tokens/step | step s | fwd+bwd s | optim s | tokens/s/GPU | MFU | max mem GiB |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        fb = statistics.mean(fb_times)
        print(f"| {lay.tp} | {lay.pp} | {lay.dp} | {tokens_done // a.steps} | {step_s:.3f} | {fb:.3f} | "
              f"{step_s - fb:.3f} | {tok_s_gpu:,.0f} | {100 * mfu:.1f}% | {mems[0].item():.1f} |")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
