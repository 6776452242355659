"""Validation loss against estimated wall-clock time over network links (lowcomm-wallclock).

    python analysis/wallclock.py --runs 'runs/quickstart/*'
    python analysis/wallclock.py --sweep table1_1b --link wan:1G:20ms --target-excess 0.5

Writes wallclock.md / wallclock.csv (time to the target excess loss per link) and
loss_vs_wallclock as PNG and PDF; see analysis/README.md.
"""

import sys

from lowcomm.cli.report import wallclock_main

if __name__ == "__main__":
    sys.exit(wallclock_main())
