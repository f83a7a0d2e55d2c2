"""The result of ``bias``: tables, plots, summary and metadata of a :class:`Decomposition`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lensdiv.analyzers.bias.decomposition import Decomposition, Form
from lensdiv.core.results import Plot, Result, Table
from lensdiv.ops.translators import PHRASES

if TYPE_CHECKING:  # the analyzer imports this module; its type is only an annotation here
    from lensdiv.analyzers.bias import BiasDiversity

# The x axis of each table the plots draw: (column, label).
_AXES = {
    "depth": ("layer", "residual state h_l (prefix ensemble of the members before it)"),
    "members": ("member", "member i (0 = embedding, then attention and MLP of each block)"),
}


def present(numbers: Decomposition, options: BiasDiversity) -> Result:
    """The ``bias``, ``members`` and ``depth`` tables, their plots, the summary and the meta."""
    labelled = options.tasks != ""
    words = numbers.label_words if numbers.label_words is not None else options.labels
    target = (
        f"label set {list(words)} at the last prompt position"
        if labelled
        else "next token, full vocabulary"
    )
    states = numbers.kind == "states"
    if states:
        return _present_states(numbers, options, target)
    return Result(
        analyzer=options.name,
        summary=_summary(numbers, target),
        tables={
            "bias": _forms_table(numbers),
            "members": _members_table(numbers),
            "depth": _depth_table(numbers),
        },
        plots=_plots(numbers.depth_ce is not None),
        meta={
            "members": numbers.names,
            "forms": {
                "squared": "||z-y||^2 = (1/M) sum ||f_i-y||^2 - (1/M) sum ||f_i-z||^2, "
                "f_i = M z_i (full vocabulary via Gram matrices in d_model space)"
                if not labelled
                else "||z-y||^2 = (1/M) sum ||f_i-y||^2 - (1/M) sum ||f_i-z||^2, f_i = M z_i",
                "ce": "CE(y, softmax z) = (1/M) sum CE(y, q_i) - (1/M) sum KL(softmax z || "
                "q_i), q_i = softmax(M z_i)",
            },
            "constant": "shared: each member gets (W_U beta + b_U) / M",
            "member_scale": "final residual's norm scale sigma(h_L) for every member",
            "weighting": numbers.weighting,
            "target": target,
            "every": 1 if labelled else options.every,
            "ce_depth": labelled or options.ce_depth,
            "ce_positions": "every example" if labelled else "t mod every = 0",
            "exclude_bos": options.exclude_bos,
            "positions": int(numbers.squared.positions),
            "positions_ce": int(numbers.ce.positions),
        },
    )


def _lens_phrase(numbers: Decomposition) -> str:
    """``"tuned lens"`` (the members' lens), ``"logit lens"`` without a fitted one."""
    return PHRASES[numbers.lens["kind"]] if numbers.lens else PHRASES["logit"]


def _present_states(numbers: Decomposition, options: BiasDiversity, target: str) -> Result:
    """The result when the members are the residual states read through the run's lens."""
    lens = _lens_phrase(numbers)
    depth = _depth_table(numbers)
    depth = Table(
        depth.name,
        dict(depth.columns),
        f"Prefix ensembles: the readouts of h_0 .. h_l through the {lens}, averaged in logits",
    )
    sq, ce = numbers.squared, numbers.ce
    summary = (
        f"Target: {target}; {len(numbers.names)} members: the residual states h0..h"
        f"{len(numbers.names) - 1} read through the {lens}, {numbers.weighting}-weighted. "
        f"Cross-entropy: ensemble {ce.ensemble_loss:.4g} nats = bias {ce.bias:.4g} - diversity "
        f"{ce.diversity:.4g}; squared error: {sq.ensemble_loss:.4g} = {sq.bias:.4g} - "
        f"{sq.diversity:.4g}, over {int(ce.positions)} positions."
    )
    return Result(
        analyzer=options.name,
        summary=summary,
        tables={
            "bias": _forms_table(numbers),
            "members": _members_table(numbers),
            "depth": depth,
        },
        plots=_plots(True, True, lens),
        meta={
            "members": numbers.names,
            "member_kind": "states",
            "lens": numbers.lens or {"kind": "logit"},
            "forms": {
                "squared": "||z-y||^2 = (1/M) sum ||f_i-y||^2 - (1/M) sum ||f_i-z||^2, f_i = "
                "the logits of h_i read through the lens, z their mean",
                "ce": "CE(y, softmax z) = (1/M) sum CE(y, q_i) - (1/M) sum KL(softmax z || "
                "q_i), q_i = softmax(f_i)",
            },
            "weighting": numbers.weighting,
            "target": target,
            "every": options.every,
            "ce_positions": "t mod every = 0 (both forms)",
            "exclude_bos": options.exclude_bos,
            "positions": int(numbers.squared.positions),
            "positions_ce": int(numbers.ce.positions),
        },
    )


def _forms_table(numbers: Decomposition) -> Table:
    """One row per form: bias, diversity, ensemble loss and how well the identity holds."""
    forms: dict[str, Form] = {"squared": numbers.squared, "ce": numbers.ce}
    return Table(
        "bias",
        {
            "form": list(forms),
            "positions": [int(f.positions) for f in forms.values()],
            "bias": [f.bias for f in forms.values()],
            "diversity": [f.diversity for f in forms.values()],
            "ensemble_loss": [f.ensemble_loss for f in forms.values()],
            "identity_gap": [f.identity_gap for f in forms.values()],
            "diversity_share": [f.diversity_share for f in forms.values()],
        },
        "Ensemble loss = bias - diversity (squared error and cross-entropy forms)",
    )


def _members_table(numbers: Decomposition) -> Table:
    """One row per member."""
    terms = numbers.members
    return Table(
        "members",
        {
            "member": list(range(len(numbers.names))),
            "name": numbers.names,
            "layer": numbers.layers,
            "sq_bias": terms.sq_bias,
            "sq_diversity": terms.sq_diversity,
            "ce_bias": terms.ce_bias,
            "ce_diversity": terms.ce_diversity,
            "top1_acc": terms.top1_acc,
        },
        f"Each member's contribution ({numbers.weighting}-weighted): bias = its error, "
        "diversity = its spread from the ensemble",
    )


def _depth_table(numbers: Decomposition) -> Table:
    """One row per residual state ``h_l``: the prefix ensemble of the members before it."""
    depth, ce = numbers.depth, numbers.depth_ce
    n_states = len(numbers.sizes)
    columns: dict[str, Any] = {
        "layer": list(range(n_states)),
        "state": [f"h{layer}" for layer in range(n_states)],
        "members": numbers.sizes,
        "bias": depth.bias,
        "diversity": depth.diversity,
        "ensemble_loss": depth.loss,
    }
    if ce is not None:
        columns["ce_bias"] = ce.bias
        columns["ce_diversity"] = ce.diversity
        columns["ce_loss"] = ce.loss
        columns["accuracy"] = ce.accuracy
    return Table(
        "depth", columns, "Prefix ensembles: members written before h_l, on the final norm's scale"
    )


# The same axes when the members are the residual states read through a lens.
_STATE_AXES = {
    "depth": ("layer", "residual state h_l (ensemble of the readouts of h_0 .. h_l)"),
    "members": ("member", "member h_i (residual state i read through the lens)"),
}


def _line(
    name: str,
    title: str,
    table: str,
    y: tuple[str, ...],
    ylabel: str,
    caption: str = "",
    states: bool = False,
    labels: tuple[str, ...] = (),
) -> Plot:
    """A line plot of ``table``'s ``y`` columns along depth or along the members."""
    x, xlabel = (_STATE_AXES if states else _AXES)[table]
    return Plot(
        "line",
        name,
        title,
        table,
        x=x,
        y=y,
        xlabel=xlabel,
        ylabel=ylabel,
        caption=caption,
        labels=labels,
    )


def _plots(ce_depth: bool, states: bool = False, lens: str = "") -> tuple[Plot, ...]:
    """Bias, diversity and loss along depth and per member (and along depth in CE)."""
    plots = [
        _line(
            "bias_depth",
            "Bias, diversity and ensemble loss along depth (squared)",
            "depth",
            ("bias", "diversity", "ensemble_loss"),
            "squared error (logits²)",
            labels=("bias", "diversity", "ensemble loss"),
            caption="Ensemble loss = bias − diversity (Krogh–Vedelsby), for the members "
            + (f"h_0 .. h_l read through the {lens}." if states else "written before h_l."),
            states=states,
        ),
        _line(
            "bias_members",
            "Per-member bias and diversity (squared)",
            "members",
            ("sq_bias", "sq_diversity"),
            "squared error (logits²)",
            labels=("bias (squared error)", "diversity (squared)"),
            states=states,
        ),
        _line(
            "bias_members_ce",
            "Per-member CE and KL (cross-entropy form)",
            "members",
            ("ce_bias", "ce_diversity"),
            "cross-entropy, KL (nats)",
            labels=("bias: cross-entropy", "diversity: KL to the ensemble"),
            states=states,
        ),
    ]
    if ce_depth:
        plots.append(
            _line(
                "bias_depth_ce",
                "Bias, diversity and loss along depth (CE)",
                "depth",
                ("ce_bias", "ce_diversity", "ce_loss"),
                "cross-entropy, KL (nats)",
                labels=("bias: cross-entropy", "diversity: KL", "ensemble loss"),
                states=states,
            )
        )
    return tuple(plots)


def _summary(numbers: Decomposition, target: str) -> str:
    """The identity in both forms, the most accurate and the most diverse member, and how the
    prefix ensemble's terms change from ``h_0`` to ``h_L``."""
    names, terms, depth = numbers.names, numbers.members, numbers.depth
    sq, ce = numbers.squared, numbers.ce
    text = (
        f"Target: {target}; {len(names)} members (embedding + attention and MLP outputs), "
        f"{numbers.weighting}-weighted. Squared error: ensemble loss {sq.ensemble_loss:.4g} = "
        f"bias {sq.bias:.4g} - diversity {sq.diversity:.4g} (diversity is "
        f"{sq.diversity / sq.bias:.0%} of the bias) over {int(sq.positions)} positions."
    )
    if ce.positions:
        text += (
            f" Cross-entropy: {ce.ensemble_loss:.4g} nats = {ce.bias:.4g} - {ce.diversity:.4g} "
            f"over {int(ce.positions)} positions."
        )
        acc = terms.top1_acc
        best = int(torch.tensor(acc, dtype=torch.float64).nan_to_num(-1.0).argmax())
        text += f" The most accurate single member is {names[best]} (top-1 {acc[best]:.2f})."
    top = int(np.asarray(terms.sq_diversity).argmax())
    text += f" The largest squared-error diversity comes from {names[top]}."
    loss = depth.loss
    text += (
        " Along depth the prefix ensemble's squared error of raw logits against the one-hot"
        " target (it grows as the logits sharpen, unlike the cross-entropy) goes"
        f" {loss[0]:.4g} (h0) -> "
        f"{loss[-1]:.4g} (h{len(loss) - 1}), bias {depth.bias[0]:.4g} -> "
        f"{depth.bias[-1]:.4g}, diversity {depth.diversity[0]:.4g} -> "
        f"{depth.diversity[-1]:.4g}."
    )
    along = numbers.depth_ce
    if along is not None:
        accuracy = along.accuracy if along.accuracy is not None else [math.nan]
        text += (
            f" Cross-entropy along depth: loss {along.loss[0]:.4g} -> {along.loss[-1]:.4g}, bias "
            f"{along.bias[0]:.4g} -> {along.bias[-1]:.4g}, diversity "
            f"{along.diversity[0]:.4g} -> {along.diversity[-1]:.4g}; top-1 "
            f"accuracy {accuracy[0]:.2f} -> {accuracy[-1]:.2f}."
        )
    return text
