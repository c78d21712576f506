"""Prompts in, micro-batches out: the data side of RL post-training.

**The dataset format** is verl's parquet layout, one prompt per row: `prompt` holds the chat messages (`{"role",
"content"}` dicts, or a plain string sent as one user message), `data_source` tells the reward function how to score
it, `reward_model.ground_truth` is what the scorer compares against, `extra_info` is free-form; other columns
(`ability`, ...) are carried along. The policy continues the chat-template rendering, generation prompt appended.

**One tokenized copy per node.** Tokenizing a large dataset takes minutes, and eight ranks per node would hold eight
copies. So one process tokenizes it all into an Arrow IPC file that every rank memory-maps: the page cache holds one
shared copy, and reopening costs milliseconds. The file's name hashes all that decides its contents (data files'
bytes, tokenizer vocabulary and chat template, length settings), so a change never reuses a stale file. Whoever
holds an exclusive flock on the lock file builds to a temporary name, then renames it, while the rest wait; no
torch.distributed needed. An invalid file is rebuilt; the kernel drops a dead builder's flock, so it blocks nobody.

**Sampling.** A fresh permutation per epoch from (seed, epoch), the tail too short for a batch dropped; the state is
just (epoch, position), so a resumed run draws exactly the batches it would have drawn, also at an epoch boundary.

**The rollout batch.** `Batch` holds one step's rollouts, the same on every rank: per sample its prompt and response
ids, group (the prompt's dataset index), data source, ground truth and extra info, its response mask and the
generator's log-probs, and the [B, R] or [B] tensors the step adds (scores, log-probs, values, advantages).

**Packing.** Log-probs and updates run on unpadded concatenated sequences (`packed_inputs`) in micro-batches of at
most `max_tokens` tokens. Data-parallel ranks should get about equal work (all wait for the slowest at the gradient
all-reduce) and exactly equal micro-batch counts (collectives and the pipeline schedule run in lock-step). Greedy LPT
(longest first, each to the least-loaded rank) splits sequences over k ranks; by Graham's bound its largest load is
at most (4/3 - 1/(3k)) times optimal, and at most mean load + longest sequence. Each rank packs first-fit decreasing,
and ranks with fewer micro-batches split their fullest ones (or add empty ones) until counts agree. Work is token
count: attention's quadratic term is small while sequences are short next to the width. `micro_batch` records where
each response token lands in the [rows, R] tensors (`scatter_rows` puts per-token results back there)."""
from __future__ import annotations

import argparse
import copy
import dataclasses
import fcntl
import glob
import hashlib
import heapq
import itertools
import json
import logging
import os
import pathlib
import re
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

logger = logging.getLogger("nanorl.data")

CACHE_VERSION = "3"  # bump when the cache layout changes, so old files are never reused
TRUNCATIONS = ("error", "left", "right", "middle")
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")  # one suffices


def load_tokenizer(model_dir: str):
    """The Hugging Face tokenizer stored in a local model directory."""
    from transformers import AutoTokenizer
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"tokenizer directory {model_dir!r} does not exist")
    if not any(os.path.exists(os.path.join(model_dir, f)) for f in TOKENIZER_MARKERS):
        raise FileNotFoundError(f"{model_dir!r} holds no tokenizer files (expected one of {list(TOKENIZER_MARKERS)}); "
                                f"it has {sorted(os.listdir(model_dir))}")
    return AutoTokenizer.from_pretrained(model_dir)


def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)  # works for directories too: makes the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write) -> None:
    """Call write(tmp_path), fsync, then rename onto path (its directory made if needed): readers see all of the
    file or none."""
    tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        write(tmp)
        fsync(tmp)
        os.replace(tmp, path)
    finally:
        pathlib.Path(tmp).unlink(missing_ok=True)
    fsync(os.path.dirname(os.path.abspath(path)))


def write_text(path: str, text: str) -> None:
    atomic_write(path, lambda tmp: pathlib.Path(tmp).write_text(text))


