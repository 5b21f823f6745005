"""The end of a training run: its figures into SAVE/plots/ (rank 0, after the last step).

Plotting must never fail a run that trained: a missing matplotlib or any error while reading or
drawing becomes one log line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Optional


def plot_at_end(save: str | Path, log_file: Optional[str], tensorboard_dir: Optional[str],
                say: Callable[[str], None]) -> Optional[List[Path]]:
    """Draw the run from its log file (else its TensorBoard events) into save/plots/.

    say: writes one line to the run's log (MetricsWriter.write_text).
    Returns the PNG paths, or None when nothing was written (the line says why).
    """
    out = Path(save) / "plots"
    source = log_file if log_file and Path(log_file).is_file() else tensorboard_dir
    if not source:
        say(f"plots: neither --log-file nor --tensorboard-dir is set, so no figures in {out}")
        return None
    from megatron.plot.figures import MissingMatplotlib, build_figures, write_figures
    from megatron.plot.find import default_labels, load_run

    try:
        figures = build_figures([load_run(source, label=default_labels([save])[0])])
        paths = write_figures(figures, out)
    except MissingMatplotlib as e:
        say(f"plots: none written to {out}: {e}")
        return None
    except Exception as e:  # noqa: BLE001 - a figure is never worth a failed run
        say(f"warning: plots: none written to {out}: {type(e).__name__}: {e}")
        return None
    say(f"plots: {len(paths)} figures in {out} ({', '.join(p.name for p in paths)})")
    return paths
