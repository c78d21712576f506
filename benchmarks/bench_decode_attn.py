"""Tune model.py's flash-decoding kernel: GB/s of KV read per decode-attention call at RL shapes.

    python benchmarks/bench_decode_attn.py
"""
import itertools
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model  # noqa: E402

SHAPES = {"0.5b": (256, 14, 2, 64), "1.5b": (256, 12, 2, 128), "7b": (128, 28, 4, 128)}  # B, H, Hkv, d


def launch(q, k, v, lengths, block, warps, stages, split_factor):
    (B, H, d), (hkv, L) = q.shape, k.shape[1:3]
    G, GP, DP = H // hkv, max(16, triton.next_power_of_2(H // hkv)), max(16, triton.next_power_of_2(d))
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    S = max(1, min(triton.cdiv(L, block), triton.cdiv(split_factor * sms, B * hkv)))
    mo, lo = (torch.empty(B, hkv, S, GP, dtype=torch.float32, device=q.device) for _ in range(2))
    ao = torch.empty(B, hkv, S, GP, DP, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    model._flash_decode_split[(B, hkv, S)](q, k, v, lengths, mo, lo, ao, d ** -0.5, *q.stride()[:2],
                                           *k.stride()[:3], *v.stride()[:3], G=G, D=d, GP=GP, DP=DP, BLOCK=block,
                                           num_warps=warps, num_stages=stages)
    model._flash_decode_merge[(B, hkv)](mo, lo, ao, out, out.stride(0), out.stride(1), S=S,
                                        SP=triton.next_power_of_2(S), G=G, D=d, GP=GP, DP=DP)
    return out


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
    torch.manual_seed(0)
    rows = []
    for name, (B, H, hkv, d) in SHAPES.items():
        maxlen = 768
        q = torch.randn(B, H, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, hkv, maxlen, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, hkv, maxlen, d, device="cuda", dtype=torch.bfloat16)
        lengths = torch.randint(256, 769, (B,), device="cuda", dtype=torch.int32)
        kv_bytes = int(lengths.sum()) * hkv * d * 2 * 2
        ref = model.decode_attention(q.float(), k.float(), v.float(), lengths)
        base = timeit(lambda: model._flash_decode(q, k, v, lengths))
        rows.append(f"{name}: current {base:7.1f} us  {kv_bytes / base / 1e3:6.0f} GB/s  (KV {kv_bytes / 2**20:.0f} MiB)")
        best = []
        for block, warps, stages, sf in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4), (2, 4, 8)):
            try:
                out = launch(q, k, v, lengths, block, warps, stages, sf)
                err = (out.float() - ref).abs().max().item()
                t = timeit(lambda: launch(q, k, v, lengths, block, warps, stages, sf))
            except Exception:  # noqa: BLE001 - a config that does not compile (shared memory)
                continue
            best.append((t, block, warps, stages, sf, err))
        best.sort()
        for t, block, warps, stages, sf, err in best[:6]:
            rows.append(f"   block {block:3d} warps {warps} stages {stages} splits x{sf}: {t:7.1f} us "
                        f"{kv_bytes / t / 1e3:6.0f} GB/s  err {err:.1e}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