# ----------------------------------------------------------------------------- the dataset


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what decides the token ids: the backend's whole pipeline (not just its vocab), the chat template and
    the special tokens it is rendered with (apply_chat_template passes special_tokens_map: {{ bos_token }}, ...)."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))).encode())
    h.update(json.dumps(tokenizer.chat_template, sort_keys=True).encode())
    if tokenizer.chat_template is not None:  # what it renders today: a template may print the date (strftime_now)
        try:
            h.update(tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tokenize=False).encode())
        except Exception as e:  # a template that wants another conversation (a system message first): its message
            h.update(repr(e).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    h.update(str(getattr(tokenizer, "split_special_tokens", False)).encode())  # the wrapper's, not in to_str()
    return h.hexdigest()


def _check_messages(prompt, where: str) -> list[dict]:
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                   and isinstance(m.get("content"), str) for m in prompt):
        return prompt
    raise TypeError(f"{where}: expected a string or a non-empty list of {{'role': str, 'content': str}} "
                    f"messages, got {type(prompt).__name__}: {str(prompt)[:100]}")


class PromptDataset:
    """Tokenized prompts of verl-schema parquet files, memory-mapped from a shared Arrow cache.

    Items are dicts: `prompt_ids` (list[int]), `data_source`, `ground_truth` (str), `extra_info` (dict), `index` (the
    item's position in this dataset), the prompt (under `prompt_key`), `reward_model` and any other source columns.
    Overlong prompts are dropped (`filter_overlong`, counted in `num_filtered`) or else handled by `truncation`:
    "error", "left" (keep the end), "right", "middle"."""

    def __init__(self, files: list[str], tokenizer, max_prompt_length: int, truncation: str = "error",
                 filter_overlong: bool = True, prompt_key: str = "prompt", cache_dir: str | None = None,
                 lock_timeout: float = 1800.0):
        files = [files] if isinstance(files, str) else files
        if not files:
            raise ValueError("PromptDataset needs at least one parquet file")
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation={truncation!r}; expected one of {TRUNCATIONS}")
        if max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
        if missing := [f for f in files if not os.path.isfile(f)]:
            raise FileNotFoundError(f"data file {missing[0]!r} does not exist")
        self.files = [os.path.abspath(f) for f in files]
        self.tokenizer, self.max_prompt_length, self.truncation = tokenizer, max_prompt_length, truncation
        self.filter_overlong, self.prompt_key, self.lock_timeout = filter_overlong, prompt_key, lock_timeout
        self.key = hashlib.sha256(json.dumps(dict(
            version=CACHE_VERSION, max_prompt_length=max_prompt_length, truncation=truncation,
            filter_overlong=filter_overlong, prompt_key=prompt_key, files=[_sha256_file(f) for f in self.files],
            tokenizer=_tokenizer_fingerprint(tokenizer)), sort_keys=True).encode()).hexdigest()
        cache_dir = cache_dir or os.path.join(os.path.dirname(self.files[0]), ".nanorl_cache")
        os.makedirs(cache_dir, exist_ok=True)
        self.cache_path = os.path.join(cache_dir, f"prompts-{self.key[:24]}.arrow")
        self.cache_built = False  # True in the one process that tokenized
        self._table = self._open_or_build()
        self.num_filtered = int(self._table.schema.metadata[b"nanorl_num_filtered"])
        if self.num_filtered:
            logger.warning("%d prompts longer than %d tokens were filtered out of %s",
                           self.num_filtered, max_prompt_length, self.files)

    def _try_open(self) -> pa.Table | None:
        try:
            table = pa.ipc.open_file(pa.memory_map(self.cache_path, "r")).read_all()
            meta = table.schema.metadata or {}
            if (meta.get(b"nanorl_key") != self.key.encode() or "prompt_ids" not in table.column_names
                    or int(meta[b"nanorl_num_rows"]) != table.num_rows):
                raise ValueError("key, columns or row count mismatch")
            table.validate()
            return table
        except (OSError, pa.ArrowException, ValueError, KeyError) as e:
            self._unusable = str(e)  # reported by whoever rebuilds it, not by every waiting process
            return None

    def _open_or_build(self) -> pa.Table:
        """One process builds the cache, holding an exclusive flock on `<cache>.lock`; the kernel drops the flock
        when its holder dies, so a crashed builder blocks nobody. The holder removes the file before letting go: a
        waiter that then gets the flock of the removed file tries again (and finds the cache)."""
        lock, deadline = self.cache_path + ".lock", time.monotonic() + self.lock_timeout
        while (table := self._try_open()) is None:
            fd = os.open(lock, os.O_CREAT | os.O_RDWR)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"waited {self.lock_timeout:.0f}s for another process to build "
                                           f"{self.cache_path} (it holds {lock})") from None
                    time.sleep(0.05)
                    continue
                try:
                    if not os.path.samestat(os.fstat(fd), os.stat(lock)):
                        continue  # the flock of a file its last holder removed (another one is there now)
                except FileNotFoundError:
                    continue  # the same, no file there now
                try:
                    if self._try_open() is None:  # unless someone finished before we took the lock
                        for old in glob.glob(glob.escape(self.cache_path) + ".tmp-*"):  # a dead builder's
                            os.remove(old)
                        if os.path.exists(self.cache_path):
                            logger.warning("rebuilding unusable cache %s (%s)", self.cache_path, self._unusable)
                        atomic_write(self.cache_path, self._build)
                        self.cache_built = True
                        if self._try_open() is None:
                            raise RuntimeError(f"freshly built cache {self.cache_path} does not validate")
                finally:
                    os.remove(lock)
            finally:
                os.close(fd)
        return table

    def _build(self, out_path: str) -> None:
        t0 = time.perf_counter()
        # prompt and reward_model stay Python values: Arrow types vary by file (int or str truths, list field names)
        rests, prompts, rewards, origin = [], [], [], []
        for f in self.files:
            try:
                t = pq.read_table(f)
            except (OSError, pa.ArrowException) as e:
                raise ValueError(f"{f}: not a readable parquet file ({e})") from e
            if missing := [c for c in (self.prompt_key, "data_source", "reward_model") if c not in t.column_names]:
                raise ValueError(f"{f}: missing column(s) {missing}; the file has columns {t.column_names}")
            t = t.cast(pa.schema([c.with_type(c.type.value_type) if pa.types.is_dictionary(c.type) else c
                                  for c in t.schema]))  # (pandas' categoricals: plain values, as other files have)
            if taken := [c for c in ("prompt_ids", "ground_truth", "index") if c in t.column_names]:
                raise ValueError(f"{f}: column(s) {taken} would be overwritten by the ones nanorl derives (the "
                                 "tokenized prompt, reward_model.ground_truth, the row's position): rename them")
            prompts += [[{"role": "user", "content": p}] if isinstance(p, str)
                        else _check_messages(p, f"{f}: row {r}: column {self.prompt_key!r}")
                        for r, p in enumerate(t.column(self.prompt_key).to_pylist())]
            rewards += t.column("reward_model").to_pylist()
            origin += [(f, r) for r in range(t.num_rows)]
            rests.append(t.drop_columns([c for c in t.column_names if c.startswith("__index_level_") or c in (
                self.prompt_key, "reward_model")]))
        try:
            rest = pa.concat_tables(rests, promote_options="permissive")
        except pa.ArrowException as e:
            raise ValueError("the data files have incompatible schemas: "
                             + "; ".join(f"{f}: {t.schema}" for f, t in zip(self.files, rests))) from e
        if not prompts:
            raise ValueError(f"the data files {self.files} hold no rows")
        if self.tokenizer.chat_template is None:
            raise ValueError(f"tokenizer {self.tokenizer.name_or_path!r} has no chat template")
        texts = self.tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=False)
        backend, all_ids = getattr(self.tokenizer, "backend_tokenizer", None), []
        if backend is not None:  # a copy set up as the wrapper's own call would (tokenizer.json may set truncation)
            backend = copy.deepcopy(backend)
            backend.no_truncation()
            backend.no_padding()
            backend.encode_special_tokens = getattr(self.tokenizer, "split_special_tokens", False)
        # the Rust tokenizer without transformers' wrapper: same ids, 2x faster; Encodings are large: keep ids only
        for chunk in (texts[i:i + 4096] for i in range(0, len(texts), 4096)):
            all_ids += ([e.ids for e in backend.encode_batch_fast(chunk, add_special_tokens=False)]
                        if backend is not None else self.tokenizer(chunk, add_special_tokens=False)["input_ids"])
        kept = []  # (row, ids, reward_model) of each prompt that stays
        for row, (ids, rm, (f, r)) in enumerate(zip(all_ids, rewards, origin)):
            if not ids:  # found here, not when the sampler first draws it hours into a run
                raise ValueError(f"{f}: row {r}: the prompt renders to no tokens (an empty message under a bare "
                                 "chat template?)")
            if len(ids) > self.max_prompt_length:
                if self.filter_overlong:
                    continue
                if self.truncation == "error":
                    raise ValueError(f"{f}: row {r}: prompt is {len(ids)} tokens, over max_prompt_length="
                                     f"{self.max_prompt_length} (set data.filter_overlong_prompts: true or a "
                                     "data.truncation mode)")
                n = self.max_prompt_length  # the first `head` tokens and the last n - head ("left" keeps the question)
                head = {"left": 0, "right": n, "middle": n // 2}[self.truncation]
                ids = ids[:head] + ids[len(ids) - (n - head):]
            truth = rm.get("ground_truth") if isinstance(rm, dict) else None
            if truth is None:
                raise ValueError(f"{f}: row {r}: reward_model must be a struct with a ground_truth, got {rm!r}")
            try:  # (bytes, dates, decimals are not JSON)
                truth = truth if isinstance(truth, str) else json.dumps(truth, ensure_ascii=False)
            except TypeError as e:
                raise ValueError(f"{f}: row {r}: reward_model.ground_truth must be a string or a JSON value: "
                                 f"{e}") from None
            kept.append((row, ids, {**rm, "ground_truth": truth}))
        if not kept:
            raise ValueError(f"no prompts left in {self.files}: all {len(origin)} are longer than "
                             f"max_prompt_length={self.max_prompt_length}")
        keep, kept_ids, kept_rewards = zip(*kept)
        table = rest.take(pa.array(keep, pa.int64()))
        try:
            prompt_col, reward_col = pa.array([prompts[i] for i in keep]), pa.array(kept_rewards)
        except pa.ArrowException as e:  # (a field an int in one row or file, a string in another)
            raise ValueError(f"the {self.prompt_key!r} or reward_model values of {self.files} do not keep one type "
                             f"per field: {e}") from e
        for name, values in ((self.prompt_key, prompt_col), ("reward_model", reward_col),
                             ("prompt_ids", pa.array(kept_ids, pa.large_list(pa.int32()))),
                             ("ground_truth", pa.array([r["ground_truth"] for r in kept_rewards], pa.string())),
                             ("index", pa.array(np.arange(len(keep), dtype=np.int64)))):
            table = table.append_column(name, values)
        table = table.replace_schema_metadata({"nanorl_key": self.key, "nanorl_num_rows": str(len(keep)),
                                               "nanorl_num_filtered": str(len(origin) - len(keep))})
        # One record batch: Arrow's take() on a multi-chunk table concatenates them first, a full copy per batch draw.
        with open(out_path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table.combine_chunks())
        logger.info("built prompt cache %s: %d prompts in %.1fs", self.cache_path, len(keep), time.perf_counter() - t0)

    def __len__(self) -> int:
        return self._table.num_rows

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for a dataset of {len(self)} prompts")
        return self.get_batch([i % len(self)])[0]

    def distinct(self, column: str) -> list:
        """The distinct values of a column (e.g. every data_source, for the trainer's check of its scorers)."""
        return self._table.column(column).unique().to_pylist()

    def get_batch(self, indices: list[int]) -> list[dict]:
        if bad := [i for i in indices if not 0 <= i < len(self)]:
            raise IndexError(f"indices {bad[:5]} out of range for a dataset of {len(self)} prompts")
        table = self._table.take(pa.array(indices, pa.int64()))
        ids = table.column("prompt_ids").combine_chunks()
        # Token ids dominate the batch; numpy slices turn them into Python lists ~10x faster than Arrow.
        values, offsets = ids.values.to_numpy(), ids.offsets.to_numpy()
        rows = table.drop_columns(["prompt_ids"]).to_pylist()
        for k, row in enumerate(rows):
            row["prompt_ids"] = values[offsets[k]:offsets[k + 1]].tolist()
            row["extra_info"] = row.get("extra_info") or {}
        return rows

    # A pickled dataset (e.g. sent to a worker) reopens the mapping instead of copying the table.
    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_table"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._table = self._open_or_build()


# ----------------------------------------------------------------------------- sampling


class Sampler:
    """Batches of dataset indices (see the module docstring). `epoch` and `position` describe the last batch drawn; a
    draw that does not fit in what is left of the epoch starts the next one. Batch sizes may vary between calls."""

    def __init__(self, num_items: int, batch_size: int, seed: int, shuffle: bool = True):
        if not 1 <= batch_size <= num_items:
            raise ValueError(f"batch_size={batch_size} (data.gen_batch_size if set, else data.train_batch_size) must "
                             f"be between 1 and the dataset size {num_items}")
        if seed < 0:  # numpy's default_rng takes non-negative seeds only; fail now, not at the first draw
            raise ValueError(f"sampler seed (data.seed) must be >= 0, got {seed}")
        self.num_items, self.batch_size, self.seed, self.shuffle = num_items, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, None

    def next_indices(self, batch_size: int | None = None) -> list[int]:
        b = self.batch_size if batch_size is None else batch_size
        if not 1 <= b <= self.num_items:
            raise ValueError(f"batch_size={b} must be between 1 and the dataset size {self.num_items}")
        if self.position + b > self.num_items:
            self.epoch, self.position = self.epoch + 1, 0
        if self._order_epoch != self.epoch:  # the epoch's order is a pure function of (seed, epoch)
            rng, self._order_epoch = np.random.default_rng([self.seed, self.epoch]), self.epoch
            self._order = rng.permutation(self.num_items) if self.shuffle else np.arange(self.num_items)
        self.position += b
        return self._order[self.position - b:self.position].tolist()

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("num_items", "seed", "shuffle", "epoch", "position")}

    def load_state_dict(self, state: dict) -> None:
        for k in ("num_items", "seed", "shuffle"):
            if state[k] != getattr(self, k):
                raise ValueError(f"sampler state has {k}={state[k]!r} but this sampler has {getattr(self, k)!r} "
                                 "(data.train_files, data.seed or data.shuffle changed since the checkpoint); "
                                 "resuming would not continue the saved order")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


