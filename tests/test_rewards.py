"""rewards.py: GSM8K on the real test set, a table of MATH equivalences, DAPO, synthetic tasks, loading."""
import itertools
import json
import logging
import math
import os
import sys

import numpy as np
import pytest

import rewards as R

GSM8K_TEST = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k", "test.jsonl")


# --------------------------------------------------------------------------- GSM8K


def test_gsm8k_reference_answers_score_one_and_changed_answers_zero():
    assert os.path.isfile(GSM8K_TEST), f"GSM8K test set missing at {GSM8K_TEST} (shared/ must sit beside the repo)"
    with open(GSM8K_TEST) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 1319
    for row in rows:
        answer = row["answer"]
        truth = answer.split("####")[-1].strip().replace(",", "")
        assert R.compute_score("openai/gsm8k", answer, truth) == 1.0, answer[-80:]
        head, _, final = answer.rpartition("####")
        wrong = f"{head}#### {int(final.strip().replace(',', '')) + 1}"
        assert R.compute_score("openai/gsm8k", wrong, truth) == 0.0, wrong[-80:]


@pytest.mark.parametrize("solution, truth, method, expected", [
    ("Total 3 + 4 = 7\n#### 7", "7", "strict", 1.0),
    ("#### 1,234", "1234", "strict", 1.0),
    ("#### $18.", "18", "strict", 1.0),  # dollar sign and sentence-ending period dropped
    ("#### -5", "-5", "strict", 1.0),
    ("#### 5 then #### 6", "5", "strict", 0.0),  # the last occurrence counts
    ("#### 72.0", "72", "strict", 0.0),  # exact string comparison, as in verl
    ("the answer is 7", "7", "strict", 0.0),  # strict needs "####"
    ("#### 7" + " filler" * 60, "7", "strict", 0.0),  # outside the last 300 characters
    ("the answer is 1,000.", "1000", "flexible", 1.0),
    ("first 3 then 8", "3", "flexible", 0.0),
    ("no numbers at all", "3", "flexible", 0.0),
])
def test_gsm8k_cases(solution, truth, method, expected):
    assert R.gsm8k_score(solution, truth, method=method) == expected


def test_gsm8k_format_score():
    assert R.gsm8k_score("#### 3", "4", format_score=0.1) == 0.1
    assert R.gsm8k_score("nothing", "4", format_score=0.1) == 0.0
    with pytest.raises(ValueError, match="strict, flexible"):
        R.gsm8k_score("#### 3", "3", method="loose")


# --------------------------------------------------------------------------- MATH

MATH_EQUIV = [
    ("a+b=5", "5", False),  # only a short left side (x = 5) is dropped, as verl's _strip_string
    ("0.33333333333333333", "\\frac{1}{3}", False),  # compared as exact rationals, not floats
    ("\\dfrac{1}{2}", "\\frac{1}{2}", True),
    ("\\tfrac12", "\\frac{1}{2}", True),
    ("\\frac12", "\\frac{1}{2}", True),
    ("\\frac1{72}", "\\frac{1}{72}", True),
    ("1/2", "\\frac{1}{2}", True),
    ("-1/2", "-0.5", True),  # a plain fraction with a minus sign is a rational too
    ("-1/2", "-\\frac{1}{2}", True),
    ("0.5", "\\frac{1}{2}", True),
    (".5", "0.5", True),
    ("\\frac{3}{4}", "0.75", True),
    ("-\\frac{1}{2}", "-0.5", True),
    ("\\frac{-1}{2}", "-\\frac12", True),
    ("\\left( 3, 4 \\right)", "(3,4)", True),
    ("\\left[ 1, 2 \\right]", "[1,2]", True),
    ("10\\%", "10", True),
    ("5\\text{ cm}", "5", True),
    ("5\\text{ cm}^2", "5", True),
    ("\\text{Evelyn}", "Evelyn", True),
    ("x = 5", "5", True),
    ("k=3", "3", True),
    ("y = 2x+1", "2x+1", True),
    ("\\sqrt2", "\\sqrt{2}", True),
    ("2\\sqrt3", "2\\sqrt{3}", True),
    ("\\dfrac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}", True),
    ("72.0", "72", True),
    ("90^\\circ", "90", True),
    ("90^{\\circ}", "90", True),
    ("\\$18", "18", True),
    ("1,000", "1000", True),
    ("10{,}000", "10000", True),
    ("x^2+1", "x^{2}+1", True),
    ("3\\!\\cdot\\!4", "3\\cdot4", True),
    ("\\frac{1}{3}", "0.333", False),
    ("\\frac{2}{3}", "\\frac{3}{2}", False),
    ("(3,4)", "(4,3)", False),
    ("5", "-5", False),
    ("\\sqrt{2}", "\\sqrt{3}", False),
    ("1.05", "1.5", False),
    ("50\\%", "0.5", False),
    ("x^23", "x^{23}", False),  # LaTeX reads x^23 as x^{2}3
    ("12", "1,2", False),
    ("2x+1", "2x-1", False),
    ("3+2\\mathrm{i}", "3+2", False),  # one \mathrm letter is not taken for a unit
    ("5\\mathrm{cm}", "5", True),
    ("1.0.1", "1.1", False),
]


