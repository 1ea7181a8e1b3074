#!/bin/sh
# Slurm Prolog (runs as root on each node before the job): mount tierfs for the job's user.
# slurm.conf: Prolog=/etc/slurm/tierfs-prolog.sh  PrologFlags=Alloc
set -eu
TIERFS=/opt/tierfs/.venv/bin/tierfs
mkdir -p /checkpoints
if ! mountpoint -q /checkpoints; then
    "$TIERFS" mount /checkpoints --ram-dir /dev/shm/tierfs --ram-limit 50% \
        --persist "s3://my-bucket/checkpoints/$SLURM_JOB_USER" \
        --allow-other --uid "$SLURM_JOB_USER" \
        --cluster etcd://etcd-0:2379,etcd-1:2379/tierfs/"$SLURM_JOB_ID" \
        --listen "$(hostname -i):7070" --token-file /etc/tierfs/token
fi
