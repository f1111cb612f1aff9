"""The ``osdp`` command: ``osdp train``, ``osdp plan``, ``osdp calibrate``, ``osdp validate``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"train": "osdp.train", "plan": "osdp.plan_cli", "calibrate": "osdp.calibration",
                "validate": "osdp.validate"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: osdp {" + ",".join(commands) + "} [options]   (osdp COMMAND --help for its options)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib

    return importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
