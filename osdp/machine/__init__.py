"""The machine: its collective costs and compute rate (measured or from a preset), its identity, and the
meters every measurement uses (the step timer, per-rank peak memory)."""

from osdp._moved import old_names

__getattr__ = old_names(__name__)  # the previous release's names of this package (osdp._moved)
