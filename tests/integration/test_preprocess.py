"""preprocess_data.py end to end: round trips against the tokenizer, bad lines, atomic outputs."""

import gzip
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from data_tools import preprocess_data
from megatron.data.storage.indexed_dataset import IndexedDataset
from megatron.data.preprocess import workers as pool_workers
from megatron.data.preprocess.jsonl import Chunk
from megatron.data.tokenizers.tokenizer import T5Tokenizer

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "data_tools" / "preprocess_data.py"


def first_docs(path, n):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(n), f)]


@pytest.fixture(scope="module")
def mixed_texts(corpora_dir):
    """English and Chinese documents from the shared corpora."""
    return (first_docs(corpora_dir / "en_shakespeare.jsonl", 40)
            + first_docs(corpora_dir / "zh_cmrc2018_wiki.jsonl", 60)
            + first_docs(corpora_dir / "en_wikitext2.jsonl", 5)
            + first_docs(corpora_dir / "zh_cmrc2019_stories.jsonl", 30))


def write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t}, ensure_ascii=False) + "\n")


def run_cli(*args, check=True):
    proc = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_document_round_trip(tmp_path, spm_model, mixed_texts):
    tok = T5Tokenizer(str(spm_model))
    write_jsonl(tmp_path / "a.jsonl", mixed_texts[:70])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        for t in mixed_texts[70:]:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    out = tmp_path / "out" / "mix"
    run_cli("--input", tmp_path / "a.jsonl", tmp_path / "*.jsonl.gz", "--output-prefix", out,
            "--tokenizer-model", spm_model, "--append-eod", "--workers", 2, "--chunk-mb", 0.05)
    ds = IndexedDataset(f"{out}_text_document")
    assert ds.dtype == np.uint16 and ds.num_documents == len(mixed_texts) == len(ds)
    for i, text in enumerate(mixed_texts):
        ids = ds[i].tolist()
        assert ids == tok.encode(text) + [tok.eod]  # the reference: the tokenizer itself
        # Literal special-token strings (WikiText's "<unk>") are encoded as those tokens, the
        # space before them dropped, as Hugging Face's T5Tokenizer does.
        expected = re.sub(r" ?(<unk>|</s>|<pad>)", r"\1", tok.normalize(text))
        assert tok.decode(ids[:-1], skip_special_tokens=False) == expected
    assert not (tmp_path / "out" / "mix_bad_lines.tsv").exists()


def test_workers_and_chunking_do_not_change_the_output(tmp_path, spm_model, mixed_texts):
    write_jsonl(tmp_path / "in.jsonl", mixed_texts)
    outputs = []
    for workers, chunk in [(1, 4.0), (2, 0.01), (3, 0.2)]:
        out = tmp_path / f"w{workers}"
        assert preprocess_data.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                                     str(out), "--tokenizer-model", str(spm_model),
                                     "--workers", str(workers), "--chunk-mb", str(chunk),
                                     "--split-sentences", "--no-progress"]) == 0
        outputs.append([Path(f"{out}_text_sentence{e}").read_bytes() for e in (".bin", ".idx")])
    assert outputs[0] == outputs[1] == outputs[2]


