"""``lowcomm-build-kernels``: compile lowcomm's CPU kernels now, or say where they are.

    lowcomm-build-kernels

They are otherwise compiled in the first step that needs one, once per machine (about 15 s);
``make venv`` runs this. A failed build is a warning, not an error: the torch paths give the same
results, more slowly. ``LOWCOMM_CPU_KERNELS=0`` turns the kernels off. What they are, where they
are built and why per CPU: :mod:`lowcomm.compress.cpu_kernels`.
"""

from __future__ import annotations

import argparse
import sys

from lowcomm.cli.helptext import plain


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lowcomm-build-kernels", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    from lowcomm.compress import cpu_kernels

    if not cpu_kernels.enabled():
        print(f"lowcomm: CPU kernels turned off ({cpu_kernels.SWITCH}=0): the torch paths run")
        return 0
    if not cpu_kernels.available():
        print("lowcomm: CPU kernels not built (the warning above says why): the torch paths run")
        return 0
    print(f"lowcomm: CPU kernels ready in {cpu_kernels.build_directory()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
