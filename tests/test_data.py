"""Tests for data.py: GSM8K/synthetic preparation, the shared prompt cache, the sampler, packing."""
import datetime
import itertools
import json
import multiprocessing as mp
import os
import pickle
import re
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import data
from helpers import make_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k")


def reference_ids(tok, prompt):
    """Token ids by applying the chat template directly (what the cache must reproduce)."""
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))


def write_rows(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def row(content, truth="1", **extra):
    return {"prompt": [{"role": "user", "content": content}], "data_source": "t",
            "reward_model": {"ground_truth": truth}, "extra_info": {"k": 1}, **extra}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    make_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return data.load_tokenizer(tok_dir)


@pytest.fixture(scope="module")
def gsm8k(tmp_path_factory):
    assert os.path.isdir(GSM8K), f"GSM8K data missing at {GSM8K}"
    src, out = tmp_path_factory.mktemp("gsm_src"), tmp_path_factory.mktemp("gsm_out")
    lines = {}
    for split in ("train", "test"):
        with open(os.path.join(GSM8K, f"{split}.jsonl")) as f:
            lines[split] = [next(f) for _ in range(50)]
        (src / f"{split}.jsonl").write_text("".join(lines[split]))
    data.main(["gsm8k", "--src", str(src), "--out", str(out)])
    return out, {k: [json.loads(x) for x in v] for k, v in lines.items()}


# ----------------------------------------------------------------------------- GSM8K and the cache


def test_gsm8k_to_cache_matches_chat_template(gsm8k, tok, tmp_path):
    out, raw = gsm8k
    for split in ("train", "test"):
        ds = data.PromptDataset([str(out / f"{split}.parquet")], tok, max_prompt_length=4096,
                                cache_dir=str(tmp_path))
        assert len(ds) == 50 and ds.num_filtered == 0
        for i, ex in enumerate(raw[split]):
            item = ds[i]
            question = ex["question"] + " Let's think step by step and output the final answer after \"####\"."
            assert item["prompt_ids"] == reference_ids(tok, [{"role": "user", "content": question}])
            assert item["ground_truth"] == re.search(r"####\s*(.+)$", ex["answer"]).group(1).replace(",", "").strip()
            assert item["data_source"] == "openai/gsm8k" and item["ability"] == "math" and item["index"] == i
            assert item["extra_info"] == {"split": split, "index": i, "question": ex["question"],
                                          "answer": ex["answer"]}
            assert item["reward_model"] == {"style": "rule", "ground_truth": item["ground_truth"]}
    assert ds[0]["ground_truth"] == "18"  # test.jsonl line 1 (Janet's ducks)
    assert [r["index"] for r in ds.get_batch([3, 1, 3])] == [3, 1, 3]


def _open_in_child(args):
    files, tok_dir, cache_dir, barrier, queue = args
    barrier.wait()
    ds = data.PromptDataset(files, data.load_tokenizer(tok_dir), max_prompt_length=4096, cache_dir=cache_dir)
    queue.put((ds.cache_built, ds.cache_path, [ds[i]["prompt_ids"] for i in range(len(ds))]))


def test_two_processes_build_the_cache_once(gsm8k, tok_dir, tok, tmp_path):
    out, _ = gsm8k
    files = [str(out / "train.parquet"), str(out / "test.parquet")]
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_open_in_child, args=((files, tok_dir, str(tmp_path), barrier, queue),))
             for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(r[0] for r in results) == [False, True]  # exactly one builder
    assert results[0][1:] == results[1][1:]
    ds = data.PromptDataset(files, tok, max_prompt_length=4096, cache_dir=str(tmp_path))
    assert not ds.cache_built and len(ds) == 100
    assert results[0][2] == [reference_ids(tok, r["prompt"]) for f in files for r in pq.read_table(f).to_pylist()]
    assert [p for p in os.listdir(tmp_path) if p.endswith(".arrow")] == [os.path.basename(ds.cache_path)]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "wrong_key"])
