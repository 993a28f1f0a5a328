"""Published syncs of other systems against the model: calibration rows and checks, kept apart.

Each row (`published_rows.ROWS`, type `published_rows.Published`) is one measurement a project
published, with its source, the date it was read, the setup as the source states it and the parts
that are guessed. A row's `role` says what it did to the model: "calibration" rows were used to write
their variant or fit a constant (they cannot test the model); "check" rows were added after the model
was frozen, and their predictions were recorded (`published_predictions.py`, `python -m megatron_sync.scale published --record`) and
committed before their measured values were. `seen` says whether the measured value was in view when
the check's setup was read ("blind": masked while reading).
"""

from __future__ import annotations

import math
import pprint
import os
import statistics
import sys
from dataclasses import replace

from megatron_sync.core.metrics import align
from megatron_sync.scale.hardware import profile_named
from megatron_sync.scale.plans import ScalePlanner
from megatron_sync.scale.published_rows import ROWS, Published
from megatron_sync.scale.timing import physical_bound
from megatron_sync.scale.variants import FITTED, VARIANTS, Constants

PREDICTIONS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "published_predictions.py")


_PLANNERS: dict[str, ScalePlanner] = {}


def planner_for(row: Published) -> ScalePlanner:
    """Return a planner of the row's layouts; the trainer's side is planned once per process for rows of one
    model and trainer layout (its fleet is swapped in)."""
    key = repr((row.model, sorted(row.overrides.items()), row.trainer, row.draft))
    if key not in _PLANNERS:
        family, config = row.hf_config()
        _PLANNERS[key] = ScalePlanner(family, config, row.trainer, row.fleet, draft=row.draft)
    return _PLANNERS[key].with_fleet(row.fleet)


_PLANS: dict[str, dict] = {}


def plans_for(row: Published) -> dict:
    """Return the plans a row's variant reads, planned once per process for rows of equal layouts."""
    key = repr((row.model, sorted(row.overrides.items()), row.trainer, row.fleet, row.draft, row.setting.bucket_bytes,
                row.variant == "ours-p2p"))
    if key not in _PLANS:
        planner = planner_for(row)
        _PLANS[key] = {"broadcast": planner.plan("broadcast", bucket_bytes=row.setting.bucket_bytes)}
        if row.variant == "ours-p2p":
            _PLANS[key]["p2p"] = planner.plan("p2p", bucket_bytes=row.setting.bucket_bytes)
        _PLANS[key]["bound"] = physical_bound(_PLANS[key]["broadcast"], profile_named(row.profile))
    return _PLANS[key]


def compare(row: Published, constants: Constants = FITTED) -> dict:
    """Return the row's variant's prediction, its layout's physical bound, and the error when measured."""
    profile = profile_named(row.profile)
    plans = plans_for(row)
    modelled = VARIANTS[row.variant](plans, profile, row.setting, constants)
    bound = plans["bound"]
    error = None if row.seconds is None else (modelled.seconds - row.seconds) / row.seconds
    return {"row": row, "predicted": modelled.seconds, "bound": bound, "bounded_by": modelled.bound,
            "parts": modelled.parts, "regressors": modelled.regressors, "error": error}


def fit_constants(rows=None) -> Constants:
    """Return the constants fitted on the calibration rows: each minimises the squared log errors of the
    rows whose variant uses it (a grid in log space, then a finer one around the best)."""
    rows = [r for r in (rows or ROWS) if r.role == "calibration" and r.seconds is not None]
    best = Constants()
    for names, variants in ((("sglang_tensor_s",), ("miles-broadcast", "miles-p2p")),
                            (("vllm_tensor_s", "bucket_round_s"), ("checkpoint-engine",))):
        best = _fit(best, names, [r for r in rows if r.variant in variants])
    return best


