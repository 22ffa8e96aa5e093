"""Train the shipped ``shapes-video`` model on this CPU: a clip classifier, a Wan VAE and a Wan transformer.

    python scripts/train_video.py --latent-channels 16 --vae-steps 1000 --steps 0 --out /tmp/vae16   # classifier, VAE
    python scripts/train_video.py --vae-from /tmp/vae16 --vae-finetune --vae-steps 600 --vae-lr 3e-4 \
        --vae-critic-loss 0.2 --vae-critic-attributes shape --latent-channels 16 --steps 0 --out /tmp/vae16s
    python scripts/train_video.py --vae-from /tmp/vae16s --vae-finetune --vae-steps 600 --vae-lr 2e-4 \
        --vae-critic-loss 0.1 --latent-channels 16 --head-dim 32 --ffn-dim 512 --steps 8000 --out /tmp/video16c
    python scripts/train_video.py --vae-from /tmp/video16c --vae-finetune --vae-steps 800 --vae-lr 2e-4 \
        --vae-critic-loss 0.2 --latent-channels 16 --head-dim 32 --ffn-dim 512 --transformer-from /tmp/video16c \
        --lr 3e-4 --warmup 100 --steps 5000 --out /tmp/video16d
    python scripts/train_video.py --vae-from /tmp/video16d --latent-channels 16 --head-dim 32 --ffn-dim 512 \
        --transformer-from /tmp/video16d --lr 2e-4 --warmup 100 --steps 3000 --shape-weight 3   # the shipped folder
    python scripts/train_video.py --quick        # a few steps of each stage, to check the script runs

The shipped folder is the fifth command's (its ``train_log.jsonl``: the five runs' lines; docs/models.md has what
each reached). The defaults are the first, 4-channel weights' (2026-11-27): ``--steps 3000``, then ``--vae-from``
that folder with ``--steps 8000``.

Stages (each logged with its time and losses, seed fixed), on clips of ``xfuse.assets.shapes_video_world`` (13
frames of 64 px: a coloured shape crossing a plain background in the captioned direction):

1. the attribute classifier (colour, shape, background, direction) on rendered clips, lightly blurred and noised so
   it also reads decoded ones;
2. an ``AutoencoderKLWan`` of Wan 2.1's layout (8x spatial and 4x temporal compression, causal 3-D convolutions,
   ``wan-tiny``'s levels at base width 8, 4 latent channels) on whole clips: 13 frames -> 4 latent frames of 8 x 8,
   an autoencoder on the posterior's mean with the shape's pixels weighted 10x (``train_vae`` says why);
   then its ``latents_mean`` / ``latents_std`` per channel from the training clips' latents (what ``WanPipeline``
   normalises with);
3. the transformer (``WanTransformer3DModel``, 4 blocks of 4 heads x 16): every training clip encoded once, its
   caption encoded by the frozen tiny UMT5 encoder exactly as ``WanPipeline.encode_prompt`` does; flow matching
   (the ``flow_prediction`` of the folder's UniPC scheduler: the model predicts noise - clip) at the scheduler's own
   shifted sigmas, 10 % of captions replaced by the empty prompt (``WanPipeline``'s negative prompt for guidance).

After the VAE is trained (or taken with ``--vae-from``) its round trips of the 24 scoring prompts are classified
(``"recon_accuracy"``): what any transformer's clips on it can at best be read as (the shipped VAE: colour 75 %,
shape 33.3 %). ``--transformer-from`` continues a trained transformer; ``--lr``, ``--warmup``, ``--empty-captions``
and ``--shape-weight`` (the loss weighted where the shape is on the latent grid) default to the shipped run's
settings; ``--latents-cache`` keeps the encoded training clips in a file for the next run with the same VAE.

Never run by CI: the shipped weights are its output. The tokenizer holds every word of the captions' grammar as one
token (``shapes_video_world.VOCABULARY``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import torch
from torch import nn

from xfuse.assets import shapes_video_world as world
from xfuse.families.wan.presets import build_preset_pipeline

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "xfuse", "assets", "shapes-video")
TRANSFORMER = dict(num_layers=4, num_attention_heads=4, attention_head_dim=16, ffn_dim=256)  # in 4 latent channels
VAE = dict(base_dim=8)  # wan-tiny's levels (dim_mult 1, 2, 4, 4; one residual block each) twice as wide
FLOW_SHIFT = 3.0  # the folder's UniPC scheduler's (wan-tiny's, as Wan 2.1's 480p release)


def log(record: dict) -> None:
    print(json.dumps(record), flush=True)


def clips_and_tensor(n: int, seed: int):
    rng = random.Random(seed)
    clips = [world.random_clip(rng) for _ in range(n)]
    return clips, world.to_tensor([world.render(clip, rng) for clip in clips])  # (n, 3, 13, 64, 64)


def degrade(clips: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """What a VAE does to flat shapes, roughly: soft edges per frame and a little noise."""
    b, c, t, h, w = clips.shape
    frames = clips.transpose(1, 2).reshape(b * t, c, h, w)  # (B, 3, T, H, W) -> (B T, 3, H, W)
    blurred = nn.functional.avg_pool2d(frames, 3, stride=1, padding=1, count_include_pad=False)
    blurred = blurred.reshape(b, t, c, h, w).transpose(1, 2)  # (B T, 3, H, W) -> (B, 3, T, H, W)
    return blurred + 0.05 * torch.randn(clips.shape, generator=generator)


def train_classifier(steps: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model, generator = world.classifier(), torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    start = time.time()
    for step in range(steps):
        clips, tensor = clips_and_tensor(32, seed * 100_000 + step)
        logits = model(degrade(tensor, generator))
        labels = {name: torch.tensor([c.labels()[name] for c in clips]) for name in world.ATTRIBUTES}
        loss = sum(nn.functional.cross_entropy(logits[name], labels[name]) for name in world.ATTRIBUTES)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            log({"stage": "classifier", "step": step, "loss": round(loss.item(), 4), "s": round(time.time() - start)})
    return model.eval()


def train_vae(
    vae,
    steps: int,
    batch: int,
    seed: int,
    classifier: nn.Module | None = None,
    lr: float = 2e-3,
    critic: nn.Module | None = None,
    critic_loss: float = 0.0,
    critic_attributes: tuple[str, ...] = tuple(world.ATTRIBUTES),
):
    """An autoencoder on the posterior's mean (what the transformer is trained on and the pipeline decodes), the
    shape's pixels weighted 10x: with plain MSE the VAE settles on the background alone (MSE 0.10-0.15 for 600 steps:
    the shape is ~8 % of a frame). Pixels alone leave the shape a blob (a circle, square and triangle of 2-3 latent
    cells differ in a few edge pixels), so ``critic_loss`` adds that weight times the cross-entropy of ``critic``'s
    reading of the decoded clips, summed over ``critic_attributes`` (a shape term alone bought shape with motion:
    round trips read direction 83 % instead of 100 %): a perceptual term from a classifier trained apart (another seed)
    from the one that scores the round trips, so the score is not the loss."""
    torch.manual_seed(seed)
    vae.train()
    optimizer = torch.optim.AdamW(vae.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    start = time.time()
    for step in range(steps):
        scenes, clips = clips_and_tensor(batch, seed * 100_000 + 50_000 + step)
        recon = vae.decode(vae.encode(clips).latent_dist.mode()).sample  # (B, 3, 13, 64, 64)
        error = (recon - clips) ** 2
        # the shape: pixels away from the background (the top-left pixel of the first frame, never the shape's)
        shape = (clips - clips[:, :, :1, :1, :1]).abs().sum(dim=1, keepdim=True) > 0.1  # (B, 1, 13, 64, 64)
        loss = pixels = (error * (1 + 9 * shape)).mean()
        if critic is not None and critic_loss:
            read = critic(recon)
            for name in critic_attributes:
                labels = torch.tensor([scene.labels()[name] for scene in scenes])
                loss = loss + critic_loss * nn.functional.cross_entropy(read[name], labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 25 == 0 or step == steps - 1:
            log({"stage": "vae", "step": step, "loss": round(loss.item(), 5), "pixels": round(pixels.item(), 5),
                 "mse": round(error.mean().item(), 5), "s": round(time.time() - start)})  # fmt: skip
        if classifier is not None and step % 250 == 249:  # how far the round trips read, while it trains
            log({"stage": "vae", "step": step, "recon_accuracy": reconstruction_accuracy(vae.eval(), classifier, seed)})
            vae.train()
    return vae.eval()


@torch.no_grad()
def reconstruction_accuracy(vae, classifier, seed: int) -> dict:
    """The classifier's accuracy (%) per attribute on VAE round trips of the 24 scoring prompts, rendered."""
    rng = random.Random(seed * 100_000 + 70_000)
    scenes = world.scoring_clips(24)
    clips = world.to_tensor([world.render(clip, rng) for clip in scenes])
    recon = torch.cat([vae.decode(vae.encode(clips[i:i + 8]).latent_dist.mode()).sample.clamp(-1, 1)
                       for i in range(0, len(clips), 8)])  # fmt: skip
    logits = classifier(recon)
    accuracy = {}
    for name, values in world.ATTRIBUTES.items():
        read = logits[name].argmax(dim=1).tolist()
        hits = sum(values[p] == getattr(s, name) for p, s in zip(read, scenes, strict=True))
        accuracy[name] = round(100 * hits / len(scenes), 1)
    return accuracy


