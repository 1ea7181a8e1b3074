#!/bin/sh
# Slurm Epilog (runs as root on each node after the job): persist every step, then unmount
# (--force: also if the flush timed out; umount then names the steps that stay only in RAM).
# slurm.conf: Epilog=/etc/slurm/tierfs-epilog.sh
set -eu
TIERFS=/opt/tierfs/.venv/bin/tierfs
if mountpoint -q /checkpoints; then
    "$TIERFS" flush /checkpoints --timeout 900 || echo "tierfs: flush incomplete" >&2
    "$TIERFS" umount /checkpoints --force
fi
