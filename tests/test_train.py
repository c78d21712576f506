"""train.py end to end on the synthetic task: config errors, metrics, learning, layouts agree."""
import copy
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

import helpers
from data import load_tokenizer, prepare_synthetic
from model import load_model
import rewards
import train

METRICS = ["critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "actor/pg_loss", "actor/pg_clipfrac",
           "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr", "response_length/mean",
           "response_length/clip_ratio", "timing_s/gen", "timing_s/reshard", "timing_s/old_log_prob",
           "timing_s/update_actor", "timing_s/step", "perf/throughput", "perf/mfu/actor",
           "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")
VOLATILE = ("timing_s/", "perf/throughput", "perf/time_per_step", "perf/mfu", "perf/max_memory")  # (a save step has its own phase's)


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("synthetic"))
    prepare_synthetic(d, task="copy", n_train=512, n_test=32, seed=0)
    return d


@pytest.fixture(scope="module")
def small_synth(tmp_path_factory):
    """64 prompts: with 32 per step an epoch is 2 steps, so a 6-step run crosses two epoch boundaries."""
    d = str(tmp_path_factory.mktemp("small"))
    prepare_synthetic(d, task="copy", n_train=64, n_test=8, seed=1)
    return d


def overrides(synth, out, *extra):
    return [f"data.train_files=[{synth}/train.parquet]", f"data.val_files=[{synth}/test.parquet]",
            f"actor.model_path={synth}/model", f"trainer.output_dir={out}", f"data.cache_dir={out}/cache",
            *extra]


def step_with_batch(t):
    """One train_step of Trainer t: (its metrics, the Batch of rollouts it trained on)."""
    seen, rollout = [], t.rollout_batch
    t.rollout_batch = lambda: seen.append(rollout()) or seen[-1]
    return t.train_step(), seen[0][0]


def run(synth, out, *extra):
    train.main([CONFIG, *overrides(synth, out, *extra)])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_unknown_key_names_nearest(synth, tmp_path):
    with pytest.raises(KeyError, match="did you mean 'actor.clip_ratio_high'"):
        train.load_config(CONFIG, overrides(synth, tmp_path, "actor.clip_ratio_hihg=0.3"))
    with pytest.raises(TypeError, match="actor.ppo_epochs must be int"):
        train.load_config(CONFIG, overrides(synth, tmp_path, "actor.ppo_epochs=two"))
    with pytest.raises(ValueError, match="actor.loss_agg_mode='mean' is not one of"):
        train.load_config(CONFIG, overrides(synth, tmp_path, "actor.loss_agg_mode=mean"))


def test_an_override_inside_a_section_keeps_its_other_defaults(synth, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"actor: {{model_path: {synth}/model}}\ndata: {{train_files: [{synth}/train.parquet]}}\n"
                    "critic: {optim: {weight_decay: 0.0}}\nrollout: {n: 2}\n")
    cfg = train.load_config(str(path), ["critic.optim.grad_clip=0.5"])
    assert (cfg.critic.optim.weight_decay, cfg.critic.optim.grad_clip) == (0.0, 0.5)
    assert cfg.critic.optim.lr == 1e-5 and cfg.actor.optim.lr == 1e-6  # the critic's default, not OptimConfig's
    # a section whose keys are all commented out is None in YAML: its defaults, not "must be a mapping"
    path.write_text(f"actor: {{model_path: {synth}/model}}\ndata: {{train_files: [{synth}/train.parquet]}}\n"
                    "rollout: {n: 2}\ncritic:\n  # optim: {lr: 1.0e-6}\nalgorithm:\n  kl_ctrl:\n")
    cfg = train.load_config(str(path))
    assert cfg.critic == train.CriticConfig() and cfg.algorithm.kl_ctrl == train.KLCtrlConfig()
    cfg = train.load_config(str(path), ["critic.cliprange_value=0.3", "algorithm.kl_ctrl.kl_coef=0.5"])  # into them
    assert (cfg.critic.cliprange_value, cfg.critic.optim.lr, cfg.algorithm.kl_ctrl.kl_coef) == (0.3, 1e-5, 0.5)


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(ROOT, "configs"))))
def test_shipped_configs_load(name):
    """Every config in configs/ names only known keys with valid values (they are not run here)."""
    cfg = train.load_config(os.path.join(ROOT, "configs", name))
    if name == "dapo_7b.yaml":  # verl's recipe: 3 x 512 prompts a generation batch, at most 10 batches
        assert (cfg.data.gen_batch_size, cfg.algorithm.filter_groups.max_num_gen_batches) == (1536, 10)


def test_impossible_layout_fails_fast(synth, tmp_path):
    with pytest.raises(ValueError, match="not divisible by tp=3|world size 1 is not divisible"):
        train.main([CONFIG, *overrides(synth, tmp_path, "parallel.train.tp=3")])
    assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))


