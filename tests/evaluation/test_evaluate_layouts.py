"""Issue 47 item 2 at the layouts: `python -m megatron.evaluate` launched by torchrun (gloo)
at TP 2 and at PP 2 answers every request of the four local tasks as the reference run of
`lm_eval --model hf ...,backend=seq2seq` on the export does (loglikelihoods within 1e-4,
rolling ones 1e-6 relative, is_greedy and greedy generations identical), read back from the
harness's own files under --output-path; its metrics are the reference's. At data-parallel
size 2 the harness deals the documents to the two ranks and gathers them on rank 0: the
loglikelihood tasks' answers and metrics are the reference's too (a generation that runs to its
length limit depends on which documents share its batch, so the generation task is left out
there: docs/evaluation.md)."""

import os
import subprocess
import sys

import pytest

from reference import (LOCAL_TASKS, REFERENCE_BATCH, REPO, TASKS_DIR, read_run,
                       response_mismatches)

pytestmark = pytest.mark.slow  # (torchrun runs, the reference runs)


def torchrun_evaluate(eval_model, out, tasks, *parallel):
    """`torchrun --standalone --nproc-per-node 2 -m megatron.evaluate ...` over `tasks` at the
    reference's batch size; the harness's files read back (reference.read_run)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    # --standalone: the rendezvous on a port the launcher takes itself (none chosen here that
    # another process could take first)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "megatron.evaluate", "--load", str(eval_model.checkpoint),
           "--tokenizer-model", str(eval_model.spm_model), "--tasks", ",".join(tasks),
           "--include-path", str(TASKS_DIR), "--batch-size", str(REFERENCE_BATCH),
           "--log-samples", "--output-path", str(out), *parallel]
    proc = subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_run(out)


def same_metrics(ours, reference, tasks):
    for task in tasks:
        want = {k: v for k, v in reference.results["results"][task].items()
                if "stderr" not in k and isinstance(v, float)}
        got = {k: ours.results["results"][task][k] for k in want}
        assert got == pytest.approx(want, rel=1e-6), task


@pytest.mark.parametrize("parallel", [("--tensor-model-parallel-size", "2"),
                                      ("--pipeline-model-parallel-size", "2")],
                         ids=["tp2", "pp2"])
def test_every_request_at_tp_2_and_pp_2_is_the_hf_backends(parallel, eval_model,
                                                           reference_run, tmp_path):
    ours = torchrun_evaluate(eval_model, tmp_path / "out", LOCAL_TASKS, *parallel)
    assert len(ours.requests) == len(reference_run.requests) > 20
    assert response_mismatches(reference_run, {k: r.response for k, r in
                                               ours.requests.items()}) == []
    same_metrics(ours, reference_run, LOCAL_TASKS)
    assert ours.results["config"]["model_args"] == {"pretrained": str(eval_model.checkpoint)}


def test_data_parallel_ranks_split_the_documents_and_gather_them(eval_model, reference_run,
                                                                 tmp_path):
    tasks = [t for t in LOCAL_TASKS if t != "local_gen_en"]
    ours = torchrun_evaluate(eval_model, tmp_path / "out", tasks)  # TP 1 x DP 2
    reference = {k: r for k, r in reference_run.requests.items() if k[0] in tasks}
    assert len(ours.requests) == len(reference) > 20
    mismatches = response_mismatches(reference_run._replace(requests=reference),
                                     {k: r.response for k, r in ours.requests.items()})
    assert mismatches == []
    same_metrics(ours, reference_run, tasks)
