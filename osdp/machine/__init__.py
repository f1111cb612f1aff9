"""The machine: its collective costs and compute rate (measured or from a preset), its identity, and the
meters every measurement uses (the step timer, per-rank peak memory)."""


def __getattr__(name: str) -> object:  # the previous release's names of this package (osdp._moved)
    from osdp._moved import moved_attribute

    return moved_attribute("osdp.machine", name)
