"""Allows `python -m tierfs`, the same as the `tierfs` console script."""

from tierfs.mount_helper.cli import main

raise SystemExit(main())
