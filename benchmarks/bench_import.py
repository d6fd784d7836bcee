"""What the torch_vjp plugin adds to ``import torch`` (SPEC §7; target: at most 5%).

Each run starts fresh interpreters, one per configuration ("arm"), alternating the order of
the arms from round to round so that drifting machine load hits them alike:

* ``python -X importtime -c "import torch"``: the cumulative time of the top-level ``torch``
  line (microseconds);
* ``python -c "...import torch..."``: the wall-clock time (``time.perf_counter``) and the
  CPU time (``time.process_time``, all threads) of ``import torch`` measured inside the
  child (interpreter start-up excluded). CPU time is the steadiest of the three on a
  machine shared with other work.

``-X importtime`` does not list modules imported through ``importlib.import_module``, which
is how torch loads entry points, so the hook's own cost is also measured directly, once per
round: in a child that imported torch with the hook off, the time to import the hook module
and call it (what torch does per entry point).

Arms: ``autoload`` (the default environment) and ``off`` (``TORCH_VJP_AUTOLOAD=0``); the
reported ratio is autoload / off, medians over the runs. ``--extra`` adds ``checked``
(``TORCH_VJP_CHECKED=1``: torch_vjp itself is imported during ``import torch``) and
``no-backends`` (``TORCH_DEVICE_BACKEND_AUTOLOAD=0``: torch calls no plugin at all).

A warm-up round (not counted) checks that each arm does what it says: ``torch.vjp`` exists
(lazily, or imported for ``checked``) or does not. ``torch.utils.benchmark`` does not apply
here: an import runs once per process.

Usage::

    python benchmarks/bench_import.py [--runs 15] [--extra] [--out benchmarks/results]

Writes ``import_time.json`` and ``import_time.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_RATIO = 1.05

ARMS: dict[str, dict[str, str]] = {
    "autoload": {},
    "off": {"TORCH_VJP_AUTOLOAD": "0"},
}
EXTRA_ARMS: dict[str, dict[str, str]] = {
    "checked": {"TORCH_VJP_CHECKED": "1"},
    "no-backends": {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
}
# What each arm must show after ``import torch``: (torch.vjp exists, torch_vjp has run).
EXPECTED_STATE: dict[str, tuple[bool, bool]] = {
    "autoload": (True, False),
    "off": (False, False),
    "checked": (True, True),
    "no-backends": (False, False),
}

HOOK_CODE = """
import importlib, os, sys, time
import torch
del os.environ["TORCH_VJP_AUTOLOAD"]
start = time.perf_counter()
importlib.import_module(sys.argv[1])._autoload()
elapsed = time.perf_counter() - start
assert torch.vjp is sys.modules["torch.vjp"]
print(elapsed)
"""

WALL_CODE = """
import sys, time, types
start, start_cpu = time.perf_counter(), time.process_time()
import torch
elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
module = sys.modules.get("torch_vjp")
print(elapsed, elapsed_cpu, hasattr(torch, "vjp"), type(module) is types.ModuleType)
"""


def _hook_module_name() -> str | None:
    """The module of the ``torch_vjp`` entry point in group ``torch.backends``, if installed."""
    for entry_point in importlib.metadata.entry_points(group="torch.backends"):
        if entry_point.name == "torch_vjp":
            return entry_point.module
    return None


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("TORCH_VJP_")
        and key not in ("TORCH_DEVICE_BACKEND_AUTOLOAD", "PYTHONWARNINGS")
    }
    env.update(extra)
    return env


def _run(args: list[str], env: dict[str, str], cwd: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )
    if result.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{result.stdout}\n{result.stderr}")
    return result


def parse_importtime(stderr: str) -> int:
    """Cumulative microseconds of the top-level ``torch`` line of ``-X importtime`` output.

    Lines read ``import time: self | cumulative | name``, the name indented by one space
    plus two per nesting level, so the top-level line's name field is exactly `` torch``.
    """
    for line in stderr.splitlines():
        if not line.startswith("import time:"):
            continue
        parts = line[len("import time:") :].split("|")
        if len(parts) == 3 and parts[2].rstrip() == " torch" and parts[1].strip().isdigit():
            return int(parts[1])
    raise RuntimeError(f"no top-level torch line in -X importtime output:\n{stderr[-2000:]}")


def measure(runs: int, arms: dict[str, dict[str, str]]) -> dict[str, dict[str, list[float]]]:
    """Alternating rounds of both measurements for every arm, after a checked warm-up."""
    hook = _hook_module_name()
    if hook is None:
        raise SystemExit(
            "torch_vjp is not pip-installed (no 'torch.backends' entry point 'torch_vjp'): "
            "run `pip install -e .` first"
        )
    samples: dict[str, dict[str, list[float]]] = {
        arm: {"importtime_us": [], "wall_s": [], "cpu_s": []} for arm in arms
    }
    samples["hook_call"] = {"wall_s": []}
    hook_env = _child_env({"TORCH_VJP_AUTOLOAD": "0"})
    with tempfile.TemporaryDirectory() as cwd:  # keep the repository root off sys.path
        for arm, extra in arms.items():  # warm-up, doubling as a check of each arm
            output = _run(["-c", WALL_CODE], _child_env(extra), cwd).stdout.split()
            state = (output[2] == "True", output[3] == "True")
            if state != EXPECTED_STATE[arm]:
                raise RuntimeError(
                    f"arm {arm!r}: (torch.vjp exists, torch_vjp has run) is {state}, "
                    f"expected {EXPECTED_STATE[arm]}"
                )
        order = list(arms)
        for round_index in range(runs):
            for arm in order if round_index % 2 == 0 else order[::-1]:
                env = _child_env(arms[arm])
                stderr = _run(["-X", "importtime", "-c", "import torch"], env, cwd).stderr
                samples[arm]["importtime_us"].append(parse_importtime(stderr))
                wall = _run(["-c", WALL_CODE], env, cwd).stdout.split()
                samples[arm]["wall_s"].append(float(wall[0]))
                samples[arm]["cpu_s"].append(float(wall[1]))
            hook_time = _run(["-c", HOOK_CODE, hook], hook_env, cwd).stdout.split()
            samples["hook_call"]["wall_s"].append(float(hook_time[0]))
            print(f"round {round_index + 1}/{runs} done", file=sys.stderr)
    return samples


def summarise(samples: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    summary = {}
    for arm, metrics in samples.items():
        if arm == "hook_call":
            continue
        summary[arm] = {
            "importtime_ms_median": statistics.median(metrics["importtime_us"]) / 1000,
            "importtime_ms_min": min(metrics["importtime_us"]) / 1000,
            "wall_ms_median": statistics.median(metrics["wall_s"]) * 1000,
            "wall_ms_min": min(metrics["wall_s"]) * 1000,
            "cpu_ms_median": statistics.median(metrics["cpu_s"]) * 1000,
            "cpu_ms_min": min(metrics["cpu_s"]) * 1000,
        }
    hook = samples["hook_call"]["wall_s"]
    summary["hook_call"] = {
        "us_median": statistics.median(hook) * 1e6,
        "us_max": max(hook) * 1e6,
    }
    return summary


def environment() -> dict[str, object]:
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "torch_vjp": importlib.metadata.version("torch_vjp"),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average_at_end": load,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def markdown(result: dict[str, object]) -> str:
    summary = result["summary"]
    ratios = result["ratios"]
    env = result["environment"]
    lines = [
        "# `import torch` with and without the torch_vjp plugin",
        "",
        f"{result['runs']} alternating runs per arm; medians (min in brackets). "
        f"Ratio target: autoload / off <= {TARGET_RATIO}.",
        "",
        "| arm | environment | -X importtime, torch cumulative (ms) | wall, import torch (ms) "
        "| CPU, import torch (ms) |",
        "|---|---|---:|---:|---:|",
    ]
    for arm in result["arms"]:
        row = summary[arm]
        env_text = " ".join(f"{k}={v}" for k, v in result["arms"][arm].items()) or "(default)"
        lines.append(
            f"| {arm} | `{env_text}` | {row['importtime_ms_median']:.1f} "
            f"({row['importtime_ms_min']:.1f}) | {row['wall_ms_median']:.1f} "
            f"({row['wall_ms_min']:.1f}) | {row['cpu_ms_median']:.1f} ({row['cpu_ms_min']:.1f}) |"
        )
    hook = summary["hook_call"]
    lines += [
        "",
        f"- autoload / off, -X importtime: **{ratios['importtime']:.3f}** "
        f"(ratio of minima {ratios['importtime_min']:.3f})",
        f"- autoload / off, wall: **{ratios['wall']:.3f}** (ratio of minima "
        f"{ratios['wall_min']:.3f})",
        f"- autoload / off, CPU: **{ratios['cpu']:.3f}** (ratio of minima "
        f"{ratios['cpu_min']:.3f})",
        f"- within target ({TARGET_RATIO}): {result['within_target']}",
        f"- the hook itself (import its module and call it, torch already imported): "
        f"median {hook['us_median']:.0f} us, max {hook['us_max']:.0f} us, i.e. "
        f"{100 * ratios['hook_share']:.3f}% of the fastest `import torch` with the plugin off",
        "",
        f"Environment: Python {env['python']}, torch {env['torch']}, torch_vjp "
        f"{env['torch_vjp']}, {env['platform']}, {env['cpu_count']} CPUs, load average at end "
        f"{env['load_average_at_end']}, {env['date']}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="runs per arm (default 15)")
    parser.add_argument("--extra", action="store_true", help="also the checked and no-backends arms")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")

    arms = dict(ARMS)
    if args.extra:
        arms.update(EXTRA_ARMS)
    samples = measure(args.runs, arms)
    summary = summarise(samples)
    ratios = {
        "importtime": summary["autoload"]["importtime_ms_median"]
        / summary["off"]["importtime_ms_median"],
        "wall": summary["autoload"]["wall_ms_median"] / summary["off"]["wall_ms_median"],
        # minima are the least disturbed by other load on the machine
        "importtime_min": summary["autoload"]["importtime_ms_min"]
        / summary["off"]["importtime_ms_min"],
        "wall_min": summary["autoload"]["wall_ms_min"] / summary["off"]["wall_ms_min"],
        "cpu": summary["autoload"]["cpu_ms_median"] / summary["off"]["cpu_ms_median"],
        "cpu_min": summary["autoload"]["cpu_ms_min"] / summary["off"]["cpu_ms_min"],
        # the hook's own cost against the cheapest plugin-free import seen: an upper bound
        # on what the plugin adds that the noise in the ratios above cannot hide
        "hook_share": summary["hook_call"]["us_median"]
        / (summary["off"]["importtime_ms_min"] * 1000),
    }
    result = {
        "benchmark": "import_time",
        "runs": args.runs,
        "arms": arms,
        "summary": summary,
        "ratios": ratios,
        "target_ratio": TARGET_RATIO,
        "within_target": ratios["importtime"] <= TARGET_RATIO,
        "samples": samples,
        "environment": environment(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "import_time.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (args.out / "import_time.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
