"""``xfuse generate`` / ``xfuse serve`` on a video model (Wan 2.1, the ``wan-tiny`` preset).

The 2-rank runs are ``xfuse.cli.main`` on the module's world as torchrun's ranks run it (``tests.support.cli_fns``),
the frames handed to the CLI's clip writer also saved as ``.npy``, so the file written can be compared with the
pipeline's own frames. Real processes where the process is the case: the GIF fallback goes through a small launcher
(:data:`CHILD`, written to the test's folder) that makes ``import imageio_ffmpeg`` fail (``sys.modules[name] =
None``), as if ``xfuse[video]`` were not installed, and ``xfuse serve``'s refusal at start-up.
"""

import os
import re
import subprocess
import sys

import numpy as np
from PIL import Image, ImageSequence

from tests.support import REPO
from tests.support.cli_fns import cli_here, on_ranks

ENV = dict(os.environ)  # offline: tests/conftest.py

CHILD = """\
import os
import sys

import numpy as np

sys.modules["imageio_ffmpeg"] = None  # `import imageio_ffmpeg` raises ImportError: as if not installed

import xfuse.cli as cli

write_clip = cli.write_clip


def recorded(frames, output, fps):
    np.save(os.environ["FRAMES_NPY"], np.stack([np.asarray(frame) for frame in frames]))
    return write_clip(frames, output, fps)


cli.write_clip = recorded
sys.exit(cli.main(sys.argv[1:]))
"""

# wan-tiny at 96 x 64 px (multiples of 16: no resize by export_to_video's macro_block_size), 9 frames = 3 latent
# frames, 3 steps; the rest from configs/wan/pp2.yaml (pipefusion 2, 2 patches, warm-up 1, fps 16).
SETTINGS = ("generation.height=64", "generation.width=96", "generation.num_frames=9",
            "generation.num_inference_steps=3")  # fmt: skip
SETS = [arg for value in SETTINGS for arg in ("--set", value)]
CONFIG = str(REPO / "configs/wan/pp2.yaml")


def _child(tmp_path):
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return str(path)


def _run(cmd, env, timeout=180):
    return subprocess.run(cmd, capture_output=True, text=True, env={**ENV, **env}, timeout=timeout, cwd=REPO)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(255**2 / np.mean((a.astype(float) - b.astype(float)) ** 2)))


def test_generate_writes_an_mp4_of_the_clip_on_2_ranks(ranks, tmp_path):
    """2 ranks: rank 0 writes an H.264 MP4 at 16 fps that decodes back (imageio's ffmpeg reader) into the
    9 frames of 96 x 64 px, the first close to the pipeline's own first frame. Observed (imageio-ffmpeg 0.8.1's
    ffmpeg, quality 5, yuv420p): frame 0 at 28.1 dB PSNR, mean |diff| 7.5 of 255 over RGB (the random model's frames
    are noise-like, the hardest case for the codec; chroma is subsampled), every frame above 21 dB, and the other
    frames 14.7-17.4 dB from frame 0."""
    import imageio

    target, npy = tmp_path / "clip.mp4", tmp_path / "frames.npy"
    out = on_ranks(ranks, ["generate", "--config", CONFIG, *SETS, "--output", str(target)], frames_npy=str(npy))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"wrote {target}: 9 frames of 96x64 at 16 fps (0.56 s), 3 steps in " in out.stdout, out.stdout
    assert " s on 2 rank(s) (pipefusion 2 x cfg 1, linear, 2 patches, warm-up 1;" in out.stdout
    assert "  rank 0 sent " in out.stdout and "  rank 1 sent " in out.stdout
    assert "not installed" not in out.stderr and not (tmp_path / "clip.gif").exists()
    reader = imageio.get_reader(str(target), "ffmpeg")
    meta = reader.get_meta_data()
    assert (meta["codec"], meta["fps"], meta["size"]) == ("h264", 16.0, (96, 64))
    decoded = np.stack([frame for frame in reader.iter_data()])  # not list(reader): its len() is inf
    reader.close()
    own = np.load(npy)
    assert decoded.shape == own.shape == (9, 64, 96, 3) and own.dtype == np.uint8
    assert _psnr(decoded[0], own[0]) > 25 and np.abs(decoded[0].astype(int) - own[0]).mean() < 12
    assert min(_psnr(decoded[k], own[k]) for k in range(9)) > 19
    assert max(_psnr(decoded[0], own[k]) for k in range(1, 9)) < 21  # it is frame 0, not any frame