def test_damaged_cache_is_rebuilt(tmp_path, tok, damage):
    f = write_rows(tmp_path / "d.parquet", [row(f"question {i}", str(i)) for i in range(20)])
    first = data.PromptDataset([f], tok, 64)
    assert first.cache_built and first.cache_path.startswith(str(tmp_path / ".nanorl_cache"))
    good = first.get_batch(list(range(20)))
    path = first.cache_path
    del first
    if damage == "truncated":
        size = os.path.getsize(path)
        with open(path, "r+b") as fh:
            fh.truncate(size // 2)
    elif damage == "garbage":
        with open(path, "wb") as fh:
            fh.write(os.urandom(4096))
    elif damage == "empty":
        open(path, "wb").close()
    else:  # a well-formed Arrow file that is not ours
        t = pa.table({"prompt_ids": [[1]]}).replace_schema_metadata({"nanorl_key": "x", "nanorl_num_rows": "1"})
        with open(path, "wb") as fh, pa.ipc.new_file(fh, t.schema) as w:
            w.write_table(t)
    again = data.PromptDataset([f], tok, 64)
    assert again.cache_built and again.cache_path == path
    assert again.get_batch(list(range(20))) == good
    warm = data.PromptDataset([f], tok, 64)
    assert not warm.cache_built


def test_cache_key_follows_contents_and_tokenizer(tmp_path, tok_dir):
    tok = data.load_tokenizer(tok_dir)
    f = write_rows(tmp_path / "d.parquet", [row("hello")])
    a = data.PromptDataset([f], tok, 64)
    assert data.PromptDataset([f], tok, 64).cache_path == a.cache_path
    assert data.PromptDataset([f], tok, 65).cache_path != a.cache_path
    write_rows(tmp_path / "d.parquet", [row("hellO")])
    b = data.PromptDataset([f], tok, 64)
    assert b.cache_path != a.cache_path and b[0]["prompt_ids"] == reference_ids(tok, "hellO")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    c = data.PromptDataset([f], tok, 64)
    assert c.cache_path != b.cache_path and c[0]["prompt_ids"] == list(tok("hellO", add_special_tokens=False)["input_ids"])
    c2 = pickle.loads(pickle.dumps(c))
    assert c2[0] == c[0] and len(c2) == 1
    # the template renders the special tokens (Llama's {{ bos_token }}): another bos_token is another prompt
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    d = data.PromptDataset([f], tok, 64)
    tok.bos_token = "<|im_start|>"
    e = data.PromptDataset([f], tok, 64)
    assert e.cache_path != d.cache_path
    assert e[0]["prompt_ids"] == list(tok("<|im_start|>hellO", add_special_tokens=False)["input_ids"])
    # a template that prints the time (Llama 3's "Today Date" uses strftime_now) renders another prompt later
    tok.chat_template = "{{ strftime_now('%H%M%S%f') }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert data.PromptDataset([f], tok, 64).cache_path != data.PromptDataset([f], tok, 64).cache_path
    # a template that refuses the key's probe conversation (a lone user message) still opens a dataset it renders
    tok.chat_template = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
                         "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    g = write_rows(tmp_path / "g.parquet", [{**row(""), "prompt": [{"role": "system", "content": "s"},
                                                                   {"role": "user", "content": "hi"}]}])
    assert data.PromptDataset([g], tok, 64)[0]["prompt_ids"] == list(tok("shi", add_special_tokens=False)["input_ids"])


def test_stale_and_live_locks(tmp_path, tok):
    """The builder holds a flock: a builder killed mid-build (its lock file and temporary file left behind) blocks
    nobody, a live one makes the others wait (here past lock_timeout), and a finished build leaves no lock."""
    f = write_rows(tmp_path / "d.parquet", [row("hi")])
    probe = data.PromptDataset([f], tok, 64)
    os.remove(probe.cache_path)
    lock = probe.cache_path + ".lock"
    holder = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR); "
              "fcntl.flock(fd, fcntl.LOCK_EX); open(sys.argv[1] + '.held', 'w').close(); time.sleep(60)")
    killed = subprocess.Popen([sys.executable, "-c", holder, lock])
    while not os.path.exists(lock + ".held"):
        time.sleep(0.01)
    os.remove(lock + ".held")
    open(probe.cache_path + ".tmp-somehost-123", "w").close()  # its half-written cache
    with pytest.raises(TimeoutError, match=re.escape(lock)):  # alive: the others wait
        data.PromptDataset([f], tok, 64, lock_timeout=0.3)
    killed.kill()  # SIGKILL: no cleanup ran
    killed.wait()
    assert os.path.exists(lock)
    assert data.PromptDataset([f], tok, 64, lock_timeout=5).cache_built
    assert sorted(os.listdir(os.path.dirname(lock))) == [os.path.basename(probe.cache_path)]


# ----------------------------------------------------------------------------- options and bad input


