"""``python -m sa_fence``: the ``sa-fence`` command, for when the script is not on PATH."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
