"""Checks that teach: a student's function against lensdiv's own, with a diagnosis when it differs.

An :class:`Exercise` holds a reference implementation (lensdiv's own operations), a few known
:class:`Mistake` s (each a function computing what a student who made that mistake would get),
:class:`Requirement` s on what the function returns beyond its numbers (a loss to call
``.backward()`` on), and the inputs to compare on (random tensors, real toy states, edge cases: a
one-token row, padding, BOS). :meth:`Exercise.verdict` runs the student's function on every input
(under a time limit, on copies of the inputs it checks for changes) and returns a :class:`Verdict`:

- ``passed``: every output matches the reference; one line and a value from a real input;
- ``not done``: the function is still the blank (raises ``NotImplementedError`` or returns
  ``None``);
- ``error``: the student's code raised; the traceback is cut to the student's own frames;
- ``wrong``: a diagnosis — the known mistake whose outputs the student's outputs equal on every
  input where they differ from the reference; or what about the returned value is wrong (its
  type or structure, a requirement it misses, a value lensdiv's code cannot use); or an input
  changed in place; or the time limit — then what was expected against what was got on the
  smallest failing input, with the first entries that differ.

The checker itself never raises into the notebook: :meth:`Exercise.check` prints the verdict
and returns the student's function once it passes, lensdiv's reference until then, so the cells
after an exercise run either way.
"""

from __future__ import annotations

import inspect
import linecache
import os
import re
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lensdiv.course.timelimit import TimeLimit, limited

Output = Any

# Frames from these folders are lensdiv's, Python's or a library's: not the student's code.
_LENSDIV = str(Path(__file__).resolve().parents[1])
_HIDDEN = (_LENSDIV, os.path.dirname(os.__file__))
_LIBRARIES = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")

PASSED, NOT_DONE, WRONG, ERROR = "passed", "not done", "wrong", "error"

# A slow reference (a sweep of runs) gives its student SLOW_FACTOR times its time past a minute.
SLOW_LIMIT_S, SLOW_FACTOR = 60.0, 10.0

# The diagnoses every exercise can give (keys of :attr:`Verdict.mistake`), beside its own mistakes.
IN_PLACE, TIMEOUT, STRUCTURE, UNUSABLE = "in_place", "timeout", "structure", "unusable"
GENERIC = {
    IN_PLACE: "your function changes its input {what} in place: the notebook's next cells "
    "read that tensor again. Work on a copy (x = h - ..., not h -= ...; or .clone() first).",
    TIMEOUT: "stopped after {limit:.0f} s (lensdiv's own takes {ref:.2g} s on these inputs): "
    "something in it grows much faster than the inputs (a Python loop over every entry, a loop "
    "inside a loop, or one that never ends). Use whole-tensor operations.",
    STRUCTURE: "your function returns {got}, not {want}.",
    UNUSABLE: "lensdiv could not use what your function returns, {got}",
}


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
class Requirement:
    """What the returned value must be beyond its numbers (a loss with a gradient).

    Args:
        key: A short name (the tests' mutants are keyed by it).
        diagnosis: What is wrong when it does not hold, and the fix.
        expected: What it must be, as shown after "expected".
        missing: Given what the student's function returned and the arguments it got, what
            falls short (shown after "got"), or ``None`` when the requirement holds.
    """

    key: str
    diagnosis: str
    expected: str
    missing: Callable[[Output, tuple[Any, ...]], str | None]


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check.

    Args:
        exercise: The exercise's name.
        status: ``passed``, ``not done``, ``wrong`` or ``error``.
        text: What is printed (one line on success).
        mistake: The key of the diagnosis, when one explains the outputs.
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


class _Changed(Exception):
    """The student's function changed an input in place."""

    def __init__(self, what: str, case: Case):
        super().__init__(what)
        self.what, self.case = what, case


class _Unusable(Exception):
    """lensdiv's code could not use what the student's function returned."""

    def __init__(self, error: BaseException, out: Output, case: Case):
        super().__init__(str(error))
        self.error, self.out, self.case = error, out, case


