"""Rule-based rewards: turn a generated response into a number.

RL post-training on reasoning tasks needs no learned reward model: the answer is pulled out of the response with a
fixed rule and compared with the ground truth. Every scorer has verl's signature
    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict
where `data_source` (a dataset column) picks the rule; a dict result carries "score" and extra numbers to log ("acc").

The rules:
  openai/gsm8k   strict: the last "#### <number>" in the last 300 characters of the response; flexible: the last
                 number anywhere. Commas and "$" are dropped, then the strings are compared exactly, as verl does
                 ("72.0" does not match "72"; the reference answers are all integers). The extraction is a little
                 more lenient than verl's: "#### $18" and a sentence-ending "#### 18." count.
  MATH           the last \\boxed{...} (or \\fbox{...}, braces balanced) is normalized (\\dfrac -> \\frac,
                 \\frac12 -> \\frac{1}{2}, units, \\left/\\right, ...) and compared with the normalized ground truth;
                 two plain numbers or simple fractions are compared exactly as rationals (0.5 == \\frac{1}{2}).
  math_dapo      DAPO's rule: in the last 300 characters, the last line holding "Answer:", from its first "Answer:"
                 to the line's end, in Minerva's normal form (the value after the last "=", units and $..$ dropped);
                 +1 if equal to the (unboxed) ground truth's, or equivalent as for MATH, else -1, returned as
                 {"score", "acc", "pred"}. Also used for "math", "math_dapo_reasoning" and "aime*", as in verl.
  synthetic/*    toy tasks (data.py): the stripped response starts with the ground truth (for "add", no digit follows).

`load_reward_fn("path/to/file.py:function")` plugs in a user's scorer with the same signature, and `score_batch`
runs a scorer over a batch without letting one bad sample crash the run."""
from __future__ import annotations

import importlib.util
import inspect
import logging
import math
import numbers
import os
import re
import sys
from fractions import Fraction
from typing import Callable

import numpy as np

logger = logging.getLogger(__name__)
_NUMBER = (numbers.Real, np.bool_)  # numpy's bool is not registered as a numbers.Real (its ints and floats are)

# --------------------------------------------------------------------------- GSM8K

_SOLUTION_CLIP_CHARS = 300  # the final answer sits at the end; also bounds regex time on runaway outputs


def gsm8k_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                score: float = 1.0) -> float:
    """The final answer, the last "#### N" (strict) or the last number (flexible), against the ground truth as a
    string: `score` if equal, `format_score` if it differs, 0 if no answer was found."""
    text = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = re.findall(r"#### \$?(-?[0-9.,]+)", text)
    elif method == "flexible":
        found = [f for f in re.findall(r"-?[0-9.,]+", text) if f.strip(".,-")]
    else:
        raise ValueError(f"unknown gsm8k method {method!r}; valid: strict, flexible")
    if not found:
        return 0.0
    answer = found[-1].replace(",", "").rstrip(".")  # "18." ends a sentence
    return score if answer == ground_truth.strip().replace(",", "") else format_score


# --------------------------------------------------------------------------- MATH


def last_boxed_only_string(text: str) -> str | None:
    """The last "\\boxed{...}" / "\\fbox{...}" with balanced braces, as "\\boxed{...}" also when written
    "\\boxed {...}"; or "\\boxed x" up to "$"; or None."""
    if (idx := max(text.rfind("\\boxed"), text.rfind("\\fbox"))) < 0:
        return None
    m = re.compile(r"\\(boxed|fbox)( *)").match(text, idx)
    name, start = "\\" + m.group(1), m.end()
    if not text.startswith("{", start):
        return text[idx:].split("$")[0] if name == "\\boxed" and m.group(2) else None
    depth = 0
    for j in range(start, len(text)):
        depth += (text[j] == "{") - (text[j] == "}")
        if depth == 0:  # back to 0 only at the brace that closes text[start]
            return name + text[start:j + 1]
    return None  # unbalanced: the response was cut off inside the box


def remove_boxed(boxed: str) -> str:
    """"\\boxed{x}" -> "x" (also \\fbox{x} and "\\boxed x")."""
    for prefix in ("\\boxed ", "\\boxed{", "\\fbox{"):
        if boxed.startswith(prefix):
            return boxed[len(prefix):] if prefix.endswith(" ") else boxed[len(prefix):-1]
    return boxed