def test_sentences_and_several_keys(tmp_path, spm_model):
    from megatron.data.preprocess.sentence_splitter import SentenceSplitter

    tok = T5Tokenizer(str(spm_model))
    rows = [
        {"text": "Mr. Smith went to Washington. He liked it! Did he stay?", "title": "Smith"},
        {"text": "今天天气很好。我们去公园吧！你说呢？", "title": "天气"},
        {"text": "One sentence only", "title": "One"},
    ]
    with open(tmp_path / "in.jsonl", "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    out = tmp_path / "s"
    run_cli("--input", tmp_path / "in.jsonl", "--output-prefix", out, "--tokenizer-model",
            spm_model, "--json-keys", "text", "title", "--split-sentences", "--append-eod")
    splitter = SentenceSplitter()
    for key in ("text", "title"):
        ds = IndexedDataset(f"{out}_{key}_sentence")
        assert ds.num_documents == 3
        for d, row in enumerate(rows):
            expected = [tok.encode(s) for s in splitter.split(row[key])]
            expected[-1] = expected[-1] + [tok.eod]
            assert [s.tolist() for s in ds.document(d)] == expected
    assert [len(IndexedDataset(f"{out}_text_sentence").document(d)) for d in range(3)] == [3, 3, 1]


BAD_LINES = [
    (b'{"text": "good one"}', None),
    (b'{"text": "broken', "invalid JSON"),
    (b'{"text": "caf\xe9"}', "invalid UTF-8"),
    (b'{"body": "no text key"}', "missing key 'text'"),
    (b'{"text": 42}', "value of 'text' is int, not a string"),
    (b'{"text": "   "}', "empty document under 'text'"),
    (b'["not", "an object"]', "not a JSON object"),
    (b'{"text": "good two"}', None),
    (b"", "empty line"),
    (b'{"text": "good three"}', None),
]


def write_bad(path):
    path.write_bytes(b"\n".join(line for line, _ in BAD_LINES) + b"\n")


def test_bad_lines_are_reported_and_good_lines_kept(tmp_path, spm_model):
    tok = T5Tokenizer(str(spm_model))
    write_bad(tmp_path / "bad.jsonl")
    out = tmp_path / "b"
    proc = run_cli("--input", tmp_path / "bad.jsonl", "--output-prefix", out,
                   "--tokenizer-model", spm_model)
    assert "skipped 7 bad lines" in proc.stderr
    report = (tmp_path / "b_bad_lines.tsv").read_text().splitlines()
    assert report[0] == "file\tline\treason"
    got = [(int(r.split("\t")[1]), r.split("\t")[2]) for r in report[1:]]
    expected = [(n + 1, reason) for n, (_, reason) in enumerate(BAD_LINES) if reason]
    assert [g[0] for g in got] == [e[0] for e in expected]
    for (_, g), (_, e) in zip(got, expected):
        assert g.startswith(e), (g, e)
    ds = IndexedDataset(f"{out}_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == [
        tok.encode(t) for t in ("good one", "good two", "good three")]


def test_strict_stops_at_first_bad_line_and_leaves_nothing(tmp_path, spm_model):
    write_bad(tmp_path / "bad.jsonl")
    proc = run_cli("--input", tmp_path / "bad.jsonl", "--output-prefix", tmp_path / "o" / "x",
                   "--tokenizer-model", spm_model, "--strict", check=False)
    assert proc.returncode != 0
    assert f"{tmp_path / 'bad.jsonl'}:2: invalid JSON" in proc.stderr
    assert os.listdir(tmp_path / "o") == []


def write_with_bom(path, texts):
    """Lines as a Windows tool writes them: a UTF-8 BOM first, CRLF line ends."""
    path.write_bytes("\ufeff".encode() + b"".join(
        json.dumps({"text": t}, ensure_ascii=False).encode() + b"\r\n" for t in texts))


@pytest.mark.parametrize("strict", [False, True])
def test_a_bom_that_starts_a_file_is_removed_and_counted(tmp_path, spm_model, mixed_texts,
                                                         strict):
    tok = T5Tokenizer(str(spm_model))
    parts = [mixed_texts[:50], mixed_texts[50:51], mixed_texts[51:]]
    for k, texts in enumerate(parts):
        write_with_bom(tmp_path / f"in{k}.jsonl", texts)
    with gzip.open(tmp_path / "in3.jsonl.gz", "wb") as f:  # a BOM inside the compressed stream
        f.write((tmp_path / "in1.jsonl").read_bytes())
    out = tmp_path / "out" / "m"
    # Several workers, about a line per chunk: the first line of each file goes to any of them.
    proc = run_cli("--input", tmp_path / "in*.jsonl*", "--output-prefix", out,
                   "--tokenizer-model", spm_model, "--append-eod", "--workers", 2,
                   "--chunk-mb", "0.00005", *(["--strict"] if strict else []))
    assert "removed the UTF-8 byte order mark (BOM) that began 4 of 4 input files" in proc.stderr
    assert "bad lines" not in proc.stderr, proc.stderr
    ds = IndexedDataset(f"{out}_text_document")
    expected = mixed_texts[:50] + mixed_texts[50:51] + mixed_texts[51:] + mixed_texts[50:51]
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode(t) + [tok.eod]
                                                        for t in expected]
    assert sorted(os.listdir(out.parent)) == ["m_text_document.bin", "m_text_document.idx",
                                              "m_text_document.meta.json"]