def test_truncation_filtering_and_columns(tmp_path, tok):
    long_msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x" * 40 + "END"}]
    full = reference_ids(tok, long_msgs)
    m = len(full) - 7
    f = write_rows(tmp_path / "a.parquet", [{"prompt": long_msgs, "data_source": "a", "ability": "z",
                                             "reward_model": {"ground_truth": 5}, "extra_info": None}])
    g = write_rows(tmp_path / "b.parquet", [{"prompt": "plain", "data_source": "b", "ability": "y",
                                             "reward_model": {"ground_truth": "q"}, "extra_info": None}])
    expect = {"left": full[-m:], "right": full[:m], "middle": full[:m // 2] + full[len(full) - (m - m // 2):]}
    for mode, ids in expect.items():
        ds = data.PromptDataset([f, g], tok, m, truncation=mode, filter_overlong=False)
        assert ds[0]["prompt_ids"] == ids and len(ids) == m and ds.num_filtered == 0
    ds = data.PromptDataset([f, g], tok, m)  # filter_overlong drops the long one
    assert len(ds) == 1 and ds.num_filtered == 1
    item = ds[0]
    assert item["prompt_ids"] == reference_ids(tok, [{"role": "user", "content": "plain"}])
    assert (item["index"], item["data_source"], item["ground_truth"], item["extra_info"], item["ability"]) == \
        (0, "b", "q", {}, "y")
    ds = data.PromptDataset([f, g], tok, 4096)
    assert ds[0]["ground_truth"] == "5" and ds[-1]["data_source"] == "b"
    assert ds[1]["prompt"] == [{"role": "user", "content": "plain"}]
    with pytest.raises(IndexError):
        ds[2]


def test_categorical_columns_and_non_ascii_truths(tmp_path, tok):
    """A pandas categorical column (dictionary-typed in parquet) reads as its values beside a file of plain ones;
    a ground truth that is not a string becomes its JSON, non-ASCII kept as it is."""
    pq.write_table(pa.table({"prompt": ["a"], "data_source": pa.array(["x"]).dictionary_encode(),
                             "reward_model": [{"ground_truth": ["é", "b"]}]}), tmp_path / "a.parquet")
    g = write_rows(tmp_path / "b.parquet", [{"prompt": "c", "data_source": "z", "reward_model": {"ground_truth": "3"}}])
    ds = data.PromptDataset([str(tmp_path / "a.parquet"), g], tok, 64)
    assert sorted(ds.distinct("data_source")) == ["x", "z"] and ds[0]["ground_truth"] == '["é", "b"]'


def _bad_input(kind, tmp_path):
    if kind == "missing_file":
        return [str(tmp_path / "nope.parquet")], {}
    if kind == "missing_column":
        return [write_rows(tmp_path / "d.parquet", [{"prompt": "a", "data_source": "x"}])], {}
    if kind == "empty_after_filter":
        return [write_rows(tmp_path / "d.parquet", [row("a" * 50), row("b" * 60)])], {"max_prompt_length": 20}
    if kind == "prompt_int":
        return [write_rows(tmp_path / "d.parquet", [row("fine"), {**row(""), "prompt": None}])], {}
    if kind == "prompt_no_role":
        return [write_rows(tmp_path / "d.parquet", [{**row(""), "prompt": [{"content": "hi"}]}])], {}
    if kind == "overlong_error":
        return [write_rows(tmp_path / "d.parquet", [row("ok"), row("y" * 50)])], \
            {"max_prompt_length": 30, "filter_overlong": False}
    if kind == "reserved_column":
        return [write_rows(tmp_path / "d.parquet", [{**row("a"), "index": 7}])], {}
    if kind == "mixed_types":  # reward_model.style a string in one file, an int in the other
        rm = ({"style": "rule", "ground_truth": "1"}, {"style": 3, "ground_truth": "1"})
        return [write_rows(tmp_path / f"{n}.parquet", [{**row("a"), "reward_model": r}]) for n, r in zip("de", rm)], {}
    if kind == "bad_truncation":
        return [write_rows(tmp_path / "d.parquet", [row("ok")])], {"truncation": "sideways"}


@pytest.mark.parametrize("kind, exc, pattern", [
    ("missing_file", FileNotFoundError, r"nope\.parquet.*does not exist"),
    ("missing_column", ValueError, r"d\.parquet: missing column\(s\) \['reward_model'\].*\['prompt', 'data_source'\]"),
    ("empty_after_filter", ValueError, r"no prompts left.*all 2 are longer than max_prompt_length=20"),
    ("prompt_int", TypeError, r"d\.parquet: row 1: column 'prompt': expected a string or .*got NoneType"),
    ("prompt_no_role", TypeError, r"row 0: column 'prompt'.*got list"),
    # 69 = "<|im_start|>user\n" (6) + 50 bytes + "<|im_end|>\n" (2) + "<|im_start|>assistant\n" (11)
    ("overlong_error", ValueError, r"d\.parquet: row 1: prompt is 69 tokens, over max_prompt_length=30"),
    ("reserved_column", ValueError, r"d\.parquet: column\(s\) \['index'\] would be overwritten.*rename them"),
    ("mixed_types", ValueError, r"reward_model values of \[.*d\.parquet', '.*e\.parquet'\] do not keep one type"),
    ("bad_truncation", ValueError, r"truncation='sideways'.*'error', 'left', 'right', 'middle'"),
])
def test_bad_input_errors(tmp_path, tok, kind, exc, pattern):
    files, kw = _bad_input(kind, tmp_path)
    kw = {"max_prompt_length": 256, **kw}
    with pytest.raises(exc, match=pattern):
        data.PromptDataset(files, tok, **kw)
    cache = tmp_path / ".nanorl_cache"
    assert not cache.exists() or os.listdir(cache) == []  # nothing half-written left behind


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path)) + ".*no tokenizer files"):
        data.load_tokenizer(str(tmp_path))


# ----------------------------------------------------------------------------- the sampler


def draw(s, sizes):
    return [s.next_indices(b) for b in sizes]


