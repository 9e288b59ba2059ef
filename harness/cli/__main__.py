"""``python -m harness.cli``: the ``kph`` command."""
import sys

from .main import main

sys.exit(main())
