"""The course (``tutorials/course/``): every check passes the solutions, says "not done yet" to the
blank exercises, and gives each common mistake — a mutant of the solution — its own diagnosis.

The notebooks run like the tutorials (``LENSDIV_TUTORIAL_FAST=1``, the throw-away toy cache of
``conftest.py``), all blank notebooks then all solutions in one kernel, so the toy model loads
once. The mutants run in this process: each is the solution's source with one deliberate
mistake, and must receive exactly that mistake's diagnosis.
"""

from __future__ import annotations

import linecache
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

COURSE = Path(__file__).resolve().parents[1] / "tutorials" / "course"
SOLUTIONS = COURSE / "solutions"
sys.path.insert(0, str(SOLUTIONS))
import course_build as build  # noqa: E402  (tutorials/course/solutions/course_build.py)
from course_cells import blank, blank_body  # noqa: E402
from course_lessons import LESSONS  # noqa: E402

from lensdiv import Analyzer  # noqa: E402
from lensdiv.course import (  # noqa: E402
    checker,
    ensemble,
    logit_lens,
    patching,
    plugin,
    removal,
    skipping,
    translator,
)
from tests import test_explore_browser as explore_page  # noqa: E402

MODULES = {
    "01_logit_lens": logit_lens,
    "02_skip_a_block": skipping,
    "03_activation_patching": patching,
    "04_bias_diversity": ensemble,
    "05_remove_blocks": removal,
    "06_tuned_translator": translator,
    "07_analyzer_plugin": plugin,
}


def _solutions() -> dict[str, tuple[str, str]]:
    """``{function name: (lesson, the solution cell's source)}``."""
    out = {}
    for lesson, cells in LESSONS:
        for cell in cells:
            if cell.kind == "exercise":
                source = cell.text + cell.solution
                name = re.findall(r"^(?:def|class) (\w+)", source, re.M)[-1]
                out[name] = (lesson, source)
    return out


SOLVED = _solutions()


def _define(name: str, source: str, extra: dict[str, Any] | None = None) -> Any:
    """Run a cell's source as the notebook would (after the lessons' earlier cells) and return
    the function or class it defines."""
    namespace: dict[str, Any] = {"torch": torch, **(extra or {})}
    filename = f"<cell {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


def _earlier(lesson: str) -> dict[str, Any]:
    """What a lesson's later exercises call: its earlier solutions, and lesson 1's readout."""
    names = {
        "02_skip_a_block": [],
        "03_activation_patching": ["logit_diff", "patch_run"],
        "06_tuned_translator": [],
    }.get(lesson, ["final_norm"] if lesson == "01_logit_lens" else [])
    scope: dict[str, Any] = {"lens_logits": logit_lens.lens_logits}
    for name in names:
        scope[name] = _define(name, SOLVED[name][1], scope)
    return scope


def _exercise(name: str) -> checker.Exercise:
    lesson = SOLVED[name][0]
    return next(ex for ex in MODULES[lesson].EXERCISES if ex.name == name)


# -- every exercise: the solution passes, the blank is "not done yet" ---------------------------------


@pytest.mark.parametrize("name", list(SOLVED))
def test_solution_passes_and_blank_is_not_done(name: str) -> None:
    lesson, source = SOLVED[name]
    ex = _exercise(name)
    verdict = ex.verdict(_define(name, source, _earlier(lesson)))
    assert verdict.passed, verdict.text
    assert "\n" not in verdict.text and verdict.text.startswith("✔")
    cell = next(
        c
        for _, cells in LESSONS
        for c in cells
        if c.kind == "exercise" and c.text + c.solution == source
    )
    stub = _define(name, cell.text + blank_body(cell), _earlier(lesson))
    verdict = ex.verdict(stub)
    assert verdict.status == checker.NOT_DONE, verdict.text
    assert "not done yet" in verdict.text


# -- every diagnosis, by a mutant of the solution -------------------------------------------------------

