"""reshard.py: the grouping rule, train <-> generation resharding against one process, checkpoints, export."""
import json
import math
import os
import shutil
import signal
import time

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.multiprocessing.reductions import StorageWeakRef

import helpers
import reshard
from model import load_model
from parallel import Layout, ShardedAdamW, all_gather_stack, make_layout, stage_layers, vocab_parallel_logprobs
from reshard import Resharder, collect_results, dispatch_prompts, generation_groups

# ----------------------------------------------------------------------------- the grouping (no processes)


def test_groups_design_example():
    micro, gen = generation_groups(8, 4, 1, 2)
    assert micro == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert gen == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_groups_worked_by_hand():
    # tp=2 pp=2 dp=2 -> tp_g=1: a replica's four ranks gather everything; every rank is a replica
    assert generation_groups(8, 2, 2, 1) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[r] for r in range(8)])
    # -> tp_g=2: the stages of one TP slice gather each other's layers; generation TP = training TP
    assert generation_groups(8, 2, 2, 2) == ([[0, 2], [1, 3], [4, 6], [5, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]])
    # tp=1 dp=4 -> tp_g=2: replica d keeps slice d % 2 of everything, no communication
    assert generation_groups(4, 1, 1, 2) == ([[0], [1], [2], [3]], [[0, 1], [2, 3]])
    # pp=2 dp=2 -> tp_g=2: each rank narrows its stage and gathers the other stage's half from its PP peer
    assert generation_groups(4, 1, 2, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    # tp=2 dp=2 -> tp_g=4: rank (d, t) keeps half d of slice t, generation slice 2t + d: group ranks in slice order
    assert generation_groups(4, 2, 1, 4) == ([[0], [1], [2], [3]], [[0, 2, 1, 3]])
    # tp=2 pp=2 dp=2 -> tp_g=4: the same over two replicas' stage-0 and stage-1 ranks, gathering the other stage
    assert generation_groups(8, 2, 2, 4) == ([[0, 2], [1, 3], [4, 6], [5, 7]], [[0, 4, 1, 5], [2, 6, 3, 7]])


def _holds(tp, parts, pp, p, t, F):
    """Fine slices (stage, i) of F per stage held by TP rank t of `parts` slices in stage p (all stages if p None)."""
    stages = range(pp) if p is None else [p]
    return {(s, i) for s in stages for i in range(t * F // parts, (t + 1) * F // parts)}


@pytest.mark.parametrize("world", [4, 8, 16])
def test_groups_satisfy_the_rule(world):
    for tp in [d for d in range(1, world + 1) if world % d == 0]:
        for pp in [d for d in range(1, world // tp + 1) if world // tp % d == 0]:
            for tp_g in reshard.valid_generation_tp(world, tp, pp):
                micro, gen = generation_groups(world, tp, pp, tp_g)
                assert sorted(r for g in micro for r in g) == list(range(world))
                assert sorted(r for g in gen for r in g) == list(range(world))
                assert all(len(g) == tp_g for g in gen) and len(gen) == world // tp_g
                F = max(tp, tp_g)
                gen_of = {r: _holds(tp_g, tp_g, pp, None, g.index(r), F) for g in gen for r in g}
                train_of = {r: _holds(tp, tp, pp, r // tp % pp, r % tp, F) for r in range(world)}
                for g in micro:
                    assert len({r // (tp * pp) for r in g}) == 1  # inside one training replica
                    assert all(gen_of[r] == gen_of[g[0]] for r in g)  # jointly hold one generation shard
                    union = set().union(*(train_of[r] for r in g))
                    if tp_g <= tp:
                        assert len(g) == tp * pp // tp_g and union == gen_of[g[0]]
                        assert all(train_of[r] <= gen_of[r] for r in g)  # the training shard is part of it
                    else:  # one TP slice t of replica d, all stages, each keeping part d % n of slice t
                        d, t, n = g[0] // (tp * pp), g[0] % tp, tp_g // tp
                        assert g == [d * tp * pp + s * tp + t for s in range(pp)]
                        assert gen_of[g[0]] == {(s, t * n + d % n) for s in range(pp)}
                        assert all({x for x in gen_of[r] if x[0] == r // tp % pp} <= train_of[r] for r in g)


def test_groups_errors():
    with pytest.raises(ValueError, match=r"parallel\.rollout\.tp=3 .* valid: \[1, 2, 4\]"):
        generation_groups(4, 2, 1, 3)
    with pytest.raises(ValueError, match=r"divisor of dp=2; valid: \[1, 2\]"):
        generation_groups(4, 1, 2, 4)
    with pytest.raises(ValueError, match=r"tp times a divisor of dp=2; valid: \[1, 2, 4\]"):
        generation_groups(8, 2, 2, 8)


def test_dispatch_shares_are_contiguous_and_balanced():
    prompts = list(range(10))
    for R in (1, 3, 4, 12):
        shares = [dispatch_prompts(prompts, Layout(dp=R, dp_rank=r)) for r in range(R)]
        assert [x for s, _ in shares for x in s] == prompts
        assert [off for _, off in shares] == [sum(len(s) for s, _ in shares[:r]) for r in range(R)]
        assert max(len(s) for s, _ in shares) - min(len(s) for s, _ in shares) <= 1


# ----------------------------------------------------------------------------- helpers of the distributed bodies


def packed(seqs):
    lens = [len(s) for s in seqs]
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
    return torch.cat(seqs), torch.cat([torch.arange(n) for n in lens]), cu, max(lens)


def greedy_reference(model, prompts, new):
    """Greedy decoding by re-running the whole sequence each step (one process, no cache)."""
    out = []
    for p in prompts:
        seq = list(p)
        with torch.no_grad():
            for _ in range(new):
                seq.append(int(model.logits(model.packed(*packed([torch.tensor(seq)])))[-1].argmax()))
        out.append(seq[len(p):])
    return out


def generate(gm, prompts, new):
    try:
        from rollout import Generator, SamplingParams
    except ImportError:  # fallback: a greedy loop over the vocab-parallel logits
        return [[_greedy_tp(gm, p, new)] for p in prompts], "loop"
    gen = Generator(gm, max_rows=4, max_len=32)
    try:
        return gen.generate(prompts, SamplingParams(temperature=0, max_new_tokens=new)), "rollout"
    finally:
        gen.free()


def _greedy_tp(gm, p, new):
    seq = list(p)
    with torch.no_grad():
        for _ in range(new):
            seq.append(int(all_gather_last_dim(gm.logits(gm.packed(*packed([torch.tensor(seq)]))),
                                               gm.layout.tp_group)[-1].argmax()))
    return seq[len(p):]


def shards(name, tp, kv_heads):
    """How many distinct TP shards tensor `name` has: tp, or the KV head count when that is smaller (replicated)."""
    return min(tp, kv_heads) if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")) else tp


def slice_full(full, names, dim, tp, r, kv_heads):
    """This TP rank's shard, sliced by hand: slice r of tp of every fused piece, concatenated; of a piece with c < tp
    shards (KV heads), slice r * c // tp of c, which tp / c neighbouring ranks share."""
    if dim is None:
        return full[names[0]]
    return torch.cat([full[n].chunk(c := shards(n, tp, kv_heads), dim)[r * c // tp] for n in names], dim)


def held_bytes(*models):
    """Bytes of the distinct storages the models' parameters live in."""
    st = {}
    for m in models:
        for p in m.parameters():
            s = p.untyped_storage()
            st[s.data_ptr()] = s.nbytes()
    return sum(st.values())


class CountingOptimizer:
    def __init__(self):
        self.calls = []

    def offload(self):
        self.calls.append("offload")

    def reload(self):
        self.calls.append("reload")


# ----------------------------------------------------------------------------- the distributed body


def _body(rank, world, ckpt, tp, pp, tp_gs, seqs, prompts, new, work):
    lay = make_layout(tp, pp)
    model = load_model(ckpt, lay)
    full = load_file(os.path.join(ckpt, "model.safetensors"))
    out, kv = {}, model.cfg.num_kv_heads
    for tp_g in tp_gs:
        opt = CountingOptimizer() if tp_g == tp_gs[0] else ShardedAdamW(model, lay)
        opt_before = None if isinstance(opt, CountingOptimizer) else [t.clone() for t in opt._state()]
        r = Resharder(model, lay, tp_g, offload_optimizers=[opt], seed=7, bucket_bytes=48 << 10)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
        torch.manual_seed(100 + rank)
        train_rng = torch.get_rng_state()
        held0 = held_bytes(model)
        res = {}
        for round_ in range(2):
            with r.generation() as gm:
                gl = r.gen_layout
                held = held_bytes(model, gm)
                if not isinstance(opt, CountingOptimizer):  # offloaded: no storage left where it lived
                    assert all(t.untyped_storage().nbytes() == 0 for t in (*opt._state(), opt.grad_buffer))
                assert (gm is model) == (tp_g == tp and pp == 1)
                for name, p in gm.named_parameters():  # the generation shard, exactly
                    assert torch.equal(p, slice_full(full, gm.hf_names(name), p.tp_dim, tp_g, gl.tp_rank, kv)), name
                draw = torch.rand(4)
                if round_ == 0:
                    with torch.no_grad():
                        part = gm.logits(gm.packed(*packed(seqs)))
                        logits = all_gather_last_dim(part, gl.tp_group)
                        # the vocabulary-parallel log-prob finds each rank's slice in any group (tp_g = 4 from tp = 2:
                        # the group's ranks are not ascending)
                        tgt = torch.cat(seqs).roll(-1)
                        lp = vocab_parallel_logprobs(part, tgt, gl.tp_group)[0]
                        assert torch.allclose(lp, logits.log_softmax(-1).gather(1, tgt[:, None])[:, 0], atol=1e-5)
                    mine, off = dispatch_prompts(prompts, gl)
                    done, how = generate(gm, mine, new)
                    comps = collect_results(done, off, gl)
                    res.update(logits=logits if rank == 0 else None, how=how, held=held,
                               tokens=[c.token_ids if hasattr(c, "token_ids") else c for c in comps],
                               order=[(c.prompt_index, c.sample_index) for c in comps if hasattr(c, "prompt_index")])
            res[f"draw{round_}"] = draw
            # back in training: the shards bit for bit, at their (possibly new) storage; the training RNG
            for n, p in model.named_parameters():
                assert torch.equal(p, before[n]) and p.is_contiguous(), n
            assert torch.equal(torch.get_rng_state(), train_rng)
        if isinstance(opt, CountingOptimizer):
            assert opt.calls == ["offload", "reload"] * 2
        else:
            opt.zero_grad()  # the state's copies back wait for the optimizer's next use
            assert all(torch.equal(a, b) for a, b in zip(opt._state(), opt_before))
            assert opt.grad_buffer.abs().max() == 0
        res.update(stats=dict(r.stats), held0=held0, gen_ranks=r.gen_layout.tp_ranks,
                   unmoved=sum(p.data_ptr() == ptrs[n] for n, p in model.named_parameters()),
                   train_bytes=sum(p.numel() * 4 for n, p in model.named_parameters()
                                   if not (n.startswith("lm_head") and pp > 1 and model.cfg.tie_word_embeddings)))
        out[tp_g] = res
    if (tp, pp) in ((2, 1), (4, 1)):
        _checkpoint_into_other_layout(rank, model, lay, ckpt, full, work, out)
    if (tp, pp) == (2, 2):
        _export_from_tp2_pp2(rank, model, lay, ckpt, seqs, work, out)
    return out


def _write_meta(lay, model, ck, ckpt):
    if lay.rank == 0:
        json.dump({"step": 3, "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "model_config": model.cfg.raw},
                  open(os.path.join(ck, "meta.json"), "w"))
        for f in os.listdir(ckpt):
            if f.startswith(("tokenizer", "chat_template")):
                shutil.copy(os.path.join(ckpt, f), ck)
    dist.barrier()


def _checkpoint_into_other_layout(rank, model, lay, ckpt, full, work, out):
    ck = os.path.join(work, f"ck_tp{lay.tp}")
    os.makedirs(ck, exist_ok=True)
    reshard.save_model_shard(model, lay, ck)
    _write_meta(lay, model, ck, ckpt)
    lay2 = make_layout(1, 2)  # pp=2, dp=2 over the same ranks
    m2 = load_model(ckpt, lay2, random_init=True, seed=9)
    assert not torch.equal(m2.layers[0].mlp.down_proj.weight, slice_full(
        full, m2.hf_names("layers.0.mlp.down_proj.weight"), 1, 1, 0, 1))
    reshard.load_into(m2, ck)
    for name, p in m2.named_parameters():
        assert torch.equal(p, slice_full(full, m2.hf_names(name), p.tp_dim, lay2.tp, lay2.tp_rank, 1)), name
    out["ck"] = ck


def _export_from_tp2_pp2(rank, model, lay, ckpt, seqs, work, out):
    """New weights (so that the export is not the input checkpoint), the training layout's own logits,
    then a checkpoint of this layout."""
    model.init_random(5, std=0.08)
    x = packed(seqs)
    with torch.no_grad():
        if lay.is_first_stage:
            dist.send(model.packed(*x).contiguous(), rank + lay.tp)
        else:
            h = torch.empty(len(x[0]), model.cfg.hidden_size)
            dist.recv(h, rank - lay.tp)
            out["train_logits"] = all_gather_last_dim(model.logits(model.packed(h, *x[1:])), lay.tp_group)
    ck = os.path.join(work, "ck_tp2_pp2")
    os.makedirs(ck, exist_ok=True)
    reshard.save_model_shard(model, lay, ck)
    _write_meta(lay, model, ck, ckpt)
    out["ck_tp2_pp2"] = ck


# ----------------------------------------------------------------------------- the distributed test

HEADS8 = dict(num_attention_heads=8, num_key_value_heads=4)
CASES = {  # training (tp, pp) on 4 ranks (or WORLD's): family, config overrides, generation tp sizes
    "tp2_dp2": (2, 1, "qwen2", HEADS8, (1, 2, 4)),  # tp_g = 4: generation TP ranks not ascending
    "dp4": (1, 1, "mistral", {}, (2, 4)),  # 2 KV heads: tp_g = 4 replicates them
    "tp4_kv2": (4, 1, "qwen2", {}, (1, 2, 4)),  # 2 KV heads replicated in training, merged to one copy
    "tp4_kv1": (4, 1, "qwen3", {"num_key_value_heads": 1}, (2,)),  # replicated in both layouts
    "pp2_dp2": (1, 2, "qwen3", {}, (1, 2)),
    "tp2_pp2": (2, 2, "qwen2_tied", {"intermediate_size": 16}, (1, 2)),  # head = 1.13 layers: stages of 3 + 1
    "tp4": (4, 1, "llama", HEADS8, (1, 2, 4)),
    "pp4_tied": (1, 4, "qwen2_tied", {"num_hidden_layers": 5}, (1,)),  # middle stages hold no embedding or head
    # on 8 ranks: narrowing (tp_g > tp) and gathering the other stage at once; 2 KV heads replicated on 4 ranks
    "tp2_pp2_dp2": (2, 2, "qwen2", {"intermediate_size": 16}, (4,)),
}
WORLD = {"tp2_pp2_dp2": 8}


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("case", list(CASES))
def test_reshard_layouts(case, tmp_path):
    tp, pp, family, over, tp_gs = CASES[case]
    ckpt = helpers.make_checkpoint(str(tmp_path / "hf"), family, **over)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in (7, 12, 5)]
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (4, 9, 6)]
    ref = load_model(ckpt)
    with torch.no_grad():
        want = ref.logits(ref.packed(*packed(seqs)))
    want_tokens = greedy_reference(ref, prompts, 6)
    world = WORLD.get(case, 4)
    res = helpers.run_distributed(_body, world, ckpt, tp, pp, tp_gs, seqs, prompts, 6, str(tmp_path))
    full = load_file(os.path.join(ckpt, "model.safetensors"))
    for tp_g in tp_gs:
        per = [r[tp_g] for r in res]
        assert rel_err(per[0]["logits"], want) <= 1e-5, tp_g
        for r in per:  # every rank has every replica's completions, in prompt order
            assert r["tokens"] == want_tokens, (tp_g, r["how"])
            assert r["how"] != "rollout" or r["order"] == [(i, 0) for i in range(len(prompts))]
        groups = {tuple(r["gen_ranks"]) for r in per}
        assert len(groups) == world // tp_g
        for grp in groups:  # one generation RNG stream per generation TP group, carried over between rounds
            assert all(torch.equal(per[q]["draw0"], per[grp[0]]["draw0"]) for q in grp)
            assert all(torch.equal(per[q]["draw1"], per[grp[0]]["draw1"]) for q in grp)
            assert not torch.equal(per[grp[0]]["draw0"], per[grp[0]]["draw1"])
        if len(groups) > 1:
            assert len({tuple(per[grp[0]]["draw0"].tolist()) for grp in groups}) == len(groups)
        # memory: the generation shard computed from the checkpoint, the released training shard measured
        def shard_bytes(names):  # of the generation shards of these tensors
            kv = ref.cfg.num_kv_heads
            return sum(full[n].numel() * 4 // (1 if "norm" in n else shards(n, tp_g, kv)) for n in names)

        gen_bytes = shard_bytes(n for n in full if not (n == "lm_head.weight" and "tied" in family))
        uneven = pp * max(b - a for a, b in (stage_layers(ref.cfg.num_layers, pp, p, ref.cfg.head_cost)
                                             for p in range(pp))) - ref.cfg.num_layers
        assert (uneven > 0) == (case.startswith("tp2_pp2") or case == "pp4_tied")  # stages of different lengths
        for r in per:
            s, extra = r["stats"], r["held"] - r["held0"]
            if tp_g == tp and pp == 1:
                assert extra == 0 and s["peak_extra_bytes"] == 0 and r["unmoved"] > 0
                continue
            assert s["gen_bytes"] == gen_bytes
            assert s["recv_bytes"] == 0 if tp_g > tp and pp == 1 else s["recv_bytes"] > 0  # (narrowing: no messages)
            assert extra == s["steady_extra_bytes"]  # the accounting agrees with the storages held
            # padding under 1/8 (stages of very different sizes broadcast their parts); with k > 1 the gathered
            # copies of replicated tensors (norms, KV heads) are held until the merge
            assert s["pad_bytes"] <= (0.125 if tp % tp_g or tp == tp_g else 0.25) * gen_bytes, s
            if tp_g <= tp:  # the rank holds its generation shard (+ padding) and nothing more
                assert s["released_bytes"] == r["train_bytes"]
                assert r["held"] <= gen_bytes + s["pad_bytes"] + r["held0"] - r["train_bytes"]
                assert s["peak_extra_bytes"] <= gen_bytes - r["train_bytes"] + s["pad_bytes"] + s["max_bucket_bytes"]
                assert s["buckets"] > 1
            else:
                assert s["peak_extra_bytes"] <= gen_bytes + s["pad_bytes"]
    if case in ("tp2_dp2", "tp4_kv2"):
        assert load_full_state_equal(res[0]["ck"], full)
    if case == "tp2_pp2":
        _check_export(res, str(tmp_path))


def all_gather_last_dim(x, group):
    """Every TP rank's x concatenated along the last dim (the full logits)."""
    return x if group is None else torch.cat(all_gather_stack(x, group).unbind(0), dim=-1)


def load_full_state(ckpt_dir):
    """Every full tensor of a sharded checkpoint under its HF name."""
    ck = reshard._Checkpoint(ckpt_dir)
    return {hf: ck.tensor(hf) for hf in ck.index}


def load_full_state_equal(ck, full):
    got = load_full_state(ck)
    return set(got) == set(full) and all(torch.equal(got[n], full[n]) for n in full)


def _check_export(res, work):
    ck = res[0]["ck_tp2_pp2"]
    train_logits = next(r["train_logits"] for r in res if "train_logits" in r)
    out = os.path.join(work, "exported")
    reshard.main([ck, "--to-hf", out, "--dtype", "fp32", "--max-shard-gb", str(40e3 / 2 ** 30)])
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert "lm_head.weight" not in index["weight_map"]  # tied: the head is the embedding
    assert len(set(index["weight_map"].values())) > 1  # several shards
    assert json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == "float32"
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    # the weights, exported and checkpointed, get the mode of any new file (safetensors writes them owner-only)
    files = [os.path.join(d, f) for d in (out, ck) for f in os.listdir(d) if os.path.isfile(os.path.join(d, f))]
    assert {os.stat(f).st_mode & 0o777 for f in files} == {os.stat(os.path.join(out, "config.json")).st_mode & 0o777}
    hf = helpers.hf_model(out)
    seqs_logits = []
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in (7, 12, 5)]
    with torch.no_grad():
        for s in seqs:
            seqs_logits.append(hf(s[None]).logits[0])
    assert rel_err(train_logits, torch.cat(seqs_logits)) <= 1e-5
    with pytest.raises(FileExistsError, match="already exists"):
        reshard.main([ck, "--to-hf", out])
    bf = os.path.join(work, "exported_bf16")
    reshard.main([ck, "--to-hf", bf, "--dtype", "bf16"])
    assert json.load(open(os.path.join(bf, "config.json")))["torch_dtype"] == "bfloat16"

    def weight_bytes(d):
        return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))
    assert math.isclose(weight_bytes(bf), weight_bytes(out) / 2, rel_tol=0.05)


def _failure_body(rank, world, ckpt):
    lay = make_layout(2, 1)
    model, opt = load_model(ckpt, lay), CountingOptimizer()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    storages = {n: StorageWeakRef(p.untyped_storage()) for n, p in model.named_parameters()}
    r = Resharder(model, lay, 1, offload_optimizers=[opt], bucket_bytes=48 << 10)
    gather, merge, buckets, alive = reshard._all_gather_flat, reshard._merge, [], []

    def spying_gather(*a, **kw):  # no released training tensor is still alive when its bucket arrives
        buckets.append(len(buckets))
        alive.extend(n for n, p in model.named_parameters() if p.numel() == 0 and not storages[n].expired())
        return gather(*a, **kw)

    def merge_failing_in_bucket_1(*a):  # bucket 0 done (rebuilt from the generation weights), bucket 1 half merged
        if len(buckets) == 2 and fail:
            raise torch.OutOfMemoryError("simulated OOM in the merge")
        return merge(*a)
    reshard._all_gather_flat, reshard._merge, fail = spying_gather, merge_failing_in_bucket_1, False
    with r.generation() as gm:
        gen_weights = {n: p.clone() for n, p in gm.named_parameters()}
    assert not alive and len(buckets) > 2
    torch.manual_seed(3)
    train_rng, buckets[:], fail = torch.get_rng_state(), [], True
    with pytest.raises(torch.OutOfMemoryError, match="simulated OOM"):  # the original error, not one of the cleanup
        with r.generation():
            pass
    fail = False
    with pytest.raises(KeyError, match="in the block"):
        with r.generation():
            raise KeyError("in the block")
    for n, p in model.named_parameters():  # the training state after each failure, bit for bit
        assert p.shape == before[n].shape and torch.equal(p, before[n]), n
    assert torch.equal(torch.get_rng_state(), train_rng) and opt.calls == ["offload", "reload"] * 3
    with r.generation() as gm:  # and the resharder still works
        assert all(torch.equal(p, gen_weights[n]) for n, p in gm.named_parameters())


def test_failure_restores_the_training_state_and_raises_the_original_error(tmp_path):
    helpers.run_distributed(_failure_body, 2, helpers.make_checkpoint(str(tmp_path), "qwen2", with_tokenizer=False))


def test_a_failed_offload_brings_back_the_optimizers_offloaded_before_it(tmp_path):
    """The second optimizer's offload fails as generation begins: the first one, offloaded already, is reloaded (it
    used to stay on the host with empty device storage, and the next zero_grad crashed the process), the training
    RNG stream is untouched, and the offload's own error is the one raised."""
    class FailingOffload:
        def offload(self):
            raise MemoryError("pinned host memory (simulated)")

        def reload(self):
            raise AssertionError("never offloaded: not to be reloaded")
    model = load_model(helpers.make_checkpoint(str(tmp_path), "llama", with_tokenizer=False))
    opt = ShardedAdamW(model, Layout())
    before = [t.clone() for t in opt._state()]
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    with pytest.raises(MemoryError, match="simulated"):
        with Resharder(model, Layout(), 1, offload_optimizers=[opt, FailingOffload()]).generation():
            pass
    opt.zero_grad()  # (reload()'s copies back are made here)
    assert all(torch.equal(a, b) for a, b in zip(opt._state(), before)) and torch.equal(torch.get_rng_state(), rng)


def test_a_critic_is_refused_in_every_layout(tmp_path):
    """Resharding is the actor's: a model without an LM head is refused even where nothing moves (tp_g == tp, pp 1),
    not later by the Generator with a message about pp."""
    critic = load_model(helpers.make_checkpoint(str(tmp_path), "llama", with_tokenizer=False), value_head=True,
                        lm_head=False)
    with pytest.raises(ValueError, match="no LM head"):
        Resharder(critic, Layout(), 1)


def test_load_into_errors(tmp_path):
    ckpt = helpers.make_checkpoint(str(tmp_path / "hf"), "llama", with_tokenizer=False)
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        reshard.load_into(load_model(ckpt), ckpt)
    ck = tmp_path / "ck"
    ck.mkdir()
    m = load_model(ckpt)
    reshard.save_model_shard(m, Layout(), str(ck))
    json.dump({"step": 0, "tp": 1, "pp": 1, "dp": 1, "model_config": {**m.cfg.raw, "intermediate_size": 128}},
              open(ck / "meta.json", "w"))
    # meta.json says intermediate_size 128: the shard's fused gate_up (2 x 112 rows) disagrees with it
    with pytest.raises(ValueError, match=r"model_pp0_tp0\.safetensors: tensor 'layers\.0\.mlp\.gate_up_proj\.weight' "
                                         r"has shape \[224, 64\], expected \[256, 64\]"):
        reshard.load_into(m, str(ck))
    # a key that changes no shape (rms_norm_eps): the same tensors would load into another model
    json.dump({"step": 0, "tp": 1, "pp": 1, "dp": 1, "model_config": {**m.cfg.raw, "rms_norm_eps": 0.125}},
              open(ck / "meta.json", "w"))
    with pytest.raises(ValueError, match=r"is a different model: rms_norm_eps=0\.125"):
        reshard.load_into(m, str(ck))
    json.dump({"step": 0, "tp": 2, "pp": 1, "dp": 1, "model_config": m.cfg.raw}, open(ck / "meta.json", "w"))
    with pytest.raises(FileNotFoundError, match="lacks .*model_pp0_tp1.safetensors"):
        load_full_state(str(ck))
    json.dump({"step": 0, "pp": 1, "model_config": m.cfg.raw}, open(ck / "meta.json", "w"))
    with pytest.raises(ValueError, match=r"ck/meta\.json: missing \['tp'\]"):
        load_full_state(str(ck))


def test_export_errors_and_its_temporary_directory(tmp_path, capsys, monkeypatch):
    path = helpers.make_checkpoint(str(tmp_path / "hf"), "llama", with_tokenizer=False)
    for name, critic in (("actor", False), ("critic", True)):
        m = load_model(path, value_head=critic, lm_head=not critic)
        os.makedirs(ck := str(tmp_path / name))
        reshard.save_model_shard(m, Layout(), ck)
        json.dump({"step": 1, "tp": 1, "pp": 1, "dp": 1, "model_config": m.cfg.raw}, open(ck + "/meta.json", "w"))
    with pytest.raises(ValueError, match="critic.*is a critic .*value head, no LM head"):
        reshard.main([str(tmp_path / "critic"), "--to-hf", str(tmp_path / "out_critic")])
    for gb in ("0", "-1", "inf", "nan"):  # (inf: a bare OverflowError before)
        with pytest.raises(SystemExit):
            reshard.main([str(tmp_path / "actor"), "--to-hf", str(tmp_path / "out"), "--max-shard-gb", gb])
        assert f"--max-shard-gb {float(gb)}: expected a shard size in GB > 0" in capsys.readouterr().err
    os.makedirs(tmp_path / "out.tmp")  # the user's, not ours
    (tmp_path / "out.tmp" / "mine.txt").write_text("keep")
    reshard.main([str(tmp_path / "actor"), "--to-hf", str(tmp_path / "out")])
    assert (tmp_path / "out.tmp" / "mine.txt").read_text() == "keep"
    assert sorted(os.listdir(tmp_path)) == ["actor", "critic", "hf", "out", "out.tmp"]
    got = load_file(str(tmp_path / "out" / "model-00001-of-00001.safetensors"))
    want = load_file(os.path.join(path, "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    # a dangling symlink is there too; a directory that appears while the export runs (another export of the same
    # name finishing first; empty, which a rename would silently replace) is refused and left as it is, with no
    # temporary directory behind
    os.symlink(str(tmp_path / "nowhere"), str(tmp_path / "link"))
    save = reshard._save_file
    monkeypatch.setattr(reshard, "_save_file", lambda *a: os.makedirs(tmp_path / "late", exist_ok=True) or save(*a))
    for name in ("link", "late"):
        with pytest.raises(FileExistsError, match=f"'.*{name}' already exists"):
            reshard.main([str(tmp_path / "actor"), "--to-hf", str(tmp_path / name)])
    assert sorted(os.listdir(tmp_path)) == ["actor", "critic", "hf", "late", "link", "out", "out.tmp"]
    assert os.listdir(tmp_path / "late") == [] and os.path.islink(tmp_path / "link")
    # a SIGTERM (a scheduler's) mid-export unwinds: no temporary directory is left, and the handler is put back
    monkeypatch.setattr(reshard, "_save_file", lambda *a: os.kill(os.getpid(), signal.SIGTERM) or save(*a))
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        reshard.main([str(tmp_path / "actor"), "--to-hf", str(tmp_path / "killed")])
    assert e.value.code == 128 + signal.SIGTERM and signal.getsignal(signal.SIGTERM) == handler
    assert sorted(os.listdir(tmp_path)) == ["actor", "critic", "hf", "late", "link", "out", "out.tmp"]


def test_fp32_export_takes_the_master_weights(tmp_path):
    """--dtype fp32 exports Adam's fp32 master weights where the checkpoint has them (after bf16 training they are
    not the bf16 weights upcast); bf16 and the default take the weights as stored."""
    path = helpers.make_checkpoint(str(tmp_path / "hf"), "llama", with_tokenizer=False)
    m = load_model(path)
    os.makedirs(ck := str(tmp_path / "ck"))
    reshard.save_model_shard(m, Layout(), ck)
    master = {n: p.detach() + 0.25 for n, p in m.named_parameters()}
    reshard.save_model_shard(m, Layout(), ck, master, prefix="master")
    json.dump({"step": 1, "tp": 1, "pp": 1, "dp": 1, "model_config": m.cfg.raw}, open(ck + "/meta.json", "w"))
    want = load_file(os.path.join(path, "model.safetensors"))
    for name, shift in (("fp32", 0.25), ("stored", 0.0), ("bf16", 0.0)):
        reshard.main([ck, "--to-hf", str(tmp_path / name), *([] if name == "stored" else ["--dtype", name])])
        got = load_file(str(tmp_path / name / "model-00001-of-00001.safetensors"))
        assert set(got) == set(want)
        assert all(torch.equal(got[n], (want[n] + shift).to(got[n].dtype)) for n in want), name


def test_only_the_named_dp_rank_writes_a_shard(tmp_path):
    """save_model_shard is called on every DP rank; only `writer` may write (two ranks writing the same file through
    the same .tmp name would race)."""
    m = load_model(helpers.make_checkpoint(str(tmp_path / "hf"), "llama", with_tokenizer=False))
    for r in (0, 1):
        os.makedirs(d := str(tmp_path / f"rank{r}"))
        reshard.save_model_shard(m, Layout(dp=2, dp_rank=r), d, writer=1)
    assert os.listdir(tmp_path / "rank0") == []
    assert os.listdir(tmp_path / "rank1") == ["model_pp0_tp0.safetensors"]


# ----------------------------------------------------------------------------- resharder timing


def test_reshard_timing_counts_entry_and_exit(tmp_path, monkeypatch):
    """last_timing (timing_s/reshard) is the gather on entry plus the release on exit (each made to take 0.3 s)."""
    m = load_model(helpers.make_checkpoint(str(tmp_path), "llama", with_tokenizer=False))
    r = reshard.Resharder(m, Layout(), 1)
    for name in ("_gather", "_release"):
        monkeypatch.setattr(r, name, lambda f=getattr(r, name): time.sleep(0.3) or f())
    with r.generation():
        time.sleep(0.5)  # the block itself is generation, not resharding
    assert 0.6 <= r.last_timing < 1.0, r.last_timing


# ----------------------------------------------------------------------------- HF export


def test_export_copies_the_tokenizer_and_writes_a_complete_index(tmp_path):
    """A checkpoint with every tokenizer file beside it (chat_template.jinja included) exports to a directory that
    transformers loads: the same tokenizer and chat template, the same logits, an index whose total_size is the
    tensors' bytes, and config.json naming the dtype under both keys."""
    from transformers import AutoTokenizer
    src = helpers.make_checkpoint(str(tmp_path / "hf"), "llama")
    m = load_model(src)
    os.makedirs(ck := str(tmp_path / "ck"))
    reshard.save_model_shard(m, Layout(), ck)
    json.dump({"step": 1, "tp": 1, "pp": 1, "dp": 1, "model_config": m.cfg.raw}, open(ck + "/meta.json", "w"))
    for f in os.listdir(src):
        if f not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(os.path.join(src, f), ck)
    assert "chat_template.jinja" in os.listdir(ck)
    out = str(tmp_path / "out")
    reshard.main([ck, "--to-hf", out, "--max-shard-gb", str(100e3 / 2 ** 30)])
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    for f in files:  # each within --max-shard-gb, unless it is one tensor larger than that
        part = load_file(os.path.join(out, f))
        assert len(part) == 1 or sum(v.numel() * v.element_size() for v in part.values()) <= 100e3, f
    tensors = {k: v for f in files for k, v in load_file(os.path.join(out, f)).items()}
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in tensors.values())
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["torch_dtype"] == "float32" and config["dtype"] == "float32"
    bf = str(tmp_path / "out_bf16")  # another dtype than stored: both keys follow it (the source config says float32)
    reshard.main([ck, "--to-hf", bf, "--dtype", "bf16"])
    config = json.load(open(os.path.join(bf, "config.json")))
    assert config["torch_dtype"] == "bfloat16" and config["dtype"] == "bfloat16"
    tok, want_tok = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(src)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.chat_template == helpers.CHAT_TEMPLATE
    assert tok.apply_chat_template(msgs, add_generation_prompt=True) == \
        want_tok.apply_chat_template(msgs, add_generation_prompt=True)
    ids = torch.tensor([[1, 5, 9, 200, 17]])
    with torch.no_grad():
        assert torch.allclose(helpers.hf_model(out)(ids).logits, helpers.hf_model(src)(ids).logits, atol=1e-5)