@torch.no_grad()
def encode_clips(vae, n_clips: int, seed: int, fit_statistics: bool, cache: str | None = None):
    """``n_clips`` training clips, their latents normalised as ``WanPipeline`` reads them, by the VAE's
    ``latents_mean`` / ``latents_std`` (first fitted per channel to these latents, for a VAE trained in this run), and
    where the shape is on the latent grid (B, 1, 4, 8, 8): a latent pixel whose 8 x 8 px of any of its frames (the
    first frame alone, then 4 by 4) show the shape. ``cache``: a file holding them for this VAE's encoder, read if it
    exists, else written (the same clips: encoding is most of a short run's time on 2 cores)."""
    if cache and os.path.exists(cache):
        saved = torch.load(cache)
        clips, latents, masks = [world.Clip(*c) for c in saved["clips"]], saved["latents"], saved["masks"]
        log({"stage": "latents", "cache": cache, "clips": len(clips)})
    else:
        clips, latents, masks = [], [], []
        for chunk in range(0, n_clips, 32):
            chunk_clips, tensor = clips_and_tensor(min(32, n_clips - chunk), seed * 100_000 + 90_000 + chunk)
            clips += chunk_clips
            latents.append(vae.encode(tensor).latent_dist.mean)  # (b, 3, 13, 64, 64) -> (b, 4, 4, 8, 8)
            shape = ((tensor - tensor[:, :, :1, :1, :1]).abs().sum(dim=1, keepdim=True) > 0.1).float()
            shape = torch.cat([shape[:, :, :1].repeat(1, 1, 4, 1, 1), shape[:, :, 1:]], dim=2)  # 13 -> 16 frames
            masks.append(nn.functional.max_pool3d(shape, (4, 8, 8)))  # (b, 1, 16, 64, 64) -> (b, 1, 4, 8, 8)
        latents, masks = torch.cat(latents), torch.cat(masks)
        if cache:
            torch.save({"clips": [(c.color, c.shape, c.background, c.direction) for c in clips], "latents": latents,
                        "masks": masks}, cache)  # fmt: skip
    if fit_statistics:
        vae.register_to_config(latents_mean=[round(v, 5) for v in latents.mean(dim=(0, 2, 3, 4)).tolist()],
                               latents_std=[round(v, 5) for v in latents.std(dim=(0, 2, 3, 4)).tolist()])  # fmt: skip
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)  # per channel
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return clips, (latents - mean) / std, masks  # as WanPipeline's decode undoes: latents / (1 / std) + mean


