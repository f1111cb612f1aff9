"""Training frameworks over a model that ``osdp.wrap`` made data parallel.

``osdp.integrations.hf``: Hugging Face ``transformers.Trainer`` and ``accelerate.Accelerator``
(imported on use: neither is a dependency of osdp).
"""


class IntegrationError(ValueError):
    """A trainer (Hugging Face's Trainer or Accelerator, Lightning's Trainer or LightningModule) set up in a way
    that cannot train an osdp-wrapped model; the message says what to change."""
