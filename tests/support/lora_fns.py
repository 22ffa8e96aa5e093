"""LoRA files built offline with PEFT on the tiny presets (saved as diffusers saves them), the sequence of LoRA calls
the tests run on xfuse's pipelines and on diffusers' alike, and the share of a file each rank should keep."""

import copy

import torch

from tests.support.pipeline_fns import as_array

# What each adapter adapts: attention projections of every block (FLUX: the single blocks' too), and for the first
# adapter also the CLIP text encoder's attention (loaded on rank 0 only).
TRANSFORMER_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]


def save_lora(pipe, folder, *, seed, rank, alpha, text_encoder=False) -> str:
    """A random LoRA of ``pipe``'s transformer (and CLIP text encoder), rank ``rank`` with ``lora_alpha`` ``alpha``
    (not ``rank``: the scaling comes from the file's metadata), saved with the diffusers pipeline's own
    ``save_lora_weights``; returns ``folder``."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    torch.manual_seed(seed)
    kwargs = {}
    parts = [("transformer", pipe.transformer, TRANSFORMER_TARGETS)]
    if text_encoder:
        parts.append(("text_encoder", pipe.text_encoder, TEXT_TARGETS))
    for name, model, targets in parts:
        model = copy.deepcopy(model)
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
        inject_adapter_in_model(config, model)  # PEFT itself (transformers' add_adapter may want a newer PEFT)
        with torch.no_grad():  # PEFT's random init, scaled down: a visible but sane change of the output
            for key, param in model.named_parameters():
                if "lora_B" in key:
                    param.mul_(0.05)
        kwargs[f"{name}_lora_layers"] = get_peft_model_state_dict(model)
        kwargs[f"{name}_lora_adapter_metadata"] = config.to_dict()
    type(pipe).save_lora_weights(str(folder), **kwargs)
    return str(folder)


def lora_steps(pipe, call, lora_a, lora_b, after_load=None):
    """The LoRA API in order, one ``pipe(**call)`` after each: load ``a``; load ``b``; both with weights; fused;
    unfused; disabled; enabled with ``a`` deleted; ``b`` fused; unloaded (``b`` staying fused). Returns [(step, images
    or None, active adapters)] for xfuse's pipelines and diffusers' alike (``call`` has ``seed``). ``after_load()``:
    called after each load."""
    call = dict(call)
    seed = call.pop("seed")
    out = []

    def run(step):
        images = pipe(**call, generator=torch.Generator().manual_seed(seed))
        out.append((step, None if images is None else as_array(images), list(pipe.get_active_adapters())))

    for name, lora in (("a", lora_a), ("b", lora_b)):
        pipe.load_lora_weights(lora, adapter_name=name)
        if after_load is not None:
            after_load()
        run(name)
    pipe.set_adapters(["a", "b"], adapter_weights=[0.7, 0.4])
    run("a 0.7 + b 0.4")
    pipe.fuse_lora()
    run("fused")
    pipe.unfuse_lora()
    run("unfused")
    pipe.disable_lora()
    run("disabled")
    pipe.enable_lora()
    pipe.delete_adapters("a")
    run("a deleted")
    pipe.fuse_lora()
    run("b fused")
    pipe.unload_lora_weights()  # the fused weights stay: only an unfused adapter is undone by unloading
    run("b fused, unloaded")
    return out


def xfuse_lora_steps(folder, family, parallel, call, lora_a, lora_b):
    """Rank function: ``lora_steps`` on the family's xfuse pipeline loaded from ``folder`` with ``parallel``; every rank
    also returns the adapter weights it held after each load (``lora_parameter_count``)."""
    from xfuse.families.registry import MODEL_SPECS

    pipe = MODEL_SPECS[family].pipeline_class().from_pretrained(folder, parallel=parallel, comm={"timeout_s": 60})
    pipe.set_progress_bar_config(disable=True)
    held = []
    steps = lora_steps(pipe, call, lora_a, lora_b, after_load=lambda: held.append(pipe.lora_parameter_count()))
    context = pipe.context
    return dict(steps=steps, held=held, final=pipe.lora_parameter_count(), rank=context.rank, cfg_rank=context.cfg_rank,
                sp_rank=context.sp_rank, blocks=list(pipe.plan.blocks_of(context.pipe_rank)))  # fmt: skip


def refused_lora(folder, family, parallel, bad_files):
    """Rank function: every rank loads each bad file; returns each refusal's (type, message), then proves the world
    still works (a call after the refusals)."""
    from xfuse.families.registry import MODEL_SPECS

    pipe = MODEL_SPECS[family].pipeline_class().from_pretrained(folder, parallel=parallel, comm={"timeout_s": 60})
    pipe.set_progress_bar_config(disable=True)
    refusals = []
    for path in bad_files:
        try:
            pipe.load_lora_weights(path, adapter_name="bad")
            refusals.append(("loaded", ""))
        except Exception as err:  # noqa: BLE001 - the test compares every rank's refusal
            refusals.append((type(err).__name__, str(err)))
    out = pipe(prompt="a cat", num_inference_steps=2, height=64, width=64, output_type="latent",
               generator=torch.Generator().manual_seed(0))  # fmt: skip
    return refusals, out is None or out.images.shape[0] == 1, pipe.lora_parameter_count()


def expert_steps(pipe, call, lora_a, lora_b):
    """Wan 2.2's two experts: ``a`` into the first (high-noise) expert, ``b`` into the second with
    ``load_into_transformer_2``; the images after each load and with both weighted. Returns
    [(step, images or None, the adapters by component)]."""
    call = dict(call)
    seed = call.pop("seed")
    out = []

    def run(step):
        images = pipe(**call, generator=torch.Generator().manual_seed(seed))
        out.append((step, None if images is None else as_array(images), pipe.get_list_adapters()))

    pipe.load_lora_weights(lora_a, adapter_name="a")
    run("a in transformer")
    pipe.load_lora_weights(lora_b, adapter_name="b", load_into_transformer_2=True)
    run("b in transformer_2")
    pipe.set_adapters(["a", "b"], adapter_weights=[0.5, 2.0])
    run("a 0.5 + b 2.0")
    return out


def xfuse_expert_steps(folder, parallel, call, lora_a, lora_b):
    """Rank function: ``expert_steps`` on ``PipeFusionWanPipeline`` from ``folder`` (two experts)."""
    from xfuse.families.registry import MODEL_SPECS

    pipe = MODEL_SPECS["wan"].pipeline_class().from_pretrained(folder, parallel=parallel, comm={"timeout_s": 60})
    pipe.set_progress_bar_config(disable=True)
    return expert_steps(pipe, call, lora_a, lora_b)
