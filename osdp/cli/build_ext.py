"""``osdp build-ext``: build the C++ split op ahead of time, so that no rank compiles it at start-up."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from osdp.split._build import (
    BUILD_TIMEOUT_S,
    ExtensionUnavailable,
    cache_key,
    cache_root,
    cached_library,
    ensure_built,
    key_directory,
    load,
    sources,
)


def main(argv: list[str] | None = None) -> int:
    """``osdp build-ext``: build the op ahead of time, so that no rank compiles at start-up."""
    p = argparse.ArgumentParser(
        prog="osdp build-ext",
        description="Build the C++ split op for this osdp, torch and Python into the cache every rank loads "
        "it from ($OSDP_EXTENSIONS_DIR, else ~/.cache/osdp/torch_extensions).",
    )
    p.add_argument("--dir", type=Path, help="the cache directory (default: $OSDP_EXTENSIONS_DIR or ~/.cache/osdp/torch_extensions)")
    p.add_argument("--force", action="store_true", help="rebuild even if a valid build is cached")
    p.add_argument("--verbose", action="store_true", help="show the compiler's output")
    p.add_argument("--timeout", type=float, default=BUILD_TIMEOUT_S, help="seconds the compile may take (default: %(default)s)")
    args = p.parse_args(argv)
    root = args.dir or cache_root()
    start = time.perf_counter()
    try:
        key = cache_key(sources())
        was_cached = not args.force and cached_library(key_directory(root, key), key)[0] is not None
        library = ensure_built(root, force=args.force, verbose=args.verbose, timeout_s=args.timeout)
        load(library)
    except ExtensionUnavailable as e:
        print(f"osdp build-ext: {e}", file=sys.stderr)
        return 1
    what = "already built" if was_cached else f"built in {time.perf_counter() - start:.1f} s"
    print(f"{what}: {library}  (osdp {key['osdp']}, torch {key['torch']}, {key['python']})")
    if Path(root).resolve() != cache_root().resolve():
        print(f"ranks load it with OSDP_EXTENSIONS_DIR={root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