def strip_math_string(s: str) -> str:
    """Normalize a MATH answer so that equal answers usually become equal strings."""
    # a LaTeX space "\ " goes before "\\" (a matrix row break) becomes "\", so that the row break survives
    s = re.sub(r"(?<!\\)\\ ", "", s.strip().replace("\n", "").replace("\\!", "")).replace("\\\\", "\\")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\displaystyle", "")
    s = re.sub(r"\^\{?\\circ\}?", "", s).replace("°", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = s.replace("{,}", ",").replace("\\,", "").replace("\\;", "").replace("\\:", "").replace("~", "")
    # a trailing unit: 5\text{ cm}, 5\mathrm{cm}; not one \mathrm letter, a constant as often as a unit (2\mathrm{i});
    # verl's rule first: a \text{ ...} opening with a space is a unit, whatever it holds (5\text{ m/s}, 4\text{ p.m.})
    s = re.sub(r"^(.+?)\\text\{ [^{}]*\}(\^\{?-?\d+\}?|/\\text\{[^{}]*\})*\.?$", r"\1", s)  # (m^2, m/\text{s})
    s = re.sub(r"^(.+?)\\(?:text\{|mbox\{|mathrm\{(?=\s*[a-zA-Z]\s*[a-zA-Z]))[a-zA-Z\s]*\}(\^\{?\d\}?)?$", r"\1", s)
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}", r"\1", s).strip().rstrip(".").strip()  # \text{word}
    if s.count("=") == 1 and len(s.split("=")[0].strip()) <= 2:  # "x = 5", "k=3" -> the value
        s = s.split("=")[1]
    if re.fullmatch(r"\s*-?[1-9]\d{0,2}(,\d{3})+(\.\d+)?\s*", s):  # thousands separators; not "1, 100", "0,125"
        s = s.replace(",", "")
    s = s.replace(" ", "")
    s = re.sub(r"\\sqrt(\\[a-zA-Z]+|[0-9a-zA-Z])", r"\\sqrt{\1}", s)  # \sqrt2, \sqrt\pi
    s = re.sub(r"\\frac(\\[a-zA-Z]+|[0-9a-zA-Z])", r"\\frac{\1}", s)  # \frac12 -> \frac{1}2, \frac\pi2
    s = re.sub(r"(\\frac\{[^{}]*\})([0-9a-zA-Z])", r"\1{\2}", s)  # \frac{1}2 -> \frac{1}{2}
    s = re.sub(r"\^([0-9a-zA-Z])", r"^{\1}", s)  # LaTeX reads x^23 as x^{2}3
    if m := re.fullmatch(r"(-?\d+)/(\d+)", s):
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    s = re.sub(r"(?<![0-9])\.(?=[0-9])", "0.", s)  # .5 -> 0.5
    s = re.sub(r"(\d)\.0+(?![0-9.])", r"\1", s)  # 72.0 -> 72 (and 1.0.1 stays)
    return s


def _as_rational(s: str) -> Fraction | None:
    """A normalized answer as an exact rational when it is a number or \\frac of two integers."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    try:
        if m:
            return (-1 if m.group(1) else 1) * Fraction(int(m.group(2)), int(m.group(3)))
        return Fraction(s) if re.fullmatch(r"-?\d+(\.\d+)?", s) else None
    except (ZeroDivisionError, ValueError):  # (ValueError: past Python's 4300-digit limit for int(str))
        return None


def is_equiv(a: str | None, b: str | None) -> bool:
    """Two MATH answers are equal after normalization, as strings or as exact rationals."""
    if a is None or b is None:
        return False
    sa, sb = strip_math_string(a), strip_math_string(b)
    if sa == sb:
        return True
    ra, rb = _as_rational(sa), _as_rational(sb)
    return ra is not None and ra == rb


def math_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the last boxed answer of the response equals the ground truth, else 0.0."""
    boxed = last_boxed_only_string(solution_str)
    ground_truth = remove_boxed(last_boxed_only_string(ground_truth) or ground_truth)  # a boxed ground truth too
    return float(boxed is not None and is_equiv(remove_boxed(boxed), ground_truth))