def test_metrics_and_ratio_is_one_before_first_update(synth, tmp_path):
    # one mini-batch per step: the first update sees the policy that generated, so ratio == 1 exactly
    rows = run(synth, str(tmp_path), "trainer.total_steps=2", "actor.ppo_mini_batch_size=32", "trainer.test_freq=2")
    for name in METRICS:
        assert name in rows[0], name
    assert rows[0]["actor/ppo_kl"] == 0.0 and rows[0]["actor/pg_clipfrac"] == 0.0
    assert any(k.startswith("val-core/synthetic/copy/reward/mean@1") for k in rows[-1])
    assert os.path.isfile(os.path.join(tmp_path, "config.yaml"))
    assert os.path.isfile(os.path.join(tmp_path, "val_generations", "step_2.jsonl"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: peak memory statistics")
def test_timed_records_each_phases_peak_memory():
    """A phase's peak is its own (not the 64 MiB before it); a repeated phase keeps its largest; the step's
    peak covers what ran before the phases."""
    m, gb = {}, lambda mib: torch.cuda.memory_allocated() / 2 ** 30 + mib / 1024
    x = torch.empty(64 * 2 ** 20, dtype=torch.uint8, device="cuda")
    want_step = gb(0)
    del x
    want = {"a": gb(32), "b": gb(16)}
    for name, mib in (("a", 32), ("b", 16), ("a", 8)):
        with train.timed(m, name):
            y = torch.empty(mib * 2 ** 20, dtype=torch.uint8, device="cuda")
            del y
    for name in "ab":
        assert "timing_s/" + name in m and abs(m["perf/max_memory_allocated_gb/" + name] - want[name]) < 1e-6
    assert m["perf/max_memory_allocated_gb"] >= want_step


def test_bypass_mode_takes_pi_old_from_the_rollout(synth, tmp_path):
    """algorithm.rollout_is.bypass_mode: no old_log_prob pass, pi_old = the generator's log-probs. One optimizer
    step per batch, so every figure comes from the same weights; on CPU (fp32) the generator's log-probs equal
    the recomputed ones to rounding, so the loss and gradient must too (a shifted or missing log-prob would not)."""
    def first_step(out, *extra):
        cfg = train.load_config(CONFIG, overrides(synth, out, "actor.ppo_mini_batch_size=32", *extra))
        return train.Trainer(cfg).train_step()
    plain = first_step(str(tmp_path / "plain"))
    bypass = first_step(str(tmp_path / "bypass"), "algorithm.rollout_is.bypass_mode=true")
    assert "timing_s/old_log_prob" in plain and "training/rollout_probs_diff_max" in plain
    assert "timing_s/old_log_prob" not in bypass and "training/rollout_probs_diff_max" not in bypass
    assert plain["actor/ppo_kl"] == 0.0 and abs(bypass["actor/ppo_kl"]) < 1e-6
    assert "actor/entropy" in plain and "actor/entropy" not in bypass  # pi_old's, from the pass bypass skips (verl)
    for k in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm"):
        assert abs(plain[k] - bypass[k]) <= 1e-5 * max(1.0, abs(plain[k])), (k, plain[k], bypass[k])


def test_entropy_is_pi_olds_aggregated_as_the_loss(synth, tmp_path):
    """actor/entropy as verl logs it: the entropy of softmax(logits / temperature) under the weights that generated,
    aggregated by actor.loss_agg_mode; seq-mean-token-sum here (a sequence's sum over its tokens, then the mean over
    sequences), which token-mean would miss by the response length. Reference: each sequence alone through a copy
    of the model taken before the step, the entropy worked from log_softmax in float64."""
    t = train.Trainer(train.load_config(CONFIG, overrides(synth, str(tmp_path), "rollout.temperature=0.7",
                                                          "actor.loss_agg_mode=seq-mean-token-sum")))
    before = copy.deepcopy(t.actor.model)
    metrics, batch = step_with_batch(t)
    got, per_seq = metrics["actor/entropy"], []
    with torch.no_grad():
        for p, r in zip(batch.prompts, batch.responses):
            if r:  # (an empty response is no sequence in the seq-* modes)
                ids, n = torch.tensor(p + r), len(p) + len(r)
                h = before.packed(ids, torch.arange(n), torch.tensor([0, n], dtype=torch.int32), n)
                logp = torch.log_softmax(before.logits(h)[len(p) - 1:n - 1].double() / 0.7, -1)
                per_seq.append(float(-(logp.exp() * logp).sum()))
    want = sum(per_seq) / len(per_seq)
    assert max(len(r) for r in batch.responses) > 1 and abs(got - want) <= 1e-5 * want, (got, want)


def test_step_time_and_throughput_include_validation_and_checkpointing(synth, tmp_path, monkeypatch):
    """As verl's: timing_s/step (and perf/time_per_step) covers the step's validation and checkpoint save (each made
    to take > 2.5 s here, longer than the rest of a step), and perf/throughput is the step's tokens over that time."""
    for name in ("validate", "save_checkpoint"):
        slow = lambda self, *a, f=getattr(train.Trainer, name): time.sleep(2.5) or f(self, *a)  # noqa: E731
        monkeypatch.setattr(train.Trainer, name, slow)
    plain, last = run(synth, str(tmp_path), "trainer.total_steps=2", "trainer.test_freq=2", "trainer.save_freq=2")
    assert "timing_s/testing" not in plain and "timing_s/save_checkpoint" not in plain
    assert last["timing_s/step"] > last["timing_s/testing"] + last["timing_s/save_checkpoint"] > 5
    for r in (plain, last):
        assert abs(r["perf/throughput"] * r["timing_s/step"] / r["perf/total_num_tokens"] - 1) < 1e-9
        assert r["perf/time_per_step"] == r["timing_s/step"]


def test_dapo_refill_keeps_groups_apart(synth, tmp_path):
    """Dynamic sampling that draws the same prompts again within a step: each draw's group is its own (n samples,
    not 2n, behind one baseline). The first draw keeps half the groups, the second fills the batch. Also the
    shaped score (`seq_reward`), worked by hand: score + min(0, -(len - (L - buf)) / buf) with L = 4, buf = 2."""
    t = train.Trainer(train.load_config(CONFIG, overrides(
        synth, str(tmp_path), "algorithm.filter_groups.enable=true", "algorithm.overlong_buffer.enable=true",
        "algorithm.overlong_buffer.len=2")))
    same, n, draws = t.sampler.next_indices(), t.cfg.rollout.n, []
    t.sampler.next_indices = lambda: list(same)

    def score(batch):  # scores 0, 1, 0, 1, ... (mixed in every group); the first draw zeroes half the prompts
        s = (torch.arange(len(batch)) % 2).float()
        if not draws:
            s[[i for i in range(len(batch)) if int(batch.index[i]) in same[len(same) // 2:]]] = 0.0
        draws.append(len(batch))
        return s, {}, 0, []
    t.score = score
    batch, metrics = t.rollout_batch()
    assert metrics["train/num_gen_batches"] == 2 and len(batch) == len(same) * n
    _, counts = torch.unique(batch.index, return_counts=True)
    assert counts.tolist() == [n] * len(same)
    T, lengths = batch.tensors, batch.response_mask.sum(-1)
    assert torch.equal(T["seq_reward"], T["score"] + torch.clamp(-(lengths - 2) / 2, max=0.0))


def test_critic_ppo_epochs(small_synth, tmp_path):
    """critic.ppo_epochs=0 freezes the critic (its values still feed GAE); -1, the default, takes the actor's 2."""
    for epochs in (0, -1):
        t = train.Trainer(train.load_config(CONFIG, overrides(small_synth, str(tmp_path / str(epochs)),
                          "algorithm.adv_estimator=gae", "actor.ppo_epochs=2", f"critic.ppo_epochs={epochs}")))
        before = [p.detach().clone() for p in t.critic.model.parameters()]
        metrics = t.train_step()
        moved = [not torch.equal(b, p) for b, p in zip(before, t.critic.model.parameters())]
        actor_steps = 2 * t.cfg.data.train_batch_size // t.cfg.actor.ppo_mini_batch_size  # epochs x mini-batches
        steps = 0 if epochs == 0 else actor_steps
        assert (t.critic.optim.step_count, t.actor.optim.step_count, any(moved)) == (steps, actor_steps, steps > 0)
        assert ("critic/vf_loss" in metrics) == (steps > 0) and "timing_s/values" in metrics


@pytest.mark.parametrize("algo", [
    ["algorithm.adv_estimator=grpo"],
    ["algorithm.adv_estimator=gae"],
    ["actor.clip_ratio_high=0.28", "algorithm.filter_groups.enable=true", "actor.loss_agg_mode=token-mean"],
], ids=["grpo", "ppo", "dapo"])
def test_learns_synthetic_task(synth, tmp_path, algo):
    """A random policy answers the copy task right ~5% of the time (20-token vocabulary); RL alone must
    lift the mean training score above 0.6 (the mean of the last 5 steps)."""
    if "algorithm.filter_groups.enable=true" in algo:
        # DAPO's training batch keeps only groups with mixed scores (its mean stays near 1/2): judge
        # the greedy validation score instead, before training and at the end
        rows = run(synth, str(tmp_path), "trainer.val_before_train=true", "trainer.test_freq=100",
                   "trainer.total_steps=30", *algo)
        key = "val-core/synthetic/copy/reward/mean@1"
        first, last = rows[0][key], rows[-1][key]
        assert rows[-1]["train/num_gen_batches"] >= 2  # dynamic sampling did draw extra batches
    else:
        rows = run(synth, str(tmp_path), "trainer.test_freq=-1", *algo)
        first = rows[0]["critic/score/mean"]
        last = sum(r["critic/score/mean"] for r in rows[-5:]) / 5
    assert first < 0.3, first
    assert last > 0.6, [round(r.get("critic/score/mean", -1), 2) for r in rows]


def _first_step(rank, world, synth, out, layout):
    cfg = train.load_config(CONFIG, overrides(synth, out, "trainer.total_steps=1", *layout))
    t = train.Trainer(cfg)
    return t.train_step()


@pytest.mark.parametrize("layout", [["parallel.train.tp=2"], ["parallel.train.pp=2"]], ids=["tp2", "pp2"])
def test_layouts_agree_with_dp2(synth, tmp_path, layout):
    dp = helpers.run_distributed(_first_step, 2, synth, str(tmp_path / "dp"), [])
    other = helpers.run_distributed(_first_step, 2, synth, str(tmp_path / "other"), layout)
    for k in ("actor/pg_loss", "critic/score/mean", "actor/entropy", "actor/grad_norm"):
        assert abs(dp[0][k] - other[0][k]) <= 1e-5 * max(1.0, abs(dp[0][k])), (k, dp[0][k], other[0][k])


def _pred_scorer(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(len(solution_str) % 3), "acc": len(solution_str) % 3 == 0, "pred": solution_str[:1]}


def _validate(rank, world, synth, out):
    t = train.Trainer(train.load_config(CONFIG, overrides(synth, out, "rollout.val_n=4", "rollout.val_temperature=1.0",
                                                          "data.val_max_samples=6")))
    t.reward_fn = _pred_scorer
    return t.validate()


def test_validation_metrics_do_not_depend_on_the_number_of_processes(synth, tmp_path):
    """Each rank scores samples r, r + W, ...; the values and the scorer's preds are gathered back into sample
    order, so two processes report exactly the metrics one does (maj@k too, which a misplaced pred would change)."""
    one = helpers.run_distributed(_validate, 1, synth, str(tmp_path / "one"))
    two = helpers.run_distributed(_validate, 2, synth, str(tmp_path / "two"))
    assert one[0] == two[0] == two[1]
    assert "val-core/synthetic/copy/acc/maj@4/mean" in one[0] and 0 < one[0]["val-aux/synthetic/copy/reward/std@4"]


def test_samples_do_not_depend_on_the_number_of_replicas(synth, tmp_path):
    """Each prompt's seed comes from its index in the whole batch: one process draws what two replicas draw. The
    per-GPU rates divide by the processes: perf/throughput = the batch's tokens / step time / world, and the MFU
    of the same batch's FLOPs (the one-process run's MFU x its update time) / world / update time."""
    one = helpers.run_distributed(_first_step, 1, synth, str(tmp_path / "one"), [])
    two = helpers.run_distributed(_first_step, 2, synth, str(tmp_path / "two"), [])
    for k in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/entropy"):
        assert abs(one[0][k] - two[0][k]) <= 1e-5 * max(1.0, abs(one[0][k])), (k, one[0][k], two[0][k])
    assert one[0]["perf/total_num_tokens"] == two[0]["perf/total_num_tokens"]
    for world, r in ((1, one[0]), (2, two[0])):
        assert r["perf/throughput"] == pytest.approx(r["perf/total_num_tokens"] / r["timing_s/step"] / world, rel=1e-9)
    work = one[0]["perf/mfu/actor"] * one[0]["timing_s/update_actor"]  # FLOPs / peak, one process
    assert two[0]["perf/mfu/actor"] == pytest.approx(work / 2 / two[0]["timing_s/update_actor"], rel=1e-6)


def _stable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


@pytest.mark.parametrize("algo", [[], ["algorithm.adv_estimator=gae"]], ids=["grpo", "ppo"])
def test_resume_is_exact(small_synth, tmp_path, monkeypatch, algo):
    """6 uninterrupted steps == 3 steps, SIGTERM (checkpoint, exit), then a fresh process resumed for 3:
    every metric equal at every step, across epoch boundaries (2 steps an epoch). The interrupted run also moves
    the optimizers off the device while generating, which must change nothing."""
    common = ["trainer.total_steps=6", "trainer.test_freq=-1", "trainer.resume=auto", *algo]
    full = run(small_synth, str(tmp_path / "full"), *common)
    common.append("actor.offload_optimizer=true")
    out = str(tmp_path / "resumed")
    step = train.Trainer.train_step

    def step_then_sigterm(self):
        metrics = step(self)
        if self.step == 2:  # (the third step: the counter moves on after it)
            os.kill(os.getpid(), signal.SIGTERM)
        return metrics

    monkeypatch.setattr(train.Trainer, "train_step", step_then_sigterm)
    first = run(small_synth, out, *common)
    assert [r["step"] for r in first] == [1, 2, 3]
    assert open(os.path.join(out, "checkpoints", "latest")).read() == "3"
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), CONFIG, *overrides(small_synth, out, *common)]
    proc = subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
    assert f"resumed {out}/checkpoints/step_3: step 3 of trainer.total_steps=6" in proc.stdout  # (once: rank 0)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        resumed = [json.loads(line) for line in f]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert _stable(resumed) == _stable(full)


KILL_DURING_SAVE = """
import os, signal, sys
sys.path.insert(0, {root!r})
import torch
import train
real = torch.save
def dying_save(obj, path, *a, **k):
    real(obj, path, *a, **k)
    os.kill(os.getpid(), signal.SIGKILL)  # half-way through the save: shards written, nothing published
train.torch.save = dying_save
train.main(sys.argv[1:])
"""


def test_sigkill_while_saving_keeps_the_last_checkpoint(small_synth, tmp_path):
    """A process SIGKILLed half-way through a save publishes nothing: `latest` still names the previous
    complete checkpoint, and auto-resume continues from it; its next save, of another step, clears the staging
    directory the killed one left (about a checkpoint's size)."""
    out = str(tmp_path)
    common = ["trainer.total_steps=4", "trainer.save_freq=2", "trainer.test_freq=-1", "trainer.resume=auto"]
    run(small_synth, out, "trainer.total_steps=2", *common[1:])
    script = tmp_path / "kill.py"
    script.write_text(KILL_DURING_SAVE.format(root=ROOT))
    proc = subprocess.run([sys.executable, str(script), CONFIG, *overrides(small_synth, out, *common)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    ckpts = os.path.join(out, "checkpoints")
    assert open(os.path.join(ckpts, "latest")).read() == "2"
    left = sorted(os.listdir(ckpts))
    assert left == ["latest", "saving.tmp", "step_2"], (left, proc.stdout[-1500:])
    rows = run(small_synth, out, *common, "trainer.total_steps=3")
    # the killed run logged 3 (4 died in its save); the resumed one redid 3 and replaced its line: one line a step
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert sorted(os.listdir(ckpts)) == ["latest", "step_2", "step_3"]


def test_sigkill_between_a_save_and_its_metrics_line_loses_no_line(small_synth, tmp_path):
    """Killed after step 2's checkpoint was published but before its metrics line: the resumed run (from step 2)
    writes step 2's line from the checkpoint, and every step has exactly one line."""
    out, script = str(tmp_path), tmp_path / "kill.py"
    common = ["trainer.total_steps=3", "trainer.save_freq=2", "trainer.test_freq=-1", "trainer.resume=auto"]
    script.write_text(KILL_DURING_SAVE.replace("train.torch.save = dying_save", "train.Logger.log = lambda s, step, m: "
                                               "dying_save(None, None) if step == 2 else log(s, step, m)")
                      .replace("real = torch.save", "real, log = lambda *a: None, train.Logger.log").format(root=ROOT))
    proc = subprocess.run([sys.executable, str(script), CONFIG, *overrides(small_synth, out, *common)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert open(os.path.join(out, "checkpoints", "latest")).read() == "2"
    rows = run(small_synth, out, *common)
    assert [r["step"] for r in rows] == [1, 2, 3] and "actor/pg_loss" in rows[1]


def test_pruning_keeps_the_checkpoint_just_saved_beside_an_unpublished_later_one(small_synth, tmp_path):
    """A crash between publishing step_4 and writing `latest` leaves step_4 beside latest = 2; auto-resume redoes
    steps 3-4. With keep_last_k=1 its save of step 3 must survive, whatever step_4's number says."""
    out, ckpts = str(tmp_path), os.path.join(str(tmp_path), "checkpoints")
    run(small_synth, out, "trainer.total_steps=4", "trainer.save_freq=2", "trainer.test_freq=-1",
        "trainer.keep_last_k=0")
    with open(os.path.join(ckpts, "latest"), "w") as f:
        f.write("2")
    run(small_synth, out, "trainer.total_steps=3", "trainer.save_freq=3", "trainer.test_freq=-1",
        "trainer.keep_last_k=1", "trainer.resume=auto")
    assert open(os.path.join(ckpts, "latest")).read() == "3"
    assert sorted(os.listdir(ckpts)) == ["latest", "step_3", "step_4"]


def _nan_on_rank(rank, world, synth, out, bad_rank, max_skips):
    """Poison the policy loss on one rank at step 2; return what every rank saw, and per step whether the weights
    moved."""
    import algorithms
    real = algorithms.compute_policy_loss
    t = train.Trainer(train.load_config(CONFIG, overrides(synth, out, "trainer.total_steps=3", "trainer.test_freq=-1",
                                                          "actor.ppo_mini_batch_size=32",  # one optimizer step a step
                                                          f"trainer.max_nonfinite_skips={max_skips}")))

    def poisoned(*a, **k):
        loss, m = real(*a, **k)
        return (loss * float("nan"), m) if t.step == 1 and rank == bad_rank else (loss, m)

    real_step, moved = t.train_step, []

    def step():
        before = [p.detach().clone() for p in t.actor.model.parameters()]
        try:
            return real_step()
        finally:
            moved.append(any(not torch.equal(a, p) for a, p in zip(before, t.actor.model.parameters())))

    algorithms.compute_policy_loss, t.train_step = poisoned, step
    try:
        t.fit()
    except FloatingPointError as e:
        return {"raised": str(e), "step": t.step, "moved": moved}
    finally:
        algorithms.compute_policy_loss = real
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f] if rank == 0 else None
    return {"rows": rows, "moved": moved, "skips": t.nonfinite_skips}


def test_nonfinite_loss_on_one_rank_is_skipped_by_all(small_synth, tmp_path):
    """A non-finite gradient norm on one rank skips that optimizer step on every rank (verl): the weights do not
    move in step 2 and do in steps 1 and 3; past trainer.max_nonfinite_skips it raises everywhere."""
    res = helpers.run_distributed(_nan_on_rank, 2, small_synth, str(tmp_path / "skip"), 1, 1)
    assert [r["skips"] for r in res] == [1, 1]
    assert all(r["moved"] == [True, False, True] for r in res)
    rows = res[0]["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["actor/nonfinite_skipped"] == 1.0 and "actor/grad_norm" not in rows[1]
    assert "actor/pg_loss" in rows[2] and "actor/nonfinite_skipped" not in rows[2]
    res = helpers.run_distributed(_nan_on_rank, 2, small_synth, str(tmp_path / "abort"), 0, 0)
    assert all("non-finite actor grad norm" in r["raised"] and r["step"] == 1 for r in res)


def _run_rows(rank, world, synth, out, *extra):
    train.main([CONFIG, *overrides(synth, out, "trainer.test_freq=-1", "actor.ppo_mini_batch_size=32", *extra)])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f] if rank == 0 else None


@pytest.mark.parametrize("algo", ["grpo", "gae"])
def test_checkpoint_resumes_into_another_layout(small_synth, tmp_path, algo):
    """Saved with tp=2 at step 1, resumed with dp=2: steps 2 and 3 match the uninterrupted tp=2 run. Step 2
    (one mini-batch, so its losses come before any update) checks the weights (PPO: the critic's too, which set
    the advantages and vf_loss) and the sampler; step 3 follows an update made with the Adam state of step 1,
    which must carry over too (restarted moments move the weights differently)."""
    tp2, ppo = str(tmp_path / "tp2"), algo == "gae"
    full = helpers.run_distributed(_run_rows, 2, small_synth, tp2, "trainer.total_steps=3", "trainer.save_freq=1",
                                   "trainer.keep_last_k=3",
                                   "parallel.train.tp=2", f"algorithm.adv_estimator={algo}")[0]
    dp2 = helpers.run_distributed(_run_rows, 2, small_synth, str(tmp_path / "dp2"), "trainer.total_steps=3",
                                  f"trainer.resume={tp2}/checkpoints/step_1", f"algorithm.adv_estimator={algo}")[0]
    assert [r["step"] for r in dp2] == [2, 3]
    for got, want in zip(dp2, full[1:]):
        for k in ("actor/pg_loss", "critic/score/mean", "actor/entropy", "actor/ppo_kl", "response_length/mean",
                  *(("critic/vf_loss", "critic/advantages/max") if ppo else ())):
            assert abs(got[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])), (got["step"], k, got[k], want[k])


def _save_with_spy(rank, world, synth, out):
    """Three steps under dp=2, saving each; returns (the files this rank wrote, rank 0's metrics)."""
    real, wrote = train.save_model_shard, []

    def spy(model, layout, d, tensors=None, prefix="model", writer=0):
        wrote.extend([prefix] if layout.dp_rank == writer else [])
        return real(model, layout, d, tensors, prefix, writer)
    train.save_model_shard = spy
    try:
        return wrote, _run_rows(rank, world, synth, out, "trainer.total_steps=3", "trainer.save_freq=1",
                                "trainer.keep_last_k=3")
    finally:
        train.save_model_shard = real


def test_dp_ranks_share_the_checkpoint_writes(small_synth, tmp_path):
    """Under dp=2 the four files of a checkpoint (weights, master, two moments) are written two by each rank, and a
    single process resumed from step 1 repeats steps 2 and 3 of the dp=2 run (the samples do not depend on the
    layout; step 3 follows an update with the Adam moments that the two ranks wrote)."""
    dp2 = str(tmp_path / "dp2")
    (w0, rows), (w1, _) = helpers.run_distributed(_save_with_spy, 2, small_synth, dp2)
    assert (w0, w1) == (["model", "exp_avg"] * 3, ["master", "exp_avg_sq"] * 3)
    one = run(small_synth, str(tmp_path / "one"), "trainer.total_steps=3", "trainer.test_freq=-1",
              "actor.ppo_mini_batch_size=32", f"trainer.resume={dp2}/checkpoints/step_1")
    assert [r["step"] for r in one] == [2, 3]
    for got, want in zip(one, rows[1:]):
        for k in ("actor/pg_loss", "critic/score/mean", "actor/entropy", "actor/ppo_kl", "actor/grad_norm"):
            assert abs(got[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])), (got["step"], k, got[k], want[k])


DIE_ON_RANK_1 = """
import os, sys
sys.path.insert(0, {root!r})
import train
real = train.Trainer.train_step
def dying(self):
    if self.step == 1 and self.rank == 1:
        os._exit(3)  # a crashed GPU or OOM-killed process: no exception, no goodbye
    return real(self)
train.Trainer.train_step = dying
train.main(sys.argv[1:])
"""


def test_dead_rank_fails_the_job_within_the_timeout(small_synth, tmp_path):
    """torchrun, 2 ranks, rank 1 vanishes in step 2: the job exits non-zero, well within the collective
    timeout plus start-up, instead of hanging."""
    import time
    script = tmp_path / "die.py"
    script.write_text(DIE_ON_RANK_1.format(root=ROOT))
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script), CONFIG,
                           *overrides(small_synth, str(tmp_path / "out"), "trainer.total_steps=4",
                                      "trainer.test_freq=-1", "trainer.timeout_s=30")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert time.time() - t0 < 150, f"took {time.time() - t0:.0f} s"


def _dense(model, prompts, responses, R, temperature):
    """log p(response token) and the entropy of every response position, [B, R] each (with grad), one packed pass
    over the whole sequences with a plain log_softmax over the full vocabulary."""
    seqs = [torch.tensor(list(p) + list(r)) for p, r in zip(prompts, responses)]
    lens = [len(s) for s in seqs]
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    z = model.logits(model.packed(torch.cat(seqs), torch.cat([torch.arange(n) for n in lens]), cu, max(lens)))
    lsm = (z.float() / temperature).log_softmax(-1)
    logp, ent = [], []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        at = int(cu[i]) + len(p) - 1 + torch.arange(len(r))  # the positions that predict the response tokens
        row = lsm[at].gather(-1, torch.tensor(r, dtype=torch.long)[:, None]).squeeze(-1)
        logp.append(torch.cat([row, row.new_zeros(R - len(r))]))
        e = -(lsm[at].exp() * lsm[at]).sum(-1)
        ent.append(torch.cat([e, e.new_zeros(R - len(r))]))
    return torch.stack(logp), torch.stack(ent)


def _copy_of(path, seed, params):
    m = load_model(path, random_init=True, seed=seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(params[n])
    return m


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                                  "seq-mean-token-mean"])
def test_first_step_metrics_and_gradient_match_a_dense_reference(small_synth, tmp_path, mode):
    """One GRPO step with a KL loss, KL in the reward and a reference policy unlike the actor, two mini-batches of
    several micro-batches; a warmup so long that the weights do not move (so the ratio is 1 in both mini-batches and
    each one's loss is known in closed form). Against one dense process: the recomputed old/ref log-probs, the KL in
    the reward, pi_old's entropy over the batch (aggregated by the loss_agg_mode), per mini-batch the pg loss (-A
    aggregated by the loss_agg_mode, written out below as verl defines each), the KL loss and the gradient norm,
    averaged over the two optimizer steps; and the warmup's first LR."""
    R, coef, beta, warmup, ec = 4, 0.5, 0.05, 10 ** 9, 0.3
    cfg = train.load_config(CONFIG, overrides(
        small_synth, str(tmp_path), "trainer.total_steps=1", "data.train_batch_size=16", "actor.ppo_mini_batch_size=8",
        f"actor.loss_agg_mode={mode}",
        "actor.max_tokens_per_micro_batch=200", f"actor.optim.lr_warmup_steps={warmup}",
        "actor.use_kl_loss=true", "actor.kl_loss_type=kl", f"actor.kl_loss_coef={coef}", f"actor.entropy_coeff={ec}",
        "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=kl", f"algorithm.kl_ctrl.kl_coef={beta}"))
    t = train.Trainer(cfg)
    t.ref.model.init_random(seed=1234, std=0.2)  # a reference policy clearly unlike the actor
    actor0 = {n: p.detach().clone() for n, p in t.actor.model.named_parameters()}
    ref0 = {n: p.detach().clone() for n, p in t.ref.model.named_parameters()}
    got, batch = step_with_batch(t)
    T, mask = batch.tensors, batch.response_mask
    assert len(batch) == 128 and mask.sum(-1).min() >= 1

    # the first LR of a linear warmup: lr / warmup_steps
    assert got["actor/lr"] == pytest.approx(cfg.actor.optim.lr / warmup, rel=1e-9)
    path, seed = cfg.actor.model_path, cfg.trainer.seed
    actor, ref = _copy_of(path, seed, actor0), _copy_of(path, seed, ref0)
    with torch.no_grad():
        ref_logp, _ = _dense(ref, batch.prompts, batch.responses, R, 1.0)
    logp, ent = _dense(actor, batch.prompts, batch.responses, R, 1.0)
    m = mask.bool()
    assert (T["old_log_probs"] - logp.detach())[m].abs().max() <= 1e-5
    assert (T["ref_log_probs"] - ref_logp)[m].abs().max() <= 1e-5
    # KL in the reward: mean over sequences of the per-sequence token mean of logp_old - logp_ref; beta reported
    kl = (logp.detach() - ref_logp) * mask
    want_kl = ((kl.sum(-1) / mask.sum(-1)).mean()).item()
    assert abs(want_kl) > 1e-3
    assert got["actor/reward_kl_penalty"] == pytest.approx(want_kl, rel=1e-4, abs=1e-6)
    assert got["actor/reward_kl_penalty_coeff"] == pytest.approx(beta)
    # the rewards: score - beta * (summed KL) per sequence
    assert got["critic/rewards/mean"] == pytest.approx((T["seq_reward"] - beta * kl.sum(-1)).mean().item(),
                                                      rel=1e-4, abs=1e-6)

    def agg(x, mk):  # the loss_agg_mode's aggregate, written out (no empty response here: every row is a sequence)
        per_row = (x * mk).sum(-1)
        if mode == "token-mean":  # over all the tokens
            return per_row.sum() / mk.sum()
        if mode == "seq-mean-token-sum":  # each sequence's sum, the mean over sequences
            return per_row.mean()
        if mode == "seq-mean-token-sum-norm":  # Dr. GRPO: the token sum / (sequences x max_response_length)
            return per_row.sum() / (len(mk) * R)
        return (per_row / mk.sum(-1)).mean()  # seq-mean-token-mean: each sequence's token mean, their mean

    # per mini-batch losses and gradients, one dense process
    assert got["actor/entropy"] == pytest.approx(agg(ent, mask).item(), rel=1e-5)
    want = {"actor/pg_loss": [], "actor/kl_loss": [], "actor/grad_norm": []}
    for start in range(0, 128, 64):
        rows = slice(start, start + 64)
        mk, A = mask[rows], T["advantages"][rows]
        lp = logp[rows]
        ratio = torch.exp(lp - lp.detach())
        pg = agg(-A * ratio, mk)
        kl_loss = agg(lp - ref_logp[rows], mk)
        actor.zero_grad()
        (pg + coef * kl_loss - ec * agg(ent[rows], mk)).backward(retain_graph=True)  # an entropy bonus
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in actor.parameters() if p.grad is not None))
        want["actor/pg_loss"].append(pg.item())
        want["actor/kl_loss"].append(kl_loss.item())
        want["actor/grad_norm"].append(norm.item())
    for k, v in want.items():
        w = sum(v) / len(v)
        assert abs(got[k] - w) <= 1e-4 * max(abs(w), 1e-3), (k, got[k], w)
    assert abs(got["actor/ppo_kl"]) < 1e-6


