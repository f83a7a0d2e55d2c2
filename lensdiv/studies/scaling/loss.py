"""The loss of a model family's members: a study of this one analyzer is what
``lensdiv scaling family`` evaluates before it fits the law."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F

from lensdiv.core.analyzer import Analyzer, ModelInfo, Step
from lensdiv.core.results import Result, Table
from lensdiv.core.stats import Stats


@dataclass(frozen=True)
class FamilyLoss(Analyzer):
    """The model's mean next-token cross-entropy on the corpus (nats), and a fingerprint of the
    tokens it read, so a family's losses are known to come from the same tokens."""

    name = "loss"
    description = "Mean next-token cross-entropy on the corpus, with the tokens' fingerprint"
    needs_logits = True
    depth_profiles = ()

    def hooks(self, info: ModelInfo) -> list[str]:
        return []

    def update(self, state: Stats, step: Step) -> None:
        logits = step.logits
        assert logits is not None  # needs_logits
        targets, valid = step.batch.next_tokens()
        targets, valid = targets.to(logits.device), valid.to(logits.device)
        loss = F.cross_entropy(logits[valid].float(), targets[valid], reduction="sum")
        state.add("loss", float(loss))
        state.add("count", int(valid.sum()))
        state.include("batches", f"{step.batch.index}:{fingerprint([step.batch])}")

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        count = int(state["count"])
        loss = float(state["loss"]) / count if count else math.nan
        tokens = hashlib.sha256("\n".join(sorted(state["batches"])).encode()).hexdigest()
        return Result(
            self.name,
            f"Mean next-token cross-entropy {loss:.4g} nats over {count} positions.",
            tables={
                "loss": Table("loss", {"loss": [loss], "count": [count]}, "Mean next-token CE")
            },
            meta={"tokens_sha256": tokens},
        )


def fingerprint(batches: Sequence[Any]) -> str:
    """sha256 of the token ids and masks of ``batches``."""
    digest = hashlib.sha256()
    for batch in batches:
        digest.update(batch.tokens.cpu().numpy().astype("int64").tobytes())
        digest.update(batch.mask.cpu().numpy().tobytes())
    return digest.hexdigest()
