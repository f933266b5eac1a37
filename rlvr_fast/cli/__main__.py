"""``python -m rlvr_fast.cli``: the ``rlvr-fast`` command."""

import sys

from rlvr_fast.cli.main import main

sys.exit(main())
