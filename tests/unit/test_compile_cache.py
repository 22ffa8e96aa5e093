"""``compile.cache_dir``'s folders (``xfuse.runtime.compile_cache``): one key per torch, model, dtype, device, backend
and ``dynamic``, so a launch that differs in any of them misses; the record a folder keeps; what ``xfuse doctor
--compile-cache`` says of it."""

import dataclasses
import json
import os
import time

import pytest
import torch

from xfuse.doctor import compile_cache_lines
from xfuse.runtime.compile_cache import CompileCache, entries

PARTS = dict(torch=torch.__version__, family="flux", model_config_hash="68b2aa0d1682", dtype="torch.bfloat16",
             device="cuda", backend="inductor", dynamic=False)  # fmt: skip


@pytest.mark.parametrize(
    "changed",
    [
        {"torch": "2.12.0+cu128"},
        {"family": "flux2"},
        {"model_config_hash": "0"},
        {"dtype": "torch.float32"},
        {"device": "cpu"},
        {"backend": "aot_eager"},
        {"dynamic": True},
    ],  # fmt: skip
)
def test_a_launch_that_differs_in_any_part_gets_another_folder(tmp_path, changed):
    same = CompileCache(str(tmp_path), **PARTS)
    assert CompileCache(str(tmp_path), **PARTS).folder == same.folder
    assert CompileCache(str(tmp_path), **(PARTS | changed)).folder != same.folder


def test_the_record_names_the_parts_and_each_shape_once_and_doctor_reports_it(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cache = CompileCache(str(tmp_path), **PARTS)
    assert not cache.warm
    cache.activate()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == cache.folder  # where Inductor writes from now on
    for shape in ("latents 1x16x64x64", "latents 1x16x48x64", "latents 1x16x64x64"):
        cache.record(shape)
    assert cache.warm
    entry = cache.read()
    assert entry.shapes == ["latents 1x16x64x64", "latents 1x16x48x64"]
    assert {k: v for k, v in dataclasses.asdict(entry).items() if k in PARTS} == PARTS
    other = CompileCache(str(tmp_path), **(PARTS | {"torch": "2.12.0+cu128"}))
    os.makedirs(other.folder)
    time.sleep(0.01)  # recorded later: listed first
    other.record("latents 1x16x64x64")
    with open(os.path.join(other.folder, "kernel.bin"), "wb") as fh:
        fh.write(b"\0" * (1 << 20))
    assert [e.key for e, _ in entries(str(tmp_path))] == [other.key, entry.key]  # newest first
    lines = compile_cache_lines(str(tmp_path))
    assert lines[0] == f"compile cache {tmp_path}: 2 key(s), 1.0 MiB"
    assert lines[1].startswith(f"  {other.key}: flux (model config 68b2aa0d1682), torch.bfloat16 on cuda, inductor, "
                               f"dynamic false; torch 2.12.0+cu128 (not this torch {torch.__version__}: unused); "
                               "1 request shape(s): latents 1x16x64x64; 1.0 MiB; updated ")  # fmt: skip
    assert f"torch {torch.__version__} (this torch); 2 request shape(s)" in lines[2]


def test_an_empty_or_missing_folder_says_a_launch_compiles_cold(tmp_path):
    assert compile_cache_lines(str(tmp_path / "none")) == [
        f"compile cache {tmp_path / 'none'}: empty (a launch with it as compile.cache_dir compiles cold and fills it)"
    ]
    with open(tmp_path / "stray.json", "w") as fh:
        json.dump({}, fh)
    assert entries(str(tmp_path)) == []
