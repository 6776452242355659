"""``lowcomm-build-kernels``: compile lowcomm's CPU kernels now, or say where they are.

    lowcomm-build-kernels
    lowcomm-build-kernels --require     # exit 1 if they cannot be built (a machine that must have them)

They are otherwise compiled in the first step that needs one, once per machine (about 15 s);
``make venv`` runs this. A failed build is a warning, not an error: the torch paths run instead, more
slowly, with the same results wherever the magnitudes are distinct. ``LOWCOMM_CPU_KERNELS=0`` turns the kernels off. What they are, where they
are built and why per CPU: :mod:`lowcomm.compress.cpu_kernels`.
"""

from __future__ import annotations

import argparse
import sys

from lowcomm.cli.helptext import plain


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lowcomm-build-kernels", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--require", action="store_true",
                        help="exit with status 1 when the kernels are turned off or cannot be built")
    args = parser.parse_args(argv)
    from lowcomm.compress import cpu_kernels

    try:
        wanted = cpu_kernels.enabled()
    except ValueError as error:
        print(f"lowcomm-build-kernels: error: {error}", file=sys.stderr)
        return 2
    if not wanted:
        print(f"lowcomm: CPU kernels turned off ({cpu_kernels.SWITCH}=0): the torch paths run")
        return 1 if args.require else 0
    if not cpu_kernels.available():
        print("lowcomm: CPU kernels not built (the warning above says why): the torch paths run")
        return 1 if args.require else 0
    print(f"lowcomm: CPU kernels ready in {cpu_kernels.build_directory()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
