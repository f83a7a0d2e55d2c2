"""Built-in toy models: small TL-native bridges sharing the byte tokenizer.

Spec names: ``toy`` (the default), ``toy:d4`` (depth 4, default width), ``toy:d8-w128``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from lensdiv.errors import ModelLoadError

DEFAULT_DEPTH = 4
DEFAULT_WIDTH = 64
_SPEC = re.compile(r"^toy(?::d(?P<depth>\d+)(?:-w(?P<width>\d+))?)?$")


@dataclass(frozen=True)
class ToySpec:
    """Architecture of one toy model.

    Args:
        depth: Number of blocks.
        width: ``d_model``; heads of width 16, MLP 4×.
        n_ctx: Context length.
        seed: Initialisation seed.
    """

    depth: int = DEFAULT_DEPTH
    width: int = DEFAULT_WIDTH
    n_ctx: int = 256
    seed: int = 0

    @property
    def name(self) -> str:
        """Canonical spec string."""
        return f"toy:d{self.depth}-w{self.width}"

    def bridge_config(self) -> Any:
        """The ``TransformerBridgeConfig`` for ``boot_native``."""
        from transformer_lens.config import TransformerBridgeConfig

        from lensdiv.tokenizer import VOCAB_SIZE

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
        )


def parse_toy(spec: str) -> ToySpec:
    """Parse ``toy``, ``toy:d4`` or ``toy:d8-w128``."""
    match = _SPEC.match(spec.strip())
    if not match:
        raise ModelLoadError(
            f"bad toy model spec {spec!r}",
            hint="use 'toy', 'toy:d4' or 'toy:d8-w128' (depth d, width w, a multiple of 16)",
        )
    depth = int(match["depth"] or DEFAULT_DEPTH)
    width = int(match["width"] or DEFAULT_WIDTH)
    if not 1 <= depth <= 64 or width < 16 or width % 16 or width > 1024:
        raise ModelLoadError(
            f"toy model {spec!r} is out of range",
            hint="depth 1..64 and width a multiple of 16 in 16..1024",
        )
    return ToySpec(depth=depth, width=width)


def load_toy(spec: str, *, device: Any = None, dtype: Any = None) -> Any:
    """Build the toy bridge named by ``spec`` (random initialisation, seeded)."""
    from transformer_lens import TransformerBridge

    from lensdiv.tokenizer import byte_tokenizer

    toy = parse_toy(spec)
    model = TransformerBridge.boot_native(
        toy.bridge_config(),
        tokenizer=byte_tokenizer(),
        device=device,
        dtype=dtype,
        model_name=toy.name,
    )
    return model.eval()
