"""Built-in toy models: small TL-native bridges that lensdiv trains itself, so every analysis has
real structure to look at on a machine with no network.

Spec names: ``toy`` (the default, ``toy:d4-w64``), ``toy:d4`` (depth 4, default width),
``toy:d8-w128``, and ``toy:kb``, the multi-hop toy: 6 blocks trained on knowledge-base documents
alone and for longer, so that it answers the facts and the 2-hop (some 3-hop) queries of the
training split's chains, the in-distribution queries ``depth-score`` asks (the zoo, trained on
the language mix, answers 2–4-hop queries no better than their prior baseline). It does not
generalise compositionally: held-out chains stay at their prior baseline. The first use trains the
model on its corpus (a progress bar shows it) and caches weights, recipe and training log under
the user cache directory, keyed by a hash of the training recipe. A cache entry is only loaded
when its checksum verifies; a partial or corrupt one is retrained.

The default toy (``toy``, its default recipe) ships trained with the package (``shipped/``, an
entry of the same layout and key, ~1 MB): when the cache has no entry of that key, it is read
from there, directly (nothing to copy, go stale or fail to write), so a fresh install starts in
seconds. A shipped copy whose checksum fails is trained instead, with one warning line;
``lensdiv toy train toy`` still trains it (and says whether the weights equal the shipped ones),
and ``python -m lensdiv.models.ship`` refreshes the shipped copy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lensdiv.core.bridge import Bridge
from lensdiv.core.devices import place_model
from lensdiv.core.errors import ModelLoadError
from lensdiv.core.files import cache_root, folder_problem
from lensdiv.core.progress import progress_bar
from lensdiv.core.results import agg_figure
from lensdiv.data.corpus import CORPUS_VERSION, QUERY_HOPS, KnowledgeBase, mixed_documents
from lensdiv.data.packing import pack
from lensdiv.data.sources import DataSpec, token_batches
from lensdiv.data.tokenizer import VOCAB_SIZE, byte_tokenizer
from lensdiv.models.entries import COMPLETE as _COMPLETE
from lensdiv.models.entries import build_entry, verify_entry

TOY_VERSION = 1
DEFAULT_DEPTH = 4
DEFAULT_WIDTH = 64
DEPTHS = (1, 2, 3, 4, 6, 8)
WIDTHS = (32, 64, 128)
_SPEC = re.compile(r"^toy(?::d(?P<depth>\d+)(?:-w(?P<width>\d+))?)?$")
#: The multi-hop toy's spec name.
KB_TOY = "toy:kb"
#: The weights of a cache entry: safetensors (no pickle); entries cached before hold weights.pt.
WEIGHTS = "weights.safetensors"
_OLD_WEIGHTS = "weights.pt"
#: The trained entries shipped with the package (the default toy's), named as in the cache.
SHIPPED = Path(__file__).parent / "shipped"
#: Steps of the default recipe whose weights' digest the shipped entry records (``prefix.json``):
#: a test trains them (seconds) and compares, bit for bit where the platform allows.
PREFIX_STEPS = 25
_PREFIX = "prefix.json"


@dataclass(frozen=True)
class ToySpec:
    """Architecture of one toy model.

    Args:
        depth: Number of blocks.
        width: ``d_model``; heads of width 16, MLP 4×.
        n_ctx: Context length.
        seed: Initialisation seed.
        init_std: Standard deviation of the weight initialisation (0: TransformerLens' default).
        task: ``"mix"`` (the zoo: language text and knowledge-base documents) or ``"kb"`` (the
            multi-hop toy ``toy:kb``, whose default recipe is :meth:`TrainRecipe.multihop`).
    """

    depth: int = DEFAULT_DEPTH
    width: int = DEFAULT_WIDTH
    n_ctx: int = 256
    seed: int = 0
    init_std: float = 0.0  # 0: TransformerLens' default, 0.8 / sqrt(width)
    task: str = "mix"

    @property
    def name(self) -> str:
        """Canonical spec string."""
        return KB_TOY if self.task == "kb" else f"toy:d{self.depth}-w{self.width}"

    def bridge_config(self) -> Any:
        """The ``TransformerBridgeConfig`` for ``boot_native``."""
        from transformer_lens.config import TransformerBridgeConfig

        return TransformerBridgeConfig(
            d_model=self.width,
            d_head=16,
            n_heads=self.width // 16,
            n_layers=self.depth,
            n_ctx=self.n_ctx,
            d_mlp=4 * self.width,
            d_vocab=VOCAB_SIZE,
            act_fn="gelu",
            normalization_type="LN",
            seed=self.seed,
            initializer_range=self.init_std,
        )


@dataclass(frozen=True)
class TrainRecipe:
    """How a toy model is trained (its hash names the cache entry).

    Args:
        steps: Optimiser steps.
        batch_size: Sequences per step.
        seq_len: Tokens per sequence.
        lr: Peak AdamW learning rate (linear warm-up, cosine decay to 10 %).
        warmup: Warm-up steps.
        weight_decay: AdamW weight decay.
        data_seed: Seed of the training corpus.
        eval_tokens: Held-out tokens for the evaluation loss.
        eval_every: Steps between evaluations.
        hop_queries: Held-out queries per hop count for multi-hop accuracy.
        kb_fraction: Share of knowledge-base documents in the training mix (the rest is
            language-like text).
        kb_hops: Hop counts of the queries in each knowledge-base document (one per entry).
    """

    steps: int = 500
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 5e-3
    warmup: int = 25
    weight_decay: float = 0.01
    data_seed: int = 0
    eval_tokens: int = 8192
    eval_every: int = 125
    hop_queries: int = 200
    kb_fraction: float = 0.35
    kb_hops: tuple[int, ...] = QUERY_HOPS

    @classmethod
    def multihop(cls) -> TrainRecipe:
        """The recipe of ``toy:kb``: knowledge-base documents only, trained long enough to answer
        the facts and the 2-hop queries of the training split's chains (``bench/README.md``
        records how it was chosen)."""
        return cls(**MULTIHOP_RECIPE)

    @classmethod
    def default(cls, spec: ToySpec | None = None) -> TrainRecipe:
        """The recipe in force for ``spec`` (the zoo's, or :meth:`multihop` for ``toy:kb``);
        ``LENSDIV_TOY_STEPS`` overrides the step count (tests use it)."""
        base = cls.multihop() if spec is not None and spec.task == "kb" else cls()
        steps = os.environ.get("LENSDIV_TOY_STEPS")
        if steps:
            try:
                n = int(steps)
                if n < 1:
                    raise ValueError(steps)
            except ValueError:
                raise ModelLoadError(
                    f"LENSDIV_TOY_STEPS must be a positive whole number, not {steps!r}",
                    hint="unset it (the default recipe) or set e.g. LENSDIV_TOY_STEPS=500",
                ) from None
            return dataclasses.replace(
                base,
                steps=n,
                warmup=max(1, n // 20),
                eval_every=max(1, n // 2),
                eval_tokens=2048,
                hop_queries=50,
            )
        return base


#: ``toy:kb``: its architecture, and what its recipe changes from the zoo's (the search that
#: chose them is in ``bench/README.md``).
KB_SPEC = ToySpec(depth=6, width=64, task="kb")
MULTIHOP_RECIPE: dict[str, Any] = {
    "steps": 3000,
    "kb_fraction": 1.0,
    "weight_decay": 0.1,
    "eval_every": 500,
}


def parse_toy(spec: str) -> ToySpec:
    """Parse ``toy``, ``toy:d4``, ``toy:d8-w128`` or ``toy:kb``."""
    if spec.strip() == KB_TOY:
        return KB_SPEC
    match = _SPEC.match(spec.strip())
    if not match:
        raise ModelLoadError(
            f"bad toy model spec {spec!r}",
            hint="use 'toy', 'toy:d4', 'toy:d8-w128' (depth d, width w, a multiple of 16) or "
            "'toy:kb' (the multi-hop toy)",
        )
    depth = int(match["depth"] or DEFAULT_DEPTH)
    width = int(match["width"] or DEFAULT_WIDTH)
    if not 1 <= depth <= 64 or width < 16 or width % 16 or width > 1024:
        raise ModelLoadError(
            f"toy model {spec!r} is out of range",
            hint="depth 1..64 and width a multiple of 16 in 16..1024",
        )
    return ToySpec(depth=depth, width=width)


def zoo() -> list[ToySpec]:
    """The toy zoo: a depth family at the default width, a width family at the default depth,
    and the multi-hop toy ``toy:kb``."""
    specs = [ToySpec(depth=d) for d in DEPTHS]
    specs += [ToySpec(width=w) for w in WIDTHS if w != DEFAULT_WIDTH]
    return [*specs, KB_SPEC]


# -- cache ------------------------------------------------------------------------------------


def recipe_key(spec: ToySpec, recipe: TrainRecipe) -> str:
    """Hash of everything that determines the trained weights."""

    blob = json.dumps(
        {
            "spec": _hashed(spec),
            "recipe": _hashed(recipe),
            "corpus": CORPUS_VERSION,
            "toy": TOY_VERSION,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


# Fields added after TOY_VERSION 1 enter the hash only where they differ from these values, so
# entries cached before the fields existed keep their keys (and are not trained again).
_LATER_FIELDS: dict[str, Any] = {"kb_fraction": 0.35, "kb_hops": QUERY_HOPS, "task": "mix"}


def _hashed(obj: Any) -> dict[str, Any]:
    fields = dataclasses.asdict(obj)
    return {k: v for k, v in fields.items() if k not in _LATER_FIELDS or v != _LATER_FIELDS[k]}


def entry_dir(spec: ToySpec, recipe: TrainRecipe | None = None) -> Path:
    """The cache folder of one (model, recipe)."""
    return cache_root() / "toy" / entry_name(spec, recipe)


def entry_name(spec: ToySpec, recipe: TrainRecipe | None = None) -> str:
    """The folder name of one (model, recipe), in the cache and in :data:`SHIPPED`."""
    recipe = recipe or TrainRecipe.default(spec)
    return f"{spec.name.replace(':', '-')}-{recipe_key(spec, recipe)}"


def shipped_entry(spec: ToySpec, recipe: TrainRecipe | None = None) -> Path | None:
    """The entry of (``spec``, ``recipe``) shipped with the package, if there is one (its files
    not yet verified: :func:`verify_entry`)."""
    folder = SHIPPED / entry_name(spec, recipe)
    return folder if (folder / _COMPLETE).is_file() else None


def cached_log(spec: ToySpec, recipe: TrainRecipe | None = None) -> dict[str, Any] | None:
    """The training log of a verified cache entry, or ``None``."""
    folder = entry_dir(spec, recipe)
    if not folder.is_dir() or verify_entry(folder) is not None:
        return None
    return json.loads((folder / "train_log.json").read_text())


def trained_log(
    spec: ToySpec, recipe: TrainRecipe | None = None
) -> tuple[str, dict[str, Any]] | None:
    """Where the model loads from without training — ``"cached"`` or ``"shipped"`` (a verified
    entry shipped with the package) — and its training log; ``None`` if it would train."""
    log = cached_log(spec, recipe)
    if log is not None:
        return "cached", log
    shipped = shipped_entry(spec, recipe)
    if shipped is None or verify_entry(shipped) is not None:
        return None
    return "shipped", json.loads((shipped / "train_log.json").read_text())


# -- building, training, loading --------------------------------------------------------------
def build(spec: ToySpec, *, device: Any = None, dtype: Any = None) -> Any:
    """A freshly initialised toy bridge (seeded)."""
    from transformer_lens import TransformerBridge

    model = TransformerBridge.boot_native(
        spec.bridge_config(),
        tokenizer=byte_tokenizer(),
        device=device,
        dtype=dtype,
        model_name=spec.name,
    )
    return model.eval()


def load_toy(
    name: str,
    *,
    device: Any = None,
    dtype: Any = None,
    progress: bool = True,
    recipe: TrainRecipe | None = None,
) -> Any:
    """Load a trained toy model from the cache (or, for the default toy, the copy shipped with the
    package), training (and caching) it first if needed."""
    spec = parse_toy(name)
    recipe = recipe or TrainRecipe.default(spec)
    folder = entry_dir(spec, recipe)
    shipped = shipped_entry(spec, recipe)
    if folder.exists():
        model, problem = _load_entry(spec, folder)
        if model is not None:
            return place_model(model, device, dtype)
        then = "reading the shipped copy" if shipped is not None else "retraining"
        _warn(f"toy cache entry {folder} is unusable ({problem}); {then}")
        shutil.rmtree(folder, ignore_errors=True)
    if shipped is not None:  # read in place: a read-only cache is no obstacle
        model, problem = _load_entry(spec, shipped)
        if model is not None:
            return place_model(model, device, dtype)
        _warn(f"the {spec.name} shipped with lensdiv is unusable ({problem}); training it")
    check_cache(folder)
    model, _ = train_toy(spec, recipe, progress=progress)
    return place_model(model, device, dtype)


def _load_entry(spec: ToySpec, folder: Path) -> tuple[Any, str | None]:
    """The model of a cache (or shipped) entry, or ``None`` and what is wrong with the entry."""
    problem = verify_entry(folder)
    if problem is not None:
        return None, problem
    model = build(spec)
    try:
        load_weights(model, folder)
    except Exception as err:  # checksum passed but unreadable: treat as corrupt
        return None, f"weights do not load ({type(err).__name__})"
    return model, None


def shipped_match(spec: ToySpec, model: Bridge, recipe: TrainRecipe | None = None) -> bool | None:
    """Whether ``model``'s weights are bit for bit those shipped for (``spec``, ``recipe``);
    ``None`` when none is shipped (or the shipped entry is unusable)."""
    import torch

    shipped = shipped_entry(spec, recipe)
    other = None if shipped is None else _load_entry(spec, shipped)[0]
    if other is None:
        return None
    mine, theirs = model.original_model.state_dict(), other.original_model.state_dict()
    return mine.keys() == theirs.keys() and all(
        torch.equal(mine[k].detach().cpu(), theirs[k]) for k in mine
    )


def load_weights(model: Bridge, folder: Path) -> None:
    """Load an entry's weights (safetensors, or the weights.pt of entries cached before) into
    ``model``."""
    import torch

    net = model.original_model
    if (folder / WEIGHTS).is_file():
        from safetensors.torch import load_model

        load_model(net, folder / WEIGHTS)
    else:
        net.load_state_dict(
            torch.load(folder / _OLD_WEIGHTS, map_location="cpu", weights_only=True)
        )


def check_cache(folder: Path) -> None:
    """Fail before training when a toy model's cache entry ``folder`` is missing or unusable and
    cannot be written (``$LENSDIV_CACHE`` names a file, or a folder this process cannot write).

    Raises:
        ModelLoadError: Naming the cache folder and why it cannot be written.
    """
    if folder.is_dir() and verify_entry(folder) is None:
        return  # cached: reading is enough
    problem = folder_problem(folder)
    if problem is not None:
        raise ModelLoadError(
            f"cannot cache toy models in {cache_root()}: {problem}",
            hint="set LENSDIV_CACHE to a writable folder (or fix the permissions)",
        )


def _warn(message: str) -> None:
    from rich.console import Console

    # one line whatever the width: a log keeps it whole
    Console(stderr=True).print(
        f"[yellow]warning:[/yellow] {message}", highlight=False, soft_wrap=True
    )


def train_toy(
    spec: ToySpec,
    recipe: TrainRecipe | None = None,
    *,
    progress: bool = True,
    save: bool = True,
    stop_after: int | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Train one toy model; cache it (atomically) unless ``save`` is False. Returns (model, log).

    ``stop_after``: stop after that many steps of the recipe (its schedule unchanged), nothing
    evaluated or saved: the prefix whose digest a shipped entry records.
    """
    import torch

    recipe = recipe or TrainRecipe.default(spec)
    torch.manual_seed(spec.seed)
    model = build(spec)
    net = model.original_model
    net.train()
    opt = _optimizer(net, recipe)
    batches, eval_batches = _toy_batches(recipe)
    log: dict[str, Any] = {
        "model": spec.name,
        "spec": dataclasses.asdict(spec),
        "recipe": dataclasses.asdict(recipe),
        "key": recipe_key(spec, recipe),
        "n_params": sum(p.numel() for p in net.parameters()),
        "train_loss": [],
        "eval": [],
    }
    started = time.time()
    bar = _train_progress(progress, spec.name)
    with bar:
        task = bar.add_task("train", total=recipe.steps, loss=float("nan"))
        smooth = None
        for step, batch in enumerate(batches):
            if step >= min(recipe.steps, stop_after or recipe.steps):
                break
            for group in opt.param_groups:
                group["lr"] = _lr_at(recipe, step)
            loss = _lm_loss(net, batch.tokens, batch.mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            value = float(loss.detach())
            smooth = value if smooth is None else 0.95 * smooth + 0.05 * value
            log["train_loss"].append(round(value, 5))
            if (step + 1) % recipe.eval_every == 0 or step + 1 == recipe.steps:
                log["eval"].append(_eval_point(model, eval_batches, recipe, step + 1))
                net.train()
            bar.update(task, advance=1, loss=smooth)
    net.eval()
    if stop_after is not None:
        return model, log
    log["train_seconds"] = round(time.time() - started, 2)
    log["heldout_loss"] = log["eval"][-1]["loss"]
    log["multihop"] = log["eval"][-1]["multihop"]  # held-out chains
    log["multihop_seen"] = log["eval"][-1]["multihop_seen"]  # chains of the training split
    log["lens_kl"] = _lens_kl(model)
    if save:
        try:
            _save_entry(spec, recipe, model, log)
        except OSError as err:  # the trained model is still good for this run
            _warn(f"could not cache {spec.name} ({err.strerror or err}); it trains again next time")
    return model, log


def _optimizer(net: Any, recipe: TrainRecipe) -> Any:
    """AdamW over the toy's parameters, weight decay on the matrices only."""
    import torch

    decay = [p for n, p in net.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in net.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": recipe.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=recipe.lr,
        betas=(0.9, 0.98),
    )


def _lr_at(recipe: TrainRecipe, step: int) -> float:
    """The learning rate of ``step``: a linear warm-up, then a cosine down to a tenth."""
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    frac = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _toy_batches(recipe: TrainRecipe) -> tuple[Iterator[Any], list[Any]]:
    """The recipe's training batches (the mixed corpus' train split, as many as its steps
    read) and its evaluation batches (the test split's first ``eval_tokens``)."""
    tokenizer = byte_tokenizer()
    pack_spec = DataSpec(
        seq_len=recipe.seq_len,
        batch_size=recipe.batch_size,
        max_tokens=recipe.steps * recipe.batch_size * recipe.seq_len,
    )

    def mix(split: str) -> Iterator[str]:
        return mixed_documents(
            seed=recipe.data_seed,
            split=split,
            kb_fraction=recipe.kb_fraction,
            kb_hops=tuple(recipe.kb_hops),
        )

    batches = pack(mix("train"), tokenizer, pack_spec)
    eval_batches = list(
        pack(
            mix("test"),
            tokenizer,
            dataclasses.replace(pack_spec, max_tokens=recipe.eval_tokens),
        )
    )
    return batches, eval_batches


def _eval_point(
    model: Bridge, eval_batches: list[Any], recipe: TrainRecipe, step: int
) -> dict[str, Any]:
    """The evaluation after ``step`` steps: held-out loss, and multi-hop accuracy on held-out
    chains and on the training split's (the net left in eval mode)."""
    point: dict[str, Any] = {"step": step, "loss": _eval_loss(model.original_model, eval_batches)}
    # Multi-hop accuracy along training: on the training split's chains (seen) and on held-out
    # ones (whether composition is learnt).
    point["multihop"] = multihop_accuracy(model, n=recipe.hop_queries)
    point["multihop_seen"] = multihop_accuracy(model, n=recipe.hop_queries, chains="seen")
    return point


def _lm_loss(net: Any, tokens: Any, mask: Any) -> Any:
    import torch.nn.functional as F

    logits = net(tokens)
    valid = mask[:, 1:] & mask[:, :-1]
    return F.cross_entropy(logits[:, :-1][valid], tokens[:, 1:][valid])


def _eval_loss(net: Any, batches: list[Any]) -> float:
    import torch
    import torch.nn.functional as F

    net.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = net(batch.tokens)
            valid = batch.mask[:, 1:] & batch.mask[:, :-1]
            total += float(
                F.cross_entropy(logits[:, :-1][valid], batch.tokens[:, 1:][valid], reduction="sum")
            )
            count += int(valid.sum())
    return round(total / max(count, 1), 5)


def multihop_accuracy(
    model: Bridge, *, n: int = 200, seed: int = 1, chains: str = "unseen"
) -> dict[str, Any]:
    """Exact-match accuracy of held-out queries per hop count (answers are two bytes).

    Each query is asked as in the training documents: after three other facts of the knowledge
    base (never ones on the query's own chain), so the prompt is in-distribution. The 2–4-hop
    queries are held-out chains (``chains="unseen"``: compositions the model never saw) or
    chains of the training split (``"seen"``). Beside the accuracies (keys ``"1"`` … ``"4"``):
    ``chance`` (``1 / entities``) and, per hop count, the ``baseline`` of a model that knows
    only where each relation chain tends to end
    (:meth:`~lensdiv.data.corpus.KnowledgeBase.prior_accuracy`, averaged over the queries).
    """
    import torch

    kb = KnowledgeBase(seed=0)
    tokenizer = model.tokenizer
    out: dict[str, Any] = {"chance": round(1 / kb.n_entities, 4), "baseline": {}}
    net = model.original_model
    with torch.no_grad():
        for hops, queries in kb.asked_queries(n, seed=seed, chains=chains).items():
            asked = [(p, q.answer) for q, p in queries]
            baseline = sum(kb.prior_accuracy(q.relations) for q, _ in queries) / len(queries)
            out["baseline"][str(hops)] = round(baseline, 4)
            rows = [tokenizer(p + a, add_special_tokens=True)["input_ids"] for p, a in asked]
            width = max(len(r) for r in rows)
            tokens = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
            for i, r in enumerate(rows):
                tokens[i, : len(r)] = torch.tensor(r)
            logits = net(tokens)
            correct = 0
            for i, r in enumerate(rows):
                # Teacher-forced over the two answer bytes == greedy decoding of the answer.
                pred = logits[i, len(r) - 3 : len(r) - 1].argmax(-1)
                correct += bool((pred == torch.tensor(r[-2:])).all())
            out[str(hops)] = round(correct / len(rows), 4)
    return out


def _lens_kl(model: Bridge) -> list[float]:
    """Logit-lens KL to the output per residual state, on held-out text (the training log's
    quick check that later layers converge; ``lensdiv analyze --plugins lens`` is the analysis)."""
    import torch
    from transformer_lens.tools.analysis.logit_lens import logit_readout

    L = int(model.cfg.n_layers)
    names = [f"blocks.{layer}.hook_resid_pre" for layer in range(L)]
    names.append(f"blocks.{L - 1}.hook_resid_post")
    total, count = torch.zeros(L + 1, dtype=torch.float64), 0
    with torch.no_grad():
        for batch in token_batches(DataSpec(max_tokens=2048, seq_len=128), model.tokenizer):
            _, cache = model.run_with_cache(batch.tokens, names_filter=names)
            stack = torch.stack([cache[name][batch.mask] for name in names])
            logp = logit_readout(model, stack, return_type="log_probs").values.float()
            kl = torch.einsum("lrv,lrv->lr", logp.exp(), logp - logp[-1:]).clamp_min(0.0)
            total += kl.double().sum(1)
            count += stack.shape[1]
    return [round(float(v), 5) for v in total / max(count, 1)]


def _save_entry(spec: ToySpec, recipe: TrainRecipe, model: Bridge, log: dict[str, Any]) -> Path:
    """Write weights, recipe, log and loss plot as one cache entry (``entries.build_entry``)."""
    from safetensors.torch import save_model

    def fill(tmp: Path) -> list[str]:
        save_model(model.original_model, str(tmp / WEIGHTS))
        (tmp / WEIGHTS).chmod(0o644)  # as torch.save wrote it: a shared cache reads it
        (tmp / "recipe.json").write_text(
            json.dumps(
                {"spec": dataclasses.asdict(spec), "recipe": dataclasses.asdict(recipe)}, indent=1
            )
        )
        (tmp / "train_log.json").write_text(json.dumps(log, indent=1))
        _plot_log(log, tmp / "loss.png")
        return [WEIGHTS, "recipe.json", "train_log.json"]

    # training is seeded: an entry another process finished meanwhile is this one
    return build_entry(entry_dir(spec, recipe), fill)


def _plot_log(log: dict[str, Any], path: Path) -> None:

    fig, ax = agg_figure()
    ax.plot(range(1, len(log["train_loss"]) + 1), log["train_loss"], lw=0.8, label="train")
    ax.plot(
        [e["step"] for e in log["eval"]], [e["loss"] for e in log["eval"]], "o-", label="held-out"
    )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(f"{log['model']} training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def _train_progress(enabled: bool, name: str) -> Any:

    return progress_bar(
        f"[bold]training {name}[/bold]", "steps  loss {task.fields[loss]:.3f}", enabled=enabled
    )
