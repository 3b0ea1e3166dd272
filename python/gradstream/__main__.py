"""``python -m gradstream``: the ``gradstream`` command (see gradstream.cli)."""

import sys

from .cli import main

sys.exit(main())
