"""Times a command from OUTSIDE: seconds from its last output line to its exit, beside busy cores.

    python scripts/time_exit.py [--burners 2] -- seg-train --config configs/demo.yaml --gpus 2 ...

Starts `--burners` CPU-bound processes (`python -c 'while 1: pass'`, as a machine whose cores other
work keeps busy), runs the command with its stdout and stderr on pipes (PYTHONUNBUFFERED=1, so each
line arrives when it is written), and prints one line: the exit code, the seconds from the last
line (of either stream) to the process's exit, the longest pause between two lines (and the line
after it), and the wall time. The burners are stopped when the command ends. docs/PERFORMANCE.md
("Last line to exit") has the figures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--burners", type=int, default=2, help="CPU-bound processes beside the command (default 2)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    burners = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.burners)]
    lines, lock = [], threading.Lock()
    try:
        start = time.monotonic()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))

        def pump(stream):
            for raw in iter(stream.readline, b""):
                with lock:
                    lines.append((time.monotonic(), raw.decode(errors="replace").rstrip()))

        pumps = [threading.Thread(target=pump, args=(s,)) for s in (proc.stdout, proc.stderr)]
        for p in pumps:
            p.start()
        code = proc.wait()
        exited = time.monotonic()
        for p in pumps:
            p.join()
    finally:
        for b in burners:
            b.kill()
    lines.sort()
    last = lines[-1][0] if lines else start
    pause, after = max(((b[0] - a[0], b[1]) for a, b in zip(lines, lines[1:])), default=(0.0, ""))
    print(f"exit {code}; last line to exit {exited - last:.2f} s; longest pause {pause:.1f} s (before "
          f"{after[:60]!r}); wall {exited - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
