"""``bias`` — the residual stream as an ensemble: bias minus diversity (docs/science.md B1–B3).

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

The package: this module is the analyzer (options, examples, the streamed sums);
:mod:`~lensdiv.analyzers.bias.decomposition` holds the identities on plain tensors and the
:class:`Decomposition` of a run (the numbers, from the state alone);
:mod:`~lensdiv.analyzers.bias.present` turns a decomposition into the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lensdiv.analyzers.bias.decomposition import (
    Decomposition,
    Form,
    Members,
    MemberTerms,
    PrefixTerms,
    Weighting,
    ce_terms,
    direct_decomposition,
    gram_squared_error,
    prefix_sizes,
)
from lensdiv.analyzers.bias.present import present
from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo, Step
from lensdiv.core.bridge import Bridge, Tokenizer
from lensdiv.core.errors import DataError
from lensdiv.core.results import Result
from lensdiv.core.stats import Stats
from lensdiv.data.tasks import read_task_jsonl
from lensdiv.ops.members import keep_chunks, member_hooks, member_inputs, member_readout
from lensdiv.ops.readout import final_readout, lens_of

__all__ = [
    "BiasDiversity",
    "Decomposition",
    "Form",
    "MemberTerms",
    "PrefixTerms",
    "ce_terms",
    "direct_decomposition",
    "gram_squared_error",
]

# float64 elements of the per-chunk Gram terms (u, G·u: [member, rows, d_model]) held at once.
_GRAM_ELEMENTS = 1 << 22
# float32 member logits ([member, rows, d_vocab]) held at once in the cross-entropy form.
_LOGIT_ELEMENTS = 1 << 25


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
        members: ``sublayers`` (B1: the embedding and every attention and MLP output, whose
            logit contributions add up to the model's logits) or ``states``: every residual
            state ``h_0 .. h_L`` read out through the run's lens (``--lens``: any lens, those
            that run blocks too) as a member predicting on its own; the ensemble is then the mean
            of their logits (both identities hold exactly), taken at the ``every`` positions.
    """

    name = "bias"
    reads_lens = True  # through lens_of (--lens)
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
    members: Members = "sublayers"

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be at least 1, got {self.every}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if self.weighting not in ("mean", "sum"):
            raise ValueError(f"weighting must be 'mean' or 'sum', not {self.weighting!r}")
        if self.labels and not self.tasks:
            raise ValueError("labels needs tasks (a JSONL file of prompt/label rows)")
        if self.members not in ("sublayers", "states"):
            raise ValueError(f"members must be 'sublayers' or 'states', not {self.members!r}")
        if self.members == "states" and self.tasks:
            raise ValueError("members=states reads the corpus's next tokens (no tasks)")

    def hooks(self, info: ModelInfo) -> list[str]:
        if self.members == "states":
            return [info.resid(layer) for layer in range(info.n_layers + 1)]
        return member_hooks(info)

    # -- examples (label-set mode) -------------------------------------------------------------
    def examples(self, model: Bridge, info: ModelInfo) -> list[Batch] | None:
        if self.members == "sublayers":  # an undecomposable final norm fails here, at once
            member_readout(model)
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
    def _label_ids(tokenizer: Tokenizer, words: tuple[str, ...], info: ModelInfo) -> list[int]:
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
        elif self.members == "states":
            self._update_states(state, step)
        else:
            self._update_next(state, step)

    def _update_states(self, state: Stats, step: Step) -> None:
        """Members ``h_0 .. h_L`` through the run's lens; both forms at the ``every``
        positions, for the full ensemble and every prefix ``h_0 .. h_l``."""
        batch, info = step.batch, step.info
        targets, has_target = batch.next_tokens()
        pos = torch.arange(batch.tokens.shape[1], device=batch.mask.device).expand_as(batch.mask)
        keep = batch.positions(exclude_bos=self.exclude_bos) & has_target & (pos % self.every == 0)
        readout, lens = final_readout(step.model), lens_of(step)
        if not lens.identity:
            state.fix("lens", lens.describe())
        n_states = info.n_layers + 1
        state.add("n", int(keep.sum()))
        state.add("n_ce", int(keep.sum()))
        y_all = targets[keep].to(readout.device)
        flat = [step.resid(layer).reshape(-1, info.d_model) for layer in range(n_states)]
        index = keep.reshape(-1).nonzero()[:, 0]
        read = lens.reader(step.model, batch.tokens, dtype=readout.dtype, device=readout.device)
        per_chunk = max(1, _LOGIT_ELEMENTS // (n_states * readout.d_vocab))
        for start in range(0, y_all.shape[0], per_chunk):
            rows = slice(start, start + per_chunk)
            idx = index[rows]
            f = torch.stack([readout.logits(read(flat, layer, idx)) for layer in range(n_states)])
            y = y_all[rows]
            for p, size in enumerate(prefix_sizes(info, self.members)):
                out = direct_decomposition(f[:size], y)
                self._add_prefix(state, p, info, out, full=size == n_states)

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
        for p, size in enumerate(prefix_sizes(info, "sublayers")):
            out = direct_decomposition(size * z[:size] + c, y)
            self._add_prefix(state, p, info, out, full=size == u.shape[0])

    def _update_next(self, state: Stats, step: Step) -> None:
        batch, info = step.batch, step.info
        targets, has_target = batch.next_tokens()
        keep = batch.positions(exclude_bos=self.exclude_bos) & has_target
        pos = torch.arange(batch.tokens.shape[1], device=keep.device).expand_as(keep)
        readout = member_readout(step.model)
        const = readout.const
        n_members, d_vocab = 2 * info.n_layers + 1, readout.W_U.shape[1]
        sizes = prefix_sizes(info, "sublayers")
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

    def _add_prefix(
        self, state: Stats, p: int, info: ModelInfo, out: dict[str, Tensor], *, full: bool
    ) -> None:
        """Both forms' sums of prefix ensemble ``p`` decomposed directly, and the per-member
        sums too when it is the ``full`` ensemble."""
        if full:
            self._add_full(state, out)
        for key in ("sq_bias", "sq_div", "sq_ens"):
            state.add(f"depth/{key}", _one_hot(p, info, out[key].sum()))
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
        return present(Decomposition.from_state(state, info, self.weighting, self.members), self)


def _one_hot(index: int, info: ModelInfo, value: Tensor) -> Tensor:
    out = torch.zeros(info.n_layers + 1, dtype=torch.float64, device=value.device)
    out[index] = value
    return out