# (function, mistake key, text in the solution, what the student wrote instead)
MUTANTS = [
    ("final_norm", "no_centre", "x = h - h.mean(-1, keepdim=True)", "x = h"),
    (
        "final_norm",
        "unbiased",
        "(x.pow(2).mean(-1, keepdim=True) + eps)",
        "(x.var(-1, keepdim=True) + eps)",
    ),
    ("final_norm", "no_affine", " * w + b", ""),
    ("final_norm", "no_weight", " * w + b", " + b"),
    ("lens_logits", "norm_forgotten", "final_norm(h, ln_w, ln_b, eps) @ W_U", "h @ W_U"),
    ("lens_logits", "bias_forgotten", "@ W_U + b_U", "@ W_U"),
    (
        "lens_logits",
        "softmax",
        "return final_norm(h, ln_w, ln_b, eps) @ W_U + b_U",
        "return (final_norm(h, ln_w, ln_b, eps) @ W_U + b_U).softmax(-1)",
    ),
    (
        "lens_logits",
        "log_softmax",
        "return final_norm(h, ln_w, ln_b, eps) @ W_U + b_U",
        "return torch.log_softmax(final_norm(h, ln_w, ln_b, eps) @ W_U + b_U, dim=-1)",
    ),
    ("kl_to_output", "reversed", "(lp.exp() * (lp - lq))", "(lq.exp() * (lq - lp))"),
    ("kl_to_output", "log2", ".sum(-1)", ".sum(-1) / torch.log(torch.tensor(2.0))"),
    ("kl_to_output", "mean_vocab", ".sum(-1)", ".mean(-1)"),
    ("kl_to_output", "raw_logits", "(lp - lq)", "(logits - out_logits)"),
    ("mean_per_layer", "pads_counted", "keep = mask.clone()", "keep = torch.ones_like(mask)"),
    (
        "mean_per_layer",
        "batch_mean",
        "return values[:, keep].mean(-1)",
        "return ((values * keep).sum(-1) / keep.sum(-1)).mean(-1)",
    ),
    ("mean_per_layer", "bos_counted", "keep[:, 0] = False", "pass"),
    ("mean_per_layer", "bos_dropped", "if exclude_bos:", "if True:"),
    (
        "mean_per_layer",
        "off_by_one",
        "keep[:, 0] = False",
        "keep[:, :-1] = mask[:, 1:]; keep[:, -1] = False",
    ),
    ("skip_hooks", "bos_skipped", 'out[:, 1:] = saved["h"][:, 1:]', 'out[:] = saved["h"]'),
    (
        "skip_hooks",
        "nothing",
        'f"blocks.{s}.hook_resid_pre", save',
        'f"blocks.{s}.hook_resid_post", save',
    ),
    ("skip_hooks", "zeroed", 'out[:, 1:] = saved["h"][:, 1:]', "out[:, 1:] = 0"),
    (
        "skip_hooks",
        "next_block",
        'return [(f"blocks.{s}',
        's = min(s + 1, 3)\n    return [(f"blocks.{s}',
    ),
    ("update_effect", "mean_positions", ".amax(-1)", ".mean(-1)"),
    (
        "update_effect",
        "relative_to_skipped",
        "d.norm(dim=-1).clamp_min",
        "e.norm(dim=-1).clamp_min",
    ),
    (
        "update_effect",
        "states",
        "d, e = clean[1:] - clean[:-1], skipped[1:] - skipped[:-1]",
        "d, e = clean[1:], skipped[1:]",
    ),
    ("update_effect", "absolute", " / d.norm(dim=-1).clamp_min(1e-6)", ""),
    (
        "output_effect",
        "logits",
        "p, q = clean_logits.softmax(-1), skipped_logits.softmax(-1)",
        "p, q = clean_logits, skipped_logits",
    ),
    ("output_effect", "mean_positions", ".amax()", ".mean()"),
    (
        "output_effect",
        "kl",
        "return (p - q).norm(dim=-1).amax()",
        "return (q * (q.log() - p.log())).sum(-1).amax()",
    ),
    (
        "logit_diff",
        "sign",
        "logits[:, -1, target] - logits[:, -1, foil]",
        "logits[:, -1, foil] - logits[:, -1, target]",
    ),
    (
        "logit_diff",
        "first_position",
        "logits[:, -1, target] - logits[:, -1, foil]",
        "logits[:, 0, target] - logits[:, 0, foil]",
    ),
    (
        "logit_diff",
        "off_by_one",
        "logits[:, -1, target] - logits[:, -1, foil]",
        "logits[:, -2, target] - logits[:, -2, foil]",
    ),
    (
        "logit_diff",
        "probs",
        "return logits[:, -1, target]",
        "logits = logits.softmax(-1)\n    return logits[:, -1, target]",
    ),
    ("patch_run", "nothing", "model.run_with_cache(clean)", "model.run_with_cache(corrupt)"),
    (
        "patch_run",
        "swapped",
        ("model.run_with_cache(clean)", "model.run_with_hooks(corrupt,"),
        ("model.run_with_cache(corrupt)", "model.run_with_hooks(clean,"),
    ),
    ("patch_run", "all_positions", "out[:, pos] = cache[name][:, pos]", "out[:] = cache[name]"),
    ("patch_run", "resid_post", "hook_resid_pre", "hook_resid_post"),
    (
        "patch_run",
        "off_by_one",
        "out[:, pos] = cache[name][:, pos]",
        "out[:, pos - 1] = cache[name][:, pos - 1]",
    ),
    ("patching_map", "unnormalised", "(m - m_corrupt) / (m_clean - m_corrupt)", "m - m_corrupt"),
    (
        "patching_map",
        "from_clean",
        "(m - m_corrupt) / (m_clean - m_corrupt)",
        "(m_clean - m) / (m_clean - m_corrupt)",
    ),
    ("patching_map", "transposed", "return out", "return out.T"),
    (
        "patching_map",
        "swapped",
        "patch_run(model, clean, corrupt, layer, pos)",
        "patch_run(model, corrupt, clean, layer, pos)",
    ),
    (
        "squared_terms",
        "sum_members",
        "return ens, bias, div",
        "return ens, bias * f.shape[0], div * f.shape[0]",
    ),
    ("squared_terms", "bias_of_mean", "return ens, bias, div", "return ens, ens, div"),
    ("squared_terms", "div_to_target", "div = (f - z)", "div = (f - onehot)"),
    (
        "squared_terms",
        "mean_vocab",
        "return ens, bias, div",
        "V = f.shape[-1]\n    return ens / V, bias / V, div / V",
    ),
    ("ce_terms", "kl_reversed", "(logp.exp() * (logp - logq))", "(logq.exp() * (logq - logp))"),
    (
        "ce_terms",
        "mean_of_softmax",
        "logp = f.mean(0).log_softmax(-1)",
        "logp = f.softmax(-1).mean(0).log()",
    ),
    (
        "ce_terms",
        "log2",
        "return ens, ce, kl",
        "return ens / 0.6931471805599453, ce / 0.6931471805599453, kl / 0.6931471805599453",
    ),
    (
        "remove_hooks",
        "bos_kept",
        'return saved["h"].clone()',
        'out = saved["h"].clone(); out[:, 0] = resid[:, 0]; return out',
    ),
    (
        "remove_hooks",
        "one_too_many",
        'hook_resid_post", replace',
        'hook_resid_post".replace(str(start + n - 1), str(min(start + n, 3))), replace',
    ),
    (
        "remove_hooks",
        "one_too_few",
        "    saved = {}",
        "    n -= 1\n    if n == 0:\n        return []\n    saved = {}",
    ),
    ("block_influence", "cos", "return (1 - c)[:, mask]", "return c[:, mask]"),
    ("block_influence", "pads_counted", "[:, mask].mean(-1)", ".flatten(1).mean(-1)"),
    (
        "block_influence",
        "batch_mean",
        "return (1 - c)[:, mask].mean(-1)",
        "return (((1 - c) * mask).sum(-1) / mask.sum(-1)).mean(-1)",
    ),
    ("angular_distance", "no_pi", "/ torch.pi", ""),
    (
        "angular_distance",
        "padded_last",
        "last = mask.sum(1) - 1",
        "last = torch.full_like(mask.sum(1), mask.shape[1] - 1)",
    ),
    ("angular_distance", "cosine", "(torch.arccos(c) / torch.pi)", "c"),
    (
        "fit_translator",
        "no_bias",
        (
            "x = torch.cat([h, torch.ones(len(h), 1, dtype=h.dtype)], 1).double()",
            "return sol[:-1], sol[-1]",
        ),
        ("x = h.double()", "return sol, torch.zeros(sol.shape[1])"),
    ),
    ("fit_translator", "transposed", "return sol[:-1], sol[-1]", "return sol[:-1].T, sol[-1]"),
    (
        "fit_translator",
        "reversed",
        "def fit_translator(h, target):",
        "def fit_translator(target, h):",
    ),
    ("tuned_loss", "lens_direction", "(lp.exp() * (lp - lq))", "(lq.exp() * (lq - lp))"),
    ("tuned_loss", "no_residual", "lens_logits(h + h @ A + b", "lens_logits(h @ A + b"),
    ("tuned_loss", "sum", ".sum(-1).mean()", ".sum()"),
    ("tuned_loss", "no_grad", ".sum(-1).mean()", ".sum(-1).mean().item()"),
    (
        "tuned_loss",
        "no_grad",
        "    logits = lens_logits(",
        "    with torch.no_grad():\n        logits = lens_logits(",
    ),
    ("tuned_loss", "no_grad", "h + h @ A + b", "h + h @ A.detach() + b"),
    # The diagnoses of every exercise (checker.GENERIC), each on one exercise.
    (
        "final_norm",
        checker.IN_PLACE,
        "x = h - h.mean(-1, keepdim=True)",
        "h -= h.mean(-1, keepdim=True)\n    x = h",
    ),
    (
        "tuned_loss",
        checker.IN_PLACE,
        "    logits = lens_logits(",
        "    params['ln_w'].mul_(1)\n    h.add_(0.5)\n    logits = lens_logits(",
    ),
    (
        "mean_per_layer",
        checker.TIMEOUT,
        "keep = mask.clone()",
        "keep = mask.clone()\n    while True:\n        pass",
    ),
    (
        "mean_per_layer",
        checker.STRUCTURE,
        "return values[:, keep].mean(-1)",
        "return values[:, keep].mean(-1).tolist()",
    ),
    (
        "squared_terms",
        checker.STRUCTURE,
        "return ens, bias, div",
        "return torch.stack([ens, bias, div])",
    ),
    ("fit_translator", checker.UNUSABLE, "return sol[:-1], sol[-1]", "return sol"),
    ("remove_hooks", checker.UNUSABLE, "replace)]", "replace)][1]"),
    (
        "ResidNorms",
        "pads_counted",
        "keep = step.batch.positions(exclude_bos=self.exclude_bos)",
        "keep = torch.ones_like(step.batch.mask)\n        if self.exclude_bos:\n            keep[:, 0] = False",
    ),
    ("ResidNorms", "bos_counted", "positions(exclude_bos=self.exclude_bos)", "positions()"),
    (
        "ResidNorms",
        "batch_mean",
        '.norm(dim=-1).sum())\n        state.add("n", keep.sum())',
        '.norm(dim=-1).mean())\n        state.add("n", torch.tensor(1))',
    ),
]


