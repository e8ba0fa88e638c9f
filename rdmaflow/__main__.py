"""``python -m rdmaflow``: the ``rdmaflow`` command."""
import sys

from rdmaflow.cli import main

sys.exit(main())
