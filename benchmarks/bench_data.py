"""Prompt-cache throughput: tokenize + build for 100k GSM8K-sized prompts, then warm open + batch draw.

    python benchmarks/bench_data.py [--n 100000] [--batch 1024]

Runs on CPU; uses the byte-level test tokenizer (one token per byte, so ~300-token prompts).
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import data  # noqa: E402
from helpers import make_tokenizer  # noqa: E402

WORDS = ("Natalia sold clips to her friends in April and then half as many in May how many did she sell "
         "altogether Weng earns an hour for babysitting yesterday she did minutes of it").split()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=1024)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        tok = make_tokenizer(os.path.join(tmp, "tok"))
        # GSM8K questions run ~45 words (~240 characters); the instruction adds ~70 more.
        lens = rng.integers(25, 70, size=a.n)
        questions = [" ".join(rng.choice(WORDS, size=k)) + "?" + data.GSM8K_INSTRUCTION for k in lens]
        table = pa.table({"prompt": [[{"role": "user", "content": q}] for q in questions],
                          "data_source": ["bench"] * a.n,
                          "reward_model": [{"style": "rule", "ground_truth": str(i)} for i in range(a.n)]})
        path = os.path.join(tmp, "train.parquet")
        pq.write_table(table, path)

        t0 = time.perf_counter()
        ds = data.PromptDataset([path], tok, max_prompt_length=1024)
        build = time.perf_counter() - t0
        assert ds.cache_built and len(ds) == a.n
        tokens = sum(len(x) for x in ds._table.column("prompt_ids").to_pylist())
        size_mb = os.path.getsize(ds.cache_path) / 2**20
        del ds

        t0 = time.perf_counter()
        ds = data.PromptDataset([path], tok, max_prompt_length=1024)
        warm_open = time.perf_counter() - t0
        assert not ds.cache_built
        sampler = data.Sampler(len(ds), a.batch, seed=0)
        draws = []
        for _ in range(5):
            t0 = time.perf_counter()
            batch = ds.get_batch(sampler.next_indices())
            draws.append(time.perf_counter() - t0)
        assert len(batch) == a.batch

    rows = [("prompts", f"{a.n:,}"), ("prompt tokens (mean)", f"{tokens / a.n:.0f}"),
            ("cache file", f"{size_mb:.1f} MiB"),
            ("tokenize + build cache", f"{build:.2f} s ({a.n / build:,.0f} prompts/s)"),
            ("open warm cache (hash + mmap)", f"{warm_open * 1e3:.1f} ms"),
            (f"draw batch of {a.batch} (median of 5)", f"{np.median(draws) * 1e3:.1f} ms")]
    w = max(len(r[0]) for r in rows)
    print(f"| {'step'.ljust(w)} | result |\n|{'-' * (w + 2)}|--------|")
    for k, v in rows:
        print(f"| {k.ljust(w)} | {v} |")


if __name__ == "__main__":
    main()