@pytest.mark.parametrize(
    ("name", "mistake", "old", "new"),
    MUTANTS,
    ids=[f"{m[0]}-{m[1]}-{i}" for i, m in enumerate(MUTANTS)],
)
def test_mutant_gets_its_diagnosis(name: str, mistake: str, old: Any, new: Any) -> None:
    lesson, source = SOLVED[name]
    olds, news = (old, new) if isinstance(old, tuple) else ((old,), (new,))
    for o, n in zip(olds, news, strict=True):
        assert o in source, f"the mutant's text is not in the solution of {name}: {o!r}"
        source = source.replace(o, n)
    mutant = _define(name, source, _earlier(lesson))
    verdict = _exercise(name).verdict(mutant)
    assert verdict.status == checker.WRONG, verdict.text
    assert verdict.mistake == mistake, verdict.text
    assert _diagnosis(_exercise(name), mistake) in verdict.text, verdict.text
    assert "expected" in verdict.text and "got" in verdict.text


def _diagnosis(ex: checker.Exercise, key: str) -> str:
    """The text a diagnosis always shows: a mistake's or requirement's own, or a generic one's
    up to its first blank ({…})."""
    if key in checker.GENERIC:
        return checker.GENERIC[key].split("{")[0]
    return next(m.diagnosis for m in [*ex.mistakes, *ex.requirements] if m.key == key)


