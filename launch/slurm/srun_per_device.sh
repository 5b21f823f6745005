#!/usr/bin/env bash
# Run the trainer with srun alone, one task per device and no torchrun:
#
#   launch/slurm/srun_per_device.sh <flags of megatron.pretrain_t5>
#
# Inside an allocation (an sbatch script, salloc) it uses that allocation's nodes; from a login
# node srun makes one. Each task reads SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and meets the
# others on the first host of the node list, at a port derived from the job id (see
# megatron/initialize.py). Slurm signals (SIGUSR1 before the time limit, SIGTERM) go straight to
# the training processes.
#
# Environment (all optional):
#   NTASKS_PER_NODE  training processes per node; default: SLURM_GPUS_ON_NODE, else the GPUs this
#                    host sees, else 1
#   NODES            nodes; default: those of the allocation (SLURM_JOB_NUM_NODES), else 1
#   CPUS_PER_TASK    CPUs per task; default inside an allocation: its CPUs per node divided by
#                    NTASKS_PER_NODE; outside one: the cluster's default (the login node's core
#                    count says nothing about the compute nodes)
#   SRUN_ARGS        more srun options, word-split (e.g. "--partition gpu --time 1:00:00")
#   OMP_NUM_THREADS  default: CPUS_PER_TASK, else 1
#   PYTHON           the interpreter (default: python)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python}

if [ $# -eq 0 ]; then
    echo "usage: launch/slurm/srun_per_device.sh <flags of megatron.pretrain_t5>" \
         "(see docs/flags.md)" >&2
    exit 2
fi
if ! command -v srun >/dev/null; then
    echo "error: srun not found: run this on a Slurm cluster (or use launch/torchrun.sh)" >&2
    exit 2
fi

if [ -z "${NTASKS_PER_NODE:-}" ]; then
    NTASKS_PER_NODE=${SLURM_GPUS_ON_NODE:-$("$PYTHON" -c \
        'import torch; print(torch.cuda.device_count() or 1)')}
fi
NODES=${NODES:-${SLURM_JOB_NUM_NODES:-1}}
if [ -z "${CPUS_PER_TASK:-}" ] && [ -n "${SLURM_CPUS_ON_NODE:-}" ]; then
    CPUS_PER_TASK=$(( SLURM_CPUS_ON_NODE / NTASKS_PER_NODE ))
    CPUS_PER_TASK=$(( CPUS_PER_TASK > 0 ? CPUS_PER_TASK : 1 ))
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${CPUS_PER_TASK:-1}}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

opts=(--kill-on-bad-exit=1 --nodes="$NODES" --ntasks-per-node="$NTASKS_PER_NODE")
if [ -n "${CPUS_PER_TASK:-}" ]; then
    opts+=(--cpus-per-task="$CPUS_PER_TASK")
fi
# shellcheck disable=SC2206  # SRUN_ARGS is a word list on purpose
opts+=(${SRUN_ARGS:-})
exec srun "${opts[@]}" "$PYTHON" -m megatron.pretrain_t5 "$@"
