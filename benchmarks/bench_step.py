"""One whole GRPO step of train.py on GPUs, against the physical bound (and TRL's figure).

The workload of issue 10 (the same as TRL's GRPOTrainer comparison): a random-weight Qwen2-shaped
model, 32 prompts x 8 samples, prompts of exactly 256 random tokens, 512 completion tokens (EOS
never ends a response), temperature 1, no reference model, 4 optimizer steps per generation
(ppo_mini_batch_size = 8 prompts), gradient checkpointing, bf16.

    python benchmarks/bench_step.py --model 0.5b [--steps 3]
    torchrun --nproc_per_node=2 benchmarks/bench_step.py --model 7b --tp 2 --gen-tp 2

Everything runs through train.Trainer.train_step (generation with resharding, scoring, old
log-probs, advantages, updates); only the prompts (random ids) and the scorer (a hash of the text,
so half the samples score 1) are swapped in. tokens/s is verl's perf/throughput: (prompt +
response tokens) / step time / GPUs. The bound: every decode step reads the weights and the live KV
once at 4.8 TB/s, and the old-log-prob forward (2N) plus update (6N, recomputation not counted)
FLOPs run at 989 TFLOP/s.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import zlib

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from data import prepare_synthetic  # noqa: E402
from model import KVCache, ModelConfig  # noqa: E402

QWEN2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", max_position_embeddings=32768,
             rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=True, torch_dtype="bfloat16")
SHAPES = {
    "0.5b": dict(QWEN2, vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(QWEN2, vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(QWEN2, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
}
TRL_H200 = {"0.5b": 13685, "1.5b": 8907}  # tokens/s of TRL 1.16 GRPOTrainer on one H200 (issue 10)


def hash_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return float(zlib.crc32(solution_str.encode()) % 2)


def bound_seconds(cfg: ModelConfig, B: int, P: int, R: int, world: int) -> tuple[float, float]:
    """(generation, forward+backward) seconds at the hardware limits, per GPU."""
    weights = cfg.num_params(with_embedding=False) * 2
    kv = KVCache.bytes_per_token(cfg, cfg.num_layers, 1, torch.bfloat16) * B * (P * R + R * (R - 1) // 2)
    gen = (weights * R * world + kv) / 4.8e12 / world  # every replica reads all weights; KV is split
    # the LM head runs on the R response tokens only; with checkpointing, a forward, its recompute and a backward
    flops = 4 * cfg.forward_flops([P + R] * B, B * R)
    return gen, flops / 989e12 / world


def phase_table(prof, top: int = 10) -> str:
    """Device time of each train.timed phase of the profiled step and its top kernels (on CPU: leaf ops).
    A kernel belongs to the phase whose time range holds its start; the phases are synchronised at both
    ends while profiling, so this also catches the backward's kernels, launched from autograd's thread."""
    evs = prof.events()
    ranges = [(e.name[6:], e.time_range.start, e.time_range.end) for e in evs if e.name.startswith("phase/")]
    cuda = any(e.device_type == torch.autograd.DeviceType.CUDA for e in evs)
    phases: dict = {name: {} for name, _, _ in ranges}
    for e in evs:
        if e.name.startswith("phase/") or (e.device_type == torch.autograd.DeviceType.CUDA) != cuda or \
                (not cuda and e.cpu_children):
            continue
        for name, start, end in ranges:
            if start <= e.time_range.start <= end:
                phases[name][e.name] = phases[name].get(e.name, 0) + e.time_range.elapsed_us()
                break
    lines = []
    for name, acc in phases.items():
        total = sum(acc.values()) or 1
        lines.append(f"{name}: {total / 1e3:.1f} ms of {'device' if cuda else 'CPU op'} time")
        for k, v in sorted(acc.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"    {v / total * 100:5.1f}%  {v / 1e3:8.1f} ms  {k[:100]}")
    return "\n".join(lines)


def timed_with_range(metrics: dict, name: str):
    """train.timed inside a profiler range phase/<name>, synchronised at both ends on GPU (see phase_table)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    with torch.profiler.record_function(f"phase/{name}"), TIMED(metrics, name):
        yield
        sync()


