"""GGUF files: read through transformers' GGUF reader, dequantized once, cached as safetensors.

``lensdiv analyze model.gguf`` (or a folder holding one ``.gguf`` file) reads the file's header
with the ``gguf`` package (the architecture, the quantization of each tensor; a file that is not
GGUF, is truncated or holds an architecture transformers cannot read is refused in one line),
then has transformers dequantize it (``from_pretrained(folder, gguf_file=...)``) to float32 and
saves the model, its config and tokenizer as an ordinary Hugging Face folder, a cache entry
under ``$LENSDIV_MODEL_CACHE/gguf`` (else ``$LENSDIV_CACHE/gguf``) keyed by the file's sha256 (``entries``: written whole, verified
by checksum before it is read, rebuilt when partial or corrupt). Later loads read that folder,
in seconds. What lensdiv measures is the dequantized model: the manifest and the reports say
so (:func:`describe`).
"""

from __future__ import annotations

import collections
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lensdiv.core.errors import ModelLoadError
from lensdiv.core.files import folder_problem, model_cache_root
from lensdiv.models.entries import build_entry, sha256_file, verify_entry

GGUF_MAGIC = b"GGUF"
#: The entry's record of the file it came from.
_FACTS = "gguf.json"
#: The names GGUF files give the architectures transformers reads but whose model type differs.
_HF_TYPES = {"gemma3": "gemma3_text"}
#: The message when the ``gguf`` package is missing.
_EXTRA = "pip install 'lensdiv[gguf]' (the gguf package reads GGUF files)"


@dataclass(frozen=True)
class GGUFFacts:
    """What a GGUF file's header says, and the file's identity.

    Args:
        path: The file.
        sha256: Its digest (the cache key).
        size: Its size in bytes.
        architecture: ``general.architecture`` (``llama``, ``gemma3``, ...).
        name: ``general.name``, if the file has one.
        quantization: Tensor count by quantization type (``{"Q4_1": 210, "F32": 61}``).
    """

    path: str
    sha256: str
    size: int
    architecture: str
    name: str | None
    quantization: dict[str, int] = field(default_factory=dict)

    @property
    def quant_label(self) -> str:
        """The quantization types of the weight matrices, most used first (``Q4_1``,
        ``Q4_K/Q6_K``); float tensors (norms, biases) named only when nothing else is there."""
        ranked = sorted(self.quantization.items(), key=lambda kv: -kv[1])
        quantized = [k for k, _ in ranked if k not in ("F32", "F16", "BF16")]
        return "/".join(quantized or [k for k, _ in ranked])

    def describe(self) -> dict[str, Any]:
        """The manifest's record of where the weights came from."""
        return {
            "format": "gguf",
            "file": Path(self.path).name,
            "sha256": self.sha256,
            "bytes": self.size,
            "architecture": self.architecture,
            "name": self.name,
            "quantization": dict(self.quantization),
            "quant_label": self.quant_label,
            "dequantized": f"dequantized from {self.quant_label} to float32 by transformers",
        }


def gguf_file(path: Path) -> Path:
    """The GGUF file ``path`` names: the file itself, or the one ``.gguf`` file of a folder.

    Raises:
        ModelLoadError: A folder with none or several.
    """
    if path.is_file():
        return path
    found = sorted(path.glob("*.gguf"))
    if len(found) != 1:
        what = "no .gguf file" if not found else f"{len(found)} .gguf files"
        raise ModelLoadError(
            f"{path} holds {what}",
            hint="pass the .gguf file itself, or a folder with exactly one",
        )
    return found[0]


def is_gguf_path(path: Path) -> bool:
    """Whether a spec path names a GGUF file (by its name or its magic bytes) or a folder of one
    (a folder with a ``config.json`` is a Hugging Face folder instead)."""
    if path.is_dir():
        return not (path / "config.json").exists() and any(path.glob("*.gguf"))
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError:
        return False


def supported_architectures() -> tuple[str, ...]:
    """The GGUF architectures the installed transformers can read."""
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:  # an older or newer transformers: let the load itself decide
        return ()
    return tuple(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))


