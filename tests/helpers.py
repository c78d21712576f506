"""Test helpers: tiny random Hugging Face checkpoints, a tiny tokenizer, and a
runner that executes a test body in N spawned gloo (or NCCL) processes.

Nothing here touches the network: checkpoints are built from `transformers`
config classes with random weights and written with `save_pretrained`; the
tokenizer is a byte-level BPE with no merges (256 byte tokens + 3 specials)
built with the `tokenizers` library, wrapped with a Qwen-style chat template.
"""
from __future__ import annotations

import datetime
import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_VOCAB = 272  # >= 259 tokenizer entries, divisible by 1, 2, 4, 8, 16


def make_tokenizer(out_dir: str | None = None):
    """A byte-level tokenizer (every string encodes) with a chat template; EOS is <|im_end|> (id 258)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    t = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    t.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        t.save_pretrained(out_dir)
    return t


FAMILIES = ["llama", "llama3", "mistral", "qwen2", "qwen3", "qwen2_tied"]


def hf_config(family: str, **overrides):
    """A tiny transformers config of one model family (fp32)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    base = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=258, bos_token_id=256,
                pad_token_id=256)
    if family == "llama":
        cfg = LlamaConfig(**{**base, "rope_theta": 10000.0, **overrides})
    elif family == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        cfg = LlamaConfig(**{**base, "rope_scaling": rope, **overrides})
    elif family == "mistral":
        cfg = MistralConfig(**{**base, "sliding_window": None, **overrides})
    elif family == "qwen2":
        cfg = Qwen2Config(**{**base, **overrides})
    elif family == "qwen2_tied":
        cfg = Qwen2Config(**{**base, "tie_word_embeddings": True, **overrides})
    elif family == "qwen3":
        cfg = Qwen3Config(**{**base, "head_dim": 24, **overrides})  # head_dim != hidden/heads
    else:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    return cfg


def make_checkpoint(out_dir: str, family: str = "qwen2", seed: int = 0, with_tokenizer: bool = True,
                    max_shard_size: str | None = None, **overrides) -> str:
    """Write a tiny random HF checkpoint (config.json + safetensors [+ tokenizer]) to out_dir."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default init so logits are not all ~equal
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            else:  # norms and biases: perturb so that they matter in the comparison
                p.add_(torch.randn_like(p) * 0.05)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kw)
    if with_tokenizer:
        make_tokenizer(out_dir)
    return out_dir


def hf_model(path: str):
    """The transformers reference model for a checkpoint directory (fp32, eval mode, eager attention)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


# ----------------------------------------------------------------------------- distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, result_dir, backend="gloo"):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        # a collective that waits 5 minutes is a deadlock (the slowest test takes ~15 s): fail, do not hang CI
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=300))
        out = fn(rank, world_size, *args)
        torch.save(out, os.path.join(result_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(result_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, backend: str = "gloo"):
    """Run fn(rank, world_size, *args) in world_size spawned processes (gloo; nccl: one GPU each); return the
    list of results.

    fn must be a module-level function (it is pickled). Any rank's exception fails the call
    with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as result_dir:
        try:
            mp.spawn(_worker, args=(world_size, _free_port(), fn, args, result_dir, backend), nprocs=world_size,
                     join=True)
        except Exception as e:
            errs = [open(os.path.join(result_dir, f)).read() for f in sorted(os.listdir(result_dir)) if f.endswith(".err")]
            raise RuntimeError("distributed test failed:\n" + "\n".join(errs)) from e
        return [torch.load(os.path.join(result_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
