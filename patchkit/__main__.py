"""Command line: ``python -m patchkit {tour,demo,inspect} ...``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(device=args.device)
    return 0


def _cmd_tour(args: argparse.Namespace) -> int:
    from .tour import run_tour

    return 0 if run_tour(args.out, device=args.device).ok else 1


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .io import print_patch_file_summary

    return print_patch_file_summary(args.file, max_chunk_bytes=args.max_chunk_bytes)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m patchkit`` and the ``patchkit`` script."""
    parser = argparse.ArgumentParser(prog="python -m patchkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", help="a dense, a sparse and a repeated-name load, shown in the terminal"
    )
    demo.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    demo.set_defaults(run=_cmd_demo)

    tour = sub.add_parser(
        "tour", help="dense, sparse and repeated-name loads, written as figures + index.html"
    )
    tour.add_argument("--out", default="patchkit-tour", help="folder (default patchkit-tour/)")
    tour.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    tour.set_defaults(run=_cmd_tour)

    insp = sub.add_parser("inspect", help="summarise a patch file (.safetensors)")
    insp.add_argument("file")
    insp.add_argument(
        "--max-chunk-bytes", type=int, default=512 << 20,
        help="budget for the chunk plan (default 512 MiB)",
    )
    insp.set_defaults(run=_cmd_inspect)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