@pytest.mark.parametrize("n, b, k", [(10, 3, 2), (10, 3, 3), (10, 3, 6), (12, 4, 3), (12, 4, 5), (7, 7, 1)])
def test_sampler_resume_is_exact(n, b, k):
    ref = data.Sampler(n, b, seed=11)
    stream = draw(ref, [None] * 12)
    per_epoch = n // b
    for e in range(12 // per_epoch):  # each epoch: disjoint full batches, the tail dropped
        epoch = stream[e * per_epoch:(e + 1) * per_epoch]
        flat = [i for batch in epoch for i in batch]
        assert all(len(x) == b for x in epoch) and len(set(flat)) == per_epoch * b and set(flat) <= set(range(n))
    s = data.Sampler(n, b, seed=11)
    draw(s, [None] * k)
    state = json.loads(json.dumps(s.state_dict()))
    assert (state["epoch"], state["position"]) == ((k - 1) // per_epoch, ((k - 1) % per_epoch + 1) * b)
    resumed = data.Sampler(n, b, seed=11)
    resumed.load_state_dict(state)
    after = draw(resumed, [None] * (12 - k))
    assert after == stream[k:]
    if k % per_epoch == 0:  # resumed exactly at an epoch boundary: the next epoch's first batch, no repeat
        assert after[0] == np.random.default_rng([11, k // per_epoch]).permutation(n)[:b].tolist()
        assert resumed.epoch == k // per_epoch + (12 - k - 1) // per_epoch


def test_sampler_seeds_shuffle_and_variable_batches():
    a, b, c = (data.Sampler(100, 8, seed=s) for s in (0, 0, 1))
    assert draw(a, [None] * 30) == draw(b, [None] * 30) != draw(c, [None] * 30)
    assert draw(data.Sampler(10, 4, seed=3, shuffle=False), [None] * 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]
    s = data.Sampler(10, 4, seed=5)
    first = s.next_indices()
    mid = s.state_dict()
    rest = draw(s, [3, 4, 2, 5])  # DAPO draws extra, differently sized batches through the same call
    e = [np.random.default_rng([5, k]).permutation(10).tolist() for k in range(3)]
    assert [first, *rest] == [e[0][:4], e[0][4:7], e[1][:4], e[1][4:6], e[2][:5]]
    assert (s.epoch, s.position) == (2, 5)
    s2 = data.Sampler(10, 4, seed=5)
    s2.load_state_dict(mid)
    assert draw(s2, [3, 4, 2, 5]) == rest
    with pytest.raises(ValueError, match="num_items=10 but this sampler has 11"):
        data.Sampler(11, 4, seed=5).load_state_dict(mid)
    with pytest.raises(ValueError, match="batch_size=11"):
        s.next_indices(11)
    # a batch larger than the dataset fails at construction (at startup, naming the config keys), not at the first draw
    with pytest.raises(ValueError, match=re.escape("batch_size=10 (data.gen_batch_size if set, else "
                                                   "data.train_batch_size) must be between 1 and the dataset size 5")):
        data.Sampler(5, 10, 0)


# ----------------------------------------------------------------------------- packing


def check_packing(lens, budget, dp, result):
    assert len(result) == dp
    assert len({len(r) for r in result}) == 1, "every rank needs the same number of micro-batches"
    flat = sorted(i for r in result for mb in r for i in mb)
    assert flat == list(range(len(lens))), "each sequence exactly once"
    for r in result:
        for mb in r:
            assert sum(lens[i] for i in mb) <= budget
        if any(len(mb) == 0 for mb in r):  # empty only when nothing on the rank could be split
            assert all(len(mb) <= 1 for mb in r)
    loads = [sum(lens[i] for r_mb in r for i in r_mb) for r in result]
    assert sum(loads) == sum(lens)
    return loads


def test_packing_random_respects_budget_and_balance():
    for seed in range(300):
        rng = np.random.default_rng(seed)
        budget = int(rng.integers(8, 600))
        dp = int(rng.integers(1, 9))
        lens = rng.integers(1, budget + 1, size=int(rng.integers(0, 200))).tolist()
        loads = check_packing(lens, budget, dp, data.pack_micro_batches(lens, budget, dp))
        if lens:  # list-scheduling bound
            assert max(loads) <= sum(lens) / dp + max(lens)


def test_packing_lpt_within_four_thirds_of_optimum():
    for seed in range(60):
        rng = np.random.default_rng(1000 + seed)
        dp = int(rng.integers(2, 4))
        lens = rng.integers(1, 100, size=int(rng.integers(dp, 10))).tolist()
        loads = check_packing(lens, 100, dp, data.pack_micro_batches(lens, 100, dp))
        opt = min(max(sum(l for l, r in zip(lens, assign) if r == k) for k in range(dp))
                  for assign in itertools.product(range(dp), repeat=len(lens)))
        assert max(loads) <= (4 / 3 - 1 / (3 * dp)) * opt + 1e-9


def test_packing_hand_example_and_errors():
    # LPT: 9->r0, 7->r1, 6->r1 (7<9), 4->r0 (9<13): loads 13/13; FFD with budget 10: r0 [9],[4]; r1 [7],[6]
    assert data.pack_micro_batches([4, 9, 6, 7], 10, 2) == [[[1], [0]], [[3], [2]]]
    # one rank packs into 1 micro-batch, the other needs 2: the first splits rather than idling
    res = data.pack_micro_batches([5, 5, 1, 1, 1, 1], 10, 2)
    check_packing([5, 5, 1, 1, 1, 1], 10, 2, res)
    assert all(len(mb) > 0 for r in res for mb in r)
    # too few sequences to split: empty micro-batches pad the count
    # LPT: 6->r0, 6->r1, 3->r0 (tie, lower rank); r1's single sequence cannot be split
    assert data.pack_micro_batches([6, 6, 3], 6, 2) == [[[0], [2]], [[1], []]]
    assert data.pack_micro_batches([], 10, 3) == [[], [], []]
    with pytest.raises(ValueError, match="sequence 1 has 11 tokens, more than max_tokens_per_micro_batch=10"):
        data.pack_micro_batches([3, 11], 10, 2)


def test_packed_inputs_hand_example():
    for seqs in ([[5, 6, 7], [8], [9, 10]], [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])]):
        out = data.packed_inputs(seqs)
        assert out["input_ids"].dtype == torch.long and out["input_ids"].tolist() == [5, 6, 7, 8, 9, 10]
        assert out["position_ids"].dtype == torch.long and out["position_ids"].tolist() == [0, 1, 2, 0, 0, 1]
        assert out["cu_seqlens"].dtype == torch.int32 and out["cu_seqlens"].tolist() == [0, 3, 4, 6]
        assert out["max_seqlen"] == 3 and isinstance(out["max_seqlen"], int)
    with pytest.raises(ValueError):
        data.packed_inputs([])


# ----------------------------------------------------------------------------- synthetic task


def test_synthetic_cli(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "syn"
    subprocess.run([sys.executable, os.path.join(REPO, "data.py"), "synthetic", "--out", str(out), "--task", "add",
                    "--n-train", "60", "--n-test", "10", "--seed", "3"], check=True, capture_output=True)
    tok = AutoTokenizer.from_pretrained(str(out / "model"))
    cfg = AutoConfig.from_pretrained(str(out / "model"))
    raw = json.loads((out / "model" / "config.json").read_text())
    assert raw["architectures"] == ["Qwen2ForCausalLM"] and raw["model_type"] == "qwen2" and raw["rope_theta"] == 10000
    assert len(tok) <= 25 and cfg.vocab_size == -(-len(tok) // 8) * 8 and cfg.tie_word_embeddings
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.max_position_embeddings) == (64, 128, 2, 4, 2, 128)
    assert cfg.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    rows = pq.read_table(str(out / "train.parquet")).to_pylist()
    assert len(rows) == 60 and len(pq.read_table(str(out / "test.parquet"))) == 10
    for r in rows:
        content = r["prompt"][0]["content"]
        a, b = map(int, re.fullmatch(r"(\d)\+(\d)=", content).groups())
        assert r["reward_model"]["ground_truth"] == str(a + b) and a + b <= 9 and r["data_source"] == "synthetic/add"
        ids = tok(content, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(content) and tok.decode(ids) == content
    assert tok.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=False) == \
        f"<|im_start|>{rows[0]['prompt'][0]['content']}<|im_end|><|im_start|>"
    ds = data.PromptDataset([str(out / "train.parquet")], data.load_tokenizer(str(out / "model")), 16)
    assert ds[0]["prompt_ids"] == [tok.convert_tokens_to_ids("<|im_start|>"), *tok(rows[0]["prompt"][0]["content"])
                                   ["input_ids"], tok.eos_token_id, tok.convert_tokens_to_ids("<|im_start|>")]
    model = AutoModelForCausalLM.from_config(cfg)
    assert model(torch.tensor([ds[0]["prompt_ids"]])).logits.shape == (1, 7, cfg.vocab_size)

    data.main(["synthetic", "--out", str(tmp_path / "copy"), "--n-train", "30", "--n-test", "5"])
    copy_rows = pq.read_table(str(tmp_path / "copy" / "train.parquet")).to_pylist()
    for r in copy_rows:
        assert r["prompt"][0]["content"] == "copy " + r["reward_model"]["ground_truth"]
        assert r["data_source"] == "synthetic/copy" and r["extra_info"]["split"] == "train"
        ids = tok(r["prompt"][0]["content"], add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == r["prompt"][0]["content"] and len(ids) == 6
    assert len({r["reward_model"]["ground_truth"] for r in copy_rows}) > 5


@pytest.mark.parametrize("other", [dict(seed=12), dict(shuffle=False)])
def test_sampler_refuses_state_of_another_seed_or_shuffle(other):
    s = data.Sampler(10, 3, seed=11)
    s.next_indices()
    kw = {"seed": 11, **other}
    key = next(iter(other))
    with pytest.raises(ValueError, match=f"sampler state has {key}="):
        data.Sampler(10, 3, **kw).load_state_dict(s.state_dict())


def test_first_fit_uses_a_micro_batch_filled_exactly_to_the_budget():
    # FFD, budget 10: 6 -> mb0 (4 left), 5 -> mb1 (5 left), 5 -> mb1 (exactly full), 4 -> mb0 (exactly full)
    assert data.pack_micro_batches([6, 4, 5, 5], 10, 1) == [[[0, 1], [2, 3]]]


def test_rank_with_fewer_micro_batches_splits_its_heaviest_into_balanced_halves():
    # LPT (desc, ties by index): 9(i3)->r0, 7(i2)->r1, 6(i5)->r1, 5(i0)->r0 (9<13), 5(i4)->r1 (13<14),
    # 1(i1)->r0, 1(i6)->r0: r0 = {9, 5, 1, 1}, r1 = {7, 6, 5}.
    # FFD, budget 10: r0 [9(i3), 1(i1)] (10 tokens), [5(i0), 1(i6)] (6); r1 [7], [6], [5] -> r0 needs a 3rd:
    # it splits its heaviest micro-batch [i3, i1] into [i3], [i1]
    assert data.pack_micro_batches([5, 1, 7, 9, 5, 6, 1], 10, 2) == [[[0, 6], [3], [1]], [[2], [5], [4]]]
    # the heaviest is not the first: LPT 7(i1)->r0, 7(i3)->r1, 6(i0)->r0 (tie 7/7, lower rank), 6(i2)->r1,
    # 5(i4)->r0 (13/13), 4(i6)->r1, 1(i5)->r1 (17<18): r0 = {7, 6, 5}, r1 = {7, 6, 4, 1}.
    # FFD: r0 [7], [6], [5]; r1 [7(i3), 1(i5)] (8 tokens), [6(i2), 4(i6)] (10) -> r1 splits the second,
    # heavier one into [i2], [i6] (splitting the first would leave [i2, i6] of 10 tokens, [i3], [i5])
    assert data.pack_micro_batches([6, 7, 6, 7, 5, 1, 4], 10, 2) == [[[1], [0], [4]], [[3, 5], [2], [6]]]
    # the split is into LPT-balanced halves: LPT 10(i5)->r0, then r1 takes 4(i3), 3(i2), 2(i1), 1(i0) while its
    # load stays below 10, 1(i4)->r0 (10/10 tie, lower rank). FFD: r0 [10], [1]; r1 [4, 3, 2, 1] (10 tokens) ->
    # halves 4+1 | 3+2 = 5/5, not [4] | [3, 2, 1] = 4/6
    assert data.pack_micro_batches([1, 2, 3, 4, 1, 10], 10, 2) == [[[5], [4]], [[0, 3], [1, 2]]]


def test_pack_rejects_a_negative_length():
    with pytest.raises(ValueError, match="sequence 1 has negative length -1"):
        data.pack_micro_batches([3, -1], 10, 1)


def test_micro_batch_positions_and_scatter_hand():
    prompts = [[1, 2], [3], [4, 5, 6]]
    responses = [[7, 8, 9], [10], [11, 12]]
    mb = data.micro_batch(prompts, responses, [2, 0])
    # packed: [4 5 6 11 12 | 1 2 7 8 9]; the logits at position p predict token p+1, so response tokens are
    # predicted at 2, 3 (row 0 = dataset row 2) and 6, 7, 8 (row 1 = dataset row 0)
    assert mb["input_ids"].tolist() == [4, 5, 6, 11, 12, 1, 2, 7, 8, 9]
    assert mb["sel"].tolist() == [2, 3, 6, 7, 8]
    assert mb["row"].tolist() == [0, 0, 1, 1, 1] and mb["col"].tolist() == [0, 1, 0, 1, 2]
    assert mb["targets"].tolist() == [11, 12, 7, 8, 9] and mb["row_ids"] == [2, 0]
    out = data.scatter_rows(mb, mb["targets"].double(), 4)
    assert out.tolist() == [[11, 12, 0, 0], [7, 8, 9, 0]]
    # dp_micro_batches maps the packer's positions back to the dataset rows it was given
    (only,) = data.dp_micro_batches(prompts, responses, [2, 0], max_tokens=100, dp_size=1, dp_rank=0)
    assert only["row_ids"] == [2, 0] and only["targets"].tolist() == [11, 12, 7, 8, 9]


def test_middle_truncation_of_an_odd_length_keeps_the_shorter_half_first(tmp_path, tok):
    msgs = [{"role": "user", "content": "x" * 40 + "END"}]
    full = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    f = write_rows(tmp_path / "a.parquet", [{**row(""), "prompt": msgs}])
    n = 21  # verl: left_half = n // 2 = 10 tokens from the start, right_half = n - left_half = 11 from the end
    ds = data.PromptDataset([f], tok, n, truncation="middle", filter_overlong=False)
    assert ds[0]["prompt_ids"] == full[:10] + full[-11:]


def test_cache_key_depends_on_filter_overlong(tmp_path, tok):
    f = write_rows(tmp_path / "d.parquet", [row("hi"), row("y" * 50)])
    kept = data.PromptDataset([f], tok, 30, truncation="left", filter_overlong=False)
    assert len(kept) == 2 and kept.num_filtered == 0
    filtered = data.PromptDataset([f], tok, 30, truncation="left", filter_overlong=True)
    assert filtered.cache_path != kept.cache_path and len(filtered) == 1 and filtered.num_filtered == 1


def test_prepare_gsm8k_drops_commas_from_the_final_answer(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    for split in ("train", "test"):
        (src / f"{split}.jsonl").write_text(json.dumps({"question": "q?", "answer": "a lot\n#### 1,234"}) + "\n")
    data.prepare_gsm8k(str(src), str(out))
    for split in ("train", "test"):
        (r,) = pq.read_table(str(out / f"{split}.parquet")).to_pylist()
        assert r["reward_model"]["ground_truth"] == "1234"


def test_prompt_key_names_the_messages_column_and_a_prompt_column_is_carried(tmp_path, tok):
    """prompt_key="messages": the messages are read from that column (not from "prompt"), which is replaced by
    the messages; an unrelated column named "prompt" is just another column carried along."""
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "what is 2+2?"}]
    f = write_rows(tmp_path / "d.parquet", [{"messages": msgs, "prompt": "raw text, not the prompt",
                                         "data_source": "s", "reward_model": {"ground_truth": "4"}}])
    ds = data.PromptDataset([f], tok, 256, prompt_key="messages")
    item = ds[0]
    assert item["prompt_ids"] == reference_ids(tok, msgs)
    assert item["messages"] == msgs and item["prompt"] == "raw text, not the prompt"
    assert (item["ground_truth"], item["data_source"]) == ("4", "s")


def test_a_prompt_of_exactly_max_prompt_length_is_kept_whole(tmp_path, tok):
    msgs = [{"role": "user", "content": "exactly"}]
    full = reference_ids(tok, msgs)
    f = write_rows(tmp_path / "d.parquet", [row("exactly")])
    ds = data.PromptDataset([f], tok, len(full))  # filter_overlong=True: only longer prompts are dropped
    assert len(ds) == 1 and ds.num_filtered == 0 and ds[0]["prompt_ids"] == full
    ds = data.PromptDataset([f], tok, len(full), truncation="left", filter_overlong=False)
    assert ds[0]["prompt_ids"] == full


def test_a_non_string_ground_truth_is_json_encoded(tmp_path, tok):
    """A list or bool ground truth (several accepted answers, a yes/no label) reaches the scorer as JSON, which a
    scorer can json.loads back: not Python's repr ("['12', 'twelve']", "True")."""
    f = write_rows(tmp_path / "d.parquet", [row("a", ["12", "twelve"]), row("b", ["yes"])])
    ds = data.PromptDataset([f], tok, 256)
    assert json.loads(ds[0]["ground_truth"]) == ["12", "twelve"] and ds[0]["ground_truth"] == '["12", "twelve"]'
    assert ds[1]["ground_truth"] == '["yes"]'
    g = write_rows(tmp_path / "e.parquet", [row("c", True)])
    assert data.PromptDataset([g], tok, 256)[0]["ground_truth"] == "true"
    # not JSON (bytes, a date): an error naming the file and row, not json's bare TypeError
    for i, truth in enumerate((b"\x01", datetime.date(2024, 1, 2))):
        h = write_rows(tmp_path / f"f{i}.parquet", [row("d", truth)])
        with pytest.raises(ValueError, match=rf"f{i}\.parquet: row 0: reward_model\.ground_truth must be a string or"):
            data.PromptDataset([h], tok, 256)


def test_more_prompts_than_one_tokenizer_chunk(tmp_path, tok):
    """The prompts are tokenized in chunks of 4096: with 4100 every row keeps its own ids (none skipped or
    shifted at the chunk boundary, none dropped after it)."""
    n = 4100
    f = write_rows(tmp_path / "d.parquet", [row(f"q{i}", str(i)) for i in range(n)])
    ds = data.PromptDataset([f], tok, 256)
    assert len(ds) == n
    for i in (0, 4094, 4095, 4096, 4097, n - 1):
        item = ds[i]
        assert item["prompt_ids"] == reference_ids(tok, [{"role": "user", "content": f"q{i}"}]), i
        assert item["ground_truth"] == str(i) and item["index"] == i


def test_the_tokenizers_own_special_tokens_are_not_added_twice(tmp_path, tok):
    """A tokenizer whose post-processor adds a BOS (as Llama 3's does) must not get it on top of the chat template,
    which spells out its own special tokens: the ids are apply_chat_template's."""
    from tokenizers.processors import TemplateProcessing
    bos_tok = make_tokenizer()
    bos_tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos_tok.convert_tokens_to_ids("<|endoftext|>"))])
    assert bos_tok("hi")["input_ids"][0] == bos_tok.convert_tokens_to_ids("<|endoftext|>")  # the BOS is there
    f = write_rows(tmp_path / "d.parquet", [row("hello")])
    ds = data.PromptDataset([f], bos_tok, 256)
    assert ds[0]["prompt_ids"] == reference_ids(bos_tok, [{"role": "user", "content": "hello"}])


