#!/bin/sh
# Slurm Epilog (runs as root on each node after the job): persist every step, then unmount.
# slurm.conf: Epilog=/etc/slurm/tierfs-epilog.sh
set -eu
TIERFS=/opt/tierfs/.venv/bin/tierfs
if mountpoint -q /checkpoints; then
    "$TIERFS" flush /checkpoints --timeout 900 || echo "tierfs: flush incomplete" >&2
    "$TIERFS" umount /checkpoints
fi
