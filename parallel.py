"""Tensor, pipeline and data parallelism on plain `torch.distributed`.

The rank grid
-------------
W processes are arranged as a 3-D grid  dp x pp x tp  with TP varying fastest:

    rank = (dp_rank * pp + pp_rank) * tp + tp_rank

so the tp ranks of one TP group are consecutive (inside one node, on the fastest links),
the pp stages of one model replica are tp apart, and the dp replicas are tp*pp apart.
Example, W=8, tp=2, pp=2, dp=2:

    dp 0:  stage 0 = ranks [0 1]   stage 1 = ranks [2 3]
    dp 1:  stage 0 = ranks [4 5]   stage 1 = ranks [6 7]
    TP groups [0,1] [2,3] [4,5] [6,7];  PP groups [0,2] [1,3] [4,6] [5,7];  DP groups [0,4] [1,5] [2,6] [3,7]

Tensor parallelism (Megatron-LM)
--------------------------------
A linear layer Y = X A^T is split two ways. Column-parallel: rank r holds rows r of A (a slice
of the output features); every rank needs all of X and produces its slice of Y. Row-parallel:
rank r holds a slice of the input features and produces a partial sum of Y that one all-reduce
completes. An MLP is column-then-row (one all-reduce in forward), attention is q/k/v column
(whole heads per rank) then the output projection row (one all-reduce). The autograd rules are
the mirror images: the identity `f` in front of a column layer all-reduces gradients in backward,
the all-reduce `g` after a row layer is the identity in backward. The embedding and the LM head
are split over the vocabulary; the softmax over a split vocabulary is computed with two small
all-reduces (max and sum-exp), never gathering the logits.

Every parameter carries its shard description: `tp_dim` (0 for column, 1 for row, None when
replicated) and `tp_parts` (the full sizes of the fused pieces along tp_dim, e.g. q, k, v of a
fused qkv projection: each piece is split separately on head boundaries and the local shard is
the concatenation of the local pieces). Loading, resharding and export all follow this one rule.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------- layout


@dataclass
class Layout:
    """This rank's place in a dp x pp x tp grid and the process groups it belongs to.

    Groups are None when their size is 1 (or when running in a single process); every
    collective helper treats None as a no-op. `*_ranks` are the global ranks of each group.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    tp_group: object = None
    pp_group: object = None
    dp_group: object = None
    tp_ranks: list = field(default_factory=lambda: [0])
    pp_ranks: list = field(default_factory=lambda: [0])
    dp_ranks: list = field(default_factory=lambda: [0])
    # first and last pipeline stage of one replica: they share tied embeddings
    embed_group: object = None

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def grid_rank(dp_rank: int, pp_rank: int, tp_rank: int, pp: int, tp: int) -> int:
    return (dp_rank * pp + pp_rank) * tp + tp_rank


def _new_group(ranks: list[int]):
    # dist.new_group is collective over the whole world: every rank must call it for every
    # group, in the same order, even for groups it is not in.
    return dist.new_group(ranks) if len(ranks) > 1 else None