# ----------------------------------------------------------------------------- the rollout batch


@dataclass
class Batch:
    """All rollouts of one step (identical on every rank). Per-token tensors are [B, R]."""
    prompts: list                       # list[list[int]] per sample
    responses: list                     # list[list[int]] per sample
    index: torch.Tensor                 # [B] group id (the prompt's dataset index)
    data_source: list
    ground_truth: list
    extra_info: list
    response_mask: torch.Tensor
    rollout_log_probs: torch.Tensor
    tensors: dict = field(default_factory=dict)  # scores, old/ref log-probs, values, advantages, ...

    @classmethod
    def from_completions(cls, items: list[dict], completions: list, R: int) -> Batch:
        src = [items[c.prompt_index] for c in completions]
        mask, rlp = torch.zeros(len(completions), R), torch.zeros(len(completions), R)
        for i, c in enumerate(completions):
            mask[i, :len(c.token_ids)] = 1
            rlp[i, :len(c.token_ids)] = torch.tensor(c.logprobs, dtype=torch.float32)
        return cls([s["prompt_ids"] for s in src], [list(c.token_ids) for c in completions],
                   torch.tensor([s["index"] for s in src], dtype=torch.long), [s["data_source"] for s in src],
                   [s["ground_truth"] for s in src], [s["extra_info"] for s in src], mask, rlp)

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, keep: list[int]) -> Batch:
        return Batch.combine([self], lambda ts: ts[0][keep], lambda lists: [lists[0][i] for i in keep])

    @staticmethod
    def concat(batches: list[Batch]) -> Batch:
        """The batches one after the other; a per-sample tensor that some lack (a scorer's extra missing from a whole
        draw) is NaN there."""
        keys = {k for b in batches for k in b.tensors}
        for b in batches:
            b.tensors.update({k: torch.full((len(b),), float("nan")) for k in keys - b.tensors.keys()})
        return Batch.combine(batches, torch.cat, lambda lists: sum(lists, []))

    @staticmethod
    def combine(batches: list[Batch], tensors_fn, lists_fn) -> Batch:
        """Field by field: every tensor (those in .tensors too) from tensors_fn(its values in `batches`),
        every list from lists_fn(its values)."""
        def one(vals):
            if isinstance(vals[0], dict):
                return {n: tensors_fn([v[n] for v in vals]) for n in vals[0]}
            return tensors_fn(vals) if torch.is_tensor(vals[0]) else lists_fn(vals)
        return Batch(**{f.name: one([getattr(b, f.name) for b in batches]) for f in dataclasses.fields(Batch)})