def test_a_message_whose_content_is_not_a_string_is_refused(tmp_path, tok):
    """OpenAI-style content parts ([{"type": "text", ...}]) or a number would be rendered by the template as their
    Python repr: refused, naming the row, like a message without a role."""
    for content in ([{"type": "text", "text": "hi"}], 5):
        f = write_rows(tmp_path / "d.parquet", [{**row(""), "prompt": [{"role": "user", "content": content}]}])
        with pytest.raises(TypeError, match=r"row 0: column 'prompt': expected a string or a non-empty list"):
            data.PromptDataset([f], tok, 256)


def test_synthetic_refuses_an_empty_split_and_a_negative_seed(tmp_path):
    for n_train, n_test in ((0, 10), (10, 0), (5, -1)):  # each wrote a parquet file without columns
        with pytest.raises(ValueError, match=f"n_train={n_train} and n_test={n_test} .* must be >= 1"):
            data.prepare_synthetic(str(tmp_path / "syn"), n_train=n_train, n_test=n_test)
        assert not (tmp_path / "syn").exists()
    with pytest.raises(ValueError, match=r"seed=-1 \(--seed\) must be >= 0"):  # numpy's message and model/ before
        data.prepare_synthetic(str(tmp_path / "syn"), seed=-1)
    assert not (tmp_path / "syn").exists()


