"""The peer comparison benchmark (``make bench``): gradstream against the machine's limits,
pickle and gloo, in memory and over loopback TCP; what it measures and the ratios it checks
are described in benches/suite/__init__.py.

    python benches/bench.py [--quick] [--json FILE]
"""

import sys

from suite import main

if __name__ == "__main__":
    sys.exit(main())