# ----------------------------------------------------------------------------- packing


def _lpt_partition(seq_lens: list[int], k: int) -> list[list[int]]:
    heap = [(0, r) for r in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i)):
        load, r = heapq.heappop(heap)
        parts[r].append(i)
        heapq.heappush(heap, (load + seq_lens[i], r))
    return parts


def _first_fit_decreasing(items: list[int], seq_lens: list[int], budget: int) -> list[list[int]]:
    bins, room = [], []  # the sequences of each micro-batch, and its tokens left
    for i in sorted(items, key=lambda i: (-seq_lens[i], i)):
        if (b := next((b for b, r in enumerate(room) if r >= seq_lens[i]), len(bins))) == len(bins):
            bins.append([])
            room.append(budget)
        bins[b].append(i)
        room[b] -= seq_lens[i]
    return bins


def pack_micro_batches(seq_lens: list[int], max_tokens_per_micro_batch: int, dp_size: int) -> list[list[list[int]]]:
    """result[dp_rank][micro_batch] = sorted sequence indices (see the module docstring): each micro-batch
    within the token budget, each sequence in exactly one, the same number (some maybe empty) on every rank."""
    budget = max_tokens_per_micro_batch
    if dp_size < 1 or budget < 1:
        raise ValueError(f"dp_size ({dp_size}) and max_tokens_per_micro_batch ({budget}) must be >= 1")
    for i, n in enumerate(seq_lens):
        if not 0 <= n <= budget:
            raise ValueError(f"sequence {i} has {n} tokens, more than max_tokens_per_micro_batch={budget}; "
                             f"raise the budget to at least the longest prompt + response" if n > 0 else
                             f"sequence {i} has negative length {n}")
    per_rank = [_first_fit_decreasing(part, seq_lens, budget) for part in _lpt_partition(seq_lens, dp_size)]
    target = max(len(mbs) for mbs in per_rank)
    for mbs in per_rank:
        while len(mbs) < target:  # split the heaviest splittable micro-batch: this also shortens the slowest step
            if not (splittable := [j for j in range(len(mbs)) if len(mbs[j]) > 1]):
                mbs.append([])
                continue
            mb = mbs.pop(max(splittable, key=lambda j: sum(seq_lens[i] for i in mbs[j])))
            mbs += [[mb[p] for p in half] for half in _lpt_partition([seq_lens[i] for i in mb], 2)]
    return [[sorted(mb) for mb in mbs] for mbs in per_rank]


