# Shared by the examples (sourced, not run): checks and the launch.
#   require_env VAR...       every variable set, else a message naming them and exit 2
#   require_files FILE...    every file present, else a message naming it and exit 2
#   launch FLAG...           exec $LAUNCHER (word-split; default launch/torchrun.sh) with the flags
#                            and the script's own arguments (which come last, so they override);
#                            OUT/ is made first (a launcher may write there before the trainer
#                            starts: sbatch --output=OUT/slurm-%j.out), except on a --dry-run,
#                            which writes nothing
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

require_env() {
    local missing=() var
    for var in "$@"; do
        [ -n "${!var:-}" ] || missing+=("$var")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "error: set ${missing[*]} (see the header of $0)" >&2
        exit 2
    fi
}

require_files() {
    local file
    for file in "$@"; do
        [ -f "$file" ] || { echo "error: $file not found" >&2; exit 2; }
    done
}

_has_dry_run() {
    local word
    for word in "$@"; do
        [ "$word" = "--dry-run" ] && return 0
    done
    return 1
}

launch() {
    local launcher
    if [ -n "${LAUNCHER:-}" ]; then
        read -r -a launcher <<<"$LAUNCHER"
    else
        launcher=("$REPO/launch/torchrun.sh")
    fi
    if [ -n "${OUT:-}" ] && ! _has_dry_run "${launcher[@]}" "$@" "${SCRIPT_ARGS[@]}"; then
        mkdir -p "$OUT"
    fi
    exec "${launcher[@]}" "$@" "${SCRIPT_ARGS[@]}"
}
