"""xfuse: PipeFusion patch-level pipeline parallelism for diffusion transformers, every family the registry holds
(``xfuse.families.registry``), behind diffusers-compatible pipeline classes exported here."""

from xfuse._version import __version__ as __version__  # the package's version, exported


def __getattr__(name: str):
    # Lazy (PEP 562): importing xfuse (every test rank does) must not import diffusers, nor the families. Each
    # family's pipeline is ``PipeFusion`` + its diffusers pipeline's name, listed by the registry; ``__all__`` too
    # is read from there, so a new family folder is exported without a line here.
    from xfuse.families.registry import PIPELINE_SPECS

    if name == "__all__":
        return [*PIPELINE_SPECS, "parallelize", "__version__"]
    if name == "parallelize":  # a modular pipeline's denoise step on xfuse's loop (xfuse.modular)
        from xfuse.modular import parallelize

        return parallelize
    if name in PIPELINE_SPECS:
        return PIPELINE_SPECS[name].pipeline_class_named(name)
    raise AttributeError(f"module 'xfuse' has no attribute {name!r}")
