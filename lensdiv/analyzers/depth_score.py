"""``depth-score`` — the multi-hop depth score by difficulty grade (SCIENCE.md A5).

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
  three unrelated facts as in training;
- ``arith``: chained additions ``3+4+2=`` graded by the number of operations (1..4);
- a JSONL file of ``{"prompt": ..., "answer": ..., "grade": ...}`` rows.

Tokenisation rule: ``[BOS] + tokens(prompt) + tokens(answer)``, each part tokenised on its own
without special tokens, so ``t`` is exactly where the answer starts (put a leading space in the
answer if the tokenizer expects one).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo, Step
from lensdiv.core.errors import DataError
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.data.corpus import KnowledgeBase
from lensdiv.data.sources import read_task_jsonl
from lensdiv.data.tokenizer import NAME
from lensdiv.ops.resume import resumer_for
from lensdiv.ops.skipping import Intervals, later_effect, skip_effects

BUILTIN = ("auto", "kb", "arith")


def depth_score(effect: Float[Tensor, "*batch skipped"]) -> Float[Tensor, "*batch"]:
    """Centre of mass ``Σ_s s·e_s / Σ_s e_s`` over the last axis (NaN where all ``e_s`` are 0)."""
    s = torch.arange(effect.shape[-1], dtype=effect.dtype, device=effect.device)
    total = effect.sum(-1)
    return torch.where(total > 0, (effect * s).sum(-1) / total, torch.full_like(total, math.nan))


def kb_examples(per_grade: int, seed: int) -> list[tuple[str, str, str]]:
    """The toy knowledge base's k-hop queries, asked as in the training documents."""

    asked = KnowledgeBase(seed=0).asked(per_grade, seed=seed + 1)
    return [
        (prompt, answer, f"{hops}-hop") for hops, rows in asked.items() for prompt, answer in rows
    ]


def arith_examples(per_grade: int, seed: int) -> list[tuple[str, str, str]]:
    """Chained single-digit additions; the grade is the number of operations (1..4)."""
    rng = random.Random(f"arith-{seed}")
    out = []
    for ops in range(1, 5):
        for _ in range(per_grade):
            terms = [rng.randint(1, 9) for _ in range(ops + 1)]
            out.append(("+".join(map(str, terms)) + "=", str(sum(terms)), f"{ops}-op"))
    return out


def read_examples(path: str) -> list[tuple[str, str, str]]:
    """``{"prompt", "answer", "grade"}`` rows of a JSONL file; one clear error per bad line."""

    rows = read_task_jsonl(
        path,
        ("prompt", "answer", "grade"),
        what="depth-score examples",
        option="depth-score.tasks",
        numbers=("grade",),
    )
    return [(str(r["prompt"]), str(r["answer"]), str(r["grade"])) for _, r in rows]


def _grade_key(grade: str) -> tuple[float, str]:
    """Order grades numerically where they start with a number (``2-hop`` < ``10-hop``)."""
    digits = ""
    for ch in grade:
        if not (ch.isdigit() or (ch == "." and digits)):
            break
        digits += ch
    return (float(digits) if digits else math.inf, grade)