def test_a_bom_on_a_later_line_is_a_bad_line(tmp_path, spm_model):
    bom = "\ufeff".encode()
    (tmp_path / "a.jsonl").write_bytes(bom + b'{"text": "one"}\n' + bom + b'{"text": "two"}\n'
                                       + b'{"text": "three"}\n')
    out = tmp_path / "out" / "m"
    proc = run_cli("--input", tmp_path / "a.jsonl", "--output-prefix", out,
                   "--tokenizer-model", spm_model, "--strict", check=False)
    assert proc.returncode == 1
    assert f"{tmp_path / 'a.jsonl'}:2: invalid JSON: the line starts with a UTF-8 byte order mark" \
        in proc.stderr, proc.stderr
    assert os.listdir(out.parent) == []
    proc = run_cli("--input", tmp_path / "a.jsonl", "--output-prefix", out,
                   "--tokenizer-model", spm_model)
    assert "removed the UTF-8 byte order mark (BOM) that began 1 of 1 input files" in proc.stderr
    report = Path(f"{out}_bad_lines.tsv").read_text(encoding="utf-8").splitlines()
    assert [r.split("\t")[1] for r in report[1:]] == ["2"]
    assert IndexedDataset(f"{out}_text_document").num_documents == 2


def test_flag_errors(tmp_path, spm_model):
    for args, message in [
        (["--input", tmp_path / "nothing*.jsonl"], "matches no file"),
        (["--input", tmp_path / "x.jsonl", "--keep-newlines"], "--keep-newlines"),
        (["--input", tmp_path / "x.jsonl", "--workers", "0"], "--workers"),
    ]:
        (tmp_path / "x.jsonl").write_text('{"text": "a"}\n')
        proc = run_cli(*args, "--output-prefix", tmp_path / "o", "--tokenizer-model", spm_model,
                       check=False)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
        assert not list(tmp_path.glob("o_*"))


class StderrWatch:
    """Reads a process's stderr in a thread; `wait_for(prefix)` waits, up to a deadline, for a
    line that starts with `prefix`."""

    def __init__(self, stream):
        self.lines = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream):
        for line in stream:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self.lines.append(None)  # end of stream
            self._cond.notify_all()

    def wait_for(self, prefix, timeout):
        def seen():
            return None in self.lines or any(line.startswith(prefix) for line in self.lines
                                             if line is not None)
        with self._cond:
            return self._cond.wait_for(seen, timeout) and None not in self.lines

    def text(self, timeout):
        self._thread.join(timeout)
        return "".join(line for line in self.lines if line is not None)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_interrupted_run_leaves_no_output(tmp_path, spm_model, mixed_texts, sig):
    write_jsonl(tmp_path / "big.jsonl", mixed_texts * 60)
    out_dir = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--input", str(tmp_path / "big.jsonl"), "--output-prefix",
           str(out_dir / "big"), "--tokenizer-model", str(spm_model), "--workers", "2",
           "--split-sentences", "--chunk-mb", "0.1", "--log-interval", "1"]
    # A shell that started us in the background may have left SIGINT ignored; a user's terminal
    # does not, so the child gets the default disposition back.
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    watch = StderrWatch(proc.stderr)
    try:
        # The first progress line: workers are running, chunks are in flight (their tasks
        # bigger than a pipe holds), documents are being written.
        writing = watch.wait_for("processed ", timeout=120)
        assert writing, watch.text(1)
        proc.send_signal(sig)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = watch.text(60)
    assert proc.returncode != 0
    assert not list(out_dir.glob("*.bin")) and not list(out_dir.glob("*.idx"))
    if sig == signal.SIGKILL:
        assert list(out_dir.glob("*.tmp-*"))  # nothing could clean up; the next run does
        (tmp_path / "small.jsonl").write_text('{"text": "a b c"}\n')
        subprocess.run(cmd[:3] + [str(tmp_path / "small.jsonl")] + cmd[4:], check=True,
                       capture_output=True, timeout=120)
        assert sorted(p.name for p in out_dir.iterdir()) == [
            "big_text_sentence.bin", "big_text_sentence.idx", "big_text_sentence.meta.json"]
    else:
        assert os.listdir(out_dir) == [], os.listdir(out_dir)
        assert proc.returncode == 130 and "interrupted; no output was written" in err, err
        assert "error" not in err and "Traceback" not in err, err  # not a worker's failure