class Unusable(Exception):
    """Raised by an :attr:`Exercise.measure` that cannot turn the returned value into numbers:
    its message says why (no traceback is shown)."""


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
        requirements: What the returned value must be beyond its numbers, checked once the
            numbers match.
        time_limit: ``(at least, times the reference)``: the student's function gets the larger
            of the two, in seconds, for all the inputs together (see :meth:`limit`).
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
    requirements: Sequence[Requirement] = ()
    time_limit: tuple[float, float] = (2.0, 50.0)
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    # -- inputs and the known outputs, computed once ------------------------------------------
    def _inputs(self) -> list[Case]:
        if "cases" not in self._cache:
            self._cache["cases"] = sorted(self.cases(), key=lambda c: c.size)
        return self._cache["cases"]

    def _expected(self) -> list[Output]:
        if "expected" not in self._cache:
            cases = self._inputs()
            started = time.perf_counter()
            with torch.set_grad_enabled(self.grad):
                expected = [self._run(self.reference, c) for c in cases]
            self._cache["reference_s"] = time.perf_counter() - started
            self._cache["expected"] = expected
        return self._cache["expected"]

    def _mistaken(self, mistake: Mistake) -> list[Output]:
        key = "mistake:" + mistake.key
        if key not in self._cache:
            with torch.set_grad_enabled(self.grad):
                self._cache[key] = [self._run(mistake.compute, c) for c in self._inputs()]
        return self._cache[key]

    def limit(self) -> float:
        """Seconds the student's function gets for all the inputs (once the reference ran):
        ``time_limit``'s floor or factor times the reference, whichever is longer — but past a
        minute only :data:`SLOW_FACTOR` times a slow reference (a hung cell waits no longer)."""
        floor, factor = self.time_limit
        ref = self._cache.get("reference_s", 0.0)
        return max(floor, min(factor * ref, max(SLOW_LIMIT_S, SLOW_FACTOR * ref)))

    # -- the verdict ------------------------------------------------------------------------
    def verdict(self, student: Callable[..., Output]) -> Verdict:
        """Run ``student`` on every input and say what it got right or wrong."""
        cases = self._inputs()
        expected = self._expected()
        limit = self.limit()
        try:
            runs = limited(lambda: [self._call(student, case) for case in cases], limit)
        except NotImplementedError:
            return self._blank()
        except TimeLimit:
            text = GENERIC[TIMEOUT].format(limit=limit, ref=self._cache.get("reference_s", 0.0))
            detail = f"  expected an answer within {limit:.0f} s\n  got      none yet"
            return Verdict(self.name, WRONG, f"✘ {self.name}: {text}\n{detail}", TIMEOUT)
        except _StudentError as err:
            missing = abstract_methods(err.error)
            if missing:  # a class with a method still to write
                return self._blank(f"{missing} still to write")
            return Verdict(self.name, ERROR, _student_traceback(self.name, err.error))
        except _Changed as err:
            text = GENERIC[IN_PLACE].format(what=err.what)
            detail = (
                f"  on the input: {err.case.label}\n  expected {err.what} as it was given\n"
                "  got      it changed after your function ran"
            )
            return Verdict(self.name, WRONG, f"✘ {self.name}: {text}\n{detail}", IN_PLACE)
        except _Unusable as err:
            return self._unusable(err)
        got = [measured for measured, _, _ in runs]
        if any(g is None for g in got):
            return self._blank("it returns None")
        failing = [
            i for i, (g, e) in enumerate(zip(got, expected, strict=True)) if not self._close(g, e)
        ]
        if not failing:
            return self._requirements(cases, runs) or self._passed(cases, got)
        first = failing[0]
        mistake = self._diagnose(got, failing)
        key = mistake.key if mistake else None
        structure = _structure(expected[first], got[first])
        if mistake is not None:
            head = f"✘ {self.name}: {mistake.diagnosis}"
        elif structure:
            want, have = structure
            head = f"✘ {self.name}: " + GENERIC[STRUCTURE].format(got=have, want=want)
            if _numbers_close(got[first], expected[first], self.rtol, self.atol):
                head += f" The numbers are right: return {want}."
            key = STRUCTURE
        else:
            head = f"✘ {self.name}: not what lensdiv computes, and no common mistake I know of gives your numbers."
        detail = self._difference(cases[first], expected[first], got[first])
        return Verdict(self.name, WRONG, f"{head}\n{detail}", key)

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

    def _passed(self, cases: list[Case], got: list[Output]) -> Verdict:
        headline = next((i for i, c in enumerate(cases) if c.headline), len(cases) - 1)
        try:
            value = self.describe(got[headline])
        except Exception:  # a value of another kind that compares alike (a number, an array)
            value = ""
        line = f"✔ {self.name}: matches lensdiv's own on {len(cases)} inputs"
        return Verdict(self.name, PASSED, line + (f"; {value}" if value else "") + ".")

    def _requirements(
        self, cases: list[Case], runs: list[tuple[Output, Output, tuple[Any, ...]]]
    ) -> Verdict | None:
        for requirement in self.requirements:
            for case, (_, out, args) in zip(cases, runs, strict=True):
                missing = requirement.missing(out, args)
                if missing is not None:
                    text = (
                        f"✘ {self.name}: {requirement.diagnosis}\n  on the input: {case.label}\n"
                        f"  expected {requirement.expected}\n  got      {missing}"
                    )
                    return Verdict(self.name, WRONG, text, requirement.key)
        return None

    def _unusable(self, err: _Unusable) -> Verdict:
        what = describe_value(err.out)
        why = str(err.error) if isinstance(err.error, Unusable) else _one_line(err.error)
        text = GENERIC[UNUSABLE].format(got=what) + f": {why}"
        detail = f"  on the input: {err.case.label}\n  expected {self.shape_hint or 'what lensdiv returns'}\n  got      {what}"
        return Verdict(self.name, WRONG, f"✘ {self.name}: {text}\n{detail}", UNUSABLE)

    def _blank(self, why: str = "") -> Verdict:
        more = f" ({why})" if why else ""
        return Verdict(self.name, NOT_DONE, f"… {self.name}: not done yet{more}.")

    def _run(self, fn: Callable[..., Output], case: Case) -> Output:
        out = fn(*_copy(case.args))
        if self.measure is not None and out is not None:
            out = self.measure(out, case)
        return out

    def _call(
        self, student: Callable[..., Output], case: Case
    ) -> tuple[Output, Output, tuple[Any, ...]]:
        """``(measured output, returned value, the arguments it got)`` of the student's function,
        checking that it left its arguments as they were."""
        args = _copy(case.args)
        before = _copy(args)
        try:
            with torch.set_grad_enabled(self.grad):
                out = student(*args)
        except NotImplementedError:
            raise
        except Exception as err:
            raise _StudentError(err) from None
        changed = _changed_args(student, before, args)
        if changed:
            raise _Changed(changed, case)
        if self.measure is None or out is None:
            return out, out, args
        try:
            with torch.set_grad_enabled(self.grad):
                return self.measure(out, case), out, args
        except NotImplementedError:
            raise
        except Exception as err:
            if isinstance(err, Unusable) or not _student_frames(err):
                raise _Unusable(err, out, case) from None
            raise _StudentError(err) from None  # raised in the student's own code (a hook)

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
        kinds = _dtype_note(want, got)
        if kinds:
            lines.append(f"  {kinds}")
        lines.append(f"  expected {_show(want)}")
        lines.append(f"  got      {_show(got)}")
        lines += [f"  {line}" for line in _first_differences(want, got, self.rtol, self.atol)]
        return "\n".join(lines)


