"""The check before launch: `check_recipe` (a child process that imports the recipe, calls build and takes one
batch through forward, loss and backward) against the user's own cost of the same recipe — a bare interpreter
that imports it and calls build — side by side, interleaved. Target: the check adds under 3 s.

    python bench/recipe_check.py [--quick | --smoke]
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import ROOT, Result, describe, interleaved, median_spread, ratios, run_main
from ddpdash.trainer.config import RunConfig
from ddpdash.trainer.control import check_recipe

RECIPE = ROOT / "examples" / "linear_recipe.py"


def the_check() -> float:
    start = time.perf_counter()
    result = check_recipe(RunConfig(recipe=f"{RECIPE}:build", num_procs=2))
    if result.failures:
        raise SystemExit(f"the check failed: {result.failures}")
    return time.perf_counter() - start


def users_own_import_and_build() -> float:
    start = time.perf_counter()
    code = f"import sys; sys.path.insert(0, {str(RECIPE.parent)!r}); import linear_recipe; linear_recipe.build({{}})"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=RECIPE.parent)
    return time.perf_counter() - start


def measure(repeats: int) -> list[Result]:
    times = interleaved({"check_recipe": the_check, "python: import the recipe, build()": users_own_import_and_build},
                        repeats)
    print(f"-- {RECIPE.name}: the check against the user's own import and build, {repeats} rounds")
    for name, values in times.items():
        print("  " + describe(name, values, " s"))
    extra = [a - b for a, b in zip(times["check_recipe"], times["python: import the recipe, build()"], strict=True)]
    added, spread = median_spread(extra)
    ratio, _ = median_spread(ratios(times["check_recipe"], times["python: import the recipe, build()"]))
    print(f"  the check adds {added:.2f} s (spread {spread:.2f} s): {ratio:.2f}× the user's own time")
    return [Result("recipe check", f"{added:+.2f} s beyond the recipe's own import and build", "< +3 s", added < 3.0)]


SIZES = {"smoke": (1,), "quick": (3,), "full": (7,)}


def main() -> None:
    run_main(__doc__, SIZES, measure)


if __name__ == "__main__":
    main()
