"""RL post-training of an LLM (GRPO, PPO, DAPO and relatives): the orchestration.

    torchrun --nproc_per_node=8 train.py configs/7b.yaml [key.path=value ...]
    python train.py configs/tiny.yaml                        # one process, CPU

Every rank runs this same file (SPMD). The actor, its generation engine, the frozen reference policy and (for PPO) the
critic share the same GPUs in turn: HybridFlow's colocated engine. All ranks hold the whole batch of rollouts (small
next to the model); the DP split chooses rows.

One step
--------
1. **Generate.** Reshard the actor from its training layout (tp x pp x dp) into its generation layout (tp_g, no
   pipeline, W/tp_g replicas); each replica samples `rollout.n` responses for its share of the prompts, with every
   token's log-prob; then the weights go back, the KV cache is freed.
2. **Score.** Rule-based rewards (rewards.py), DAPO's overlong shaping (the shaped score is `seq_reward`) and dynamic
   sampling: groups whose n responses all score the same carry no signal for a group-relative advantage, so they are
   dropped and more prompts drawn until the batch is full.
3. **Recompute**, in packed micro-batches in the training layout: log-probs under the actor (pi_old; they differ
   slightly from the generator's, see training/rollout_probs_diff_*; `algorithm.rollout_is.bypass_mode` uses the
   generator's instead, one forward pass less), under the reference policy (for a KL term), and the critic's values.
4. **Advantages** (algorithms.py): GAE with the critic's values (PPO), or outcome-based group baselines (GRPO, RLOO,
   REINFORCE++).
5. **Update.** `actor.ppo_epochs` passes over mini-batches of `actor.ppo_mini_batch_size` prompts, one optimizer step
   each, over micro-batches of at most `actor.max_tokens_per_micro_batch` tokens spread evenly over the DP ranks. Each
   micro-batch loss is divided by the *global* denominator of its mini-batch (tokens or sequences, over all
   micro-batches and DP ranks), so the gradient is the same however the batch was split.

Results of the last pipeline stage reach every rank as a world sum to which only the (last stage, tp rank 0) ranks
contribute, so every rank sees the same numbers."""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.util
import json
import math
import operator
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm

import algorithms as alg
from data import (TRUNCATIONS, Batch, PromptDataset, Sampler, dp_micro_batches, fsync, load_tokenizer, scatter_rows,
                  write_text)
from model import ModelConfig, load_model, read_json
from parallel import (ShardedAdamW, all_gather_objects, init_distributed, lr_at, make_layout, pipeline_forward_backward,
                      shard_name, validate_layout, vocab_parallel_logprobs, world_all_reduce, world_barrier)
from reshard import (TOKENIZER_FILES, Resharder, collect_results, dispatch_prompts, load_into, read_shard,
                     save_model_shard, validate_generation_layout)
from rewards import check_sources, load_reward_fn, score_batch, validation_metrics
from rollout import MIN_TEMPERATURE, Generator, SamplingParams, eos_token_ids

# ----------------------------------------------------------------------------- config


@dataclass
class DataConfig:
    train_files: list = field(default_factory=list)
    val_files: list = field(default_factory=list)
    train_batch_size: int = 16          # prompts per step
    val_batch_size: int = 256           # prompts per validation generate() call
    val_max_samples: int = -1           # validate on a seeded random subset of this size (<= 0: all), as verl
    max_prompt_length: int = 512
    max_response_length: int = 512
    gen_batch_size: int = 0             # prompts a generation batch under filter_groups (0: train_batch_size), as verl
    truncation: str = "error"           # error | left | right | middle
    filter_overlong_prompts: bool = True
    prompt_key: str = "prompt"
    shuffle: bool = True
    seed: int = 0
    cache_dir: str = ""


@dataclass
class OptimConfig:
    lr: float = 1e-6
    lr_warmup_steps: int = 0
    lr_schedule: str = "constant"       # constant | cosine | linear
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0


@dataclass
class ActorConfig:
    model_path: str = ""
    random_init: bool = False           # random weights from config.json (benchmarks, the tiny task)
    dtype: str = "auto"                 # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = 16       # prompts per optimizer step
    ppo_epochs: int = 1
    max_tokens_per_micro_batch: int = 16384
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    policy_loss_mode: str = "vanilla"   # vanilla | gspo | cispo
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    gradient_checkpointing: bool = False
    offload_optimizer: bool = False     # Adam state and grad buffer (the critic's too) off the GPU while generating


@dataclass
class CriticConfig:
    model_path: str = ""                # default: the actor's
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_epochs: int = -1                # -1: the actor's; 0: a frozen critic (its values still feed GAE)
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"


@dataclass
class RolloutConfig:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_rows: int = 256                 # concurrent sequences per generation replica
    kv_cache_tokens: int = 0            # 0: size from gpu_memory_fraction (CPU: rows x max length)
    gpu_memory_fraction: float = 0.5
    use_cuda_graphs: bool = True
    val_temperature: float = 0.0        # 0: greedy validation (val_top_p, val_top_k unused), as verl's val_kwargs
    val_top_p: float = 1.0
    val_top_k: int = -1
    val_n: int = 1


@dataclass
class KLCtrlConfig:
    type: str = "fixed"                 # fixed | adaptive
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    metric: str = "score"               # score, seq_reward (score + overlong penalty), or a scorer's key (acc)
    max_num_gen_batches: int = 10       # 0: no limit


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0


@dataclass
class RolloutISConfig:
    enable: bool = False
    threshold: float = 2.0
    level: str = "token"
    bypass_mode: bool = False           # pi_old = the generator's log-probs: no old_log_prob pass


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"         # gae | grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    rollout_is: RolloutISConfig = field(default_factory=RolloutISConfig)


@dataclass
class RewardConfig:
    fn: str = ""                        # path/to/file.py:function, or empty for rewards.compute_score


@dataclass
class TrainLayoutConfig:
    tp: int = 1
    pp: int = 1


@dataclass
class GenLayoutConfig:
    tp: int = 1


@dataclass
class ParallelConfig:
    train: TrainLayoutConfig = field(default_factory=TrainLayoutConfig)
    rollout: GenLayoutConfig = field(default_factory=GenLayoutConfig)


