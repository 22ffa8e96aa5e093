"""Train the shipped ``shapes`` models on this CPU: a VAE, the attribute classifier, and a transformer per family.

    python scripts/train_tiny.py | tee xfuse/assets/shapes/train_log.jsonl     # VAE, classifier, HunyuanDiT
    python scripts/train_tiny.py --family pixart --vae-from xfuse/assets/shapes \
        | tee xfuse/assets/shapes-pixart/train_log.jsonl                        # PixArt-Σ on the same VAE
    python scripts/train_tiny.py --quick         # a few steps of each stage, to check the script runs

Stages (each logged with its time and losses, seed fixed):

1. the attribute classifier on rendered scenes (``xfuse.assets.shapes_world``), lightly blurred and noised so it also
   reads decoded images;
2. a small ``AutoencoderKL`` (four levels: scale factor 8, as both pipelines assume) on 64x64 crops of the scenes
   (it is convolutional: it runs on 256 px afterwards), then its ``scaling_factor`` from the latents' std;
   ``--vae-from`` takes both from an earlier run instead (the two families share one VAE and one classifier);
3. the transformer: every training scene encoded once, its caption encoded by the frozen tiny text encoders exactly
   as the pipeline's ``encode_prompt`` does; v-prediction (what the folder's scheduler is configured for) on the
   pipeline's own training schedule, 10 % of captions replaced by the empty prompt (what the pipeline
   feeds as the negative prompt for guidance).

Never run by CI: the shipped weights are its output. Text encoders and tokenizers are the tiny ones of
``xfuse.families.common.presets`` (random, frozen), sized by the transformer config; PixArt-Σ's tokenizer also holds
every word of the captions' grammar (``shapes.VOCABULARY``) as one token (each family's ``extra_words`` says why).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import time

import torch
from torch import nn

from xfuse.assets import shapes_world as shapes
from xfuse.families.hunyuandit.presets import build_tiny_pipeline

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "xfuse", "assets")


def log(record: dict) -> None:
    print(json.dumps(record), flush=True)


def scenes_and_images(n: int, seed: int, size: int = shapes.IMAGE_SIZE):
    rng = random.Random(seed)
    scenes = [shapes.random_scene(rng) for _ in range(n)]
    return scenes, shapes.to_tensor([shapes.render(scene, rng, size) for scene in scenes])  # (n, 3, size, size)


def degrade(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """What a VAE does to flat shapes, roughly: soft edges and a little noise."""
    blurred = nn.functional.avg_pool2d(images, 3, stride=1, padding=1, count_include_pad=False)
    return blurred + 0.05 * torch.randn(images.shape, generator=generator)


def train_classifier(steps: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model, generator = shapes.classifier(), torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    start = time.time()
    for step in range(steps):
        scenes, images = scenes_and_images(64, seed * 100_000 + step)
        logits = model(degrade(images, generator))
        labels = {name: torch.tensor([s.labels()[name] for s in scenes]) for name in shapes.ATTRIBUTES}
        loss = sum(nn.functional.cross_entropy(logits[name], labels[name]) for name in shapes.ATTRIBUTES)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            log({"stage": "classifier", "step": step, "loss": round(loss.item(), 4), "s": round(time.time() - start)})
    return model.eval()


def train_vae(steps: int, seed: int):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(16, 32, 64, 64),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=shapes.IMAGE_SIZE,
        force_upcast=False,
    )
    optimizer = torch.optim.AdamW(vae.parameters(), lr=1e-3)
    rng, start = random.Random(seed), time.time()
    for step in range(steps):
        scenes, images = scenes_and_images(16, seed * 100_000 + 50_000 + step)
        crops = []
        for scene, image in zip(scenes, images, strict=True):
            if rng.random() < 0.8:  # around the shape: random crops are mostly background, and colours then fade
                fx, fy = shapes.POSITIONS[scene.position]
                x = int(fx * shapes.IMAGE_SIZE) - 32 + rng.randrange(-40, 41)
                y = int(fy * shapes.IMAGE_SIZE) - 32 + rng.randrange(-40, 41)
            else:
                x, y = rng.randrange(0, 192), rng.randrange(0, 192)
            x, y = min(max(x, 0), 192), min(max(y, 0), 192)
            crops.append(image[:, y : y + 64, x : x + 64])  # (3, 256, 256) -> (3, 64, 64)
        crops = torch.stack(crops)  # (16, 3, 64, 64)
        posterior = vae.encode(crops).latent_dist
        recon = vae.decode(posterior.sample()).sample
        rec_loss = nn.functional.mse_loss(recon, crops)
        kl = posterior.kl().mean()
        loss = rec_loss + 1e-6 * kl
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            log({"stage": "vae", "step": step, "mse": round(rec_loss.item(), 5), "kl": round(kl.item(), 1),
                 "s": round(time.time() - start)})  # fmt: skip
    return vae.eval()


class HunyuanDiTFamily:
    """How the HunyuanDiT transformer is built, fed text and called in training, as its pipeline does."""

    out = os.path.join(ASSETS, "shapes")
    # The built-in tiny vocabulary: the shipped model was trained with it (shape and position words spelled in
    # pieces). A retrain with the grammar's words as whole tokens scored no better (70.8 % vs 76.0 % mean accuracy on
    # the quality benchmark's 24 prompts, within its noise), so the shipped weights stayed.
    extra_words: tuple[str, ...] = ()
    transformer = dict(
        num_layers=8,  # up to degree 4 folded, 8 linear; an 8-block model trains in the time budget
        num_attention_heads=4,
        attention_head_dim=24,
        cross_attention_dim=64,
        cross_attention_dim_t5=64,
        pooled_projection_dim=64,
    )

    def build(self, seed: int):
        return build_tiny_pipeline("tiny", seed, extra_words=self.extra_words, **self.transformer)

    @torch.no_grad()
    def encode(self, pipe, caption: str) -> tuple[torch.Tensor, ...]:
        """(BERT embeddings, mask, T5 embeddings, mask), as HunyuanDiTPipeline.encode_prompt gives them."""
        bert, _, bert_mask, _ = pipe.encode_prompt(
            caption, device="cpu", dtype=torch.float32, num_images_per_prompt=1,
            do_classifier_free_guidance=False, max_sequence_length=77, text_encoder_index=0,
        )  # fmt: skip
        t5, _, t5_mask, _ = pipe.encode_prompt(
            caption, device="cpu", dtype=torch.float32, num_images_per_prompt=1,
            do_classifier_free_guidance=False, max_sequence_length=256, text_encoder_index=1,
        )  # fmt: skip
        return bert[0], bert_mask[0], t5[0], t5_mask[0]

    def forward(self, pipe, noisy: torch.Tensor, t: torch.Tensor, text: tuple[torch.Tensor, ...]) -> torch.Tensor:
        bert, bert_mask, t5, t5_mask = text
        batch = noisy.shape[0]
        return pipe.transformer(
            noisy,
            t.to(noisy.dtype),  # the pipeline passes float timesteps
            encoder_hidden_states=bert,
            text_embedding_mask=bert_mask,
            encoder_hidden_states_t5=t5,
            text_embedding_mask_t5=t5_mask,
            image_meta_size=torch.tensor([[shapes.IMAGE_SIZE] * 4 + [0, 0]] * batch, dtype=torch.float32),
            style=torch.zeros(batch, dtype=torch.long),
            image_rotary_emb=self.rotary_embedding(pipe.transformer, shapes.IMAGE_SIZE),
            return_dict=False,
        )[0]

    @staticmethod
    @functools.cache
    def rotary_embedding(transformer, size: int):
        """Mirrors HunyuanDiTPipeline.__call__ (step 7): the 2D RoPE of a size x size image."""
        from diffusers.models.embeddings import get_2d_rotary_pos_embed
        from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import get_resize_crop_region_for_grid

        grid = size // 8 // transformer.config.patch_size
        base = 512 // 8 // transformer.config.patch_size
        crops = get_resize_crop_region_for_grid((grid, grid), base)
        head_dim = transformer.inner_dim // transformer.num_heads
        return get_2d_rotary_pos_embed(head_dim, crops, (grid, grid), output_type="pt")


class PixArtSigmaFamily:
    """The same for PixArt-Σ: one T5 encoder, AdaLN-single timestep."""

    out = os.path.join(ASSETS, "shapes-pixart")
    extra_words = shapes.VOCABULARY  # every word of the grammar one token
    # the HunyuanDiT model's width and depth, so the two families' figures compare like for like
    transformer = dict(num_layers=8, num_attention_heads=4, attention_head_dim=24, caption_channels=64)

    def build(self, seed: int):
        from diffusers import DPMSolverMultistepScheduler

        from xfuse.families.pixart.presets import build_preset_pipeline

        pipe = build_preset_pipeline("pixart-tiny", seed, extra_words=self.extra_words, **self.transformer)
        # v-prediction, not PixArt-Σ's epsilon: DPM-Solver++ steps on the model's x0 estimate, which epsilon turns
        # into (x - sigma * eps) / alpha; at the first steps alpha ~ 0.006, so a short training's eps error is
        # multiplied ~150x. Trained with epsilon, 2000 steps gave mostly black images (36.5 % mean accuracy, chance
        # ~32 %). The folder's scheduler config carries the choice; PipeFusion keeps the solver's state either way.
        pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config, prediction_type="v_prediction")
        return pipe

    @torch.no_grad()
    def encode(self, pipe, caption: str) -> tuple[torch.Tensor, ...]:
        """(T5 embeddings, mask), as PixArtSigmaPipeline.encode_prompt gives them (300 tokens)."""
        embeds, mask, _, _ = pipe.encode_prompt(caption, do_classifier_free_guidance=False, device="cpu")
        return embeds[0], mask[0]

    def forward(self, pipe, noisy: torch.Tensor, t: torch.Tensor, text: tuple[torch.Tensor, ...]) -> torch.Tensor:
        embeds, mask = text
        return pipe.transformer(
            noisy,
            encoder_hidden_states=embeds,
            encoder_attention_mask=mask,
            timestep=t,
            added_cond_kwargs={"resolution": None, "aspect_ratio": None},  # PixArt-Σ: no micro-conditions
            return_dict=False,
        )[0]


FAMILIES = {"hunyuandit": HunyuanDiTFamily(), "pixart": PixArtSigmaFamily()}


def encode_scenes(vae, n_images: int, seed: int, fit_scaling_factor: bool):
    """``n_images`` training scenes and their latents, scaled by the VAE's scaling_factor (first fitted to give them
    unit std, for a VAE trained in this run)."""
    scenes, latents = [], []
    with torch.no_grad():
        for chunk in range(0, n_images, 64):
            chunk_scenes, images = scenes_and_images(min(64, n_images - chunk), seed * 100_000 + 90_000 + chunk)
            scenes += chunk_scenes
            latents.append(vae.encode(images).latent_dist.mean)  # (b, 3, 256, 256) -> (b, 4, 32, 32)
    latents = torch.cat(latents)
    if fit_scaling_factor:
        vae.register_to_config(scaling_factor=round(1.0 / latents.std().item(), 5))
    return scenes, latents * vae.config.scaling_factor


def train_transformer(family, pipe, vae, steps: int, n_images: int, batch: int, seed: int, fit_scaling_factor: bool):
    torch.manual_seed(seed)
    transformer, scheduler = pipe.transformer, pipe.scheduler
    scenes, latents = encode_scenes(vae, n_images, seed, fit_scaling_factor)
    captions = sorted({s.caption for s in scenes} | {""})
    text = {caption: family.encode(pipe, caption) for caption in captions}
    log({"stage": "transformer", "images": n_images, "captions": len(captions),
         "scaling_factor": vae.config.scaling_factor, "parameters": sum(p.numel() for p in transformer.parameters()),
         "prediction_type": scheduler.config.prediction_type})  # fmt: skip
    alphas = scheduler.alphas_cumprod
    transformer.train()
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=5e-4, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 200))
    start, generator = time.time(), torch.Generator().manual_seed(seed)
    for step in range(steps):
        index = torch.randint(0, len(scenes), (batch,), generator=generator)
        x0 = latents[index]
        words = [scenes[i].caption if torch.rand((), generator=generator) > 0.1 else "" for i in index.tolist()]
        batch_text = tuple(torch.stack(parts) for parts in zip(*(text[w] for w in words), strict=True))
        t = torch.randint(0, scheduler.config.num_train_timesteps, (batch,), generator=generator)
        noise = torch.randn(x0.shape, generator=generator)
        a = alphas[t].sqrt().view(-1, 1, 1, 1)
        s = (1 - alphas[t]).sqrt().view(-1, 1, 1, 1)
        noisy = a * x0 + s * noise
        # what the pipeline's scheduler expects the model to predict
        target = {"v_prediction": a * noise - s * x0, "epsilon": noise}[scheduler.config.prediction_type]
        out = family.forward(pipe, noisy, t, batch_text)
        pred, _ = out.chunk(2, dim=1)  # learned sigma: the first 4 channels are the prediction
        loss = nn.functional.mse_loss(pred, target)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            log({"stage": "transformer", "step": step, "loss": round(loss.item(), 4), "s": round(time.time() - start)})
    return transformer.eval()


def load_trained(folder: str):
    """The VAE (its scaling_factor included) and attribute classifier of an earlier run, to share them."""
    from diffusers import AutoencoderKL

    return shapes.load_classifier(folder), AutoencoderKL.from_pretrained(folder, subfolder="vae").eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="hunyuandit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="the diffusers folder to write (default: the family's shipped folder)")
    parser.add_argument("--vae-from", help="take the VAE and classifier of this trained folder instead of training")
    parser.add_argument("--classifier-steps", type=int, default=300)
    parser.add_argument("--vae-steps", type=int, default=1200)
    parser.add_argument("--steps", type=int, default=2000, help="transformer steps")
    parser.add_argument("--images", type=int, default=3000, help="scenes encoded for the transformer")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a few steps of each stage")
    args = parser.parse_args()
    if args.quick:
        args.classifier_steps, args.vae_steps, args.steps, args.images, args.batch = 3, 3, 3, 64, 4
    family = FAMILIES[args.family]
    args.out = args.out or family.out
    torch.set_num_threads(args.threads)
    start = time.time()
    log({"stage": "start", **vars(args), "torch": torch.__version__})
    if args.vae_from:
        classifier, vae = load_trained(args.vae_from)
    else:
        classifier = train_classifier(args.classifier_steps, args.seed)
        vae = train_vae(args.vae_steps, args.seed)
    pipe = family.build(args.seed)
    pipe.vae = None  # replaced below
    train_transformer(family, pipe, vae, args.steps, args.images, args.batch, args.seed, not args.vae_from)
    pipe.register_modules(vae=vae)
    os.makedirs(args.out, exist_ok=True)
    pipe.save_pretrained(args.out, safe_serialization=True)
    if not args.vae_from:  # the classifier's home is the folder whose run trained it
        from safetensors.torch import save_file

        save_file(classifier.state_dict(), os.path.join(args.out, "attribute_classifier.safetensors"))
    log({"stage": "done", "out": os.path.abspath(args.out), "minutes": round((time.time() - start) / 60, 1)})


if __name__ == "__main__":
    main()