def test_ppo_kl_and_clipfracs_after_an_update_match_a_dense_reference(small_synth, tmp_path):
    """PPO, two epochs over two mini-batches (A, B, A, B): each optimizer step after the first starts from weights
    the earlier steps moved, so its ratio is no longer 1. Logged: the mean over the four steps of
    ppo_kl = sum m (logp_old - logp) / sum m, and of pg_clipfrac and vf_clipfrac, the tokens whose clipped branch is
    the larger / sum m, with m the step's own mini-batch's mask (not the whole batch's); the first step's are 0 (the
    weights that made pi_old and the values). Token counts, not the sequences that seq-mean-token-sum divides the
    losses by. Reference: dense log-probs and values under copies of the weights each optimizer step started from."""
    c, cr = 0.05, 1e-3  # clip ratios that the first step's moves exceed on some tokens, not on all
    t = trainer(small_synth, tmp_path, "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "actor.ppo_epochs=2",
                "algorithm.adv_estimator=gae", "actor.loss_agg_mode=seq-mean-token-sum",
                "critic.loss_agg_mode=seq-mean-token-sum", f"actor.clip_ratio_low={c}", f"actor.clip_ratio_high={c}",
                f"critic.cliprange_value={cr}")
    starts = {"actor": [], "critic": []}  # each optimizer step's starting weights
    for name in starts:
        role = getattr(t, name)

        def step(lr, _real=role.optim.step, _role=role, _seen=starts[name]):
            _seen.append({n: p.detach().clone() for n, p in _role.model.named_parameters()})
            return _real(lr)
        role.optim.step = step
    got, batch = step_with_batch(t)
    T, mask, R = batch.tensors, batch.response_mask, batch.response_mask.shape[1]
    assert [len(v) for v in starts.values()] == [4, 4] and mask.sum(-1).min() >= 1
    half = len(batch) // 2  # 2 prompts x n samples a mini-batch
    minis = [slice(0, half), slice(half, len(batch))] * 2  # the rows of each optimizer step
    assert float(mask[minis[0]].sum()) != float(mask[minis[1]].sum())  # their token counts differ
    path, seed, A, ret = t.cfg.actor.model_path, t.cfg.trainer.seed, T["advantages"], T["returns"]
    with torch.no_grad():
        logp = [_dense(_copy_of(path, seed, w), batch.prompts, batch.responses, R, 1.0)[0].double()
                for w in starts["actor"]]
        values = []
        for w in starts["critic"]:
            critic = load_model(path, random_init=True, seed=seed, value_head=True, lm_head=False)
            for name, param in critic.named_parameters():
                param.copy_(w[name])
            v = []
            for p, r in zip(batch.prompts, batch.responses):
                ids, n = torch.tensor(p + r), len(p) + len(r)
                out = critic.values(critic.packed(ids, torch.arange(n), torch.tensor([0, n], dtype=torch.int32), n))
                v.append(torch.cat([out[len(p) - 1:n - 1].double(), torch.zeros(R - len(r), dtype=torch.float64)]))
            values.append(torch.stack(v))
    m = mask.bool()
    assert (T["old_log_probs"] - logp[0])[m].abs().max() <= 1e-5 and (T["values"] - values[0])[m].abs().max() <= 1e-5
    kl, pg_cf, vf_cf = [], [], []
    for rows, lp, v in zip(minis, logp, values):
        mk, tokens, a, r = m[rows], mask[rows].sum(), A[rows], ret[rows]
        kl.append(float((logp[0][rows] - lp[rows])[mk].sum() / tokens))
        ratio = torch.exp(lp[rows] - logp[0][rows])
        pg_cf.append(float(((-a * torch.clamp(ratio, 1 - c, 1 + c) > -a * ratio) & mk).sum() / tokens))
        vc = torch.clamp(v[rows], values[0][rows] - cr, values[0][rows] + cr)
        vf_cf.append(float((((vc - r) ** 2 > (v[rows] - r) ** 2) & mk).sum() / tokens))
    assert kl[0] == 0.0 and pg_cf[0] == vf_cf[0] == 0.0
    assert min(abs(x) for x in kl[1:]) > 1e-3 and 0 < sum(pg_cf) / 4 < 0.75 and 0 < sum(vf_cf) / 4 < 0.75, \
        (kl, pg_cf, vf_cf)
    assert got["actor/ppo_kl"] == pytest.approx(sum(kl) / 4, rel=1e-4)
    assert got["actor/pg_clipfrac"] == pytest.approx(sum(pg_cf) / 4, rel=1e-6)
    assert got["critic/vf_clipfrac"] == pytest.approx(sum(vf_cf) / 4, rel=1e-6)