@dataclass
class TrainerConfig:
    total_steps: int = 10
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = False
    val_only: bool = False              # validate (a checkpoint: with trainer.resume) and stop, as verl
    output_dir: str = "outputs/run"
    resume: str = "auto"                # auto | never | PATH to a step_N directory
    keep_last_k: int = 2                # checkpoints kept (<= 0: all), as verl's max_actor_ckpt_to_keep
    logger: list = field(default_factory=lambda: ["console", "jsonl"])
    seed: int = 0
    device: str = "auto"                # auto | cpu | cuda
    timeout_s: int = 1800               # collective timeout: a dead rank fails the job, never hangs it
    max_nonfinite_skips: int = 3
    peak_tflops: float = 989.0          # dense bf16 peak per GPU, for perf/mfu/actor


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


SCHEDULES = ("constant", "cosine", "linear")
LOGGERS = ("console", "jsonl", "tensorboard")
AT_LEAST = {**dict.fromkeys(("data.train_batch_size", "data.val_batch_size", "data.max_prompt_length", "rollout.n",
                             "data.max_response_length", "actor.ppo_mini_batch_size", "actor.ppo_epochs",
                             "actor.max_tokens_per_micro_batch", "rollout.max_rows", "rollout.val_n",
                             "algorithm.kl_ctrl.horizon", "trainer.timeout_s"), 1), "rollout.top_k": -1,  # -1, 0: off
            "rollout.val_top_k": -1, "trainer.seed": 0, "critic.ppo_epochs": -1, "rollout.kv_cache_tokens": 0,
            "data.gen_batch_size": 0, "rollout.temperature": MIN_TEMPERATURE,
            **dict.fromkeys(("actor.optim.lr", "critic.optim.lr", "rollout.val_temperature", "actor.clip_ratio_low",
                             "actor.clip_ratio_high", "critic.cliprange_value"), 0)}
ABOVE = {"rollout.top_p": 0, "rollout.val_top_p": 0, "rollout.gpu_memory_fraction": 0,
         "actor.clip_ratio_c": 1, "algorithm.kl_ctrl.target_kl": 0, "algorithm.rollout_is.threshold": 0,
         "trainer.peak_tflops": 0}
AT_MOST = {"rollout.top_p": 1, "rollout.val_top_p": 1, "rollout.gpu_memory_fraction": 1}
CHOICES = {"data.truncation": TRUNCATIONS, "actor.dtype": ("auto", "bf16", "fp32"),
           "actor.loss_agg_mode": alg.LOSS_AGG_MODES, "critic.loss_agg_mode": alg.LOSS_AGG_MODES,
           "actor.policy_loss_mode": alg.POLICY_LOSS_MODES, "actor.kl_loss_type": alg.KL_PENALTIES,
           "algorithm.kl_penalty": alg.KL_PENALTIES, "algorithm.adv_estimator": alg.ADV_ESTIMATORS,
           "algorithm.kl_ctrl.type": ("fixed", "adaptive"), "algorithm.rollout_is.level": ("token", "sequence"),
           "actor.optim.lr_schedule": SCHEDULES, "critic.optim.lr_schedule": SCHEDULES,
           "trainer.device": ("auto", "cpu", "cuda")}


