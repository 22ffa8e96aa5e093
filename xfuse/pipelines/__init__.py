"""What every family's diffusers-compatible pipeline is built on: ``base.PipeFusionPipelineBase`` with its mixins (the
call driver ``call_driver``, ``denoising``, ``stream``, ``cancellation``, ``observability``, ``loading``) and the LoRA
machinery (``lora``, ``lora_share``).

The pipeline classes themselves live in their family folders (``xfuse/families/<family>/pipeline.py``) and are
exported by ``xfuse`` alone (``from xfuse import PipeFusionFluxPipeline``). This package sits below the families: it
imports none of them, nor the registry.
"""
