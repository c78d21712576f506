"""rollout.Generator on a GPU: generated tokens/s against transformers.generate and against the HBM bound.

Random-weight Qwen2-shaped models (0.5B, 1.5B at B=256; 7B at B=128), 256-token random prompts,
512 new tokens, temperature 1, EOS ignored. The bound is the bytes one decode step must read (every
matmul weight once + the live rows' KV cache) at 4.8 TB/s, summed over the decode steps; prefill
is not in the bound but is in our time ("decode only" takes it out: the same run's time less a
prefill-only run's). `--workload nanovllm` is nano-vllm's benchmark: 256
sequences, input and output lengths uniform in [100, 1024] (seed 0), EOS ignored. transformers.generate is timed
warmed up (its second full-size call), with its default dynamic cache and with its static cache.

    python benchmarks/bench_rollout.py [--quick] [--skip-hf] [--models 0.5b,1.5b,7b] [--workload fixed|nanovllm]
                                       [--top-k K] [--top-p P] [--profile]
"""
import argparse
import dataclasses
import gc
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import KVCache, ModelConfig, Transformer  # noqa: E402
from rollout import Generator, SamplingParams  # noqa: E402

HBM = 4.8e12
QWEN2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", max_position_embeddings=32768,
             rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=True)
MODELS = {  # name: (config, batch)
    "0.5b": (dict(QWEN2, vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True), 256),
    "1.5b": (dict(QWEN2, vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True), 256),
    "7b": (dict(QWEN2, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False), 128),
}


