"""Tune model.py's flash-decoding kernel: GB/s of KV read per decode-attention call at RL shapes, and the call
with a GRPO group's prompt read from one row (8 rows share a 256-token prompt).

    python benchmarks/bench_decode_attn.py [--no-sweep]
"""
import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model  # noqa: E402

SHAPES = {"0.5b": (256, 14, 2, 64), "1.5b": (256, 12, 2, 128), "7b": (128, 28, 4, 128)}  # B, H, Hkv, d


def timeit(fn, n=50):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n * 1e3  # us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-sweep", action="store_true", help="time the defaults only, without the config sweep")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, (B, H, hkv, d) in SHAPES.items():
        maxlen = 768
        q, kn, vn = torch.randn(B, H + 2 * hkv, d, device="cuda", dtype=torch.bfloat16).split([H, hkv, hkv], dim=1)
        k = torch.randn(B, hkv, maxlen, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, hkv, maxlen, d, device="cuda", dtype=torch.bfloat16)
        lengths = torch.randint(256, 769, (B,), device="cuda", dtype=torch.int32)
        kv_bytes = int(lengths.sum()) * hkv * d * 2 * 2
        ref = model.decode_attention(q.float(), kn.float(), vn.float(), k.float(), v.float(), lengths)
        base = timeit(lambda: model._flash_decode(q, kn, vn, k, v, lengths))
        rows.append(f"{name}: current {base:7.1f} us  {kv_bytes / base / 1e3:6.0f} GB/s  (KV {kv_bytes / 2**20:.0f} MiB)")
        src = (torch.arange(B, device="cuda") // 8 * 8).int()
        prefix = (src, torch.full((B,), 256, device="cuda", dtype=torch.int32))
        shared = timeit(lambda: model._flash_decode(q, kn, vn, k, v, lengths, prefix))
        rows.append(f"   prompt of 256 read from one row of 8: {shared:7.1f} us  ({base / shared:.2f}x; "
                    f"{kv_bytes / shared / 1e3:6.0f} GB/s as if every row were read)")
        if args.no_sweep:
            continue
        best = []
        for block, warps, stages, sf in itertools.product((64, 128, 256), (2, 4, 8), (2, 3, 4), (1, 4)):
            kw = dict(block=block, warps=warps, stages=stages, split_factor=sf)
            try:
                out = model._flash_decode(q, kn, vn, k, v, lengths, **kw)
                err = (out.float() - ref).abs().max().item()
                t = timeit(lambda: model._flash_decode(q, kn, vn, k, v, lengths, **kw))
            except Exception:  # noqa: BLE001 - a config that does not compile (shared memory)
                continue
            best.append((t, block, warps, stages, sf, err))
        best.sort()
        per_sf = [next(r for r in best if r[4] == sf) for sf in (1, 4)]  # the best config of each split factor
        for t, block, warps, stages, sf, err in best[:4] + per_sf:
            rows.append(f"   block {block:3d} warps {warps} stages {stages} split_factor {sf}: {t:7.1f} us "
                        f"{kv_bytes / t / 1e3:6.0f} GB/s  err {err:.1e}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