@pytest.mark.parametrize("a, b, expected", MATH_EQUIV)
def test_math_equivalence(a, b, expected):
    assert R.is_equiv(a, b) is expected
    assert R.is_equiv(b, a) is expected


@pytest.mark.parametrize("solution, truth, expected", [
    ("so the answer is $\\boxed{\\frac{1}{2}}$.", "\\frac12", 1.0),
    ("nested \\boxed{\\frac{\\sqrt{3}}{2}} ok", "\\dfrac{\\sqrt3}{2}", 1.0),
    ("first \\boxed{1} then \\boxed{2}", "2", 1.0),  # the last box counts
    ("first \\boxed{1} then \\boxed{2}", "1", 0.0),
    ("\\fbox{7}", "7", 1.0),
    ("$\\boxed 7$", "7", 1.0),
    ("the answer is 7", "7", 0.0),  # no box
    ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", 0.0),  # truncated box
    ("\\boxed{3}", "\\boxed{3}", 1.0),  # a boxed ground truth is unboxed too
    ("\\boxed {5}", "5", 1.0),  # a space before the brace
    ("\\boxed{\\frac{\\pi}{2}}", "\\frac\\pi2", 1.0),  # \frac with a command argument
    ("\\boxed{\\sqrt{\\pi}}", "\\sqrt\\pi", 1.0),
    ("\\boxed{5\\ \\text{cm}}", "5", 1.0),  # a LaTeX space before the unit
    ("\\boxed{-1/2}", "-\\frac{1}{2}", 1.0),  # a negative plain fraction
    ("\\boxed{1." + "0" * 5000 + "1}", "1", 0.0),  # past int()'s 4300 digits: not equal, not an error
])
def test_math_score(solution, truth, expected):
    for source in R.MATH_SOURCES:
        assert R.compute_score(source, solution, truth) == expected


# --------------------------------------------------------------------------- DAPO


