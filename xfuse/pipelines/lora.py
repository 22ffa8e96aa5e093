"""diffusers' LoRA API on a sharded pipeline, with PEFT underneath as diffusers uses it.

``ShardedLoraMixin`` gives an xfuse pipeline class the methods of its diffusers pipeline's LoRA loader
(``SD3LoraLoaderMixin``, ``FluxLoraLoaderMixin``, ``WanLoraLoaderMixin``): ``load_lora_weights``, ``set_adapters``,
``fuse_lora``,
``unfuse_lora``, ``unload_lora_weights``, ``delete_adapters``, ``disable_lora`` / ``enable_lora``,
``get_active_adapters`` and ``get_list_adapters``. Every rank calls them in the same order with the same arguments
(as it calls the pipeline), and:

* reads the file with the diffusers pipeline's own ``lora_state_dict`` (its format conversions), checks it against
  the whole model (``xfuse.pipelines.lora_share``: the same refusal on every rank, before any weight changes), and
  loads only its share with diffusers' model-level loaders: ``load_lora_adapter`` on its blocks of the transformer
  (or of Wan 2.2's second expert), ``load_lora_into_text_encoder`` on the text encoders where it runs them (global
  rank 0);
* keeps the pipeline's view of the adapters (which exist, for which components, which are active in each) for the
  whole model, so that a rank whose blocks an adapter does not touch answers and refuses as the others do.

The other methods act on this rank's components as diffusers' ``LoraBaseMixin`` acts on a whole pipeline's.
No message is sent: the adapters change only the weights each rank applies to its own blocks.
"""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Iterable
from typing import Any

from torch import nn

from xfuse.pipelines.lora_share import check_lora, linear_shapes, lora_parameters, meta_linear_shapes, share

TRANSFORMER = "transformer"
DENOISERS = (TRANSFORMER, "transformer_2")  # diffusers models (Wan 2.2's second expert too); the rest: text encoders