def test_every_mistake_has_a_mutant() -> None:
    have = {(n, m) for n, m, _, _ in MUTANTS}
    for module in MODULES.values():
        for ex in module.EXERCISES:
            for mistake in [*ex.mistakes, *ex.requirements]:
                if (ex.name, mistake.key) == ("angular_distance", "all_tokens"):
                    continue  # below: tested by the checker's own mistake function
                if ex.name == "lens_logits" and mistake.key.startswith("norm_"):
                    continue  # a mutant of final_norm under a correct lens_logits: below
                assert (ex.name, mistake.key) in have, f"no mutant for {ex.name}: {mistake.key}"
    for key in checker.GENERIC:  # the diagnoses every exercise can give: a mutant somewhere
        assert any(m == key for _, m, _, _ in MUTANTS), f"no mutant for {key}"


# -- correct answers written differently: every one must pass ------------------------------------------

# (function, what is different, the whole cell's source)
ALTERNATIVES = [
    (
        "final_norm",
        "torch's own layer_norm",
        """
def final_norm(h, w, b, eps):
    return torch.nn.functional.layer_norm(h, h.shape[-1:], w, b, eps)
""",
    ),
    (
        "lens_logits",
        "an einsum and the bias through F.linear",
        """
def lens_logits(h, ln_w, ln_b, eps, W_U, b_U):
    x = torch.einsum("...d,dv->...v", final_norm(h, ln_w, ln_b, eps), W_U)
    return x + torch.nn.functional.linear(torch.zeros(1), torch.zeros(len(b_U), 1), b_U)
""",
    ),
    (
        "kl_to_output",
        "F.kl_div, target first",
        """
def kl_to_output(logits, out_logits):
    lp, lq = logits.log_softmax(-1), out_logits.log_softmax(-1)
    return torch.nn.functional.kl_div(lq, lp, reduction="none", log_target=True).sum(-1)
""",
    ),
    (
        "mean_per_layer",
        "a masked sum over a count",
        """
def mean_per_layer(values, mask, exclude_bos):
    keep = mask.clone()
    keep[:, 0] &= not exclude_bos
    return (values * keep).sum((1, 2)) / keep.sum()
""",
    ),
    (
        "skip_hooks",
        "the block's two writes zeroed after BOS",
        """
def skip_hooks(s):
    def zero(out, hook):
        out = out.clone()
        out[:, 1:] = 0
        return out

    return [(f"blocks.{s}.hook_attn_out", zero), (f"blocks.{s}.hook_mlp_out", zero)]
""",
    ),
    (
        "update_effect",
        "torch.diff, vector_norm and max",
        """
def update_effect(clean, skipped):
    d, e = torch.diff(clean, dim=0).double(), torch.diff(skipped, dim=0).double()
    top = torch.linalg.vector_norm(d - e, dim=-1)
    return (top / torch.linalg.vector_norm(d, dim=-1).clamp(min=1e-6)).max(-1).values
""",
    ),
    (
        "output_effect",
        "the square root of a sum of squares",
        """
def output_effect(clean_logits, skipped_logits):
    p, q = torch.softmax(clean_logits.double(), dim=-1), torch.softmax(skipped_logits.double(), dim=-1)
    return ((p - q) ** 2).sum(-1).sqrt().max()
""",
    ),
    (
        "logit_diff",
        "the last position selected first",
        """
def logit_diff(logits, target, foil):
    last = logits.select(1, logits.shape[1] - 1)
    return last[:, target] - last[:, foil]
""",
    ),
    (
        "patch_run",
        "a names_filter, and a hook that writes into the activation",
        """
def patch_run(model, clean, corrupt, layer, pos):
    name = f"blocks.{layer}.hook_resid_pre"
    _, cache = model.run_with_cache(clean, names_filter=lambda n: n == name)
    saved = cache[name]

    def patch(resid, hook):
        resid[:, pos] = saved[:, pos]
        return resid

    with torch.no_grad():
        return model.run_with_hooks(corrupt, fwd_hooks=[(name, patch)])
""",
    ),
    (
        "patching_map",
        "a list of rows, made a tensor at the end",
        """
def patching_map(model, clean, corrupt, target, foil):
    with torch.no_grad():
        hi = logit_diff(model(clean), target, foil).item()
        lo = logit_diff(model(corrupt), target, foil).item()
        rows = []
        for layer in range(model.cfg.n_layers):
            row = [logit_diff(patch_run(model, clean, corrupt, layer, t), target, foil).item() for t in range(clean.shape[1])]
            rows.append([(m - lo) / (hi - lo) for m in row])
    return torch.tensor(rows)
""",
    ),
    (
        "squared_terms",
        "a loop over the members, in float64",
        """
def squared_terms(f, y):
    f = f.double()
    onehot = torch.zeros_like(f[0])
    onehot[torch.arange(len(y)), y] = 1
    z = f.mean(0)
    bias = sum(((fi - onehot) ** 2).sum(-1) for fi in f) / len(f)
    div = sum(((fi - z) ** 2).sum(-1) for fi in f) / len(f)
    return ((z - onehot) ** 2).sum(-1).mean(), bias.mean(), div.mean()
""",
    ),
    (
        "ce_terms",
        "F.cross_entropy and F.kl_div",
        """
def ce_terms(f, y):
    F = torch.nn.functional
    z = f.mean(0)
    ce = torch.stack([F.cross_entropy(fi, y) for fi in f]).mean()
    logp = z.log_softmax(-1).expand_as(f)
    kl = F.kl_div(f.log_softmax(-1), logp, reduction="none", log_target=True).sum(-1).mean()
    return F.cross_entropy(z, y), ce, kl
""",
    ),
    (
        "remove_hooks",
        "every removed block made the identity",
        """
def remove_hooks(start, n):
    hooks = []
    for block in range(start, start + n):
        saved = {}

        def save(resid, hook, saved=saved):
            saved["h"] = resid.clone()
            return resid

        def replace(resid, hook, saved=saved):
            return saved["h"]

        hooks += [(f"blocks.{block}.hook_resid_pre", save), (f"blocks.{block}.hook_resid_post", replace)]
    return hooks
""",
    ),
    (
        "remove_hooks",
        "the removed blocks' attention and MLP writes zeroed",
        """
def remove_hooks(start, n):
    def zero(out, hook):
        return torch.zeros_like(out)

    return [(f"blocks.{b}.hook_{w}_out", zero) for b in range(start, start + n) for w in ("attn", "mlp")]
""",
    ),
    (
        "block_influence",
        "unit vectors by hand, a masked sum over a count",
        """
def block_influence(states, mask):
    u = states.double() / states.double().norm(dim=-1, keepdim=True)
    c = (u[:-1] * u[1:]).sum(-1)
    return ((1 - c) * mask).sum((1, 2)) / mask.sum()
""",
    ),
    (
        "angular_distance",
        "the last real token found by argmax of a cumulative sum",
        """
def angular_distance(states, mask, start, n):
    last = mask.long().cumsum(1).argmax(1)
    rows = torch.arange(len(last))
    a, b = states[start, rows, last].double(), states[start + n, rows, last].double()
    c = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    return torch.arccos(c.clamp(-1, 1)).mean() / torch.pi
""",
    ),
    (
        "fit_translator",
        "both sides centred, then the offset from the means",
        """
def fit_translator(h, target):
    h, target = h.double(), target.double()
    mh, mt = h.mean(0), target.mean(0)
    W = torch.linalg.lstsq(h - mh, target - mt).solution
    return W, mt - mh @ W
""",
    ),
    (
        "tuned_loss",
        "F.kl_div with batchmean",
        """
def tuned_loss(A, b, h, out_logits, params):
    lq = lens_logits(h + (h @ A + b), **params).log_softmax(-1)
    lp = out_logits.log_softmax(-1)
    return torch.nn.functional.kl_div(lq, lp, reduction="batchmean", log_target=True)
""",
    ),
    (
        "ResidNorms",
        "vector_norm, the mask by hand, one tensor of sums",
        '''
from dataclasses import dataclass

from lensdiv import Analyzer, Result, Table


@dataclass(frozen=True)
class ResidNorms(Analyzer):
    """Mean norms.

    Args:
        exclude_bos: Leave the BOS position out.
    """

    name = "resid-norms"
    description = "Mean norm of every residual state"
    exclude_bos: bool = True

    def hooks(self, info):
        return [info.resid(layer) for layer in range(info.n_layers + 1)]

    def update(self, state, step):
        keep = step.batch.mask.clone()
        if self.exclude_bos:
            keep[:, 0] = False
        norms = [torch.linalg.vector_norm(step.resid(l)[keep].double(), dim=-1).sum() for l in range(step.info.n_layers + 1)]
        state.add("sums", torch.stack(norms))
        state.add("count", keep.sum().double())

    def finalize(self, state, info):
        mean = (state["sums"] / state["count"]).tolist()
        table = Table("resid_norms", {"layer": list(range(len(mean))), "mean_norm": mean})
        return Result(self.name, tables={"resid_norms": table})
''',
    ),
]