@pytest.mark.parametrize("solution, truth, score, pred", [
    ("Reasoning...\nAnswer: 42", "42", 1.0, "42"),
    ("Reasoning...\nanswer:   42\nThanks", "42", 1.0, "42"),
    ("Answer: 41\nwait, no.\nAnswer: 42", "42", 1.0, "42"),  # the last one counts
    ("Answer: \\boxed{1,000}.", "1000", 1.0, "1,000."),  # DAPO's form keeps "1,000."; is_equiv matches it
    ("Answer: 1,000", "1000", 1.0, "1000"),  # Minerva: commas dropped when only digits remain
    ("Answer: $m+n = 25$", "25", 1.0, "25"),  # DAPO's normal form: the value after the last "="
    ("Answer: 120 degrees", "120", 1.0, "120"),  # unit words deleted
    ("Answer: $42$ cm", "42", 1.0, "42"),  # the inside of $...$
    ("Answer: \\frac12", "0.5", 1.0, "\\frac{1}{2}"),  # equal as rationals (DAPO's string test says no)
    ("Answer: 25 ways", "26", -1.0, "25"),
    ("Answer: 42\t\r\n", "42", 1.0, "42"),  # verl strips the normal form (the line keeps a \t, \r)
    ("Answer: $x = 12$", "12", 1.0, "12"),
    ("Answer: 43", "42", -1.0, "43"),
    ("Answer: 42", "\\boxed{42}", 1.0, "42"),  # a boxed ground truth is unboxed
    ("Answer: (3, \\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0, "(3,\\frac{\\pi}{2})"),  # as for MATH
    ("Answer: \\left[ 1, 2 \\right)", "[1, 2)", 1.0, "\\left[1,2\\right)"),  # not "ft" deleted: \left kept
    ("I think it is 42", "42", -1.0, "[INVALID]"),
    ("Answer: 42\n" + "more text " * 40, "42", -1.0, "[INVALID]"),  # outside the last 300 characters
])
def test_math_dapo(solution, truth, score, pred):
    for source in ("math_dapo", "aime2024"):
        result = R.compute_score(source, solution, truth)
        assert result == {"score": score, "acc": score > 0, "pred": pred}


# --------------------------------------------------------------------------- synthetic tasks


@pytest.mark.parametrize("source, solution, truth, expected", [
    ("synthetic/copy", "7", "7", 1.0),
    ("synthetic/copy", "  \n7 and more", "7", 1.0),
    ("synthetic/copy", "77", "7", 1.0),  # copy only checks the prefix
    ("synthetic/copy", "8", "7", 0.0),
    ("synthetic/copy", "", "7", 0.0),
    ("synthetic/copy", "a7", "7", 0.0),
    ("synthetic/add", "12", "12", 1.0),
    ("synthetic/add", " 12 is the sum", "12", 1.0),
    ("synthetic/add", "12.", "12", 1.0),
    ("synthetic/add", "123", "12", 0.0),  # a longer number is a different number
    ("synthetic/add", "1 2", "12", 0.0),
    ("synthetic/add", "the sum is 12", "12", 0.0),
])
def test_synthetic(source, solution, truth, expected):
    assert R.compute_score(source, solution, truth) == expected


def test_unknown_data_source():
    with pytest.raises(ValueError, match="openai/gsm8k.*synthetic/add"):
        R.compute_score("my/dataset", "x", "y")
    R.check_sources(["openai/gsm8k", "aime2024", "synthetic/add", "math_dapo", "math", "math_dapo_reasoning"])
    for source in ("math", "math_dapo_reasoning"):  # verl routes these to the DAPO rule too
        assert R.compute_score(source, "so\nAnswer: 12", "\\boxed{12}") == {"score": 1.0, "acc": True, "pred": "12"}
    for bad in ("synthetic/cpy", None, 3):
        with pytest.raises(ValueError, match=f"in x: no rule-based scorer for data_source {bad!r}; known: openai/gsm8k"):
            R.check_sources(["openai/gsm8k", bad], "in x: ")


# --------------------------------------------------------------------------- user scorers


def write(tmp_path, text, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_load_reward_fn(tmp_path):
    assert R.load_reward_fn(None) is R.compute_score
    path = write(tmp_path, "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                           "    return float(solution_str == ground_truth)\n"
                           "def loose(**kwargs):\n    return 0.5\n"
                           "def two_args(solution_str, ground_truth):\n    return 1.0\n"
                           "helper = 3\n")
    fn = R.load_reward_fn(f"{path}:score")
    assert fn(data_source="d", solution_str="a", ground_truth="a", extra_info=None) == 1.0
    assert R.load_reward_fn(f"{path}:loose")(data_source="d", solution_str="a", ground_truth="b") == 0.5
    with pytest.raises(FileNotFoundError, match="nope.py"):
        R.load_reward_fn(str(tmp_path / "nope.py") + ":score")
    with pytest.raises(ValueError, match=r"'missing'.*loose, score, two_args"):
        R.load_reward_fn(f"{path}:missing")
    with pytest.raises(ValueError, match="helper"):
        R.load_reward_fn(f"{path}:helper")  # present but not callable
    with pytest.raises(TypeError, match="data_source, solution_str, ground_truth, extra_info"):
        R.load_reward_fn(f"{path}:two_args")
    with pytest.raises(ValueError, match="path/to/file.py:function"):
        R.load_reward_fn(path)
    # a scorer module like any other: dataclasses under postponed annotations look their module up by name
    typed = write(tmp_path, "from __future__ import annotations\nimport dataclasses\n\n@dataclasses.dataclass\n"
                            "class Rule:\n    bonus: float = 0.25\n\n"
                            "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                            "    return Rule().bonus\n", name="typed.py")
    assert R.load_reward_fn(f"{typed}:score")(data_source="d", solution_str="a", ground_truth="b") == 0.25


def test_score_batch(caplog):
    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise RuntimeError("malformed sample")
        if data_source == "dict":
            return {"score": 2.0, "acc": True, "pred": "x", "len": len(solution_str)}
        return R.compute_score(data_source, solution_str, ground_truth, extra_info)

    with caplog.at_level(logging.WARNING, logger="rewards"):
        scores, extras, errors = R.score_batch(
            scorer,
            ["synthetic/copy", "synthetic/copy", "dict", "math_dapo"],
            ["3", "boom", "abc", "Answer: 5"],
            ["3", "3", "", "6"],
            None,
        )
    assert scores == [1.0, 0.0, 2.0, -1.0]
    assert errors == 1
    assert "malformed sample" in caplog.text and "synthetic/copy" in caplog.text
    # numeric extras (bools included) aligned with the batch; the failed sample's are 0.0, like its score (a DAPO
    # filter on "acc" must not see it lacking the key); "pred" as given, None where a sample has none (maj@k's votes)
    assert extras == {"acc": [None, 0.0, 1.0, 0.0], "len": [None, 0.0, 3.0, None], "pred": [None, None, "x", "5"]}
    # no "pred" at all (a numeric pred is a vote too, not an extra)
    assert R.score_batch(lambda **kw: 1.0, ["x"], ["a"], ["a"], None)[1] == {}
    assert R.score_batch(lambda **kw: {"score": 1.0, "pred": 7}, ["x"], ["a"], ["a"], None)[1] == {"pred": [7]}

    # numpy's bool is not a numbers.Real: it must count as a number all the same (np.isclose(...) as a score)
    scores, extras, _ = R.score_batch(lambda **kw: {"score": np.bool_(True), "acc": np.bool_(False), "n": np.int64(3)},
                                      ["x"], ["a"], ["a"], None)
    assert scores == [1.0] and extras == {"acc": [0.0], "n": [3.0]}
    with pytest.raises(TypeError, match="weird/source"):
        R.score_batch(lambda **kw: "1.0", ["weird/source"], ["a"], ["a"], [None])
    with pytest.raises(TypeError, match="weird/source"):
        R.score_batch(lambda **kw: {"acc": 1.0}, ["weird/source"], ["a"], ["a"], [None])
    # a non-finite score is a scorer bug (it would poison the advantages), NaN and both infinities alike, an int past
    # a float's range too (a bare OverflowError before); so is a non-finite extra (a NaN "acc" read as a missing one)
    for bad, shown in ((float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "-inf"), (10 ** 400, "inf")):
        for result, key in ((bad, "score"), ({"score": bad}, "score"), ({"score": 1, "acc": bad}, "acc")):
            with pytest.raises(ValueError, match=f"{key} {shown} for data_source 'weird/source'; expected a finite"):
                R.score_batch(lambda **kw: result, ["weird/source"], ["a"], ["a"], [None])


def test_answers_are_read_from_the_last_300_characters_exactly():
    # verl's gsm8k (_SOLUTION_CLIP_CHARS = 300) and DAPO (solution_str[-300:]) both look at the last 300 characters
    assert R.gsm8k_score("#### 7" + "x" * 294, "7") == 1.0  # 300 characters: the marker is inside
    assert R.gsm8k_score("#### 7" + "x" * 295, "7") == 0.0  # 301: the first "#" is cut off
    assert R.compute_score("math_dapo", "Answer: 42\n" + "y" * 289, "42")["score"] == 1.0  # 300 characters
    assert R.compute_score("math_dapo", "Answer: 42\n" + "y" * 290, "42")["score"] == -1.0  # "A" cut off


def test_gsm8k_flexible_ignores_punctuation_only_matches():
    # "..." matches the number pattern but holds no digit: the last *number* is 42
    assert R.gsm8k_score("so the total is 42 ...", "42", method="flexible") == 1.0


def test_gsm8k_ground_truth_commas_are_dropped():
    assert R.gsm8k_score("#### 1234", "1,234") == 1.0


@pytest.mark.parametrize("a, b, expected", [
    ("1.05", "15", False),  # only trailing zeros after the point go: 72.0 -> 72, but 1.05 stays 1.05
    ("1.05", "1.050", True),  # equal as rationals
    ("AB=5", "5", True),  # a left-hand side of up to 2 characters is dropped (verl's strip_string)
    # a matrix row break (two backslashes) is kept; a LaTeX space (one backslash and a space) goes
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", True),
    ("\\begin{pmatrix} 12 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", False),
    ("\\begin{pmatrix} 1 & 23 & 4 \\end{pmatrix}", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", False),
    ("1\\ 000", "1000", True),  # a LaTeX space
    ("1, 100", "1100", False),  # a list, not a thousands separator
    ("0,125", "125", False),
    ("12,345.5", "12345.5", True),
    # verl's unit rule: a \text{ ...} opening with a space ends the number, whatever it holds
    ("5\\text{ m/s}", "5", True),
    ("4\\text{ p.m.}", "4", True),
    ("5\\text{ cm}.", "5", True),
    ("42\\text{ (units)}", "42", True),
    ("10\\text{ m/s}^2", "10", True),  # with an exponent after it, and a period
    ("6\\text{ cm}^2.", "6", True),
    ("5\\text{ cm}^{-1}", "5", True),
    ("5\\text{ m}/\\text{s}", "5", True),  # a compound unit in two \text groups
    ("5\\text{ m}/\\text{s}^2", "5", True),
    ("2 \\text{ and } 3", "2", False),
])
def test_math_equivalence_more(a, b, expected):
    assert R.is_equiv(a, b) is expected
    assert R.is_equiv(b, a) is expected


@pytest.mark.parametrize("answer, expected", [
    ("1,000", "1000"),  # Minerva's rule: thousands commas go when only digits remain
    ("12,345,678", "12345678"),
    ("1,000.", "1,000."),  # not only digits: kept (is_equiv matches it later)
    ("(1,2)", "(1,2)"),  # a pair, not a number
])
def test_normalize_final_answer_drops_thousands_commas(answer, expected):
    assert R.normalize_final_answer(answer) == expected


def test_math_ground_truth_given_as_a_solution_uses_its_last_box():
    assert R.math_score("\\boxed{3}", "so the answer is \\boxed{3}.") == 1.0
    assert R.math_score("\\boxed{3}", "first \\boxed{2}, finally \\boxed{3}.") == 1.0


def test_load_reward_fn_rejects_a_scorer_without_extra_info(tmp_path):
    # score_batch calls scorers with extra_info=...: a 3-parameter scorer would fail on every sample
    path = tmp_path / "three.py"
    path.write_text("def score(data_source, solution_str, ground_truth):\n    return 1.0\n")
    with pytest.raises(TypeError, match="data_source, solution_str, ground_truth, extra_info"):
        R.load_reward_fn(f"{path}:score")


def test_failed_reward_import_leaves_no_half_initialised_module(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import nanorl_no_such_module\n")
    with pytest.raises(ImportError, match="failed to import"):
        R.load_reward_fn(f"{path}:score")
    assert not [k for k, v in list(sys.modules.items()) if getattr(v, "__file__", None) == str(path)]


# --------------------------------------------------------------------------- validation metrics


def _all_draws(n, k):  # every ordered k-tuple of indices 0..n-1, drawn with replacement: each equally likely
    return itertools.product(range(n), repeat=k)


def _maj_value(values, preds, draw):  # verl's calc_maj_val, written out: first-inserted answer wins a tie
    votes = {}
    for i in draw:
        votes.setdefault(preds[i], []).append(values[i])
    counts = {p: len(v) for p, v in votes.items()}
    return votes[max(counts, key=counts.get)][0]


def test_best_and_worst_of_k_match_every_draw_enumerated():
    """best@k / worst@k are the mean and std of the max / min of k values drawn with replacement: by formula,
    against all n^k draws enumerated (ties in the values included)."""
    v = np.array([0.5, -1.0, 2.0, 0.5, 1.0])
    for k in (1, 2, 3, 5):
        maxes = np.array([max(v[list(d)]) for d in _all_draws(len(v), k)])
        mins = np.array([min(v[list(d)]) for d in _all_draws(len(v), k)])
        got = R._best_worst(v, k)
        assert got == pytest.approx([maxes.mean(), maxes.std(), mins.mean(), mins.std()], abs=1e-12), k


def test_majority_of_k_matches_every_draw_enumerated():
    """maj@k by bootstrap against its exact expectation over every draw. Values 1 for answer "a", 0 for "b":
    at k = 2 a tie goes to the answer drawn first (0.5 here; 0.75 if "a" always won ties, 0.25 if "b")."""
    values, preds = np.array([1.0, 0.0]), ["a", "b"]
    got = R._majority(values, R._answer_ids(preds), 2, np.random.default_rng(0), draws=20000)
    assert got[0] == pytest.approx(0.5, abs=0.02) and got[1] == pytest.approx(0.5, abs=0.02)
    values = np.array([1.0, 0.0, 0.2, 0.8, 0.5])  # answers "x", "y", "y", "x", None: the winner's first draw counts
    preds = ["x", "y", "y", "x", None]
    for k in (2, 3, 4):
        exact = np.array([_maj_value(values, preds, d) for d in _all_draws(len(values), k)])
        got = R._majority(values, R._answer_ids(preds), k, np.random.default_rng(1), draws=20000)
        assert got == pytest.approx([exact.mean(), exact.std()], abs=0.015), k


def test_validation_metrics_names_and_values_as_verl():
    """Two data sources: "g" (a float scorer: the core variable is the reward) with 2 prompts x 4 samples, and "d"
    (acc and pred given: acc is core, the reward aux) with 1 prompt x 4. Values worked by hand."""
    sources = ["g"] * 8 + ["d"] * 4
    uids = [0] * 4 + [1] * 4 + [2] * 4
    values = [{"reward": x} for x in (1, 0, 0, 0, 1, 1, 1, 0)]
    values += [{"reward": 1.0, "acc": 1.0}, {"reward": -1.0, "acc": 0.0}, {"reward": -1.0, "acc": 0.0},
               {"reward": 1.0, "acc": math.nan}]
    preds = [None] * 8 + ["5", "6", "6", "5"]
    got = R.validation_metrics(sources, uids, values, preds)
    ks = [f"{w}@{k}/{s}" for k in (2, 4) for w in ("best", "worst") for s in ("mean", "std")]
    core_g = {"mean@4", "best@4/mean", "best@4/std"}
    assert {k for k in got if k.startswith("val-core/g/")} == {f"val-core/g/reward/{m}" for m in core_g}
    assert {k for k in got if k.startswith("val-aux/g/")} == {
        f"val-aux/g/reward/{m}" for m in {"std@4", *ks} - core_g}  # no preds for "g": no maj
    # prompt 0: 1 of 4 right, prompt 1: 3 of 4; best@2 of one right in four: 1 - (3/4)^2, of three: 1 - (1/4)^2
    assert got["val-core/g/reward/mean@4"] == pytest.approx(0.5)
    assert got["val-aux/g/reward/std@4"] == pytest.approx(np.sqrt(3 / 16))
    assert got["val-aux/g/reward/best@2/mean"] == pytest.approx(((1 - 9 / 16) + (1 - 1 / 16)) / 2)
    assert got["val-aux/g/reward/worst@2/mean"] == pytest.approx((1 / 16 + 9 / 16) / 2)
    # "d": acc is given by 3 of its 4 samples (NaN: not given), so acc has n = 3 (k = 2, 3) and the reward n = 4
    assert got["val-core/d/acc/mean@3"] == pytest.approx(1 / 3)
    assert got["val-core/d/acc/best@3/mean"] == pytest.approx(1 - (2 / 3) ** 3)
    assert "val-core/d/acc/maj@3/mean" in got and "val-aux/d/acc/maj@2/mean" in got
    assert got["val-aux/d/reward/mean@4"] == pytest.approx(0.0)
    assert not any(k.startswith("val-core/d/reward") for k in got)
    # mean@1 alone with one sample a prompt (validation's default), the reward core
    assert R.validation_metrics(["g", "g"], [0, 1], [{"reward": 1.0}, {"reward": 0.0}]) == {
        "val-core/g/reward/mean@1": 0.5}