@torch.no_grad()
def encode_caption(pipe, caption: str) -> torch.Tensor:
    """The prompt embeddings (512, text_dim), as ``WanPipeline.encode_prompt`` gives them (padding zeroed)."""
    embeds, _ = pipe.encode_prompt(caption, do_classifier_free_guidance=False, device="cpu")
    return embeds[0]


def train_transformer(
    pipe,
    vae,
    steps: int,
    n_clips: int,
    batch: int,
    seed: int,
    fit_statistics: bool,
    lr: float = 5e-4,
    warmup: int = 200,
    empty_captions: float = 0.1,
    shape_weight: float = 1.0,
    cache: str | None = None,
):
    """Flow matching on the encoded clips; the loss of a latent pixel where the shape is weighted ``shape_weight``
    times (1: plain MSE)."""
    torch.manual_seed(seed)
    transformer = pipe.transformer
    clips, latents, masks = encode_clips(vae, n_clips, seed, fit_statistics, cache)
    captions = sorted({c.caption for c in clips} | {""})
    text = {caption: encode_caption(pipe, caption) for caption in captions}
    log({"stage": "transformer", "clips": n_clips, "captions": len(captions),
         "latents_mean": vae.config.latents_mean, "latents_std": vae.config.latents_std,
         "parameters": sum(p.numel() for p in transformer.parameters()),
         "prediction_type": pipe.scheduler.config.prediction_type})  # fmt: skip
    transformer.train()
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=0.0)
    # ``warmup`` steps of warm-up, then a cosine to zero
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0))))
    )
    start, generator = time.time(), torch.Generator().manual_seed(seed)
    for step in range(steps):
        index = torch.randint(0, len(clips), (batch,), generator=generator)
        x0 = latents[index]  # (B, 4, 4, 8, 8)
        words = [
            clips[i].caption if torch.rand((), generator=generator) > empty_captions else "" for i in index.tolist()
        ]
        embeds = torch.stack([text[w] for w in words])  # (B, 512, text_dim)
        # the UniPC scheduler's flow sigmas: uniform, then shifted as FlowMatch / UniPC's flow_shift shifts them
        u = torch.rand(batch, generator=generator)
        sigma = FLOW_SHIFT * u / (1 + (FLOW_SHIFT - 1) * u)
        noise = torch.randn(x0.shape, generator=generator)
        s = sigma.view(-1, 1, 1, 1, 1)
        noisy = (1 - s) * x0 + s * noise
        target = noise - x0  # flow_prediction: the scheduler's x0 is sample - sigma * output
        pred = transformer(hidden_states=noisy, timestep=sigma * 1000, encoder_hidden_states=embeds,
                           return_dict=False)[0]  # fmt: skip
        loss = ((pred - target) ** 2 * (1 + (shape_weight - 1) * masks[index])).mean()
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            log({"stage": "transformer", "step": step, "loss": round(loss.item(), 4), "s": round(time.time() - start)})
    return transformer.eval()


