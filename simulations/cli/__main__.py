"""``python -m simulations.cli``: the ``fedfilter`` command."""

import sys

from simulations.cli import main

sys.exit(main())
