"""Tables of training runs that ship with lensdiv, read by name (``chinchilla``).

Each is a CSV under ``lensdiv/studies/scaling/data/``, package data that an installed lensdiv
has too, read with :mod:`importlib.resources`; ``data/README.md`` beside it says what each
table is, where it comes from, whom to cite and under which terms it is shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from lensdiv.core.errors import DataError


@dataclass(frozen=True)
class RunsDataset:
    """A built-in table of training runs.

    Args:
        name: The name that ``lensdiv scaling fit NAME`` and ``fit_csv(NAME)`` read it by.
        file: Its CSV, in the package's ``data`` folder.
        description: One line: what the runs are.
        citation: Whom to cite for it.
    """

    name: str
    file: str
    description: str
    citation: str

    def read_text(self) -> str:
        """The CSV's text (header first)."""
        try:
            folder = resources.files("lensdiv.studies.scaling") / "data"
            return (folder / self.file).read_text(encoding="utf-8")
        except OSError as err:  # a broken installation, not the user's input
            raise DataError(
                f"the built-in table {self.name!r} cannot be read from the lensdiv package: {err}",
                hint="reinstall lensdiv",
            ) from None


DATASETS: dict[str, RunsDataset] = {
    "chinchilla": RunsDataset(
        name="chinchilla",
        file="chinchilla_runs.csv",
        description="245 training runs of the Chinchilla study (Hoffmann et al. 2022) as "
        "reconstructed by Besiroglu et al. (2024): model_size, FLOP, loss, num_tokens, d_model, "
        "n_layers",
        citation="Hoffmann et al., Training Compute-Optimal Large Language Models, NeurIPS 2022; "
        "Besiroglu, Erdil, Barnett, You, Chinchilla Scaling: A replication attempt, 2024 "
        "(github.com/epoch-research/analyzing-chinchilla)",
    ),
}
"""Every built-in table of runs, by name."""


def builtin_dataset(source: str | Path) -> RunsDataset | None:
    """The built-in table that ``source`` names, or ``None`` (a file path: only a ``str`` can be
    a name, and a name wins over a file of that name)."""
    return DATASETS.get(source) if isinstance(source, str) else None
