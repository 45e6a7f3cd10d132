"""`python -m kvsidecar ...` is `kvsidecar ...`."""

import sys

from kvsidecar.cli import main

sys.exit(main())
