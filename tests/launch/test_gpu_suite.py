"""benchmarks/gpu_suite.py: the GPU suite runs end to end here in ``--quick`` mode. Without a GPU its GPU sections
are recorded as skipped with the reason, its CPU section (speedups with real gloo ranks) is measured and its patch
cost runs every family's tiny shapes on the CPU; its Markdown renders the GPU sections' figures from a report of the
same shape."""

import json
import subprocess
import sys

import pytest
import torch

from benchmarks import gpu_suite
from benchmarks.gpu_patch_cost import StaleKV, UlyssesShare
from tests.support import REPO

ROOT = str(REPO)


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_suite")
    run = subprocess.run(
        [sys.executable, "benchmarks/gpu_suite.py", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    with open(out / "gpu.json") as fh:
        report = json.load(fh)
    return report, (out / "gpu.md").read_text()


def test_cpu_section_measures_speedups_with_real_ranks(quick_report):
    report, md = quick_report
    cpu = report["cpu_speedups"]
    assert (cpu["model"], cpu["size"], cpu["steps"], cpu["threads_per_rank"]) == ("tiny", 256, 4, 1)
    rows = cpu["degrees"]
    assert set(rows) == {"1", "2"}
    for row in rows.values():
        assert 0 < row["min"] <= row["median"] <= row["max"] < 60
    assert rows["1"]["speedup"] == 1.0
    assert rows["2"]["speedup"] == pytest.approx(rows["1"]["median"] / rows["2"]["median"])
    # 4 steps at N = 2: the warm-up step's two CFG batch parts overlap (3/4 of a step), then 3 steps at 1/2 each
    assert rows["2"]["ideal"] == pytest.approx(4 / (3 / 4 + 3 / 2))
    assert f"| 2 | {rows['2']['median']:.3f} s" in md and f"{rows['2']['speedup']:.2f}x | 1.78x |" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what the suite records where no GPU is")
def test_gpu_sections_say_why_they_did_not_run(quick_report):
    report, md = quick_report
    reason = "skipped: no CUDA device (torch.cuda.is_available() is False)"
    assert report["nccl_one_gpu"] == {"skipped": reason}
    assert md.count(reason) == 1 and report["machine"].startswith("no GPU, ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU form of the degree-1 section")
def test_degree1_runs_every_familys_diffusers_and_xfuse_call_on_the_cpu(quick_report):
    """Each family's tiny preset through the section's own path (its process, the build with parameters made on the
    device, diffusers' call, ``from_pipe`` at degree 1, xfuse's call): times, no peak memory or sync count on a CPU."""
    report, md = quick_report
    d1 = report["degree1"]
    assert (d1["device"], d1["dtype"]) == ("cpu", "float32")
    rows = d1["models"]
    assert list(rows) == ["HunyuanDiT v1.2 (DiT-g/2)", "SD3.5-large", "FLUX.1-dev", "Wan 2.1 T2V 14B"]
    assert [row.get("preset") for row in rows.values()] == ["tiny", "sd3-tiny", "flux-tiny", "wan-tiny"], rows
    for name, row in rows.items():
        for side in ("diffusers", "xfuse"):
            seconds = row[side]["seconds"]
            assert 0 < seconds["min"] <= seconds["median"] <= seconds["max"], (name, side)
            assert row[side]["peak_gib"] is None
        assert row["xfuse_over_diffusers"] == pytest.approx(
            row["xfuse"]["seconds"]["median"] / row["diffusers"]["seconds"]["median"]
        )
        assert "counted by CUDA's sync debug mode" in row["sync_debug"]["skipped"]
    assert rows["Wan 2.1 T2V 14B"]["call"]["num_frames"] == 5  # two latent frames of the 4x temporal VAE
    assert "| Wan 2.1 T2V 14B (`wan-tiny`) | 64 x 64 px, 5 frames, 2 steps," in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU form of the compiled-stages section")
def test_the_compiled_section_runs_eager_cold_warm_and_graphs_in_processes_of_their_own(quick_report):
    """FLUX's tiny preset through the section's own path (``aot_eager`` on the CPU): the cold stage compiles graphs,
    the warm one (the same ``compile.cache_dir``, a new process) makes the same graphs, ``graphs`` makes a graph per
    patch kind and its latents equal the pipelined eager call's (nothing captured on a CPU), and the report says so."""
    report, md = quick_report
    stages = report["compiled"]["stages"]
    assert list(stages) == ["eager", "cold", "warm", "pipelined eager", "graphs"], stages
    assert all("error" not in row for row in stages.values()), stages
    assert stages["pipelined eager"]["graphs"] == 0 and stages["graphs"]["graphs"] == stages["graphs"]["patches"]
    assert stages["graphs"]["max_abs_diff_to_eager"] == 0.0 and "| graphs | " in md
    assert stages["eager"]["graphs"] == 0 and stages["cold"]["graphs"] == stages["warm"]["graphs"] > 0
    assert "seconds" in stages["cold"] and "seconds" not in stages["warm"]  # a warm launch's start is its first call
    assert report["compiled"]["speedup"] == pytest.approx(
        stages["eager"]["seconds"]["median"] / stages["cold"]["seconds"]["median"]
    )
    assert "Compiled stages, `flux-tiny` at degree 1," in md and "| warm | " in md


ROWS_THAT_FAIL = """
import json, os, time
from benchmarks.own_process import row_in_own_process
rows = [row_in_own_process(entry, args, timeout, preload=())
        for entry, args, timeout in [(dict, (), 30), (os._exit, (3,), 30), (time.sleep, (60,), 1), (int, ("x",), 30)]]
print(json.dumps(rows))
"""


def test_a_rows_process_that_dies_hangs_or_raises_gives_an_error_row_and_the_next_row_runs():
    """``benchmarks.own_process``: each row in a process of its own (the degree-1 cases, the compiled stages); one
    that exits without a row, outlives its limit or raises is recorded as the error it was, and the next one runs.
    (Without the preload: what is checked is the process's end, not what it imported.)"""
    run = subprocess.run([sys.executable, "-c", ROWS_THAT_FAIL], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-3000:]
    plain, exited, hung, raised = json.loads(run.stdout.splitlines()[-1])
    assert plain == {} and exited == {"error": "rc 3: "} and hung == {"error": "did not finish in 1 s"}
    assert raised["error"] == "ValueError: invalid literal for int() with base 10: 'x'"
    assert raised["traceback"].startswith("Traceback (most recent call last):")


def test_markdown_of_the_gpu_sections():
    timing = {"median": 2.0, "min": 1.9, "max": 2.2, "runs": [1.9, 2.0, 2.2]}
    row = dict(model="FLUX.1-dev", preset="flux-dev", repeats=3, note="batch of 1",
               call=dict(height=1024, width=1024, num_inference_steps=20, output_type="latent"),
               diffusers={"seconds": timing, "peak_gib": 9.5},
               xfuse={"seconds": {**timing, "median": 1.8}, "peak_gib": 8.25},
               xfuse_over_diffusers=0.9,
               sync_debug={"total": 3, "by_source": {"diffusers/x.py:1 step": 3}})  # fmt: skip
    oom = dict(row, model="Wan", preset="wan2.1-t2v-14b", sync_debug={"error": "OutOfMemoryError: ...", "why": "K/V"})
    report = {
        "machine": "NVIDIA H100",
        "degree1": {"device": "cuda", "dtype": "bfloat16", "models": {"FLUX.1-dev": row, "Wan": oom}},
        "cpu_speedups": {"model": "small", "size": 512, "steps": 20, "degrees": {}},
        "nccl_one_gpu": {"error": "NCCL refused"},
    }
    md = gpu_suite.markdown(report)
    assert "(CUDA events, median of the repeats" in md
    assert (
        "| FLUX.1-dev (`flux-dev`) | 1024 x 1024 px, 20 steps, batch of 1, x3 | 2.000 s (1.900–2.200) | "
        "1.800 s (1.900–2.200) | 0.900 | 9.50 / 8.25 | 3 |"
    ) in md
    assert "| 0.900 | 9.50 / 8.25 | not counted: K/V |" in md
    assert "- FLUX.1-dev: 3x diffusers/x.py:1 step" in md
    assert md.rstrip().endswith("NCCL refused")


def test_only_runs_the_named_sections_and_merge_joins_split_runs(quick_report, tmp_path):
    report, _ = quick_report
    only = subprocess.run(
        [sys.executable, "benchmarks/gpu_suite.py", "--quick", "--only", "nccl_one_gpu", "--out", str(tmp_path / "a")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert only.returncode == 0, only.stderr[-3000:]
    with open(tmp_path / "a" / "gpu.json") as fh:
        part = json.load(fh)
    assert set(part) == {"machine", "nccl_one_gpu"}  # the other sections neither ran nor appear
    assert "CPU," not in (tmp_path / "a" / "gpu.md").read_text()
    cpu_part = tmp_path / "cpu.json"
    cpu_part.write_text(json.dumps({"machine": report["machine"], "cpu_speedups": report["cpu_speedups"]}))
    merged = gpu_suite.merge([str(tmp_path / "a" / "gpu.json"), str(cpu_part)])
    want = {"machine": report["machine"], "nccl_one_gpu": part["nccl_one_gpu"], "cpu_speedups": report["cpu_speedups"]}
    assert merged == want
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"machine": "NVIDIA H200, x86_64", "degree1": {}}))
    with pytest.raises(SystemExit, match="is from 'NVIDIA H200, x86_64'"):
        gpu_suite.merge([str(cpu_part), str(other)])


def test_bad_section_names_are_refused_naming_the_allowed_ones():
    run = subprocess.run(
        [sys.executable, "benchmarks/gpu_suite.py", "--only", "degree1,nccl"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert (
        "--only: unknown section(s) ['nccl']; allowed: patch_cost, degree1, cpu_speedups, nccl_one_gpu, compiled"
        in run.stderr
    )


def test_patch_cost_runs_every_family_with_a_later_patchs_text_as_the_engine_carries_it(quick_report):
    """Every family's tiny shape through the harness: a whole pass and M = 2, 4, 8; the MMDiT families whose untouched
    diffusers model takes a zero-token text stream run later patches without text, Qwen-Image's (its RoPE cannot)
    carries it in every patch and the report says so."""
    report, md = quick_report
    cost = report["patch_cost"]
    assert cost["device"] == "cpu" and cost["patches"] == [2, 4, 8]
    families = cost["families"]
    assert list(families) == ["HunyuanDiT", "SD3.5", "FLUX.1", "Qwen-Image", "FLUX.2", "Wan 2.1"]
    for name, row in families.items():
        assert "error" not in row, (name, row.get("error"))
        for depth in map(str, row["depths"]):
            assert set(row["times"][depth]) == {"1", "2", "4", "8"}
            assert all(0 < t["min_ms"] <= t["median_ms"] <= t["max_ms"] for t in row["times"][depth].values())
        assert set(row["step_over_whole"]) == {"2", "4", "8"}
        # a Ulysses rank's share: the tiny shapes have 2 heads, so U = 2 only (4 and 8 do not divide them)
        assert set(row["shares_over_whole"]) == {"2"}, name
        for depth in map(str, row["depths"]):
            share = row["share_times"][depth]["2"]
            assert 0 < share["min_ms"] <= share["median_ms"] <= share["max_ms"]
    later_text = {name: row.get("text_in_later_patches") for name, row in families.items() if row["joint_text"]}
    assert later_text == {"SD3.5": False, "FLUX.1": False, "Qwen-Image": True, "FLUX.2": False}
    assert [row["preset"] for row in families.values()] == ["tiny", "sd3-tiny", "flux-tiny", None, "flux2-tiny",
                                                            "wan-tiny"]  # fmt: skip
    assert "| Qwen-Image | 64 (128, in every patch) x 2 |" in md


def test_the_stale_kv_wrapper_attends_a_bands_queries_over_the_whole_images_buffer():
    """Inside a band's pass a self-attention's keys are the band's fresh K/V in the buffer's first rows and stale
    rows after them (what the engine's StaleKVCache.update returns); cross-attention, whose keys are the text, and
    a whole-image pass are left alone."""
    import torch.nn.functional as F

    stale = StaleKV()
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    text = torch.randn(1, 2, 7, 8)
    with stale.band(extra_tokens=11):
        out = F.scaled_dot_product_attention(q, k, v)
        cross = F.scaled_dot_product_attention(q, text, text)
    ((k_buf, v_buf),) = stale._buffers.values()
    assert k_buf.shape == (1, 2, 16, 8) and torch.equal(k_buf[:, :, :5], k) and torch.equal(v_buf[:, :, :5], v)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k_buf, v_buf))
    assert not torch.allclose(out, F.scaled_dot_product_attention(q, k, v))  # the stale rows count
    assert torch.allclose(cross, F.scaled_dot_product_attention(q, text, text))
    assert F.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"  # restored after the band
    with stale.band(extra_tokens=0):
        assert torch.allclose(F.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
    assert len(stale._buffers) == 1  # the whole image allocates nothing


def test_a_ulysses_share_attends_all_its_tokens_with_a_part_of_the_heads():
    """Inside a share's pass a self-attention of (B, heads, L, d) runs as (B, heads / U, L * U, d), what a Ulysses rank
    attends after its all-to-all, and comes back in its own shape; cross-attention is left alone."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    q, k, v = (torch.randn(1, 4, 5, 8) for _ in range(3))
    text = torch.randn(1, 4, 7, 8)
    seen = []
    F.scaled_dot_product_attention = lambda *a, **kw: seen.append(a[0].shape) or original(*a, **kw)
    try:
        with UlyssesShare().share(2):
            out = F.scaled_dot_product_attention(q, k, v)
            cross = F.scaled_dot_product_attention(q, text, text)
    finally:
        F.scaled_dot_product_attention = original
    assert seen == [(1, 2, 10, 8), (1, 4, 5, 8)]
    expected = original(*(x.reshape(1, 2, 10, 8) for x in (q, k, v))).reshape(1, 4, 5, 8)
    assert out.shape == q.shape and torch.allclose(out, expected)
    assert torch.allclose(cross, original(q, text, text))


@pytest.mark.parametrize(
    "nccl,outcome",
    [
        ({"exact_pp2": {"rc": 0, "identical": True}, "exact_pp4": {"rc": 0, "identical": True}},
         "ran and matched degree 1 exactly (exact_pp2, exact_pp4)"),
        ({"exact_pp2": {"rc": 0, "identical": False, "max_abs_pixel_diff_vs_degree1": 3}},
         "ran, but differed from degree 1: exact_pp2 max |pixel difference| 3"),
        ({"exact_pp2": {"rc": "timeout", "started": False, "nccl_said": "x\n[rank1]: ... raised the following async "
                        "exception: NCCL error: unhandled system error, NCCL 2.28.9\n"}},
         "refused: exact_pp2 ended with rc timeout; NCCL said: NCCL error: unhandled system error, NCCL 2.28.9"),
        ({"nccl_alone": {"rc": 0, "ok": True, "steps": ["rank 0: all_reduce on the default group ok"]},
          "exact_pp2": {"rc": 1, "started": False, "nccl_said": ""}},
         "refused: exact_pp2 ended with rc 1; NCCL alone ran every probe step"),
        ({"nccl_alone": {"rc": 3, "ok": False, "steps": ["rank 0: all_reduce on the default group FAILED x"]},
          "exact_pp2": {"rc": 1, "started": False, "nccl_said": ""}},
         "refused: exact_pp2 ended with rc 1; NCCL alone failed too"),
    ],
)  # fmt: skip
def test_the_nccl_section_states_its_outcome_plainly(nccl, outcome):
    assert gpu_suite.nccl_outcome(nccl) == outcome
    assert f"Outcome: {outcome}" in gpu_suite.markdown({"machine": "NVIDIA H100", "nccl_one_gpu": nccl})


def test_a_launch_past_its_limit_ends_with_the_stacks_of_its_ranks():
    # Under torchrun, as the suite's NCCL launches run: each rank is stalled in an xfuse frame; past the limit the
    # suite has each rank write its stacks (SIGUSR1, one rank at a time) and kills the launch, keeping what it wrote.
    script = REPO / "tests" / "support" / "stall_forever.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT) as proc:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.communicate(timeout=8)
        out = gpu_suite._stacks_then_kill(proc)
    assert proc.returncode is not None  # the launch is over
    head, _, frames = out.partition("xfuse frames of the stacks at the limit:\n")
    # both ranks wrote their stacks, each whole: the stalled main thread's innermost frame first
    assert head.count("Current thread") == 2, head[-3000:]
    assert frames.count("xfuse/runtime/faults.py") == 2 and frames.count("in _fire") == 2, frames
