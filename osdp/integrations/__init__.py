"""Training frameworks over a model that ``osdp.wrap`` made data parallel.

``osdp.integrations.hf``: Hugging Face ``transformers.Trainer`` and ``accelerate.Accelerator``
(imported on use: neither is a dependency of osdp).
"""