def test_generate_decodes_the_clip_over_both_ranks_and_reports_each_ranks_share(ranks, tmp_path):
    """``parallel.vae_parallel=on``: the summary says the decode ran on both ranks, and each rank's line its decode's
    bytes sent (halo rows, keys and values; rank 1 its band of the clip) and what the decode added to its memory at
    its peak; the frames are those of rank 0 decoding alone (``off``), up to one level of rounding."""
    frames = {}
    for mode in ("on", "off"):
        npy = tmp_path / f"{mode}.npy"
        argv = ["generate", "--config", CONFIG, *SETS, "--set", f"parallel.vae_parallel={mode}",
                "--output", str(tmp_path / f"{mode}.mp4")]  # fmt: skip
        out = on_ranks(ranks, argv, frames_npy=str(npy))
        assert out.returncode == 0, out.stderr[-3000:]
        assert f"; VAE decode on {2 if mode == 'on' else 1} rank(s); text encoders rank0)" in out.stdout, out.stdout
        lines = [next(line for line in out.stdout.splitlines() if line.startswith(f"  rank {r} sent")) for r in (0, 1)]
        for rank, line in enumerate(lines):
            share = re.search(r"; decode: sent (\d+\.\d\d) MiB, \+(\d+) MiB resident at its peak$", line)
            if mode == "off":  # rank 0 decodes alone, sending nothing; rank 1 takes no part
                assert (share is not None and float(share[1]) == 0) if rank == 0 else "decode:" not in line, line
                continue
            assert share is not None and float(share[1]) > 0 and "vae halo" in line and "vae kv" in line, line
            assert ("vae image" in line) is (rank == 1) and ("vae latent" in line) is (rank == 0), line
        frames[mode] = np.load(npy)
    assert frames["on"].shape == frames["off"].shape == (9, 64, 96, 3)
    assert np.abs(frames["on"].astype(int) - frames["off"].astype(int)).max() <= 1


