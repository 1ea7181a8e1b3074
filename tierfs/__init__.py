"""tierfs: a tiered checkpoint filesystem for ML training.

Writes land in a RAM tier behind a FUSE mount; step directories commit atomically; later tiers
(peers, S3) receive committed steps. See README.md for the user's view.
"""

__version__ = "0.1.0"
