"""``python -m zerolayer``: the ``zerolayer`` command (zerolayer.cli.main), as the console
script runs it."""

import sys

from zerolayer.cli.main import main

sys.exit(main())