def test_the_clip_writer_starts_ffmpeg_with_no_python_between_fork_and_exec(tmp_path, monkeypatch):
    """A rank is threaded (the failure monitor, gloo's threads): imageio-ffmpeg's default start of ffmpeg runs a
    Python ``preexec_fn`` in the forked child, which can deadlock before ``exec`` and leave rank 0 writing frames to
    an ffmpeg that never started (one CI run: rank 0 of a 2-rank clip never answered). The writer turns that off;
    the clip is still written (every ``Popen`` of the real run recorded)."""
    from xfuse.cli import write_clip

    monkeypatch.delenv("IMAGEIO_FFMPEG_NO_PREVENT_SIGINT", raising=False)
    started = []

    class Recorded(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            started.append((os.path.basename(str(args[0])), kwargs.get("preexec_fn")))
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    frames = [Image.new("RGB", (64, 48), (30 * i, 0, 255 - 30 * i)) for i in range(6)]
    path, note = write_clip(frames, str(tmp_path / "clip.mp4"), 8)
    assert note is None and path.endswith("clip.mp4") and os.path.getsize(path) > 0
    writers = [preexec for name, preexec in started if "ffmpeg" in name]
    assert writers and writers == [None] * len(writers), started


def test_generate_without_imageio_ffmpeg_writes_a_gif_and_says_so(tmp_path):
    """Plain python, one rank, imageio-ffmpeg hidden: an animated GIF beside the MP4 asked for (9 frames of 96 x 64,
    60 ms each: 1000 / 16 fps in whole centiseconds, looping), one stderr line naming the missing package and the
    install command. GIF's 256-colour palette (dithered) costs a mean |diff| of about 4.7 of 255 here."""
    asked, npy = tmp_path / "clip.mp4", tmp_path / "frames.npy"
    gif = tmp_path / "clip.gif"
    cmd = [sys.executable, _child(tmp_path), "generate", "--config", CONFIG, *SETS,
           "--set", "parallel.pipefusion_degree=1", "--output", str(asked)]  # fmt: skip
    out = _run(cmd, {"FRAMES_NPY": str(npy)})
    assert out.returncode == 0, out.stderr[-3000:]
    line = (
        f"xfuse generate: imageio-ffmpeg is not installed, so {gif} is an animated GIF, not an MP4 "
        "(pip install 'xfuse[video]' writes MP4)\n"
    )
    assert line in out.stderr, out.stderr[-2000:]
    assert f"wrote {gif}: 9 frames of 96x64 at 16 fps (0.56 s), 3 steps in " in out.stdout, out.stdout
    assert " s on 1 rank(s) (pipefusion 1 x cfg 1," in out.stdout
    assert gif.exists() and not asked.exists()
    with Image.open(gif) as image:
        assert (image.format, image.n_frames, image.size, image.info["loop"]) == ("GIF", 9, (96, 64), 0)
        frames = [frame.convert("RGB") for frame in ImageSequence.Iterator(image)]
        durations = [frame.info["duration"] for frame in ImageSequence.Iterator(image)]
    assert durations == [60] * 9
    own = np.load(npy)
    assert own.shape == (9, 64, 96, 3)
    assert np.abs(np.stack([np.asarray(f) for f in frames]).astype(int) - own).mean() < 8


def test_generate_image_to_video_on_2_ranks_equals_diffusers(ranks, tmp_path):
    """``--image`` with a Wan 2.2 TI2V model (``wan2.2-ti2v-tiny``): the family's image-to-video pipeline on 2 ranks,
    exact mode (warm-up = all steps), whose frames equal diffusers' ``WanImageToVideoPipeline`` on the same preset and
    first frame within one 8-bit level (observed: 0.003 % of the values one level off, the ranks' single-threaded
    GEMMs rounding otherwise)."""
    import torch

    from xfuse.families.registry import load_pipeline

    first, target, npy = tmp_path / "first.png", tmp_path / "clip.mp4", tmp_path / "frames.npy"
    Image.fromarray((np.random.RandomState(1).rand(128, 224, 3) * 255).astype(np.uint8)).save(first)
    size = ("generation.height=128", "generation.width=224", "generation.num_frames=9",
            "generation.num_inference_steps=3", "parallel.warmup_steps=3", "model=wan2.2-ti2v-tiny")  # fmt: skip
    argv = ["generate", "--config", CONFIG, *[a for v in size for a in ("--set", v)], "--image", str(first),
            "--output", str(target)]  # fmt: skip
    out = on_ranks(ranks, argv, frames_npy=str(npy))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"wrote {target}: 9 frames of 224x128 at 16 fps (0.56 s), 3 steps in " in out.stdout, out.stdout
    reference = load_pipeline("wan2.2-ti2v-tiny", None, "WanImageToVideoPipeline")
    reference.set_progress_bar_config(disable=True)
    expected = reference(
        image=Image.open(first).convert("RGB"), prompt="A small red fox running through the snow, cinematic",
        height=128, width=224, num_frames=9, num_inference_steps=3, guidance_scale=5.0, output_type="pil",
        generator=torch.Generator().manual_seed(0),
    ).frames[0]  # fmt: skip
    own = np.load(npy)
    assert own.shape == (9, 128, 224, 3)
    diff = np.abs(own.astype(int) - np.stack([np.asarray(f) for f in expected]))
    assert diff.max() <= 1


def test_generate_refuses_an_image_for_a_model_without_image_to_video():
    out = cli_here(["generate", "--set", "model=flux-tiny", "--image", str(REPO / "README.md")])
    assert out.returncode == 2, out.stderr[-2000:]
    assert (
        "generation.image: image-to-video needs a model whose family has an image-to-video pipeline on the same "
        "transformer (Wan 2.2 TI2V: WanImageToVideoPipeline); flux-tiny is a FluxPipeline model"
    ) in out.stderr


def test_serve_refuses_a_video_model_before_loading_it():
    """xfuse serve answers the OpenAI Images API: a video model is refused at start-up, by name, exit 2, before the
    port is bound or any weights load."""
    cmd = [sys.executable, "-m", "xfuse", "serve", "--config", CONFIG, "--set", "parallel.pipefusion_degree=1",
           "--port", "0"]  # fmt: skip
    out = _run(cmd, {}, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert (
        "xfuse serve: rank 0: error: model: wan-tiny is a video model (WanPipeline); xfuse serve answers the OpenAI "
        "Images API only: use xfuse generate for clips (got 'wan-tiny')"
    ) in out.stderr
    assert "listening" not in out.stdout