def test_config_values_reach_the_algorithms(small_synth, tmp_path, monkeypatch):
    """Each algorithm key arrives at the function that uses it (the functions themselves are checked against
    references in test_algorithms.py): PPO's clip ratios, GAE's gamma and lam, the critic's value clip and loss
    aggregation (not the actor's), the rollout IS threshold and level; then GRPO without the std normalisation
    (Dr. GRPO). actor.gradient_checkpointing reaches the models trained (off by default). The rollout IS weights'
    direction, pi_old / pi_rollout: the generator's log-probs are shifted by d = -0.3 on every response token, so the
    sequence-level weight given to the policy loss is min(exp(-d * length), 3) (by hand; pi_old equals the unshifted
    rollout log-probs to ~1e-6 on CPU fp32), not its inverse."""
    seen, d = {}, -0.3
    for name in ("compute_policy_loss", "compute_value_loss", "compute_advantage", "compute_rollout_is_weights"):
        def spy(*a, _real=getattr(train.alg, name), _name=name, **kw):
            seen[_name] = (a, kw)
            return _real(*a, **kw)
        monkeypatch.setattr(train.alg, name, spy)

    def shifted(self, items, seed, val=False, _real=train.Trainer.generate):
        b = _real(self, items, seed, val)
        b.rollout_log_probs = b.rollout_log_probs + d * b.response_mask
        return b
    monkeypatch.setattr(train.Trainer, "generate", shifted)
    t = trainer(small_synth, tmp_path / "ppo", "algorithm.adv_estimator=gae", "algorithm.gamma=0.95",
                "algorithm.lam=0.9", "critic.cliprange_value=0.3", "critic.loss_agg_mode=seq-mean-token-sum",
                "actor.loss_agg_mode=seq-mean-token-mean", "actor.clip_ratio_low=0.15",
                "actor.clip_ratio_high=0.33", "actor.clip_ratio_c=4.0", "algorithm.rollout_is.enable=true",
                "algorithm.rollout_is.level=sequence", "algorithm.rollout_is.threshold=3.0",
                "actor.gradient_checkpointing=true")
    assert t.actor.model.gradient_checkpointing is True and t.critic.model.gradient_checkpointing is True
    _, batch = step_with_batch(t)
    kw = seen["compute_policy_loss"][1]
    assert (kw["clip_ratio_low"], kw["clip_ratio_high"], kw["clip_ratio_c"]) == (0.15, 0.33, 4.0)
    assert (kw["loss_agg_mode"], kw["horizon"]) == ("seq-mean-token-mean", 4)  # (tiny.yaml: max_response_length 4)
    vkw = seen["compute_value_loss"][1]
    assert (vkw["cliprange_value"], vkw["loss_agg_mode"]) == (0.3, "seq-mean-token-sum")
    adv = seen["compute_advantage"]
    assert adv[0][0] == "gae" and (adv[1]["gamma"], adv[1]["lam"]) == (0.95, 0.9)
    isw = seen["compute_rollout_is_weights"][0]
    assert isw[0] is batch.tensors["old_log_probs"] and isw[1] is batch.rollout_log_probs
    assert isw[3:] == (3.0, "sequence")
    mask = seen["compute_policy_loss"][0][3]  # the last micro-batch's rows
    length = mask.sum(-1, keepdim=True)
    want = torch.where(mask.bool(), torch.clamp(torch.exp(-d * length), max=3.0), 0.0)
    assert length.min() < 4 and length.max() == 4  # weights below the threshold and clipped at it
    torch.testing.assert_close(kw["rollout_is_weights"], want, rtol=1e-4, atol=0)
    g = trainer(small_synth, tmp_path / "grpo", "algorithm.norm_adv_by_std_in_grpo=false")
    assert g.actor.model.gradient_checkpointing is False
    g.train_step()
    adv = seen["compute_advantage"]
    assert adv[0][0] == "grpo" and adv[1]["norm_adv_by_std_in_grpo"] is False


