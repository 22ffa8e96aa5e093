"""A LoRA file checked against the whole model, and the share of it one rank keeps.

Every rank reads the same file and checks it against the same description of the whole model (every linear layer of
every LoRA-loadable component, from its config on a meta device where the rank does not hold it), so a bad file is
refused with the same message on every rank, before any rank changes a weight or sends a message. Each rank then
keeps only the weights of the modules it holds: its blocks of the transformer, and the text encoders where it runs
them.

Key names are those ``lora_state_dict`` of the family's diffusers pipeline returns (its conversions of other formats
already applied): ``<component>.<module>.lora_A.weight`` and ``.lora_B.weight`` (PEFT's names), or the older
``.lora.down.weight`` / ``.lora.up.weight``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

# component, module, which half (PEFT's name or the older one)
_KEY = re.compile(
    r"^(?P<component>[A-Za-z0-9_]+)\.(?P<module>.+)\.(?P<half>lora_A|lora_B|lora\.down|lora\.up)\.weight$"
)
_DOWN = ("lora_A", "lora.down")  # (rank, in_features)


def linear_shapes(module: nn.Module) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every linear layer of ``module``, by its name in ``module``."""
    return {name: (m.in_features, m.out_features) for name, m in module.named_modules() if isinstance(m, nn.Linear)}


def meta_linear_shapes(build: Callable[[], nn.Module]) -> dict[str, tuple[int, int]]:
    """``linear_shapes`` of the module ``build`` makes, made on the meta device (no memory, no weights read)."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        return linear_shapes(build())


def check_lora(
    state_dict: dict[str, torch.Tensor], targets: dict[str, dict[str, tuple[int, int]]], model: str
) -> dict[str, set[str]]:
    """The components and modules ``state_dict`` adapts (component -> module names); ``ValueError`` naming the key
    where it is not a LoRA of ``model`` (``targets``: every LoRA-loadable component's ``linear_shapes``): a key that
    is not a LoRA weight, a component or module the model does not have (a LoRA for another model), a down
    projection without its up projection or the other way round, shapes that do not fit the layer or each other."""
    if not state_dict:
        raise ValueError("the LoRA file has no weights")
    halves: dict[tuple[str, str], dict[str, torch.Size]] = {}
    for key, tensor in state_dict.items():
        found = _KEY.match(key)
        if found is None:
            raise ValueError(
                f"LoRA key {key!r} is not a LoRA weight xfuse loads: expected <component>.<module>.lora_A.weight and "
                f".lora_B.weight (or .lora.down.weight / .lora.up.weight); DoRA, biases and Control-LoRA norms are "
                "not supported on a sharded pipeline"
            )
        component, module, half = found["component"], found["module"], found["half"]
        if component not in targets:
            raise ValueError(
                f"LoRA key {key!r}: {model} loads LoRA into {', '.join(sorted(targets))}, not {component!r} "
                "(a LoRA for another model?)"
            )
        if module not in targets[component]:
            raise ValueError(
                f"LoRA key {key!r}: {model}'s {component} has no linear layer {module!r} (a LoRA for another model?)"
            )
        halves.setdefault((component, module), {})["down" if half in _DOWN else "up"] = tensor.shape
    adapted: dict[str, set[str]] = {}
    for (component, module), shapes in sorted(halves.items()):
        name = f"{component}.{module}"
        if set(shapes) != {"down", "up"}:
            (have,) = shapes
            raise ValueError(f"LoRA weights of {name}: the {have} projection is there, its other half is missing")
        (in_features, out_features), down, up = targets[component][module], shapes["down"], shapes["up"]
        if len(down) != 2 or len(up) != 2 or down[1] != in_features or up[0] != out_features or down[0] != up[1]:
            raise ValueError(
                f"LoRA weights of {name}: down {tuple(down)} and up {tuple(up)} do not fit the layer "
                f"({in_features} -> {out_features}): expected (rank, {in_features}) and ({out_features}, rank)"
            )
        adapted.setdefault(component, set()).add(module)
    return adapted


def share(state_dict: dict[str, torch.Tensor], held: Callable[[str, str], bool]) -> dict[str, torch.Tensor]:
    """The weights of ``state_dict`` (checked by ``check_lora``) whose (component, module) this rank ``held``."""
    out = {}
    for key, tensor in state_dict.items():
        found = _KEY.match(key)
        assert found is not None, key  # checked
        if held(found["component"], found["module"]):
            out[key] = tensor
    return out


def lora_parameters(modules: Iterable[nn.Module]) -> int:
    """Elements of the LoRA weights resident in ``modules`` (PEFT's ``lora_A`` / ``lora_B`` layers)."""
    return sum(
        p.numel() for m in modules for name, p in m.named_parameters() if ".lora_A." in name or ".lora_B." in name
    )
