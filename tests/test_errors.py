"""Every user-facing bad input gives a clear error and leaves nothing half-written on disk.

One table: each case builds a bad input, calls the public entry point a user would reach
(train.load_config / train.main, parallel.validate_layout, reshard.validate_generation_layout,
model.ModelConfig.from_dir / model.load_model, data.load_tokenizer / data.PromptDataset / data.prepare_gsm8k,
rewards.load_reward_fn / rewards.score_batch, reshard.load_into / the reshard CLI) and checks
the exception type and a regex on its message: the message must name what is wrong, where
(the file, key or value) and what was expected. Cases with a `leftovers` check also assert
that the failed call wrote nothing (no output directory, no *.tmp directory, no cache file).

Everything is built once per module from the synthetic task's tiny model (2 layers, 4 heads,
2 kv heads, intermediate 128, vocab 24): no transformers model classes, no processes.
"""
from __future__ import annotations

import copy
import errno
import glob
import importlib.util
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, replace
from typing import Any, Callable
from unittest import mock

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

import data
import reshard
import rewards
import train
from data import prepare_synthetic
from model import ModelConfig, load_model
from parallel import Layout, tp_rows, validate_layout

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "tiny.yaml")
README = os.path.join(os.path.dirname(CONFIG), "..", "README.md")
N_TRAIN = 64

# ----------------------------------------------------------------------------- shared inputs (built once)


@dataclass
class Env:
    synth: str        # prepare_synthetic output: train/test parquet + model/ (tokenizer + config.json, no weights)
    model_dir: str    # synth/model
    hf: str           # a Hugging Face directory of the same model, with weights (exported from ck)
    ck: str           # a good tp=1 checkpoint (meta.json + model_pp0_tp0.safetensors + tokenizer)
    ck_other: str     # a good checkpoint of a different model shape (intermediate_size=256)
    ck_trunc: str     # ck with its weight shard cut in half
    ck_mixed: str     # a tp=2 checkpoint whose tp1 shard comes from the other model
    tok: Any          # the synthetic tokenizer


