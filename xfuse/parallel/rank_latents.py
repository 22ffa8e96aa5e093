"""The latents of one request on the ranks that keep them: the embedding rank's model input, the output rank's
guided noise stepped by the scheduler (per patch after warm-up), and the rows they hand each other.

Only the embedding rank (it turns latent rows into hidden states) and the output rank (output layer and
``scheduler.step``) hold latents; folded, both are pipeline rank 0, linear, the output rank sends the stepped rows
back to rank 0 as the next step's model input, and the final latents at the end. The engine's loop
(``xfuse.parallel.executor``) says when; this file keeps what those two ranks know between tasks.
"""

from __future__ import annotations

import torch

from xfuse.parallel.patch_grid import PatchGrid
from xfuse.parallel.request import DenoiseRequest
from xfuse.parallel.schedule import Schedule, Task
from xfuse.parallel.scheduler_state import PatchStepping
from xfuse.parallel.stage import BatchPart
from xfuse.parallel.stage_plan import StagePlan


def scale_model_input(scheduler, sample: torch.Tensor, t) -> torch.Tensor:
    """``scheduler.scale_model_input`` where the scheduler has one; flow-matching schedulers have none and their
    pipelines (SD3, FLUX) feed the latents as they are."""
    scale = getattr(scheduler, "scale_model_input", None)
    return sample if scale is None else scale(sample, t)


