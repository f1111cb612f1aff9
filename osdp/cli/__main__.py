"""``python -m osdp.cli COMMAND ...``: the ``osdp`` command without its console script."""

import sys

from osdp.cli import main

sys.exit(main())