def attribute_names(text: str) -> tuple[str, ...]:
    """``--vae-critic-attributes``: comma-separated names of ``shapes_video_world.ATTRIBUTES``, refused before any
    training if one is not."""
    names = tuple(text.split(","))
    unknown = [name for name in names if name not in world.ATTRIBUTES]
    if unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not one of {', '.join(world.ATTRIBUTES)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=OUT, help="the diffusers folder to write")
    parser.add_argument("--vae-from", help="take the VAE (its latents' statistics included) and the classifier of this "
                        "trained folder instead of training them")  # fmt: skip
    parser.add_argument("--classifier-steps", type=int, default=300)
    parser.add_argument("--vae-steps", type=int, default=1000)
    parser.add_argument("--vae-batch", type=int, default=8)
    parser.add_argument("--vae-lr", type=float, default=2e-3, help="the VAE's peak learning rate (then a cosine)")
    parser.add_argument("--vae-finetune", action="store_true", help="train the VAE of --vae-from --vae-steps more "
                        "steps (its latents' statistics fitted again)")  # fmt: skip
    parser.add_argument("--vae-critic-loss", type=float, default=0.0, help="the VAE's loss weight on a critic "
                        "classifier's cross-entropy of the decoded clips (0: pixels alone)")  # fmt: skip
    parser.add_argument("--vae-critic-attributes", type=attribute_names, default=tuple(world.ATTRIBUTES),
                        help="the attributes the critic's term reads, comma-separated (default: all)")  # fmt: skip
    parser.add_argument("--critic-steps", type=int, default=1000, help="the critic classifier's steps (seed + 1)")
    parser.add_argument("--latent-channels", type=int, default=4, help="the VAE's z_dim (the transformer's channels)")
    parser.add_argument("--steps", type=int, default=3000, help="transformer steps (0: keep the transformer)")
    parser.add_argument("--clips", type=int, default=2000, help="clips encoded for the transformer")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-4, help="the transformer's peak learning rate")
    parser.add_argument("--warmup", type=int, default=200, help="the transformer's warm-up steps (then a cosine)")
    parser.add_argument("--empty-captions", type=float, default=0.1, help="the share of empty captions (guidance)")
    parser.add_argument("--shape-weight", type=float, default=1.0, help="the transformer's loss weight on latent "
                        "pixels where the shape is (1: plain MSE)")  # fmt: skip
    parser.add_argument("--latents-cache", help="a file for the encoded training clips (read if it exists)")
    parser.add_argument("--transformer-from", help="start the transformer from this trained folder's weights")
    parser.add_argument("--head-dim", type=int, default=TRANSFORMER["attention_head_dim"], help="the transformer's "
                        "attention head width (4 heads)")  # fmt: skip
    parser.add_argument("--ffn-dim", type=int, default=TRANSFORMER["ffn_dim"], help="the transformer's MLP width")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a few steps of each stage")
    args = parser.parse_args()
    if args.quick:
        args.classifier_steps, args.critic_steps, args.vae_steps, args.steps, args.clips, args.batch = 3, 3, 3, 3, 64, 4
    torch.set_num_threads(args.threads)
    start = time.time()
    log({"stage": "start", **vars(args), "torch": torch.__version__})
    layout = {**TRANSFORMER, "attention_head_dim": args.head_dim, "ffn_dim": args.ffn_dim}
    pipe = build_preset_pipeline("wan-tiny", args.seed, extra_words=world.VOCABULARY, vae_overrides=VAE,
                                 in_channels=args.latent_channels, **layout)  # fmt: skip
    from safetensors.torch import save_file

    critic = None
    if args.vae_critic_loss:
        critic = train_classifier(args.critic_steps, args.seed + 1).requires_grad_(False)
    if args.vae_from:
        from diffusers import AutoencoderKLWan

        classifier = world.load_classifier(args.vae_from)
        vae = AutoencoderKLWan.from_pretrained(args.vae_from, subfolder="vae").eval()
        if args.vae_finetune:
            vae = train_vae(vae, args.vae_steps, args.vae_batch, args.seed + 1, classifier, args.vae_lr, critic,
                            args.vae_critic_loss, args.vae_critic_attributes)  # fmt: skip
        pipe.register_modules(vae=vae)
    else:
        classifier = train_classifier(args.classifier_steps, args.seed)
        vae = train_vae(pipe.vae, args.vae_steps, args.vae_batch, args.seed, classifier, args.vae_lr, critic,
                        args.vae_critic_loss, args.vae_critic_attributes)  # fmt: skip
    if args.transformer_from:
        from diffusers import WanTransformer3DModel

        transformer = WanTransformer3DModel.from_pretrained(args.transformer_from, subfolder="transformer").eval()
        pipe.register_modules(transformer=transformer)
    # what any transformer's clips can at best be read as: the classifier on the VAE's round trips of the scoring
    # prompts, rendered (shipped VAE: colour 75 %, shape 33.3 %, background and direction 100 %)
    log({"stage": "vae", "recon_accuracy": reconstruction_accuracy(vae, classifier, args.seed)})
    if args.steps:
        train_transformer(
            pipe,
            vae,
            args.steps,
            args.clips,
            args.batch,
            args.seed,
            lr=args.lr,
            warmup=args.warmup,
            empty_captions=args.empty_captions,
            shape_weight=args.shape_weight,
            fit_statistics=not args.vae_from or args.vae_finetune,
            cache=args.latents_cache,
        )
    elif not args.vae_from or args.vae_finetune:  # a new VAE's latents' statistics, without training a transformer
        encode_clips(vae, args.clips, args.seed, fit_statistics=True, cache=args.latents_cache)
    os.makedirs(args.out, exist_ok=True)
    pipe.save_pretrained(args.out, safe_serialization=True)
    save_file(classifier.state_dict(), os.path.join(args.out, "attribute_classifier.safetensors"))
    log({"stage": "done", "out": os.path.abspath(args.out), "minutes": round((time.time() - start) / 60, 1)})


if __name__ == "__main__":
    main()
