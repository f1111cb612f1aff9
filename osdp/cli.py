"""The ``osdp`` command: ``osdp train``, ``osdp plan``, ``osdp calibrate``, ``osdp validate``, ``osdp build-ext``,
``osdp --version``."""

from __future__ import annotations

import sys

COMMANDS = {
    "train": "osdp.train", "plan": "osdp.plan_cli", "calibrate": "osdp.calibration", "validate": "osdp.validate",
    "build-ext": "osdp.split._build",
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


if __name__ == "__main__":
    sys.exit(main())
