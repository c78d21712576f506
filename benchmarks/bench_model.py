"""model.py on a GPU: bf16 logits vs transformers for a random Qwen2.5-0.5B-shaped model, every available
attention backend agreeing, and forward throughput per backend.

    python benchmarks/bench_model.py [--quick]
"""
import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as M  # noqa: E402

QWEN05 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, hidden_size=896,
              intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
              max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, Qwen2Config
    dev = torch.device("cuda")
    cfg = dict(QWEN05, num_hidden_layers=4) if args.quick else QWEN05
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(Qwen2Config(**cfg), dtype=torch.bfloat16).to(dev).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.02)
    d = tempfile.mkdtemp()
    hf.save_pretrained(d)
    ours = M.load_model(d, dtype=torch.bfloat16, device=dev).eval()
    lens = [37, 512, 1000, 3, 250]
    seqs = [torch.randint(0, cfg["vocab_size"], (n,), device=dev) for n in lens]
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(n, device=dev) for n in lens])
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
    with torch.no_grad():
        ref = torch.cat([hf(s[None]).logits[0].float() for s in seqs])
        hf.float()  # what bf16 itself costs: transformers bf16 against transformers fp32
        ref32 = torch.cat([hf(s[None]).logits[0].float() for s in seqs])
        hf.bfloat16()
    print(f"transformers bf16 vs transformers fp32: rel err {((ref - ref32).norm() / ref32.norm()).item():.2e}")
    backends = ["sdpa"] + (["varlen"] if M.TORCH_VARLEN is not None else []) + (["flash"] if M.FLASH_ATTN else [])
    rows, outs = [], {}
    for b in backends:
        ours.attn_backend = b
        with torch.no_grad():
            out = ours.logits(ours.packed(ids, pos, cu, max(lens)))
            outs[b] = out
            err = ((out - ref).norm() / ref.norm()).item()
            err32 = ((out - ref32).norm() / ref32.norm()).item()
            agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
            # throughput on a larger pack
            big_lens = [2048] * 8
            bid = torch.randint(0, cfg["vocab_size"], (sum(big_lens),), device=dev)
            bpos = torch.cat([torch.arange(n, device=dev) for n in big_lens])
            bcu = torch.tensor([0] + list(torch.tensor(big_lens).cumsum(0)), dtype=torch.int32, device=dev)
            if b == "sdpa":
                tps = float("nan")  # O(T^2) mask path: CPU fallback only
            else:
                for _ in range(2):
                    ours.packed(bid, bpos, bcu, 2048)
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(5):
                    ours.packed(bid, bpos, bcu, 2048)
                torch.cuda.synchronize()
                tps = 5 * sum(big_lens) / (time.perf_counter() - t)
        rows.append((b, err, err32, agree, tps))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, layers={cfg['num_hidden_layers']}")
    print(f"{'backend':8} {'rel err vs HF bf16':>19} {'vs HF fp32':>11} {'argmax agree':>13} {'fwd tok/s':>10}")
    for b, e, e32, a, t in rows:
        print(f"{b:8} {e:19.2e} {e32:11.2e} {a:13.4f} {t:10.0f}")
    for b in backends[1:]:
        print(f"{b} vs sdpa: rel diff {((outs[b] - outs['sdpa']).norm() / outs['sdpa'].norm()).item():.2e}")


if __name__ == "__main__":
    main()