def packed_inputs(sequences: list[list[int]] | list[torch.Tensor]) -> dict:
    """Concatenate sequences without padding: the varlen-attention inputs model.py consumes. position_ids restart at 0
    for each sequence; cu_seqlens[b]:cu_seqlens[b+1] is sequence b."""
    if len(sequences) == 0:
        raise ValueError("packed_inputs needs at least one sequence")
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
    lens = [len(s) for s in seqs]
    return {"input_ids": torch.cat(seqs), "position_ids": torch.cat([torch.arange(n, dtype=torch.long) for n in lens]),
            "cu_seqlens": torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32), "max_seqlen": max(lens)}


def micro_batch(prompts: list, responses: list, rows: list[int], device=None) -> dict:
    """Pack rows (prompt + response token ids) into one micro-batch; `sel` are the packed positions whose
    next token is a response token, (`row`, `col`) where each lands in the [len(rows), R] tensors. `row_ids`
    stays a host list, so indexing the batch's CPU tensors by it never waits for the device."""
    mb = packed_inputs([prompts[i] + responses[i] for i in rows]) if rows else {
        "input_ids": torch.zeros(0, dtype=torch.long), "position_ids": torch.zeros(0, dtype=torch.long),
        "cu_seqlens": torch.zeros(1, dtype=torch.int32), "max_seqlen": 0}
    plen = torch.tensor([len(prompts[i]) for i in rows], dtype=torch.long)
    rlen = torch.tensor([len(responses[i]) for i in rows], dtype=torch.long)
    row = torch.repeat_interleave(torch.arange(len(rows)), rlen)
    col = torch.arange(int(rlen.sum())) - torch.repeat_interleave(torch.cumsum(rlen, 0) - rlen, rlen)
    sel = mb["cu_seqlens"][:-1].long()[row] + plen[row] - 1 + col
    mb.update(sel=sel, row=row, col=col, rows=torch.tensor(rows, dtype=torch.long), row_ids=list(rows),
              targets=mb["input_ids"][sel + 1])
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in mb.items()}