class ShardedLoraMixin:
    """LoRA for an xfuse pipeline class whose diffusers pipeline has a LoRA loader (module docstring). Put it before
    ``PipeFusionPipelineBase`` in the bases."""

    pipeline: Any
    stage: Any
    spec: Any

    def __init__(self, pipeline, *args, **kwargs):
        # The text encoders' layers, read before ranks other than 0 drop them (from_pipe: every rank has them now).
        self._lora_shapes: dict[str, dict[str, tuple[int, int]]] = {
            name: linear_shapes(module)
            for name in self._loader()._lora_loadable_modules
            if name not in DENOISERS and isinstance(module := getattr(pipeline, name, None), nn.Module)
        }
        super().__init__(pipeline, *args, **kwargs)
        self._lora_adapters: dict[str, tuple[str, ...]] = {}  # adapter -> the components it has weights for
        self._lora_active: dict[str, list[str]] = {}  # component -> its active adapters (the whole model's)
        self._lora_merged: set[str] = set()

    # --- what this rank holds ------------------------------------------------------------------------------------
    @classmethod
    def _loader(cls):
        """The diffusers pipeline class (its LoRA loader's class methods, and ``_lora_loadable_modules``: the
        components it loads LoRA into)."""
        import diffusers

        return getattr(diffusers, cls.diffusers_name())  # type: ignore[attr-defined]

    def _local(self) -> dict[str, nn.Module]:
        """This rank's LoRA-loadable components: its share of the transformer (and of Wan 2.2's second expert), the
        text encoders it runs."""
        out = {TRANSFORMER: self.stage.transformer}
        second = getattr(self, "stage_2", None)
        if second is not None:
            out["transformer_2"] = second.transformer
        for name in self._loader()._lora_loadable_modules:
            module = getattr(self.pipeline, name, None)
            if name not in DENOISERS and isinstance(module, nn.Module):
                out[name] = module
        return out

    def _targets(self) -> dict[str, dict[str, tuple[int, int]]]:
        """Every linear layer of every LoRA-loadable component of the whole model (the same on every rank)."""
        if TRANSFORMER not in self._lora_shapes:
            import diffusers

            model_class = getattr(diffusers, self.spec.diffusers_transformer)
            config = self.stage.transformer.config
            self._lora_shapes[TRANSFORMER] = meta_linear_shapes(lambda: model_class.from_config(config))
            for name in self._loader()._lora_loadable_modules:
                if name not in self._lora_shapes and name not in DENOISERS:
                    self._lora_shapes[name] = self._folder_shapes(name)
        return self._lora_shapes

    def _folder_shapes(self, name: str) -> dict[str, tuple[int, int]]:
        """A text encoder this rank did not load: its layers from the folder's config, on the meta device."""
        import transformers

        from xfuse.families.folder import component_class

        folder = self.pipeline.config.get("_name_or_path")
        class_name = component_class(folder, name) if folder and os.path.isdir(folder) else None
        if class_name is None:
            raise ValueError(f"LoRA: the pipeline's {name} is not loaded here and its folder does not name it")
        config = transformers.AutoConfig.from_pretrained(folder, subfolder=name, local_files_only=True)
        return meta_linear_shapes(lambda: getattr(transformers, class_name)._from_config(config))

    def _held(self, local: dict[str, nn.Module]):
        names = {component: {n for n, _ in module.named_modules()} for component, module in local.items()}
        return lambda component, module: module in names.get(component, ())

    # --- diffusers' LoRA API ---------------------------------------------------------------------------------------
    def load_lora_weights(self, pretrained_model_name_or_path_or_dict, adapter_name: str | None = None, **kwargs):
        r"""
        Load a LoRA (a local file or folder in a format the diffusers pipeline reads, or a state dict) as
        ``adapter_name`` and make it the active adapter, as diffusers' `load_lora_weights` does; every rank keeps the
        weights of its own blocks (and rank 0 those of the text encoders). A file that is not a LoRA of this model is
        refused with the same `ValueError` on every rank before any weight changes.

        Mirrors ``diffusers.loaders.lora_pipeline.SD3LoraLoaderMixin.load_lora_weights``,
        ``diffusers.loaders.lora_pipeline.FluxLoraLoaderMixin.load_lora_weights`` and
        ``diffusers.loaders.lora_pipeline.WanLoraLoaderMixin.load_lora_weights`` (``load_into_transformer_2``), without
        hot swapping, Control LoRA, DoRA or Wan's expansion of a text-to-video LoRA for an image-conditioned
        transformer (whose Wan models xfuse refuses).
        """
        if kwargs.pop("hotswap", False):
            raise ValueError("load_lora_weights: hotswap is not supported on a sharded pipeline")
        low_cpu_mem_usage = kwargs.pop("low_cpu_mem_usage", False)
        # Wan: the file's transformer weights go into the second expert instead (WanLoraLoaderMixin's flag)
        into = "transformer_2" if kwargs.pop("load_into_transformer_2", False) else TRANSFORMER
        loader = self._loader()
        source = pretrained_model_name_or_path_or_dict
        if isinstance(source, dict):
            source = dict(source)  # diffusers' conversions pop keys
        read_args = {"return_lora_metadata": True, **kwargs}
        if "return_alphas" in inspect.signature(loader.lora_state_dict).parameters:  # FLUX: (dict, alphas, metadata)
            state_dict, network_alphas, metadata = loader.lora_state_dict(source, return_alphas=True, **read_args)
        else:
            (state_dict, metadata), network_alphas = loader.lora_state_dict(source, **read_args), None
        if adapter_name is None:  # diffusers' default_{n}, counted on the whole model
            adapter_name = f"default_{len(self._lora_adapters)}"
        if adapter_name in self._lora_adapters:
            raise ValueError(f"Adapter name {adapter_name} already in use in the pipeline; pick another adapter_name")
        local = self._local()
        if into not in local:
            raise ValueError(f"load_into_transformer_2: {type(self).__name__} has no transformer_2 (Wan 2.2 A14B has)")
        adapted = check_lora(state_dict, self._targets(), type(self).__name__)
        _check_text_encoder_support(sorted(c for c in adapted if c not in DENOISERS))
        held = self._held({**local, TRANSFORMER: local[into]})
        mine = share(state_dict, held)
        for component in adapted:
            keys = {k: v for k, v in mine.items() if k.startswith(f"{component}.")}
            if not keys:
                continue
            # as the loaders' load_lora_into_transformer (Wan: into ``into``, which its load_lora_weights picks)
            if component == TRANSFORMER:
                local[into].load_lora_adapter(keys, prefix=TRANSFORMER, network_alphas=network_alphas,
                                              metadata=metadata, adapter_name=adapter_name,
                                              low_cpu_mem_usage=low_cpu_mem_usage)  # fmt: skip
            else:
                loader.load_lora_into_text_encoder(keys, network_alphas=network_alphas, text_encoder=local[component],
                                                   prefix=component, adapter_name=adapter_name, metadata=metadata,
                                                   low_cpu_mem_usage=low_cpu_mem_usage)  # fmt: skip
        components = {into if c == TRANSFORMER else c for c in adapted}
        self._lora_adapters[adapter_name] = tuple(c for c in self._loader()._lora_loadable_modules if c in components)
        for component in components:  # PEFT activates the adapter it injects, alone, in that component
            self._lora_active[component] = [adapter_name]
        self._activate([adapter_name], [1.0], components)

    def get_list_adapters(self) -> dict[str, list[str]]:
        """The adapters loaded, by component they have weights for (the whole model's, the same on every rank)."""
        out: dict[str, list[str]] = {}
        for adapter, components in self._lora_adapters.items():
            for component in components:
                out.setdefault(component, []).append(adapter)
        return out

    def get_active_adapters(self) -> list[str]:
        """The active adapters of the first component with any (diffusers reads the first LoRA layer it finds); the
        same on every rank."""
        for component in self._loader()._lora_loadable_modules:
            if any(component in components for components in self._lora_adapters.values()):
                return list(self._lora_active.get(component, []))
        return []

    def set_adapters(self, adapter_names: list[str] | str, adapter_weights=None) -> None:
        r"""
        Activate `adapter_names` with `adapter_weights` (a float, one per adapter, or dicts by component), as
        diffusers' `set_adapters`. Unknown names raise the same `ValueError` on every rank.
        """
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        weights = copy.deepcopy(adapter_weights)
        if not isinstance(weights, list):
            weights = [weights] * len(names)
        if len(names) != len(weights):
            raise ValueError(
                f"Length of adapter names {len(names)} is not equal to the length of the weights {len(weights)}"
            )
        self._check_names(names)
        components = [c for c in self._loader()._lora_loadable_modules if c in self._model_components()]
        self._activate(names, weights, components)
        self._lora_active.update(dict.fromkeys(components, names))

    def _check_names(self, names: list[str]) -> None:
        missing = [n for n in names if n not in self._lora_adapters]
        if missing:
            raise ValueError(
                f"Adapter name(s) {missing} not in the list of present adapters: {list(self._lora_adapters)}"
            )

    def _model_components(self) -> set[str]:
        """The LoRA-loadable components the whole model has (a rank may hold none of a text encoder)."""
        return set(self._targets()) | ({"transformer_2"} if hasattr(self, "stage_2") else set())

    def _activate(self, names: list[str], weights: list, components: Iterable[str]) -> None:
        """Mirrors ``diffusers.loaders.lora_base.LoraBaseMixin.set_adapters`` on this rank's share of ``components``:
        each gets its part of the weights."""
        from diffusers.loaders.lora_base import set_adapters_for_text_encoder

        for component, module in self._local().items():
            if component not in components or not hasattr(module, "peft_config"):  # none touches this rank's share
                continue
            part = [w.get(component) if isinstance(w, dict) else w for w in weights]
            if component in DENOISERS:
                module.set_adapters(names, part)
            else:
                set_adapters_for_text_encoder(names, module, part)

    def fuse_lora(self, components: list[str] | None = None, lora_scale: float = 1.0, safe_fusing: bool = False,
                  adapter_names: list[str] | None = None) -> None:  # fmt: skip
        r"""Fuse the active (or named) adapters into the weights of `components` (default: the diffusers loader's, e.g.
        SD3's transformer and CLIP encoders, FLUX's transformer), as diffusers' `fuse_lora`, each rank into its own
        share."""
        from diffusers.loaders.lora_base import fuse_text_encoder_lora

        for component, module in self._components(components, "fuse_lora"):
            if component in DENOISERS:
                module.fuse_lora(lora_scale, safe_fusing=safe_fusing, adapter_names=adapter_names)
            else:
                fuse_text_encoder_lora(module, lora_scale=lora_scale, safe_fusing=safe_fusing,
                                       adapter_names=adapter_names)  # fmt: skip
        fused = components or list(inspect.signature(self._loader().fuse_lora).parameters["components"].default)
        self._lora_merged |= set(adapter_names or [a for c in fused for a in self._lora_active.get(c, [])])

    def unfuse_lora(self, components: list[str] | None = None) -> None:
        """Undo `fuse_lora` on `components` (default: the diffusers loader's)."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        for _, module in self._components(components, "unfuse_lora"):
            for layer in module.modules():
                if isinstance(layer, BaseTunerLayer):
                    layer.unmerge()
        self._lora_merged.clear()

    def unload_lora_weights(self) -> None:
        """Remove every adapter (its layers and weights) from every component, as diffusers' `unload_lora_weights`."""
        from diffusers.loaders.lora_base import _remove_text_encoder_monkey_patch

        for component, module in self._local().items():
            if component in DENOISERS:
                if hasattr(module, "peft_config"):
                    module.unload_lora()
            else:
                _remove_text_encoder_monkey_patch(module)
        self._lora_adapters.clear()
        self._lora_active, self._lora_merged = {}, set()

    def delete_adapters(self, adapter_names: list[str] | str) -> None:
        """Remove the named adapters' layers, as diffusers' `delete_adapters`."""
        from diffusers.utils.peft_utils import delete_adapter_layers

        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        missing = set(names) - set(self._lora_adapters)
        if missing:
            raise ValueError(
                f"Adapter name(s) {missing} not in the list of present adapters: {set(self._lora_adapters)}."
            )
        for component, module in self._local().items():
            if component in DENOISERS and hasattr(module, "peft_config"):
                module.delete_adapters([n for n in names if n in module.peft_config])
            elif component not in DENOISERS:
                for name in names:
                    delete_adapter_layers(module, name)
        for name in names:
            del self._lora_adapters[name]
        self._lora_active = {c: [n for n in active if n not in names] for c, active in self._lora_active.items()}

    def disable_lora(self) -> None:
        """Run without the adapters (kept loaded), as diffusers' `disable_lora`."""
        self._enable(False)

    def enable_lora(self) -> None:
        """Run with the active adapters again, as diffusers' `enable_lora`."""
        self._enable(True)

    def _enable(self, enabled: bool) -> None:
        """Mirrors ``diffusers.loaders.lora_base.LoraBaseMixin.disable_lora`` (and ``enable_lora``) on this rank's
        components: diffusers' model-level and text-encoder helpers both come down to this one."""
        from diffusers.utils.peft_utils import set_adapter_layers

        for module in self._local().values():
            set_adapter_layers(module, enabled=enabled)

    def _components(self, components: list[str] | None, method: str):
        """This rank's modules of ``components`` (``None``: the diffusers loader's default for ``method``)."""
        known = self._loader()._lora_loadable_modules
        if components is None:
            components = list(inspect.signature(getattr(self._loader(), method)).parameters["components"].default)
        for component in components:
            if component not in known:
                raise ValueError(f"{component} is not found in the LoRA-loadable components {known}")
        local = self._local()
        return [(c, local[c]) for c in components if c in local]

    def lora_parameter_count(self) -> int:
        """Elements of the adapter weights this rank holds (its share; `lora_share.lora_parameters`)."""
        return lora_parameters(self._local().values())

    @property
    def num_fused_loras(self) -> int:
        return len(self._lora_merged)

    @property
    def fused_loras(self) -> set[str]:
        return set(self._lora_merged)


def _check_text_encoder_support(components: list[str]) -> None:
    """Text-encoder LoRA goes through transformers' PEFT integration, which may want a newer PEFT than diffusers':
    refused on every rank alike (only rank 0 runs the text encoders, so only it would fail otherwise)."""
    if not components:
        return
    from transformers.integrations.peft import MIN_PEFT_VERSION
    from transformers.utils.peft_utils import check_peft_version

    try:
        check_peft_version(min_version=MIN_PEFT_VERSION)
    except ValueError as err:
        raise ValueError(f"the LoRA adapts {', '.join(components)}, which transformers loads only with PEFT >= "
                         f"{MIN_PEFT_VERSION}: {err}") from err  # fmt: skip
