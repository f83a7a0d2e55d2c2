"""Checks that teach: a student's function against lensdiv's own, with a diagnosis when it differs.

An :class:`Exercise` holds a reference implementation (lensdiv's own operations), a few known
:class:`Mistake` s (each a function computing what a student who made that mistake would get)
and the inputs to compare on (random tensors, real toy states, edge cases: a one-token row,
padding, BOS). :meth:`Exercise.verdict` runs the student's function on every input and returns a
:class:`Verdict`:

- ``passed``: every output matches the reference; one line and a value from a real input;
- ``not done``: the function is still the blank (raises ``NotImplementedError`` or returns
  ``None``);
- ``error``: the student's code raised; the traceback is cut to the student's own frames;
- ``wrong``: a diagnosis — the known mistake whose outputs the student's outputs equal on every
  input where they differ from the reference — then what was expected against what was got on the
  smallest failing input.

The checker itself never raises into the notebook: :meth:`Exercise.check` prints the verdict
and returns the student's function once it passes, lensdiv's reference until then, so the cells
after an exercise run either way.
"""

from __future__ import annotations

import linecache
import os
import re
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

Output = Any

# Frames from these folders are lensdiv's, Python's or a library's: not the student's code.
_LENSDIV = str(Path(__file__).resolve().parents[1])
_HIDDEN = (_LENSDIV, os.path.dirname(os.__file__))
_LIBRARIES = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")

PASSED, NOT_DONE, WRONG, ERROR = "passed", "not done", "wrong", "error"


@dataclass(frozen=True)
class Case:
    """One input of a check.

    Args:
        label: What it is, as shown on failure ("2 rows, the second padded").
        args: Positional arguments of the exercise's function.
        size: Orders the inputs: the smallest failing one is shown.
        headline: The input whose output the success line shows.
        context: What :attr:`Exercise.measure` needs beyond the output (the tokens to run on).
    """

    label: str
    args: tuple[Any, ...]
    size: int = 0
    headline: bool = False
    context: Any = None


@dataclass(frozen=True)
class Mistake:
    """A common mistake: what it computes, and the sentence that names it.

    Args:
        key: A short name (the tests' mutants are keyed by it).
        diagnosis: What the student most likely did, and the fix.
        compute: Same signature as the reference; returns what the mistake gives.
    """

    key: str
    diagnosis: str
    compute: Callable[..., Output]


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check.

    Args:
        exercise: The exercise's name.
        status: ``passed``, ``not done``, ``wrong`` or ``error``.
        text: What is printed (one line on success).
        mistake: The key of the diagnosed mistake, when one explains the outputs.
    """

    exercise: str
    status: str
    text: str
    mistake: str | None = None

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    def __str__(self) -> str:
        return self.text


class _StudentError(Exception):
    """The student's code raised; carries the exception."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


@dataclass
class Exercise:
    """One checked function of the course.

    Args:
        name: The function's name in the notebook.
        reference: lensdiv's own computation (same signature).
        cases: Builds the inputs (called once, on first check: it may load the toy model).
        mistakes: Known mistakes, most specific first.
        describe: The success line's value, from the headline input's output.
        rtol, atol: How close an output must be (``torch.allclose``).
        grad: Run with autograd on (a loss to train).
        shape_hint: What the output's shape means, for a shape mismatch.
        measure: Turns what the function returns into numbers, given the input (hooks into the
            states of a run with them); applied to the reference and the mistakes alike.
    """

    name: str
    reference: Callable[..., Output]
    cases: Callable[[], Sequence[Case]]
    mistakes: Sequence[Mistake] = ()
    describe: Callable[[Output], str] = lambda out: ""
    rtol: float = 1e-4
    atol: float = 1e-5
    grad: bool = False
    shape_hint: str = ""
    measure: Callable[[Output, Case], Output] | None = None
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    # -- inputs and the known outputs, computed once ------------------------------------------
    def _inputs(self) -> list[Case]:
        if "cases" not in self._cache:
            self._cache["cases"] = sorted(self.cases(), key=lambda c: c.size)
        return self._cache["cases"]

    def _expected(self) -> list[Output]:
        if "expected" not in self._cache:
            with torch.set_grad_enabled(self.grad):
                self._cache["expected"] = [self._run(self.reference, c) for c in self._inputs()]
        return self._cache["expected"]

    def _mistaken(self, mistake: Mistake) -> list[Output]:
        key = "mistake:" + mistake.key
        if key not in self._cache:
            with torch.set_grad_enabled(self.grad):
                self._cache[key] = [self._run(mistake.compute, c) for c in self._inputs()]
        return self._cache[key]

    # -- the verdict ------------------------------------------------------------------------
    def verdict(self, student: Callable[..., Output]) -> Verdict:
        """Run ``student`` on every input and say what it got right or wrong."""
        cases = self._inputs()
        try:
            got = [self._call(student, case) for case in cases]
        except NotImplementedError:
            return self._blank()
        except _StudentError as err:
            missing = abstract_methods(err.error)
            if missing:  # a class with a method still to write
                return self._blank(f"{missing} still to write")
            return Verdict(self.name, ERROR, _student_traceback(self.name, err.error))
        expected = self._expected()
        if any(g is None for g in got):
            return self._blank("it returns None")
        failing = [
            i for i, (g, e) in enumerate(zip(got, expected, strict=True)) if not self._close(g, e)
        ]
        if not failing:
            headline = next((i for i, c in enumerate(cases) if c.headline), len(cases) - 1)
            value = self.describe(got[headline])
            line = f"✔ {self.name}: matches lensdiv's own on {len(cases)} inputs"
            return Verdict(self.name, PASSED, line + (f"; {value}" if value else "") + ".")
        first = failing[0]
        mistake = self._diagnose(got, failing)
        if mistake is not None:
            head = f"✘ {self.name}: {mistake.diagnosis}"
        else:
            head = f"✘ {self.name}: not what lensdiv computes, and no common mistake I know of gives your numbers."
        detail = self._difference(cases[first], expected[first], got[first])
        return Verdict(self.name, WRONG, f"{head}\n{detail}", mistake.key if mistake else None)

    def check(self, student: Callable[..., Output]) -> Callable[..., Output]:
        """Print the verdict; return ``student`` once it passes, lensdiv's reference until then."""
        try:
            verdict = self.verdict(student)
        except Exception as err:  # the checker's own failure: one line, never a traceback
            print(f"? {self.name}: the check itself failed ({type(err).__name__}: {err})")
            return self.reference
        print(verdict.text)
        if verdict.passed:
            return student
        print(f"  (the cells below use lensdiv's own {self.name} until yours passes)")
        return self.reference

    def _blank(self, why: str = "") -> Verdict:
        more = f" ({why})" if why else ""
        return Verdict(self.name, NOT_DONE, f"… {self.name}: not done yet{more}.")

    def _run(self, fn: Callable[..., Output], case: Case) -> Output:
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in case.args)
        out = fn(*args)
        if self.measure is not None and out is not None:
            out = self.measure(out, case)
        return out

    def _call(self, student: Callable[..., Output], case: Case) -> Output:
        try:
            with torch.set_grad_enabled(self.grad):
                return self._run(student, case)
        except NotImplementedError:
            raise
        except Exception as err:
            raise _StudentError(err) from None

    def _close(self, got: Output, want: Output) -> bool:
        return _close(got, want, self.rtol, self.atol)

    def _diagnose(self, got: list[Output], failing: list[int]) -> Mistake | None:
        for mistake in self.mistakes:
            wrong = self._mistaken(mistake)
            if all(self._close(got[i], wrong[i]) for i in failing):
                return mistake
        return None

    def _difference(self, case: Case, want: Output, got: Output) -> str:
        lines = [f"  smallest failing input: {case.label}"]
        shapes = _shapes(want), _shapes(got)
        if shapes[0] != shapes[1]:
            hint = f" ({self.shape_hint})" if self.shape_hint else ""
            lines.append(f"  expected shape {shapes[0]}{hint}, got {shapes[1]}")
        lines.append(f"  expected {_show(want)}")
        lines.append(f"  got      {_show(got)}")
        return "\n".join(lines)