def read_facts(path: Path, *, sha256: str | None = None) -> GGUFFacts:
    """Read a GGUF file's header and check it can be loaded, before anything is dequantized.

    Args:
        path: The ``.gguf`` file.
        sha256: Its digest when already known (a fetched file, verified on arrival).

    Raises:
        ModelLoadError: The ``gguf`` package is missing; the file is not GGUF, is truncated, or
            holds an architecture transformers cannot read (the message names those it can).
    """
    with path.open("rb") as fh:
        if fh.read(4) != GGUF_MAGIC:
            raise ModelLoadError(
                f"{path.name} is not a GGUF file (it does not start with the GGUF magic bytes)",
                hint="pass a .gguf model file, a Hugging Face folder, a hub name or 'toy'",
            )
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModelLoadError(
            f"cannot read {path.name}: the gguf package is missing", hint=_EXTRA
        ) from None
    size = path.stat().st_size
    try:
        reader = GGUFReader(str(path))
    except Exception as err:  # the reader fails on a short file with numpy's errors
        raise ModelLoadError(
            f"{path.name} is truncated or damaged ({size} bytes; the reader says: "
            f"{' '.join(str(err).split())[:120]})",
            hint="download the file again (its sha256 should match the publisher's)",
        ) from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ModelLoadError(
            f"{path.name} is truncated: its tensors need {end} bytes, the file has {size}",
            hint="download the file again (its sha256 should match the publisher's)",
        )
    architecture = _field(reader, "general.architecture") or "unknown"
    known = supported_architectures()
    if known and architecture not in known:
        raise ModelLoadError(
            f"{path.name} holds a {architecture!r} model, which transformers cannot read from "
            f"GGUF (it reads {', '.join(known)})",
            hint="convert the original weights with save_pretrained and pass that folder",
        )
    counts = collections.Counter(t.tensor_type.name for t in reader.tensors)
    return GGUFFacts(
        path=str(path.resolve()),
        sha256=sha256 or sha256_file(path),
        size=size,
        architecture=architecture,
        name=_field(reader, "general.name"),
        quantization=dict(counts.most_common()),
    )


def _field(reader: Any, key: str) -> str | None:
    found = reader.fields.get(key)
    if found is None:
        return None
    value = found.contents()
    return str(value) if value is not None else None


def entry_dir(sha256: str) -> Path:
    """The cache folder of the model dequantized from the GGUF file of this digest."""
    return model_cache_root() / "gguf" / sha256[:32]


def cached_facts(sha256: str) -> GGUFFacts | None:
    """The facts of a verified cache entry, or ``None`` when it is missing, partial or corrupt."""
    folder = entry_dir(sha256)
    if not folder.is_dir() or verify_entry(folder) is not None:
        return None
    return GGUFFacts(**json.loads((folder / _FACTS).read_text()))


def dequantized(facts: GGUFFacts, *, progress: bool = True) -> Path:
    """The Hugging Face folder of the model in ``facts``' file: the verified cache entry, else
    dequantized now (transformers' GGUF reader, float32) and cached.

    Raises:
        ModelLoadError: The cache cannot be written, or transformers cannot load the file.
    """
    folder = entry_dir(facts.sha256)
    problem = verify_entry(folder) if folder.is_dir() else "not cached"
    if problem is None:
        return folder
    if folder.is_dir():
        _warn(f"the cached model of {Path(facts.path).name} is unusable ({problem}); rebuilding it")
    where = folder_problem(folder.parent)
    if where is not None:
        raise ModelLoadError(
            f"cannot cache the dequantized model in {folder.parent}: {where}",
            hint="set LENSDIV_MODEL_CACHE (or LENSDIV_CACHE) to a writable folder",
        )
    if progress:
        _note(
            f"dequantizing {Path(facts.path).name} ({facts.quant_label}, {facts.size / 2**20:.0f} "
            "MiB) to float32 once; later loads read the cache"
        )

    def fill(tmp: Path) -> list[str]:
        _dequantize_into(Path(facts.path), tmp, progress)
        (tmp / _FACTS).write_text(json.dumps(asdict(facts), indent=1))
        return sorted(p.name for p in tmp.iterdir() if p.is_file())  # weights, config, tokenizer

    return build_entry(folder, fill)


def _dequantize_into(path: Path, out: Path, progress: bool) -> None:
    """Dequantize ``path`` with transformers and save model, config and tokenizer in ``out``.

    A model loaded from GGUF is marked quantized and ``save_pretrained`` refuses it: it is
    rebuilt from its config (without the quantization entry) and its state dict.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except KeyboardInterrupt:
        raise
    except Exception as err:
        raise ModelLoadError(
            f"transformers cannot load {path.name}: {type(err).__name__}: "
            f"{' '.join(str(err).split())[:200]}",
            hint="update transformers and gguf, or pass a save_pretrained folder",
        ) from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    model_type = str(config.get("model_type"))
    config["model_type"] = _HF_TYPES.get(model_type, model_type)
    config["dtype"] = "float32"
    rebuilt_config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(rebuilt_config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    model.tie_weights()
    del loaded
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    for written in out.iterdir():
        written.chmod(0o644)  # safetensors writes 0600: a shared cache is read by others


def _note(message: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(message, highlight=False, soft_wrap=True)


def _warn(message: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(
        f"[yellow]warning:[/yellow] {message}", highlight=False, soft_wrap=True
    )