def _write_ckpt(model_dir: str, out: str, tp: int = 1) -> None:
    os.makedirs(out, exist_ok=True)
    for r in range(tp):
        lay = Layout(tp=tp, tp_rank=r)
        m = load_model(model_dir, lay, random_init=True, seed=1)
        reshard.save_model_shard(m, lay, out)
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump({"step": 1, "tp": tp, "pp": 1, "dp": 1, "model_config": m.cfg.raw}, f)
    for fn in os.listdir(model_dir):
        if fn.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(os.path.join(model_dir, fn), out)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Env:
    root = str(tmp_path_factory.mktemp("errors"))
    synth = os.path.join(root, "synth")
    prepare_synthetic(synth, task="copy", n_train=N_TRAIN, n_test=8, seed=0)
    model_dir = os.path.join(synth, "model")
    # the same model with intermediate_size 256: another shape, same tensor names
    other_dir = os.path.join(root, "other_model")
    shutil.copytree(model_dir, other_dir)
    cfg = json.load(open(os.path.join(other_dir, "config.json")))
    json.dump({**cfg, "intermediate_size": 256}, open(os.path.join(other_dir, "config.json"), "w"))

    ck, ck_other = os.path.join(root, "ck"), os.path.join(root, "ck_other")
    _write_ckpt(model_dir, ck)
    _write_ckpt(other_dir, ck_other)
    hf = os.path.join(root, "hf")
    reshard.export_hf(ck, hf)

    ck_trunc = os.path.join(root, "ck_trunc")
    shutil.copytree(ck, ck_trunc)
    shard = os.path.join(ck_trunc, "model_pp0_tp0.safetensors")
    blob = open(shard, "rb").read()
    open(shard, "wb").write(blob[:len(blob) // 2])

    # tp=2 checkpoint of the synthetic model, then its tp1 shard replaced by the other model's
    ck_mixed, other_tp2 = os.path.join(root, "ck_mixed"), os.path.join(root, "other_tp2")
    _write_ckpt(model_dir, ck_mixed, tp=2)
    _write_ckpt(other_dir, other_tp2, tp=2)
    shutil.copy(os.path.join(other_tp2, "model_pp0_tp1.safetensors"), ck_mixed)
    return Env(synth, model_dir, hf, ck, ck_other, ck_trunc, ck_mixed, data.load_tokenizer(model_dir))


# ----------------------------------------------------------------------------- small builders


def _cfg(*ov):
    return lambda env, tmp: train.load_config(CONFIG, list(ov))


def _without_tensorboard(call, env, tmp):
    find = importlib.util.find_spec
    with mock.patch("importlib.util.find_spec", lambda name, *a: None if name == "tensorboard" else find(name, *a)):
        return call(env, tmp)


def _yaml_file(tmp, name: str, text: str) -> str:
    p = os.path.join(tmp, name)
    with open(p, "w") as f:
        f.write(text)
    return p


def _config_without_model_path(env, tmp):
    raw = yaml.safe_load(open(CONFIG))
    del raw["actor"]["model_path"]
    return train.load_config(_yaml_file(tmp, "no_model.yaml", yaml.safe_dump(raw)))


def _mcfg(env) -> ModelConfig:
    return ModelConfig.from_dir(env.model_dir)


def _model_dir(tmp, config: dict | str | None, weights_from: str | None = None, tokenizer_from: str | None = None):
    """A model directory with the given config.json (a dict, raw text, or none at all)."""
    d = os.path.join(tmp, "model")
    os.makedirs(d, exist_ok=True)
    if config is not None:
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write(config if isinstance(config, str) else json.dumps(config))
    if weights_from:
        for fn in os.listdir(weights_from):
            if "safetensors" in fn:
                shutil.copy(os.path.join(weights_from, fn), d)
    if tokenizer_from:
        for fn in os.listdir(tokenizer_from):
            if fn.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
                shutil.copy(os.path.join(tokenizer_from, fn), d)
    return d


def _synth_config(env, **changes) -> dict:
    c = json.load(open(os.path.join(env.model_dir, "config.json")))
    for k, v in changes.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    return c


def _truncated_hf(env, tmp):
    d = _model_dir(tmp, _synth_config(env), weights_from=env.hf)
    for fn in glob.glob(os.path.join(d, "*.safetensors")):
        blob = open(fn, "rb").read()
        open(fn, "wb").write(blob[:len(blob) // 2])
    return load_model(d)


def _two_copies_no_index(env, tmp):
    d = _model_dir(tmp, _synth_config(env), weights_from=env.hf)
    os.remove(os.path.join(d, "model.safetensors.index.json"))
    shutil.copy(glob.glob(os.path.join(d, "*.safetensors"))[0], os.path.join(d, "model_ema.safetensors"))
    return load_model(d)


def _index_names_the_wrong_file(env, tmp):
    from safetensors.torch import save_file
    d = _model_dir(tmp, _synth_config(env), weights_from=env.hf)
    index = os.path.join(d, "model.safetensors.index.json")
    save_file({"x": torch.zeros(1)}, os.path.join(d, "extra.safetensors"))
    meta = json.load(open(index))
    json.dump({**meta, "weight_map": {**meta["weight_map"], "model.norm.weight": "extra.safetensors"}}, open(index, "w"))
    return load_model(d)


def _tied_with_its_own_head(env, tmp):
    """The synthetic model is tied; its export plus an lm_head.weight: the same tensor loads, another one is refused."""
    from safetensors.torch import load_file, save_file
    d = _model_dir(tmp, _synth_config(env), weights_from=env.hf)
    (fn,), index = glob.glob(os.path.join(d, "model-*.safetensors")), os.path.join(d, "model.safetensors.index.json")
    meta = json.load(open(index))
    json.dump({**meta, "weight_map": {**meta["weight_map"], "lm_head.weight": os.path.basename(fn)}}, open(index, "w"))
    w, emb = load_file(fn), load_file(fn)["model.embed_tokens.weight"]
    save_file({**w, "lm_head.weight": emb.clone()}, fn, metadata={"format": "pt"})
    for lay in (None, Layout(tp=2, tp_rank=0), Layout(tp=2, tp_rank=1)):
        rows = tp_rows(len(emb), lay.tp, lay.tp_rank) if lay else slice(None)
        assert torch.equal(load_model(d, lay).lm_head.weight, emb[rows])
    differs = emb.clone()
    differs[-1] += 1e-3  # in TP rank 1's rows only: each rank compares the rows it holds
    save_file({**w, "lm_head.weight": differs}, fn, metadata={"format": "pt"})
    try:
        load_model(d, Layout(tp=2, tp_rank=0))
    except ValueError as e:  # not the case's expected error: rank 0's rows are equal
        raise AssertionError(f"TP rank 0 holds equal rows, yet: {e}") from None
    with pytest.raises(ValueError, match="differs from model.embed_tokens.weight"):
        load_model(d, Layout(tp=2, tp_rank=1))
    return load_model(d)


def _dataset(env, tmp, files, **kw):
    kw.setdefault("max_prompt_length", 16)
    return data.PromptDataset(files, env.tok, cache_dir=os.path.join(tmp, "cache"), **kw)


def _parquet(tmp, name: str, rows: list[dict]) -> str:
    p = os.path.join(tmp, name)
    pq.write_table(pa.Table.from_pylist(rows), p)
    return p


def _renders_empty(env, tmp):
    """Under a bare template ({{ content }} alone) an empty message is a prompt of no tokens."""
    tok = copy.deepcopy(env.tok)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    rows = [{"prompt": text, "data_source": "t", "reward_model": {"ground_truth": "1"}} for text in ("copy 1", "")]
    return data.PromptDataset([_parquet(tmp, "blank.parquet", rows)], tok, 16, cache_dir=os.path.join(tmp, "cache"))


def _empty_parquet(env, tmp) -> str:  # the synthetic task's columns, no rows
    p = os.path.join(tmp, "empty.parquet")
    pq.write_table(pq.read_table(f"{env.synth}/train.parquet").slice(0, 0), p)
    return p


def _cache_leftovers(env, tmp):
    return glob.glob(os.path.join(tmp, "cache", "*"))


def _gsm8k(tmp, train_lines: list[str] | None, test_lines: list[str] | None):
    src, out = os.path.join(tmp, "src"), os.path.join(tmp, "out")
    os.makedirs(src)
    for split, lines in (("train", train_lines), ("test", test_lines)):
        if lines is not None:
            with open(os.path.join(src, f"{split}.jsonl"), "w") as f:
                f.write("".join(line + "\n" for line in lines))
    data.prepare_gsm8k(src, out)


GSM_OK = json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"})


def _gsm8k_leftovers(env, tmp):
    return glob.glob(os.path.join(tmp, "out", "*.parquet")) + glob.glob(os.path.join(tmp, "out", "*.tmp*"))


def _reward_file(tmp, text: str, name: str = "rew.py") -> str:
    return _yaml_file(tmp, name, text)


GOOD_SCORER = "def compute(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"


def _train_main(env, tmp, *extra):
    out = os.path.join(tmp, "run")
    train.main([CONFIG, f"data.train_files=[{env.synth}/train.parquet]", f"data.val_files=[{env.synth}/test.parquet]",
                f"actor.model_path={env.model_dir}", f"trainer.output_dir={out}", f"data.cache_dir={out}/cache",
                "trainer.total_steps=1", *extra])


def _misspelt_source(env, tmp):  # the synthetic train split with data_source 'synthetic/cpy'
    t = pq.read_table(f"{env.synth}/train.parquet")
    col = t.schema.get_field_index("data_source")
    bad = os.path.join(tmp, "cpy.parquet")
    pq.write_table(t.set_column(col, "data_source", pa.array(["synthetic/cpy"] * len(t))), bad)
    _train_main(env, tmp, f"data.train_files=[{bad}]")


def _fresh_over_checkpoints(env, tmp):
    _train_main(env, tmp, "trainer.save_freq=1", "trainer.test_freq=-1")
    _train_main(env, tmp, "trainer.resume=never", "trainer.seed=5")


def _first_run_untouched(env, tmp):  # the refused run rewrote neither the first one's config nor its metrics
    run = os.path.join(tmp, "run")
    rows = open(os.path.join(run, "metrics.jsonl")).read().count("\n")
    return [run] if rows != 1 or yaml.safe_load(open(os.path.join(run, "config.yaml")))["trainer"]["seed"] != 0 else []


def _gae_over_grpo(env, tmp):
    _train_main(env, tmp, "trainer.save_freq=1", "trainer.test_freq=-1")
    _train_main(env, tmp, "trainer.resume=auto", "algorithm.adv_estimator=gae", "trainer.total_steps=2")


def _run_leftovers(env, tmp):
    return [p for p in (os.path.join(tmp, "run", "metrics.jsonl"), os.path.join(tmp, "run", "checkpoints"))
            if os.path.exists(p)]


def _export(ck_attr: str):
    return lambda env, tmp: reshard.main([getattr(env, ck_attr), "--to-hf", os.path.join(tmp, "out")])


def _export_leftovers(env, tmp):
    return [p for p in [os.path.join(tmp, "out")] + glob.glob(os.path.join(tmp, "out.tmp*")) if os.path.exists(p)]


def _ck_with_meta(env, tmp, meta_text: str):
    d = os.path.join(tmp, "ck")
    shutil.copytree(env.ck, d)
    with open(os.path.join(d, "meta.json"), "w") as f:
        f.write(meta_text)
    return d


def _disk_full(target: str, call: Callable):
    """call(env, tmp) while `target` (a dotted name) fails as a full disk does."""
    def run(env, tmp):
        with mock.patch(target, side_effect=OSError(errno.ENOSPC, "No space left on device")):
            return call(env, tmp)
    return run


def _export_existing(env, tmp):
    out = os.path.join(tmp, "out")
    os.makedirs(out)
    open(os.path.join(out, "keep.txt"), "w").write("mine")
    reshard.main([env.ck, "--to-hf", out])


def _existing_untouched(env, tmp):
    out = os.path.join(tmp, "out")
    bad = [] if os.listdir(out) == ["keep.txt"] else [out]
    return bad + glob.glob(out + ".tmp*")


# ----------------------------------------------------------------------------- the table


@dataclass
class Case:
    id: str
    input: str                    # for the README table
    call: Callable                # call(env, tmp) must raise `exc`
    exc: type
    match: str                    # re.search on str(exception)
    leftovers: Callable | None = None  # leftovers(env, tmp) -> paths that must not exist after the failure


CASES = [
    # --- config: train.load_config(path, overrides)
    Case("config-unknown-key", "actor.clip_ratio_hihg=0.3", _cfg("actor.clip_ratio_hihg=0.3"), KeyError,
         r"override 'actor\.clip_ratio_hihg=0\.3': "
         r"unknown config key 'actor\.clip_ratio_hihg'; did you mean 'actor\.clip_ratio_high'\?"),
    Case("config-unknown-section", "trainr.total_steps=5", _cfg("trainr.total_steps=5"), KeyError,
         r"override 'trainr\.total_steps=5': unknown config key 'trainr'; did you mean 'trainer'\?"),
    Case("config-key-in-another-section", "actor.temperature=0.7", _cfg("actor.temperature=0.7"), KeyError,
         r"unknown config key 'actor\.temperature'; did you mean 'rollout\.temperature'\?"),
    Case("config-section-in-another-section", "actor.kl_ctrl.type=adaptive", _cfg("actor.kl_ctrl.type=adaptive"),
         KeyError, r"unknown config key 'actor\.kl_ctrl'; did you mean 'algorithm\.kl_ctrl'\?"),
    Case("config-gen-batch-without-dapo", "data.gen_batch_size=48 without filter_groups",
         _cfg("data.gen_batch_size=48"), ValueError, r"override 'data\.gen_batch_size=48': data\.gen_batch_size=48 "
         r"differs from data\.train_batch_size, which only DAPO's dynamic sampling allows"),
    Case("config-val-only-without-val-files", "trainer.val_only=true with no data.val_files",
         _cfg("trainer.val_only=true", "data.val_files=[]"), ValueError,
         r"override 'trainer\.val_only=true': trainer\.val_only needs data\.val_files to validate on"),
    Case("config-wrong-type", "actor.ppo_epochs=two", _cfg("actor.ppo_epochs=two"), TypeError,
         r"override 'actor\.ppo_epochs=two': actor\.ppo_epochs must be int, got 'two'"),
    Case("config-wrong-bool", "data.shuffle=maybe", _cfg("data.shuffle=maybe"), TypeError,
         r"override 'data\.shuffle=maybe': data\.shuffle must be true or false, got 'maybe'"),
    Case("config-bad-enum", "actor.loss_agg_mode=mean", _cfg("actor.loss_agg_mode=mean"), ValueError,
         r"override 'actor\.loss_agg_mode=mean': "
         r"actor\.loss_agg_mode='mean' is not one of \['token-mean', 'seq-mean-token-sum'"),
    Case("config-bad-dtype", "actor.dtype=fp16", _cfg("actor.dtype=fp16"), ValueError,
         r"override 'actor\.dtype=fp16': actor\.dtype='fp16' is not one of \['auto', 'bf16', 'fp32'\]"),
    Case("config-batch-not-multiple", "data.train_batch_size=24 (ppo_mini_batch_size 16)",
         _cfg("data.train_batch_size=24"), ValueError,
         r"override 'data\.train_batch_size=24': "
         r"data\.train_batch_size=24 is not a multiple of actor\.ppo_mini_batch_size=16"),
    Case("config-grpo-n1", "rollout.n=1 with adv_estimator grpo", _cfg("rollout.n=1"), ValueError,
         r"override 'rollout\.n=1': algorithm\.adv_estimator=grpo compares .*rollout\.n=1 must be >= 2"),
    Case("config-bypass-with-is", "algorithm.rollout_is.bypass_mode=true with .enable=true",
         _cfg("algorithm.rollout_is.bypass_mode=true", "algorithm.rollout_is.enable=true"), ValueError,
         r"override 'algorithm\.rollout_is\.enable=true': "
         r"algorithm\.rollout_is\.enable and bypass_mode are exclusive"),
    Case("config-not-positive", "actor.ppo_epochs=0", _cfg("actor.ppo_epochs=0"), ValueError,
         r"override 'actor\.ppo_epochs=0': actor\.ppo_epochs=0 must be >= 1"),
    Case("config-negative-lr", "actor.optim.lr=-1 (gradient ascent)", _cfg("actor.optim.lr=-1"), ValueError,
         r"override 'actor\.optim\.lr=-1': actor\.optim\.lr=-1\.0 must be >= 0"),
    Case("config-bad-top-k", "rollout.top_k=-5", _cfg("rollout.top_k=-5"), ValueError,
         r"override 'rollout\.top_k=-5': rollout\.top_k=-5 must be >= -1"),
    Case("config-negative-val-temperature", "rollout.val_temperature=-1", _cfg("rollout.val_temperature=-1"),
         ValueError, r"override 'rollout\.val_temperature=-1': rollout\.val_temperature=-1\.0 must be >= 0"),
    Case("config-zero-val-top-p", "rollout.val_top_p=0", _cfg("rollout.val_top_p=0"), ValueError,
         r"override 'rollout\.val_top_p=0': rollout\.val_top_p=0\.0 must be > 0"),
    Case("config-kv-cache-under-one-sequence", "rollout.kv_cache_tokens=100 (found at the first generation, before)",
         _cfg("rollout.kv_cache_tokens=100", "data.max_prompt_length=64", "data.max_response_length=64"), ValueError,
         r"override 'data\.max_response_length=64': rollout\.kv_cache_tokens=100 < data\.max_prompt_length \+ "
         r"max_response_length = 128: it cannot hold one sequence"),
    Case("config-negative-kv-cache", "rollout.kv_cache_tokens=-5 (found at the first generation, naming no key, "
         "before)", _cfg("rollout.kv_cache_tokens=-5"), ValueError,
         r"override 'rollout\.kv_cache_tokens=-5': rollout\.kv_cache_tokens=-5 must be >= 0"),
    Case("config-critic-epochs", "critic.ppo_epochs=-2 (the actor's epochs, before)", _cfg("critic.ppo_epochs=-2"),
         ValueError, r"override 'critic\.ppo_epochs=-2': critic\.ppo_epochs=-2 must be >= -1"),
    Case("config-micro-batch-under-one-sequence", "actor.max_tokens_per_micro_batch=100 (found after the first "
         "generation, before)", _cfg("actor.max_tokens_per_micro_batch=100", "data.max_prompt_length=64",
                                     "data.max_response_length=64"), ValueError,
         r"override 'data\.max_response_length=64': actor\.max_tokens_per_micro_batch=100 < "
         r"data\.max_prompt_length \+ max_response_length = 128: it cannot hold one sequence"),
    Case("config-negative-seed", "trainer.seed=-1 (numpy's message, naming no key, before)", _cfg("trainer.seed=-1"),
         ValueError, r"override 'trainer\.seed=-1': trainer\.seed=-1 must be >= 0"),
    Case("config-top-p-above-one", "rollout.top_p=1.5 (failed only at the first generation before)",
         _cfg("rollout.top_p=1.5"), ValueError, r"override 'rollout\.top_p=1\.5': rollout\.top_p=1\.5 must be <= 1"),
    Case("config-top-p-zero", "rollout.top_p=0", _cfg("rollout.top_p=0"), ValueError,
         r"override 'rollout\.top_p=0': rollout\.top_p=0\.0 must be > 0"),
    Case("config-zero-temperature", "rollout.temperature=0 (the training log-probs divide by it)",
         _cfg("rollout.temperature=0"), ValueError,
         r"override 'rollout\.temperature=0': rollout\.temperature=0\.0 must be >= 1e-05"),
    Case("config-tiny-temperature", "rollout.temperature=1e-40 (NaN log-probs and token 0 before: logits / T overflow)",
         _cfg("rollout.temperature=1e-40"), ValueError,
         r"override 'rollout\.temperature=1e-40': rollout\.temperature=1e-40 must be >= 1e-05"),
    Case("config-dual-clip-c", "actor.clip_ratio_c=1 (failed only at the first update before)",
         _cfg("actor.clip_ratio_c=1"), ValueError,
         r"override 'actor\.clip_ratio_c=1': actor\.clip_ratio_c=1\.0 must be > 1"),
    Case("config-kl-horizon-zero", "algorithm.kl_ctrl.horizon=0 (a division by zero at the first update before)",
         _cfg("algorithm.kl_ctrl.horizon=0"), ValueError,
         r"override 'algorithm\.kl_ctrl\.horizon=0': algorithm\.kl_ctrl\.horizon=0 must be >= 1"),
    Case("config-negative-clip-low", "actor.clip_ratio_low=-0.2", _cfg("actor.clip_ratio_low=-0.2"), ValueError,
         r"override 'actor\.clip_ratio_low=-0\.2': actor\.clip_ratio_low=-0\.2 must be >= 0"),
    Case("config-memory-fraction", "rollout.gpu_memory_fraction=1.2", _cfg("rollout.gpu_memory_fraction=1.2"),
         ValueError, r"override 'rollout\.gpu_memory_fraction=1\.2': rollout\.gpu_memory_fraction=1\.2 must be <= 1"),
    Case("config-bool-beta", "critic.optim.betas=[false,0.9]", _cfg("critic.optim.betas=[false,0.9]"), ValueError,
         r"critic\.optim\.betas=\[False, 0\.9\] must be two numbers in \[0, 1\)"),
    Case("config-bad-betas", "actor.optim.betas=[0.9]", _cfg("actor.optim.betas=[0.9]"), ValueError,
         r"override 'actor\.optim\.betas=\[0\.9\]': actor\.optim\.betas=\[0\.9\] must be two numbers in \[0, 1\)"),
    Case("config-unknown-logger", "trainer.logger=[jsonl_]", _cfg("trainer.logger=[jsonl_]"), ValueError,
         r"override 'trainer\.logger=\[jsonl_\]': "
         r"trainer\.logger has unknown sink\(s\) \['jsonl_'\]; valid: \['console', 'jsonl'"),
    Case("config-tensorboard-missing", "trainer.logger=[console,tensorboard] without tensorboard installed",
         lambda env, tmp: _without_tensorboard(_cfg("trainer.logger=[console,tensorboard]"), env, tmp),
         ModuleNotFoundError, r"override 'trainer\.logger=\[console,tensorboard\]': trainer\.logger names "
         r"tensorboard: pip install tensorboard"),
    Case("config-gspo-token-mean", "actor.policy_loss_mode=gspo with the default token-mean aggregation",
         _cfg("actor.policy_loss_mode=gspo"), ValueError,
         r"override 'actor\.policy_loss_mode=gspo': actor\.policy_loss_mode=gspo needs "
         r"actor\.loss_agg_mode=seq-mean-token-mean \(its sequence-level ratio\), got token-mean"),
    Case("config-overlong-no-buffer", "algorithm.overlong_buffer.enable=true (len 0)",
         _cfg("algorithm.overlong_buffer.enable=true"), ValueError,
         r"override 'algorithm\.overlong_buffer\.enable=true': "
         r"algorithm\.overlong_buffer\.len=0 must be in \(0, data\.max_response_length=4\]"),
    Case("config-file-typo-with-override", "actor.clip_ratio_hihg in the YAML file, an override beside it",
         lambda env, tmp: train.load_config(_yaml_file(tmp, "typo.yaml", "actor: {clip_ratio_hihg: 0.3}\n"),
                                            ["actor.clip_ratio_high=0.3", "trainer.total_steps=5"]), KeyError,
         r"typo\.yaml: unknown config key 'actor\.clip_ratio_hihg'; did you mean 'actor\.clip_ratio_high'\?"),
    Case("config-missing-model-path", "YAML without actor.model_path", _config_without_model_path, ValueError,
         r"no_model\.yaml: actor\.model_path is required"),
    Case("config-missing-file", "load_config('nope.yaml')",
         lambda env, tmp: train.load_config(os.path.join(tmp, "nope.yaml")), FileNotFoundError,
         r"config file '.*nope\.yaml' does not exist"),
    Case("config-override-no-equals", "override 'trainer.total_steps'", _cfg("trainer.total_steps"), ValueError,
         r"override 'trainer\.total_steps' must look like key\.path=value"),
    Case("config-override-into-scalar", "trainer.total_steps.x=1", _cfg("trainer.total_steps.x=1"), TypeError,
         r"override 'trainer\.total_steps\.x=1': .*total_steps is not a mapping"),
    Case("config-section-not-mapping", "actor=5", _cfg("actor=5"), TypeError,
         r"override 'actor=5': actor must be a mapping, got 5"),
    Case("config-yaml-syntax", "YAML file 'data: [a, b'",
         lambda env, tmp: train.load_config(_yaml_file(tmp, "bad.yaml", "data: [a, b\n")), yaml.YAMLError,
         r'bad\.yaml", line \d+'),
    Case("config-not-a-mapping", "YAML file holding a list",
         lambda env, tmp: train.load_config(_yaml_file(tmp, "list.yaml", "- data\n- actor\n")), TypeError,
         r"list\.yaml: .*must be a mapping.*got list"),

    # --- layout: parallel.validate_layout(mcfg, tp, pp, world, name)
    Case("layout-world-not-divisible", "tp=3, pp=1 on 4 ranks",
         lambda env, tmp: validate_layout(_mcfg(env), 3, 1, 4, name="actor"), ValueError,
         r"actor: world size 4 is not divisible by tp\*pp = 3\*1; valid tp sizes for this model with pp=1: "
         r"\[1, 2, 4\]"),
    Case("layout-heads-not-divisible", "tp=8 (4 attention heads) on 8 ranks",
         lambda env, tmp: validate_layout(_mcfg(env), 8, 1, 8, name="actor"), ValueError,
         r"actor: num_attention_heads=4 is not divisible by tp=8; valid tp sizes for this model and 8 ranks: "
         r"\[1, 2, 4\]"),
    Case("layout-kv-heads-not-divisible", "tp=2 (6 heads, 3 kv heads) on 4 ranks",
         lambda env, tmp: validate_layout(replace(_mcfg(env), num_heads=6, num_kv_heads=3), 2, 1, 4,
                                          name="actor"), ValueError,
         r"actor: num_key_value_heads=3 is not divisible by tp=2, nor is tp a multiple of it \(KV heads replicated\); "
         r"valid tp sizes for this model and 4 ranks: \[1\]"),
    Case("layout-pp-exceeds-layers", "pp=4 (2 layers) on 4 ranks",
         lambda env, tmp: validate_layout(_mcfg(env), 1, 4, 4, name="actor"), ValueError,
         r"actor: pp=4 exceeds num_hidden_layers=2; valid pp sizes for tp=1 and 4 ranks: \[1, 2\]"),
    Case("layout-rollout-tp-does-not-fit", "rollout tp=4 from training tp=1, pp=2 on 4 ranks (dp=2)",
         lambda env, tmp: reshard.validate_generation_layout(_mcfg(env), 4, 1, 2, 4, "parallel.rollout"), ValueError,
         r"parallel\.rollout\.tp=4 does not fit training tp=1, pp=2 on 4 ranks: it must divide tp, or be tp times a divisor "
         r"of dp=2; valid: \[1, 2\]"),

    # --- model directory: model.ModelConfig.from_dir / model.load_model
    Case("model-missing-dir", "from_dir('nope/')",
         lambda env, tmp: ModelConfig.from_dir(os.path.join(tmp, "nope")), FileNotFoundError,
         r"model directory '.*nope' does not exist"),
    Case("model-no-config-json", "directory with a tokenizer, no config.json",
         lambda env, tmp: ModelConfig.from_dir(_model_dir(tmp, None, tokenizer_from=env.model_dir)),
         FileNotFoundError, r"model directory '.*model' has no config\.json"),
    Case("model-config-bad-json", "config.json cut mid-object",
         lambda env, tmp: ModelConfig.from_dir(_model_dir(tmp, '{"architectures": ["Qwen2ForCausalLM"],')),
         ValueError, r"model[/\\]config\.json: not valid JSON"),
    Case("model-config-not-object", "config.json holding [1]",
         lambda env, tmp: ModelConfig.from_dir(_model_dir(tmp, "[1]")), ValueError,
         r"model[/\\]config\.json: expected a JSON object, got \[1\]"),
    Case("model-config-string-value", 'config.json with num_attention_heads: "4"',
         lambda env, tmp: ModelConfig.from_dir(_model_dir(tmp, _synth_config(env, num_attention_heads="4"))),
         ValueError, r"config\.json: \{'num_attention_heads': '4'\} must be positive integers"),
    Case("model-unsupported-architecture", "architectures: [GPT2LMHeadModel], no model_type",
         lambda env, tmp: ModelConfig.from_dir(_model_dir(tmp, _synth_config(
             env, architectures=["GPT2LMHeadModel"], model_type=None))), ValueError,
         r"config\.json: architecture 'GPT2LMHeadModel' is not supported; supported: \['LlamaForCausalLM'"),
    Case("model-type-decides", "model_type: gemma with architectures [LlamaForCausalLM] (transformers builds Gemma)",
         lambda env, tmp: ModelConfig.from_dir(_model_dir(tmp, _synth_config(
             env, architectures=["LlamaForCausalLM"], model_type="gemma"))), ValueError,
         r"config\.json: model_type 'gemma' is not supported; supported: \['llama', 'mistral', 'qwen2', 'qwen3'\]"),
    Case("model-rope-per-layer-type", "rope_parameters nested by layer type (read as theta 1e4 before)",
         lambda env, tmp: ModelConfig.from_dir(_model_dir(tmp, _synth_config(env, rope_parameters={
             "full_attention": {"rope_type": "default", "rope_theta": 1e6},
             "sliding_attention": {"rope_type": "yarn"}}))),
         ValueError, r"config\.json: rope parameters per layer type \(\['full_attention', 'sliding_attention'\]\) are "
         r"not supported"),
    Case("model-unsupported-model-type", "model_type: gpt2, no architectures",
         lambda env, tmp: ModelConfig.from_dir(_model_dir(tmp, _synth_config(
             env, architectures=None, model_type="gpt2"))), ValueError,
         r"config\.json: .*'gpt2'.* not supported; supported: "),
    Case("model-config-missing-key", "config.json without hidden_size",
         lambda env, tmp: ModelConfig.from_dir(_model_dir(tmp, _synth_config(env, hidden_size=None))), ValueError,
         r"config\.json: missing required key.*'hidden_size'"),
    Case("model-unsupported-bias", "Llama config.json with attention_bias: true (o_proj bias)",
         lambda env, tmp: ModelConfig.from_dir(_model_dir(tmp, _synth_config(
             env, architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=True))), ValueError,
         r"config\.json: attention_bias=true is not supported for LlamaForCausalLM"),
    Case("model-llama3-rope-keys", "rope_scaling {rope_type: llama3, factor: 8} only",
         lambda env, tmp: ModelConfig.from_dir(_model_dir(tmp, _synth_config(
             env, rope_scaling={"rope_type": "llama3", "factor": 8.0}))), ValueError,
         r"config\.json: llama3 rope scaling lacks \['low_freq_factor', 'high_freq_factor'\] \(needs "),
    Case("model-quantized", "config.json with quantization_config (an FP8 checkpoint)",
         lambda env, tmp: ModelConfig.from_dir(_model_dir(tmp, _synth_config(
             env, quantization_config={"quant_method": "fp8"}))), ValueError,
         r"config\.json: quantized checkpoints \(fp8\) are not supported; use the bf16/fp16/fp32 weights"),
    Case("model-hidden-act", "config.json with hidden_act: gelu",
         lambda env, tmp: ModelConfig.from_dir(_model_dir(tmp, _synth_config(env, hidden_act="gelu"))), ValueError,
         r"config\.json: hidden_act='gelu' is not supported; the MLP is SwiGLU \(silu\)"),
    Case("model-rope-scaling-over-parameters", "rope_parameters default, rope_scaling linear (it wins, as in HF)",
         lambda env, tmp: ModelConfig.from_dir(_model_dir(tmp, _synth_config(
             env, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
             rope_scaling={"rope_type": "linear", "factor": 4.0}))), ValueError,
         r"config\.json: rope type 'linear' is not supported; supported: default, llama3"),
    Case("model-no-weights", "load_model(dir without *.safetensors), random_init=False",
         lambda env, tmp: load_model(env.model_dir), FileNotFoundError,
         r"model directory '.*model' has no \*\.safetensors weights"),
    Case("model-truncated-weights", "model-00001-of-00001.safetensors cut in half", _truncated_hf, ValueError,
         r"model-00001-of-00001\.safetensors: .*(truncated|corrupt)"),
    Case("model-two-copies", "model-00001-of-00001.safetensors and a copy model_ema.safetensors, no index (the copy "
         "loaded silently before)", _two_copies_no_index, ValueError, r"model: tensor '.*' is in both "
         r"model-00001-of-00001\.safetensors and model_ema\.safetensors; keep one, or add a model\.safetensors\.index"),
    Case("model-index-wrong-file", "model.safetensors.index.json maps model.norm.weight to a file without it "
         "(safetensors' error, naming no file, before)", _index_names_the_wrong_file, KeyError,
         r"model\.safetensors\.index\.json: maps 'model\.norm\.weight' to extra\.safetensors, which does not hold it"),
    Case("model-tied-head-differs", "tie_word_embeddings: true, an lm_head.weight other than the embedding",
         _tied_with_its_own_head, ValueError, r"model: config\.json has tie_word_embeddings=true, but the "
         r"checkpoint's lm_head\.weight differs from model\.embed_tokens\.weight; set it to false to load both"),
    Case("model-weight-shape-mismatch", "config.json intermediate_size=256, weights of 128",
         lambda env, tmp: load_model(_model_dir(tmp, _synth_config(env, intermediate_size=256),
                                                weights_from=env.hf)), ValueError,
         r"\.safetensors: tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \[128, 64\], "
         r"expected \[256, 64\] from config\.json"),

    # --- tokenizer: data.load_tokenizer
    Case("tokenizer-no-files", "model dir with config.json only",
         lambda env, tmp: data.load_tokenizer(_model_dir(tmp, _synth_config(env))), FileNotFoundError,
         r"'.*model' holds no tokenizer files \(expected one of \['tokenizer\.json', .*\]\); it has \['config\.json'\]"),
    Case("tokenizer-missing-dir", "load_tokenizer('nope/')",
         lambda env, tmp: data.load_tokenizer(os.path.join(tmp, "nope")), FileNotFoundError,
         r"tokenizer directory '.*nope' does not exist"),

    # --- data: data.PromptDataset
    Case("data-missing-file", "train_files=[missing.parquet]",
         lambda env, tmp: _dataset(env, tmp, [os.path.join(tmp, "missing.parquet")]), FileNotFoundError,
         r"data file '.*missing\.parquet' does not exist", _cache_leftovers),
    Case("data-not-parquet", "a text file named garbage.parquet",
         lambda env, tmp: _dataset(env, tmp, [_yaml_file(tmp, "garbage.parquet", "not parquet\n")]), ValueError,
         r"garbage\.parquet: not a readable parquet file", _cache_leftovers),
    Case("data-missing-prompt-key", "prompt_key='question' (file has 'prompt')",
         lambda env, tmp: _dataset(env, tmp, [f"{env.synth}/train.parquet"], prompt_key="question"), ValueError,
         r"train\.parquet: missing column\(s\) \['question'\]; the file has columns \[.*'prompt'", _cache_leftovers),
    Case("data-all-filtered", "max_prompt_length=2, filter_overlong=True",
         lambda env, tmp: _dataset(env, tmp, [f"{env.synth}/train.parquet"], max_prompt_length=2), ValueError,
         rf"no prompts left in .*train\.parquet.*: all {N_TRAIN} are longer than max_prompt_length=2",
         _cache_leftovers),
    Case("data-overlong-error", "max_prompt_length=2, filter_overlong=False, truncation='error'",
         lambda env, tmp: _dataset(env, tmp, [f"{env.synth}/train.parquet"], max_prompt_length=2,
                                   filter_overlong=False, truncation="error"), ValueError,
         r"train\.parquet: row 0: prompt is \d+ tokens, over max_prompt_length=2", _cache_leftovers),
    Case("data-bad-truncation", "truncation='both'",
         lambda env, tmp: _dataset(env, tmp, [f"{env.synth}/train.parquet"], truncation="both"), ValueError,
         r"truncation='both'; expected one of \('error', 'left', 'right', 'middle'\)", _cache_leftovers),
    Case("data-bad-prompt-type", "prompt column of ints",
         lambda env, tmp: _dataset(env, tmp, [_parquet(tmp, "ints.parquet", [
             {"prompt": 7, "data_source": "t", "reward_model": {"ground_truth": "1"}}])]), TypeError,
         r"ints\.parquet: row 0: column 'prompt': expected a string or a non-empty list", _cache_leftovers),
    Case("data-no-ground-truth", "reward_model without ground_truth",
         lambda env, tmp: _dataset(env, tmp, [_parquet(tmp, "nogt.parquet", [
             {"prompt": "hi", "data_source": "t", "reward_model": {"style": "rule"}}])]), ValueError,
         r"nogt\.parquet: row 0: reward_model must be a struct with a ground_truth", _cache_leftovers),
    Case("data-prompt-renders-empty", "an empty message under a bare chat template (the run stopped in generation "
         "when the sampler first drew it, naming a position in the batch, before)", _renders_empty, ValueError,
         r"blank\.parquet: row 1: the prompt renders to no tokens", _cache_leftovers),
    Case("data-cache-disk-full", "disk full while writing the prompt cache",
         _disk_full("pyarrow.ipc.new_file", lambda env, tmp: _dataset(env, tmp, [f"{env.synth}/train.parquet"])),
         OSError, r"No space left on device", _cache_leftovers),
    Case("data-empty-file", "a parquet file with no rows",
         lambda env, tmp: _dataset(env, tmp, [_empty_parquet(env, tmp)]), ValueError,
         r"the data files \[.*empty\.parquet'\] hold no rows", _cache_leftovers),
    Case("gsm8k-bad-json-line", "GSM8K train.jsonl line 2 is not JSON",
         lambda env, tmp: _gsm8k(tmp, [GSM_OK, "{not json"], [GSM_OK]), ValueError,
         r"train\.jsonl: line 2: not valid JSON", _gsm8k_leftovers),
    Case("gsm8k-missing-field", "GSM8K train.jsonl line 2 without 'question'",
         lambda env, tmp: _gsm8k(tmp, [GSM_OK, json.dumps({"answer": "#### 2"})], [GSM_OK]), ValueError,
         r"train\.jsonl: line 2: expected an object with string 'question' and 'answer'", _gsm8k_leftovers),
    Case("gsm8k-empty-answer", "GSM8K test.jsonl line 1 ends in '#### ' (a ground truth of '' that '#### .' matched)",
         lambda env, tmp: _gsm8k(tmp, [GSM_OK], [json.dumps({"question": "q?", "answer": "so\n#### "})]), ValueError,
         r"test\.jsonl: line 1: the final answer after '####' is '', not a number", _gsm8k_leftovers),
    Case("gsm8k-word-answer", "GSM8K train.jsonl line 2 answers '#### seven'",
         lambda env, tmp: _gsm8k(tmp, [GSM_OK, json.dumps({"question": "q?", "answer": "#### seven"})], [GSM_OK]),
         ValueError, r"train\.jsonl: line 2: the final answer after '####' is 'seven', not a number", _gsm8k_leftovers),
    Case("gsm8k-missing-split", "GSM8K src without test.jsonl",
         lambda env, tmp: _gsm8k(tmp, [GSM_OK], None), FileNotFoundError,
         r"test\.jsonl does not exist \(expected GSM8K's test\.jsonl in ", _gsm8k_leftovers),

    # --- reward function: rewards.load_reward_fn / rewards.score_batch
    Case("reward-missing-file", "reward.fn=nope.py:compute",
         lambda env, tmp: rewards.load_reward_fn(os.path.join(tmp, "nope.py") + ":compute"), FileNotFoundError,
         r"reward function file not found: '.*nope\.py'"),
    Case("reward-bad-spec", "reward.fn=rew.py (no ':function')",
         lambda env, tmp: rewards.load_reward_fn(_reward_file(tmp, GOOD_SCORER)), ValueError,
         r"reward function spec '.*rew\.py' must look like 'path/to/file\.py:function'"),
    Case("reward-missing-function", "reward.fn=rew.py:nope",
         lambda env, tmp: rewards.load_reward_fn(_reward_file(tmp, GOOD_SCORER) + ":nope"), ValueError,
         r"'.*rew\.py' has no function 'nope'; callables present: compute"),
    Case("reward-wrong-signature", "def score(text)",
         lambda env, tmp: rewards.load_reward_fn(_reward_file(tmp, "def score(text):\n    return 0.0\n") + ":score"),
         TypeError, r"reward function '.*rew\.py:score' must have the signature"),
    Case("reward-import-fails", "reward file importing a missing module",
         lambda env, tmp: rewards.load_reward_fn(_reward_file(
             tmp, "import nanorl_no_such_module\n" + GOOD_SCORER, "broken.py") + ":compute"), ImportError,
         r"reward function file '.*broken\.py' failed to import: .*No module named 'nanorl_no_such_module'"),
    Case("reward-not-python", "reward.fn=rew.txt:compute",
         lambda env, tmp: rewards.load_reward_fn(_reward_file(tmp, GOOD_SCORER, "rew.txt") + ":compute"), ValueError,
         r"reward function file '.*rew\.txt' \(from .*\) is not a Python source file"),
    Case("reward-returns-nan", "scorer returning NaN",
         lambda env, tmp: rewards.score_batch(lambda **kw: float("nan"), ["synthetic/copy"], ["1"], ["1"], None),
         ValueError, r"reward function returned score nan for data_source 'synthetic/copy'; expected a finite"),
    Case("reward-returns-none", "scorer returning None",
         lambda env, tmp: rewards.score_batch(lambda **kw: None, ["synthetic/copy"], ["1"], ["1"], None), TypeError,
         r"reward function returned NoneType for data_source 'synthetic/copy'; expected a number or a dict "
         r"with a numeric 'score'"),

    Case("train-unknown-data-source", "data_source 'synthetic/cpy' and no reward.fn", _misspelt_source, ValueError,
         r"cpy\.parquet: no rule-based scorer for data_source 'synthetic/cpy'; known: openai/gsm8k, .*"
         r"\(or a scorer of your own: reward\.fn=path/to/file\.py:function\)", _run_leftovers),
    Case("train-negative-seed", "data.seed=-1", lambda env, tmp: _train_main(env, tmp, "data.seed=-1"), ValueError,
         r"sampler seed \(data\.seed\) must be >= 0, got -1", _run_leftovers),

    # --- checkpoints: train resume, reshard.load_into, the reshard CLI
    Case("resume-not-checkpoint", "trainer.resume=<an HF model dir>",
         lambda env, tmp: _train_main(env, tmp, f"trainer.resume={env.model_dir}"), FileNotFoundError,
         r"trainer\.resume: '.*model' is not a checkpoint directory \(no meta\.json\)", _run_leftovers),
    Case("resume-different-model", "trainer.resume=<checkpoint with intermediate_size 256>",
         lambda env, tmp: _train_main(env, tmp, f"trainer.resume={env.ck_other}"), ValueError,
         r"checkpoint '.*ck_other' is a different model: intermediate_size=256 \(model has 128\)", _run_leftovers),
    Case("resume-never-over-checkpoints", "trainer.resume=never in an output_dir holding checkpoints",
         _fresh_over_checkpoints, ValueError,
         r"trainer\.output_dir '.*run' holds checkpoints of another run \(steps \[1\]\); resume it with "
         r"trainer\.resume=auto", _first_run_untouched),
    Case("resume-gae-from-grpo", "PPO (adv_estimator=gae) resuming a GRPO checkpoint (no critic)",
         _gae_over_grpo, ValueError, r"trainer\.resume: '.*step_1' holds no critic"),
    Case("load-into-truncated-shard", "load_into(model, ckpt with model_pp0_tp0.safetensors cut in half)",
         lambda env, tmp: reshard.load_into(load_model(env.model_dir, random_init=True), env.ck_trunc), ValueError,
         r"model_pp0_tp0\.safetensors: .*(truncated|corrupt)"),
    Case("load-into-bad-meta", "meta.json cut mid-object",
         lambda env, tmp: reshard.load_into(load_model(env.model_dir, random_init=True),
                                            _ck_with_meta(env, tmp, '{"step": 1, "tp": 1,')), ValueError,
         r"meta\.json: not valid JSON"),
    Case("export-truncated-shard", "reshard.py CKPT --to-hf OUT, shard cut in half", _export("ck_trunc"),
         ValueError, r"model_pp0_tp0\.safetensors: .*(truncated|corrupt)", _export_leftovers),
    Case("export-mixed-shards", "reshard.py CKPT --to-hf OUT, tp1 shard from another model", _export("ck_mixed"),
         ValueError, r"model_pp0_tp1\.safetensors: tensor '.*' has shape \[.*\], expected \[.*\]", _export_leftovers),
    Case("export-disk-full", "reshard.py CKPT --to-hf OUT, disk full while writing a shard",
         _disk_full("safetensors.torch.save_file", _export("ck")), OSError, r"No space left on device",
         _export_leftovers),
    Case("export-not-checkpoint", "reshard.py HF_DIR --to-hf OUT", _export("hf"), FileNotFoundError,
         r"'.*hf' is not a checkpoint directory \(no meta\.json\)", _export_leftovers),
    Case("export-out-exists", "reshard.py CKPT --to-hf EXISTING", _export_existing, FileExistsError,
         r"--to-hf '.*out' already exists; choose a new directory", _existing_untouched),
]


def test_table_is_complete():
    assert len(CASES) == int(re.search(r"table of (\d+)\s+cases", open(README).read()).group(1))  # README counts
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, env: Env, tmp_path):
    tmp = str(tmp_path)
    with pytest.raises(case.exc) as info:
        case.call(env, tmp)
    msg = str(info.value)
    assert re.search(case.match, msg), (
        f"{type(info.value).__name__}: {msg[:500]!r}\n does not match {case.match!r}")
    if case.leftovers is not None:
        left = case.leftovers(env, tmp)
        assert not left, f"the failed call left {left} on disk"


def test_score_batch_counts_scorer_errors(caplog):
    """A scorer that raises on some samples scores them 0.0 and counts them; the batch goes on."""
    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise RuntimeError("scorer bug")
        return float(solution_str == ground_truth)

    with caplog.at_level(logging.WARNING, logger="rewards"):
        scores, extras, errors = rewards.score_batch(flaky, ["synthetic/copy"] * 4, ["1", "boom", "2", "boom"],
                                                     ["1", "1", "1", "1"], None)
    assert errors == 2
    assert scores == [1.0, 0.0, 0.0, 0.0]
    assert extras == {}
    assert "sample 1 (data_source='synthetic/copy')" in caplog.text and "scorer bug" in caplog.text