def dp_micro_batches(prompts: list, responses: list, rows: list[int], max_tokens: int, dp_size: int,
                     dp_rank: int, device=None) -> list[dict]:
    """DP rank `dp_rank`'s micro-batches of `rows`, balanced over the dp_size ranks by tokens."""
    lens = [len(prompts[i]) + len(responses[i]) for i in rows]
    plan = pack_micro_batches(lens, max_tokens, dp_size)[dp_rank]
    return [micro_batch(prompts, responses, [rows[j] for j in mbi], device) for mbi in plan]


def scatter_rows(mb: dict, values: torch.Tensor, R: int) -> torch.Tensor:
    """Per-token values of a micro-batch -> [rows, R] (differentiable)."""
    return values.new_zeros(len(mb["rows"]), R).index_put((mb["row"], mb["col"]), values)


# ----------------------------------------------------------------------------- dataset preparation

GSM8K_INSTRUCTION = " Let's think step by step and output the final answer after \"####\"."


def _write_parquet(rows: list[dict], path: str) -> None:
    atomic_write(path, lambda tmp: pq.write_table(pa.Table.from_pylist(rows), tmp))


def prepare_gsm8k(src: str, out: str) -> None:
    """GSM8K JSONL (question, answer) -> verl-schema train.parquet / test.parquet."""
    splits = {}  # both splits are read and checked before anything is written
    for split in ("train", "test"):
        if not os.path.isfile(path := os.path.join(src, f"{split}.jsonl")):
            raise FileNotFoundError(f"{path} does not exist (expected GSM8K's {split}.jsonl in {src})")
        rows = splits[split] = []
        with open(path) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    ex = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: line {line_no}: not valid JSON ({e})") from None
                if not (isinstance(ex, dict) and isinstance(ex.get("question"), str)
                        and isinstance(ex.get("answer"), str)):
                    raise ValueError(f"{path}: line {line_no}: expected an object with string 'question' and 'answer', "
                                     f"got {line.strip()[:100]}")
                if "####" not in ex["answer"]:
                    raise ValueError(f"{path}: line {line_no}: answer has no '####' final-answer marker")
                truth = ex["answer"].split("####")[-1].replace(",", "").strip()
                if not re.fullmatch(r"-?[0-9]+(\.[0-9]+)?", truth):  # (verl's preparation reads "-?[0-9.,]+")
                    raise ValueError(f"{path}: line {line_no}: the final answer after '####' is {truth!r}, "
                                     "not a number")
                rows.append({"prompt": [{"role": "user", "content": ex["question"] + GSM8K_INSTRUCTION}],
                             "data_source": "openai/gsm8k", "ability": "math",
                             "reward_model": {"style": "rule", "ground_truth": truth},
                             "extra_info": {"split": split, "index": len(rows), "question": ex["question"],
                                            "answer": ex["answer"]}})
        if not rows:
            raise ValueError(f"{path} holds no examples")
    for split, rows in splits.items():  # (atomic_write makes `out`)
        path = os.path.join(out, f"{split}.parquet")
        _write_parquet(rows, path)
        print(f"wrote {len(rows)} rows to {path}")