def test_checkpoint_restores_the_trainer_state(small_synth, tmp_path):
    """What a checkpoint's state file holds comes back on resume: the adaptive KL coefficient reached, the count of
    skipped non-finite steps, the sampler position, the optimizer step count and the step."""
    out = str(tmp_path / "run")
    extra = ("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "trainer.total_steps=9")
    t = train.Trainer(train.load_config(CONFIG, overrides(small_synth, out, *extra)))
    t.kl_ctrl.value, t.nonfinite_skips, t.step, t.actor.optim.step_count = 0.0123, 2, 3, 5
    for _ in range(3):  # 64 prompts, 32 a batch: into epoch 1
        t.sampler.next_indices()
    saved = t.sampler.state_dict()
    want_next = list(t.sampler.next_indices())
    t.sampler.load_state_dict(saved)
    t.save_checkpoint()
    r = train.Trainer(train.load_config(CONFIG, overrides(small_synth, out, *extra,
                                                          f"trainer.resume={out}/checkpoints/step_3")))
    r.maybe_resume()
    assert r.step == 3 and r.actor.optim.step_count == 5
    assert r.kl_ctrl.value == pytest.approx(0.0123)
    assert r.nonfinite_skips == 2
    assert list(r.sampler.next_indices()) == want_next


def test_dynamic_sampling_on_seq_reward_filters_on_the_shaped_score(small_synth, tmp_path):
    """algorithm.filter_groups.metric=seq_reward filters on score + overlong penalty: with every score equal, only
    the length penalty (worked by hand, L = 4, buffer 2) can make a group's values differ, and such groups are kept."""
    t = train.Trainer(train.load_config(CONFIG, overrides(
        small_synth, str(tmp_path), "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward",
        "algorithm.filter_groups.max_num_gen_batches=4", "algorithm.overlong_buffer.enable=true",
        "algorithm.overlong_buffer.len=2")))
    t.score = lambda batch: (torch.ones(len(batch)), {}, 0, [])
    batch, _ = t.rollout_batch()
    T, n = batch.tensors, t.cfg.rollout.n
    want = 1.0 + torch.clamp(-(batch.response_mask.sum(-1) - 2) / 2, max=0.0)
    assert torch.equal(T["score"], torch.ones(len(batch))) and torch.equal(T["seq_reward"], want)
    assert len(batch) == 8 * n
    for g in batch.index.unique():
        vals = want[batch.index == g]
        assert len(vals) == n and vals.max() > vals.min()


def test_ppo_returns_carry_the_outcome_reward_to_every_response_token(small_synth, tmp_path):
    """The outcome reward sits on a response's last token, so with gamma = lam = 1 GAE's return (reward to go) is the
    sequence's score at every one of its tokens: critic/returns/mean is the token-weighted mean score (by hand).
    Then the critic's loss, under critic.loss_agg_mode=seq-mean-token-mean (the actor keeps token-mean): one
    mini-batch and epoch, so its prediction is the value it was given (no clip), and vf_loss = 0.5 mean over
    sequences of mean_t (V_t - score)^2, V from each sequence alone through a copy of the critic taken before the step
    (the value at the position that predicts the response token, as verl's); token-mean's sum / its count (the
    critic's: sequences) would miss by the length."""
    t = train.Trainer(train.load_config(CONFIG, overrides(
        small_synth, str(tmp_path), "trainer.total_steps=1", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
        "algorithm.adv_estimator=gae", "algorithm.gamma=1.0", "algorithm.lam=1.0",
        "critic.loss_agg_mode=seq-mean-token-mean")))
    t.score = lambda batch: (torch.linspace(-1.0, 1.0, len(batch)), {}, 0, [])
    critic = copy.deepcopy(t.critic.model)
    got, batch = step_with_batch(t)
    lens, score = batch.response_mask.sum(-1), torch.linspace(-1.0, 1.0, len(batch))
    assert lens.min() >= 1 and lens.max() > 1
    assert got["critic/returns/mean"] == pytest.approx(((score * lens).sum() / lens.sum()).item(), abs=1e-5)
    assert got["critic/rewards/mean"] == pytest.approx(score.mean().item(), abs=1e-6)
    per_seq = []
    with torch.no_grad():
        for p, r, s in zip(batch.prompts, batch.responses, score.tolist()):
            ids, n = torch.tensor(p + r), len(p) + len(r)
            v = critic.values(critic.packed(ids, torch.arange(n), torch.tensor([0, n], dtype=torch.int32), n))
            per_seq.append(float(((v[len(p) - 1:n - 1].double() - s) ** 2).mean()))
    want = 0.5 * sum(per_seq) / len(per_seq)
    assert got["critic/vf_loss"] == pytest.approx(want, rel=1e-5) and got["critic/vf_clipfrac"] == 0.0


def trainer(synth, out, *extra):
    return train.Trainer(train.load_config(CONFIG, overrides(synth, str(out), *extra)))


# ----------------------------------------------------------------------------- load_config


def test_config_float_written_without_a_dot_is_a_float(small_synth, tmp_path):
    """YAML reads 1e-6 (no dot) as a string; a float key takes it as the number (file and override)."""
    path = tmp_path / "c.yaml"
    path.write_text(f"actor: {{model_path: {small_synth}/model, optim: {{lr: 1e-6}}}}\n"
                    f"data: {{train_files: [{small_synth}/train.parquet]}}\nrollout: {{n: 2}}\n")
    cfg = train.load_config(str(path), ["critic.optim.lr=2e-5"])
    assert cfg.actor.optim.lr == 1e-6 and cfg.critic.optim.lr == 2e-5
    assert isinstance(cfg.actor.optim.lr, float) and isinstance(cfg.critic.optim.lr, float)


def test_config_single_string_for_a_list_key(small_synth, tmp_path):
    cfg = train.load_config(CONFIG, overrides(small_synth, tmp_path, "trainer.logger=jsonl",
                                              f"data.val_files={small_synth}/test.parquet"))
    assert cfg.trainer.logger == ["jsonl"] and cfg.data.val_files == [f"{small_synth}/test.parquet"]


def test_config_bool_is_not_an_int(small_synth, tmp_path):
    """True is an int in Python; an int key must still refuse it (and a bool key an int)."""
    with pytest.raises(TypeError, match="trainer.total_steps must be int, got True"):
        train.load_config(CONFIG, overrides(small_synth, tmp_path, "trainer.total_steps=true"))
    with pytest.raises(TypeError, match="data.shuffle must be true or false, got 1"):
        train.load_config(CONFIG, overrides(small_synth, tmp_path, "data.shuffle=1"))


def test_config_override_value_may_hold_an_equals_sign(small_synth, tmp_path):
    cfg = train.load_config(CONFIG, overrides(small_synth, tmp_path, "reward.fn=/x/a=b.py:score"))
    assert cfg.reward.fn == "/x/a=b.py:score"


def test_config_mapping_override_merges_into_the_section(small_synth, tmp_path):
    """actor.optim={lr: 0.01} sets lr and keeps the file's other optim keys (tiny.yaml: weight_decay 0.0, not the
    default 0.01), as Hydra merges; algorithm={kl_ctrl: ...} keeps the file's algorithm.filter_groups (30, not 10)."""
    cfg = train.load_config(CONFIG, overrides(small_synth, tmp_path, "actor.optim={lr: 0.01}",
                                              "algorithm={kl_ctrl: {kl_coef: 0.5}}"))
    assert (cfg.actor.optim.lr, cfg.actor.optim.weight_decay, cfg.actor.optim.grad_clip) == (0.01, 0.0, 1.0)
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.5 and cfg.algorithm.filter_groups.max_num_gen_batches == 30


def test_config_betas_must_be_below_one(small_synth, tmp_path):
    with pytest.raises(ValueError, match=r"actor\.optim\.betas=\[0\.9, 1\.0\] must be two numbers in \[0, 1\)"):
        train.load_config(CONFIG, overrides(small_synth, tmp_path, "actor.optim.betas=[0.9, 1.0]"))


OUT_OF_BOUNDS = [  # (override, the error it must give), written out by hand; None: a YAML without data.train_files
    ("data.max_response_length=0", r"data\.max_response_length=0 must be >= 1"),
    ("rollout.val_n=0", r"rollout\.val_n=0 must be >= 1"),
    ("trainer.timeout_s=0", r"trainer\.timeout_s=0 must be >= 1"),
    ("data.gen_batch_size=-1", r"data\.gen_batch_size=-1 must be >= 0"),
    ("actor.clip_ratio_high=-0.1", r"actor\.clip_ratio_high=-0\.1 must be >= 0"),
    ("critic.cliprange_value=-1", r"critic\.cliprange_value=-1\.0 must be >= 0"),
    ("critic.optim.lr=-1", r"critic\.optim\.lr=-1\.0 must be >= 0"),
    ("rollout.val_top_k=-2", r"rollout\.val_top_k=-2 must be >= -1"),
    ("algorithm.kl_ctrl.target_kl=0", r"algorithm\.kl_ctrl\.target_kl=0\.0 must be > 0"),
    ("algorithm.rollout_is.threshold=0", r"algorithm\.rollout_is\.threshold=0\.0 must be > 0"),
    ("trainer.peak_tflops=0", r"trainer\.peak_tflops=0\.0 must be > 0"),
    ("algorithm.kl_penalty=foo", r"algorithm\.kl_penalty='foo' is not one of "
                                 r"\['kl', 'k1', 'abs', 'mse', 'k2', 'low_var_kl', 'k3'\]"),
    ("actor.kl_loss_type=foo", r"actor\.kl_loss_type='foo' is not one of "
                               r"\['kl', 'k1', 'abs', 'mse', 'k2', 'low_var_kl', 'k3'\]"),
    ("algorithm.kl_ctrl.type=foo", r"algorithm\.kl_ctrl\.type='foo' is not one of \['fixed', 'adaptive'\]"),
    ("critic.optim.lr_schedule=foo",
     r"critic\.optim\.lr_schedule='foo' is not one of \['constant', 'cosine', 'linear'\]"),
    ("trainer.device=tpu", r"trainer\.device='tpu' is not one of \['auto', 'cpu', 'cuda'\]"),
    ("critic.loss_agg_mode=mean", r"critic\.loss_agg_mode='mean' is not one of \['token-mean', 'seq-mean-token-sum', "
                                  r"'seq-mean-token-mean', 'seq-mean-token-sum-norm'\]"),
    ("actor.optim.betas=[-0.1,0.9]", r"actor\.optim\.betas=\[-0\.1, 0\.9\] must be two numbers in \[0, 1\)"),
    (None, r"c\.yaml: data\.train_files is required"),
]


@pytest.mark.parametrize("bad, message", OUT_OF_BOUNDS, ids=[b or "no-train-files" for b, _ in OUT_OF_BOUNDS])
def test_config_refuses_a_value_out_of_bounds(small_synth, tmp_path, bad, message):
    """Each key's bound or choices, and a required key, checked at load time: the error names the override (or the
    file), the key, the value and what it must be."""
    if bad is None:  # (tiny.yaml names train files, as every override list here does)
        with open(CONFIG) as f:
            raw = yaml.safe_load(f)
        del raw["data"]["train_files"]
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(raw))
        args = (str(path), [ov for ov in overrides(small_synth, tmp_path) if not ov.startswith("data.train_files=")])
    else:
        args, message = (CONFIG, overrides(small_synth, tmp_path, bad)), f"override {re.escape(repr(bad))}: {message}"
    with pytest.raises(ValueError, match=message):
        train.load_config(*args)