# DAPO normalizes answers as Minerva does (Lewkowycz et al. 2022, appendix D): these rewrites, then these words and
# marks deleted wherever they occur (units, mostly; not Minerva's "ft", as in verl: it cut \left to \le), then the
# insides of $..$, \text, \textbf, \overline, \boxed kept
MINERVA_REWRITES = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
MINERVA_DELETED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
                   "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters",
                   "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}",
                   "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ",
                   "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots")


def normalize_final_answer(answer: str) -> str:
    """DAPO's (Minerva's) normal form of an answer: "$m+n = 25$" -> "25", "120 degrees" -> "120", "1,000" -> "1000"."""
    answer = answer.split("=")[-1]
    for old, new in MINERVA_REWRITES:
        answer = answer.replace(old, new)
    for word in MINERVA_DELETED:
        answer = answer.replace(word, "")
    answer = re.sub(r"^.*?\$(.*?)\$.*$", r"$\1$", answer, flags=re.S)  # the first $...$
    for command in ("text", "textbf", "overline"):
        answer = re.sub(rf"\\{command}\{{(.*?)\}}", r"\1", answer)
    answer = re.sub(r"\\boxed\{(.*)\}", r"\1", answer)
    answer = re.sub(r"frac([^{])(.)", r"frac{\1}{\2}", answer)
    answer = re.sub(r"sqrt([^{])", r"sqrt{\1}", answer).replace("$", "")
    return (answer.replace(",", "") if answer.replace(",", "").isdigit() else answer).strip()


def math_dapo_score(solution_str: str, ground_truth: str) -> dict:
    """DAPO: pred = the rest of the last line holding "Answer:" (case-insensitive, after its first one) in the last 300
    characters, in DAPO's normal form; score +1.0 if it equals the ground truth's (unboxed if boxed), else -1.0 (also
    when no answer is given). Equal is DAPO's string equality, or else is_equiv (0.5 = \\frac{1}{2}, "1,000." =
    1000): every answer DAPO counts right counts right here."""
    found = re.findall(r"(?i)answer\s*:\s*([^\n]+)", solution_str[-_SOLUTION_CLIP_CHARS:])
    pred = normalize_final_answer(found[-1]) if found else "[INVALID]"
    truth = normalize_final_answer(remove_boxed(last_boxed_only_string(ground_truth) or ground_truth))
    correct = bool(found) and is_equiv(pred, truth)  # (equal strings are equivalent)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


# --------------------------------------------------------------------------- synthetic tasks (data.py)


def synthetic_score(data_source: str, solution_str: str, ground_truth: str) -> float:
    """1.0 if the left-stripped response starts with the ground truth (for "add": and no digit follows)."""
    text = solution_str.lstrip()
    digit_follows = text[len(ground_truth):len(ground_truth) + 1].isdigit()
    return float(text.startswith(ground_truth) and not (data_source == "synthetic/add" and digit_follows))


# --------------------------------------------------------------------------- dispatch

MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")  # as verl routes them
KNOWN_SOURCES = ("openai/gsm8k", *MATH_SOURCES, *DAPO_SOURCES, "aime*", "synthetic/copy", "synthetic/add")


def compute_score(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: dict | None = None) -> float | dict:
    """Score one response with the rule chosen by `data_source` (see the module docstring)."""
    check_sources([data_source])
    if data_source == "openai/gsm8k":
        return gsm8k_score(solution_str, ground_truth)
    elif data_source in MATH_SOURCES:
        return math_score(solution_str, ground_truth)
    elif data_source in DAPO_SOURCES or data_source.startswith("aime"):
        return math_dapo_score(solution_str, ground_truth)
    return synthetic_score(data_source, solution_str, ground_truth)


def check_sources(sources, where: str = "") -> None:
    """Raise unless compute_score has a rule for every data_source given. The trainer checks its datasets' sources at
    start-up: a typo would otherwise score each sample 0.0 and train on nothing."""
    if bad := [s for s in sources if not (isinstance(s, str) and (s in KNOWN_SOURCES or s.startswith("aime")))]:
        raise ValueError(f"{where}no rule-based scorer for data_source {bad[0]!r}; known: {', '.join(KNOWN_SOURCES)} "
                         "(or a scorer of your own: reward.fn=path/to/file.py:function)")


# --------------------------------------------------------------------------- user scorers and batches