# Every bad kind among real text, the first bad one at line 5: the kinds that JSON parses
# (a lone surrogate, a non-string value) must not reach the tokenizer, whatever the chunking.
GOOD = [
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "All:\nSpeak, speak.",
    "First Citizen:\nYou are all resolved rather to die than to famish?",
    "All:\nResolved. resolved.",
    "First Citizen:\nLet us kill him, and we'll have corn at our own price.\nIs't a verdict?",
    "All:\nNo more talking on't; let it be done: away, away! \U0001f3ad",
    "Second Citizen:\nOne word, good citizens.",
    "MENENIUS:\nWhat work's, my countrymen, in hand? where go you\nWith bats and clubs?",
]
LONE_SURROGATE = "value of 'text' has a lone surrogate"
MIXED_LINES = [
    (GOOD[0], None),
    (GOOD[1], None),
    (GOOD[2], None),
    (GOOD[3], None),
    (b'{"text": "First Citizen:\\nFirst, you know Caius Marcius is chief', "invalid JSON"),
    (GOOD[4], None),
    (b'{"text": ["We know\'t", "we know\'t"]}', "value of 'text' is list, not a string"),
    (GOOD[5], None),  # an escaped surrogate pair (the emoji) is a good character
    (b'{"text": "Let us revenge this \\ud800 with our pikes"}', LONE_SURROGATE),
    (b'{"text": "Would you proceed especially against Caius Marcius?", "id": 3}', None),
    (b'{"text": "he pays himself with being proud \xff"}', "invalid UTF-8"),
    (b'["Consider you what services he has done for his country?"]', "not a JSON object"),
    (b'{"title": "Coriolanus"}', "missing key 'text'"),
    (b'{"text": " \\n\\t "}', "empty document under 'text'"),
    (GOOD[6], None),
    (b'{"text": "Nay, but speak not \\udc00\\ud800 maliciously."}', LONE_SURROGATE),
    (GOOD[7], None),
]


def write_mixed(path):
    lines = [json.dumps({"text": line}).encode() if isinstance(line, str) else line
             for line, _ in MIXED_LINES]
    path.write_bytes(b"\n".join(lines) + b"\n")


def mixed_good_texts():
    return [line if isinstance(line, str) else json.loads(line)["text"]
            for line, reason in MIXED_LINES if reason is None]


# One chunk for the whole file, and about one line per chunk (so that workers race).
CHUNKINGS = pytest.mark.parametrize("chunk_mb", ["1", "0.00005"])


@CHUNKINGS
@pytest.mark.parametrize("workers", [1, 2])
def test_strict_stops_at_line_5_of_every_bad_kind(tmp_path, spm_model, workers, chunk_mb):
    write_mixed(tmp_path / "mixed.jsonl")
    out_dir = tmp_path / "out"
    proc = run_cli("--input", tmp_path / "mixed.jsonl", "--output-prefix", out_dir / "m",
                   "--tokenizer-model", spm_model, "--append-eod", "--strict", "--workers",
                   workers, "--chunk-mb", chunk_mb, check=False)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, proc.stderr
    assert f"{tmp_path / 'mixed.jsonl'}:5: invalid JSON: Unterminated string" in errors[0]
    assert not out_dir.exists() or os.listdir(out_dir) == [], os.listdir(out_dir)


@CHUNKINGS
@pytest.mark.parametrize("workers", [1, 2])
def test_every_bad_kind_is_skipped_and_listed(tmp_path, spm_model, workers, chunk_mb):
    tok = T5Tokenizer(str(spm_model))
    write_mixed(tmp_path / "mixed.jsonl")
    out = tmp_path / "out" / "m"
    proc = run_cli("--input", tmp_path / "mixed.jsonl", "--output-prefix", out,
                   "--tokenizer-model", spm_model, "--append-eod", "--workers", workers,
                   "--chunk-mb", chunk_mb)
    expected = [(n, reason) for n, (_, reason) in enumerate(MIXED_LINES, 1) if reason]
    assert f"skipped {len(expected)} bad lines" in proc.stderr
    report = Path(f"{out}_bad_lines.tsv").read_text(encoding="utf-8").splitlines()
    assert report[0] == "file\tline\treason"
    rows = [r.split("\t") for r in report[1:]]
    assert [(f, int(n)) for f, n, _ in rows] == [(str(tmp_path / "mixed.jsonl"), n)
                                                 for n, _ in expected]
    for (_, _, got), (_, reason) in zip(rows, expected):
        assert got.startswith(reason), (got, reason)
    ds = IndexedDataset(f"{out}_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == [
        tok.encode(text) + [tok.eod] for text in mixed_good_texts()]
    assert sorted(os.listdir(out.parent)) == [
        "m_bad_lines.tsv", "m_text_document.bin", "m_text_document.idx",
        "m_text_document.meta.json"]


def test_a_failing_worker_leaves_no_temporaries(tmp_path, spm_model, monkeypatch):
    def broken(self, *args, **kwargs):
        raise RuntimeError("tokenizer broke")

    # Workers are forked, so they inherit the patch.
    monkeypatch.setattr(T5Tokenizer, "encode_batch", broken)
    write_jsonl(tmp_path / "in.jsonl", GOOD)
    out_dir = tmp_path / "out"
    with pytest.raises(RuntimeError, match="tokenizer broke"):
        preprocess_data.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                              str(out_dir / "m"), "--tokenizer-model", str(spm_model),
                              "--workers", "2", "--chunk-mb", "0.00005", "--no-progress"])
    assert os.listdir(out_dir) == []