def test_config_overlong_buffer_may_span_the_whole_response(small_synth, tmp_path):
    ok = ("algorithm.overlong_buffer.enable=true", "data.max_response_length=4")
    assert train.load_config(CONFIG, overrides(small_synth, tmp_path, *ok, "algorithm.overlong_buffer.len=4")) \
        .algorithm.overlong_buffer.len == 4
    with pytest.raises(ValueError, match=r"overlong_buffer\.len=5 must be in \(0, data\.max_response_length=4\]"):
        train.load_config(CONFIG, overrides(small_synth, tmp_path, *ok, "algorithm.overlong_buffer.len=5"))


@pytest.mark.parametrize("est", ["rloo", "reinforce_plus_plus_baseline"])
def test_config_group_baselines_need_two_samples(small_synth, tmp_path, est):
    with pytest.raises(ValueError, match=f"algorithm.adv_estimator={est} compares .*rollout.n=1 must be >= 2"):
        train.load_config(CONFIG, overrides(small_synth, tmp_path, f"algorithm.adv_estimator={est}", "rollout.n=1"))


# ----------------------------------------------------------------------------- DAPO dynamic sampling

DAPO = ("data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "algorithm.filter_groups.enable=true")


def _scripted(t, per_draw):
    """t.score returns per_draw[k](batch) for the k-th generation batch; returns the list of batches generated."""
    seen, gen = [], t.generate

    def generate(items, seed, val=False):
        b = gen(items, seed, val)
        seen.append(b)
        return b
    t.generate = generate
    t.score = lambda batch: per_draw[min(len(seen), len(per_draw)) - 1](batch)
    return seen


def _same(batch):
    return torch.ones(len(batch)), {}, 0, []


def _mixed(batch):
    return (torch.arange(len(batch)) % 2).float(), {}, 0, []


def test_dynamic_sampling_gives_up_after_max_num_gen_batches(small_synth, tmp_path):
    t = trainer(small_synth, tmp_path, *DAPO, "algorithm.filter_groups.max_num_gen_batches=3")
    seen = _scripted(t, [_same])
    with pytest.raises(RuntimeError, match="0 of 8 prompts had varied 'score' in 3 batches .*too easy or too hard"):
        t.rollout_batch()
    assert len(seen) == 3


def test_gen_batch_size_draws_that_many_prompts_a_generation_batch(small_synth, tmp_path):
    """data.gen_batch_size (verl's DAPO recipe) draws 12 prompts a generation batch for a batch of 8: a draw with 6
    varied groups and then one with all 12 fill it with 6 + 2 groups, in draw order, each with its n samples."""
    t = trainer(small_synth, tmp_path, *DAPO, "data.gen_batch_size=12")

    def half_mixed(b):  # groups of the first 6 prompts mixed, the rest all alike
        return ((torch.arange(len(b)) % 2) * (torch.arange(len(b)) < 6 * t.cfg.rollout.n)).float(), {}, 0, []
    seen = _scripted(t, [half_mixed, _mixed])
    batch, metrics = t.rollout_batch()
    n, first = t.cfg.rollout.n, seen[0].index.unique_consecutive()
    assert [len(b) for b in seen] == [12 * n] * 2 and metrics["train/num_gen_batches"] == 2.0
    second = seen[1].index.unique_consecutive()  # (offset by the dataset size: a prompt drawn again is a new group)
    assert (first < t.sampler.num_items).all() and (second >= t.sampler.num_items).all()
    assert batch.index.unique_consecutive().tolist() == first[:6].tolist() + second[:2].tolist()
    assert len(batch) == 8 * n and torch.unique(batch.index, return_counts=True)[1].tolist() == [n] * 8


def test_dynamic_sampling_max_zero_means_no_limit(small_synth, tmp_path):
    t = trainer(small_synth, tmp_path, *DAPO, "algorithm.filter_groups.max_num_gen_batches=0")
    seen = _scripted(t, [_same, _same, _mixed])
    batch, metrics = t.rollout_batch()
    assert len(seen) == 3 and metrics["train/num_gen_batches"] == 3.0
    assert len(batch) == 8 * t.cfg.rollout.n


def test_redrawn_prompts_get_fresh_samples(small_synth, tmp_path):
    """The same prompts drawn again within a step (their first draw all dropped) must not repeat its samples."""
    t = trainer(small_synth, tmp_path, *DAPO)
    same = t.sampler.next_indices()
    t.sampler.next_indices = lambda: list(same)
    seen = _scripted(t, [_same, _mixed])
    t.rollout_batch()
    assert len(seen) == 2 and seen[0].prompts == seen[1].prompts
    assert seen[0].responses != seen[1].responses


def test_dynamic_sampling_on_a_scorers_extra_key(small_synth, tmp_path):
    """filter_groups.metric names a key the reward function returns beside score (acc): filtered on it."""
    t = trainer(small_synth, tmp_path, *DAPO, "algorithm.filter_groups.metric=acc")
    seen = _scripted(t, [lambda b: (torch.ones(len(b)), {"acc": (torch.arange(len(b)) % 2).float()}, 0, [])])
    batch, metrics = t.rollout_batch()
    assert len(seen) == 1 and metrics["train/num_gen_batches"] == 1.0
    assert torch.equal(batch.tensors["extra/acc"], (torch.arange(len(batch)) % 2).float())


def test_dynamic_sampling_refuses_a_metric_missing_for_some_samples(small_synth, tmp_path):
    t = trainer(small_synth, tmp_path, *DAPO, "algorithm.filter_groups.metric=acc")

    def partial(b):
        acc = (torch.arange(len(b)) % 2).float()
        acc[3] = float("nan")
        return torch.ones(len(b)), {"acc": acc}, 0, []
    _scripted(t, [partial])
    with pytest.raises(ValueError, match=r"only some samples \(1 of 64 lack it\)"):
        t.rollout_batch()


def test_an_extra_missing_from_a_whole_draw_is_nan(small_synth, tmp_path):
    """Draw 1 keeps 4 of 8 groups (32 rows, acc = 1), draw 2 all 8 (no acc): the 64 rows kept are draw 1's 32 with
    acc 1 and the first 32 of draw 2 with acc NaN (not 0, which would read as a real value)."""
    t = trainer(small_synth, tmp_path, *DAPO)
    n = t.cfg.rollout.n

    def first(b):
        s = (torch.arange(len(b)) % 2).float()
        s[len(b) // 2:] = 0.0  # the last 4 groups all 0: dropped
        return s, {"acc": torch.ones(len(b))}, 0, []
    _scripted(t, [first, _mixed])
    batch, _ = t.rollout_batch()
    acc = batch.tensors["extra/acc"]
    assert len(batch) == 8 * n
    assert torch.equal(acc[:4 * n], torch.ones(4 * n)) and acc[4 * n:].isnan().all()


# ----------------------------------------------------------------------------- score


def test_score_marks_an_extra_a_sample_lacked_as_nan(small_synth, tmp_path):
    t = trainer(small_synth, tmp_path)
    calls = []

    def fn(data_source, solution_str, ground_truth, extra_info):
        calls.append(1)
        return {"score": 0.5, "acc": 1.0} if len(calls) % 2 else {"score": 0.25}
    t.reward_fn = fn
    B = 4
    batch = train.Batch([[1, 2]] * B, [[3]] * B, torch.arange(B), ["s"] * B, ["x"] * B, [{}] * B,
                        torch.ones(B, 1), torch.zeros(B, 1))
    scores, extras, errors, *_ = t.score(batch)
    assert scores.tolist() == [0.5, 0.25, 0.5, 0.25] and errors == 0
    assert extras["acc"][0::2].tolist() == [1.0, 1.0] and extras["acc"][1::2].isnan().all()


def test_a_scorer_that_raises_on_every_sample_stops_the_run(small_synth, tmp_path):
    """Some samples failing score 0 and are counted; all of them failing is a bug in the scorer: the run stops."""
    t = trainer(small_synth, tmp_path)
    B = 4
    batch = train.Batch([[1, 2]] * B, [[3]] * B, torch.arange(B), ["s"] * B, ["x"] * B, [{"i": i} for i in range(B)],
                        torch.ones(B, 1), torch.zeros(B, 1))
    t.reward_fn = lambda data_source, solution_str, ground_truth, extra_info: 1 / extra_info["i"]
    scores, _, errors, *_ = t.score(batch)
    assert scores.tolist() == pytest.approx([0.0, 1.0, 0.5, 1 / 3]) and errors == 1
    t.reward_fn = lambda data_source, solution_str, ground_truth, extra_info: undefined_name  # noqa: F821
    with pytest.raises(RuntimeError, match="the reward function raised on all 4 samples"):
        t.score(batch)


# ----------------------------------------------------------------------------- validate


def _val_records(out, step=0):
    with open(os.path.join(out, "val_generations", f"step_{step}.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_val_max_samples_and_the_generations_file(small_synth, tmp_path):
    """val_max_samples=5 of 8, val_batch_size=2: five samples in three batches, a seeded subset in file order (not
    the first five: with several val files a cap would skip the later ones), the same at every validation; 0 takes
    all eight, as in verl. The file holds each sample's own prompt, response, ground truth and score (decoded here
    from the batches generated), the first 64 samples of a larger validation."""
    t = trainer(small_synth, tmp_path, "data.val_max_samples=5", "data.val_batch_size=2", "rollout.val_temperature=1.0")
    seen, gen, asked, get = [], t.generate, [], t.val_data.get_batch
    t.generate = lambda items, seed, val=False: seen.append(gen(items, seed, val)) or seen[-1]
    t.val_data.get_batch = lambda idx: asked.append(idx) or get(idx)
    t.validate()
    recs = _val_records(str(tmp_path))
    assert [len(b) for b in seen] == [2, 2, 1] and len(recs) == 5
    want = [(t.tokenizer.decode(b.prompts[i]), t.tokenizer.decode(b.responses[i], skip_special_tokens=True),
             b.ground_truth[i]) for b in seen for i in range(len(b))]
    assert [(r["prompt"], r["response"], r["ground_truth"]) for r in recs] == want
    assert len({r["response"] for r in recs}) > 1
    picked = [i for idx in asked for i in idx]
    assert picked == sorted(set(picked)) != [0, 1, 2, 3, 4] and len(picked) == 5
    t.validate()
    assert [i for idx in asked for i in idx] == picked * 2
    # all eight prompts, 9 samples each: the file keeps the first 64 of the 72 generated
    everything = trainer(small_synth, tmp_path / "all", "data.val_max_samples=0", "data.val_batch_size=8",
                         "rollout.val_n=9", "rollout.val_temperature=1.0")
    everything.val_data.get_batch = lambda idx: asked.append(idx) or get(idx)
    seen, gen = [], everything.generate
    everything.generate = lambda items, seed, val=False: seen.append(gen(items, seed, val)) or seen[-1]
    everything.validate()
    assert asked[-1] == list(range(8)) and [len(b) for b in seen] == [72]
    want = [(everything.tokenizer.decode(b.prompts[i]), everything.tokenizer.decode(b.responses[i],
             skip_special_tokens=True)) for b in seen for i in range(len(b))]
    assert [(r["prompt"], r["response"]) for r in _val_records(str(tmp_path / "all"))] == want[:64]


def test_validation_batches_draw_fresh_noise(small_synth, tmp_path):
    """Sampled validation (val_temperature 1), one prompt per batch, the same prompt in each: the batches must not
    reuse one seed (eight identical responses)."""
    t = trainer(small_synth, tmp_path, "rollout.val_temperature=1.0", "data.val_batch_size=1",
                "data.val_max_samples=8")
    one = t.val_data.get_batch([0])
    t.val_data.get_batch = lambda idx: [dict(one[0]) for _ in idx]
    t.validate()
    assert len({r["response"] for r in _val_records(str(tmp_path))}) > 1


def test_validation_samples_with_val_top_p_and_val_top_k(small_synth, tmp_path):
    """val_top_p and val_top_k reach the validation generator (and only it): at val_temperature 1, a nucleus of
    mass 1e-6 or a top-1 keeps the argmax alone, so validation repeats the greedy one; plain sampling does not."""
    texts = {}
    for name, ov in (("greedy", ()), ("top_p", ("rollout.val_temperature=1.0", "rollout.val_top_p=1e-6")),
                     ("top_k", ("rollout.val_temperature=1.0", "rollout.val_top_k=1")),
                     ("sampled", ("rollout.val_temperature=1.0",))):
        t = trainer(small_synth, tmp_path / name, "data.val_max_samples=6", "rollout.top_p=1e-6", *ov)
        t.validate()
        texts[name] = [r["response"] for r in _val_records(str(tmp_path / name))]
    assert texts["top_p"] == texts["greedy"] == texts["top_k"] != texts["sampled"]


def test_validation_averages_by_data_source_and_names_val_n(small_synth, tmp_path):
    """Two data sources (even / odd positions), scores by hand (position / 10), val_n=2, batches of 3: means of
    a = (0+0+2+2+4+4+6+6)/80 and b = (1+1+3+3+5+5+7+7)/80, named mean@2."""
    t = trainer(small_synth, tmp_path, "rollout.val_n=2", "data.val_batch_size=3")
    get = t.val_data.get_batch

    def two_sources(idx):
        items = get(idx)
        for i, it in zip(idx, items):
            it["data_source"], it["extra_info"] = "a" if i % 2 == 0 else "b", {"pos": i}
        return items
    t.val_data.get_batch = two_sources
    t.score = lambda b: (torch.tensor([e["pos"] / 10 for e in b.extra_info]), {}, 0, [""] * len(b), [None] * len(b))
    got = t.validate()
    assert {k for k in got if k.startswith("val-core")} == {
        f"val-core/{s}/reward/{m}" for s in "ab" for m in ("mean@2", "best@2/mean", "best@2/std")}
    assert got["val-core/a/reward/mean@2"] == pytest.approx(0.3) == got["val-core/a/reward/best@2/mean"]
    assert got["val-core/b/reward/mean@2"] == pytest.approx(0.4) == got["val-aux/b/reward/worst@2/mean"]
    assert got["val-aux/a/reward/std@2"] == 0 == got["val-core/b/reward/best@2/std"]  # a prompt's two score alike


def test_validation_reports_verls_best_worst_and_majority_metrics(small_synth, tmp_path):
    """A scorer giving acc and pred, val_n=4 sampled over the 8 test prompts in batches of 3 prompts: acc is the core
    variable and the reward aux, and every figure is rewards.validation_metrics' over the 32 samples that the
    generations file records (prompt-major: four consecutive samples a prompt), rebuilt from their responses."""
    t = trainer(small_synth, tmp_path, "rollout.val_n=4", "rollout.val_temperature=1.0", "data.val_batch_size=3")
    t.reward_fn = lambda data_source, solution_str, ground_truth, extra_info: {
        "score": float(len(solution_str) % 3), "acc": len(solution_str) % 3 == 0, "pred": solution_str[:1]}
    got = t.validate()
    recs = _val_records(str(tmp_path))
    assert len(recs) == 32 and [r["score"] for r in recs] == [len(r["response"]) % 3 for r in recs]
    want = rewards.validation_metrics(["synthetic/copy"] * 32, [i // 4 for i in range(32)],
                                      [{"reward": r["score"], "acc": float(r["score"] == 0)} for r in recs],
                                      [r["response"][:1] for r in recs])
    assert got == want
    src = "synthetic/copy"
    assert {f"val-core/{src}/acc/{m}" for m in ("mean@4", "best@4/mean", "best@4/std", "maj@4/mean", "maj@4/std")} \
        == {k for k in got if k.startswith("val-core/")}
    assert {f"val-aux/{src}/reward/mean@4", f"val-aux/{src}/acc/worst@2/mean", f"val-aux/{src}/reward/maj@2/mean"} \
        < set(got)


# ----------------------------------------------------------------------------- batch metrics


@pytest.mark.parametrize("epochs", [1, 2])
def test_batch_metrics_by_hand(small_synth, tmp_path, epochs):
    """Length statistics and clip ratio (responses that reached max_response_length = 4) from the batch, and the
    MFU from first principles: 6 FLOPs per weight and token for forward + backward (body weights on every token,
    the LM head on response tokens), causal attention QK^T and AV at 6 * heads * head_dim * len^2 per layer; every
    PPO epoch passes over the batch again, so the update's FLOPs are that times actor.ppo_epochs."""
    t = trainer(small_synth, tmp_path, "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
                f"actor.ppo_epochs={epochs}")
    got, batch = step_with_batch(t)
    rl = torch.tensor([len(r) for r in batch.responses], dtype=torch.float64)
    pl = torch.tensor([len(p) for p in batch.prompts], dtype=torch.float64)
    assert got["response_length/clip_ratio"] == pytest.approx(float((rl == 4).double().mean()))
    assert 0 < got["response_length/clip_ratio"] < 1
    for k, x in (("response_length", rl), ("prompt_length", pl), ("critic/score", batch.tensors["seq_reward"])):
        assert got[f"{k}/min"] == pytest.approx(float(x.min())) and got[f"{k}/max"] == pytest.approx(float(x.max()))
    assert got["response_length/min"] < got["response_length/max"]
    m = t.actor.model
    c = m.cfg
    body = sum(p.numel() for n, p in m.named_parameters() if n.startswith("layers.") and p.dim() == 2)
    head = c.vocab_size * c.hidden_size
    tokens, resp = float(rl.sum() + pl.sum()), float(rl.sum())
    attn = 6 * c.num_layers * c.num_heads * c.head_dim * float(((rl + pl) ** 2).sum())
    flops = (6 * body * tokens + 6 * head * resp + attn) * epochs
    want = flops / got["timing_s/update_actor"] / (t.cfg.trainer.peak_tflops * 1e12)
    assert got["perf/mfu/actor"] == pytest.approx(want, rel=1e-6)



def test_critic_value_metrics_and_prompt_clip_ratio(small_synth, tmp_path):
    """PPO (gae): critic/values/* over the response tokens, and verl's vf_explained_var = 1 - Var(returns - values) /
    (Var(returns) + 1e-5), from the batch's own values and returns; prompt_length/clip_ratio is the share of prompts
    at max_prompt_length (the synthetic prompts all have one length: 1 with the limit there, 0 above it)."""
    common = ("data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "algorithm.adv_estimator=gae", "rollout.n=1")
    t = trainer(small_synth, tmp_path / "a", *common)
    n = len(t.train_data[0]["prompt_ids"])
    got, batch = step_with_batch(t)
    mask = batch.response_mask.bool()
    values, returns = batch.tensors["values"][mask].double(), batch.tensors["returns"][mask].double()
    assert got["critic/values/mean"] == pytest.approx(float(values.mean()), rel=1e-5)
    assert got["critic/values/min"] == pytest.approx(float(values.min()), rel=1e-5)
    assert got["critic/values/max"] == pytest.approx(float(values.max()), rel=1e-5)
    var = lambda x: float(((x - x.mean()) ** 2).sum() / (len(x) - 1))  # noqa: E731 - unbiased, as torch.var
    assert got["critic/vf_explained_var"] == pytest.approx(1 - var(returns - values) / (var(returns) + 1e-5), abs=1e-6)
    assert got["prompt_length/clip_ratio"] == 0.0
    got, _ = step_with_batch(trainer(small_synth, tmp_path / "b", *common, f"data.max_prompt_length={n}"))
    assert got["prompt_length/clip_ratio"] == 1.0
    assert "critic/values/mean" not in step_with_batch(trainer(small_synth, tmp_path / "c", *common[:2]))[0]  # GRPO


# ----------------------------------------------------------------------------- checkpoints


def test_resume_by_path_from_the_newest_step(small_synth, tmp_path):
    """trainer.resume=PATH of the newest checkpoint in the run's own output_dir works; an older one, with a later
    one beside it, is refused, and so is another run's checkpoint into an output_dir holding checkpoints."""
    out = str(tmp_path / "run")
    t = trainer(small_synth, out, "trainer.keep_last_k=3")
    for s in (1, 2):
        t.step = s
        t.save_checkpoint()
    r = trainer(small_synth, out, f"trainer.resume={out}/checkpoints/step_2")
    r.maybe_resume()
    assert r.step == 2
    r = trainer(small_synth, out, f"trainer.resume={out}/checkpoints/step_1")
    with pytest.raises(ValueError, match=r"already holds steps \[2\] past it"):
        r.maybe_resume()
    # another run's checkpoint into this output_dir: its steps 1-2 would sit beside the other run's
    other = str(tmp_path / "other")
    o = trainer(small_synth, other, "trainer.keep_last_k=3")
    o.step = 1
    o.save_checkpoint()
    r = trainer(small_synth, out, f"trainer.resume={other}/checkpoints/step_1")
    with pytest.raises(ValueError, match=r"already holds steps \[1, 2\] of another run"):
        r.maybe_resume()


def test_redone_step_replaces_its_published_checkpoint(small_synth, tmp_path):
    """A crash after step_2 was published but before `latest` named it: auto-resume from step 1, and the redone save
    of step 2 replaces the old step_2 and publishes it."""
    out = str(tmp_path / "run")
    t = trainer(small_synth, out, "trainer.keep_last_k=3")
    for s in (1, 2):
        t.step = s
        t.save_checkpoint()
    ckpts = os.path.join(out, "checkpoints")
    with open(os.path.join(ckpts, "latest"), "w") as f:
        f.write("1")
    r = trainer(small_synth, out, "trainer.keep_last_k=3", "trainer.resume=auto")
    r.maybe_resume()
    assert r.step == 1
    r.step = 2
    r.save_checkpoint()
    assert open(os.path.join(ckpts, "latest")).read() == "2"
    assert sorted(os.listdir(ckpts)) == ["latest", "step_1", "step_2"]


def test_auto_resume_without_latest_takes_the_newest_checkpoint(small_synth, tmp_path):
    """`latest` lost (deleted, or only the step_N directories copied): auto-resume continues from the newest step_N,
    which is complete once published, instead of silently starting over and overwriting the run; `never` refuses."""
    out = str(tmp_path / "run")
    t = trainer(small_synth, out, "trainer.keep_last_k=3")
    for s in (1, 2):
        t.step = s
        t.save_checkpoint()
    os.remove(os.path.join(out, "checkpoints", "latest"))
    r = trainer(small_synth, out, "trainer.resume=auto")
    r.maybe_resume()
    assert r.step == 2
    with pytest.raises(ValueError, match=r"holds checkpoints of another run \(steps \[1, 2\]\)"):
        trainer(small_synth, out, "trainer.resume=never").maybe_resume()
    with pytest.raises(FileNotFoundError, match="'disable' is not a checkpoint directory .no meta.json.; expected au"):
        trainer(small_synth, out, "trainer.resume=disable").maybe_resume()  # (verl's resume_mode value)


def test_checkpoint_holds_the_tokenizer(small_synth, tmp_path):
    """A checkpoint carries the model's tokenizer files (reshard.py CKPT --to-hf copies them from there)."""
    out = str(tmp_path / "run")
    t = trainer(small_synth, out)
    t.step = 1
    t.save_checkpoint()
    ck, model_dir = os.path.join(out, "checkpoints", "step_1"), f"{small_synth}/model"
    want = {f for f in os.listdir(model_dir) if f.startswith("tokenizer")}
    assert want and want <= set(os.listdir(ck))
    a, b = load_tokenizer(ck), load_tokenizer(model_dir)
    assert a.get_vocab() == b.get_vocab() and a("1 2 3")["input_ids"] == b("1 2 3")["input_ids"]


# ----------------------------------------------------------------------------- fit

SMALL = ("data.train_batch_size=8", "actor.ppo_mini_batch_size=8")


def test_last_step_validates_and_saves(small_synth, tmp_path):
    """total_steps=3, test_freq=save_freq=2: validation and a checkpoint at step 2 and at the last step, 3."""
    out = str(tmp_path)
    rows = run(small_synth, str(out), "trainer.total_steps=3", "trainer.test_freq=2", "trainer.save_freq=2",
               "trainer.keep_last_k=3", "data.val_max_samples=4", *SMALL)
    key = "val-core/synthetic/copy/reward/mean@1"
    assert [key in r for r in rows] == [False, True, True]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step_2", "step_3"]


def test_val_only_validates_a_checkpoint_and_trains_nothing(small_synth, tmp_path):
    """trainer.val_only with trainer.resume=PATH into a new output_dir: one metrics line, at the checkpoint's step, the
    validation of the checkpoint's weights (greedy: the training run's own figure at that step), no training step,
    no checkpoint; the training run's directory is left as it was."""
    train_out, eval_out = str(tmp_path / "train"), str(tmp_path / "eval")
    common = ("data.val_max_samples=4", *SMALL)
    rows = run(small_synth, train_out, "trainer.total_steps=2", "trainer.save_freq=2", "trainer.test_freq=2", *common)
    before = sorted(os.listdir(train_out))
    got = run(small_synth, eval_out, "trainer.val_only=true", f"trainer.resume={train_out}/checkpoints/step_2", *common)
    key = "val-core/synthetic/copy/reward/mean@1"
    assert [r["step"] for r in got] == [2] and got[0][key] == rows[-1][key]
    assert not any(k.startswith(("actor/", "timing_s/")) for k in got[0])
    assert "checkpoints" not in os.listdir(eval_out) and sorted(os.listdir(train_out)) == before


def test_val_before_train_only_on_a_fresh_run(small_synth, tmp_path):
    """trainer.val_before_train validates at step 0 of a fresh run, not again when a run resumes."""
    out = str(tmp_path)
    common = ("trainer.test_freq=-1", "trainer.save_freq=1", "trainer.val_before_train=true",
              "trainer.resume=auto", "data.val_max_samples=4", *SMALL)
    run(small_synth, str(out), "trainer.total_steps=1", *common)
    rows = run(small_synth, str(out), "trainer.total_steps=2", *common)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [any(k.startswith("val-core") for k in r) for r in rows] == [True, False, False]
