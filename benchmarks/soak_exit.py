"""Exit soak: launch the same torchrun generation many times and count how each launch ended.

    python benchmarks/soak_exit.py --runs 200                          # cfg 2 x pp 2 on 4 ranks (issue 15's world)
    python benchmarks/soak_exit.py --runs 50 --world pp2               # 2 ranks, pp 2
    python benchmarks/soak_exit.py --runs 30 --keep-cores              # also keep core dumps of aborted ranks

Every launch is ``torchrun --standalone -m xfuse generate`` on a small HunyuanDiT folder (the ``tiny`` preset saved
with ``save_pretrained``, loaded with ``from_pretrained``), CPU, fp32, 256x256, 4 steps, ``comm.timeout_s: 10``.
A launch counts as clean only if torchrun exits 0, the PNG exists and no rank printed an abort. Each other launch
keeps its stderr under ``--log-dir`` and is classified (``abort``: a rank died of SIGABRT or printed "terminate
called"; ``no-png``; ``exit-N``; ``timeout``). The summary is printed and written as JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WORLDS = {
    # name: (ranks, YAML of the parallel section)
    "cfg2_pp2": (4, "parallel: {pipefusion_degree: 2, cfg_degree: 2, num_patches: 4, warmup_steps: 1}\n"),
    "pp2": (2, "parallel: {pipefusion_degree: 2, cfg_degree: 1, num_patches: 2, warmup_steps: 1}\n"),
}
ABORT = re.compile(r"terminate called|Fatal Python error: Aborted|exitcode\s*:\s*-6|Signals\.SIGABRT")


def write_config(folder: str, model: str, world: str) -> str:
    path = os.path.join(folder, f"{world}.yaml")
    with open(path, "w") as fh:
        fh.write(
            f"model: {model}\n{WORLDS[world][1]}comm: {{timeout_s: 10}}\n"
            "runtime: {device: cpu, dtype: float32}\n"
            "generation: {height: 256, width: 256, num_inference_steps: 4, seed: 0}\n"
        )
    return path


def launch(config: str, ranks: int, output: str, env: dict, timeout_s: float) -> tuple[str, str, float]:
    """One torchrun launch: (outcome, stderr, seconds)."""
    if os.path.exists(output):
        os.remove(output)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        "-m",
        "xfuse",
        "generate",
        "--config",
        config,
        "--output",
        output,
    ]
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired as err:
        return (
            "timeout",
            (err.stderr or b"").decode(errors="replace") if isinstance(err.stderr, bytes) else (err.stderr or ""),
            time.perf_counter() - start,
        )
    seconds = time.perf_counter() - start
    if ABORT.search(out.stderr):
        return "abort", out.stderr, seconds
    if out.returncode != 0:
        return f"exit-{out.returncode}", out.stderr, seconds
    if not os.path.exists(output):
        return "no-png", out.stderr, seconds
    return "ok", out.stderr, seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--world", choices=sorted(WORLDS), default="cfg2_pp2")
    parser.add_argument("--log-dir", default=os.path.join(ROOT, "outputs", "soak_exit"))
    parser.add_argument("--json", help="write the summary here (default <log-dir>/<world>.json)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds before a launch counts as hung")
    parser.add_argument(
        "--keep-cores",
        action="store_true",
        help="raise the core-file limit so aborted ranks leave core dumps in <log-dir>/cores",
    )
    args = parser.parse_args(argv)

    from xfuse.families.hunyuandit.presets import save_tiny_pipeline

    os.makedirs(args.log_dir, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONFAULTHANDLER": "1"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if args.keep_cores:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    ranks = WORLDS[args.world][0]
    outcomes: collections.Counter = collections.Counter()
    seconds = []
    with tempfile.TemporaryDirectory(prefix="xfuse-soak-") as tmp:
        model = save_tiny_pipeline(os.path.join(tmp, "tiny-hunyuandit"))
        config = write_config(tmp, model, args.world)
        output = os.path.join(tmp, "soak.png")
        for run in range(1, args.runs + 1):
            outcome, stderr, took = launch(config, ranks, output, env, args.timeout)
            outcomes[outcome] += 1
            seconds.append(took)
            if outcome != "ok":
                with open(os.path.join(args.log_dir, f"{args.world}-run{run:03d}-{outcome}.log"), "w") as fh:
                    fh.write(stderr)
            print(f"run {run}/{args.runs}: {outcome} ({took:.1f} s); so far {dict(outcomes)}", flush=True)
    seconds.sort()
    summary = {
        "world": args.world,
        "ranks": ranks,
        "runs": args.runs,
        "outcomes": dict(outcomes),
        "clean": outcomes["ok"],
        "seconds_median": seconds[len(seconds) // 2],
        "seconds_min": seconds[0],
        "seconds_max": seconds[-1],
    }
    with open(args.json or os.path.join(args.log_dir, f"{args.world}.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    print(
        f"{args.world}: {outcomes['ok']} of {args.runs} launches exited 0 with their PNG written; "
        f"outcomes {dict(outcomes)}; {summary['seconds_median']:.1f} s median per launch"
    )
    return 0 if outcomes["ok"] == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
