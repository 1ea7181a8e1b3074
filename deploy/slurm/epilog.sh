#!/bin/sh
# Slurm Epilog (runs as root on each node after the job): the job's last steps commit (its
# savers are gone), every step goes to the persistent tier (15 minutes at most: in a cluster
# each node sends its share and waits until the store holds every step whole), then unmount
# (--force: also if the flush did not complete; umount then names the steps that stay only in
# RAM, which go up at the RAM dir's next mount).
# slurm.conf: Epilog=/etc/slurm/tierfs-epilog.sh
set -eu
TIERFS=/opt/tierfs/.venv/bin/tierfs
if mountpoint -q /checkpoints; then
    "$TIERFS" umount /checkpoints --flush --timeout 900 --force
fi
