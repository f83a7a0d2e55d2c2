"""``depth-score`` — the multi-hop depth score by difficulty grade (docs/science.md A5).

Each example is a prompt, its answer and a grade (number of hops, level). The future-effect skip
of :mod:`lensdiv.analyzers.skip` is applied with the split at the first answer token ``t``: block
``s`` is skipped at positions ``1 ≤ τ < t`` and the effects are measured at the answer positions
``t' ≥ t``. Per skipped block

    e_s = Σ_{l>s} E[s, l] / max(L − 1 − s, 1)        (layer effect; the output effect uses O[s])
    depth score = Σ_s s·e_s / Σ_s e_s                 (centre of mass over skipped blocks)

If harder examples used more layers, the score would grow with the grade; the depth-efficiency
paper finds it does not.

Examples (option ``tasks``):
- ``auto``: ``kb`` for models with lensdiv's byte tokenizer (the toy zoo), ``arith`` otherwise;
- ``kb``: the toy knowledge base's k-hop queries ``friend(boss(ka))=`` (k = 1..4), asked after
  three unrelated facts as in training. 1-hop queries are the facts; 2–4-hop ones are chains of
  the training split (option ``chains=seen``, the default: the toy can answer them, whether by
  composing facts or by recalling the chain) or held-out chains (``chains=unseen``: compositions
  no training document holds, so only a model that composes facts answers them);
- ``arith``: chained additions ``3+4+2=`` graded by the number of operations (1..4);
- a JSONL file of ``{"prompt": ..., "answer": ..., "grade": ...}`` rows.

Tokenisation rule: ``[BOS] + tokens(prompt) + tokens(answer)``, each part tokenised on its own
without special tokens, so ``t`` is exactly where the answer starts (put a leading space in the
answer if the tokenizer expects one).

A centre of mass of skip effects on examples the model cannot answer is not a finding, so the
result also gives, per grade, the model's **accuracy** (greedy decoding of the whole answer, read
off the clean pass teacher-forced), a **prior baseline** (the accuracy of the best answer that
ignores the example's content: for ``kb`` the most common end of the query's relation chain over
all start entities, for ``arith`` the most likely sum, for a file the grade's most common answer),
the one-sided exact binomial p-value of the accuracy against that baseline, and the depth score of
the correctly answered examples alone. Grades whose accuracy is not significantly above the
baseline (p ≥ 0.05) get a warning in ``Result.warnings``.

Which model is scored (option ``model``): ``auto`` scores the analysed model, except that on a
toy model of lensdiv's zoo with the ``kb`` tasks it scores ``toy:kb``, the toy trained for the
knowledge-base queries (the zoo answers 2–4-hop queries at the prior baseline); ``self`` always
scores the analysed model; any other value is a model spec (same tokenizer) to score instead.
The scored model is named in the summary and in ``meta["scored_model"]``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo, RunContext, Step
from lensdiv.core.bridge import Bridge
from lensdiv.core.errors import DataError, LensdivError, OptionError
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.data.corpus import CHAINS, KnowledgeBase
from lensdiv.data.tasks import read_task_jsonl
from lensdiv.data.tokenizer import NAME
from lensdiv.models.load import load_model
from lensdiv.models.toy import KB_TOY
from lensdiv.ops.capture import capture
from lensdiv.ops.resume import Resumer, resumer_for
from lensdiv.ops.skipping import Intervals, later_effect, skip_effects
from lensdiv.ops.surgery import answered

BUILTIN = ("auto", "kb", "arith")
#: Significance level below which a grade's accuracy counts as above its prior baseline.
ALPHA = 0.05

# One example: (prompt, answer, grade, prior baseline accuracy of the example).
Example = tuple[str, str, str, float]


def depth_score(effect: Float[Tensor, "*batch skipped"]) -> Float[Tensor, "*batch"]:
    """Centre of mass ``Σ_s s·e_s / Σ_s e_s`` over the last axis (NaN where all ``e_s`` are 0)."""
    s = torch.arange(effect.shape[-1], dtype=effect.dtype, device=effect.device)
    total = effect.sum(-1)
    return torch.where(total > 0, (effect * s).sum(-1) / total, torch.full_like(total, math.nan))


def kb_examples(per_grade: int, seed: int, chains: str = "seen") -> list[Example]:
    """The toy knowledge base's k-hop queries, asked as in the training documents (2–4-hop ones
    from the training split's chains, or held out: ``chains``); the prior baseline of each is
    :meth:`KnowledgeBase.prior_accuracy` of its relation chain."""
    kb = KnowledgeBase(seed=0)
    asked = kb.asked_queries(per_grade, seed=seed + 1, chains=chains)
    return [
        (prompt, q.answer, f"{hops}-hop", kb.prior_accuracy(q.relations))
        for hops, rows in asked.items()
        for q, prompt in rows
    ]


def arith_examples(per_grade: int, seed: int) -> list[Example]:
    """Chained single-digit additions; the grade is the number of operations (1..4). The prior
    baseline is the probability of the most likely sum of that many terms."""
    rng = random.Random(f"arith-{seed}")
    out = []
    for ops in range(1, 5):
        baseline = _mode_probability(ops + 1)
        for _ in range(per_grade):
            terms = [rng.randint(1, 9) for _ in range(ops + 1)]
            out.append(("+".join(map(str, terms)) + "=", str(sum(terms)), f"{ops}-op", baseline))
    return out


def _mode_probability(terms: int) -> float:
    """Probability of the most likely sum of ``terms`` independent digits uniform on 1..9."""
    dist = [1.0]
    for _ in range(terms):
        nxt = [0.0] * (len(dist) + 9)
        for total, p in enumerate(dist):
            for digit in range(1, 10):
                nxt[total + digit] += p / 9
        dist = nxt
    return max(dist)


def read_examples(path: str) -> list[Example]:
    """``{"prompt", "answer", "grade"}`` rows of a JSONL file; one clear error per bad line.

    The prior baseline of every example of a grade is the share of the grade's most common
    answer (always giving that answer scores this much).
    """
    rows = read_task_jsonl(
        path,
        ("prompt", "answer", "grade"),
        what="depth-score examples",
        option="depth-score.tasks",
        numbers=("grade",),
    )
    parsed = [(str(r["prompt"]), str(r["answer"]), str(r["grade"])) for _, r in rows]
    answers: dict[str, list[str]] = {}
    for _, answer, grade in parsed:
        answers.setdefault(grade, []).append(answer)
    majority = {g: max(a.count(x) for x in set(a)) / len(a) for g, a in answers.items()}
    return [(p, a, g, majority[g]) for p, a, g in parsed]


def _grade_key(grade: str) -> tuple[float, str]:
    """Order grades numerically where they start with a number (``2-hop`` < ``10-hop``)."""
    digits = ""
    for ch in grade:
        if not (ch.isdigit() or (ch == "." and digits)):
            break
        digits += ch
    return (float(digits) if digits else math.inf, grade)


@dataclass(frozen=True)
class Scored:
    """The model whose depth score is measured, when it is not the analysed one.

    Args:
        model: The ``TransformerBridge``.
        info: Its facts.
        label: Its name in the result.
    """

    model: Bridge
    info: ModelInfo
    label: str


@dataclass(frozen=True)
class DepthScore(Analyzer):
    """Multi-hop depth score by difficulty grade, with the model's accuracy per grade.

    Args:
        tasks: ``auto``, ``kb``, ``arith`` or a JSONL file of ``prompt``/``answer``/``grade`` rows.
        per_grade: Examples per grade for the built-in tasks.
        batch_size: Examples per forward pass.
        seed: Seed of the built-in examples.
        model: ``auto`` (the analysed model; ``toy:kb`` in place of a toy zoo model on the
            ``kb`` tasks), ``self`` (always the analysed model) or a model spec to score instead.
        chains: ``kb`` tasks: 2–4-hop queries from the training split's chains (``seen``) or
            held out (``unseen``: compositions no training document holds).
    """

    name = "depth-score"
    aliases = ("depthscore", "multihop")
    description = "Multi-hop depth score: where skipping a layer affects the answer, by grade"
    depth_profiles = ()
    extra_forwards = True

    tasks: str = "auto"
    per_grade: int = 32
    batch_size: int = 16
    seed: int = 0
    model: str = "auto"
    chains: str = "seen"

    def __post_init__(self) -> None:
        if self.per_grade < 1 or self.batch_size < 1:
            raise ValueError("per_grade and batch_size must be positive")
        if self.chains not in CHAINS:
            raise ValueError(f"chains must be one of {', '.join(CHAINS)}, got {self.chains!r}")
        if not self.model.strip():
            raise ValueError("model must be 'auto', 'self' or a model spec")

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(layer) for layer in range(info.n_layers + 1)]

    def _tasks(self, model: Bridge) -> str:
        if self.tasks != "auto":
            return self.tasks
        return "kb" if getattr(model.tokenizer, "name_or_path", "") == NAME else "arith"

    def examples(self, model: Bridge, info: ModelInfo) -> list[Batch]:
        tokenizer = model.tokenizer
        tasks = self._tasks(model)
        if tasks == "kb":
            rows = kb_examples(self.per_grade, self.seed, self.chains)
        elif tasks == "arith":
            rows = arith_examples(self.per_grade, self.seed)
        else:
            rows = read_examples(tasks)
        unk = tokenizer.unk_token_id
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        encoded = []
        for i, (prompt, answer, grade, baseline) in enumerate(rows, 1):
            p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            a = tokenizer(answer, add_special_tokens=False)["input_ids"]
            if not a or (unk is not None and unk in a) or max(a) >= info.d_vocab:
                raise DataError(
                    f"depth-score example {i}: answer {answer!r} is not in the vocabulary of "
                    f"{info.name} (tokens {a})",
                    hint="use an answer the tokenizer can encode (check leading spaces)",
                )
            if not p:
                raise DataError(f"depth-score example {i}: the prompt is empty")
            encoded.append((bos + p + a, len(bos) + len(p), grade, baseline))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        batches = []
        for index, lo in enumerate(range(0, len(encoded), self.batch_size)):
            chunk = encoded[lo : lo + self.batch_size]
            width = max(len(ids) for ids, _, _, _ in chunk)
            tokens = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.bool)
            for r, (ids, _, _, _) in enumerate(chunk):
                tokens[r, : len(ids)] = torch.tensor(ids)
                mask[r, : len(ids)] = True
            extra = {
                "split": torch.tensor([t for _, t, _, _ in chunk]),
                "grade": [g for _, _, g, _ in chunk],
                "baseline": torch.tensor([b for _, _, _, b in chunk], dtype=torch.float64),
                "tasks": tasks,
            }
            batches.append(Batch(tokens, mask, bos=bool(bos), index=index, extra=extra))
        return batches

    def setup(self, model: Bridge, info: ModelInfo) -> Scored | None:
        """Load the model to score, where it is not the analysed one (see ``model``)."""
        choice = self.model.strip()
        if choice == "self":
            return None
        if choice == "auto":
            own = str(getattr(model.cfg, "model_name", ""))
            if not (self._tasks(model) == "kb" and own.startswith("toy:") and own != KB_TOY):
                return None
            choice = KB_TOY
        param = next(model.parameters())
        try:
            other = load_model(choice, device=param.device, dtype=param.dtype)
        except LensdivError as err:
            raise type(err)(f"depth-score model: {err.message}", hint=err.hint) from None
        if other.tokenizer.get_vocab() != model.tokenizer.get_vocab():
            raise OptionError(
                f"depth-score model {choice!r} does not share the tokenizer of {info.name}",
                hint="score a model with the same tokenizer, or -O depth-score.model=self",
            )
        return Scored(other, ModelInfo.from_model(other, name=choice), choice)

    def update(self, state: Stats, step: Step) -> None:
        batch = step.batch
        scored: Scored | None = step.resource(self.name)
        if scored is None:
            resumer = resumer_for(step)
            label = step.info.name
        else:
            # The example batches ran through the analysed model; score the other one here.
            names = [scored.info.resid(layer) for layer in range(scored.info.n_layers + 1)]
            _, cache = capture(scored.model, batch.tokens, names, need_logits=False)
            # The scored model's own context, kept for the run (its resumer is built once).
            context = step.cached(
                (self.name, "context"),
                lambda: RunContext(scored.model, scored.info, step.context.resources),
            )
            context.pass_index = step.pass_index
            step = Step(batch, cache, None, context=context)
            resumer = step.cached((self.name, "resumer"), lambda: Resumer(scored.model))
            label = scored.label
        device = batch.tokens.device
        split = batch.extra["split"].to(device)[:, None]
        pos = torch.arange(batch.tokens.shape[1], device=device)
        intervals = Intervals(
            rows=torch.arange(batch.tokens.shape[0], device=device),
            skip=(pos >= 1) & (pos < split) & batch.mask,
            measure=(pos >= split) & batch.mask,
        )
        effect, output = skip_effects(step, intervals, resumer=resumer)
        correct = _answered(resumer, step, intervals.measure)
        layer_e = torch.stack([later_effect(e) for e in effect])  # [example, skipped]
        scores = {"layer": depth_score(layer_e), "output": depth_score(output)}
        state.fix("tasks", batch.extra.get("tasks"))
        state.fix("scored_model", label)
        state.fix("n_layers", step.info.n_layers)
        baseline = batch.extra["baseline"].to(device)
        for grade in dict.fromkeys(batch.extra["grade"]):
            rows = torch.tensor([g == grade for g in batch.extra["grade"]], device=device)
            right = rows & correct
            state.include("grades", grade)
            state.add(f"{grade}/n", int(rows.sum()))
            state.add(f"{grade}/correct", int(right.sum()))
            state.add(f"{grade}/baseline", baseline[rows].sum())
            state.add(f"{grade}/E", effect[rows].sum(0))
            state.add(f"{grade}/layer_e", layer_e[rows].sum(0))
            state.add(f"{grade}/output_e", output[rows].sum(0))
            state.add(f"{grade}/correct_layer_e", layer_e[right].sum(0))
            for kind, score in scores.items():
                ok = rows & ~score.isnan()
                state.add(f"{grade}/{kind}_n", int(ok.sum()))
                state.add(f"{grade}/{kind}_sum", score[ok].sum())
                state.add(f"{grade}/{kind}_sq", (score[ok] ** 2).sum())

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return present(DepthScores.from_state(state, info), self)


# -- the numbers ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class GradeScore:
    """The numbers of one grade.

    Args:
        grade: The grade's name.
        examples: Examples of the grade.
        correct: Examples answered correctly (greedy decoding of the whole answer).
        baseline: The prior baseline accuracy (mean over the examples).
        profile: Mean effect ``e_s`` of skipping block ``s``, by kind (``layer``, ``output``).
        mean: Mean over examples of their own depth scores, by kind (NaN if none has one).
        se: Standard error of that mean, by kind (NaN with fewer than two scores).
        score_layer_correct: Layer-effect depth score of the correctly answered examples' mean
            profile (NaN if none).
        effect: Mean ``E[s, l]`` over the grade's examples.
    """

    grade: str
    examples: int
    correct: int
    baseline: float
    profile: Mapping[str, Float[Tensor, " skipped"]]
    mean: Mapping[str, float]
    se: Mapping[str, float]
    score_layer_correct: float
    effect: Float[Tensor, "skipped layer"]

    @property
    def accuracy(self) -> float:
        """Fraction of the examples answered correctly."""
        return self.correct / float(self.examples)

    @property
    def p_above_baseline(self) -> float:
        """One-sided exact binomial p-value of the accuracy against the prior baseline."""
        return _p_above(self.correct, self.examples, self.baseline)

    @property
    def above_baseline(self) -> bool:
        """Whether the accuracy is significantly above the prior baseline (p < :data:`ALPHA`)."""
        return self.p_above_baseline < ALPHA

    def score(self, kind: str) -> float:
        """The depth score (centre of mass) of the mean ``kind`` profile."""
        return float(depth_score(self.profile[kind]))

    @classmethod
    def from_state(cls, state: Stats, grade: str) -> GradeScore:
        """The sums of ``grade`` in a merged state, as means."""
        n = float(state[f"{grade}/n"])
        right = int(state[f"{grade}/correct"])
        mean: dict[str, float] = {}
        se: dict[str, float] = {}
        for kind in ("layer", "output"):
            k = float(state[f"{grade}/{kind}_n"])
            mean[kind] = float(state[f"{grade}/{kind}_sum"]) / k if k else math.nan
            var = float(state[f"{grade}/{kind}_sq"]) / k - mean[kind] ** 2 if k else math.nan
            se[kind] = math.sqrt(max(var, 0.0) / (k - 1)) if k > 1 else math.nan
        return cls(
            grade=grade,
            examples=int(n),
            correct=right,
            baseline=float(state[f"{grade}/baseline"]) / n,
            profile={kind: state[f"{grade}/{kind}_e"] / n for kind in ("layer", "output")},
            mean=mean,
            se=se,
            score_layer_correct=(
                float(depth_score(state[f"{grade}/correct_layer_e"] / right)) if right else math.nan
            ),
            effect=state[f"{grade}/E"] / n,
        )


@dataclass(frozen=True)
class DepthScores:
    """The depth scores of a run, grade by grade: no tables, no prose.

    Args:
        scored_model: The model whose skips were measured.
        n_layers: Its blocks.
        tasks: ``kb``, ``arith`` or the examples file (``None`` if unknown).
        grades: Every grade, in order (numeric where the names start with a number).
    """

    scored_model: str
    n_layers: int
    tasks: str | None
    grades: tuple[GradeScore, ...]

    @classmethod
    def from_state(cls, state: Stats, info: ModelInfo) -> DepthScores:
        """The numbers of a merged state (the scored model's facts are in it; ``info`` is the
        analysed model's, used where the state has none)."""
        grades = sorted(state.get("grades", ()), key=_grade_key)
        if not grades:
            raise ValueError("no examples were processed")
        return cls(
            scored_model=str(state.get("scored_model", info.name)),
            n_layers=int(state.get("n_layers", info.n_layers)),
            tasks=state.get("tasks"),
            grades=tuple(GradeScore.from_state(state, grade) for grade in grades),
        )

    def scores(self, kind: str = "layer") -> list[float]:
        """The depth score of every grade."""
        return [g.score(kind) for g in self.grades]

    @property
    def slope(self) -> float:
        """Least-squares slope of the layer-effect depth score per grade."""
        return _slope(self.scores("layer"))


# -- the result ----------------------------------------------------------------------------------
def present(numbers: DepthScores, options: DepthScore) -> Result:
    """The table, profiles, plots, summary, warnings and metadata of the depth scores."""
    grades = [g.grade for g in numbers.grades]
    tasks = numbers.tasks if numbers.tasks is not None else options.tasks
    return Result(
        analyzer=options.name,
        summary=_summary(numbers, options),
        tables={"depth_score": _table(numbers), "profile": _profile(numbers)},
        arrays={f"effect:{g.grade}": g.effect.cpu().numpy() for g in numbers.grades},
        plots=(
            Plot(
                "line",
                "depth_score",
                "Depth score by grade",
                "depth_score",
                x="grade",
                y=("score_layer", "score_output"),
                xlabel="grade",
                ylabel="depth score (layer)",
            ),
            Plot(
                "line",
                "depth_profile",
                "Layer effect e_s by grade",
                "profile",
                x="skipped",
                y=tuple(f"layer:{g}" for g in grades),
                xlabel="skipped block s",
                ylabel="e_s",
            ),
        ),
        meta={
            "tasks": tasks,
            "chains": options.chains if numbers.tasks == "kb" else None,
            "scored_model": numbers.scored_model,
            "n_layers": numbers.n_layers,
            "grades": grades,
            "slope_per_grade": numbers.slope,
            "split": "first answer token",
            "accuracy": "greedy decoding of the whole answer (teacher-forced argmax)",
            "baseline": BASELINES.get(str(tasks), BASELINES["file"]),
            "significance": ALPHA,
        },
        warnings=tuple(
            f"{g.grade}: {numbers.scored_model} answers {g.correct} of {g.examples} correctly "
            f"({g.accuracy:.0%}), not significantly above the prior baseline of "
            f"{g.baseline:.0%} (one-sided binomial p = {g.p_above_baseline:.2g}): it cannot do "
            "these examples, so their depth score does not say how it does them."
            for g in numbers.grades
            if not g.above_baseline
        ),
    )


def _table(numbers: DepthScores) -> Table:
    """One row per grade: accuracy against the baseline, then the depth scores."""
    columns: dict[str, list] = {
        "grade": [g.grade for g in numbers.grades],
        "examples": [g.examples for g in numbers.grades],
        "accuracy": [g.accuracy for g in numbers.grades],
        "baseline": [g.baseline for g in numbers.grades],
        "p_above_baseline": [g.p_above_baseline for g in numbers.grades],
    }
    for kind in ("layer", "output"):
        columns[f"score_{kind}"] = numbers.scores(kind)
        columns[f"mean_{kind}"] = [g.mean[kind] for g in numbers.grades]
        columns[f"se_{kind}"] = [g.se[kind] for g in numbers.grades]
    columns["correct"] = [g.correct for g in numbers.grades]
    columns["score_layer_correct"] = [g.score_layer_correct for g in numbers.grades]
    return Table(
        "depth_score",
        columns,
        "Depth score (centre of mass of skip effects) by grade, with the scored model's "
        "accuracy, the prior baseline and the score of the correctly answered examples",
    )


def _profile(numbers: DepthScores) -> Table:
    """The mean effect profiles ``e_s``, one column per grade and kind."""
    profiles: dict[str, list] = {"skipped": list(range(numbers.n_layers))}
    for g in numbers.grades:
        for kind in ("layer", "output"):
            profiles[f"{kind}:{g.grade}"] = g.profile[kind].tolist()
    return Table("profile", profiles, "Mean effect e_s of skipping block s, by grade")


def _summary(numbers: DepthScores, options: DepthScore) -> str:
    """The scores by grade, how far they move from the first grade to the last, the queries."""
    L, grades, scores = numbers.n_layers, numbers.grades, numbers.scores("layer")
    summary = (
        f"Layer-effect depth score of {numbers.scored_model} by grade: "
        + ", ".join(
            f"{g.grade} {v:.2f} (accuracy {g.accuracy:.0%}, baseline {g.baseline:.0%})"
            for g, v in zip(grades, scores, strict=True)
        )
        + f" (blocks 0..{L - 1}; uniform effects would give {(L - 1) / 2:.1f})."
    )
    if len(grades) > 1:
        change = float(scores[-1] - scores[0])
        summary += (
            f" From {grades[0].grade} to {grades[-1].grade} it moves by {change:+.2f} blocks "
            f"({100 * change / max(L - 1, 1):+.0f}% of the depth; slope {numbers.slope:+.2f} "
            "per grade)."
        )
    if numbers.tasks == "kb":
        summary += (
            " Queries: 2–4-hop chains of the training split (in-distribution: what the model "
            "knows, not compositional generalisation)."
            if options.chains == "seen"
            else " Queries: held-out 2–4-hop chains (compositional generalisation)."
        )
    return summary


BASELINES = {
    "kb": "most common end of the query's relation chain over all start entities",
    "arith": "probability of the most likely sum",
    "file": "share of the grade's most common answer",
}


def _answered(resumer: Resumer, step: Step, measure: Tensor) -> Tensor:
    """Per example, whether greedy decoding gives the whole answer (teacher-forced: the clean
    logits at the position before each answer token)."""
    return answered(resumer, step.batch.tokens, step.resid(step.info.n_layers), measure)


def _p_above(right: int, n: int, baseline: float) -> float:
    """One-sided exact binomial p-value of ``right`` of ``n`` against success rate ``baseline``."""
    from scipy.stats import binomtest

    if n == 0:
        return math.nan
    if baseline >= 1.0:
        return 1.0
    return float(binomtest(right, n, max(baseline, 0.0), alternative="greater").pvalue)


def _slope(values: Any) -> float:
    """Least-squares slope of ``values`` against their index (0 for fewer than two)."""
    import numpy as np

    y = np.asarray(values, dtype=float)
    ok = ~np.isnan(y)
    if ok.sum() < 2:
        return 0.0
    x = np.arange(len(y))[ok]
    return float(np.polyfit(x, y[ok], 1)[0])
