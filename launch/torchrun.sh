#!/usr/bin/env bash
# Run `python -m megatron.pretrain_t5 <flags>` under torchrun on this node:
#
#   launch/torchrun.sh --model-config t5-base --data-path data/mix_text_document ...
#
# Environment (all optional):
#   NPROC_PER_NODE  processes on this node; default: one per visible GPU, else 1 (CPU)
#   NNODES          nodes in the job (default 1); for elastic c10d jobs also MIN:MAX
#   NODE_RANK       this node's index, 0 .. NNODES-1 (default 0; static rendezvous only)
#   MASTER_ADDR     host of node 0 (required when NNODES > 1 without RDZV_ENDPOINT)
#   MASTER_PORT     a free port on that host (default 29500)
#   RDZV_ENDPOINT   host:port of a c10d rendezvous; with RDZV_ID (a job-unique name) it replaces
#                   MASTER_ADDR/MASTER_PORT/NODE_RANK: every node runs the same command and
#                   torchrun assigns the node ranks
#   OMP_NUM_THREADS default: the CPUs this process may use divided by NPROC_PER_NODE
#   TORCHRUN_ARGS   more torchrun options, word-split (e.g. "--max-restarts 0 --log-dir logs")
#   PYTHON          the interpreter (default: python)
#
# Exit status: the first failed rank's (docs/troubleshooting.md), not torchrun's 1 for any failure:
# torchrun runs through `python -m megatron.torchrun`, which takes the same options.
#
# Several nodes by hand: run this on every node with the same NNODES/MASTER_ADDR/MASTER_PORT and
# its own NODE_RANK. Under Slurm, launch/slurm/pretrain_t5.sbatch does that with srun.
#
# SIGUSR1 (the preemption warning, e.g. from `sbatch --signal=USR1@120`): torchrun is started with
# SIGUSR1 ignored. Unless it is listed in --signals-to-handle, SIGUSR1 kills torchrun (the default
# action) and orphans its workers; when it is listed, torchrun forwards it but then stops the
# workers after --shutdown-timeout and exits 1 even when they exit 0. Ignored, torchrun lives on
# and exits with its workers' status. The workers inherit the ignored disposition until the
# trainer installs its own handler. Slurm signals every process of a job step, workers included;
# by hand, signal the workers, torchrun's children: `pkill -USR1 -P <pid of torchrun>`.
set -euo pipefail
# First thing, so that a warning that arrives while this script still runs is not fatal either.
trap '' USR1  # see the header: inherited by torchrun, which then survives the preemption warning

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}

if [ $# -eq 0 ]; then
    echo "usage: launch/torchrun.sh <flags of megatron.pretrain_t5> (see docs/flags.md)" >&2
    exit 2
fi

if [ -z "${NPROC_PER_NODE:-}" ]; then
    # The trainer's own view of the devices (CUDA_VISIBLE_DEVICES included); 0 GPUs -> 1 CPU rank.
    NPROC_PER_NODE=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 1)')
fi
NNODES=${NNODES:-1}
MASTER_PORT=${MASTER_PORT:-29500}

if [ -z "${OMP_NUM_THREADS:-}" ]; then
    # torchrun would set 1; on CPU that leaves cores idle, on GPU hosts it is harmless either way.
    threads=$(( $(nproc) / NPROC_PER_NODE ))
    export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi

# Importable from any working directory even without `pip install -e .`; relative paths in the
# flags stay relative to the caller's directory.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

launch=(--nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE")
if [ -n "${RDZV_ENDPOINT:-}" ] || [ -n "${RDZV_ID:-}" ]; then
    if [ -z "${RDZV_ENDPOINT:-}" ] || [ -z "${RDZV_ID:-}" ]; then
        echo "error: set both RDZV_ENDPOINT (host:port) and RDZV_ID (a job-unique name) for a" \
             "c10d rendezvous, or neither" >&2
        exit 2
    fi
    launch+=(--rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID")
else
    if [ "$NNODES" != 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
        echo "error: NNODES=$NNODES needs MASTER_ADDR (the host of NODE_RANK 0) and MASTER_PORT," \
             "or RDZV_ENDPOINT and RDZV_ID" >&2
        exit 2
    fi
    launch+=(--node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-127.0.0.1}"
             --master-port "$MASTER_PORT")
fi
# shellcheck disable=SC2206  # TORCHRUN_ARGS is a word list on purpose
launch+=(${TORCHRUN_ARGS:-})
exec "$PYTHON" -m megatron.torchrun "${launch[@]}" -m megatron.pretrain_t5 "$@"