class RankLatents:
    """One request's latents on pipeline rank ``pipe_rank`` (kept per request, so requests never share them)."""

    def __init__(self, request: DenoiseRequest, grid: PatchGrid, schedule: Schedule, plan: StagePlan, pipe_rank: int):
        self.request, self.grid, self.schedule = request, grid, schedule
        self.embeds, self.outputs = pipe_rank == plan.embed_rank, pipe_rank == plan.output_rank
        self.whole = request.latents.clone() if self.embeds or self.outputs else None  # (B, C, H, W)
        self.inputs: dict[tuple, torch.Tensor] = {}  # (step, patch) -> model-input latent rows (embedding rank)
        if self.embeds:  # step 0's input: the whole latent, scaled once (as diffusers does)
            self.inputs[(0, None)] = scale_model_input(request.scheduler, self.own, request.timesteps[0])
        self.part_size = request.model_batch // schedule.batch_parts  # transformer batch rows of a batch part
        self.part_input: torch.Tensor | None = None  # a whole-image step's transformer input, read part by part
        self.head_parts: list[torch.Tensor] = []  # output-layer results of a whole-image step's parts so far
        self.patches: PatchStepping | None = None  # output rank, from the first pipelined step
        if self.outputs:
            # scheduler.step gets host timesteps and the scheduler keeps its own on the host too: schedulers compare
            # and index them (DDPM's previous_timestep, alphas_cumprod[t]), and on a device every such lookup is a
            # host/device synchronisation per patch. One copy per request instead; the math is unchanged (diffusers'
            # step already reads its coefficient tables on the host).
            self.host_timesteps = request.timesteps.cpu()
            steps_table = getattr(request.scheduler, "timesteps", None)
            if isinstance(steps_table, torch.Tensor) and steps_table.device.type != "cpu":
                request.scheduler.timesteps = steps_table.cpu()

    @property
    def own(self) -> torch.Tensor:
        """The whole latent this rank keeps: only the embedding and output ranks keep one (the others never ask)."""
        assert self.whole is not None, "this pipeline rank keeps no latents"
        return self.whole

    def rows(self, patch) -> slice:
        return slice(None) if patch is None else self.grid[patch].latent_rows

    def part(self, part: int) -> BatchPart:
        return BatchPart(part, self.schedule.batch_parts, self.part_size)

    def write_rows(self, patch, rows: torch.Tensor) -> None:
        """Store (B, C, h, W) latent rows of ``patch`` (``None``: the whole latent): only the patch's own pixels
        where a patch cut by cost shares a token row with its neighbour."""
        dest = self.own[:, :, self.rows(patch)]  # (B, C, h, W), a view
        if patch is None:
            dest.copy_(rows)
        else:
            self.grid[patch].copy_pixels(dest, rows)

    # --- the embedding rank ---------------------------------------------------------------------------------------
    def model_input_rows(self, step: int, patch, latent_msgs) -> torch.Tensor:
        """Scaled model-input latent rows of (step, patch): ``latent_msgs`` received from the output rank (linear),
        or kept here."""
        rows = self.rows(patch)
        if latent_msgs:  # linear: received from the output rank
            ((m, tensor),) = latent_msgs
            if m.patch is None and patch is not None:  # a whole latent after warm-up: keep it for the other patches
                self.inputs[(step, None)] = tensor.clone()
                return self.inputs[(step, None)][:, :, rows]
            return tensor
        if (step, patch) in self.inputs:  # this patch's own rows, or a whole-image step's whole latent
            return self.inputs.pop((step, patch))
        whole = self.inputs[(step, None)]  # a whole latent (step 0, or after warm-up) shared by the patches
        if patch == self.grid.num_patches - 1:
            self.inputs.pop((step, None))
        return whole[:, :, rows]

    def transformer_input(self, task: Task, rows: torch.Tensor | None) -> torch.Tensor:
        """The task's rows of the transformer input, from its (B, C, h, W) latent rows (a batch part after the
        first: ``None``, it takes its rows of the input the first part built)."""
        if task.part is None:
            assert rows is not None
            return self.request.model_input(rows, self.rows(task.patch))  # (B, C, h, W) -> (B_model, C, h, W)
        if task.part == 0:
            assert rows is not None
            self.part_input = self.request.model_input(rows, self.rows(task.patch))
        assert self.part_input is not None  # built by part 0, which runs first
        part_rows = self.part_input[self.part(task.part).rows]  # (B_model, ...) -> (part rows, ...)
        if self.schedule.is_last_part(task):
            self.part_input = None
        return part_rows

    # --- the output rank --------------------------------------------------------------------------------------------
    def step(self, task: Task, output: torch.Tensor) -> torch.Tensor | None:
        """Guidance and ``scheduler.step`` on (step, patch)'s output-layer result (B_model or a part's rows,
        C_out, h, W); returns the stepped rows (the rows covering the patch: the scheduler is elementwise, and only
        the patch's own pixels are kept).

        A batch part of a whole-image step is kept; the last part joins the parts' outputs in batch order (the
        [uncond, cond] halves guidance combines) and steps the whole latent. ``None`` until then.
        """
        step, patch, req = task.step, task.patch, self.request
        if task.part is not None:
            self.head_parts.append(output)
            if not self.schedule.is_last_part(task):
                return None
            output = torch.cat(self.head_parts)  # parts in batch order -> (B_model, C_out, H, W)
            self.head_parts = []
        noise = req.guide(output, step, patch)  # (B, C, h, W)
        # The host copy of the timestep: schedulers index their host-side tables with it (a device timestep would
        # make every step copy it to the host: a device synchronisation per patch).
        t = self.host_timesteps[step]
        # A copy, not a view of the latents this rank updates in place: a scheduler may keep the sample it steps
        # (UniPC's corrector reads ``last_sample`` at the next step), as diffusers' loop leaves it untouched.
        sample = self.own[:, :, self.rows(patch)].clone()
        if patch is None:
            return req.scheduler.step(noise, t, sample, **req.extra_step_kwargs, return_dict=False)[0]
        if self.patches is None:  # the first pipelined step: the scheduler's state split per patch
            self.patches = PatchStepping(req.scheduler, req.extra_step_kwargs, req.generator, self.own.shape,
                                         list(self.grid), self.own.device)  # fmt: skip
        return self.patches.step(patch, step, noise, t, sample)

    def route_stepped(self, step: int, patch, stepped: torch.Tensor) -> torch.Tensor:
        """Store the stepped rows; return the next model-input rows (after the last step, the final latent rows)."""
        req, rows = self.request, self.rows(patch)
        self.write_rows(patch, stepped)
        if req.on_step_end is not None and patch in (None, self.grid.num_patches - 1):
            req.on_step_end(step, self.own)
        if step + 1 == len(req.timesteps):
            return self.own[:, :, rows]
        if patch is None:
            scheduler = req.scheduler
        else:
            assert self.patches is not None  # split at the first pipelined step, before any patch stepped
            scheduler = self.patches.schedulers[patch]
        next_rows = scale_model_input(scheduler, stepped, self.host_timesteps[step + 1])
        if self.embeds:  # folded: the next step's input stays here
            self.inputs[(step + 1, patch)] = next_rows
        return next_rows

    def finish(self) -> torch.Tensor | None:
        """End of the request: the scheduler ends where serial diffusers' does; the final latents on the embedding
        rank, ``None`` elsewhere."""
        if self.patches is not None:
            self.patches.merge_into(self.request.scheduler)
        return self.whole if self.embeds else None
