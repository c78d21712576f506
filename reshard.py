"""Moving weights between layouts: training <-> generation in place, and checkpoint -> Hugging Face.

Why two layouts
---------------
Training wants tensor and pipeline parallelism (tp x pp) to fit activations and optimizer state; memory-bound decoding
wants the smallest TP that fits, no pipeline and many replicas: the generation layout (tp_g, pp = 1, dp_g = W / tp_g)
on the same W ranks. The actor's weights are resharded in place between the two (HybridFlow's 3D-HybridEngine).

The grouping rule
-----------------
Every rank's training shard must be part of its generation shard. With k = tp / tp_g, generation TP slice g is the
union of training TP slices g*k .. g*k+k-1 of every layer. The m = k * pp ranks of a replica holding them (k
neighbouring TP ranks, all stages) form a *micro-DP group*: all end up with the same generation shard, so one
all-gather in the group builds it, all groups gather concurrently, and nobody receives what it does not keep. A rank's
generation TP group is its stage's ranks with the same t % k, its rank there t // k. W=8, tp=4, pp=1, dp=2, tp_g=2:

    training TP groups  [0 1 2 3] [4 5 6 7]
    micro-DP groups     [0 1] [2 3] [4 5] [6 7]     rank 2 holds slice 2, gathers 3 -> slices 2-3
    generation TP       [0 2] [1 3] [4 6] [5 7]     = generation shard 1 of group [0 2]

With tp_g > tp a rank narrows its shard instead: n = tp_g / tp training replicas d0*n .. d0*n+n-1 form one generation
replica, the rank of replica d keeping part d % n of its TP slice t, which is generation slice t*n + d % n. So a
generation TP group lists its ranks in slice order, not ascending (W=4, tp=2, dp=2, tp_g=4: [0 2 1 3]). With pp > 1 a
rank also gathers other stages' layers. Fused parameters follow `p.tp_parts`: a qkv shard is [q_t; k_t; v_t], so the k
gathered blocks merge per piece, on head boundaries; a replicated KV head (tp > num_kv_heads) is kept once.

Memory
------
Each bucket (whole layers, about `bucket_bytes` gathered) is one flat in-place all-gather: a rank copies its part into
its slot and releases its training tensor (only the storage: the Parameter, its hooks and the optimizer's references
stay). The gathered bucket is the generation weights: views into it when k = 1, merged copies when k > 1 (freeing the
bucket). On exit each released tensor is rebuilt bit for bit from its slice of them. Extra bytes held (`stats`):
    tp_g == tp, pp == 1:  0 (the generation model is the training model itself)
    tp_g <= tp:           steady gen - train + padding; peak + one bucket in flight
    tp_g >  tp:           <= gen + padding (the training shard stays whole: the generation shard holds only 1/n of it)
Padding: the all-gather pads every stage's part of a bucket to the largest. Where that would add over 1/8 (the first
stage's embedding against a middle stage's nothing or a tied head's norm alone, a stage of fewer layers), the bucket
goes by one broadcast per holder instead: no padding, but one sender at a time."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import sys
import time
from contextlib import contextmanager, suppress

import torch
import torch.distributed as dist
from torch import nn

from model import ModelConfig, Transformer, open_safetensors, read_json
from parallel import (Layout, _all_gather_flat, _new_group, all_gather_objects, model_state, shard_name,
                      stage_layers, tp_chunks, tp_rows, validate_layout, world_all_reduce)

# ----------------------------------------------------------------------------- the grouping


def _split(tp: int, tp_g: int) -> tuple[int, int]:
    """(k, n): k training slices make one generation slice, or one training slice makes n."""
    return (tp // tp_g, 1) if tp % tp_g == 0 else (1, tp_g // tp)


def valid_generation_tp(world: int, tp: int, pp: int) -> list[int]:
    dp = world // (tp * pp)
    return [g for g in range(1, world + 1) if tp % g == 0 or (g % tp == 0 and dp % (g // tp) == 0)]


def generation_groups(world: int, tp: int, pp: int, tp_g: int) -> tuple[list[list[int]], list[list[int]]]:
    """(micro-DP groups, generation TP groups) for the training layout (tp, pp, dp = world / (tp*pp)).
    Generation TP group r is replica r (its dp rank), listed in generation TP-rank order."""
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tp*pp = {tp}*{pp}")
    if tp_g not in (valid := valid_generation_tp(world, tp, pp)):
        raise ValueError(f"parallel.rollout.tp={tp_g} does not fit training tp={tp}, pp={pp} on {world} ranks: it must "
                         f"divide tp, or be tp times a divisor of dp={world // (tp * pp)}; valid: {valid}")
    k, n = _split(tp, tp_g)
    micro, gen = {}, {}
    for rank in range(world):
        d, p, t = rank // (tp * pp), rank // tp % pp, rank % tp
        micro.setdefault((d, t // k), []).append(rank)
        gen.setdefault(((d // n) * pp + p) * k + t % k, {})[(t // k) * n + d % n] = rank
    return sorted(micro.values()), [[gen[r][g] for g in range(tp_g)] for r in range(len(gen))]


def validate_generation_layout(cfg: ModelConfig, world: int, tp: int, pp: int, tp_g: int, name: str) -> None:
    """Fail before anything is built when the generation tp does not fit the training layout or the model (in that
    order: the layout's message lists the sizes it allows)."""
    generation_groups(world, tp, pp, tp_g)
    validate_layout(cfg, tp_g, 1, world, name=name)


def generation_layout(train: Layout, tp_g: int) -> tuple[Layout, object, list[int]]:
    """(generation Layout, micro-DP group, its ranks). Collective: every rank creates every group in the same order."""
    world, rank = train.world_size, train.rank
    micro, gen = generation_groups(world, train.tp, train.pp, tp_g)
    if tp_g == train.tp and train.pp == 1:
        return train, None, [rank]
    k, n = _split(train.tp, tp_g)

    def member(groups, new_group=_new_group):  # create every group; return this rank's (ranks, group)
        made = [(ranks, new_group(ranks)) for ranks in groups]
        return next(rg for rg in made if rank in rg[0])
    lay = Layout(tp=tp_g, pp=1, dp=world // tp_g, rank=rank)
    # k == 1: the micro-DP group is the PP group; k == n == 1: the generation TP groups are the training ones
    mine, mgroup = member(micro) if k > 1 else (train.pp_ranks, train.pp_group)
    lay.tp_ranks, lay.tp_group = member(gen, (lambda _: train.tp_group) if k == n == 1 else _new_group)
    lay.dp_rank, lay.tp_rank = gen.index(lay.tp_ranks), lay.tp_ranks.index(rank)
    lay.dp_ranks, lay.dp_group = member(map(list, zip(*gen)))  # generation DP group g: TP rank g of each replica
    return lay, mgroup, mine


# ----------------------------------------------------------------------------- slicing fused shards


def _sub(t: torch.Tensor, dim, parts: list[int] | None, num: int, idx: int, unit: int = 1) -> torch.Tensor:
    """Shard idx of num of every fused piece of t along dim (pieces of sizes `parts`, split on `unit` rows; see
    parallel.tp_rows), concatenated; a view when there is one piece. Full tensor -> TP shard is
    _sub(full, dim, tp_parts, tp, tp_rank, tp_unit)."""
    if dim is None or num == 1:
        return t
    pieces = [x.narrow(dim, (r := tp_rows(x.shape[dim], num, idx, unit)).start, r.stop - r.start)
              for x in t.split(parts, dim)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def _merge(blocks: list[torch.Tensor], dim: int, parts: list[int], merged: list[int]) -> torch.Tensor:
    """Inverse of _sub over consecutive idx: [q_a; k_a; v_a], [q_b; k_b; v_b] -> [q_a q_b; k_a k_b; v_a v_b], pieces
    of sizes `parts` in each block and `merged` after. A piece with merged < k * parts (a replicated KV head) is in
    k * parts / merged neighbouring blocks alike, so one of them is kept: [q_a q_b; k_a; v_a]."""
    split, k = [b.split(parts, dim) for b in blocks], len(blocks)
    return torch.cat([split[i * k * p // m][x] for x, (p, m) in enumerate(zip(parts, merged)) for i in range(m // p)],
                     dim)


def _owned(t: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """t in storage of its own (copied unless it already is a new tensor)."""
    shared = t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    return t.clone(memory_format=torch.contiguous_format) if shared or not t.is_contiguous() else t


@dataclasses.dataclass
class _Entry:
    train: str  # name in its stage's training model
    gen: str  # name in the generation model
    shape: torch.Size  # what its stage's ranks contribute: their training shard, narrowed when tp_g > tp
    tp_dim: int | None
    parts: list | None  # full sizes of the fused pieces along tp_dim
    unit: int = 1  # the rows they split on
    offset: int = 0  # element offset in the contributor's slot of the bucket

    def local(self, tp: int) -> list[int] | None:
        return self.parts and [f // tp_chunks(f, tp, self.unit) for f in self.parts]


def _stage_entries(cfg: ModelConfig, tp: int, pp: int, p: int, n: int) -> list[_Entry]:
    """What stage p contributes to the generation model (all but the last stage's copy of a tied embedding)."""
    skel = Transformer(cfg, Layout(tp=tp, pp=pp, pp_rank=p), device="meta")
    start, out = skel.layer_start, []
    for name, prm in skel.named_parameters():
        if name.startswith("lm_head.") and cfg.tie_word_embeddings:
            continue
        gen = re.sub(r"^layers\.(\d+)", lambda layer: f"layers.{start + int(layer[1])}", name)  # stage-local -> global
        e = _Entry(name, gen, prm.shape, prm.tp_dim, prm.tp_parts, prm.tp_unit)
        e.shape = _sub(prm, e.tp_dim, e.local(tp), n, 0, e.unit).shape
        out.append(e)
    return out


# ----------------------------------------------------------------------------- the resharder


class Resharder:
    """Train <-> generation resharding of one actor. Collective: `with r.generation() as gen_model:` (all ranks enter
    and leave together) yields a pp=1 Transformer in `r.gen_layout`; inside, the training model must not be used (its
    resharded tensors are released); `offload_optimizers` (offload/reload, e.g. ShardedAdamW) hold no device memory."""

    def __init__(self, model: Transformer, layout: Layout, tp_g: int, offload_optimizers=(), seed: int = 0,
                 bucket_bytes: int = 1 << 30):
        self.model, self.layout, self.optimizers = model, layout, list(offload_optimizers)
        validate_generation_layout(model.cfg, layout.world_size, layout.tp, layout.pp, tp_g, f"rollout tp={tp_g}")
        self.gen_layout, self.group, self.micro_ranks = generation_layout(layout, tp_g)
        self.me, self.k, self.n = self.micro_ranks.index(layout.rank), *_split(layout.tp, tp_g)
        self.c_me = layout.tp_rank % self.k  # this rank's block in a merge; a narrowing rank keeps slice dp_rank % n
        self.gen_seed = seed * 100_003 + self.gen_layout.dp_rank + 1  # one stream per generation TP group
        self._rng, self._held, self.last_timing = {"train": None, "gen": None}, [], 0.0
        if len(dtypes := {p.dtype for p in model.parameters()}) != 1:
            raise ValueError(f"Resharder needs one parameter dtype, got {sorted(map(str, dtypes))}")
        self.dtype, self.device = dtypes.pop(), next(model.parameters()).device
        self.stats = dict(gen_bytes=0, buckets=0, max_bucket_bytes=0, pad_bytes=0, recv_bytes=0, released_bytes=0,
                          peak_extra_bytes=0, steady_extra_bytes=0)
        ok = torch.tensor([float(model.lm_head is not None or not layout.is_last_stage)], device=self.device)
        if world_all_reduce(ok, dist.ReduceOp.MIN).item() != 1.0:
            raise ValueError("Resharder: the model has no LM head (a critic?); only the actor is resharded")
        if tp_g == layout.tp and layout.pp == 1:  # the training model is the generation model: nothing to move
            self.gen_model, self.sizes = model, []
            return
        self.gen_model = Transformer(model.cfg, self.gen_layout, self.dtype, device="meta").requires_grad_(False)
        self.gen_model.inv_freq, self.gen_model.attn_backend = model.inv_freq, model.attn_backend
        self._meta = dict(self.gen_model.named_parameters())
        self._plan(bucket_bytes)

    def _plan(self, bucket_bytes: int) -> None:
        """Cut every stage's contribution into the same sequence of buckets. Stages hold the same layer shapes,
        so bucket b takes local layers [b*per, (b+1)*per) of every stage, and one more bucket the first stage's
        embedding with the last stage's norm and head (two when one stage)."""
        lay, cfg, m = self.layout, self.model.cfg, len(self.micro_ranks)
        stages = [_stage_entries(cfg, lay.tp, lay.pp, p, self.n) for p in range(lay.pp)]
        covered = {e.gen for es in stages for e in es}
        assert covered == set(self._meta), f"generation parameters not covered: {covered ^ set(self._meta)}"
        size = lambda es: sum(e.shape.numel() for e in es)  # noqa: E731
        item = torch.finfo(self.dtype).bits // 8
        per = max(1, bucket_bytes // (item * m * size(e for e in stages[0] if e.train.startswith("layers.0."))))
        layers0 = {e.train.split(".")[1] for e in stages[0] if e.train.startswith("layers.")}  # stage 0 has most
        nl = -(-len(layers0) // per)  # layer buckets
        self.buckets = [[[] for _ in range(nl + 1 + (lay.pp == 1))] for _ in stages]  # [stage][bucket]
        for p, entries in enumerate(stages):
            for e in entries:
                b = (int(e.train.split(".")[1]) // per if e.train.startswith("layers.")
                     else nl + (lay.pp == 1 and not e.train.startswith("embed_tokens.")))
                e.offset = size(self.buckets[p][b])
                self.buckets[p][b].append(e)
        self.sizes = []  # slot sizes: the parts, or each padded to the largest where that wastes little
        for parts in ([size(es) for es in column] for column in zip(*self.buckets)):
            self.sizes.append([max(parts)] * len(parts) if max(parts) * len(parts) <= 1.125 * sum(parts) else parts)
        gathered = [self.k * sum(s) * item for s in self.sizes] if m > 1 else [0]
        gen = sum(p.numel() for p in self._meta.values()) * item
        recv = sum(g - s[lay.pp_rank] * item for g, s in zip(gathered, self.sizes)) if m > 1 else 0
        self.stats.update(gen_bytes=gen, buckets=len(self.sizes), max_bucket_bytes=max(gathered),
                          pad_bytes=max(0, sum(gathered) - gen), recv_bytes=recv)

    @contextmanager
    def generation(self):
        t0, offloaded, swapped = time.perf_counter(), [], False
        try:
            for opt in self.optimizers:  # their device memory goes to the KV cache while generating
                opt.offload()
                offloaded.append(opt)  # (if the next one fails, these come back below)
            self._swap_rng(to_generation=True)
            swapped = True
            self._gather()
            torch.get_device_module(self.device).synchronize(self.device)
            self.stats["enter_s"] = time.perf_counter() - t0
            yield self.gen_model
        finally:  # on a failure too (an offload, the gather, the block): the training state back, the error re-raised
            t1 = time.perf_counter()
            try:
                self._release()
            finally:
                if swapped:
                    self._swap_rng(to_generation=False)
                for opt in offloaded:
                    opt.reload()
            torch.get_device_module(self.device).synchronize(self.device)
            self.stats["exit_s"] = time.perf_counter() - t1
            self.last_timing = self.stats.get("enter_s", 0.0) + self.stats["exit_s"]

    def _account(self, nbytes: int) -> None:
        self.stats["steady_extra_bytes"] += nbytes
        self.stats["peak_extra_bytes"] = max(self.stats["peak_extra_bytes"], self.stats["steady_extra_bytes"])

    def _set(self, name: str, data: torch.Tensor | None) -> None:
        """Point a generation parameter at real data (None: back to its meta placeholder)."""
        mod, _, leaf = name.rpartition(".")
        meta = p = self._meta[name]
        if data is not None:
            p = nn.Parameter(data, requires_grad=False)
            vars(p).update(vars(meta))  # tp_dim, tp_parts (and tp_partial_grad where set)
        setattr(self.gen_model.get_submodule(mod), leaf, p)

    @torch.no_grad()
    def _gather(self) -> None:
        lay, k, n, m, me = self.layout, self.k, self.n, len(self.micro_ranks), self.me
        self.stats.update(released_bytes=0, peak_extra_bytes=0, steady_extra_bytes=0)
        for b, sizes in enumerate(self.sizes):
            mine = self.buckets[lay.pp_rank][b]
            released = []  # (param, entry) released until exit; gathered views keep their bucket alive
            self._held.append(released)
            if m == 1:  # tp_g > tp and pp == 1: narrow, no communication
                for e in mine:
                    data = _sub(self.model.get_parameter(e.train).detach(), e.tp_dim, e.local(lay.tp), n,
                                lay.dp_rank % n, e.unit)
                    self._account(data.nbytes if e.parts and len(e.parts) > 1 else 0)  # fused: a concatenated copy
                    self._set(e.gen, data)
                continue
            buf = torch.empty(k * sum(sizes), dtype=self.dtype, device=self.device)
            self._account(buf.nbytes)
            slots = buf.split([sizes[i // k] for i in range(m)])  # micro-group rank i: stage i // k, block i % k
            try:
                for e in mine:
                    p = self.model.get_parameter(e.train)
                    slots[me][e.offset:e.offset + e.shape.numel()].view(e.shape).copy_(  # unnamed: freed by the release
                        _sub(p.detach(), e.tp_dim, e.local(lay.tp), n, lay.dp_rank % n, e.unit))
                    if n == 1:  # its slot holds this shard now: release the training copy until exit
                        self._account(-p.nbytes)
                        self.stats["released_bytes"] += p.nbytes
                        p.data = p.data.new_empty(0)
                        released.append((p, e))
                if len(set(sizes)) == 1:
                    _all_gather_flat(buf, slots[me], group=self.group)
                else:
                    for i, src in enumerate(self.micro_ranks):
                        if sizes[i // k]:
                            dist.broadcast(slots[i], src, group=self.group)
                for stage, runs in enumerate(self.buckets):
                    for e in runs[b]:
                        at = slice(e.offset, e.offset + e.shape.numel())
                        blocks = [slots[stage * k + c][at].view(e.shape) for c in range(k)]
                        data = blocks[self.c_me]  # k == 1: a view into the bucket
                        if k > 1:  # replicated: this rank's own copy, bitwise what it released
                            data = (_owned(data, buf) if e.tp_dim is None else
                                    _merge(blocks, e.tp_dim, e.local(lay.tp), e.local(self.gen_layout.tp)))
                            self._account(data.nbytes)
                        self._set(e.gen, data)
            except BaseException:  # this bucket's released shards are only in this rank's slot: put them back
                for p, e in released:
                    p.data = slots[me][e.offset:e.offset + e.shape.numel()].view(e.shape).clone()
                released.clear()
                raise
            if k > 1:  # the merged copies are the generation weights: the bucket goes now
                self._account(-buf.nbytes)
            del buf, slots, blocks

    @torch.no_grad()
    def _release(self) -> None:
        """Bucket by bucket, rebuild the released training tensors from the generation weights, then unset those
        (a bucket whose gather failed has put its own back)."""
        for b, released in enumerate(self._held):
            for p, e in released:
                g = self.gen_model.get_parameter(e.gen).detach()
                p.data = _owned(_sub(g, e.tp_dim, e.local(self.gen_layout.tp), self.k, self.c_me, e.unit), g)
            g = None  # a view into bucket b: it must not keep it alive while b + 1 is rebuilt
            for runs in self.buckets:
                for e in runs[b]:
                    self._set(e.gen, None)
        self._held = []

    def _swap_rng(self, to_generation: bool) -> None:
        """One torch RNG stream per generation TP group (same seed on its ranks), carried over between
        generations; the training stream is set aside and restored exactly (CPU and this CUDA device)."""
        cuda = self.device.type == "cuda"
        leave, enter = ("train", "gen") if to_generation else ("gen", "train")
        self._rng[leave] = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if cuda else None)
        if (new := self._rng[enter]) is None:  # the first generation: seed its stream
            torch.random.default_generator.manual_seed(self.gen_seed)
            if cuda:
                torch.cuda.default_generators[self.device.index or 0].manual_seed(self.gen_seed)
            return
        torch.set_rng_state(new[0])
        if cuda:
            torch.cuda.set_rng_state(new[1], self.device)


# ----------------------------------------------------------------------------- prompts in, completions out


def dispatch_prompts(prompts: list, gen_layout: Layout) -> tuple[list, int]:
    """This generation replica's contiguous share of the prompt list (the same on every rank) and its
    offset. A prompt's n samples are generated together, so they stay in one replica."""
    start, end = stage_layers(len(prompts), gen_layout.dp, gen_layout.dp_rank)  # an even split (no head cost)
    return prompts[start:end], start


def collect_results(done: list, offset: int, gen_layout: Layout) -> list:
    """Every replica's completions on every rank, in global prompt order (prompt_index made global)."""
    parts = all_gather_objects((offset, done) if gen_layout.tp_rank == 0 else None)
    parts = sorted((p for p in parts if p is not None), key=lambda p: p[0])
    return [dataclasses.replace(c, prompt_index=c.prompt_index + off) for off, items in parts for c in items]


# ----------------------------------------------------------------------------- checkpoints and export


def save_model_shard(model: Transformer, layout: Layout, ckpt_dir: str, tensors: dict | None = None,
                     prefix: str = "model", writer: int = 0) -> None:
    """Write this (pp, tp) coordinate's weights (or `tensors` named and shaped like them, e.g. an optimizer's
    full_state) as {prefix}_pp{p}_tp{t}.safetensors; only DP rank `writer` writes (the others hold the same)."""
    if layout.dp_rank != writer:
        return
    path = os.path.join(ckpt_dir, f"{prefix}_{shard_name(layout)}.safetensors")
    _save_file({k: v.detach().contiguous().cpu() for k, v in (tensors or model_state(model)).items()}, path + ".tmp")
    os.replace(path + ".tmp", path)


def _save_file(tensors: dict, path: str) -> None:
    """safetensors' save_file, the file then given the mode any new file gets (save_file makes it owner-only)."""
    from safetensors.torch import save_file
    save_file(tensors, path, metadata={"format": "pt"})
    mask = os.umask(0o022)  # (reading the umask means setting it)
    os.umask(mask)
    with suppress(OSError):  # (a file system without modes)
        os.chmod(path, 0o666 & ~mask)


class _Checkpoint:
    """Full HF-named tensors read out of a sharded checkpoint's {prefix}_pp*_tp* files, one at a time."""

    def __init__(self, ckpt_dir: str, prefix: str = "model"):
        if not os.path.isfile(f := os.path.join(ckpt_dir, "meta.json")):
            raise FileNotFoundError(f"{ckpt_dir!r} is not a checkpoint directory (no meta.json)")
        self.meta = read_json(f)
        if missing := [k for k in ("tp", "pp", "model_config") if k not in self.meta]:
            raise ValueError(f"{f}: missing {missing}; a checkpoint's meta.json holds tp, pp and model_config")
        self.dir, tp, pp = ckpt_dir, self.meta["tp"], self.meta["pp"]
        self.cfg = ModelConfig.from_hf(self.meta["model_config"], source=f)
        self.index = {}  # hf name -> (its distinct shards' files, our name, tp_dim, its rows/columns in each)
        stages = [[os.path.join(ckpt_dir, f"{prefix}_{shard_name(Layout(tp_rank=t, pp_rank=p))}.safetensors")
                   for t in range(tp)] for p in range(pp)]
        if missing := [fn for files in stages for fn in files if not os.path.isfile(fn)]:
            raise FileNotFoundError(f"checkpoint {ckpt_dir!r} (tp={tp}, pp={pp}) lacks {missing}")
        critic = "value_head.weight" in open_safetensors(stages[-1][0]).keys()  # no LM head: an even stage split
        for p, names in enumerate(stages):
            files = [open_safetensors(fn) for fn in names]
            keys = set(files[0].keys())
            skel = Transformer(self.cfg, Layout(tp=tp, pp=pp, pp_rank=p), device="meta", value_head=critic,
                               lm_head=not critic)
            if set(named := dict(skel.named_parameters())) != keys:
                raise ValueError(f"{ckpt_dir}: stage {p} holds {sorted(keys ^ set(named))} unlike a "
                                 f"{self.cfg.architecture} stage of tp={tp}, pp={pp}")
            for name, prm in named.items():
                for fn, fh in zip(names, files):  # every shard, so one from another model cannot slip in
                    if (shape := fh.get_slice(name).get_shape()) != list(prm.shape):
                        raise ValueError(f"{fn}: tensor {name!r} has shape {shape}, expected {list(prm.shape)}")
                chunks = [tp_chunks(n, tp, prm.tp_unit) for n in prm.tp_parts or [1]]
                parts = [n // c for n, c in zip(prm.tp_parts or [0], chunks)]
                for j, hf in enumerate(skel.hf_names(name)):  # a tied head's copy: the embedding came first
                    distinct = [files[i * tp // chunks[j]] for i in range(chunks[j])]  # a replicated head once
                    self.index.setdefault(hf, (distinct, name, prm.tp_dim, slice(sum(parts[:j]), sum(parts[:j + 1]))))

    def tensor(self, hf: str) -> torch.Tensor:
        if hf not in self.index:
            raise KeyError(f"checkpoint {self.dir!r} has no tensor for {hf!r}")
        files, name, dim, rows = self.index[hf]
        return (files[0].get_tensor(name) if dim is None
                else torch.cat([f.get_slice(name)[(slice(None),) * dim + (rows,)] for f in files], dim))


def read_shard(model: Transformer, ckpt_dir: str, prefix: str = "model"):
    """(name, this rank's shard) of each of `model`'s parameters from a checkpoint's {prefix} files (weights,
    or an optimizer state saved like them) written under any other layout, one full tensor at a time."""
    ck = _Checkpoint(ckpt_dir, prefix)
    mine, theirs = dataclasses.asdict(model.cfg), dataclasses.asdict(ck.cfg)
    if diff := [k for k in mine if k != "raw" and mine[k] != theirs[k]]:
        raise ValueError(f"checkpoint {ckpt_dir!r} is a different model: " +
                         ", ".join(f"{k}={theirs[k]!r} (model has {mine[k]!r})" for k in diff))
    for name, p in model.named_parameters():
        full = torch.cat([ck.tensor(hf) for hf in model.hf_names(name)], p.tp_dim or 0)
        yield name, _sub(full, p.tp_dim, p.tp_parts, model.layout.tp, model.layout.tp_rank, p.tp_unit)


@torch.no_grad()
def load_into(model: Transformer, ckpt_dir: str) -> None:
    """Fill this rank's shard of `model` (any layout) from a checkpoint written under any other layout."""
    for name, local in read_shard(model, ckpt_dir):
        model.get_parameter(name).copy_(local)


TOKENIZER_FILES = ("tokenizer", "special_tokens", "vocab", "merges", "chat_template", "added_tokens",
                   "generation_config")


def export_hf(ckpt_dir: str, out_dir: str, dtype: torch.dtype | None = None, max_shard_bytes: int = 4 << 30) -> None:
    """A Hugging Face directory (config.json, safetensors shards + index, tokenizer files) from a checkpoint,
    written into a temporary directory that is renamed into place; one shard in memory at a time."""
    master = dtype == torch.float32 and os.path.isfile(os.path.join(ckpt_dir, "master_pp0_tp0.safetensors"))
    ck = _Checkpoint(ckpt_dir, "master" if master else "model")  # fp32: Adam's master weights, not bf16 ones upcast
    if any(hf.startswith("value_head.") for hf in ck.index):
        raise ValueError(f"{ckpt_dir!r} is a critic (a value head, no LM head): only an actor exports as a causal LM")

    def refuse_existing():  # at the start, and again before the rename: another export may have finished meanwhile
        if os.path.lexists(out_dir):  # (lexists: a dangling symlink is there too)
            raise FileExistsError(f"--to-hf {out_dir!r} already exists; choose a new directory")
    refuse_existing()
    tmp, shards, cur, total = f"{out_dir.rstrip('/')}.tmp{os.getpid()}_{time.time_ns()}", [], {}, 0
    os.makedirs(tmp)  # a new name: a directory already there (the user's) is never overwritten or removed

    def flush():
        _save_file(cur, os.path.join(tmp, f"part{len(shards)}"))
        shards.append(list(cur))
        cur.clear()
    try:
        for hf in ck.index:
            t = ck.tensor(hf).to(dtype=dtype).contiguous()  # dtype None: as stored
            if cur and sum(v.nbytes for v in cur.values()) + t.nbytes > max_shard_bytes:
                flush()
            cur[hf], total, written = t, total + t.nbytes, t.dtype
        flush()
        weight_map = {}
        for i, names in enumerate(shards):
            fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            os.replace(os.path.join(tmp, f"part{i}"), os.path.join(tmp, fn))
            weight_map.update(dict.fromkeys(names, fn))
        config = {**ck.meta["model_config"], "torch_dtype": str(written)[6:], "dtype": str(written)[6:]}
        for fn, obj in (("model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map}),
                        ("config.json", config)):
            with open(os.path.join(tmp, fn), "w") as f:
                json.dump(obj, f, indent=1)
        for fn in os.listdir(ckpt_dir):
            if fn.startswith(TOKENIZER_FILES):
                shutil.copy(os.path.join(ckpt_dir, fn), tmp)
        refuse_existing()
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written survives a failure (disk full, ^C, a race)
        raise


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Export a nanorl checkpoint as a Hugging Face model directory.")
    ap.add_argument("checkpoint", help="a checkpoints/step_N directory (meta.json + model_pp*_tp*.safetensors)")
    ap.add_argument("--to-hf", required=True, metavar="OUT_DIR", help="new directory to write")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                    help="default: as stored; fp32 takes Adam's fp32 master weights when the checkpoint has them")
    ap.add_argument("--max-shard-gb", type=float, default=4.0)
    a = ap.parse_args(argv)
    if not 0 < a.max_shard_gb < math.inf:
        ap.error(f"--max-shard-gb {a.max_shard_gb}: expected a shard size in GB > 0")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[a.dtype]
    # a scheduler's SIGTERM unwinds as SystemExit, so that export_hf removes its temporary directory
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        export_hf(a.checkpoint, a.to_hf, dtype, int(a.max_shard_gb * (1 << 30)))
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"wrote {a.to_hf}")


if __name__ == "__main__":
    main()