@pytest.mark.parametrize(
    ("name", "how", "source"),
    ALTERNATIVES,
    ids=[f"{a[0]}-{i}" for i, a in enumerate(ALTERNATIVES)],
)
def test_correct_alternative_passes(name: str, how: str, source: str) -> None:
    lesson = SOLVED[name][0]
    student = _define(name, source.strip("\n") + "\n", _earlier(lesson))
    verdict = _exercise(name).verdict(student)
    assert verdict.passed, f"{how}:\n{verdict.text}"


def test_every_exercise_has_a_correct_alternative() -> None:
    assert set(SOLVED) <= {name for name, _, _ in ALTERNATIVES}


def test_fallback_final_norm_keeps_the_dtype() -> None:
    """The reference (what the notebook uses until the student's passes) keeps float64 float64."""
    h = checker.randn(2, 3, 8, seed=1).double()
    w, b = checker.randn(8, seed=2), checker.randn(8, seed=3)
    out = logit_lens.final_norm(h, w, b, 1e-5)
    assert out.dtype == torch.float64
    want = torch.nn.functional.layer_norm(h, (8,), w.double(), b.double(), 1e-5)
    torch.testing.assert_close(out, want)
    assert logit_lens.final_norm(h.float(), w, b, 1e-5).dtype == torch.float32


def test_a_changed_argument_is_named() -> None:
    """An input changed in place is named, a tensor in a dict by its key."""
    lesson, source = SOLVED["tuned_loss"]
    source = source.replace(
        "    logits = lens_logits(", "    params['ln_w'].mul_(2)\n    logits = lens_logits("
    )
    verdict = translator.TUNED_LOSS.verdict(_define("tuned_loss", source, _earlier(lesson)))
    assert verdict.mistake == checker.IN_PLACE and "`params`['ln_w']" in verdict.text, verdict.text