@dataclass(frozen=True)
class DepthScore(Analyzer):
    """Multi-hop depth score by difficulty grade.

    Args:
        tasks: ``auto``, ``kb``, ``arith`` or a JSONL file of ``prompt``/``answer``/``grade`` rows.
        per_grade: Examples per grade for the built-in tasks.
        batch_size: Examples per forward pass.
        seed: Seed of the built-in examples.
    """

    name = "depth-score"
    aliases = ("depthscore", "multihop")
    description = "Multi-hop depth score: where skipping a layer affects the answer, by grade"
    extra_forwards = True

    tasks: str = "auto"
    per_grade: int = 32
    batch_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.per_grade < 1 or self.batch_size < 1:
            raise ValueError("per_grade and batch_size must be positive")

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(layer) for layer in range(info.n_layers + 1)]

    def examples(self, model: Any, info: ModelInfo) -> list[Batch]:
        tokenizer = model.tokenizer
        tasks = self.tasks
        if tasks == "auto":
            tasks = "kb" if getattr(tokenizer, "name_or_path", "") == NAME else "arith"
        if tasks == "kb":
            rows = kb_examples(self.per_grade, self.seed)
        elif tasks == "arith":
            rows = arith_examples(self.per_grade, self.seed)
        else:
            rows = read_examples(tasks)
        unk = tokenizer.unk_token_id
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        encoded = []
        for i, (prompt, answer, grade) in enumerate(rows, 1):
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
            encoded.append((bos + p + a, len(bos) + len(p), grade))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        batches = []
        for index, lo in enumerate(range(0, len(encoded), self.batch_size)):
            chunk = encoded[lo : lo + self.batch_size]
            width = max(len(ids) for ids, _, _ in chunk)
            tokens = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.bool)
            for r, (ids, _, _) in enumerate(chunk):
                tokens[r, : len(ids)] = torch.tensor(ids)
                mask[r, : len(ids)] = True
            extra = {
                "split": torch.tensor([t for _, t, _ in chunk]),
                "grade": [g for _, _, g in chunk],
                "tasks": tasks,
            }
            batches.append(Batch(tokens, mask, bos=bool(bos), index=index, extra=extra))
        return batches

    def update(self, state: Stats, step: Step) -> None:
        batch = step.batch
        device = batch.tokens.device
        split = batch.extra["split"].to(device)[:, None]
        pos = torch.arange(batch.tokens.shape[1], device=device)
        intervals = Intervals(
            rows=torch.arange(batch.tokens.shape[0], device=device),
            skip=(pos >= 1) & (pos < split) & batch.mask,
            measure=(pos >= split) & batch.mask,
        )
        effect, output = skip_effects(step, intervals, resumer=resumer_for(step))
        layer_e = torch.stack([later_effect(e) for e in effect])  # [example, skipped]
        scores = {"layer": depth_score(layer_e), "output": depth_score(output)}
        state.put("tasks", batch.extra.get("tasks"))
        for grade in dict.fromkeys(batch.extra["grade"]):
            rows = torch.tensor([g == grade for g in batch.extra["grade"]], device=device)
            state.include("grades", grade)
            state.add(f"{grade}/n", int(rows.sum()))
            state.add(f"{grade}/E", effect[rows].sum(0))
            state.add(f"{grade}/layer_e", layer_e[rows].sum(0))
            state.add(f"{grade}/output_e", output[rows].sum(0))
            for kind, score in scores.items():
                ok = rows & ~score.isnan()
                state.add(f"{grade}/{kind}_n", int(ok.sum()))
                state.add(f"{grade}/{kind}_sum", score[ok].sum())
                state.add(f"{grade}/{kind}_sq", (score[ok] ** 2).sum())

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        L = info.n_layers
        grades = sorted(state.get("grades", ()), key=_grade_key)
        if not grades:
            raise ValueError("no examples were processed")
        columns: dict[str, list] = {"grade": grades, "examples": []}
        for kind in ("layer", "output"):
            columns[f"score_{kind}"] = []
            columns[f"mean_{kind}"] = []
            columns[f"se_{kind}"] = []
        profiles: dict[str, list] = {"skipped": list(range(L))}
        for grade in grades:
            n = float(state[f"{grade}/n"])
            columns["examples"].append(int(n))
            for kind in ("layer", "output"):
                e = state[f"{grade}/{kind}_e"] / n
                columns[f"score_{kind}"].append(float(depth_score(e)))
                k = float(state[f"{grade}/{kind}_n"])
                mean = float(state[f"{grade}/{kind}_sum"]) / k if k else math.nan
                var = float(state[f"{grade}/{kind}_sq"]) / k - mean**2 if k else math.nan
                se = math.sqrt(max(var, 0.0) / (k - 1)) if k > 1 else math.nan
                columns[f"mean_{kind}"].append(mean)
                columns[f"se_{kind}"].append(se)
                profiles[f"{kind}:{grade}"] = e.tolist()
        table = Table(
            "depth_score", columns, "Depth score (centre of mass of skip effects) by grade"
        )
        scores = table["score_layer"]
        slope = _slope(scores)
        summary = (
            "Layer-effect depth score by grade: "
            + ", ".join(f"{g} {v:.2f}" for g, v in zip(grades, scores, strict=True))
            + f" (blocks 0..{L - 1}; uniform effects would give {(L - 1) / 2:.1f})."
        )
        if len(grades) > 1:
            change = float(scores[-1] - scores[0])
            summary += (
                f" From {grades[0]} to {grades[-1]} it moves by {change:+.2f} blocks "
                f"({100 * change / max(L - 1, 1):+.0f}% of the depth; slope {slope:+.2f} per grade)."
            )
        return Result(
            analyzer=self.name,
            summary=summary,
            tables={
                "depth_score": table,
                "profile": Table(
                    "profile", profiles, "Mean effect e_s of skipping block s, by grade"
                ),
            },
            arrays={
                f"effect:{g}": (state[f"{g}/E"] / float(state[f"{g}/n"])).cpu().numpy()
                for g in grades
            },
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
                "tasks": state.get("tasks", self.tasks),
                "grades": grades,
                "slope_per_grade": slope,
                "split": "first answer token",
            },
        )


def _slope(values: Any) -> float:
    """Least-squares slope of ``values`` against their index (0 for fewer than two)."""
    import numpy as np

    y = np.asarray(values, dtype=float)
    ok = ~np.isnan(y)
    if ok.sum() < 2:
        return 0.0
    x = np.arange(len(y))[ok]
    return float(np.polyfit(x, y[ok], 1)[0])