# -- comparing and showing outputs ----------------------------------------------------------------
def _parts(value: Output) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [p for v in value for p in _parts(v)]
    if isinstance(value, dict):
        return [p for k in sorted(value) for p in _parts(value[k])]
    return [value]


def _tensor(value: Any) -> torch.Tensor | None:
    try:
        return torch.as_tensor(value).detach().to("cpu", torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return None


def _close(got: Output, want: Output, rtol: float, atol: float) -> bool:
    a, b = _parts(got), _parts(want)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        tx, ty = _tensor(x), _tensor(y)
        if tx is None or ty is None or tx.shape != ty.shape:
            return False
        if not torch.allclose(tx, ty, rtol=rtol, atol=atol, equal_nan=True):
            return False
    return True


def _shapes(value: Output) -> str:
    out = []
    for part in _parts(value):
        t = _tensor(part)
        out.append("not a number" if t is None else str(list(t.shape)))
    return out[0] if len(out) == 1 else "(" + ", ".join(out) + ")"


def _show(value: Output) -> str:
    parts = _parts(value)
    shown = []
    for part in parts:
        t = _tensor(part)
        if t is None:
            shown.append(repr(part)[:80])
            continue
        flat = t.flatten()
        body = ", ".join(f"{float(v):.4g}" for v in flat[:8]) + (", …" if flat.numel() > 8 else "")
        shown.append(body if t.dim() == 0 else f"[{body}]")
    return shown[0] if len(shown) == 1 else "(" + "; ".join(shown) + ")"


def abstract_methods(error: BaseException) -> str:
    """The methods a class still lacks, when ``error`` says it cannot be instantiated for that."""
    found = (
        re.search(r"abstract methods? (.+)$", str(error)) if isinstance(error, TypeError) else None
    )
    return found.group(1).strip("'\"") if found else ""


def _student_traceback(name: str, error: BaseException) -> str:
    """The traceback cut to the student's frames, ending with the error's own line."""
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not f.filename.startswith(_HIDDEN) and not any(lib in f.filename for lib in _LIBRARIES)
    ]
    lines = [f"✘ {name} raised an error in your code:"]
    for frame in frames:
        where = _where(frame.filename)
        lines.append(f"  {where}, line {frame.lineno}, in {frame.name}")
        text = frame.line or linecache.getline(frame.filename, frame.lineno or 0).strip()
        if text:
            lines.append(f"    {text}")
    lines.append(f"{type(error).__name__}: {error}")
    return "\n".join(lines)


def _where(filename: str) -> str:
    # IPython names a cell's code after a temporary file; "your cell" reads better.
    if "ipykernel" in filename or filename.startswith("<"):
        return "your cell"
    return f'File "{filename}"'


def randn(*shape: int, seed: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """Fixed random float32 numbers: the same on every call with this seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * scale + shift