# -- copies of the inputs, and what the student changed --------------------------------------------
def _copy(value: Any) -> Any:
    """A copy of every tensor in ``value`` (leaves that keep ``requires_grad``), containers
    rebuilt; anything else (a model, a number) as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, tuple):
        return tuple(_copy(v) for v in value)
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


def _changed(before: Any, after: Any, name: str) -> str:
    """The name of the first tensor in ``after`` that differs from its copy ``before`` ("" when
    none did): ``h``, ``params['ln_w']``."""
    if isinstance(before, torch.Tensor):
        same = isinstance(after, torch.Tensor) and _same(before, after.detach())
        return "" if same else name
    if isinstance(before, (tuple, list)) and isinstance(after, (tuple, list)):
        if len(before) != len(after):
            return name
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            found = _changed(b, a, f"{name}[{i}]")
            if found:
                return found
    if isinstance(before, dict) and isinstance(after, dict):
        for key in before:
            found = _changed(before[key], after.get(key), f"{name}[{key!r}]")
            if found:
                return found
    return ""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return bool((a == b).all())


def _names(fn: Callable[..., Any], n: int) -> list[str]:
    """The names of ``fn``'s first ``n`` positional arguments."""
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"argument {i + 1}" for i in range(n)]


def _changed_args(
    student: Callable[..., Any], before: tuple[Any, ...], after: tuple[Any, ...]
) -> str:
    if inspect.isclass(student):  # an analyzer's options: nothing to change
        return ""
    for b, a, name in zip(before, after, _names(student, len(after)), strict=True):
        found = _changed(b, a, f"`{name}`")
        if found:
            return found
    return ""


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


def _flat(value: Output) -> torch.Tensor | None:
    """Every number of ``value`` in one float64 vector (``None`` when one is not a number)."""
    parts = [_tensor(p) for p in _parts(value)]
    if any(p is None for p in parts):
        return None
    return torch.cat([p.flatten() for p in parts if p is not None]) if parts else None