def _sigterm_bits(status_path):
    fields = dict(line.split(":\t", 1) for line in Path(status_path).read_text().splitlines()
                  if ":\t" in line)
    bit = 1 << (signal.SIGTERM - 1)
    return bool(int(fields["SigBlk"], 16) & bit), bool(int(fields["SigCgt"], 16) & bit)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc")
def test_pool_threads_hold_sigterm_for_the_workers_they_fork(spm_model, tmp_path):
    # CPython's Pool may fork a worker from its own thread while terminate() runs; under the main
    # process's Python SIGTERM handler that worker would lose terminate()'s SIGTERM and hang it.
    args = preprocess_data.get_args(["--input", "x", "--output-prefix", str(tmp_path / "o"),
                                     "--tokenizer-model", str(spm_model), "--workers", "2"])
    old = signal.signal(signal.SIGTERM, pool_workers.on_sigterm)
    before = {p.name for p in Path("/proc/self/task").iterdir()}
    with pool_workers.sigterm_held():
        pool, stop = pool_workers.start_pool(args)
    try:
        pool.apply(os.getpid)  # one worker has run its initializer; the other may still be starting
        tasks = [p for p in Path("/proc/self/task").iterdir() if p.name not in before]
        assert tasks and all(_sigterm_bits(t / "status")[0] for t in tasks)  # blocked
        assert _sigterm_bits(f"/proc/self/task/{threading.get_native_id()}/status")[0] is False
        workers = multiprocessing.active_children()
        assert len(workers) == 2
        # Each worker, once its initializer has run: neither blocked nor caught, the default
        # action (death). A worker forked but not yet initialised still shows the inherited
        # (blocked, caught) state, so wait for the initializers, not for a fixed time.
        deadline = time.monotonic() + 60
        bits = [_sigterm_bits(f"/proc/{w.pid}/status") for w in workers]
        while any(b != (False, False) for b in bits) and time.monotonic() < deadline:
            time.sleep(0.05)
            bits = [_sigterm_bits(f"/proc/{w.pid}/status") for w in workers]
        assert bits == [(False, False)] * 2
    finally:
        pool_workers.stop_pool(pool, stop)
        signal.signal(signal.SIGTERM, old)


@pytest.mark.skipif(sys.platform != "linux", reason="the workers are forked on Linux only")
def test_stopping_the_pool_skips_chunks_not_started_and_ends_workers_cleanly(
        spm_model, tmp_path, mixed_texts, monkeypatch):
    encode_batch = T5Tokenizer.encode_batch
    started = multiprocessing.get_context("fork").Semaphore(0)

    def held(self, texts, num_threads=1):  # each worker keeps its first chunk until the stop
        started.release()
        deadline = time.monotonic() + 120
        while not pool_workers.worker_state["stop"].value and time.monotonic() < deadline:
            time.sleep(0.01)
        return encode_batch(self, texts, num_threads=num_threads)

    monkeypatch.setattr(T5Tokenizer, "encode_batch", held)  # workers are forked: they have it
    args = preprocess_data.get_args(["--input", "x", "--output-prefix", str(tmp_path / "o"),
                                     "--tokenizer-model", str(spm_model), "--workers", "2"])
    lines = [json.dumps({"text": t}, ensure_ascii=False).encode() + b"\n" for t in mixed_texts]
    chunk = Chunk(0, 1, lines, sum(map(len, lines)), 0)
    assert chunk.nbytes > 4 * 65536  # bigger than a pipe holds, as in the runs that hung
    with pool_workers.sigterm_held():
        pool, stop = pool_workers.start_pool(args)
    workers = multiprocessing.active_children()
    in_flight = [pool.apply_async(pool_workers.process_chunk, (chunk,)) for _ in range(8)]
    assert all(started.acquire(timeout=120) for _ in workers)  # both have a chunk in hand
    pool_workers.stop_pool(pool, stop)
    # Every worker left through the pool's own stop sentinel (exit 0), none was killed; each
    # finished the chunk in its hands, the others were skipped.
    assert sorted(w.exitcode for w in workers) == [0, 0]
    documents = [r.get(timeout=0).documents for r in in_flight]
    assert sorted(documents) == [0] * 6 + [len(mixed_texts)] * 2, documents
