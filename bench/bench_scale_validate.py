"""The scale model against this machine, in one command: one calibration, then one bench run, then the
comparison, in that order, every output kept whatever it shows.

1. bench_scale_rates.py: this machine's rates on calibration models (not the bench's), written to
   OUT/rates.json (the package's rates_local.json is left alone unless --install);
2. bench_sync.py (`make bench`: broadcast, six models x 4/16/64 MiB) -> OUT/bench.json, then
   bench_scale_local.py (the same models over p2p with each backend, disk_delta, ipc) -> OUT/local.json;
3. bench_scale_check.py: every measured configuration against the model's prediction from OUT/rates.json.

Run it alone on the machine (other jobs share the cores the model assumes the sync has):

    PYTHONPATH=. nice -n -15 .venv/bin/python bench/bench_scale_validate.py --out runs/scale-validate
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def step(name: str, args: list[str], log: str) -> None:
    """Run one script with this interpreter, print its output as it comes and keep it in `log`."""
    command = [sys.executable, os.path.join(HERE, name), *args]
    print(f"\n$ {' '.join(command)}", flush=True)
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            out.write(line)
        code = proc.wait()
    print(f"[{name}: exit {code}, {time.monotonic() - started:.0f} s; log {log}]", flush=True)
    if code != 0:
        raise SystemExit(f"{name} failed (exit {code}); see {log}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/scale-validate", help="directory for every output")
    parser.add_argument("--reps", type=int, default=3, help="rounds of the calibration and of make bench")
    parser.add_argument("--install", action="store_true", help="also copy the rates to the package's rates file")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    out = lambda name: os.path.join(args.out, name)  # noqa: E731
    step("bench_scale_rates.py", ["--reps", str(args.reps), "--out", out("rates.json")], out("rates.log"))
    step("bench_sync.py", ["--reps", str(args.reps), "--json", out("bench.json")], out("bench.log"))
    step("bench_scale_local.py", ["--json", out("local.json")], out("local.log"))
    step("bench_scale_check.py", [out("bench.json"), "--local", out("local.json"), "--rates", out("rates.json")],
         out("check.log"))
    if args.install:
        from megatron_sync.scale.hardware import RATES_FILE

        shutil.copy(out("rates.json"), RATES_FILE)
        print(f"installed {out('rates.json')} as {RATES_FILE}")


if __name__ == "__main__":
    main()