def test_a_wrong_number_shows_where_it_differs() -> None:
    """Expected and got: the first entries that differ, by index, not the first 8 values."""

    def late(h: Any, w: Any, b: Any, eps: float) -> Any:
        out = logit_lens.final_norm(h, w, b, eps).clone()
        out.view(-1)[-1] += 1.0  # the last entry only
        return out

    verdict = logit_lens.FINAL_NORM.verdict(late)
    assert verdict.mistake is None
    assert "first entries that differ:" in verdict.text and "at [0, 15]:" in verdict.text, (
        verdict.text
    )


def test_an_error_in_a_plugin_is_shown_at_its_line() -> None:
    """A plugin that raises inside a run: the real error and the student's line, not a bare
    StopIteration (a run reports a failing analyzer in one line)."""
    lesson, source = SOLVED["ResidNorms"]
    broken = source.replace('state.add("n", keep.sum())', 'state.add("n", keep.sum() / undefined)')
    verdict = plugin.PLUGIN.verdict(_define("ResidNorms", broken))
    assert verdict.status == checker.ERROR, verdict.text
    assert "NameError" in verdict.text and "keep.sum() / undefined" in verdict.text, verdict.text
    assert "StopIteration" not in verdict.text


def test_a_value_of_another_kind_is_named() -> None:
    """A list of the right numbers: "a list …, not a tensor …" and that the numbers are right;
    integers for floats: the dtypes."""
    listed = logit_lens.MEAN_PER_LAYER.verdict(
        lambda v, m, x: logit_lens.mean_per_layer(v, m, x).tolist()
    )
    assert listed.mistake == checker.STRUCTURE, listed.text
    assert "a list of 3 floats, not a tensor of shape [3]" in listed.text, listed.text
    assert "The numbers are right" in listed.text
    rounded = patching.LOGIT_DIFF.verdict(lambda z, t, f: patching.logit_diff(z, t, f).long())
    assert "expected dtype torch.float32, got torch.int64" in rounded.text, rounded.text


def test_a_plugin_result_lensdiv_cannot_read_is_said() -> None:
    """A result without the exercise's column: what it has instead, not a KeyError."""
    lesson, source = SOLVED["ResidNorms"]
    renamed = source.replace('"mean_norm": mean', '"norm": mean')
    verdict = plugin.PLUGIN.verdict(_define("ResidNorms", renamed))
    assert verdict.mistake == checker.UNUSABLE, verdict.text
    assert "no column 'mean_norm' (it has ['layer', 'norm'])" in verdict.text, verdict.text


def _spin(h: Any, w: Any, b: Any, eps: float) -> Any:
    while True:
        pass


def test_the_time_limit_stops_a_check_off_the_main_thread() -> None:
    """Off the main thread (no SIGALRM there) the work runs in a daemon thread that is stopped
    by an exception; no thread is left running."""
    ex = checker.Exercise(
        "final_norm", logit_lens.final_norm, logit_lens.FINAL_NORM.cases, time_limit=(0.5, 1.0)
    )
    box: dict[str, Any] = {}
    caller = threading.Thread(target=lambda: box.setdefault("v", ex.verdict(_spin)))
    caller.start()
    caller.join(60)
    assert box["v"].mistake == checker.TIMEOUT, box["v"].text
    for _ in range(50):  # the worker gets the exception at its next line
        if not any(t.name == "lensdiv-course-check" for t in threading.enumerate()):
            break
        time.sleep(0.1)
    assert not any(t.name == "lensdiv-course-check" for t in threading.enumerate())
    lesson, source = SOLVED["remove_hooks"]  # and a right answer passes there, hooks and all
    solved = _define("remove_hooks", source, _earlier(lesson))
    caller = threading.Thread(target=lambda: box.update(v=removal.REMOVE_HOOKS.verdict(solved)))
    caller.start()
    caller.join(120)
    assert box["v"].passed, box["v"].text