def sync_time(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def bound_seconds(cfg: ModelConfig, seqs: list[tuple[int, int]], rows: int) -> float:
    """Fewest bytes to read at HBM speed: each decode step reads the weights once (steps >= the
    tokens each row must produce, rows at a time) and every live row's KV once."""
    weights = cfg.num_params(with_embedding=False) * 2
    per_tok = KVCache.bytes_per_token(cfg, cfg.num_layers, 1, torch.bfloat16)
    kv = sum(per_tok * (n_in * n_out + n_out * (n_out - 1) // 2) for n_in, n_out in seqs)
    steps = max(max(n for _, n in seqs), -(-sum(n for _, n in seqs) // rows))
    return (weights * steps + kv) / HBM


def hf_tok_s(hf_cfg: dict, prompts: list[list[int]], new: int) -> str:
    from transformers import AutoModelForCausalLM, Qwen2Config
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(Qwen2Config(**hf_cfg), dtype=torch.bfloat16,
                                              attn_implementation="sdpa").eval()
    ids = torch.tensor(prompts, device="cuda")
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new, min_new_tokens=new,
              pad_token_id=0, eos_token_id=None)
    rates = []
    # the default (dynamic) cache, then the static one, each timed on its second full-size call: the first warms up
    # (and, for the static cache, compiles for these shapes), as every call after it in a training run would be
    for cache in (None, "static"):
        try:
            with torch.no_grad():
                hf.generate(ids, **kw, cache_implementation=cache)
                _, dt = sync_time(lambda: hf.generate(ids, **kw, cache_implementation=cache))
            rates.append(f"{len(prompts) * new / dt:.0f} ({cache or 'dynamic'})")
        except Exception as e:  # noqa: BLE001 - report it, keep the other
            print(f"  transformers cache_implementation={cache}: {type(e).__name__}: {str(e)[:120]}")
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return " / ".join(rates) or "failed"


def profile(gen: Generator, model: Transformer, B: int, L: int, vocab: int) -> str:
    """Milliseconds of one decode step (graph replay) and of its parts, at B rows and L positions."""
    def ms(fn, n=20):
        fn()
        _, dt = sync_time(lambda: [fn() for _ in range(n)])
        return dt / n * 1e3
    gen.lengths[:B] = torch.randint(L // 3, L - 32, (B,), device="cuda", dtype=torch.int32)  # mid-generation rows
    step = ms(lambda: gen._step(B, L))
    logits = (torch.randn(B, model.lm_head.weight.shape[0], device="cuda") * 3).bfloat16()
    keys, pos = torch.arange(B, device="cuda"), torch.zeros(B, dtype=torch.long, device="cuda")
    samp = ms(lambda: gen._sample(logits, keys, pos))  # the run's sampling settings
    from torch.profiler import ProfilerActivity, profile as torch_profile
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with torch.no_grad(), torch_profile(activities=acts, record_shapes=True) as prof:  # 10 eager decode steps
        for _ in range(10):
            gen._decode_step(B, L)
        torch.cuda.synchronize()
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="cuda_time_total", row_limit=40,
                                                             max_name_column_width=50, max_shapes_column_width=80))
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:  # 10 graph replays
        for _ in range(10):
            gen._step(B, L)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    return f"step {step:.2f} ms (sampling alone, eager: {samp:.2f} ms) at B={B} L={L}"


def run(name: str, args) -> list[str]:
    hf_cfg, B = MODELS[name]
    if args.quick:
        hf_cfg = dict(hf_cfg, num_hidden_layers=4)
        B = min(B, 64)
    cfg = ModelConfig.from_hf(hf_cfg)
    model = Transformer(cfg, dtype=torch.bfloat16, device="cuda")
    model.init_random(0)
    model.eval()
    rng = random.Random(0)
    if args.workload == "nanovllm":
        n_seq = 32 if args.quick else 256
        ins = [rng.randint(100, 1024) for _ in range(n_seq)]
        outs = [rng.randint(100, 1024) for _ in range(n_seq)]
        prompts = [[rng.randint(0, 10000) for _ in range(n)] for n in ins]
    else:
        new = 64 if args.quick else 512
        prompts = [[rng.randint(0, cfg.vocab_size - 1) for _ in range(256)] for _ in range(B)]
        ins, outs = [256] * B, [new] * B
    base = torch.cuda.memory_allocated()
    gen = Generator(model, max_rows=B, max_len=max(i + o for i, o in zip(ins, outs)))
    params = SamplingParams(temperature=1.0, top_k=args.top_k, top_p=args.top_p, max_new_tokens=max(outs),
                            ignore_eos=True)
    # warm-up: CUDA graphs, cuBLAS and Triton kernels of every batch bucket the timed run will use (nano-vllm
    # captures its graphs at start-up too); the mixed workload's tail visits several buckets, so run it whole
    if args.workload == "nanovllm":
        gen.generate(prompts, params, max_new_tokens=outs)
    else:
        gen.generate(prompts[:B], dataclasses.replace(params, max_new_tokens=8))
    # best of 3: one prefill-only call now and then ran 25% slow (BENCHMARKS.md, fourteenth session), and the
    # decode-only figure is the whole run less this
    t_prefill = min(sync_time(lambda: gen.generate(prompts, params, max_new_tokens=[1] * len(prompts)))[1]
                    for _ in range(3))
    comps, dt = sync_time(lambda: gen.generate(prompts, params, max_new_tokens=outs))
    total = sum(len(c.token_ids) for c in comps)
    assert total == sum(outs), (total, sum(outs))
    bound = bound_seconds(cfg, list(zip(ins, outs)), B)
    prof = profile(gen, model, B, gen.cache.max_len, cfg.vocab_size) if args.profile else ""
    gen.free()
    leaked = torch.cuda.memory_allocated() - base
    hf = "skipped"
    if not args.skip_hf and args.workload == "fixed":
        hf = hf_tok_s(hf_cfg, prompts, outs[0] if args.hf_new_tokens is None else args.hf_new_tokens)
    decode = dt - t_prefill  # the same run less its prefill (and first tokens)
    row = (f"{name:5s} B={B:3d} seqs={len(prompts):3d} tok/s {total / dt:7.0f} "
           f"(decode only {(total - len(prompts)) / decode:7.0f})  HBM bound {sum(outs) / bound:7.0f} tok/s -> "
           f"{bound / dt * 100:4.1f}% (decode only {bound / decode * 100:4.1f}%)"
           f"  prefill {t_prefill * 1e3:.0f} ms ({2 * cfg.num_params(False) * sum(ins) / t_prefill / 989e12:.0%} MFU)"
           f"  transformers tok/s {hf}  graphs {gen.stats['graphs_captured']}  free() leaves {leaked} B")
    print(row, gen.stats, prof, flush=True)
    del model, gen
    gc.collect()
    torch.cuda.empty_cache()
    return [row]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="4-layer models, B <= 64, 64 new tokens")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf-new-tokens", type=int, default=None, help="new tokens for the transformers run "
                    "(default: the same as ours); fewer is kinder to transformers (shorter contexts)")
    ap.add_argument("--models", default="0.5b,1.5b,7b")
    ap.add_argument("--workload", choices=["fixed", "nanovllm"], default="fixed")
    ap.add_argument("--profile", action="store_true", help="also time one decode step and the sampler")
    ap.add_argument("--top-k", type=int, default=-1, help="sample from the top k (default: off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="sample from the nucleus of mass p (default: off)")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  workload {args.workload}  "
          f"top_k {args.top_k} top_p {args.top_p}")
    rows = [r for name in args.models.split(",") for r in run(name, args)]
    print("\n".join(["", "summary"] + rows))


if __name__ == "__main__":
    main()
