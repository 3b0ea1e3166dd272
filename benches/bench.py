"""The issue-4 benchmark: ``python benches/bench.py [--quick] [--json FILE]``."""

import sys

from gradstream.bench import main

sys.exit(main())