@pytest.mark.usefixtures("kernel_env")
def test_the_time_limit_stops_a_check_in_a_kernel(tmp_path: Path) -> None:
    """In a Jupyter kernel (cells run in its main thread: SIGALRM) a hanging answer is stopped,
    the kernel lives on and runs the next cell."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "from lensdiv.course import checker\n"
            "ex = checker.Exercise('double', lambda x: x * 2, lambda: [checker.Case('one', (1.0,))], time_limit=(1.0, 1.0))\n"
            "def double(x):\n    while True:\n        pass\n"
            "double = ex.check(double)"
        ),
        nbformat.v4.new_code_cell("print('next cell', double(2.0))"),
    ]
    nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    first = "".join(o.get("text", "") for o in nb.cells[0].outputs)
    second = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert "✘ double: stopped after 1 s" in first, first
    assert "next cell 4.0" in second, second


def test_mistakes_the_mutants_cannot_reach_are_still_diagnosed() -> None:
    """The all-token angle (a mutant would rewrite the whole solution), by the checker's own
    mistake function."""
    ex = removal.ANGULAR_DISTANCE
    wrong = next(m for m in ex.mistakes if m.key == "all_tokens")
    assert ex.verdict(wrong.compute).mistake == "all_tokens"


@pytest.mark.parametrize("key", ["no_centre", "unbiased", "no_affine"])
def test_a_wrong_final_norm_is_named_in_lens_logits(key: str) -> None:
    """lens_logits built on a mutant final_norm: the diagnosis points at the norm."""
    old, new = next((o, n) for f, k, o, n in MUTANTS if f == "final_norm" and k == key)
    norm = _define("final_norm", SOLVED["final_norm"][1].replace(old, new))
    student = _define("lens_logits", SOLVED["lens_logits"][1], {"final_norm": norm})
    verdict = logit_lens.LENS_LOGITS.verdict(student)
    assert verdict.mistake == f"norm_{key}", verdict.text


def test_student_error_shows_their_line_only() -> None:
    source = "def kl_to_output(logits, out_logits):\n    p = logits.softmax(-1)\n    return p @ out_logits\n"
    verdict = logit_lens.KL_TO_OUTPUT.verdict(_define("kl_to_output", source))
    assert verdict.status == checker.ERROR
    assert "return p @ out_logits" in verdict.text and "RuntimeError" in verdict.text
    assert "lensdiv/course" not in verdict.text and "checker.py" not in verdict.text


def test_returning_none_is_not_done() -> None:
    verdict = logit_lens.FINAL_NORM.verdict(lambda h, w, b, eps: None)
    assert verdict.status == checker.NOT_DONE


def test_unknown_mistake_shows_expected_and_got_on_the_smallest_input() -> None:
    verdict = logit_lens.FINAL_NORM.verdict(lambda h, w, b, eps: h * 2)
    assert verdict.status == checker.WRONG and verdict.mistake is None
    assert "1 random vector of 16 numbers" in verdict.text  # the smallest input


def test_check_returns_the_reference_until_the_exercise_passes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    header = "def final_norm(h, w, b, eps):\n"
    stub = _define("final_norm", header + blank(header))
    assert logit_lens.check_final_norm(stub) is logit_lens.final_norm
    assert "not done yet" in capsys.readouterr().out


@dataclass(frozen=True)
class _FixedPerBatch(plugin.ResidNorms):
    def update(self, state: Any, step: Any) -> None:
        super().update(state, step)
        state.fix("rows", torch.tensor(step.batch.tokens.shape[0]))  # differs in the last batch


@dataclass(frozen=True)
class _Undocumented(plugin.ResidNorms):
    """Mean norms."""

    scale: float = 1.0


@dataclass
class _NotFrozen(Analyzer):
    """Mean norms.

    Args:
        exclude_bos: Leave BOS out.
    """

    name = "not-frozen"
    description = "not frozen"
    exclude_bos: bool = True

    def hooks(self, info: Any) -> list[str]:
        return [info.resid(0)]

    def update(self, state: Any, step: Any) -> None:
        state.add("n", step.batch.mask.sum())

    def finalize(self, state: Any, info: Any) -> Any:
        return plugin.ResidNorms().finalize(state, info)


@pytest.mark.parametrize(
    ("cls", "pattern"),
    [
        (plugin._PadsCounted, r"pad positions \(their content\)"),
        (plugin._BatchMean, "rows cut"),
        (_FixedPerBatch, "fixed statistic"),
        (_Undocumented, "docstring"),
        (_NotFrozen, "frozen|dataclass"),
    ],
    ids=["pads", "batch-mean", "fixed", "undocumented", "not-frozen"],
)
def test_contract_diagnoses(cls: Any, pattern: str) -> None:
    """Each way to break the contract that the course names, by a plugin that breaks it."""
    verdict = plugin.contract_verdict(cls)
    assert verdict.status == checker.WRONG and verdict.mistake == pattern, verdict.text
    assert {p for p, _ in plugin.CONTRACT_DIAGNOSES} == {
        r"pad positions \(their content\)",
        "rows cut",
        "fixed statistic",
        "docstring",
        "frozen|dataclass",
    }


def test_contract_passes_the_reference() -> None:
    assert plugin.contract_verdict(plugin.ResidNorms).passed


# -- the notebooks ------------------------------------------------------------------------------------


def test_notebooks_are_built_from_the_lessons() -> None:
    for path, text in build.build().items():
        assert path.exists(), (
            f"{path} missing: run python tutorials/course/solutions/course_build.py"
        )
        assert path.read_text(encoding="utf-8") == text, (
            f"{path.name} is stale: run course_build.py"
        )


def test_exercises_hide_the_solutions() -> None:
    for lesson, cells in LESSONS:
        nb = nbformat.read(COURSE / f"{lesson}.ipynb", as_version=4)
        source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
        text = "\n".join(c.source for c in nb.cells)
        for cell in cells:
            if cell.kind == "exercise":
                assert cell.solution.strip() not in source, f"{lesson} shows a solution"
        assert source.count("# your code here") == sum(c.kind == "exercise" for c in cells)
        assert "<details>" in text and "**Time:**" in text and "**Difficulty:**" in text


@pytest.mark.usefixtures("kernel_env")
def test_course_runs(tmp_path: Path) -> None:
    """Every blank notebook, then every solution, in one kernel: checks say "not done yet", then
    "✔"; no cell raises; every lesson draws its figure."""
    cells, owners = [], []
    for folder, kind in ((COURSE, "blank"), (SOLUTIONS, "solved")):
        for lesson, _ in LESSONS:
            nb = nbformat.read(folder / f"{lesson}.ipynb", as_version=4)
            for cell in nb.cells:
                if cell.cell_type == "code":
                    cells.append(cell)
                    owners.append((kind, lesson))
    whole = nbformat.v4.new_notebook()
    whole.cells = cells
    started = time.perf_counter()
    nbclient.NotebookClient(
        whole, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    print(
        f"the course: {len(LESSONS)} blank and {len(LESSONS)} solved notebooks in {time.perf_counter() - started:.1f} s"
    )
    lines: dict[tuple[str, str], list[str]] = {}
    images = set()
    for cell, owner in zip(whole.cells, owners, strict=True):
        for out in cell.outputs:
            text = out.get("text", "")
            lines.setdefault(owner, []).extend(
                line for line in text.splitlines() if line and line[0] in "✔✘…?"
            )
            if "image/png" in out.get("data", {}):
                images.add(owner)
    for owner, found in lines.items():
        print(owner, *found, sep="\n  ")
    for lesson, cells_ in LESSONS:
        n = sum(c.kind == "exercise" for c in cells_)
        blank, solved = lines.get(("blank", lesson), []), lines.get(("solved", lesson), [])
        contract = 1 if lesson == "07_analyzer_plugin" else 0
        assert len(blank) == n + contract and all("not done yet" in x for x in blank), (
            lesson,
            blank,
        )
        assert len(solved) == n + contract and all(x.startswith("✔") for x in solved), (
            lesson,
            solved,
        )
        assert ("solved", lesson) in images and ("blank", lesson) in images, (
            f"{lesson} drew no figure"
        )


@pytest.fixture
def kernel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's environment, as tests/test_tutorials.py sets it."""
    import os

    monkeypatch.setenv("LENSDIV_TUTORIAL_FAST", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("MPLBACKEND", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(
        "PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    )


@pytest.fixture(scope="module")
def served() -> Any:
    """The explore page on the toy model (no runs folder), for the links' test."""
    pytest.importorskip("starlette", reason="the explore extra is a dev dependency")
    pytest.importorskip("uvicorn", reason="the explore extra is a dev dependency")
    pytest.importorskip("websocket", reason="websocket-client is a dev dependency")
    import lensdiv

    app = lensdiv.explore(skipping.toy.toy())
    yield app, None
    app.stop()


# Screenshots go where the explore page's tests put theirs ($LENSDIV_SCREENSHOTS when set).
shots = explore_page.shots


@pytest.mark.skipif(explore_page.CHROMIUM is None, reason="Chromium is not installed")
def test_explore_links_open_the_page_on_the_prompt(served: Any, shots: Path) -> None:
    """The lessons' links: ``?text=…&skip=N`` opens the lens tab on the prompt with the block
    skipped, ``?clean=…&corrupt=…&tab=patch`` the patch tab on the pair."""
    from lensdiv.course import toy
    from tests.browser import Browser
    from tests.test_browser import not_blank

    wait = explore_page.wait

    app, _ = served
    base = app.url.split("?")[0]
    token = app.url.split("?")[1] if "?" in app.url else ""
    text = toy.PROMPTS[1]
    assert explore_page.CHROMIUM is not None
    with Browser(explore_page.CHROMIUM, width=1300, height=800) as page:
        page.open(base + toy.explore_query(text, skip=1) + (f"&{token}" if token else ""))
        wait(page, "!!document.querySelector('.panel.skip')")
        assert page.evaluate("document.querySelector('#prompt').value") == text
        not_blank(page.screenshot(shots / "course_link_skip.png"))
        pair = toy.pair(toy.toy())["text"]
        page.open(
            base + toy.explore_query(pair[0], corrupt=pair[1]) + (f"&{token}" if token else "")
        )
        wait(page, "!!document.querySelector('#patch-table')")
        assert page.evaluate("document.querySelector('#pane-patch').hidden") is False
        assert page.evaluate("document.querySelector('#corrupt').value") == pair[1]
        not_blank(page.screenshot(shots / "course_link_patch.png"))


def test_references_agree_with_lensdiv_analyzers() -> None:
    """The course's hook-based skip and removal give the ``skip`` analyzer's current mode and
    ``prune``'s true KL on the same token row (a token tensor is analysed as given)."""
    import lensdiv

    toy = skipping.toy
    model = toy.toy()
    ids, _ = toy.tokens(model, toy.PROMPTS[0])
    logits, clean = toy.residual_states(model, ids)
    options = {
        "skip": {"mode": "current"},
        "prune": {"max_n": 1, "curves": False, "linearity": False},
    }
    run = lensdiv.analyze(model, plugins="skip,prune", data=ids, options=options, progress=False)
    L = model.cfg.n_layers
    effect, output, kl = torch.zeros(L, L, dtype=torch.float64), [], []
    for s in range(L):
        skipped_logits, skipped = toy.residual_states(model, ids, skipping.skip_hooks(s))
        effect[s] = skipping.update_effect(clean[:, 0], skipped[:, 0])
        output.append(float(skipping.output_effect(logits[0], skipped_logits[0])))
        removed_logits, _ = toy.residual_states(model, ids, removal.remove_hooks(s, 1))
        kl.append(float(logit_lens.kl_to_output(removed_logits, logits).mean()))
    later = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)  # skip reports l > s
    theirs = torch.as_tensor(run["skip"].arrays["effect_max"], dtype=torch.float64)
    torch.testing.assert_close(theirs[later], effect[later], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        torch.as_tensor(run["skip"].arrays["output_max"], dtype=torch.float64),
        torch.tensor(output, dtype=torch.float64),
        rtol=1e-4,
        atol=1e-5,
    )
    torch.testing.assert_close(
        torch.as_tensor(run["prune"].arrays["true_kl"][:, 0], dtype=torch.float64),
        torch.tensor(kl, dtype=torch.float64),
        rtol=1e-4,
        atol=1e-6,
    )
