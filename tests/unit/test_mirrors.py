"""The diffusers code xfuse mirrors is named in one format and has not moved since the mirror was written
(``tests/support/mirrors.py``): a diffusers upgrade that changes a mirrored function fails here, naming it."""

import re

import pytest

from tests.support import mirrors
from xfuse.families.registry import FAMILIES

REFERENCES = mirrors.references()
RECORDED = mirrors.load_record()


def test_every_mirror_claim_names_its_diffusers_function():
    assert mirrors.unnamed_claims() == []


def test_the_record_holds_exactly_the_referenced_names():
    named, recorded = set(REFERENCES), set(RECORDED)
    assert named - recorded == set(), "named in xfuse but never recorded: python -m tests.support.mirrors --record"
    assert recorded - named == set(), "recorded but no longer named in xfuse: re-record"


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_mirrored_signature_is_unchanged(name):
    where = ", ".join(REFERENCES[name])
    try:
        current = mirrors.signature(name)
    except (ImportError, AttributeError) as err:
        pytest.fail(f"{name} (named at {where}) no longer exists in the installed diffusers: {err}")
    assert current == RECORDED[name], (
        f"the installed diffusers changed {name}'s signature since the mirror at {where} was written:\n"
        f"  was {RECORDED[name]}\n  now {current}\nre-read the mirror, then: python -m tests.support.mirrors --record"
    )


# Every xfuse pipeline class: (its family, its diffusers pipeline's name), the family's own, its image-to-video and
# its ControlNet pipeline.
PIPELINES = [(spec, name) for spec in FAMILIES for name in spec.diffusers_pipelines]


@pytest.mark.parametrize("spec,name", PIPELINES, ids=[name for _, name in PIPELINES])
def test_each_pipeline_takes_exactly_its_diffusers_pipelines_arguments(spec, name):
    """Same names, order and defaults as diffusers' ``__call__``: a diffusers script runs unchanged (what xfuse cannot
    honour it refuses by name at call time)."""
    import diffusers

    ours = spec.pipeline_class_named(f"PipeFusion{name}")
    assert ours.diffusers_name() == name
    assert mirrors.parameters(ours.__call__) == mirrors.parameters(getattr(diffusers, name).__call__)


@pytest.mark.parametrize("spec", FAMILIES, ids=[spec.name for spec in FAMILIES])
def test_each_pipeline_is_exported_under_diffusers_name_after_pipefusion(spec):
    """A family folder and its registry line are all it takes: ``xfuse`` exports its classes by the names the spec
    derives from diffusers' (``FluxPipeline`` -> ``PipeFusionFluxPipeline``), found by convention in its package
    (``pipeline.py``; a ControlNet pipeline in ``controlnet.py``), and its adapter by ``stage_name`` in ``stage.py``
    (none: the generic family's, built from its ``ForwardPlan``)."""
    import xfuse

    cls = spec.pipeline_class()
    assert cls.__name__ == spec.pipeline_name == f"PipeFusion{spec.diffusers_pipeline}"
    assert cls.__module__ == f"{spec.package}.pipeline" and spec.package.startswith("xfuse.families.")
    for name in spec.pipeline_names:  # the family's own pipeline, then its image-to-video and ControlNet ones
        cls = spec.pipeline_class_named(name)
        assert cls.__name__ == name
        assert getattr(xfuse, name) is cls and name in xfuse.__all__
    stage_name = spec.stage_name or f"{spec.diffusers_transformer}ForwardStage"
    assert spec.stage_class().__name__ == stage_name and spec.stage_class().spec is spec
    with pytest.raises(ValueError, match=f"'PipeFusionNope' is not a pipeline of the {spec.name} family"):
        spec.pipeline_class_named("PipeFusionNope")


@pytest.mark.parametrize(
    "changes,says",
    [
        ({"name": "flux-copy"}, "preset 'flux-tiny' is claimed by two families: flux and flux-copy"),
        ({"presets": ("flux-copy-tiny",)}, "family name 'flux' is claimed by two families: flux and flux"),
        (
            {"name": "flux-copy", "presets": ("flux-copy-tiny",)},
            "diffusers pipeline 'FluxPipeline' is claimed by two families: flux and flux-copy",
        ),
    ],
    ids=["preset", "family", "diffusers-pipeline"],
)
def test_a_name_two_families_claim_is_refused_when_the_registry_loads(changes, says):
    """A new family folder copied from another keeps its names until renamed: the registry's tables (built by
    ``_lookups`` when it loads) must say so, not let the later family silently take the earlier one's presets,
    folders or exports."""
    import dataclasses

    from xfuse.families import registry

    assert registry._lookups(registry.FAMILIES) == (
        registry.MODEL_SPECS,
        registry.PRESET_MODELS,
        registry._BY_PIPELINE,
        registry.PIPELINE_SPECS,
    )
    copy = dataclasses.replace(registry.FLUX, **changes)
    with pytest.raises(ValueError, match=re.escape(says)):
        registry._lookups((*registry.FAMILIES, copy))
