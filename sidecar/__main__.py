"""`python -m sidecar ...` is `kvsidecar ...`."""

import sys

from sidecar.cli import main

sys.exit(main())
