"""`python -m megatron.plot`: PNG figures of runs from their log files or TensorBoard events,
without a browser; also written to SAVE/plots/ when a run with --save ends.

    runs.py      the Run (series by iteration, later starts merged in) and the x axes (step,
                 samples, tokens, time)
    find.py      where a RUN argument (a --save folder, a log file, an events folder) finds its
                 log or events, and reading them
    logfile.py   the --log-file reader (metrics, evaluation and per-layer grad norm lines)
    events.py    the TensorBoard reader (the same series from the scalars)
    figures.py   one matplotlib figure per quantity (raw and smoothed curves, a legend), the
                 per-layer heat map, and the PNG files
    at_end.py    the trainer's hook: its own run's figures into SAVE/plots/

matplotlib is an optional extra (`pip install 't5-pretrain[plot]'`); only figures.py needs it.
"""
