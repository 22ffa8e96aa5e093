"""Adapter code several families share: sharding a diffusers transformer, PipeFusion's attention processors (plain
and joint text-image), the MMDiT stage, classifier-free guidance, tensor helpers and the offline preset builders."""
