"""The ``osdp`` command: ``osdp train``, ``osdp plan``, ``osdp calibrate``, ``osdp validate``, ``osdp build-ext``,
``osdp --version``."""

from __future__ import annotations

import sys

# one module per command, imported only when that command runs
COMMANDS = {
    "train": "osdp.cli.train", "plan": "osdp.cli.plan", "calibrate": "osdp.cli.calibrate",
    "validate": "osdp.cli.validate", "build-ext": "osdp.cli.build_ext",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        from osdp import __version__

        print(f"osdp {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: osdp {" + ",".join(COMMANDS) + "} [options]   (osdp COMMAND --help for its options)\n"
              "       osdp --version")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib

    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])