SYNTHETIC_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SYNTHETIC_CHARS = " 0123456789copy+="  # kept tiny: a random policy hits the right digit now and then
SYNTHETIC_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>{% endif %}")


def synthetic_tokenizer():
    """One token per character of SYNTHETIC_CHARS, with a role-free chat template.

    Built as a byte-level BPE without merges, i.e. exactly Qwen2's tokenizer pipeline: transformers 5
    loads any model_type "qwen2" directory with its Qwen2 tokenizer class, which rebuilds the
    pre-tokenizer and decoder, so only a tokenizer of that shape survives the round trip unchanged."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Byte-level BPE spells the space byte as "\u0120"; the other characters stand for themselves.
    chars = ["\u0120" if c == " " else c for c in SYNTHETIC_CHARS]
    tok = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(SYNTHETIC_SPECIALS + chars)}, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SYNTHETIC_SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=SYNTHETIC_TEMPLATE)


def prepare_synthetic(out: str, task: str = "copy", n_train: int = 2000, n_test: int = 200, seed: int = 0) -> None:
    """A task a tiny random model learns by RL alone: parquet files plus a model dir (tokenizer, config)."""
    if task not in ("copy", "add"):
        raise ValueError(f"task={task!r}; expected 'copy' or 'add'")
    if n_train < 1 or n_test < 1:  # an empty split would be a parquet file without columns
        raise ValueError(f"n_train={n_train} and n_test={n_test} (--n-train, --n-test): each must be >= 1")
    if seed < 0:
        raise ValueError(f"seed={seed} (--seed) must be >= 0")
    model_dir = os.path.join(out, "model")
    os.makedirs(model_dir, exist_ok=True)
    for split, n, s in zip(("train", "test"), (n_train, n_test), np.random.SeedSequence(seed).spawn(2)):
        rng, rows = np.random.default_rng(s), []
        for i in range(n):
            a = int(rng.integers(10))
            if task == "copy":
                content, truth = f"copy {a}", str(a)
            else:
                b = int(rng.integers(10 - a))  # a + b <= 9: the answer is one digit
                content, truth = f"{a}+{b}=", str(a + b)
            rows.append({"prompt": [{"role": "user", "content": content}], "data_source": f"synthetic/{task}",
                         "ability": "synthetic", "reward_model": {"style": "rule", "ground_truth": truth},
                         "extra_info": {"split": split, "index": i}})
        _write_parquet(rows, os.path.join(out, f"{split}.parquet"))
    tok = synthetic_tokenizer()
    ids = tok.convert_tokens_to_ids
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": -(-len(tok) // 8) * 8,
        "tie_word_embeddings": True, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 128,
        "hidden_act": "silu", "torch_dtype": "float32", "initializer_range": 0.02, "attention_dropout": 0.0,
        "use_sliding_window": False, "eos_token_id": ids("<|im_end|>"), "bos_token_id": ids("<|endoftext|>"),
        "pad_token_id": ids("<|endoftext|>")}
    with tempfile.TemporaryDirectory(dir=out) as tmp:  # save_pretrained is not atomic; each rename is
        tok.save_pretrained(tmp)
        pathlib.Path(tmp, "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in os.listdir(tmp):
            atomic_write(os.path.join(model_dir, name), lambda dst: shutil.copyfile(os.path.join(tmp, name), dst))
    print(f"wrote synthetic/{task}: {n_train} train + {n_test} test prompts and {model_dir}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Prepare verl-schema parquet datasets.")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gsm8k", help="GSM8K train/test.jsonl -> parquet")
    g.add_argument("--src", required=True)
    g.add_argument("--out", required=True)
    s = sub.add_parser("synthetic", help="a tiny task plus a tiny model config, for CPU runs")
    s.add_argument("--out", required=True)
    s.add_argument("--task", choices=["copy", "add"], default="copy")
    for flag, default in (("--n-train", 2000), ("--n-test", 200), ("--seed", 0)):
        s.add_argument(flag, type=int, default=default)
    a = p.parse_args(argv)
    if a.cmd == "gsm8k":
        prepare_gsm8k(a.src, a.out)
    else:
        prepare_synthetic(a.out, a.task, a.n_train, a.n_test, a.seed)


if __name__ == "__main__":
    main()
