"""``python -m pagedkv.cli``: runs the ``pagedkv`` command line."""

import sys

from . import main

sys.exit(main())
