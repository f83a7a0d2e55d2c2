"""By hand: `lensdiv explore toy` (the command, its default limits) against 20,000 half-open
connections and a patching map of a 255-token prompt.

1. ``--connections`` (20,000) connections each send ``GET / HTTP/1.1\\r\\nHost: x\\r\\n`` and
   never finish, no token (from ``--clients`` processes, each under its own file limit); then
   one request with the token: the seconds it took, the connections and file descriptors the
   server holds, the lines its log (stderr) got.
2. The page's full patching map of a 255-token prompt (piece after piece) while a grid of the
   same prompt is asked: how long the grid waited, the longest piece, the whole map.

    python bench/abuse_explore.py [--connections 20000] [--clients 2] [--json out.json]

(tests/test_explore_abuse.py runs the same cases, bounded for CI: 2,000 connections.)
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import re
import resource
import socket
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HALF_OPEN = b"GET / HTTP/1.1\r\nHost: x\r\n"


def hold(port: int, n: int, ready: Any, done: Any) -> None:
    """Open ``n`` half-open connections and keep them until ``done`` is set."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held, refused = [], 0
    for _ in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            with suppress(OSError):
                s.sendall(HALF_OPEN)
            held.append(s)
        except OSError:
            refused += 1
    ready.put((len(held), refused))
    done.wait()
    for s in held:
        s.close()


def ask(port: int, token: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data,
                     headers={"X-Lensdiv-Token": token, "Content-Type": "application/json"})
        got = conn.getresponse()
        return got.status, json.loads(got.read() or b"null")
    finally:
        conn.close()


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=20_000)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    log = Path("/tmp/abuse_explore.stderr")
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lensdiv", "explore", "toy", "--port", "0", "--no-browser"],
            stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)/\?token=([\w-]+)", line)
        assert found, line
        port, token = int(found.group(1)), found.group(2)
        out: dict[str, Any] = {"connections": args.connections, "clients": args.clients}
        out["server_fds_idle"] = fds(proc.pid)
        cpu_before = cpu_s(proc.pid)
        ready, done = mp.Queue(), mp.Event()
        per = args.connections // args.clients
        begun = time.perf_counter()
        workers = [mp.Process(target=hold, args=(port, per, ready, done))
                   for _ in range(args.clients)]
        most = [0]
        sampling = threading.Event()

        def sample() -> None:  # the most file descriptors the server held during the flood
            while not sampling.is_set():
                with suppress(OSError):
                    most[0] = max(most[0], fds(proc.pid))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample)
        sampler.start()
        for w in workers:
            w.start()
        opened = [ready.get(timeout=600) for _ in workers]
        out["opened_s"] = round(time.perf_counter() - begun, 2)
        out["client_sockets_open"] = sum(o[0] for o in opened)
        out["connect_refused"] = sum(o[1] for o in opened)
        out["server_fds_under_load"] = fds(proc.pid)
        out["load_average"] = os.getloadavg()[0]
        t0 = time.perf_counter()
        status, info = ask(port, token, "GET", "/api/info")
        out["authorised_request_s"] = round(time.perf_counter() - t0, 3)
        out["authorised_status"] = status
        sampling.set()
        sampler.join()
        out["server_fds_most"] = most[0]
        t0 = time.perf_counter()
        status, _ = ask(port, token, "POST", "/api/grid", {"text": "The happy dog runs"})
        out["authorised_grid_s"] = round(time.perf_counter() - t0, 3)
        done.set()
        for w in workers:
            w.join(60)
        time.sleep(1)
        out["server_fds_after"] = fds(proc.pid)
        out["server_cpu_us_per_connection"] = round(
            1e6 * (cpu_s(proc.pid) - cpu_before) / args.connections, 1)

        # 2. a grid asked during the page's patching map of a 255-token prompt
        clean = ("The happy dog runs to the park and the cat sleeps in the sun. " * 5)[:254]
        corrupt = clean.replace("dog", "cat", 1)
        pieces: list[float] = []
        finished = threading.Event()

        def walk() -> None:
            asked: dict[str, Any] = {"clean": clean, "corrupt": corrupt, "map": True}
            while True:
                got_status, piece = ask(port, token, "POST", "/api/patch", asked)
                assert got_status == 200, piece
                pieces.append(piece["ms"])
                if piece["next"] is None:
                    finished.set()
                    return
                asked.update(piece["next"])

        t_map = time.perf_counter()
        walker = threading.Thread(target=walk)
        walker.start()
        time.sleep(2.0)
        grids = []
        for _ in range(3):
            t0 = time.perf_counter()
            status, _ = ask(port, token, "POST", "/api/grid", {"text": clean})
            grids.append(round(time.perf_counter() - t0, 3))
            during = not finished.is_set()
            time.sleep(1.0)
        walker.join(600)
        out["map_s"] = round(time.perf_counter() - t_map, 1)
        out["map_pieces"] = len(pieces)
        out["map_longest_piece_ms"] = max(pieces)
        out["grid_during_map_s"] = grids
        out["grid_asked_while_map_ran"] = during
    finally:
        proc.terminate()
        proc.wait(30)
    lines = log.read_text().splitlines()
    out["log_lines"] = len(lines)
    out["log_bytes"] = log.stat().st_size
    out["log"] = lines[:10]
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
