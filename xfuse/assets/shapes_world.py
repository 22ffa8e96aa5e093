"""The ``shapes`` world: captioned images of one coloured shape, drawn in code, every attribute known by construction.

Used to train the shipped ``shapes`` model (``scripts/train_tiny.py``), to train the attribute classifier that scores
generated images, and by ``benchmarks/quality.py`` and the tests to turn "does the image follow the prompt" into
numbers. Grammar::

    a {red|green|blue|yellow} {circle|square|triangle} [{on the left|on the right|at the top|at the bottom|
    in the center}] on a {white|black} background

The position phrase is optional in training captions (the shape is then placed anywhere); scoring prompts always
carry one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

COLORS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (235, 210, 20)}
SHAPES = ("circle", "square", "triangle")
BACKGROUNDS = {"white": (255, 255, 255), "black": (0, 0, 0)}
POSITIONS = {  # phrase -> the shape's centre, as fractions of the image side (x, y)
    "on the left": (0.25, 0.5),
    "on the right": (0.75, 0.5),
    "at the top": (0.5, 0.25),
    "at the bottom": (0.5, 0.75),
    "in the center": (0.5, 0.5),
}
ATTRIBUTES = {
    "color": tuple(COLORS),
    "shape": SHAPES,
    "background": tuple(BACKGROUNDS),
    "position": tuple(POSITIONS),
}
# Every word of the grammar: the shapes models' tokenizers hold each as one token (``extra_words`` of the tiny
# pipelines), instead of spelling the ones the built-in tiny vocabulary lacks letter by letter.
VOCABULARY = tuple(dict.fromkeys(" ".join(["a on the background", *COLORS, *SHAPES, *BACKGROUNDS, *POSITIONS]).split()))
IMAGE_SIZE = 256  # pixels: a 32x32 latent at the VAE's factor 8, i.e. 16 token rows at patch size 2
# How the shapes models are sampled when scored (benchmarks/quality.py, tests/launch/test_shapes.py): call arguments.
SCORING_CALL = {
    "height": IMAGE_SIZE,
    "width": IMAGE_SIZE,
    "num_inference_steps": 20,
    "guidance_scale": 5.0,
    "use_resolution_binning": False,  # the trained size (binning would pick one of HunyuanDiT's ~1 MP sizes)
}


@dataclass(frozen=True)
class Scene:
    color: str
    shape: str
    background: str
    position: str
    say_position: bool = True  # whether the caption names the position

    @property
    def caption(self) -> str:
        where = f" {self.position}" if self.say_position else ""
        return f"a {self.color} {self.shape}{where} on a {self.background} background"

    def labels(self) -> dict[str, int]:
        return {name: values.index(getattr(self, name)) for name, values in ATTRIBUTES.items()}


def random_scene(rng: random.Random, say_position_p: float = 0.75) -> Scene:
    return Scene(
        rng.choice(tuple(COLORS)),
        rng.choice(SHAPES),
        rng.choice(tuple(BACKGROUNDS)),
        rng.choice(tuple(POSITIONS)),
        rng.random() < say_position_p,
    )


def render(scene: Scene, rng: random.Random, size: int = IMAGE_SIZE):
    """A PIL image of ``scene``: the shape 30-40 % of the side, its centre jittered by up to 5 % of the side."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), BACKGROUNDS[scene.background])
    draw = ImageDraw.Draw(image)
    fx, fy = POSITIONS[scene.position]
    cx = (fx + rng.uniform(-0.05, 0.05)) * size
    cy = (fy + rng.uniform(-0.05, 0.05)) * size
    r = rng.uniform(0.15, 0.2) * size  # half the side of the shape's box
    fill = COLORS[scene.color]
    if scene.shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif scene.shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:  # an upright triangle in the same box
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return image


def classifier():
    """The attribute classifier's network (untrained): 4 strided convolutions on a 64x64 view, one head per
    attribute. ``forward(images in [-1, 1], (B, 3, H, W))`` returns ``{attribute: logits (B, n)}``."""
    from torch import nn

    class AttributeClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            layers, width = [], 3
            for out in (16, 32, 64, 64):
                layers += [nn.Conv2d(width, out, 3, stride=2, padding=1), nn.GroupNorm(4, out), nn.SiLU()]
                width = out
            self.features = nn.Sequential(*layers)  # (B, 3, 64, 64) -> (B, 64, 4, 4)
            self.heads = nn.ModuleDict({name: nn.Linear(64 * 4 * 4, len(v)) for name, v in ATTRIBUTES.items()})

        def forward(self, images):
            small = nn.functional.interpolate(images, size=(64, 64), mode="area")  # (B, 3, H, W) -> (B, 3, 64, 64)
            features = self.features(small).flatten(1)  # (B, 64, 4, 4) -> (B, 1024)
            return {name: head(features) for name, head in self.heads.items()}

    return AttributeClassifier()


def to_tensor(images):
    """PIL images -> a float tensor in [-1, 1], (B, 3, H, W)."""
    import numpy as np
    import torch

    array = np.stack([np.asarray(image.convert("RGB"), dtype=np.float32) for image in images])  # (B, H, W, 3)
    return torch.from_numpy(array).permute(0, 3, 1, 2).div(127.5).sub(1.0)  # (B, H, W, 3) -> (B, 3, H, W)


def load_classifier(folder: str | None = None):
    """The trained attribute classifier (``attribute_classifier.safetensors``): by default the shipped one, beside
    the ``shapes`` model (it scores both shapes models: they share the VAE whose output it was trained to read)."""
    import os

    from safetensors.torch import load_file

    from xfuse.families.folder import SHIPPED_MODELS

    folder = SHIPPED_MODELS["shapes"] if folder is None else folder
    model = classifier()
    model.load_state_dict(load_file(os.path.join(folder, "attribute_classifier.safetensors")))
    return model.eval()


def attribute_hits(model, images, scenes: list[Scene]) -> dict[str, list[bool]]:
    """Per attribute, whether the classifier reads each image as its scene says (positions only where named)."""
    import torch

    with torch.no_grad():
        logits = model(to_tensor(images))
    hits = {}
    for name, values in ATTRIBUTES.items():
        predicted = logits[name].argmax(dim=1).tolist()
        hits[name] = [
            values[p] == getattr(s, name)
            for p, s in zip(predicted, scenes, strict=True)
            if name != "position" or s.say_position
        ]
    return hits


def scoring_scenes(count: int = 24) -> list[Scene]:
    """A fixed, balanced set of prompts: every colour x shape x background once, positions cycling."""
    combos = [(c, s, b) for c in COLORS for s in SHAPES for b in BACKGROUNDS]
    positions = tuple(POSITIONS)
    return [Scene(c, s, b, positions[i % len(positions)]) for i, (c, s, b) in enumerate(combos[:count])]
