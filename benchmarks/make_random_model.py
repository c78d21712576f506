"""A model directory for running the real configs without downloading a model: Qwen2.5-7B's config.json (or the
0.5B or 1.5B shape of bench_step.py, or a tiny one for a CPU check) and a byte-level BPE tokenizer trained on GSM8K's questions and answers, with Qwen's chat
specials and template. The weights come from `actor.random_init=true`. The 7B shape's 152,064-row head and embedding
are kept: the trainer samples over the config's vocabulary, as vLLM and transformers do, so a random model also draws
ids past the tokenizer's (they decode to nothing; a trained model gives them no mass).

    python benchmarks/make_random_model.py --src ../shared/data/gsm8k --out models/random-7b
    python benchmarks/make_random_model.py --shape 0.5b --out models/qwen2.5-0.5b-random    # configs/gpu_smoke.yaml
    python data.py gsm8k --src ../shared/data/gsm8k --out data/gsm8k
    torchrun --nproc_per_node=8 train.py configs/7b.yaml actor.model_path=models/random-7b actor.random_init=true
"""
import argparse
import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_step import SHAPES  # noqa: E402
from tests.helpers import CHAT_TEMPLATE, SPECIALS  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=32000)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default="../shared/data/gsm8k",
                    help="the directory of GSM8K's train.jsonl (the tokenizer's corpus)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", choices=list(SHAPES), default="7b", help="Qwen2.5's shape (default: 7b)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model of the same family (CPU checks)")
    a = ap.parse_args()
    if os.path.exists(a.out):
        sys.exit(f"--out {a.out!r} already exists; choose a new directory")
    if not os.path.isfile(os.path.join(a.src, "train.jsonl")):
        sys.exit(f"--src {a.src!r}: expected a directory holding GSM8K's train.jsonl")
    with open(os.path.join(a.src, "train.jsonl")) as f:
        texts = [t for line in f for t in json.loads(line).values()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=32000, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    t.chat_template = CHAT_TEMPLATE
    tmp = a.out + ".tmp"  # nothing half-written under --out
    t.save_pretrained(tmp)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(dict(SHAPES[a.shape], **(TINY if a.tiny else {}), eos_token_id=t.eos_token_id), f, indent=1)
    os.rename(tmp, a.out)
    print(f"wrote {a.out}: {len(t)} tokenizer entries, EOS {t.eos_token}={t.eos_token_id}")


if __name__ == "__main__":
    main()