def make_layout(tp: int = 1, pp: int = 1) -> Layout:
    """Build the training layout from torchrun's environment (or one process when not distributed)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if tp < 1 or pp < 1 or world % (tp * pp) != 0:
        raise ValueError(f"parallel.train: world size {world} is not divisible by tp*pp = {tp}*{pp}; "
                         f"valid (tp, pp) have tp*pp dividing {world}")
    dp = world // (tp * pp)
    dp_rank, rem = divmod(rank, tp * pp)
    pp_rank, tp_rank = divmod(rem, tp)
    lay = Layout(tp=tp, pp=pp, dp=dp, rank=rank, tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank)
    if world == 1:
        return lay
    for d in range(dp):
        for p in range(pp):
            ranks = [grid_rank(d, p, t, pp, tp) for t in range(tp)]
            g = _new_group(ranks)
            if rank in ranks:
                lay.tp_group, lay.tp_ranks = g, ranks
    for d in range(dp):
        for t in range(tp):
            ranks = [grid_rank(d, p, t, pp, tp) for p in range(pp)]
            g = _new_group(ranks)
            if rank in ranks:
                lay.pp_group, lay.pp_ranks = g, ranks
            ends = sorted({ranks[0], ranks[-1]})
            g = _new_group(ends)
            if rank in ends:
                lay.embed_group = g
    for p in range(pp):
        for t in range(tp):
            ranks = [grid_rank(d, p, t, pp, tp) for d in range(dp)]
            g = _new_group(ranks)
            if rank in ranks:
                lay.dp_group, lay.dp_ranks = g, ranks
    return lay


def validate_layout(cfg, tp: int, pp: int, world_size: int, name: str = "model") -> None:
    """Check a (tp, pp) layout against a model config before anything is built.

    `cfg` is a model.ModelConfig. Errors name the model, the counts and the valid choices.
    """
    if tp < 1 or pp < 1 or world_size % (tp * pp) != 0:
        raise ValueError(f"world size {world_size} is not divisible by tp*pp = {tp}*{pp}")
    need = {"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}
    for key, n in need.items():
        if n % tp:
            valid = [t for t in range(1, world_size + 1) if world_size % t == 0
                     and all(v % t == 0 for v in need.values())]
            raise ValueError(f"{name}: {key}={n} is not divisible by tp={tp}; valid tp sizes for "
                             f"this model and {world_size} ranks: {valid}")
    if pp > cfg.num_layers:
        raise ValueError(f"{name}: pp={pp} exceeds num_hidden_layers={cfg.num_layers}")


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> tuple[int, int]:
    """[start, end) of the layers held by one pipeline stage: an even split, earlier stages
    taking the remainder."""
    base, extra = divmod(num_layers, pp)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


# ----------------------------------------------------------------------------- TP collectives


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward (in front of a column layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward (after a row layer)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)


def all_gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every TP rank's x along the last dim (no autograd; generation and tests)."""
    if group is None:
        return x
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


# ----------------------------------------------------------------------------- TP layers


def shard_range(full: int, tp: int, tp_rank: int) -> tuple[int, int]:
    n = full // tp
    return tp_rank * n, (tp_rank + 1) * n


def _mark(p: nn.Parameter, tp_dim, parts) -> nn.Parameter:
    p.tp_dim, p.tp_parts = tp_dim, parts
    return p


class ColumnParallelLinear(nn.Module):
    """y[..., local outputs] = x W_local^T + b_local; W is split along its output rows.

    `parts` lists the full output sizes of fused pieces (e.g. [q, k, v]); each piece is split
    over tp separately, so a rank's rows are [q_r; k_r; v_r].
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, layout: Layout,
                 parts: list[int] | None = None, dtype=None, device=None):
        super().__init__()
        parts = parts or [out_features]
        assert sum(parts) == out_features and all(n % layout.tp == 0 for n in parts)
        self.group = layout.tp_group
        self.weight = _mark(nn.Parameter(torch.empty(out_features // layout.tp, in_features, dtype=dtype,
                                                     device=device)), 0, parts)
        self.bias = _mark(nn.Parameter(torch.zeros(out_features // layout.tp, dtype=dtype, device=device)),
                          0, parts) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum_r x[..., inputs_r] W_r^T (+ b once, after the reduction)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, layout: Layout, dtype=None,
                 device=None):
        super().__init__()
        assert in_features % layout.tp == 0
        self.group = layout.tp_group
        self.weight = _mark(nn.Parameter(torch.empty(out_features, in_features // layout.tp, dtype=dtype,
                                                     device=device)), 1, [in_features])
        self.bias = _mark(nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)), None,
                          None) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r*V/tp, (r+1)*V/tp) of the table; ids outside give zeros, and one
    all-reduce assembles the embedding."""

    def __init__(self, vocab_size: int, dim: int, layout: Layout, dtype=None, device=None):
        super().__init__()
        self.group = layout.tp_group
        self.start, self.end = shard_range(vocab_size, layout.tp, layout.tp_rank)
        self.weight = _mark(nn.Parameter(torch.empty(self.end - self.start, dim, dtype=dtype, device=device)),
                            0, [vocab_size])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)