def _fit(start: Constants, names: tuple[str, ...], rows: list[Published]) -> Constants:
    def loss(c: Constants) -> float:
        return sum(math.log(compare(r, c)["predicted"] / r.seconds) ** 2 for r in rows)

    grid = [10 ** (e / 4) for e in range(-28, -3)]  # 1e-7 .. 0.1 s
    best, best_loss = start, math.inf
    for values in _product(grid, len(names)):
        c = replace(start, **dict(zip(names, values)))
        current = loss(c)
        if current < best_loss:
            best, best_loss = c, current
    fine = [1.0 + i / 40 for i in range(-8, 9)]
    centre = best
    for factors in _product(fine, len(names)):
        c = replace(centre, **{n: getattr(centre, n) * f for n, f in zip(names, factors)})
        current = loss(c)
        if current < best_loss:
            best, best_loss = c, current
    return replace(best, **{n: float(f"{getattr(best, n):.2g}") for n in names})


def _product(values: list[float], n: int):
    if n == 0:
        yield ()
        return
    for v in values:
        for rest in _product(values, n - 1):
            yield (v,) + rest


def record_predictions(path: str = PREDICTIONS_FILE) -> str:
    """Write every check row's prediction (and bound) as the module `published_predictions`; return its path."""
    out = {}
    for row in ROWS:
        if row.role == "check":
            c = compare(row)
            out[row.key] = {"predicted_s": round(c["predicted"], 4), "bound_s": round(c["bound"], 4),
                            "bounded_by": c["bounded_by"]}
            print(f"{row.key}: predicted {c['predicted']:.3f} s", file=sys.stderr, flush=True)
    with open(path, "w") as f:
        f.write('"""The check rows\' predictions, recorded by `python -m megatron_sync.scale published --record` '
                'before their\nmeasured values were written (see `published.py`)."""\n\nRECORDED = ')
        f.write(pprint.pformat(out, width=110, sort_dicts=True))
        f.write("\n")
    return path


def recorded() -> dict:
    """Return the committed predictions of the check rows ({} before any were recorded)."""
    try:
        from megatron_sync.scale.published_predictions import RECORDED
    except ImportError:
        return {}
    return RECORDED


def _stats(errors: list[float]) -> str:
    if not errors:
        return "no measured rows"
    worst = max(errors, key=abs)
    within = sum(abs(e) <= 0.25 for e in errors)
    return (f"{len(errors)} rows: median |error| {100 * statistics.median(abs(e) for e in errors):.0f}%, worst "
            f"{100 * worst:+.0f}%, {within} of {len(errors)} within 25%")


def groups(rows=ROWS) -> dict[str, list[tuple[Published, float, float]]]:
    """Return (row, the prediction it is judged by, the error) per group: calibration, check (blind),
    check (seen); a check is judged by its recorded prediction."""
    marks = recorded()
    out: dict[str, list] = {"calibration": [], "check (blind)": [], "check (seen)": []}
    for row in rows:
        if row.seconds is None:
            continue
        predicted = compare(row)["predicted"]
        if row.role == "check":
            predicted = marks.get(row.key, {}).get("predicted_s", predicted)
        group = "calibration" if row.role == "calibration" else f"check ({row.seen})"
        out[group].append((row, predicted, (predicted - row.seconds) / row.seconds))
    return out


def print_published() -> None:
    """Print every row beside its prediction (checks: the recorded one), and each group's errors."""
    table = []
    judged = {row.key: (predicted, error) for rows in groups().values() for row, predicted, error in rows}
    for row in ROWS:
        c = compare(row)
        predicted, error = judged.get(row.key, (c["predicted"], None))
        below = row.seconds is not None and row.seconds < c["bound"]
        table.append([row.key, row.role + ("" if row.role == "calibration" else f" ({row.seen})"), row.system,
                      row.trainer.describe(), row.fleet.describe(row.trainer), row.profile,
                      "-" if row.seconds is None else f"{row.seconds:.2f}" + (" (below bound)" if below else ""),
                      f"{predicted:.2f}", "-" if error is None else f"{100 * error:+.0f}%", f"{c['bound']:.2f}",
                      c["bounded_by"]])
        print(f"{row.key}: predicted {predicted:.2f} s", file=sys.stderr, flush=True)
    print(align(["row", "role", "system", "trainer", "engines", "profile", "measured s", "predicted s", "error",
                 "bound s", "bounded by"], table))
    for group, rows in groups().items():
        print(f"{group}: {_stats([e for _, _, e in rows])}")
    print(f"checks, all: {_stats([e for g, rows in groups().items() if g != 'calibration' for _, _, e in rows])}")
    print(f"constants fitted on calibration rows: {FITTED}")