def _key_paths(c, prefix: str = "") -> list[str]:  # every dotted key and section of a config dataclass
    subs = {prefix + f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
    return [*subs, *(p for k, v in subs.items() if dataclasses.is_dataclass(v) for p in _key_paths(v, k + "."))]


def _build(base, d: dict, prefix: str, source):
    """dict -> a copy of the dataclass instance `base` with those values (a nested section starts from its parent's
    default, e.g. the critic's lr), naming the nearest valid key for an unknown one and checking types; source(key)
    names where a key's value came from (the YAML file or an override)."""
    fields, kwargs = [f.name for f in dataclasses.fields(base)], {}
    for key, val in d.items():
        path = prefix + key
        if key not in fields:  # a near name here, or the key (or section) in another section: actor.temperature
            near = [prefix + k for k in difflib.get_close_matches(key, fields, n=1)] + [
                p for p in _key_paths(Config()) if p.endswith("." + key)]
            hint = f"; did you mean {' or '.join(map(repr, near))}?" if near else f"; valid keys here: {sorted(fields)}"
            raise KeyError(f"{source(path)}: unknown config key {path!r}{hint}")
        default = getattr(base, key)
        if dataclasses.is_dataclass(default):
            if not isinstance(val := {} if val is None else val, dict):  # (None: a YAML section left empty)
                raise TypeError(f"{source(path)}: {path} must be a mapping, got {val!r}")
            kwargs[key] = _build(default, val, path + ".", source)
            continue
        if isinstance(default, float) and isinstance(val, (int, str)) and not isinstance(val, bool):
            with contextlib.suppress(ValueError):  # YAML reads 1e-6 (no dot) as a string
                val = float(val)
        val = [val] if isinstance(default, list) and isinstance(val, str) else val
        if not isinstance(val, type(default)) or isinstance(val, bool) != isinstance(default, bool):
            want = "true or false" if isinstance(default, bool) else type(default).__name__
            raise TypeError(f"{source(path)}: {path} must be {want}, got {val!r}")
        if path in CHOICES and val not in CHOICES[path]:
            raise ValueError(f"{source(path)}: {path}={val!r} is not one of {list(CHOICES[path])}")
        for table, ok, word in ((AT_LEAST, operator.ge, ">="), (ABOVE, operator.gt, ">"), (AT_MOST, operator.le, "<=")):
            if path in table and not ok(val, table[path]):  # (the defaults are in bounds)
                raise ValueError(f"{source(path)}: {path}={val} must be {word} {table[path]}")
        if path.endswith(".betas") and not (len(val) == 2 and all(type(b) in (int, float) and 0 <= b < 1 for b in val)):
            raise ValueError(f"{source(path)}: {path}={val} must be two numbers in [0, 1) (beta1, beta2)")
        kwargs[key] = val
    return dataclasses.replace(base, **kwargs)


def load_config(path: str, overrides: list[str] = ()) -> Config:
    """YAML file + `a.b=value` overrides (values parsed as YAML) -> Config."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist")
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise TypeError(f"{path}: a config must be a mapping of sections (data, actor, ...), got {type(raw).__name__}")
    for ov in overrides:
        if "=" not in ov:
            raise ValueError(f"override {ov!r} must look like key.path=value")
        key, val = ov.split("=", 1)
        node, (*parents, last) = raw, key.split(".")
        for p in parents:
            node[p] = {} if node.get(p) is None else node[p]  # (None: a section left empty)
            if not isinstance(node := node[p], dict):
                raise TypeError(f"override {ov!r}: {p} is not a mapping, got {node!r}")
        new = yaml.safe_load(val)  # a mapping merges into the section, as Hydra's overrides do
        node[last] = {**node[last], **new} if isinstance(new, dict) and isinstance(node.get(last), dict) else new

    def src(*keys: str) -> str:  # an error names the (last) override that set one of these keys, else the file
        hits = [ov for ov in overrides for key in keys  # ov sets `key`, a key under it, or a section holding it
                if (key + ".").startswith(k := ov.split("=")[0] + ".") or k.startswith(key + ".")]
        return f"override {hits[-1]!r}" if hits else path
    cfg = _build(Config(), raw, "", src)
    d, a = cfg.data, cfg.actor  # checks across keys
    for key, val in (("actor.model_path", a.model_path), ("data.train_files", d.train_files)):
        if not val:
            raise ValueError(f"{src(key)}: {key} is required")
    if bad := sorted(set(cfg.trainer.logger) - set(LOGGERS)):
        raise ValueError(f"{src('trainer.logger')}: trainer.logger has unknown sink(s) {bad}; valid: {list(LOGGERS)}")
    if "tensorboard" in cfg.trainer.logger and not importlib.util.find_spec("tensorboard"):  # not a dependency
        raise ModuleNotFoundError(f"{src('trainer.logger')}: trainer.logger names tensorboard: pip install tensorboard")
    if (ob := cfg.algorithm.overlong_buffer).enable and not 0 < ob.len <= d.max_response_length:
        raise ValueError(f"{src('algorithm.overlong_buffer', 'data.max_response_length')}: algorithm.overlong_buffer"
                         f".len={ob.len} must be in (0, data.max_response_length={d.max_response_length}]")
    for key in ("rollout.kv_cache_tokens", "actor.max_tokens_per_micro_batch"):  # (kv_cache_tokens 0: from memory)
        if 0 < (v := operator.attrgetter(key)(cfg)) < (L := d.max_prompt_length + d.max_response_length):
            raise ValueError(f"{src(key, 'data.max_prompt_length', 'data.max_response_length')}: {key}={v} < "
                             f"data.max_prompt_length + max_response_length = {L}: it cannot hold one sequence")
    if d.train_batch_size % a.ppo_mini_batch_size:
        raise ValueError(f"{src('data.train_batch_size', 'actor.ppo_mini_batch_size')}: data.train_batch_size="
                         f"{d.train_batch_size} is not a multiple of actor.ppo_mini_batch_size={a.ppo_mini_batch_size}")
    if d.gen_batch_size not in (0, d.train_batch_size) and not cfg.algorithm.filter_groups.enable:
        raise ValueError(f"{src('data.gen_batch_size')}: data.gen_batch_size={d.gen_batch_size} differs from data."
                         "train_batch_size, which only DAPO's dynamic sampling allows (algorithm.filter_groups.enable)")
    if cfg.trainer.val_only and not d.val_files:
        raise ValueError(f"{src('trainer.val_only')}: trainer.val_only needs data.val_files to validate on")
    if (est := cfg.algorithm.adv_estimator) in ("grpo", "rloo", "reinforce_plus_plus_baseline") and cfg.rollout.n < 2:
        raise ValueError(f"{src('algorithm.adv_estimator', 'rollout.n')}: algorithm.adv_estimator={est} compares "
                         f"the rollout.n responses of a prompt; rollout.n={cfg.rollout.n} must be >= 2")
    if (ris := cfg.algorithm.rollout_is).bypass_mode and ris.enable:  # pi_old = pi_rollout: the weights would be 1
        raise ValueError(f"{src('algorithm.rollout_is')}: algorithm.rollout_is.enable and bypass_mode are exclusive")
    if a.policy_loss_mode == "gspo" and a.loss_agg_mode != "seq-mean-token-mean":  # (verl imposes it)
        raise ValueError(f"{src('actor.policy_loss_mode', 'actor.loss_agg_mode')}: actor.policy_loss_mode=gspo needs "
                         f"actor.loss_agg_mode=seq-mean-token-mean (its sequence-level ratio), got {a.loss_agg_mode}")
    return cfg


# ----------------------------------------------------------------------------- start-up


@dataclass
class Role:  # a model in the training layout and its sharded optimizer (None for the frozen reference)
    model: torch.nn.Module
    optim: ShardedAdamW | None


def sum_dicts(dicts: list[dict]) -> dict[str, float]:  # keys in first-seen order
    return {k: sum(float(d[k]) for d in dicts if k in d) for k in dict.fromkeys(k for d in dicts for k in d)}


@contextlib.contextmanager
def timed(metrics: dict, name: str):
    """metrics['timing_s/<name>'] += the block's seconds; on GPU its peak in 'perf/max_memory_allocated_gb/<name>'."""
    cuda, key = torch.cuda.is_initialized(), "perf/max_memory_allocated_gb"
    if cuda:
        metrics[key] = max(metrics.get(key, 0.0), torch.cuda.max_memory_allocated() / 2 ** 30)
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    yield
    metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + time.perf_counter() - t0
    if cuda:
        metrics[f"{key}/{name}"] = max(metrics.get(f"{key}/{name}", 0.0), torch.cuda.max_memory_allocated() / 2 ** 30)


# ----------------------------------------------------------------------------- losses


def actor_loss_fn(cfg: Config, layout, batch: Batch):
    a, R, T = cfg.actor, batch.response_mask.shape[1], batch.tensors

    def fn(m, hidden, mb, denom):
        rows, dev = mb["row_ids"], hidden.device
        logp, ent = (scatter_rows(mb, x, R) for x in vocab_parallel_logprobs(
            m.logits(hidden[mb["sel"]]), mb["targets"], layout.tp_group, cfg.rollout.temperature, with_entropy=True))
        mask = batch.response_mask[rows].to(dev)
        is_w = T["rollout_is_weights"][rows].to(dev) if "rollout_is_weights" in T else None
        pg_loss, pm = alg.compute_policy_loss(
            T["old_log_probs"][rows].to(dev), logp, T["advantages"][rows].to(dev), mask, denom["agg"],
            loss_agg_mode=a.loss_agg_mode, clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
            clip_ratio_c=a.clip_ratio_c, policy_loss_mode=a.policy_loss_mode, horizon=R, rollout_is_weights=is_w,
            global_tokens=denom["tokens"])
        loss = pg_loss - a.entropy_coeff * alg.agg_loss(ent, mask, a.loss_agg_mode, denom["agg"], horizon=R) \
            if a.entropy_coeff else pg_loss
        out = {"actor/pg_loss": pg_loss.detach(), **{f"actor/{k}": v.detach() for k, v in pm.items()}}
        if a.use_kl_loss:
            kl = alg.kl_penalty(logp, T["ref_log_probs"][rows].to(dev), a.kl_loss_type)
            kl_loss = alg.agg_loss(kl, mask, a.loss_agg_mode, denom["agg"], horizon=R)
            loss = loss + a.kl_loss_coef * kl_loss
            out["actor/kl_loss"] = kl_loss.detach()
        return loss, out
    return fn


def critic_loss_fn(cfg: Config, batch: Batch):
    c, R, T = cfg.critic, batch.response_mask.shape[1], batch.tensors

    def fn(m, hidden, mb, denom):
        rows, dev = mb["row_ids"], hidden.device
        vpred = scatter_rows(mb, m.values(hidden[mb["sel"]]), R)
        mask = batch.response_mask[rows].to(dev)
        loss, clipfrac = alg.compute_value_loss(vpred, T["values"][rows].to(dev), T["returns"][rows].to(dev), mask,
                                                denom["agg"], cliprange_value=c.cliprange_value,
                                                loss_agg_mode=c.loss_agg_mode, horizon=R, global_tokens=denom["tokens"])
        return loss, {"critic/vf_loss": loss.detach(), "critic/vf_clipfrac": clipfrac.detach()}
    return fn


# ----------------------------------------------------------------------------- the trainer


class Trainer:
    """Holds the roles, data, sampler and counters of one run (the state a checkpoint saves)."""

    def __init__(self, cfg: Config):
        self.cfg, self.out = cfg, cfg.trainer.output_dir
        self.device, self.rank, self.world = init_distributed(cfg.trainer.device, cfg.trainer.timeout_s)
        for seed in (random.seed, np.random.seed, torch.manual_seed):
            seed(cfg.trainer.seed)
        a, p, d = cfg.actor, cfg.parallel, cfg.data
        self.mcfg = ModelConfig.from_dir(a.model_path)
        validate_layout(self.mcfg, p.train.tp, p.train.pp, self.world, name=a.model_path)
        validate_generation_layout(self.mcfg, self.world, p.train.tp, p.train.pp, p.rollout.tp, "parallel.rollout")
        self.layout = lay = make_layout(p.train.tp, p.train.pp)
        if d.train_batch_size % lay.dp:
            raise ValueError(f"data.train_batch_size={d.train_batch_size} is not divisible by dp={lay.dp}")
        self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(
            a.dtype, torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.tokenizer = load_tokenizer(a.model_path)
        self.eos_ids = eos_token_ids(a.model_path, self.tokenizer)
        self.reward_fn = load_reward_fn(cfg.reward.fn or None)
        ds = (self.tokenizer, d.max_prompt_length, d.truncation, d.filter_overlong_prompts, d.prompt_key, d.cache_dir)
        self.train_data = PromptDataset(d.train_files, *ds)
        self.val_data = PromptDataset(d.val_files, *ds) if d.val_files else None
        for data in filter(None, (self.train_data, self.val_data) if not cfg.reward.fn else ()):
            check_sources(data.distinct("data_source"), f"{', '.join(data.files)}: ")
        self.actor = self._role(a.model_path, a.optim)
        self.ref = self._role(a.model_path, None) if a.use_kl_loss or cfg.algorithm.use_kl_in_reward else None
        self.critic = (self._role(cfg.critic.model_path or a.model_path, cfg.critic.optim, value_head=True)
                       if cfg.algorithm.adv_estimator == "gae" else None)
        self.kl_ctrl = (alg.FixedKLController(kc.kl_coef) if (kc := cfg.algorithm.kl_ctrl).type == "fixed"
                        else alg.AdaptiveKLController(kc.kl_coef, kc.target_kl, kc.horizon))
        self.sampler = Sampler(len(self.train_data), d.gen_batch_size or d.train_batch_size, d.seed, d.shuffle)
        offload = [r.optim for r in (self.actor, self.critic) if r is not None] if a.offload_optimizer else []
        self.resharder = Resharder(self.actor.model, lay, p.rollout.tp, offload, seed=cfg.trainer.seed)
        self.step, self.nonfinite_skips, self.saved_row = 0, 0, None

    def _role(self, path: str, o: OptimConfig | None, value_head: bool = False) -> Role:
        m = load_model(path, self.layout, self.dtype, self.device, random_init=self.cfg.actor.random_init,
                       seed=self.cfg.trainer.seed, value_head=value_head, lm_head=not value_head)
        if o is None:
            return Role(m.requires_grad_(False), None)
        m.gradient_checkpointing = self.cfg.actor.gradient_checkpointing
        return Role(m, ShardedAdamW(m, self.layout, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay))

    # --- generation
    def generate(self, items: list[dict], seed: int, val: bool = False) -> Batch:
        ro, R = self.cfg.rollout, self.cfg.data.max_response_length
        n, t, p, k = (getattr(ro, ("val_" if val else "") + key) for key in ("n", "temperature", "top_p", "top_k"))
        with self.resharder.generation() as gen_model:
            mine, offset = dispatch_prompts([it["prompt_ids"] for it in items], self.resharder.gen_layout)
            gen = Generator(gen_model, max_rows=ro.max_rows, max_len=self.cfg.data.max_prompt_length + R,
                            kv_cache_tokens=ro.kv_cache_tokens or None, gpu_memory_fraction=ro.gpu_memory_fraction,
                            use_cuda_graphs=ro.use_cuda_graphs)
            try:  # a seed per prompt from its index in the whole batch: the samples do not depend on the replicas
                done = gen.generate(mine, SamplingParams(n=n, temperature=t, top_p=p, top_k=k, max_new_tokens=R),
                                    self.eos_ids, seeds=[seed * 1_000_003 + offset + i for i in range(len(mine))])
            finally:
                gen.free()
            return Batch.from_completions(items, collect_results(done, offset, self.resharder.gen_layout), R)

    def score(self, batch: Batch) -> tuple[torch.Tensor, dict, int, list[str], list]:
        """(scores, numeric extras, errors, decoded responses, "pred"s); rank r scores r, r + W, ..., gathered."""
        texts = self.tokenizer.batch_decode(batch.responses, skip_special_tokens=True)
        cols = (batch.data_source, texts, batch.ground_truth, batch.extra_info)
        scores, extras, errors = score_batch(self.reward_fn, *(col[self.rank::self.world] for col in cols))
        parts = all_gather_objects(({"score": scores, **extras}, errors))
        full, preds = {}, [None] * len(batch)  # one tensor per key over the whole batch; NaN where a sample lacked it
        for r, (vals, _) in enumerate(parts):
            preds[r::self.world] = vals.pop("pred", [None] * len(vals["score"]))
            for k, v in vals.items():
                full.setdefault(k, torch.full((len(batch),), float("nan")))[r::self.world] = torch.tensor(
                    [float("nan") if x is None else x for x in v], dtype=torch.float32)
        if (errors := sum(p[1] for p in parts)) == len(batch) > 0:  # a bug in the scorer (a NameError), not bad data
            raise RuntimeError(f"the reward function raised on all {errors} samples of the batch (warnings above)")
        return full.pop("score"), full, errors, texts, preds

    def rollout_batch(self) -> tuple[Batch, dict]:
        """Generate, score and (DAPO) filter until the batch holds train_batch_size prompt groups."""
        cfg, kept, num_prompts, metrics = self.cfg, [], 0, {}  # kept: what each generation batch kept
        fg, ob, n = cfg.algorithm.filter_groups, cfg.algorithm.overlong_buffer, cfg.rollout.n
        while num_prompts < cfg.data.train_batch_size:
            if fg.enable and 0 < fg.max_num_gen_batches <= len(kept):
                raise RuntimeError(f"algorithm.filter_groups: {num_prompts} of {cfg.data.train_batch_size} prompts had "
                                   f"varied {fg.metric!r} in {len(kept)} batches (.max_num_gen_batches, 0: no limit); "
                                   "the others scored alike: too easy or too hard for the policy, or a constant reward")
            items = self.train_data.get_batch(self.sampler.next_indices())
            with timed(metrics, "gen"):
                batch = self.generate(items, seed=cfg.trainer.seed + 7919 * self.step + len(kept))
            metrics["timing_s/reshard"] = metrics.get("timing_s/reshard", 0.0) + self.resharder.last_timing
            scores, extras, errors, *_ = self.score(batch)
            metrics["reward/num_errors"] = metrics.get("reward/num_errors", 0.0) + float(errors)
            shaped = scores + alg.compute_overlong_penalty(batch.response_mask.sum(-1), cfg.data.max_response_length,
                                                           ob.len, ob.penalty_factor) if ob.enable else scores
            batch.tensors.update(score=scores, seq_reward=shaped, **{"extra/" + k: v for k, v in extras.items()})
            if not fg.enable:
                return batch, metrics
            batch.index = batch.index + self.sampler.num_items * len(kept)  # a prompt drawn again is a new group
            metric = {"score": scores, "seq_reward": shaped}.get(fg.metric, batch.tensors.get("extra/" + fg.metric))
            if metric is None:
                raise KeyError(f"algorithm.filter_groups.metric={fg.metric!r} is not returned by the reward function "
                               f"(it returns: score, {', '.join(extras) or 'nothing else'}; or use seq_reward)")
            if metric.isnan().any():
                raise ValueError(f"algorithm.filter_groups.metric={fg.metric!r}: the reward function returned it for "
                                 f"only some samples ({int(metric.isnan().sum())} of {len(metric)} lack it)")
            keep = alg.filter_groups(metric, batch.index).nonzero().flatten().tolist()
            kept.append(batch.select(keep))
            num_prompts += len(keep) // n
        metrics["train/num_gen_batches"] = float(len(kept))
        return Batch.concat(kept).select(list(range(cfg.data.train_batch_size * n))), metrics

    # --- forward passes and updates in the training layout
    def forward_only(self, role: Role, batch: Batch, values: bool = False) -> torch.Tensor:
        """[K, B, R] on every rank, no grad: the responses' log-probs and entropies (K = 2), or values (K = 1)."""
        lay, R = self.layout, batch.response_mask.shape[1]

        def fn(m, hidden, mb):
            h = hidden[mb["sel"]]
            out = (m.values(h),) if values else vocab_parallel_logprobs(
                m.logits(h), mb["targets"], lay.tp_group, self.cfg.rollout.temperature, with_entropy=True)
            return hidden.new_zeros(()), {"out": torch.stack(out)}
        mbs = dp_micro_batches(batch.prompts, batch.responses, list(range(len(batch))),
                               self.cfg.actor.max_tokens_per_micro_batch, lay.dp, lay.dp_rank, self.device)
        if role.optim is not None:  # its offloaded Adam state comes back under these passes (inputs copied first)
            role.optim.prefetch()
        outs = pipeline_forward_backward(role.model, lay, mbs, fn, forward_only=True)  # (without grad)
        full = torch.zeros(1 if values else 2, len(batch), R, device=self.device)
        for mb, o in zip(mbs, outs) if lay.is_last_stage and lay.tp_rank == 0 else []:
            full[:, mb["rows"]] = torch.stack([scatter_rows(mb, x, R) for x in o["out"].float()])
        return world_all_reduce(full).cpu()  # the other ranks add their zeros

    def update(self, name: str, batch: Batch, loss_fn) -> dict[str, float]:
        """`<name>.ppo_epochs` x mini-batches of optimizer steps of the actor or critic; loss_fn(model, hidden, mb,
        denom) -> (loss, metrics). Returns the loss metrics averaged over the steps, `<name>/grad_norm`, `<name>/lr`."""
        cfg, lay, role, rc = self.cfg, self.layout, getattr(self, name), getattr(self.cfg, name)
        mini, per_step, skipped, o = cfg.actor.ppo_mini_batch_size * cfg.rollout.n, [], 0, rc.optim  # mini: rows
        lr = lr_at(self.step, cfg.trainer.total_steps, o.lr, o.lr_warmup_steps, o.lr_schedule, o.min_lr_ratio)
        for _ in range(rc.ppo_epochs if rc.ppo_epochs >= 0 else cfg.actor.ppo_epochs):  # -1: the actor's
            for start in range(0, len(batch), mini):
                rows = list(range(start, min(start + mini, len(batch))))
                mask = batch.response_mask[rows]
                denom = {"agg": alg.loss_denominator(mask, rc.loss_agg_mode), "tokens": float(mask.sum())}
                mbs = dp_micro_batches(batch.prompts, batch.responses, rows, cfg.actor.max_tokens_per_micro_batch,
                                       lay.dp, lay.dp_rank, self.device)
                role.optim.zero_grad()
                role.optim.expect_backwards(sum(mb["input_ids"].numel() > 0 for mb in mbs))  # empty ones skip the model
                outs = pipeline_forward_backward(role.model, lay, mbs, lambda m, h, mb: loss_fn(m, h, mb, denom))
                role.optim.reduce_gradients()
                gnorm = role.optim.clip_grad_norm(o.grad_clip)
                if not math.isfinite(gnorm):  # every rank sees the same all-reduced norm: all skip together
                    self.nonfinite_skips += 1
                    if self.nonfinite_skips > cfg.trainer.max_nonfinite_skips:
                        raise FloatingPointError(f"non-finite {name} grad norm {gnorm} at step {self.step + 1}, "
                                                 f"over trainer.max_nonfinite_skips={cfg.trainer.max_nonfinite_skips}")
                    print(f"[nanorl] step {self.step + 1}: non-finite {name} grad norm; step skipped", file=sys.stderr)
                    role.optim.zero_grad()
                    skipped += 1
                    continue
                role.optim.step(lr)
                # summed over micro-batches, then the world (as objects: other ranks do not know the metric names)
                mine = sum_dicts(outs if lay.is_last_stage and lay.tp_rank == 0 else [])
                per_step.append({**sum_dicts(all_gather_objects(mine)), f"{name}/grad_norm": gnorm})
        return {**{k: v / len(per_step) for k, v in sum_dicts(per_step).items()}, f"{name}/lr": lr,
                **({f"{name}/nonfinite_skipped": float(skipped)} if skipped else {})}

    # --- one step
    def train_step(self) -> dict:
        cfg, al, t_start = self.cfg, self.cfg.algorithm, time.perf_counter()
        batch, metrics = self.rollout_batch()
        T, mask = batch.tensors, batch.response_mask
        resp_len, scores = mask.sum(-1), T["seq_reward"]
        rewards = torch.zeros_like(mask)  # the outcome reward sits on the last response token
        rewards[torch.arange(len(batch)), (resp_len.long() - 1).clamp(min=0)] = scores * (resp_len > 0)
        if al.rollout_is.bypass_mode:  # pi_old is the generator's: no forward pass, and no mismatch to measure
            T["old_log_probs"] = batch.rollout_log_probs
        else:
            with timed(metrics, "old_log_prob"):
                T["old_log_probs"], ent = self.forward_only(self.actor, batch)
            metrics.update(alg.rollout_mismatch_metrics(T["old_log_probs"], batch.rollout_log_probs, mask))
            mode, R = cfg.actor.loss_agg_mode, mask.shape[1]  # verl's actor/entropy: pi_old's, aggregated as the loss
            metrics["actor/entropy"] = float(alg.agg_loss(ent, mask, mode, alg.loss_denominator(mask, mode), R))
        if al.rollout_is.enable:
            T["rollout_is_weights"] = alg.compute_rollout_is_weights(T["old_log_probs"], batch.rollout_log_probs,
                                                                     mask, al.rollout_is.threshold, al.rollout_is.level)
        if self.ref is not None:
            with timed(metrics, "ref"):
                T["ref_log_probs"] = self.forward_only(self.ref, batch)[0]
        if self.critic is not None:
            with timed(metrics, "values"):
                T["values"] = self.forward_only(self.critic, batch, values=True)[0]
        if al.use_kl_in_reward:
            rewards, km = alg.apply_kl_penalty(rewards, T["old_log_probs"], T["ref_log_probs"], mask, self.kl_ctrl,
                                               al.kl_penalty)
            metrics.update(km)
        T["advantages"], T["returns"] = alg.compute_advantage(
            al.adv_estimator, rewards, mask, index=batch.index, values=T.get("values"), gamma=al.gamma, lam=al.lam,
            norm_adv_by_std_in_grpo=al.norm_adv_by_std_in_grpo)
        if self.critic is not None:
            with timed(metrics, "update_critic"):
                metrics.update(self.update("critic", batch, critic_loss_fn(cfg, batch)))
        with timed(metrics, "update_actor"):
            metrics.update(self.update("actor", batch, actor_loss_fn(cfg, self.layout, batch)))
        metrics["timing_s/step"] = time.perf_counter() - t_start
        return {**metrics, **self.batch_metrics(batch, scores, rewards, metrics)}

    def batch_metrics(self, batch: Batch, scores, rewards, timing: dict) -> dict:
        cfg, c, T, valid = self.cfg, self.mcfg, batch.tensors, batch.response_mask.bool()
        resp_len, plen = batch.response_mask.sum(-1), torch.tensor([len(p) for p in batch.prompts], dtype=torch.float32)
        tokens = float(resp_len.sum() + plen.sum())
        adv, ret = (T["advantages"][valid], T["returns"][valid]) if valid.any() else (torch.zeros(1), torch.zeros(1))
        values = T["values"][valid] if "values" in T and valid.any() else None  # PPO's critic
        m = {f"{k}/{stat}": float(getattr(x.float(), stat)()) for stat in ("mean", "max", "min") for k, x in (
            ("critic/score", scores), ("critic/rewards", rewards.sum(-1)), ("critic/advantages", adv),
            ("critic/returns", ret), ("response_length", resp_len), ("prompt_length", plen),
            *([("critic/values", values)] if values is not None else []))}
        m.update({"response_length/clip_ratio": (resp_len >= cfg.data.max_response_length).float().mean().item(),
                  "prompt_length/clip_ratio": (plen >= cfg.data.max_prompt_length).float().mean().item(),
                  "perf/total_num_tokens": tokens, "perf/throughput": tokens / timing["timing_s/step"] / self.world})
        if values is not None:  # verl's: the share of the returns' variance that the values explain
            m["critic/vf_explained_var"] = float(1 - (ret - values).var() / (ret.var() + 1e-5))
        # a GPU's actor update FLOPs per epoch: a forward and a backward (twice the forward) of every sequence
        flops = 3 * c.forward_flops((resp_len + plen).tolist(), float(resp_len.sum()))
        m["perf/mfu/actor"] = flops * cfg.actor.ppo_epochs / self.world / max(timing["timing_s/update_actor"], 1e-9) \
            / (cfg.trainer.peak_tflops * 1e12)
        if self.device.type == "cuda":
            m["perf/max_memory_allocated_gb"] = max(timing.get("perf/max_memory_allocated_gb", 0.0),
                                                    torch.cuda.max_memory_allocated(self.device) / 2 ** 30)
            torch.cuda.reset_peak_memory_stats(self.device)
        return m

    # --- validation
    def validate(self) -> dict:
        cfg, vd, cap = self.cfg, self.val_data, self.cfg.data.val_max_samples  # (a subset: every file has its share)
        idx = np.sort(np.random.default_rng(cfg.data.seed).permutation(len(vd))[:cap] if cap > 0 else range(len(vd)))
        sources, uids, values, preds, records = [], [], [], [], []  # per sample; the first 64 samples, written out
        for start in range(0, len(idx), cfg.data.val_batch_size):
            items = vd.get_batch(idx[start:start + cfg.data.val_batch_size].tolist())
            batch = self.generate(items, seed=cfg.trainer.seed + start, val=True)  # a seed per batch, each validation
            scores, ext, _, texts, batch_preds = self.score(batch)
            sources += batch.data_source
            uids += batch.index.tolist()
            preds += batch_preds
            values += [{"reward": float(x), **{k: float(v[i]) for k, v in ext.items()}} for i, x in enumerate(scores)]
            records += [{"prompt": self.tokenizer.decode(batch.prompts[i]), "response": texts[i],
                         "ground_truth": batch.ground_truth[i], "score": float(scores[i])}
                        for i in range(min(len(batch), 64 - len(records)))]
        if self.rank == 0:
            write_text(os.path.join(self.out, "val_generations", f"step_{self.step}.jsonl"),
                       "".join(json.dumps(r) + "\n" for r in records))
        return validation_metrics(sources, uids, values, preds)

    # --- checkpoints
    def save_checkpoint(self, metrics: dict | None = None) -> None:
        """Every rank writes its shards into saving.tmp; rank 0 makes them durable, renames the directory to
        step_N and only then writes `latest`, so a crash at any point leaves `latest` naming a complete one."""
        root, lay = os.path.join(self.out, "checkpoints"), self.layout
        final, tmp = os.path.join(root, f"step_{self.step}"), os.path.join(root, "saving.tmp")
        if self.rank == 0:  # (one name: a crashed save's leftovers go whatever its step was)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "critic") if self.critic is not None else tmp)
        world_barrier()
        # weights, Adam state: shards whole over DP (any layout reads them), held by every DP rank, written round-robin
        files = [(role, d, name) for role, d in self._role_dirs(tmp) for name in ("model", *ShardedAdamW.STATES)]
        for i, (role, d, name) in enumerate(files):
            tensors = None if name == "model" else role.optim.full_state(name)
            save_model_shard(role.model, lay, d, tensors, prefix=name, writer=i % lay.dp)
            role.optim.zero_grad()  # full_state staged its tensors in the grad buffer
        state = {"step": self.step, "optim_steps": [r.optim.step_count for r, _ in self._role_dirs(tmp)],
                 "sampler": self.sampler.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                 "nonfinite_skips": self.nonfinite_skips, "metrics": metrics and {"step": self.step, **metrics},
                 "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                         **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})}}
        torch.save(state, os.path.join(tmp, f"state_{shard_name(lay, with_dp=True)}.pt"))
        world_barrier()
        if self.rank == 0:
            for role, d in self._role_dirs(tmp):
                meta = {"step": self.step, "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "model_config": role.model.cfg.raw}
                write_text(os.path.join(d, "meta.json"), json.dumps(meta, indent=1))
            for f in filter(lambda f: f.startswith(TOKENIZER_FILES), os.listdir(src := self.cfg.actor.model_path)):
                shutil.copy(os.path.join(src, f), tmp)
            for d, _, files in os.walk(tmp, topdown=False):
                for f in [*(os.path.join(d, f) for f in files), d]:
                    fsync(f)  # every rank's shards reach the disk before the rename publishes them
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            write_text(os.path.join(root, "latest"), str(self.step))
            keep, done = self.cfg.trainer.keep_last_k, [s for s in _saved_steps(root) if s <= self.step]
            for s in done[:-keep] if keep > 0 else []:  # (a later one: a crashed run's, unpublished, to be redone)
                shutil.rmtree(os.path.join(root, f"step_{s}"), ignore_errors=True)
        world_barrier()

    def _role_dirs(self, root: str) -> list:
        return [(self.actor, root)] + ([(self.critic, os.path.join(root, "critic"))] if self.critic is not None else [])

    def maybe_resume(self) -> None:
        """trainer.resume: never | auto (checkpoints/latest, if any) | PATH of a step_N directory. A run only ever
        writes checkpoints past those in its output_dir, so `latest` and keep_last_k never lose the newest one."""
        r, root, lay = self.cfg.trainer.resume, os.path.join(self.out, "checkpoints"), self.layout
        latest, saved = os.path.join(root, "latest"), _saved_steps(root)
        if r == "never" or (r == "auto" and not os.path.isfile(latest) and not saved):
            if saved:
                raise ValueError(f"trainer.output_dir {self.out!r} holds checkpoints of another run (steps {saved}); "
                                 f"resume it with trainer.resume=auto, or use a new output_dir")
            return
        path = r  # auto: `latest` holds N; without it (lost, or a first save cut off before it) the newest step_N
        if r == "auto":
            path = os.path.join(root, f"step_{read_json(latest, int) if os.path.isfile(latest) else saved[-1]}")
        if not os.path.isfile(os.path.join(path, "meta.json")):
            raise FileNotFoundError(f"trainer.resume: {path!r} is not a checkpoint directory (no meta.json); "
                                    "expected auto, never or the path of a checkpoints/step_N directory")
        meta = read_json(os.path.join(path, "meta.json"))
        own = not saved or os.path.samefile(os.path.dirname(os.path.abspath(path)), root)
        if r != "auto" and (bad := [s for s in saved if s > meta["step"] or not own]):  # (auto: a later one is redone)
            raise ValueError(f"trainer.resume: {path!r} is step {meta['step']}, but {root!r} already holds steps {bad} "
                             f"{'past it' if own else 'of another run'}; resume into a new output_dir")
        for role, d in self._role_dirs(path):
            if not os.path.isfile(os.path.join(d, "meta.json")):  # only a critic's can be missing
                raise ValueError(f"trainer.resume: {path!r} holds no critic (saved by a run without one); PPO "
                                 "(algorithm.adv_estimator=gae) cannot resume from it")
            load_into(role.model, d)
            for name in ShardedAdamW.STATES:
                role.optim.load_full_state(name, read_shard(role.model, d, name))
        same = (was := (meta["tp"], meta["pp"], meta["dp"])) == (now := (lay.tp, lay.pp, lay.dp))
        mine = shard_name(lay, with_dp=True) if same else "dp0_pp0_tp0"  # another layout: rank 0's sampler, counters
        st = torch.load(os.path.join(path, f"state_{mine}.pt"), weights_only=False)
        for (role, _), n in zip(self._role_dirs(path), st["optim_steps"]):
            role.optim.step_count = n
        if same:  # per-rank streams; another layout restarts them (the sampling noise is counter-based)
            for k, fn in (("python", random.setstate), ("numpy", np.random.set_state), ("torch", torch.set_rng_state)):
                fn(st["rng"][k])
            if "cuda" in st["rng"] and torch.cuda.is_available():
                torch.cuda.set_rng_state(st["rng"]["cuda"])
        if self.rank == 0:  # (past total_steps it trains nothing)
            print(f"[nanorl] resumed {path}: step {meta['step']} of trainer.total_steps={self.cfg.trainer.total_steps}"
                  + ("" if same else f"; saved with (tp, pp, dp) = {was}, loaded into {now}"), flush=True)
        self.sampler.load_state_dict(st["sampler"])
        self.kl_ctrl.load_state_dict(st["kl_ctrl"])
        self.nonfinite_skips, self.step, self.saved_row = st.get("nonfinite_skips", 0), st["step"], st.get("metrics")

    # --- the loop
    def fit(self) -> None:
        tc = self.cfg.trainer
        self.maybe_resume()  # first: a refused output_dir keeps its config.yaml
        if self.rank == 0 and not tc.val_only:  # (a val-only run leaves the run's own config)
            write_text(os.path.join(self.out, "config.yaml"),
                       yaml.safe_dump(dataclasses.asdict(self.cfg), sort_keys=False))
        logger, stop = Logger(self.cfg, self.rank, self.step, self.saved_row), {"sigterm": False}
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("sigterm", True))
        try:
            if self.val_data is not None and (tc.val_before_train and self.step == 0 or tc.val_only):
                logger.log(self.step, self.validate())
            if tc.val_only:
                return
            bar = tqdm(total=tc.total_steps, initial=self.step, disable=self.rank > 0, desc="steps", dynamic_ncols=True)
            while self.step < tc.total_steps:
                metrics = self.train_step()
                self.step += 1
                last = self.step == tc.total_steps
                if self.val_data is not None and tc.test_freq > 0 and (self.step % tc.test_freq == 0 or last):
                    with timed(metrics, "testing"):
                        metrics.update(self.validate())
                # a SIGTERM on any rank stops all of them, after the same step
                sigterm = bool(world_all_reduce(torch.tensor([float(stop["sigterm"])], device=self.device)).item())
                if sigterm or (tc.save_freq > 0 and (self.step % tc.save_freq == 0 or last)):
                    with timed(metrics, "save_checkpoint"):
                        self.save_checkpoint(metrics)
                extra = sum(metrics.get(f"timing_s/{k}", 0.0) for k in ("testing", "save_checkpoint"))  # in verl's step
                metrics["perf/throughput"] *= metrics["timing_s/step"] / (metrics["timing_s/step"] + extra)
                metrics["timing_s/step"] += extra
                metrics["perf/time_per_step"] = metrics["timing_s/step"]  # (verl logs both)
                logger.log(self.step, metrics)
                bar.update(1)
                if sigterm:
                    print(f"[nanorl] SIGTERM: checkpoint of step {self.step} saved; exiting", flush=True)
                    break
            bar.close()
        finally:
            signal.signal(signal.SIGTERM, previous)
            logger.close()


def _saved_steps(root: str) -> list[int]:  # of the complete checkpoints in `root`, ascending
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(d[5:]) for d in names if d.startswith("step_") and d[5:].isdigit())


class Logger:
    """Console line, metrics.jsonl and TensorBoard, as trainer.logger lists them, on rank 0."""
    CONSOLE = {"critic/score/mean": "score", "actor/pg_loss": "pg_loss", "actor/entropy": "entropy",
               "actor/ppo_kl": "ppo_kl", "response_length/mean": "response_length", "timing_s/step": "step"}

    def __init__(self, cfg: Config, rank: int, step: int = 0, saved: dict | None = None):
        out, kinds = cfg.trainer.output_dir, cfg.trainer.logger if rank == 0 else []
        self.console, path = "console" in kinds, os.path.join(out, "metrics.jsonl")
        if "jsonl" in kinds:  # after `step` (0: fresh) the lines go (redone); its own, if a crash lost it, is `saved`
            old = [json.loads(s) for s in open(path) if s.endswith("\n")] if step and os.path.isfile(path) else []
            rows = [r for r in old if r["step"] < step] + [next((r for r in old if r["step"] == step), old and saved)]
            write_text(path, "".join(json.dumps(r, default=float) + "\n" for r in rows if r))
        self.jsonl = open(path, "a") if "jsonl" in kinds else None
        tb = "tensorboard" in kinds and importlib.import_module("torch.utils.tensorboard")  # (load_config checked it)
        self.tb = tb.SummaryWriter(os.path.join(out, "tensorboard")) if tb else None

    def log(self, step: int, metrics: dict) -> None:
        metrics = {k: float(v) for k, v in metrics.items()}
        if self.jsonl:
            print(json.dumps({"step": step, **metrics}), file=self.jsonl, flush=True)
        if self.console:
            short = " ".join(f"{name}={metrics[k]:.4g}" for k, name in self.CONSOLE.items() if k in metrics)
            val = " ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k.startswith("val-core"))
            print(f"[step {step}] {short} {val}".rstrip(), flush=True)
        if self.tb:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        for sink in filter(None, (self.jsonl, self.tb)):
            sink.close()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0] + "\n\nusage: train.py CONFIG.yaml [key.path=value ...]")
        return
    try:  # (the process group may exist before Trainer() fails)
        Trainer(load_config(argv[0], argv[1:])).fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
