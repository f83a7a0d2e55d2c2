"""Plain text everywhere: print(result) and print(run) in a script without a terminal give the
terminal's table, and progress reaches a log as lines at every tenth of the work or 30 s."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from rich.console import Console

from lensdiv.core.progress import LineProgress, progress_bar
from lensdiv.core.results import Result, Table, render_text

ROOT = Path(__file__).resolve().parents[1]


def script(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter whose stdout and stderr are pipes (no TTY)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True,
        cwd=ROOT, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", **env},
    )


def terminal(renderable: Any, width: int) -> str:
    """What a terminal of ``width`` columns shows, colours removed."""
    console = Console(file=io.StringIO(), width=width, force_terminal=True, color_system=None)
    console.print(renderable)
    return console.file.getvalue().rstrip("\n")


def test_print_result_in_a_script_without_a_tty() -> None:
    proc = script("""
        from lensdiv.core.results import Result, Table
        result = Result("demo", "A summary.", tables={"t": Table("t", {"layer": [0, 1],
                        "kl": [0.5, 0.25]}, "Per layer")}, warnings=("look here",))
        print(result)
        print(result.table())
    """, COLUMNS="90")
    result = Result("demo", "A summary.", tables={"t": Table("t", {"layer": [0, 1],
                    "kl": [0.5, 0.25]}, "Per layer")}, warnings=("look here",))
    expected = terminal(result, 90) + "\n" + terminal(result.table(), 90) + "\n"
    assert proc.stdout == expected
    assert "Per layer" in proc.stdout and "0.25" in proc.stdout and "look here" in proc.stdout
    assert "Result(" not in proc.stdout and "\x1b[" not in proc.stdout
    assert str(result) == render_text(result)


def test_print_run_in_a_script_without_a_tty(native_model: Any, tmp_path: Path) -> None:
    from lensdiv.run.runner import analyze

    run = analyze(native_model, plugins="lens,contrib", out=tmp_path, max_tokens=128,
                  seq_len=32, progress=False)
    proc = script(f"""
        from lensdiv.run.runner import load_run
        print(load_run({str(tmp_path)!r}))
    """, COLUMNS="100")
    assert proc.stdout == terminal(run, 100) + "\n"
    assert run["lens"].table().description in proc.stdout
    assert "Run(" not in proc.stdout


def test_line_progress_reports_every_tenth_and_every_30_seconds() -> None:
    now = [0.0]
    out = io.StringIO()
    bar = LineProgress("[bold]lens, contrib[/bold]", "tokens", stream=out, clock=lambda: now[0])
    with bar:
        task = bar.add_task("analyzing", total=1000)
        for _ in range(100):
            now[0] += 0.1
            bar.update(task, advance=10)
    lines = out.getvalue().splitlines()
    percents = [int(re.search(r"\((\d+)%\)", line).group(1)) for line in lines]
    assert percents == list(range(10, 101, 10))
    assert lines[-1].startswith("lens, contrib: 1,000/1,000 tokens (100%)")
    assert "tokens/s" in lines[-1] and "[bold]" not in lines[-1]
    # Slow work between tenths: a line every 30 s all the same.
    out = io.StringIO()
    bar = LineProgress("training", "steps  loss {task.fields[loss]:.2f}", stream=out,
                       clock=lambda: now[0])
    with bar:
        task = bar.add_task("train", total=1000, loss=3.0)
        for _ in range(20):  # 2 % of the work in 100 s
            now[0] += 5.0
            bar.update(task, advance=1, loss=2.5)
    lines = out.getvalue().splitlines()
    assert len(lines) == 4  # at 30 s, 60 s, 90 s, and the last state on exit
    assert lines[0].startswith("training: 6/1,000 steps loss 2.50 (1%)")


def test_progress_is_a_log_line_without_a_terminal() -> None:
    proc = script("""
        from lensdiv.core.progress import progress_bar
        bar = progress_bar("work", "items")
        print(type(bar).__name__)
        with bar:
            task = bar.add_task("x", total=50)
            for _ in range(50):
                bar.update(task, advance=1)
    """)
    assert proc.stdout.strip() == "LineProgress"
    assert len(proc.stderr.splitlines()) == 10 and "work: 50/50 items (100%)" in proc.stderr
    assert progress_bar("x", "y", enabled=False).disable  # off means off


def test_analyze_logs_progress_without_a_terminal(full_run: Any, tmp_path: Path) -> None:
    """The non-TTY run of the issue: `lensdiv analyze ... > log 2>&1` shows progress.

    ``full_run`` has trained and cached the toy model, so the subprocess only analyzes."""
    proc = subprocess.run(
        [sys.executable, "-m", "lensdiv", "analyze", "toy", "--plugins", "lens", "--max-tokens",
         "1024", "--seq-len", "32", "--batch-size", "2", "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("lens: ")]
    percents = [int(re.search(r"\((\d+)%\)", line).group(1)) for line in lines]
    # Batches are 64 tokens (6.25 %): a line in every tenth of the work, none missed.
    assert {p // 10 for p in percents} >= set(range(1, 11)), proc.stderr
    assert percents[-1] == 100 and percents == sorted(percents)
    assert "report.html" in proc.stdout
