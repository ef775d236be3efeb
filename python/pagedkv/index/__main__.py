"""``python -m pagedkv.index``: a standalone prefix-index process (see :func:`.service.main`)."""

from __future__ import annotations

from .service import main

if __name__ == "__main__":
    raise SystemExit(main())