def _numbers_close(got: Output, want: Output, rtol: float, atol: float) -> bool:
    a, b = _flat(got), _flat(want)
    return (
        a is not None
        and b is not None
        and a.shape == b.shape
        and bool(torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True))
    )


def describe_value(value: Output) -> str:
    """What a value is, in words: "a tensor of shape [3, 4]", "a list of 3 floats"."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}" if value.dim() else "a 0-dim tensor"
    if isinstance(value, (tuple, list)):
        kind = type(value).__name__
        inner = {_kind(v) for v in value}
        of = f" {inner.pop()}s" if len(inner) == 1 else " items"
        return f"a {kind} of {len(value)}{of if value else ''}"
    if isinstance(value, bool):
        return "a bool"
    if isinstance(value, (int, float)):
        return f"a Python {type(value).__name__} (a plain number)"
    if type(value).__module__.startswith("numpy"):
        return f"a NumPy {type(value).__name__}"
    return f"a {type(value).__name__}"


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor" if value.dim() else "0-dim tensor"
    return type(value).__name__


def _structure(want: Output, got: Output) -> tuple[str, str] | None:
    """``(what lensdiv returns, what the student returns)`` when their kinds differ: a list for
    a tensor, a tensor for a tuple, a tuple of 2 for one of 3."""

    def shape(value: Output) -> Any:
        if isinstance(value, (tuple, list)):
            return ("seq", len(value), tuple(shape(v) for v in value))
        if isinstance(value, torch.Tensor):
            return ("tensor",)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return ("tensor",)  # a number where a 0-dim tensor is expected compares alike
        return (type(value).__name__,)

    if shape(want) == shape(got):
        return None
    return describe_value(want), describe_value(got)


def _shapes(value: Output) -> str:
    out = []
    for part in _parts(value):
        t = _tensor(part)
        out.append("not a number" if t is None else str(list(t.shape)))
    return out[0] if len(out) == 1 else "(" + ", ".join(out) + ")"


def _dtype_note(want: Output, got: Output) -> str:
    """A line on a dtype of another kind (integers or bools where lensdiv gives floats)."""
    kinds = []
    for w, g in zip(_parts(want), _parts(got), strict=False):
        tensors = isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor)
        if tensors and w.is_floating_point() != g.is_floating_point():
            kinds.append(f"expected dtype {w.dtype}, got {g.dtype}")
    return kinds[0] if kinds else ""


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


def _first_differences(
    want: Output, got: Output, rtol: float, atol: float, n: int = 3
) -> list[str]:
    """Lines naming the first entries that differ: index, expected, got."""
    wp, gp = _parts(want), _parts(got)
    pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    if len(wp) == len(gp) and all(
        (a := _tensor(w)) is not None and (b := _tensor(g)) is not None and a.shape == b.shape
        for w, g in zip(wp, gp, strict=True)
    ):
        for i, (w, g) in enumerate(zip(wp, gp, strict=True)):
            tw, tg = _tensor(w), _tensor(g)
            assert tw is not None and tg is not None
            pairs.append((f"[{i}]" if len(wp) > 1 else "", tw, tg))
    else:  # the structure differs: compare all the numbers in order, when there are as many
        fw, fg = _flat(want), _flat(got)
        if fw is None or fg is None or fw.shape != fg.shape:
            return []
        pairs.append(("", fw, fg))
    lines: list[str] = []
    for prefix, w, g in pairs:
        off = ~torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
        for index in off.nonzero().tolist()[: n - len(lines)]:
            where = prefix + (str(index) if index else "")
            at = tuple(index)
            lines.append(f"at {where or '[]'}: expected {float(w[at]):.6g}, got {float(g[at]):.6g}")
        if len(lines) >= n:
            break
    if not lines:
        return ["the numbers are the same"] if pairs else []
    return ["first entries that differ:"] + [f"  {line}" for line in lines]


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:300]


def abstract_methods(error: BaseException) -> str:
    """The methods a class still lacks, when ``error`` says it cannot be instantiated for that."""
    found = (
        re.search(r"abstract methods? (.+)$", str(error)) if isinstance(error, TypeError) else None
    )
    return found.group(1).strip("'\"") if found else ""


def _student_frames(error: BaseException) -> list[traceback.FrameSummary]:
    return [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not f.filename.startswith(_HIDDEN) and not any(lib in f.filename for lib in _LIBRARIES)
    ]


def _student_traceback(name: str, error: BaseException) -> str:
    """The traceback cut to the student's frames, ending with the error's own line."""
    lines = [f"✘ {name} raised an error in your code:"]
    for frame in _student_frames(error):
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
