"""``bias`` — the residual stream as an ensemble: bias minus diversity (SCIENCE.md B1–B3).

Members are the embedding and every attention and MLP output (``M = 2L + 1``, see
:mod:`lensdiv.ops.members`); member ``i`` predicts ``f_i = M z_i`` where ``z_i`` is its exact logit
contribution with the constant ``W_U β + b_U`` shared equally (``z_i + const/M``), so the members'
mean is exactly the model's logits ``z``. Two exact identities are accumulated per position:

- squared error (Krogh–Vedelsby), ``y`` one-hot::

      ||z − y||² = (1/M) Σ_i ||f_i − y||² − (1/M) Σ_i ||f_i − z||²      ensemble = bias − diversity

  Over the full vocabulary this never materialises member logits: with ``u_i`` the normalised
  member vectors (``z_i = u_i·W_U``), ``U = Σ u_i``, ``c`` the constant and ``G = W_U W_Uᵀ``,
  ``||f_i − y||² = M² u_iᵀGu_i + 2M u_i·(W_U c) + ||c||² − 2(M u_i·W_U[:, y] + c_y) + 1`` and
  ``||f_i − z||² = (M u_i − U)ᵀ G (M u_i − U)``: one ``d_model × d_model`` product per member.
- cross-entropy, ``q_i = softmax(f_i)`` (whose normalised geometric mean is ``softmax(z)``)::

      CE(y, softmax z) = (1/M) Σ_i CE(y, q_i) − (1/M) Σ_i KL(softmax z ‖ q_i)

  This needs every member's full-vocabulary softmax (``M × d_vocab`` per position), so on the
  corpus it is computed at positions ``t`` with ``t mod every = 0`` only.

Depth: for every block boundary ``h_l`` the same decomposition is taken for the prefix ensemble
of the ``2l + 1`` members written so far (embedding and blocks ``< l``), read on the final norm's
scale like the full ensemble (the direct path: its last row is the model itself). The squared form
gets it at every position for a few dot products; the cross-entropy form only with ``ce_depth``
(at the ``every`` positions) or in label mode.

Targets: the next token over the full vocabulary (default), or a label set: ``tasks`` is a JSONL
file of ``{"prompt": ..., "label": ...}`` rows; the target is the label at the last prompt position
and the softmax runs over the label words' tokens only (each label word must be one token; both
forms are then cheap and computed at every example, for every prefix too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo, Step
from lensdiv.core.errors import DataError
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.data.sources import read_task_jsonl
from lensdiv.ops.members import (
    keep_chunks,
    member_hooks,
    member_inputs,
    member_layers,
    member_names,
    member_readout,
)
from lensdiv.ops.readout import log_partition

Weighting = Literal["mean", "sum"]

# float64 elements of the per-chunk Gram terms (u, G·u: [member, rows, d_model]) held at once.
_GRAM_ELEMENTS = 1 << 22
# float32 member logits ([member, rows, d_vocab]) held at once in the cross-entropy form.
_LOGIT_ELEMENTS = 1 << 25


# -- the decompositions, on plain tensors ---------------------------------------------------------


def direct_decomposition(
    f: Float[Tensor, "member n vocab"], y: Int[Tensor, " n"]
) -> dict[str, Tensor]:
    """Both forms from member predictions ``f_i`` (their mean is the ensemble's logits ``z``).

    Returns per position (float64): ``sq_bias``/``sq_div`` ``[member, n]`` (``||f_i − y||²``,
    ``||f_i − z||²``), ``sq_ens`` ``[n]`` (``||z − y||²``), ``ce``/``kl`` ``[member, n]``
    (``CE(y, q_i)``, ``KL(softmax z ‖ q_i)``), ``ce_ens`` ``[n]`` and top-1 hits ``correct``
    ``[member, n]`` / ``correct_ens`` ``[n]``. Materialises everything: small vocabularies only.
    """
    f = f.double()
    z = f.mean(0)
    onehot = torch.nn.functional.one_hot(y, f.shape[-1]).double()
    logq = torch.log_softmax(f, -1)
    logp = torch.log_softmax(z, -1)
    return {
        "sq_bias": (f - onehot).pow(2).sum(-1),
        "sq_div": (f - z).pow(2).sum(-1),
        "sq_ens": (z - onehot).pow(2).sum(-1),
        "ce": -logq.gather(-1, y.expand(f.shape[0], -1).unsqueeze(-1))[..., 0],
        "kl": (logp.exp() * (logp - logq)).sum(-1),
        "ce_ens": -logp.gather(-1, y.unsqueeze(-1))[..., 0],
        "correct": (f.argmax(-1) == y).double(),
        "correct_ens": (z.argmax(-1) == y).double(),
    }


def gram_squared_error(
    u: Float[Tensor, "member n d_model"],
    gram: Float[Tensor, "d_model d_model"],
    w_c: Float[Tensor, " d_model"],
    c_sq: float,
    g_y: Float[Tensor, "n d_model"],
    c_y: Float[Tensor, " n"],
    sizes: list[int],
) -> tuple[Tensor, Tensor, Tensor]:
    """The squared-error form over the full vocabulary without member logits.

    For each prefix size ``m`` in ``sizes`` (the ensemble of the first ``m`` members, each
    predicting ``f_i = m u_i·W_U + c``): ``||f_i − y||²`` and ``||f_i − z||²`` for ``i < m``
    (zero beyond), and ``||z − y||²``.

    Args:
        u: Normalised member vectors (``z_i = u_i·W_U``).
        gram: ``G = W_U W_Uᵀ``.
        w_c: ``W_U c`` for the constant ``c``.
        c_sq: ``||c||²``.
        g_y: ``W_U[:, y]``, the target's unembedding column, per position.
        c_y: ``c[y]`` per position.
        sizes: Prefix sizes (``M`` alone for the full ensemble).

    Returns:
        ``(bias, div, ens)`` in float64: ``[prefix, member, n]``, ``[prefix, member, n]``,
        ``[prefix, n]``.
    """
    n_members = u.shape[0]
    gu = (u @ gram).double()  # G is symmetric: rows of u·G are G·u_i
    ud = u.double()
    q = (gu * ud).sum(-1)  # u_iᵀ G u_i
    a = ud @ w_c.double()  # u_i · W_U c
    b = (ud * g_y.double()).sum(-1)  # u_i · W_U[:, y]
    prefix = ud.cumsum(0)[[m - 1 for m in sizes]]  # U_S, [prefix, n, d_model]
    s = torch.einsum("ind,pnd->pin", gu, prefix)  # u_iᵀ G U_S
    member = torch.arange(n_members, device=u.device)
    m = torch.tensor(sizes, device=u.device, dtype=torch.float64).view(-1, 1, 1)
    inside = (member.view(1, -1) < m.view(-1, 1).long()).unsqueeze(-1).double()  # [p, M, 1]
    s = s * inside
    big_q = s.sum(1)  # U_Sᵀ G U_S, [prefix, n]
    c_y = c_y.double()
    bias = (m * m * q + 2 * m * a + c_sq - 2 * (m * b + c_y) + 1.0) * inside
    # A squared norm: clamp the rounding of the expanded form (it cancels for equal members).
    div = (m * m * q - 2 * m * s + big_q.unsqueeze(1)).clamp_min(0.0) * inside
    a_s, b_s = (a * inside).sum(1), (b * inside).sum(1)
    ens = big_q + 2 * a_s + c_sq - 2 * (b_s + c_y) + 1.0
    return bias, div, ens


def ce_terms(f: Float[Tensor, "member n vocab"], y: Int[Tensor, " n"]) -> dict[str, Tensor]:
    """The cross-entropy form over a large vocabulary, one pass over the member logits.

    ``KL(p ‖ q_i) = lse(f_i) − lse(z) − p·(f_i − z)`` with ``p = softmax z`` (exact), so no
    log-softmax of the members is materialised. Same keys and meaning as
    :func:`direct_decomposition`'s ``ce``, ``kl``, ``ce_ens``, ``correct``, ``correct_ens``.
    """
    z = f.mean(0)
    lse_f = log_partition(f)
    lse_z = log_partition(z)
    p = torch.softmax(z, -1)
    pf = torch.einsum("mnv,nv->mn", f, p).double()
    pz = (p * z).sum(-1).double()
    f_y = f.gather(-1, y.expand(f.shape[0], -1).unsqueeze(-1))[..., 0].double()
    z_y = z.gather(-1, y.unsqueeze(-1))[..., 0].double()
    return {
        "ce": lse_f - f_y,
        "kl": (lse_f - lse_z - (pf - pz)).clamp_min(0.0),
        "ce_ens": lse_z - z_y,
        "correct": (f.argmax(-1) == y).double(),
        "correct_ens": (z.argmax(-1) == y).double(),
    }


# The x axis of each table the plots draw: (column, label).
_AXES = {
    "depth": ("layer", "residual state h_l (prefix ensemble of the members before it)"),
    "members": ("member", "member i (0 = embedding, then attention and MLP of each block)"),
}


def _line(
    name: str, title: str, table: str, y: tuple[str, ...], ylabel: str, caption: str = ""
) -> Plot:
    """A line plot of ``table``'s ``y`` columns along depth or along the members."""
    x, xlabel = _AXES[table]
    return Plot("line", name, title, table, x=x, y=y, xlabel=xlabel, ylabel=ylabel, caption=caption)


# -- the analyzer ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BiasDiversity(Analyzer):
    """Ensemble view of the residual stream: bias − diversity = loss, per member and depth.

    Args:
        tasks: JSONL file of ``{"prompt": ..., "label": ...}`` classification rows: score the
            label at the last prompt position, softmax over the label set. Empty (default): the
            next token of the corpus over the full vocabulary.
        labels: Label words (comma-separated; each must be a single token, with a leading space
            if the tokenizer expects one). Default: the rows' ``labels`` field (the same on
            every row), else the file's distinct labels in order of first appearance.
        weighting: ``mean`` (bias and diversity are averages over members, the ensemble loss is
            the model's) or ``sum`` (sums over members; everything scales by ``M``).
        every: Next-token mode: the cross-entropy form (full-vocabulary member softmaxes,
            ``M × d_vocab`` per position) runs at positions ``t`` with ``t mod every = 0``;
            1 = every position. Label mode always uses every example.
        ce_depth: Next-token mode: also take the cross-entropy form for every prefix ensemble
            ``h_0 .. h_L`` at those positions (about ``(L + 1) / 2`` times the cost of the
            cross-entropy form). Label mode always does.
        exclude_bos: Leave the BOS position out of every statistic.
        batch_size: Examples per forward pass (label mode).
    """

    name = "bias"
    aliases = ("bias-diversity", "biasdiv")
    description = (
        "Layer diversity: ensemble loss = bias - diversity of embedding/attn/MLP members (B1-B3)"
    )
    depth_profiles = ("depth.bias", "depth.diversity")

    tasks: str = ""
    labels: tuple[str, ...] = ()
    weighting: Weighting = "mean"
    every: int = 16
    ce_depth: bool = False
    exclude_bos: bool = False
    batch_size: int = 16

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be at least 1, got {self.every}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if self.weighting not in ("mean", "sum"):
            raise ValueError(f"weighting must be 'mean' or 'sum', not {self.weighting!r}")
        if self.labels and not self.tasks:
            raise ValueError("labels needs tasks (a JSONL file of prompt/label rows)")

    def hooks(self, info: ModelInfo) -> list[str]:
        return member_hooks(info)

    # -- examples (label-set mode) -------------------------------------------------------------
    def examples(self, model: Any, info: ModelInfo) -> list[Batch] | None:
        member_readout(model)  # an undecomposable final norm fails here, before any forward
        if not self.tasks:
            return None

        rows = read_task_jsonl(
            self.tasks, ("prompt", "label"), what="bias classification", option="bias.tasks"
        )
        words = self._label_words(rows)
        ids = self._label_ids(model.tokenizer, words, info)
        index = {w: k for k, w in enumerate(words)}
        tokenizer = model.tokenizer
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        encoded = []
        for number, row in rows:
            label = str(row["label"])
            if label not in index:
                raise DataError(
                    f"bias tasks line {number}: label {label!r} is not one of the label words "
                    f"{list(words)}",
                    hint="list every label with -O bias.labels=w1,w2,...",
                )
            prompt = tokenizer(str(row["prompt"]), add_special_tokens=False)["input_ids"]
            if not prompt:
                raise DataError(f"bias tasks line {number}: the prompt is empty")
            encoded.append((bos + prompt, index[label]))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        batches = []
        for number, lo in enumerate(range(0, len(encoded), self.batch_size)):
            chunk = encoded[lo : lo + self.batch_size]
            width = max(len(ids_) for ids_, _ in chunk)
            tokens = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.bool)
            for r, (ids_, _) in enumerate(chunk):
                tokens[r, : len(ids_)] = torch.tensor(ids_)
                mask[r, : len(ids_)] = True
            extra = {
                "last": torch.tensor([len(ids_) - 1 for ids_, _ in chunk]),
                "target": torch.tensor([t for _, t in chunk]),
                "label_ids": torch.tensor(ids),
                "label_words": list(words),
            }
            batches.append(Batch(tokens, mask, bos=bool(bos), index=number, extra=extra))
        return batches

    def _label_words(self, rows: list[tuple[int, dict[str, Any]]]) -> tuple[str, ...]:
        if self.labels:
            words = tuple(self.labels)
        elif "labels" in rows[0][1]:
            first = rows[0][1]["labels"]
            for number, row in rows:
                if row.get("labels") != first:
                    raise DataError(
                        f"bias tasks line {number}: its 'labels' field differs from the first "
                        "row's (one label set per file)",
                        hint="give every row the same labels, or set -O bias.labels=w1,w2,...",
                    )
            if not isinstance(first, list) or not first:
                raise DataError("bias tasks: the 'labels' field must be a non-empty list")
            words = tuple(str(w) for w in first)
        else:
            words = tuple(dict.fromkeys(str(row["label"]) for _, row in rows))
        if len(words) < 2:
            raise DataError(
                f"bias tasks: need at least two label words, got {list(words)}",
                hint="set -O bias.labels=w1,w2,...",
            )
        if len(set(words)) != len(words):
            raise DataError(f"bias labels repeat a word: {list(words)}")
        return words

    @staticmethod
    def _label_ids(tokenizer: Any, words: tuple[str, ...], info: ModelInfo) -> list[int]:
        ids: list[int] = []
        for word in words:
            tokens = tokenizer(word, add_special_tokens=False)["input_ids"]
            if len(tokens) != 1 or not 0 <= tokens[0] < info.d_vocab:
                raise DataError(
                    f"bias label {word!r} is {len(tokens)} tokens {tokens} for {info.name}; "
                    "label words must be single tokens",
                    hint="choose single-token label words (mind leading spaces)",
                )
            if tokens[0] in ids:
                other = words[ids.index(tokens[0])]
                raise DataError(f"bias labels {other!r} and {word!r} are the same token")
            ids.append(tokens[0])
        return ids

    # -- streaming -------------------------------------------------------------------------------
    def update(self, state: Stats, step: Step) -> None:
        if "label_ids" in step.batch.extra:
            self._update_labels(state, step)
        else:
            self._update_next(state, step)

    def _update_labels(self, state: Stats, step: Step) -> None:
        batch, info = step.batch, step.info
        device = batch.tokens.device
        rows = torch.arange(batch.tokens.shape[0], device=device)
        keep = torch.zeros_like(batch.mask)
        keep[rows, batch.extra["last"].to(device)] = True
        keep &= batch.mask
        ids = batch.extra["label_ids"].to(device)
        state.fix("label_words", list(batch.extra["label_words"]))
        u, const = member_inputs(step.model, step.cache, info, keep)
        readout = member_readout(step.model)
        z = u @ readout.W_U[:, ids]  # [M, n, K]
        c = const[ids]
        y = batch.extra["target"].to(device)  # one kept position (the last) per row
        state.add("n", y.shape[0])
        state.add("n_ce", y.shape[0])
        for p, size in enumerate(_prefix_sizes(info)):
            out = direct_decomposition(size * z[:size] + c, y)
            if size == u.shape[0]:
                self._add_full(state, out)
            state.add("depth/sq_bias", _one_hot(p, info, out["sq_bias"].sum()))
            state.add("depth/sq_div", _one_hot(p, info, out["sq_div"].sum()))
            state.add("depth/sq_ens", _one_hot(p, info, out["sq_ens"].sum()))
            self._add_depth_ce(state, p, info, out)

    def _update_next(self, state: Stats, step: Step) -> None:
        batch, info = step.batch, step.info
        targets, has_target = batch.next_tokens()
        keep = batch.positions(exclude_bos=self.exclude_bos) & has_target
        pos = torch.arange(batch.tokens.shape[1], device=keep.device).expand_as(keep)
        readout = member_readout(step.model)
        const = readout.const
        n_members, d_vocab = 2 * info.n_layers + 1, readout.W_U.shape[1]
        sizes = _prefix_sizes(info)
        w_c = readout.W_U @ const
        c_sq = float(const.double().pow(2).sum())
        state.add("n", int(keep.sum()))
        state.add("n_ce", int((keep & (pos % self.every == 0)).sum()))
        # Chunks of kept positions bound the [member, rows, d_model] float64 Gram terms.
        for mask in keep_chunks(keep, max(1, _GRAM_ELEMENTS // (n_members * info.d_model))):
            u, _ = member_inputs(step.model, step.cache, info, mask)
            y = targets[mask]
            bias, div, ens = gram_squared_error(
                u, readout.gram, w_c, c_sq, readout.W_U[:, y].T, const[y], sizes
            )
            state.add("depth/sq_bias", bias.sum(1).sum(-1))
            state.add("depth/sq_div", div.sum(1).sum(-1))
            state.add("depth/sq_ens", ens.sum(-1))
            state.add("sq_bias", bias[-1].sum(-1))
            state.add("sq_div", div[-1].sum(-1))
            sub = (pos % self.every == 0)[mask]
            u_sub, y_sub = u[:, sub], y[sub]
            per_chunk = max(1, _LOGIT_ELEMENTS // (n_members * d_vocab))
            for start in range(0, y_sub.shape[0], per_chunk):
                rows = slice(start, start + per_chunk)
                for p, size in enumerate(sizes if self.ce_depth else sizes[-1:]):
                    f = (size * u_sub[:size, rows]) @ readout.W_U
                    f += const
                    out = ce_terms(f, y_sub[rows])
                    if size == n_members:
                        self._add_full(state, out)
                    if self.ce_depth:
                        self._add_depth_ce(state, p, info, out)

    @staticmethod
    def _add_depth_ce(state: Stats, p: int, info: ModelInfo, out: dict[str, Tensor]) -> None:
        """Cross-entropy-form sums of prefix ensemble ``p`` (one slot of ``L + 1``)."""
        for key, name in (
            ("ce", "depth/ce"),
            ("kl", "depth/kl"),
            ("ce_ens", "depth/ce_ens"),
            ("correct_ens", "depth/correct_ens"),
        ):
            state.add(name, _one_hot(p, info, out[key].sum()))

    @staticmethod
    def _add_full(state: Stats, out: dict[str, Tensor]) -> None:
        """Per-member sums of the full ensemble (squared terms only when ``out`` has them)."""
        for key in ("sq_bias", "sq_div", "ce", "kl", "correct"):
            if key in out:
                state.add(key, out[key].sum(-1))
        for key in ("ce_ens", "correct_ens"):
            state.add(key, out[key].sum())

    # -- results ---------------------------------------------------------------------------------
    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        n, n_ce = float(state["n"]), float(state["n_ce"])
        if n == 0:
            raise ValueError("no position had a target, so there is nothing to decompose")
        names, layers = member_names(info), member_layers(info)
        n_members = len(names)
        labelled = self.tasks != ""
        w = 1.0 / n_members if self.weighting == "mean" else 1.0
        scale_ens = 1.0 if self.weighting == "mean" else float(n_members)
        per_ce = 1.0 / n_ce if n_ce else math.nan

        sq_bias = (state["sq_bias"] / n * w).tolist()
        sq_div = (state["sq_div"] / n * w).tolist()
        ce_bias = (state["ce"] * per_ce * w).tolist() if "ce" in state else [math.nan] * n_members
        ce_div = (state["kl"] * per_ce * w).tolist() if "kl" in state else [math.nan] * n_members
        acc = (state["correct"] * per_ce).tolist() if "correct" in state else [math.nan] * n_members
        members = Table(
            "members",
            {
                "member": list(range(n_members)),
                "name": names,
                "layer": layers,
                "sq_bias": sq_bias,
                "sq_diversity": sq_div,
                "ce_bias": ce_bias,
                "ce_diversity": ce_div,
                "top1_acc": acc,
            },
            f"Each member's contribution ({self.weighting}-weighted): bias = its error, "
            "diversity = its spread from the ensemble",
        )

        sizes = _prefix_sizes(info)
        m = torch.tensor(sizes, dtype=torch.float64)
        wm = 1.0 / m if self.weighting == "mean" else torch.ones_like(m)
        em = torch.ones_like(m) if self.weighting == "mean" else m
        depth_cols: dict[str, Any] = {
            "layer": list(range(info.n_layers + 1)),
            "state": [f"h{layer}" for layer in range(info.n_layers + 1)],
            "members": sizes,
            "bias": (state["depth/sq_bias"] / n * wm).tolist(),
            "diversity": (state["depth/sq_div"] / n * wm).tolist(),
            "ensemble_loss": (state["depth/sq_ens"] / n * em).tolist(),
        }
        ce_depth = "depth/ce" in state
        if ce_depth:
            depth_cols["ce_bias"] = (state["depth/ce"] * per_ce * wm).tolist()
            depth_cols["ce_diversity"] = (state["depth/kl"] * per_ce * wm).tolist()
            depth_cols["ce_loss"] = (state["depth/ce_ens"] * per_ce * em).tolist()
            depth_cols["accuracy"] = (state["depth/correct_ens"] * per_ce).tolist()
        depth = Table(
            "depth",
            depth_cols,
            "Prefix ensembles: members written before h_l, on the final norm's scale",
        )

        forms = {
            "squared": (
                sum(sq_bias),
                sum(sq_div),
                float(state["depth/sq_ens"][-1]) / n * scale_ens,
                n,
            ),
            "ce": (
                sum(ce_bias),
                sum(ce_div),
                float(state.get("ce_ens", math.nan)) * per_ce * scale_ens,
                n_ce,
            ),
        }
        main = Table(
            "bias",
            {
                "form": list(forms),
                "positions": [int(v[3]) for v in forms.values()],
                "bias": [v[0] for v in forms.values()],
                "diversity": [v[1] for v in forms.values()],
                "ensemble_loss": [v[2] for v in forms.values()],
                "identity_gap": [v[0] - v[1] - v[2] for v in forms.values()],
                "diversity_share": [v[1] / v[0] if v[0] else math.nan for v in forms.values()],
            },
            "Ensemble loss = bias - diversity (squared error and cross-entropy forms)",
        )
        target = (
            f"label set {list(state.get('label_words', self.labels))} at the last prompt position"
            if labelled
            else "next token, full vocabulary"
        )
        summary = self._summary(forms, members, depth, target, n_ce, ce_depth)
        plots = [
            _line(
                "bias_depth",
                "Bias, diversity and ensemble loss along depth (squared)",
                "depth",
                ("bias", "diversity", "ensemble_loss"),
                "squared error (logits²)",
                caption="Ensemble loss = bias − diversity (Krogh–Vedelsby), for the members "
                "written before h_l.",
            ),
            _line(
                "bias_members",
                "Per-member bias and diversity (squared)",
                "members",
                ("sq_bias", "sq_diversity"),
                "squared error (logits²)",
            ),
            _line(
                "bias_members_ce",
                "Per-member CE and KL (cross-entropy form)",
                "members",
                ("ce_bias", "ce_diversity"),
                "cross-entropy, KL (nats)",
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
                )
            )
        return Result(
            analyzer=self.name,
            summary=summary,
            tables={"bias": main, "members": members, "depth": depth},
            plots=tuple(plots),
            meta={
                "members": names,
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
                "weighting": self.weighting,
                "target": target,
                "every": 1 if labelled else self.every,
                "ce_depth": labelled or self.ce_depth,
                "ce_positions": "every example" if labelled else "t mod every = 0",
                "exclude_bos": self.exclude_bos,
                "positions": int(n),
                "positions_ce": int(n_ce),
            },
        )

    def _summary(
        self,
        forms: dict[str, tuple[float, float, float, float]],
        members: Table,
        depth: Table,
        target: str,
        n_ce: float,
        ce_depth: bool,
    ) -> str:
        names = members["name"].tolist()
        sq_b, sq_d, sq_e, n = forms["squared"]
        text = (
            f"Target: {target}; {len(names)} members (embedding + attention and MLP outputs), "
            f"{self.weighting}-weighted. Squared error: ensemble loss {sq_e:.4g} = bias "
            f"{sq_b:.4g} - diversity {sq_d:.4g} (diversity is {sq_d / sq_b:.0%} of the bias) "
            f"over {int(n)} positions."
        )
        ce_b, ce_d, ce_e, _ = forms["ce"]
        if n_ce:
            text += (
                f" Cross-entropy: {ce_e:.4g} nats = {ce_b:.4g} - {ce_d:.4g} over {int(n_ce)} "
                "positions."
            )
            best = int(torch.tensor(members["top1_acc"]).nan_to_num(-1.0).argmax())
            text += (
                f" The most accurate single member is {names[best]} (top-1 "
                f"{members['top1_acc'][best]:.2f})."
            )
        div = members["sq_diversity"]
        top = int(div.argmax())
        text += f" The largest squared-error diversity comes from {names[top]}."
        loss = depth["ensemble_loss"]
        text += (
            " Along depth the prefix ensemble's squared error of raw logits against the one-hot"
            " target (it grows as the logits sharpen, unlike the cross-entropy) goes"
            f" {loss[0]:.4g} (h0) -> "
            f"{loss[-1]:.4g} (h{len(loss) - 1}), bias {depth['bias'][0]:.4g} -> "
            f"{depth['bias'][-1]:.4g}, diversity {depth['diversity'][0]:.4g} -> "
            f"{depth['diversity'][-1]:.4g}."
        )
        if ce_depth:
            ce, acc = depth["ce_loss"], depth["accuracy"]
            text += (
                f" Cross-entropy along depth: loss {ce[0]:.4g} -> {ce[-1]:.4g}, bias "
                f"{depth['ce_bias'][0]:.4g} -> {depth['ce_bias'][-1]:.4g}, diversity "
                f"{depth['ce_diversity'][0]:.4g} -> {depth['ce_diversity'][-1]:.4g}; top-1 "
                f"accuracy {acc[0]:.2f} -> {acc[-1]:.2f}."
            )
        return text


def _prefix_sizes(info: ModelInfo) -> list[int]:
    """Members written before ``h_l`` for ``l = 0..L``: ``2l + 1``."""
    return [2 * layer + 1 for layer in range(info.n_layers + 1)]


def _one_hot(index: int, info: ModelInfo, value: Tensor) -> Tensor:
    out = torch.zeros(info.n_layers + 1, dtype=torch.float64, device=value.device)
    out[index] = value
    return out