def load_reward_fn(spec: str | None) -> Callable:
    """None -> compute_score; "path/to/file.py:function" -> that function, checked for verl's signature. The scorer is
    called with keyword arguments (as verl does), so its parameters must carry these names."""
    if spec is None:
        return compute_score
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"reward function spec {spec!r} must look like 'path/to/file.py:function'")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"reward function file not found: {path!r} (from {spec!r})")
    module_spec = importlib.util.spec_from_file_location(f"nanorl_user_reward_{abs(hash(path))}", path)
    if module_spec is None:
        raise ValueError(f"reward function file {path!r} (from {spec!r}) is not a Python source file (.py)")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # as an import would: dataclasses and pickle look modules up there
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file: say which one broke, keep the original traceback
        del sys.modules[module_spec.name]
        raise ImportError(f"reward function file {path!r} failed to import: {type(e).__name__}: {e}") from e
    if not callable(fn := getattr(module, name, None)):
        present = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"{path!r} has no function {name!r}; callables present: {', '.join(present) or 'none'}")
    try:
        inspect.signature(fn).bind(data_source="", solution_str="", ground_truth="", extra_info=None)
    except TypeError as e:
        raise TypeError(f"reward function {spec!r} must have the signature "
                        f"fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict: {e}") from None
    return fn


def _finite(x, key: str, data_source: str) -> float:
    try:
        x = float(x)
    except OverflowError:  # an int past a float's range
        x = math.inf
    if not math.isfinite(x):  # a NaN "acc" would read as a missing one (train.py), a NaN score poison the advantages
        raise ValueError(f"reward function returned {key} {x} for data_source {data_source!r}; "
                         "expected a finite number")
    return x


def score_batch(reward_fn: Callable, data_sources: list[str], solution_strs: list[str], ground_truths: list[str],
                extra_infos: list[dict | None] | None) -> tuple[list[float], dict[str, list], int]:
    """Score every sample; returns (scores, extras, num_errors).

    A dict result gives its "score"; its other numeric keys (bools count) go to `extras`, one list per key aligned with
    the batch (None where a sample lacked the key), and its "pred" (the extracted answer, any type) to extras["pred"]
    when any sample has one: validation's majority vote (maj@k). A scorer that raises is logged and scores 0.0, its
    extras too (a DAPO filter on "acc" would otherwise stop on one malformed sample). A result that is neither a number
    nor a dict with "score", or a score or extra that is NaN or infinite, is a bug in the scorer and raises."""
    extra_infos = [None] * len(solution_strs) if extra_infos is None else extra_infos
    scores, extra_rows, preds, num_errors = [], [], [], 0  # extra_rows: per sample, its numeric extras (None: raised)
    for i in range(len(solution_strs)):
        try:
            result = reward_fn(data_source=data_sources[i], solution_str=solution_strs[i],
                               ground_truth=ground_truths[i], extra_info=extra_infos[i])
        except Exception as e:  # one malformed sample must not end a long run
            logger.warning("reward function failed on sample %d (data_source=%r): %r", i, data_sources[i], e)
            num_errors += 1
            scores.append(0.0)
            extra_rows.append(None)
            preds.append(None)
            continue
        if isinstance(result, _NUMBER):
            result = {"score": result}
        if not (isinstance(result, dict) and isinstance(result.get("score"), _NUMBER)):
            raise TypeError(f"reward function returned {type(result).__name__} for data_source {data_sources[i]!r}; "
                            "expected a number or a dict with a numeric 'score'")
        numbers = {k: _finite(v, k, data_sources[i]) for k, v in result.items()
                   if k != "pred" and isinstance(v, _NUMBER)}
        scores.append(numbers.pop("score"))
        preds.append(result.get("pred"))
        extra_rows.append(numbers)
    keys = dict.fromkeys(k for row in extra_rows if row for k in row)  # in order of first appearance
    extras = {k: [0.0 if row is None else row.get(k) for row in extra_rows] for k in keys}
    return scores, extras | ({"pred": preds} if any(p is not None for p in preds) else {}), num_errors


# --------------------------------------------------------------------------- validation metrics


