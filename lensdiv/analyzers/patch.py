"""``patch`` — causal interventions on clean/corrupt prompt pairs (SCIENCE.md A4).

Three measurements on the same pairs ``{clean, corrupt, target[, foil]}``:

1. **Activation patching** clean → corrupt over (layer × position) for ``resid_pre``,
   ``attn_out`` and ``mlp_out``: run the corrupt prompt with one clean activation copied in and
   score it by ``(m_patched - m_corrupt) / (m_clean - m_corrupt)`` (0: no effect, 1: the clean
   answer is fully restored), where the metric ``m`` is the target-minus-foil logit difference or
   the target probability at the answer position. Mean and standard error over pairs.
2. **Residual erasure**: replace ``h_l(t)`` by the dataset-mean residual of layer ``l`` (mean over
   every clean prompt's positions, BOS excluded by default, summed in pass 0) and measure
   ``||p - p̃||₂`` between the clean and the erased output distributions at the answer position:
   an ``[L+1, T]`` map.
3. **Integrated gradients** of the metric with respect to each layer output ``h_l`` (``l = 0..L``)
   of the clean prompt, from the baseline ``h̄_l`` (the prompt's mean over positions, BOS excluded
   by default) along the straight path, midpoint rule with ``ig_steps`` steps:
   ``attr(l, t) = Σ_d (h - h̄)·mean grad``.
   Completeness ``Σ_t attr(l, t) ≈ f(h_l) - f(h̄_l)`` is checked and its worst error reported.

Conventions:

- **Pairs** come from a JSONL file (``-O patch.pairs=FILE``, one object per line; BOS is
  prepended) or, by default, from :func:`builtin_pairs`: facts of the toy corpus' knowledge base
  (``boss(ka)=`` against ``boss(mi)=``) for the byte tokenizer of the toy models, capital cities
  (``The capital of France is`` → ``" Paris"``) for other tokenizers.
- **Answer position** = the last token of the prompt (the answer is predicted there).
- **Answer token** = the first token of the target tokenised *as a continuation*: the token that
  follows the prompt's tokens in ``tokenize(clean + target)``; when the prompt's tokens are not a
  prefix of that (a merge across the boundary), the first token of ``tokenize(target)`` alone. So
  write the space yourself where the tokenizer marks word starts (``" Paris"``). A target or foil
  may also be an integer token id. The foil is tokenised after the corrupt prompt.
- **Alignment**: clean and corrupt of one pair must tokenise to the same length (positions are
  compared one to one); pairs of different lengths are aligned **at the end**: column ``j`` of a
  ``[.., T]`` map is the position ``j - (T - 1)`` tokens before the answer position, and a column
  averages only the pairs long enough to have it.
- Pairs whose clean and corrupt metrics coincide (``|Δ| < 1e-6``) cannot be normalised: they are
  left out of the patching scores (counted in ``meta["degenerate_pairs"]``) but still enter the
  erasure and IG maps.

Interventions resume the forward pass from the patched layer (:class:`lensdiv.ops.resume.Resumer`)
and batch every site and position of a layer into one pass: a patching sweep is ``L`` passes of
``sites x T x pairs`` rows that run ``L/2`` blocks on average, where TransformerLens'
``get_act_patch_*`` runs ``3·L·T`` full passes (the tests check both agree). IG needs gradients,
which the resumer does not offer, so its passes run every block.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo, Step
from lensdiv.core.errors import DataError
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats

SITES = ("resid_pre", "attn_out", "mlp_out")
EPS = 1e-6
# Activation elements one batched intervention pass may hold (~256 MB in fp32).
_ELEMENTS = 1 << 26
ALIGNMENT = (
    "end: column j of a [.., T] map is the position j-(T-1) tokens before the answer position "
    "(the prompt's last token); a column averages the pairs long enough to have it"
)
ANSWER_RULE = (
    "first token of the target tokenised as a continuation of the prompt "
    "(tokenize(prompt + target) after tokenize(prompt); tokenize(target) alone when the prompt's "
    "tokens are not a prefix); integer targets are token ids"
)


# -- task data ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pair:
    """One clean/corrupt pair as read from the task file.

    Args:
        line: 1-based line number in the file (or index in the built-in set).
        clean: The prompt whose answer is ``target``.
        corrupt: A prompt of the same token length whose answer differs.
        target: The clean answer (string, or a token id).
        foil: The corrupt answer (needed by ``metric=logit_diff``).
    """

    line: int
    clean: str
    corrupt: str
    target: str | int
    foil: str | int | None = None


def read_pairs(path: str | Path) -> list[Pair]:
    """Read a JSONL file of ``{clean, corrupt, target[, foil]}`` objects, one per line.

    Raises:
        DataError: Missing or empty file, bad JSON, a missing key or a wrong type, naming the line.
    """
    from lensdiv.data.sources import read_task_jsonl

    path = Path(path)
    pairs = []
    required = ("clean", "corrupt", "target")
    for number, row in read_task_jsonl(path, required, what="pairs", option="patch.pairs"):
        where = f"{path.name} line {number}"
        for key in ("clean", "corrupt"):
            if not isinstance(row[key], str) or not row[key]:
                raise DataError(f"{where}: {key!r} must be a non-empty string")
        for key in ("target", "foil"):
            value = row.get(key)
            if key == "foil" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                raise DataError(f"{where}: {key!r} must be a string or a token id")
        pairs.append(Pair(number, row["clean"], row["corrupt"], row["target"], row.get("foil")))
    return pairs


_CAPITALS = (
    ("France", "Paris"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Japan", "Tokyo"),
    ("Egypt", "Cairo"),
    ("Peru", "Lima"),
    ("Kenya", "Nairobi"),
    ("Chile", "Santiago"),
    ("China", "Beijing"),
    ("Russia", "Moscow"),
    ("Greece", "Athens"),
    ("Cuba", "Havana"),
    ("Norway", "Oslo"),
    ("Poland", "Warsaw"),
    ("Austria", "Vienna"),
    ("Germany", "Berlin"),
)
_BUILTIN_PAIRS = 16


def _is_byte_tokenizer(tokenizer: Any) -> bool:
    from lensdiv.data.tokenizer import SPECIALS, VOCAB_SIZE

    try:
        specials = tokenizer.convert_ids_to_tokens(list(range(len(SPECIALS))))
        return len(tokenizer) == VOCAB_SIZE and tuple(specials) == SPECIALS
    except Exception:  # any tokenizer without these methods is not ours
        return False


def builtin_pairs(tokenizer: Any) -> list[Pair]:
    """The built-in task: knowledge-base facts for the byte tokenizer, capitals otherwise.

    Byte tokenizer (toy models): 4 facts per relation of the toy corpus' knowledge base,
    ``boss(ka)=`` → its answer, corrupted by another entity whose answer starts with a different
    letter (the foil). Other tokenizers: ``The capital of France is`` → ``" Paris"`` against other
    countries, keeping pairs whose prompts tokenise to the same length and whose answers differ
    in their first token.
    """
    if _is_byte_tokenizer(tokenizer):
        from lensdiv.data.corpus import RELATIONS, KnowledgeBase, Query

        kb = KnowledgeBase(seed=0)  # the knowledge base every toy model is trained on
        pairs: list[Pair] = []
        per_relation = _BUILTIN_PAIRS // len(RELATIONS)
        for relation in RELATIONS:
            entities = kb.entities
            used = 0
            for i, entity in enumerate(entities):
                answer = kb.answer((relation,), entity)
                for other in entities[i + 1 :] + entities[:i]:
                    foil = kb.answer((relation,), other)
                    if foil[0] != answer[0]:
                        pairs.append(
                            Pair(
                                len(pairs) + 1,
                                Query((relation,), entity, answer).prompt,
                                Query((relation,), other, foil).prompt,
                                answer,
                                foil,
                            )
                        )
                        used += 1
                        break
                if used == per_relation:
                    break
        return pairs
    unk = getattr(tokenizer, "unk_token_id", None)
    pairs = []
    for country, capital in _CAPITALS:
        for other, foil in _CAPITALS:
            if other == country:
                continue
            clean, corrupt = f"The capital of {country} is", f"The capital of {other} is"
            ids = [_encode(tokenizer, clean), _encode(tokenizer, corrupt)]
            if len(ids[0]) != len(ids[1]):
                continue
            answers = [_answer_id(tokenizer, clean, " " + capital)]
            answers.append(_answer_id(tokenizer, corrupt, " " + foil))
            if answers[0] == answers[1] or unk in [*ids[0], *ids[1], *answers] or None in answers:
                continue
            pairs.append(Pair(len(pairs) + 1, clean, corrupt, " " + capital, " " + foil))
            break  # one corruption per country keeps the set varied
        if len(pairs) == _BUILTIN_PAIRS:
            break
    return pairs


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _answer_id(tokenizer: Any, prompt: str, target: str) -> int | None:
    """The answer-token rule (module docstring); ``None`` when the target tokenises to nothing."""
    head = _encode(tokenizer, prompt)
    full = _encode(tokenizer, prompt + target)
    if len(full) > len(head) and full[: len(head)] == head:
        return full[len(head)]
    alone = _encode(tokenizer, target)
    return alone[0] if alone else None


def answer_token(tokenizer: Any, prompt: str, target: str | int, d_vocab: int, where: str) -> int:
    """Token id of ``target`` after ``prompt`` (see the module docstring), checked.

    Raises:
        DataError: The target tokenises to nothing or to the unknown token, or an id is outside
            the model's vocabulary.
    """
    hint = "give a target the tokenizer knows (or its token id below d_vocab)"
    if isinstance(target, int):
        if not 0 <= target < d_vocab:
            raise DataError(
                f"{where}: token id {target} is not in the vocabulary (d_vocab={d_vocab})",
                hint=hint,
            )
        return target
    token = _answer_id(tokenizer, prompt, target)
    if token is None:
        raise DataError(f"{where}: {target!r} tokenises to nothing", hint=hint)
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and token == unk:
        raise DataError(
            f"{where}: {target!r} is not in the vocabulary (it tokenises to the unknown token)",
            hint=hint,
        )
    if token >= d_vocab:
        raise DataError(
            f"{where}: {target!r} tokenises to id {token}, outside the model's vocabulary "
            f"(d_vocab={d_vocab})",
            hint="the tokenizer does not match the model",
        )
    return token


# -- measurements -------------------------------------------------------------------------------
def metric_values(
    logits: Float[Tensor, "row d_vocab"],
    target: Int[Tensor, " row"],
    foil: Int[Tensor, " row"],
    metric: str,
) -> Float[Tensor, " row"]:
    """``logit[target] - logit[foil]`` (``logit_diff``) or ``p(target)`` (``prob``)."""
    logits = logits.float()
    if metric == "logit_diff":
        return logits.gather(-1, target[:, None])[:, 0] - logits.gather(-1, foil[:, None])[:, 0]
    return logits.log_softmax(-1).gather(-1, target[:, None])[:, 0].exp()


def _last_position(model: Any) -> list[tuple[str, Callable[..., Any]]]:
    """A hook that unembeds only the last position (the answer position), where the model has
    the hook: the final norm and unembedding are per position, so the answer's logits are
    unchanged, and the largest matmul of a small model shrinks ``pos``-fold."""
    if "unembed.hook_in" not in model.hook_dict:
        return []

    def last(tensor: Tensor, *, hook: Any) -> Tensor:
        return tensor[:, -1:]

    return [("unembed.hook_in", last)]


def _rows_per_pass(model: Any, n_pos: int, *, grad: bool) -> int:
    """Rows of ``n_pos`` tokens one batched pass may hold within a fixed memory budget.

    Without gradients a pass holds a few ``[row, pos, d_mlp]`` activations and the logits;
    with gradients it keeps about a dozen activations per block for the backward.
    """
    cfg = model.cfg
    width = int(getattr(cfg, "d_mlp", None) or 4 * cfg.d_model)
    if grad:  # the answer position alone is unembedded (see _last_position)
        per_row = n_pos * width * 12 * int(cfg.n_layers) + int(cfg.d_vocab)
    else:
        per_row = n_pos * (width * 4 + int(cfg.d_vocab))
    return max(1, _ELEMENTS // per_row)


_RESUMERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _resumer(model: Any) -> Any:
    """One :class:`~lensdiv.ops.resume.Resumer` per model, so its first-use check runs once."""
    from lensdiv.ops.resume import Resumer

    if model not in _RESUMERS:
        _RESUMERS[model] = Resumer(model)
    return _RESUMERS[model]


def site_hook(site: str, layer: int) -> str:
    """TransformerLens hook name of ``site`` in block ``layer``."""
    return f"blocks.{layer}.hook_{site}"


Patch = tuple[str, Tensor, Tensor]  # (site, masks [variant, pos], values [batch, pos, d_model])


def run_patches(
    resumer: Any,
    tokens: Int[Tensor, "batch pos"],
    layer: int,
    resid: Float[Tensor, "batch pos d_model"],
    patches: Sequence[Patch],
) -> list[Tensor]:
    """Answer-position logits ``[variant, batch, d_vocab]`` of every variant of every patch.

    A patch ``(site, masks, values)`` has one variant per row of ``masks``: it runs every row of
    ``tokens`` from block ``layer`` with input ``resid`` (``h_layer``, ``0 ≤ layer ≤ L``) and
    replaces the activation of ``site`` by ``values`` at the positions where the row is True.
    ``site`` is ``"resid_pre"`` (the residual ``h_layer`` itself; ``layer = L`` is the final
    residual) or ``"attn_out"``/``"mlp_out"`` of block ``layer``. All variants of all patches
    share batched passes, chunked to stay within a fixed memory budget.
    """
    n_batch, n_pos = tokens.shape
    kinds = [site for site, masks, _ in patches for _ in range(masks.shape[0])]
    groups = [g for g, (_, masks, _) in enumerate(patches) for _ in range(masks.shape[0])]
    masks = torch.cat([m.to(tokens.device) for _, m, _ in patches])
    per_chunk = max(1, _rows_per_pass(resumer.model, n_pos, grad=False) // n_batch)
    out = []
    for start in range(0, masks.shape[0], per_chunk):
        stop = min(start + per_chunk, masks.shape[0])
        n = stop - start
        rows = tokens.repeat(n, 1)
        where = masks[start:stop, None, :, None].expand(n, n_batch, n_pos, 1)
        where = where.reshape(n * n_batch, n_pos, 1)
        values = torch.cat([patches[g][2] for g in groups[start:stop]])
        of_kind = {
            kind: torch.tensor(
                [k == kind for k in kinds[start:stop]], device=tokens.device
            ).repeat_interleave(n_batch)[:, None, None]
            for kind in set(kinds[start:stop])
        }
        mixed = resid.repeat(n, 1, 1)
        if "resid_pre" in of_kind:
            mixed = torch.where(where & of_kind["resid_pre"], values.to(mixed.dtype), mixed)
        hooks = []
        for kind, rows_of_kind in of_kind.items():
            if kind == "resid_pre":
                continue

            def hook(
                tensor: Tensor,
                *,
                hook: Any,
                sel: Tensor = where & rows_of_kind,
                new: Tensor = values,
            ) -> Tensor:
                return torch.where(sel, new.to(tensor.dtype), tensor)

            hooks.append((site_hook(kind, layer), hook))
        logits = resumer.run(rows, layer, mixed, hooks)
        assert logits is not None
        out.append(logits[:, -1].reshape(n, n_batch, -1))
    flat = torch.cat(out)
    sizes = [masks.shape[0] for _, masks, _ in patches]
    return list(flat.split(sizes))


def run_variants(
    resumer: Any,
    tokens: Int[Tensor, "batch pos"],
    layer: int,
    resid: Float[Tensor, "batch pos d_model"],
    masks: Bool[Tensor, "variant pos"],
    values: Float[Tensor, "batch pos d_model"],
    site: str = "resid_pre",
) -> Float[Tensor, "variant batch d_vocab"]:
    """:func:`run_patches` for one patch: logits of ``len(masks)`` variants."""
    (logits,) = run_patches(resumer, tokens, layer, resid, [(site, masks, values)])
    return logits


def integrated_gradients(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    hook_name: str,
    x: Float[Tensor, "batch pos d_model"],
    baseline: Float[Tensor, "batch pos d_model"],
    fn: Callable[[Tensor], Tensor],
    steps: int,
    start: int | None = None,
) -> tuple[Float[Tensor, "batch pos"], Float[Tensor, " batch"], Float[Tensor, " batch"]]:
    """Integrated gradients of ``fn`` of the answer-position logits w.r.t. activation ``hook_name``.

    ``fn`` maps logits ``[k, batch, d_vocab]`` (``k`` copies of the batch) to ``[k, batch]``.

    The activation is replaced by ``baseline + α (x - baseline)`` for the midpoints
    ``α = (k + ½)/steps`` (error O(1/steps²)), all α of a chunk in one batched pass (the
    first also evaluates ``f(x)`` and ``f(baseline)``).

    Returns:
        ``attr[b, t] = Σ_d (x - baseline)[b, t, d] · mean_α ∂f/∂h[b, t, d]``, ``f(x)`` and
        ``f(baseline)`` per row; completeness says ``attr.sum(-1) ≈ f(x) - f(baseline)``.

    With ``start`` (``hook_name`` is then the residual ``h_start``) each pass resumes from the
    path value and runs only blocks ``start..L-1`` (:class:`~lensdiv.ops.resume.Resumer`).
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    n_batch, n_pos = tokens.shape
    diff = (x - baseline).detach()
    per_chunk = max(1, _rows_per_pass(model, n_pos, grad=True) // n_batch - 2)
    grad_sum = torch.zeros_like(diff)
    alphas = (torch.arange(steps, dtype=torch.float64, device=x.device) + 0.5) / steps

    def forward(path: Tensor) -> Tensor:
        rows = tokens.repeat(path.shape[0] // n_batch, 1)

        def inject(tensor: Tensor, *, hook: Any) -> Tensor:
            return path.to(tensor.dtype)

        if start is not None:
            logits = _resumer(model).run(rows, start, path, _last_position(model), grad=True)
        else:
            with model.hooks(fwd_hooks=[(hook_name, inject), *_last_position(model)]):
                logits = model(rows)
        return fn(logits[:, -1].reshape(-1, n_batch, logits.shape[-1]))

    ends = None
    for lo in range(0, steps, per_chunk):
        chunk = alphas[lo : lo + per_chunk].to(x.dtype)
        path = baseline.detach()[None] + chunk[:, None, None, None] * diff[None]
        if ends is None:  # the end points ride along with the first chunk (their grads unused)
            path = torch.cat([x.detach()[None], baseline.detach()[None], path])
        path = path.reshape(-1, n_pos, diff.shape[-1]).requires_grad_(True)
        with torch.enable_grad():
            values = forward(path)
            (grad,) = torch.autograd.grad(values.sum(), path)
        grad = grad.detach().reshape(-1, n_batch, n_pos, diff.shape[-1])
        if ends is None:
            ends, grad = values.detach()[:2], grad[2:]
        grad_sum += grad.sum(0)
    assert ends is not None
    attr = (diff.double() * grad_sum.double()).sum(-1) / steps
    return attr.float(), ends[0], ends[1]


# -- the analyzer -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Patching(Analyzer):
    """Activation patching, residual erasure and integrated gradients on clean/corrupt pairs.

    Args:
        pairs: ``"builtin"`` or a JSONL file of ``{clean, corrupt, target[, foil]}`` per line.
        metric: ``logit_diff`` (target minus foil logit; needs a foil) or ``prob`` (target
            probability), at the answer position.
        sites: Activations to patch: any of ``resid_pre``, ``attn_out``, ``mlp_out``.
        ig_steps: Integration steps of integrated gradients (the source's 256); ``0`` skips IG.
            The midpoint rule's error falls as ``1/steps²``: on the trained default toy 256 steps
            leave a completeness error of at most 1e-4 (0.1 % relative for the worst pair and
            layer), 64 steps 2e-3 (2 %) at a quarter of the cost. The error reached is in the
            result.
        erasure: Run the residual-erasure map (a second pass over the pairs).
        exclude_bos: Leave BOS out of the dataset-mean residual and of the IG baseline mean.
        prepend_bos: Put the tokenizer's BOS token before every prompt.
        batch_size: Pairs per batch (pairs are batched by token length).
    """

    name = "patch"
    aliases = ("patching", "causal")
    description = (
        "Activation patching (resid/attn/mlp x position), residual erasure and integrated "
        "gradients on clean/corrupt pairs"
    )
    needs_logits = True
    extra_forwards = True
    needs_grad = True
    passes: ClassVar[int] = 2

    pairs: str = "builtin"
    metric: Literal["logit_diff", "prob"] = "logit_diff"
    sites: tuple[str, ...] = SITES
    ig_steps: int = 256
    erasure: bool = True
    exclude_bos: bool = True
    prepend_bos: bool = True
    batch_size: int = 8

    def __post_init__(self) -> None:
        unknown = [s for s in self.sites if s not in SITES]
        if unknown or not self.sites:
            raise ValueError(f"sites must be some of {', '.join(SITES)}, not {self.sites!r}")
        if self.metric not in ("logit_diff", "prob"):
            raise ValueError(f"metric must be logit_diff or prob, not {self.metric!r}")
        if self.ig_steps < 0:
            raise ValueError(f"ig_steps must be >= 0, got {self.ig_steps}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    def hooks(self, info: ModelInfo) -> list[str]:
        names = [info.resid(layer) for layer in range(info.n_layers + 1)]
        for site in self.sites:
            if site != "resid_pre":
                names += [site_hook(site, layer) for layer in range(info.n_layers)]
        return names

    # -- examples --------------------------------------------------------------------------------
    def examples(self, model: Any, info: ModelInfo) -> list[Batch]:
        tokenizer = model.tokenizer
        if self.pairs == "builtin":
            pairs, source = builtin_pairs(tokenizer), "built-in pair"
            if not pairs:
                raise DataError(
                    "no built-in pair tokenises to equal lengths with this model's tokenizer",
                    hint="pass your own pairs with -O patch.pairs=FILE.jsonl",
                )
        else:
            pairs, source = read_pairs(self.pairs), f"{Path(self.pairs).name} line"
        bos = tokenizer.bos_token_id if self.prepend_bos else None
        n_ctx = int(getattr(model.cfg, "n_ctx", 0) or 0)
        rows: dict[int, list[tuple[list[int], list[int], int, int, int]]] = {}
        for pair in pairs:
            where = f"{source} {pair.line}"
            clean = ([bos] if bos is not None else []) + _encode(tokenizer, pair.clean)
            corrupt = ([bos] if bos is not None else []) + _encode(tokenizer, pair.corrupt)
            if len(clean) != len(corrupt):
                raise DataError(
                    f"{where}: clean and corrupt tokenise to different lengths "
                    f"({len(clean)} vs {len(corrupt)} tokens)",
                    hint="patching compares positions one to one; make the prompts differ by "
                    "words of equal token length",
                )
            target = answer_token(tokenizer, pair.clean, pair.target, info.d_vocab, where)
            if pair.foil is None:
                if self.metric == "logit_diff":
                    raise DataError(
                        f"{where}: no 'foil', but metric logit_diff needs one",
                        hint="add the corrupt prompt's answer as foil, or use -O patch.metric=prob",
                    )
                foil = target
            else:
                foil = answer_token(tokenizer, pair.corrupt, pair.foil, info.d_vocab, where)
                if foil == target and self.metric == "logit_diff":
                    raise DataError(
                        f"{where}: target {pair.target!r} and foil {pair.foil!r} start with the "
                        f"same token (id {target}), so their logit difference is always 0",
                        hint="choose answers whose first tokens differ",
                    )
            if n_ctx and len(clean) > n_ctx:
                raise DataError(
                    f"{where}: the prompt has {len(clean)} tokens, more than the model's context "
                    f"of {n_ctx}",
                    hint="shorten the prompts",
                )
            rows.setdefault(len(clean), []).append((clean, corrupt, target, foil, pair.line))
        batches = []
        for length in sorted(rows):
            group = rows[length]
            for start in range(0, len(group), self.batch_size):
                chunk = group[start : start + self.batch_size]
                tokens = torch.tensor([c[0] for c in chunk], dtype=torch.long)
                batches.append(
                    Batch(
                        tokens=tokens,
                        mask=torch.ones_like(tokens, dtype=torch.bool),
                        bos=bos is not None,
                        index=len(batches),
                        extra={
                            "corrupt": torch.tensor([c[1] for c in chunk], dtype=torch.long),
                            "target": torch.tensor([c[2] for c in chunk], dtype=torch.long),
                            "foil": torch.tensor([c[3] for c in chunk], dtype=torch.long),
                            "line": [c[4] for c in chunk],
                        },
                    )
                )
        return batches

    # -- streaming ---------------------------------------------------------------------------------
    def update(self, state: Stats, step: Step) -> None:
        batch, info = step.batch, step.info
        device = batch.tokens.device
        tokens = batch.tokens
        n_batch, n_pos = tokens.shape
        target = batch.extra["target"].to(device)
        foil = batch.extra["foil"].to(device)
        L = info.n_layers
        clean = {k: v.detach() for k, v in step.cache.items()}
        assert step.logits is not None
        clean_last = step.logits[:, -1].detach()
        resumer = _resumer(step.model)
        keep = torch.ones(n_pos, dtype=torch.bool, device=device)
        if self.exclude_bos and batch.bos:
            keep[0] = False
        with torch.no_grad():
            if step.pass_index == 0:
                self._pass0(state, step, resumer, clean, clean_last, target, foil, keep)
            elif self.erasure and "resid_n" in state:
                mean = state["resid_sum"] / state["resid_n"]
                p_clean = clean_last.float().softmax(-1)
                eye = torch.eye(n_pos, dtype=torch.bool, device=device)
                dist = torch.zeros(L + 1, n_pos, n_batch, dtype=torch.float64, device=device)
                for layer in range(L + 1):
                    h = clean[info.resid(layer)]
                    values = mean[layer].to(h.dtype).expand_as(h)
                    logits = run_variants(resumer, tokens, layer, h, eye, values)
                    dist[layer] = (logits.float().softmax(-1) - p_clean).norm(dim=-1)
                state.add(f"erase/{n_pos}/sum", dist.sum(-1))
                state.add(f"erase/{n_pos}/sq", (dist**2).sum(-1))
                state.add(f"erase/{n_pos}/n", n_batch)
        if resumer.mode is not None and step.pass_index == 0:
            state.add("resumer/resume", float(resumer.mode == "resume"))
            state.add("resumer/calls", 1.0)

    def _pass0(
        self,
        state: Stats,
        step: Step,
        resumer: Any,
        clean: dict[str, Tensor],
        clean_last: Float[Tensor, "batch d_vocab"],
        target: Int[Tensor, " batch"],
        foil: Int[Tensor, " batch"],
        keep: Bool[Tensor, " pos"],
    ) -> None:
        from lensdiv.ops.capture import capture

        batch, info, model = step.batch, step.info, step.model
        L = info.n_layers
        n_batch, n_pos = batch.tokens.shape
        corrupt_tokens = batch.extra["corrupt"].to(batch.tokens.device)
        corrupt_logits, corrupt = capture(model, corrupt_tokens, self.hooks(info), need_logits=True)
        assert corrupt_logits is not None
        m_clean = metric_values(clean_last, target, foil, self.metric).double()
        m_corrupt = metric_values(corrupt_logits[:, -1], target, foil, self.metric).double()
        gap = m_clean - m_corrupt
        ok = gap.abs() >= EPS
        for i, line in enumerate(batch.extra["line"]):
            state.add(f"pair/{line}/tokens", n_pos)
            state.add(f"pair/{line}/target", int(target[i]))
            state.add(f"pair/{line}/foil", int(foil[i]))
            state.add(f"pair/{line}/clean", float(m_clean[i]))
            state.add(f"pair/{line}/corrupt", float(m_corrupt[i]))

        # Dataset-mean residual for the erasure pass.
        h_all = torch.stack([clean[info.resid(layer)] for layer in range(L + 1)]).double()
        state.add("resid_sum", h_all[:, :, keep].sum((1, 2)))
        state.add("resid_n", n_batch * int(keep.sum()))

        # Activation patching: one batched pass per layer for every site and position.
        eye = torch.eye(n_pos, dtype=torch.bool, device=batch.tokens.device)
        state.add(f"n/{n_pos}", int(ok.sum()))
        state.add(f"all/{n_pos}", n_batch)
        raw = torch.zeros(len(self.sites), L, n_pos, n_batch, dtype=torch.float64)
        for layer in range(L):
            patches = [(site, eye, clean[site_hook(site, layer)]) for site in self.sites]
            outs = run_patches(resumer, corrupt_tokens, layer, corrupt[info.resid(layer)], patches)
            for i, logits in enumerate(outs):
                flat = logits.reshape(n_pos * n_batch, -1)
                values = metric_values(flat, target.repeat(n_pos), foil.repeat(n_pos), self.metric)
                raw[i, layer] = values.reshape(n_pos, n_batch).double().cpu()
        for i, site in enumerate(self.sites):
            score = (raw[i] - m_corrupt.cpu()) / torch.where(ok, gap, torch.ones_like(gap)).cpu()
            score = score[..., ok.cpu()]
            state.add(f"{site}/{n_pos}/raw", raw[i].sum(-1))
            state.add(f"{site}/{n_pos}/sum", score.sum(-1))
            state.add(f"{site}/{n_pos}/sq", (score**2).sum(-1))

        # Integrated gradients of the metric w.r.t. every layer output.
        if self.ig_steps:

            def fn(logits: Tensor) -> Tensor:
                k = logits.shape[0]
                flat = metric_values(
                    logits.reshape(-1, logits.shape[-1]),
                    target.repeat(k),
                    foil.repeat(k),
                    self.metric,
                )
                return flat.reshape(k, -1)

            attr_all = torch.zeros(L + 1, n_batch, n_pos, dtype=torch.float64, device=gap.device)
            abs_error = torch.zeros(L + 1, dtype=torch.float64)
            rel_error = torch.zeros(L + 1, dtype=torch.float64)
            for layer in range(L + 1):
                x = clean[info.resid(layer)]
                base = x[:, keep].mean(1, keepdim=True).expand_as(x)
                attr, f_x, f_base = integrated_gradients(
                    model, batch.tokens, info.resid(layer), x, base, fn, self.ig_steps, layer
                )
                attr_all[layer] = attr.double()
                delta = (f_x - f_base).double()
                error = (attr.double().sum(-1) - delta).abs()
                abs_error[layer] = float(error.max())
                rel_error[layer] = float((error / delta.abs().clamp_min(EPS)).max())
            state.max("ig/abs_error", abs_error)
            state.max("ig/rel_error", rel_error)
            state.add(f"ig/{n_pos}/sum", attr_all.sum(1))
            state.add(f"ig/{n_pos}/sq", (attr_all**2).sum(1))
            state.add(f"ig/{n_pos}/n", n_batch)

    # -- results -----------------------------------------------------------------------------------
    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        L = info.n_layers
        lengths = sorted(int(k.split("/")[1]) for k in state.sums if k.startswith("all/"))
        if not lengths:
            raise RuntimeError("no pair was processed")
        n_pos = max(lengths)
        offsets = list(range(-(n_pos - 1), 1))
        arrays: dict[str, Any] = {"positions": offsets}
        long: dict[str, dict[str, list]] = {}
        maps: dict[str, Tensor] = {}

        def aligned(prefix: str, count: Callable[[int], str], n_rows: int) -> tuple[Tensor, ...]:
            total = torch.zeros(n_rows, n_pos, dtype=torch.float64)
            squares, n = torch.zeros_like(total), torch.zeros(n_pos, dtype=torch.float64)
            for length in lengths:
                if f"{prefix}/{length}/sum" not in state:
                    continue
                total[:, n_pos - length :] += state[f"{prefix}/{length}/sum"].cpu()
                squares[:, n_pos - length :] += state[f"{prefix}/{length}/sq"].cpu()
                n[n_pos - length :] += float(state[count(length)])
            return _mean_stderr(total, squares, n)

        table_patch: dict[str, list] = {k: [] for k in ("site", "layer", "pos", "score")}
        table_patch.update(stderr=[], pairs=[], metric_mean=[])
        for site in self.sites:
            mean, stderr, n = aligned(site, lambda t: f"n/{t}", L)
            raw_sum = torch.zeros(L, n_pos, dtype=torch.float64)
            count = torch.zeros(n_pos, dtype=torch.float64)
            for length in lengths:
                raw_sum[:, n_pos - length :] += state[f"{site}/{length}/raw"].cpu()
                count[n_pos - length :] += float(state[f"all/{length}"])
            raw_mean = raw_sum / count.clamp_min(1)
            maps[site] = mean
            arrays[f"patch_{site}"] = mean
            arrays[f"patch_{site}_stderr"] = stderr
            for layer in range(L):
                for j, offset in enumerate(offsets):
                    table_patch["site"].append(site)
                    table_patch["layer"].append(layer)
                    table_patch["pos"].append(offset)
                    table_patch["score"].append(float(mean[layer, j]))
                    table_patch["stderr"].append(float(stderr[layer, j]))
                    table_patch["pairs"].append(int(n[j]))
                    table_patch["metric_mean"].append(float(raw_mean[layer, j]))
        long["patching"] = table_patch

        for kind, prefix in (("erasure", "erase"), ("ig", "ig")):
            if not any(k.startswith(f"{prefix}/") and k.endswith("/sum") for k in state.sums):
                continue
            mean, stderr, n = aligned(prefix, lambda t, p=prefix: f"{p}/{t}/n", L + 1)
            maps[kind] = mean
            arrays[kind] = mean
            arrays[f"{kind}_stderr"] = stderr
            value = "distance" if kind == "erasure" else "attribution"
            rows: dict[str, list] = {"layer": [], "pos": [], value: [], "stderr": [], "pairs": []}
            for layer in range(L + 1):
                for j, offset in enumerate(offsets):
                    rows["layer"].append(layer)
                    rows["pos"].append(offset)
                    rows[value].append(float(mean[layer, j]))
                    rows["stderr"].append(float(stderr[layer, j]))
                    rows["pairs"].append(int(n[j]))
            long[kind] = rows
        meta: dict[str, Any] = {}
        if "ig/abs_error" in state:
            arrays["ig_completeness_abs_error"] = state["ig/abs_error"]
            arrays["ig_completeness_rel_error"] = state["ig/rel_error"]
            meta["ig_completeness_rel_error"] = float(state["ig/rel_error"].max())
            meta["ig_completeness_abs_error"] = float(state["ig/abs_error"].max())

        # Per pair: what the metric does on the clean and the corrupt prompt.
        lines = sorted({int(k.split("/")[1]) for k in state.sums if k.startswith("pair/")})
        pairs: dict[str, list] = {"line": lines}
        for key in ("tokens", "target", "foil"):
            pairs[key if key == "tokens" else f"{key}_id"] = [
                int(state[f"pair/{i}/{key}"]) for i in lines
            ]
        for key in ("clean", "corrupt"):
            pairs[f"{key}_{self.metric}"] = [float(state[f"pair/{i}/{key}"]) for i in lines]
        gaps = [
            c - r
            for c, r in zip(
                pairs[f"clean_{self.metric}"], pairs[f"corrupt_{self.metric}"], strict=True
            )
        ]
        pairs["normalised"] = [int(abs(g) >= EPS) for g in gaps]
        n_pairs, degenerate = len(lines), sum(1 - u for u in pairs["normalised"])

        depth: dict[str, list] = {"layer": list(range(L + 1))}
        for site in self.sites:
            best, where = _best(maps[site])
            depth[f"{site}_max"] = [*best, math.nan]
            depth[f"{site}_pos"] = [*(offsets[w] if w >= 0 else math.nan for w in where), math.nan]
        if "erasure" in maps:
            best, where = _best(maps["erasure"])
            depth["erasure_max"] = best
            depth["erasure_pos"] = [offsets[w] if w >= 0 else math.nan for w in where]
        if "ig" in maps:
            depth["ig_sum"] = torch.nansum(maps["ig"], 1).tolist()
            depth["ig_answer"] = maps["ig"][:, -1].tolist()
            depth["ig_completeness_rel_error"] = arrays["ig_completeness_rel_error"]

        tables = {
            "depth": Table(
                "depth",
                depth,
                "Per layer: best patching score (pos = offset from the answer), erasure and IG",
            ),
            "patching": Table(
                "patching", long["patching"], "Normalised patching score per site, layer, position"
            ),
        }
        if "erasure" in long:
            tables["erasure"] = Table(
                "erasure", long["erasure"], "||p - p~||_2 at the answer after erasing h_l(t)"
            )
        if "ig" in long:
            tables["ig"] = Table("ig", long["ig"], "Integrated-gradients attribution of h_l(t)")
        tables["pairs"] = Table("pairs", pairs, "Clean and corrupt metric of every pair")

        xlabel = f"position (end-aligned; {n_pos - 1} = answer)"
        plots = [
            Plot(
                "heatmap",
                f"patch_{site}",
                f"Patching {site} ({self.metric})",
                f"patch_{site}",
                xlabel=xlabel,
                ylabel="layer",
            )
            for site in self.sites
        ]
        if "erasure" in maps:
            plots.append(
                Plot(
                    "heatmap",
                    "erasure",
                    "Residual erasure ||p - p~||",
                    "erasure",
                    xlabel=xlabel,
                    ylabel="residual h_l",
                )
            )
        if "ig" in maps:
            plots.append(
                Plot(
                    "heatmap",
                    "ig",
                    f"Integrated gradients ({self.metric})",
                    "ig",
                    xlabel=xlabel,
                    ylabel="layer output h_l",
                )
            )
        resumed = state.get("resumer/resume")
        calls = state.get("resumer/calls")
        meta.update(
            metric=self.metric,
            sites=list(self.sites),
            ig_steps=self.ig_steps,
            ig_rule="midpoint",
            ig_baseline="mean over the prompt's positions of h_l"
            + (" (BOS excluded)" if self.exclude_bos else ""),
            erasure_mean="dataset mean of h_l over clean prompts' positions"
            + (" (BOS excluded)" if self.exclude_bos else ""),
            pairs=self.pairs,
            n_pairs=n_pairs,
            degenerate_pairs=degenerate,
            positions=n_pos,
            alignment=ALIGNMENT,
            answer_token=ANSWER_RULE,
            answer_position="last prompt token",
            intervention="resume" if calls and float(resumed) == float(calls) else "rerun",
        )
        summary = self._summary(maps, offsets, n_pairs, degenerate, meta)
        return Result(
            analyzer=self.name,
            summary=summary,
            tables=tables,
            arrays=arrays,
            plots=tuple(plots),
            meta=meta,
        )

    def _summary(
        self,
        maps: dict[str, Tensor],
        offsets: list[int],
        n_pairs: int,
        degenerate: int,
        meta: dict[str, Any],
    ) -> str:
        parts = [
            f"{n_pairs} pairs, metric {self.metric}"
            + (
                f" ({degenerate} with equal clean and corrupt metric left out)"
                if degenerate
                else ""
            )
            + "."
        ]
        if "resid_pre" in maps:
            _, where = _best(maps["resid_pre"])
            runs = _runs([offsets[w] if w >= 0 else None for w in where])
            spans = [
                ("the answer position" if pos == 0 else f"offset {pos}")
                + (f" in layers {a}-{b}" if a != b else f" in layer {a}")
                for a, b, pos in runs
            ]
            text = ", then ".join(spans)
            parts.append(f"Patching the residual stream, the answer sits at {text}.")
        for site, label in (("attn_out", "attention"), ("mlp_out", "MLP")):
            if site in maps and torch.isfinite(maps[site]).any():
                layer, j = _argmax(maps[site])
                parts.append(
                    f"Strongest {label} output: layer {layer} at offset {offsets[j]} "
                    f"(score {float(maps[site][layer, j]):.2f})."
                )
        if "erasure" in maps and torch.isfinite(maps["erasure"]).any():
            layer, j = _argmax(maps["erasure"])
            parts.append(
                f"Erasing h_{layer} at offset {offsets[j]} moves the output most "
                f"(||p - p~|| = {float(maps['erasure'][layer, j]):.3f})."
            )
        if "ig" in maps and torch.isfinite(maps["ig"]).any():
            layer, j = _argmax(maps["ig"].abs())
            parts.append(
                f"Integrated gradients put the most weight on h_{layer} at offset {offsets[j]}; "
                f"completeness error at most {meta.get('ig_completeness_rel_error', math.nan):.2g} "
                f"(relative) with {self.ig_steps} steps."
            )
        parts.append("Offsets count back from the answer position (0).")
        return " ".join(parts)


def _mean_stderr(
    total: Float[Tensor, "row pos"], squares: Float[Tensor, "row pos"], n: Float[Tensor, " pos"]
) -> tuple[Float[Tensor, "row pos"], Float[Tensor, "row pos"], Float[Tensor, " pos"]]:
    """Mean and standard error (unbiased std / sqrt(n)) from sums; NaN where undefined."""
    mean = torch.where(n > 0, total / n.clamp_min(1), torch.full_like(total, math.nan))
    var = (squares / n.clamp_min(1) - mean**2).clamp_min(0) * n / (n - 1).clamp_min(1)
    stderr = torch.where(n > 1, (var / n.clamp_min(1)).sqrt(), torch.full_like(total, math.nan))
    return mean, stderr, n


def _best(grid: Float[Tensor, "row pos"]) -> tuple[list[float], list[int]]:
    """Row-wise maximum over finite entries and its column (-1 for an all-NaN row)."""
    finite = torch.isfinite(grid)
    filled = torch.where(finite, grid, torch.full_like(grid, -math.inf))
    best, where = filled.max(1)
    has = finite.any(1)
    return (
        [float(b) if h else math.nan for b, h in zip(best, has, strict=True)],
        [int(w) if h else -1 for w, h in zip(where, has, strict=True)],
    )


def _argmax(grid: Float[Tensor, "row pos"]) -> tuple[int, int]:
    filled = torch.where(torch.isfinite(grid), grid, torch.full_like(grid, -math.inf))
    flat = int(filled.argmax())
    return flat // grid.shape[1], flat % grid.shape[1]


def _runs(values: Sequence[int | None]) -> list[tuple[int, int, int]]:
    """``[(first, last, value)]`` for runs of equal values (``None`` entries are skipped)."""
    runs: list[tuple[int, int, int]] = []
    for i, value in enumerate(values):
        if value is None:
            continue
        if runs and runs[-1][2] == value and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i, value)
        else:
            runs.append((i, i, value))
    return runs
