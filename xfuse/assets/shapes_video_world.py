"""The ``shapes-video`` world: captioned clips of one coloured shape moving across a plain background, drawn in code,
every attribute known by construction (the video sibling of ``shapes_world``).

Used to train the shipped ``shapes-video`` model (``scripts/train_video.py``: a Wan VAE, a Wan transformer and the
attribute classifier that scores generated clips), and by ``benchmarks/quality_video.py`` and the tests to turn
"does the clip follow the prompt" into numbers. Grammar::

    a {red|green|blue|yellow} {circle|square|triangle} moving {to the right|to the left|up|down}
    on a {white|black} background

A clip is ``FRAMES`` frames of ``SIZE`` px: the shape crosses the middle half of the frame along its direction, at a
random height (or column) in the middle 40 %, at constant speed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from xfuse.assets.shapes_world import BACKGROUNDS, COLORS, SHAPES

DIRECTIONS = {  # phrase -> the shape's step per frame in (x, y), as fractions of the side over the whole clip
    "to the right": (1, 0),
    "to the left": (-1, 0),
    "up": (0, -1),
    "down": (0, 1),
}
ATTRIBUTES = {
    "color": tuple(COLORS),
    "shape": SHAPES,
    "background": tuple(BACKGROUNDS),
    "direction": tuple(DIRECTIONS),
}
# Every word of the grammar: the model's tokenizer holds each as one token (``extra_words`` of the Wan preset builder).
VOCABULARY = tuple(
    dict.fromkeys(" ".join(["a moving on background", *COLORS, *SHAPES, *BACKGROUNDS, *DIRECTIONS]).split())
)
SIZE = 64  # pixels: an 8 x 8 latent at the VAE's factor 8, i.e. 4 x 4 tokens at patch size 2
FRAMES = 13  # 1 + 4 x 3: four latent frames at the VAE's temporal factor 4 (temporal patches of M = 2 and 4)
TRAVEL = 0.5  # the shape's path along its direction, as a fraction of the side (from 0.25 to 0.75)
# How the model is sampled when scored (benchmarks/quality_video.py, tests/launch/test_shapes_video.py).
SCORING_CALL = {"height": SIZE, "width": SIZE, "num_frames": FRAMES, "num_inference_steps": 20, "guidance_scale": 5.0}


@dataclass(frozen=True)
class Clip:
    color: str
    shape: str
    background: str
    direction: str

    @property
    def caption(self) -> str:
        return f"a {self.color} {self.shape} moving {self.direction} on a {self.background} background"

    def labels(self) -> dict[str, int]:
        return {name: values.index(getattr(self, name)) for name, values in ATTRIBUTES.items()}


def random_clip(rng: random.Random) -> Clip:
    color, shape = rng.choice(tuple(COLORS)), rng.choice(SHAPES)
    return Clip(color, shape, rng.choice(tuple(BACKGROUNDS)), rng.choice(tuple(DIRECTIONS)))


def render(clip: Clip, rng: random.Random, frames: int = FRAMES, size: int = SIZE) -> list:
    """``frames`` PIL images of ``clip``: the shape 28-36 % of the side, its path jittered by up to 5 % of the side."""
    from PIL import Image, ImageDraw

    dx, dy = DIRECTIONS[clip.direction]
    across = rng.uniform(0.3, 0.7)  # the coordinate the motion does not change
    start = 0.5 - TRAVEL / 2 + rng.uniform(-0.05, 0.05)
    r = rng.uniform(0.14, 0.18) * size  # half the side of the shape's box
    fill = COLORS[clip.color]
    images = []
    for frame in range(frames):
        along = start + TRAVEL * frame / (frames - 1)  # 0.25 -> 0.75 (about), in the direction of motion
        fx = (along if dx > 0 else 1 - along) if dx else across
        fy = (along if dy > 0 else 1 - along) if dy else across
        cx, cy = fx * size, fy * size
        image = Image.new("RGB", (size, size), BACKGROUNDS[clip.background])
        draw = ImageDraw.Draw(image)
        if clip.shape == "circle":
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
        elif clip.shape == "square":
            draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
        else:  # an upright triangle in the same box
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
        images.append(image)
    return images


def classifier():
    """The attribute classifier's network (untrained): the first, middle and last frames stacked as channels, 4
    strided convolutions, one head per attribute. ``forward(clips in [-1, 1], (B, 3, T, H, W))`` returns
    ``{attribute: logits (B, n)}``."""
    from torch import nn

    class ClipClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            layers, width = [], 9
            for out in (32, 64, 64, 64):
                layers += [nn.Conv2d(width, out, 3, stride=2, padding=1), nn.GroupNorm(4, out), nn.SiLU()]
                width = out
            self.features = nn.Sequential(*layers)  # (B, 9, 64, 64) -> (B, 64, 4, 4)
            self.heads = nn.ModuleDict({name: nn.Linear(64 * 4 * 4, len(v)) for name, v in ATTRIBUTES.items()})

        def forward(self, clips):
            frames = clips.shape[2]
            picked = clips[:, :, [0, frames // 2, frames - 1]]  # (B, 3, T, H, W) -> (B, 3, 3, H, W)
            stacked = picked.transpose(1, 2).flatten(1, 2)  # (B, 3, 3, H, W) -> (B, 3 frames x 3 channels, H, W)
            small = nn.functional.interpolate(stacked, size=(64, 64), mode="area")  # -> (B, 9, 64, 64)
            features = self.features(small).flatten(1)  # (B, 64, 4, 4) -> (B, 1024)
            return {name: head(features) for name, head in self.heads.items()}

    return ClipClassifier()


def to_tensor(clips: list[list]):
    """Clips (lists of PIL frames, or of (H, W, 3) uint8 arrays) -> a float tensor in [-1, 1], (B, 3, T, H, W)."""
    import numpy as np
    import torch

    array = np.stack([np.stack([np.asarray(frame, dtype=np.float32)[..., :3] for frame in clip]) for clip in clips])
    return torch.from_numpy(array).permute(0, 4, 1, 2, 3).div(127.5).sub(1.0)  # (B, T, H, W, 3) -> (B, 3, T, H, W)


def load_classifier(folder: str | None = None):
    """The trained clip classifier (``attribute_classifier.safetensors`` beside the ``shapes-video`` model)."""
    import os

    from safetensors.torch import load_file

    from xfuse.families.folder import SHIPPED_MODELS

    folder = SHIPPED_MODELS["shapes-video"] if folder is None else folder
    model = classifier()
    model.load_state_dict(load_file(os.path.join(folder, "attribute_classifier.safetensors")))
    return model.eval()


def attribute_hits(model, clips: list[list], scenes: list[Clip]) -> dict[str, list[bool]]:
    """Per attribute, whether the classifier reads each clip as its scene says."""
    import torch

    with torch.no_grad():
        logits = model(to_tensor(clips))
    return {
        name: [values[p] == getattr(s, name) for p, s in zip(logits[name].argmax(dim=1).tolist(), scenes, strict=True)]
        for name, values in ATTRIBUTES.items()
    }


def scoring_clips(count: int = 24) -> list[Clip]:
    """A fixed, balanced set of prompts: every colour x direction once per 16, backgrounds alternating within each
    colour, shapes cycling."""
    colors, directions, backgrounds = tuple(COLORS), tuple(DIRECTIONS), tuple(BACKGROUNDS)
    return [
        Clip(colors[i % 4], SHAPES[i % 3], backgrounds[(i + i // 4) % 2], directions[(i // 4) % 4])
        for i in range(count)
    ]