def test_synthetic_splits_are_independent_streams(tmp_path):
    """Each split draws from its own child of the seed: the test prompts stay put when n_train changes and are not
    the first train prompts again, the train prompts of a longer split extend the shorter one, another seed differs."""
    def prompts(name, split):
        return [r["prompt"][0]["content"] for r in pq.read_table(str(tmp_path / name / f"{split}.parquet")).to_pylist()]
    for name, n_train, seed in (("a", 50, 0), ("b", 80, 0), ("c", 50, 1)):
        data.prepare_synthetic(str(tmp_path / name), "add", n_train=n_train, n_test=20, seed=seed)
    a_train, a_test = prompts("a", "train"), prompts("a", "test")
    assert len(a_train) == 50 and len(a_test) == 20 and a_test != a_train[:20]
    assert prompts("b", "test") == a_test and prompts("b", "train")[:50] == a_train
    assert prompts("c", "test") != a_test and prompts("c", "train") != a_train


def test_truncation_and_padding_saved_in_tokenizer_json_do_not_touch_the_ids(tmp_path, tok):
    """A tokenizer.json may carry truncation/padding settings (the backend keeps them after loading); the wrapper
    turns them off for a plain call, as verl's tokenizer(text, add_special_tokens=False) makes, so must the cache."""
    t = make_tokenizer()
    t.backend_tokenizer.enable_truncation(max_length=12)
    t.backend_tokenizer.enable_padding(pad_id=256, pad_token="<|endoftext|>")
    t.save_pretrained(str(tmp_path / "tok"))
    saved = data.load_tokenizer(str(tmp_path / "tok"))
    f = write_rows(tmp_path / "d.parquet", [row("hi"), row("a much longer question")])
    ds = data.PromptDataset([f], saved, 256)
    for i, content in enumerate(["hi", "a much longer question"]):
        assert ds[i]["prompt_ids"] == reference_ids(tok, content)


def test_split_special_tokens_is_part_of_the_cache_key(tmp_path, tok_dir):
    """split_special_tokens (a wrapper setting, not in tokenizer.json) changes the ids: no stale cache across it."""
    from transformers import AutoTokenizer
    f = write_rows(tmp_path / "d.parquet", [row("hi")])
    plain = data.PromptDataset([f], AutoTokenizer.from_pretrained(tok_dir), 256)
    split_tok = AutoTokenizer.from_pretrained(tok_dir, split_special_tokens=True)
    split = data.PromptDataset([f], split_tok, 256)
    text = split_tok.apply_chat_template(row("hi")["prompt"], add_generation_prompt=True, tokenize=False)
    assert split.cache_path != plain.cache_path
    assert split[0]["prompt_ids"] == split_tok(text, add_special_tokens=False)["input_ids"] != plain[0]["prompt_ids"]


def test_prepare_gsm8k_refuses_an_empty_split(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.jsonl").write_text(json.dumps({"question": "q?", "answer": "a\n#### 1"}) + "\n")
    (src / "test.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"test\.jsonl holds no examples"):
        data.prepare_gsm8k(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