TIMED = train.timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(SHAPES), default="0.5b")
    ap.add_argument("--layers", type=int, default=0, help="fewer layers (quick checks)")
    ap.add_argument("--steps", type=int, default=3, help="the first is warm-up (CUDA graphs, cuBLAS)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8, help="rollout.n (not --n: torchrun would take that as its own)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=512)
    ap.add_argument("--mini", type=int, default=8, help="prompts per optimizer step")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--gen-tp", type=int, default=1)
    ap.add_argument("--micro-tokens", type=int, default=16384)
    ap.add_argument("--out", default="/tmp/nanorl_bench_step")
    ap.add_argument("--device", default="cuda", help="cpu: a functional check of this script only (fp32)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler over the last step: top kernels")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    args = ap.parse_args()
    if args.profile:  # phase ranges (and syncs) only in profiled runs: timing runs keep train.timed as it is
        train.timed = contextlib.contextmanager(timed_with_range)
    rank = int(os.environ.get("RANK", 0))
    data_dir = os.path.join(args.out, f"rank{rank}")  # one copy per rank: no start-up ordering to get wrong
    prepare_synthetic(data_dir, task="copy", n_train=max(64, args.prompts), n_test=8, seed=0)
    model_dir = os.path.join(data_dir, "model")
    shape = dict(SHAPES[args.model], **({"num_hidden_layers": args.layers} if args.layers else {}))
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(shape, f)
    cfg = train.load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml"), [
        f"data.train_files=[{data_dir}/train.parquet]", "data.val_files=[]",
        f"data.train_batch_size={args.prompts}", f"data.max_prompt_length={args.prompt_len}",
        f"data.max_response_length={args.response_len}",  # the copy task's prompts only give the dataset its size
        "data.truncation=left", "data.filter_overlong_prompts=false",  # (get_batch below makes the random ones)
        f"actor.model_path={model_dir}", "actor.dtype=" + ("bf16" if args.device == "cuda" else "fp32"),
        "actor.optim.lr=1e-6", f"actor.ppo_mini_batch_size={args.mini}", "actor.gradient_checkpointing=true",
        f"actor.max_tokens_per_micro_batch={args.micro_tokens}", f"rollout.n={args.samples}",
        f"rollout.max_rows={args.prompts * args.samples}", f"trainer.device={args.device}", f"trainer.total_steps={args.steps}",
        f"trainer.output_dir={data_dir}/run", f"parallel.train.tp={args.tp}", f"parallel.train.pp={args.pp}",
        f"parallel.rollout.tp={args.gen_tp}", "trainer.logger=[]", *args.set])
    t = train.Trainer(cfg)
    t.eos_ids = []  # EOS never ends a response: every one is max_response_length tokens
    t.reward_fn = hash_score
    rng = random.Random(0)
    vocab = t.mcfg.vocab_size

    def get_batch(indices):
        return [{"prompt_ids": [rng.randrange(vocab) for _ in range(args.prompt_len)], "data_source": "bench",
                 "ground_truth": "", "extra_info": {}, "index": int(i)} for i in indices]

    t.train_data.get_batch = get_batch
    rows = []
    for step in range(args.steps):
        prof = None
        if args.profile and step == args.steps - 1:
            from torch.profiler import ProfilerActivity, profile
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        m = t.train_step()
        if prof is not None:
            prof.__exit__(None, None, None)
            if rank == 0:
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
                print(phase_table(prof), flush=True)
        t.step += 1
        rows.append(m)
        if rank == 0:
            keys = ("timing_s/step", "timing_s/gen", "timing_s/reshard", "timing_s/old_log_prob",
                    "timing_s/update_actor", "perf/throughput", "perf/mfu/actor", "perf/max_memory_allocated_gb",
                    "training/rollout_probs_diff_max", "response_length/mean")
            print(f"step {step}: " + " ".join(f"{k.split('/', 1)[1]}={m.get(k, float('nan')):.4g}" for k in keys),
                  flush=True)
    if rank == 0:
        last = rows[1:] or rows
        avg = {k: sum(r[k] for r in last) / len(last) for k in last[0] if k.startswith(("timing_s", "perf"))}
        world = t.world
        gen_b, fb_b = bound_seconds(t.mcfg, args.prompts * args.samples, args.prompt_len, args.response_len, world)
        step_s = avg["timing_s/step"]
        device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        print(f"\n{device_name} x{world}  model {args.model}"
              f"{f' ({args.layers} layers)' if args.layers else ''}  tp={args.tp} pp={args.pp} gen_tp={args.gen_tp}")
        print("| s/step | gen | reshard | old_log_prob | update_actor | tok/s/GPU | MFU actor | bound s | "
              "% of bound | vs TRL |")
        trl = TRL_H200.get(args.model) if world == 1 and not args.layers else None
        vs_trl = f"{avg['perf/throughput'] / trl:.2f}x" if trl else "-"
        print(f"| {step_s:.2f} | {avg['timing_s/gen']:.2f} | {avg['timing_s/reshard']:.3f} | "
              f"{avg.get('timing_s/old_log_prob', 0.0):.2f} | {avg['timing_s/update_actor']:.2f} | "
              f"{avg['perf/throughput']:.0f} | {avg['perf/mfu/actor'] * 100:.1f}% | {gen_b + fb_b:.2f} "
              f"(gen {gen_b:.2f} + fb {fb_b:.2f}) | {(gen_b + fb_b) / step_s * 100:.1f}% | "
              f"{vs_trl} |", flush=True)
        peaks = {k.rsplit("/", 1)[1]: v for k, v in avg.items() if k.startswith("perf/max_memory_allocated_gb/")}
        if peaks:
            print("peak GiB by phase (rank 0): " + ", ".join(f"{k} {v:.1f}" for k, v in peaks.items())
                  + f"; step {avg['perf/max_memory_allocated_gb']:.1f}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