def _best_worst(v: np.ndarray, k: int) -> list[float]:
    """Mean and std of the max, then of the min, of k draws with replacement from v, exactly (verl estimates them
    with 1000 bootstrap draws): over v sorted, P(max = v_j) = ((j+1)/n)^k - (j/n)^k; the min's weights are reversed."""
    s = np.sort(v)
    w = np.diff((np.arange(len(s) + 1) / len(s)) ** k)
    out = []
    for p in (w, w[::-1]):
        mean = float(p @ s)
        out += [mean, math.sqrt(max(float(p @ s ** 2) - mean ** 2, 0.0))]
    return out


def _answer_ids(votes: list) -> np.ndarray:
    """Each sample's answer as a small int, equal answers equal (by repr: any answer type is hashable so)."""
    order = {}
    return np.array([order.setdefault(repr(p), len(order)) for p in votes])


def _majority(v: np.ndarray, ids: np.ndarray, k: int, rng: np.random.Generator, draws: int = 1000) -> list[float]:
    """Mean and std, over bootstrap draws of k samples, of the value of the majority answer's (`ids`) first sample; a
    tie goes to the answer drawn first (verl's maj@k, which keeps the first-inserted of tied dict keys)."""
    idx = rng.integers(len(v), size=(draws, k))
    pick = ids[idx]
    hit = pick[:, :, None] == np.arange(ids.max() + 1)  # [draws, k, answers]
    win = (hit.sum(1) * (k + 1) - hit.argmax(1)).argmax(1)  # the most votes, then the earliest first draw
    got = v[idx[np.arange(draws), (pick == win[:, None]).argmax(1)]]
    return [float(got.mean()), float(got.std())]


def validation_metrics(data_sources: list[str], uids: list, values: list[dict[str, float]],
                       preds: list | None = None, seed: int = 42) -> dict[str, float]:
    """verl's validation metrics from every sample of a validation: its data source, its prompt (uid; n samples a
    prompt), its values ("reward" and the scorer's numeric extras, NaN or absent where it gave none) and its pred (the
    scorer's "pred", None where it gave none). Per data source and variable, each the mean over prompts of: mean@n
    and std@n of the prompt's n values; best@k and worst@k (mean and std of the max and the min of k of them drawn
    with replacement, k = 2, 4, ... up to n); where it gives preds, maj@k (the value of the majority answer among k
    drawn, by bootstrap). Named val-core/<source>/<var>/<metric> for the core variable ("acc" if the scorer gives
    one, else "reward") and its mean, best and maj at k = n, val-aux/... for the rest, as verl."""
    rng, groups, out = np.random.default_rng(seed), {}, {}
    for i, (src, uid) in enumerate(zip(data_sources, uids)):
        groups.setdefault(src, {}).setdefault(uid, []).append(i)
    for src, prompts in groups.items():
        names = dict.fromkeys(k for rows in prompts.values() for i in rows for k, x in values[i].items()
                              if not math.isnan(x))  # (NaN or absent: the sample has no such value)
        core = "acc" if "acc" in names else "reward"
        for var in names:
            per_prompt = {}  # metric name -> its value for each prompt
            for rows in prompts.values():
                rows = [i for i in rows if not math.isnan(values[i].get(var, math.nan))]
                v, n = np.array([values[i][var] for i in rows], dtype=np.float64), len(rows)
                if n == 0:
                    continue
                got = {f"mean@{n}": float(v.mean()), **({f"std@{n}": float(v.std())} if n > 1 else {})}
                votes = [preds[i] for i in rows] if preds else []  # (a prompt whose samples gave none: no maj@k)
                ids = _answer_ids(votes) if any(p is not None for p in votes) else None
                for k in [2 ** e for e in range(1, n.bit_length()) if 2 ** e < n] + [n] * (n > 1):
                    got.update(zip((f"{w}@{k}/{s}" for w in ("best", "worst") for s in ("mean", "std")),
                                   _best_worst(v, k)))
                    if ids is not None:
                        got.update(zip((f"maj@{k}/mean", f"maj@{k}/std"), _majority(v, ids, k, rng)))
                for name, x in got.items():
                    per_prompt.setdefault(name, []).append(x)
            at = {name: int(name.split("@")[1].split("/")[0]) for name in per_prompt}  # its n or k
            n_max = max(at.values(), default=0)
            for name, xs in per_prompt.items():
                core_metric = var == core and name.startswith(("mean", "maj", "best")) and at[name] == n_max
                out[f"{'val-core' if core_metric else 'val-aux'}/{src}/{var}/{name}"] = float(np.mean(xs))
    return out
