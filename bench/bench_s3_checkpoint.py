"""Checkpoints on S3 (`--save s3://`, `--load s3://`): our upload and download against boto3's
own, the step held by --async-save against a synchronous save, and the requests a save sends.

    python bench/bench_s3_checkpoint.py [--repeats 7] [--work DIR] [--no-write]

The server is `rclone serve s3` (tests/objectstore/s3_server.py, `--etag-hash "" --dir-cache-time
1h`: see ETAG_OFF) pinned to core 0 (`taskset -a -p -c 0`). In one process:

1. Two trainer runs (`torchrun --nproc_per_node 2`, gloo, CPU, fp32, ZeRO-1, 12 steps, saves at
   4, 8, 12, `--keep-last 2`) on a 21 M-parameter model whose checkpoint with Adam's states is
   320 MiB, `--save s3://` synchronously and with `--async-save`: the step held per save from
   the trainer's log line (mean of the saves at 4 and 8), and every HTTP request each rank sent
   (a `before-send` hook on every botocore client, installed in the ranks by a sitecustomize.py
   on PYTHONPATH), grouped by the save it belongs to; from them, a 256-rank save on paper.
2. The files of the synchronous run's last checkpoint (iteration 12, as the trainer wrote them)
   go up `--repeats` times, then come back as often, this process pinned to core 1, ours and
   boto3's in alternating order: ours (RemoteFolder.upload_files, 32 MiB parts and 16 requests
   at once as the trainer's defaults, then confirm: a listing of the folder) against boto3's
   `upload_file` (s3transfer's default TransferConfig: 8 MiB parts, 10 threads) of the same
   files one by one; ours (RemoteFolder.download_files, what stage_for_load calls) against
   boto3's `download_file`, and download_files as it was before this bench's fix. Medians, the
   CPU seconds of client and server, the requests of each.
3. The uploads again on a server with rclone's default MD5 ETags.

Results go to bench/RESULTS.md (section "s3_checkpoint").
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "objectstore")]

from bench.common import (  # noqa: E402
    machine_line,
    markdown_table,
    prepare_data,
    run_torchrun,
    saves_in_log,
    train_flags,
    write_section,
)

MODEL = dict(vocab_size=8100, d_model=512, d_kv=64, d_ff=1024, num_layers=2,
             num_decoder_layers=2, num_heads=8, feed_forward_proj="gated-gelu",
             tie_word_embeddings=False, dropout_rate=0.0)
BUCKET = "t5bench"
SAVES = (4, 8, 12)
ITER_RE = re.compile(r"/iter_(\d+)/")
MIB = 2 ** 20

HOOK = '''\
"""bench_s3_checkpoint's request counter: every HTTP request of every botocore client of this
process, one JSON line each (operation, method, path, bytes sent, time, RANK)."""
import os

if os.environ.get("S3BENCH_REQUESTS"):
    import json
    import threading
    import time
    from urllib.parse import urlsplit

    import botocore.session

    _lock = threading.Lock()
    _path = os.path.join(os.environ["S3BENCH_REQUESTS"], f"{os.getpid()}.jsonl")
    _create = botocore.session.Session.create_client

    def _count(request, event_name, **_):
        line = json.dumps({"rank": os.environ.get("RANK"), "op": event_name.rsplit(".", 1)[-1],
                           "path": urlsplit(request.url).path, "t": time.time(),
                           "bytes": int(request.headers.get("Content-Length") or 0)})
        with _lock, open(_path, "a") as f:
            f.write(line + "\\n")

    def _create_client(self, *args, **kwargs):
        client = _create(self, *args, **kwargs)
        client.meta.events.register("before-send.s3", _count)
        return client

    botocore.session.Session.create_client = _create_client
'''


# the trainer ---------------------------------------------------------------------------------
def trainer_run(paths, work: Path, server, name: str, extra: List[str]) -> Dict:
    """One trainer run saving to s3://BUCKET/NAME; its saves and its requests."""
    requests = work / f"requests_{name}"
    shutil.rmtree(requests, ignore_errors=True)
    requests.mkdir(parents=True)
    flags = train_flags(paths, "bench", SAVES[-1], [
        "--zero-stage", "1", "--micro-batch-size", "1", "--encoder-seq-length", "64",
        "--save", f"s3://{BUCKET}/{name}", "--save-interval", str(SAVES[0]), "--keep-last", "2",
        "--checkpoint-staging-path", str(work / f"staging_{name}"), *extra])
    log = work / f"{name}.log"
    env = dict(server.env(), S3BENCH_REQUESTS=str(requests),
               PYTHONPATH=os.pathsep.join([str(work / "hook"), str(REPO),
                                           os.environ.get("PYTHONPATH", "")]))
    result = run_torchrun(flags, log, env=env)
    text = log.read_text()
    saves = {str(i): save for i, save in saves_in_log(text).items()}
    if sorted(map(int, saves)) != list(SAVES):
        sys.exit(f"{name}: expected saves at {SAVES} in {log}, found {sorted(saves)}")
    sent = sorted((json.loads(line) for f in requests.glob("*.jsonl")
                   for line in f.read_text().splitlines()), key=lambda r: r["t"])
    return {"saves": saves, "wall_s": result.wall_s, "requests": by_save(sent)}


def what(path: str) -> str:
    """The object a request's path names, by kind."""
    if "/" not in path.strip("/"):
        return "(bucket: a listing or a batch)"
    for part, kind in (("optim_states", "optimizer shard"), ("model_states", "model states"),
                       ("/rng/", "RNG state"), ("meta.json", "meta.json"),
                       ("latest", "tracker"), (".py", "DeepSpeed's scripts"),
                       (".write-probe", "write probe")):
        if part in path:
            return kind
    return path.rsplit("/", 1)[-1]


def by_save(sent: List[Dict]) -> Dict[str, Dict[str, Dict[str, List[int]]]]:
    """{save: {rank: {"OPERATION KIND": [count, bytes sent]}}}: a request naming an
    iteration's object belongs to that save; one naming none (the tracker, listings, batch deletes, the multipart
    listing) to the save whose objects came last before it; those before any to "start-up"."""
    out: Dict = collections.defaultdict(lambda: collections.defaultdict(
        lambda: collections.defaultdict(lambda: [0, 0])))
    current = "start-up"
    for r in sent:
        found = ITER_RE.search(r["path"])
        if found and r["op"] != "DeleteObjects":
            current = str(int(found.group(1)))
        cell = out[current][f"rank {r['rank']}"][f"{r['op']} {what(r['path'])}"]
        cell[0] += 1
        cell[1] += r["bytes"]
    return json.loads(json.dumps(out))


# ours against boto3 --------------------------------------------------------------------------
def download_before(folder, pairs, down: Path, tally) -> None:
    """RemoteFolder.download_files before this bench's fix: a file per thread, each through the
    data's ObjectStorage.download (64 MiB ranged GETs one after another, then an fsync)."""
    if tally is not None:
        counter(folder.objects.client(), tally)
        getter = folder.objects.getter()  # ranged GETs of its own (s3_get.py)
        get = getter.get

        def counted(*args, **kwargs):
            tally["GetObject"] += 1
            return get(*args, **kwargs)
        getter.get = counted
    for _, rel in pairs:
        (down / rel).parent.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(folder.storage.upload_concurrency) as pool:
        list(pool.map(lambda rel: folder.objects.download(folder.url_of(rel), str(down / rel)),
                      [rel for _, rel in pairs]))


def counter(client, counts):
    def count(event_name, **_):
        counts[event_name.rsplit(".", 1)[-1]] += 1
    client.meta.events.register("before-send.s3", count)


def throughput(server, source: Path, work: Path, repeats: int,
               phases=("save", "load")) -> Dict:
    """Seconds per upload (and download) of the files under `source`, ours and boto3's."""
    import boto3

    from megatron.checkpoint.io.remote import RemoteFolder
    from megatron.config.training import CheckpointStorage

    storage = CheckpointStorage()
    files = sorted(p for p in source.rglob("*") if p.is_file())
    pairs = [(str(p), p.relative_to(source).as_posix()) for p in files]
    total = sum(p.stat().st_size for p in files)
    admin = server.client()
    counts = {k: collections.Counter() for k in ("ours save", "boto3 save", "ours load",
                                                 "boto3 load", "before load")}
    seconds: Dict[str, List[float]] = collections.defaultdict(list)
    used: Dict[str, List[List[float]]] = collections.defaultdict(list)  # [client, server] CPU s
    rclone = psutil.Process(server._proc.pid)

    def cpu_now() -> List[float]:
        mine = resource.getrusage(resource.RUSAGE_SELF)
        return [mine.ru_utime + mine.ru_stime, sum(rclone.cpu_times()[:2])]
    down = work / "downloaded"

    def clear(prefix: str) -> None:
        keys = [{"Key": o["Key"]} for page in admin.get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, Prefix=prefix + "/") for o in page.get("Contents", [])]
        if keys:
            admin.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})

    def save(who: str, r: int) -> None:
        prefix, tally = f"up-{who}-{r}", counts[f"{who} save"] if r == 0 else None
        start, cpu = time.perf_counter(), cpu_now()
        if who == "ours":
            folder = RemoteFolder(f"s3://{BUCKET}/{prefix}", storage)
            if tally is not None:
                counter(folder.objects.client(), tally)
            folder.confirm(folder.upload_files(pairs))
        else:
            client = boto3.session.Session().client("s3")
            if tally is not None:
                counter(client, tally)
            for path, rel in pairs:
                client.upload_file(path, BUCKET, f"{prefix}/{rel}")
        seconds[f"{who} save"].append(time.perf_counter() - start)
        used[f"{who} save"].append([b - a for a, b in zip(cpu, cpu_now())])

    def load(who: str, r: int) -> None:
        shutil.rmtree(down, ignore_errors=True)
        down.mkdir(parents=True)
        prefix, tally = "up-ours-0", counts[f"{who} load"] if r == 0 else None
        start, cpu = time.perf_counter(), cpu_now()
        if who == "ours":
            folder = RemoteFolder(f"s3://{BUCKET}/{prefix}", storage)
            if tally is not None:
                counter(folder.objects.client(), tally)
            folder.download_files((rel, down / rel) for _, rel in pairs)
        elif who == "before":
            download_before(RemoteFolder(f"s3://{BUCKET}/{prefix}", storage), pairs, down, tally)
        else:
            client = boto3.session.Session().client("s3")
            if tally is not None:
                counter(client, tally)
            for _, rel in pairs:
                (down / rel).parent.mkdir(parents=True, exist_ok=True)
                client.download_file(BUCKET, f"{prefix}/{rel}", str(down / rel))
        seconds[f"{who} load"].append(time.perf_counter() - start)
        used[f"{who} load"].append([b - a for a, b in zip(cpu, cpu_now())])
        got = sum(p.stat().st_size for p in down.rglob("*") if p.is_file())
        if got != total:
            sys.exit(f"{who} downloaded {got} bytes of {total}")

    # each phase's repeats back to back: the downloads' writeback does not meet the uploads
    for r in range(repeats):
        order = ("ours", "boto3") if r % 2 == 0 else ("boto3", "ours")
        for who in order:
            save(who, r)
        for who in order:
            if r > 0:
                clear(f"up-{who}-{r}")
    for r in range("load" in phases and repeats):
        # the code before the fix last: a reference, never in the first (slower) place
        for who in (("ours", "boto3") if r % 2 == 0 else ("boto3", "ours")) + ("before",):
            load(who, r)
    print(", ".join(f"{k} {' '.join(f'{x:.2f}' for x in v)} s"
                    for k, v in sorted(seconds.items())), flush=True)
    shutil.rmtree(down, ignore_errors=True)
    return {"files": [[rel, os.path.getsize(path)] for path, rel in pairs], "bytes": total,
            "seconds": dict(seconds), "cpu": dict(used), "counts": {k: dict(v) for k, v in counts.items()}}


# the run -------------------------------------------------------------------------------------
ETAG_OFF = ("--etag-hash", "")
"""rclone's local backend stores no ETag: by default it hashes a new object's whole file (MD5)
at the first HEAD or listing that shows it (0.18 s of its core for 120 MiB), which S3, Ceph RGW
and MinIO, storing the ETag at the write, do not; confirm's HEADs would pay it and boto3's
upload_file, which sends none, would not. So the server runs without ETags (as
bench_object_storage's), and the upload is measured again on a server with rclone's default."""


def pinned_server(extra):
    """An S3Server on core 0 with `extra` arguments, the environment pointing at it, BUCKET made.
    --dir-cache-time 1h: objects come through the S3 API, which rclone's folder cache sees."""
    from s3_server import S3Server

    server = S3Server(extra_args=(*extra, "--dir-cache-time", "1h"))
    subprocess.run(["taskset", "-a", "-p", "-c", "0", str(server._proc.pid)], check=True,
                   stdout=subprocess.DEVNULL)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION"):
        os.environ.pop(name, None)
    os.environ.update(server.env())
    server.make_bucket(BUCKET)
    return server


def rclone_version(binary: str) -> str:
    out = subprocess.run([binary, "version"], capture_output=True, text=True).stdout
    return (out.splitlines() or ["rclone (version unknown)"])[0].strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--work", type=Path, default=Path("/tmp/t5_bench_s3_checkpoint"))
    parser.add_argument("--no-write", action="store_true", help="print, do not edit RESULTS.md")
    parser.add_argument("--report", action="store_true",
                        help="only write the report of WORK/results.json again")
    args = parser.parse_args(argv)
    if args.report:
        text = report(json.loads((args.work / "results.json").read_text()))
        print(text)
        if not args.no_write:
            write_section("s3_checkpoint", text)
        return 0
    began = time.perf_counter()
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "hook").mkdir(exist_ok=True)
    (args.work / "hook" / "sitecustomize.py").write_text(HOOK)
    paths = prepare_data(args.work / "training")
    paths["bench"] = args.work / "model.json"
    paths["bench"].write_text(json.dumps(MODEL, indent=1) + "\n")
    server = pinned_server(ETAG_OFF)
    try:
        runs = {name: trainer_run(paths, args.work, server, name, extra)
                for name, extra in (("sync", []), ("async", ["--async-save"]))}
        source = args.work / "checkpoint"
        shutil.rmtree(source, ignore_errors=True)
        shutil.copytree(server.root / BUCKET / "sync" / f"iter_{SAVES[-1]:07d}", source)
        os.sched_setaffinity(0, {1})  # the client on the other core than the server
        speed = throughput(server, source, args.work, args.repeats)
    finally:
        server.close()
    server = pinned_server(())  # rclone's default: an MD5 of each new object at its first HEAD
    try:
        hashing = throughput(server, source, args.work, args.repeats, ("save",))
    finally:
        server.close()
    speed["rclone"] = rclone_version(server.rclone)
    data = {"runs": runs, "speed": speed, "hashing": hashing, "wall_s": time.perf_counter() - began,
            "repeats": args.repeats}
    (args.work / "results.json").write_text(json.dumps(data, indent=1))
    text = report(data)
    print(text)
    if not args.no_write:
        write_section("s3_checkpoint", text)
    return 0


def _held(run: Dict) -> float:
    """Seconds the step was held per save, waits for the previous save included (the mean of
    the saves before the last: the last is waited for at the end of the run)."""
    return statistics.mean(run["saves"][str(i)]["held_s"] + run["saves"][str(i)]["waited_s"]
                           for i in SAVES[:-1])


def _requests_table(run: Dict, save: str) -> List[str]:
    rows = []
    per_rank = run["requests"][save]
    keys = sorted({k for rank in per_rank.values() for k in rank})
    for key in keys:
        op, kind = key.split(" ", 1)
        cells = []
        for rank in ("rank 0", "rank 1"):
            count, sent = per_rank.get(rank, {}).get(key, [0, 0])
            cells += [count or "", f"{sent / MIB:.2f}" if sent else ""]
        rows.append([op, kind, *cells])
    totals = []
    for rank in ("rank 0", "rank 1"):
        cells = per_rank.get(rank, {}).values()
        totals += [f"**{sum(c for c, _ in cells)}**", f"**{sum(b for _, b in cells) / MIB:.1f}**"]
    rows.append(["all", "", *totals])
    return markdown_table(["request", "object", "rank 0", "MiB sent", "rank 1", "MiB sent"],
                          rows)


def _estimate(data: Dict) -> str:
    """The save of the bench's layout (ZeRO-1, data parallel only) of this model at 256 ranks,
    from the requests counted per object kind (on paper: the optimizer shard is 1/256 of the
    states instead of 1/2; every other object keeps its size)."""
    files = dict(data["speed"]["files"])
    shard = 2 * sum(n for rel, n in files.items() if "optim_states" in rel) / 256
    model = sum(n for rel, n in files.items() if "model_states" in rel)
    rng = max(n for rel, n in files.items() if rel.startswith("rng/"))
    part = 32 * MIB

    def puts(size: float) -> int:  # s3transfer: multipart above the part size
        return 1 if size <= part else 2 + -(-int(size) // part)
    objects = 1 + 2 * 256  # in the manifest: the model states, each rank's shard and RNG file
    per_rank = puts(shard) + puts(rng)
    # rank 0's other requests, as counted (the commit's confirm: one listing of the iteration
    # folder per 1000 objects, a HEAD only for an object the listing does not show whole)
    counted = {str(i): data["runs"]["sync"]["requests"][str(i)]["rank 0"] for i in SAVES[1:]}
    middle = counted[str(SAVES[1])]
    heads = sum(c for k, (c, _) in middle.items() if k.startswith("HeadObject "))
    own = sum(c for k, (c, _) in middle.items() if not k.startswith("HeadObject ")
              and k.split(" ", 1)[1] in ("optimizer shard", "model states", "RNG state"))
    others = sum(c for c, _ in middle.values()) - heads - own
    pruned = sum(c for c, _ in counted[str(SAVES[-1])].values()) - \
        sum(c for c, _ in middle.values())
    rank0 = per_rank + puts(model) + heads + others  # one listing: up to 1000 objects
    return (
        f"**At 256 ranks** (on paper, from the counts above; the same model and layout, ZeRO-1 "
        f"over 256 data-parallel ranks, 32 MiB parts): a save is {objects} objects in the "
        f"iteration folder ({objects - 1} of them 2 per rank: its optimizer shard of "
        f"{shard / MIB:.2f} MiB (the states / 256) and its RNG file of {rng / 1024:.0f} KiB; "
        f"the model states, {model / MIB:.0f} MiB, once) plus meta.json, DeepSpeed's two "
        f"scripts and the two tracker objects. Each rank other than 0 sends {per_rank} "
        f"requests ({'a PUT each' if per_rank == 2 else 'multipart for the shard'}) and "
        f"{(shard + rng) / MIB:.2f} MiB; rank 0 sends about {rank0} ({puts(model)} for the "
        f"model states, {heads} HEADs at the commit (counted here for {1 + 2 * 2} objects: "
        f"the commit confirms them by one listing of the iteration folder, 1000 objects a "
        f"request, and so {objects}), and {others} others as counted here: that listing, "
        f"meta.json, the scripts, the tracker's 2 PUTs, the multipart listing and the "
        f"iterations' listing) and {(shard + rng + model) / MIB:.1f} MiB; a save that prunes "
        f"(`--keep-last`) adds {pruned} here (the old folder's listing, 1000 keys a page, and "
        f"a batch delete per 1000 keys: still 2 for {objects} objects). The whole job: about "
        f"{255 * per_rank + rank0} requests and {(256 * (shard + rng) + model) / MIB:.0f} MiB "
        f"per save (before the listing, the commit sent a HEAD per object: {objects} from "
        f"rank 0 alone). The {256 * per_rank} PUTs of the ranks "
        f"are well under the 3,500 PUTs a second S3 takes per prefix even when sent in the "
        f"same second. "
        f"For a larger model the bytes per rank are its optimizer states / 256 (12 bytes a "
        f"parameter with fp32 Adam) and the requests grow by one UploadPart per 32 MiB.")


def _speed_rows(speed: Dict, phases, label: str) -> List[List[str]]:
    mib = speed["bytes"] / MIB
    rows = []
    for phase in phases:
        ours, boto = (statistics.median(speed["seconds"][f"{who} {phase}"])
                      for who in ("ours", "boto3"))
        each = " ".join(f"{b / o:.2f}" for o, b in zip(speed["seconds"][f"ours {phase}"],
                                                        speed["seconds"][f"boto3 {phase}"]))
        asks = {who: ", ".join(f"{n} {op}" for op, n in speed["counts"][f"{who} {phase}"].items())
                for who in ("ours", "boto3")}
        cpu = {who: [statistics.median(c[i] for c in speed["cpu"][f"{who} {phase}"])
                     for i in (0, 1)] for who in ("ours", "boto3")}
        rows.append([phase + label, f"{ours:.2f}", f"{mib / ours:.0f}",
                     "{:.2f} / {:.2f}".format(*cpu["ours"]), f"{boto:.2f}", f"{mib / boto:.0f}",
                     "{:.2f} / {:.2f}".format(*cpu["boto3"]), f"**{boto / ours:.2f}x**", each,
                     asks["ours"], asks["boto3"]])
    return rows


def _verdict(speed: Dict) -> str:
    """Whether the medians meet the goal, and how far single repeats spread."""
    parts = []
    for phase in ("save", "load"):
        ours, boto = speed["seconds"][f"ours {phase}"], speed["seconds"][f"boto3 {phase}"]
        each = [b / o for o, b in zip(ours, boto)]
        ratio = statistics.median(boto) / statistics.median(ours)
        parts.append(f"{phase} {ratio:.2f}x ({'meets' if ratio >= 1.0 else 'misses'} the goal; "
                     f"single repeats {min(each):.2f}x to {max(each):.2f}x)")
    return ("Goal: >= 1.0x each. This run: " + ", ".join(parts) + ". The server's one core is "
            "the bottleneck (its CPU seconds are most of each transfer's wall time) and the "
            "machine's other sessions share it, so a spread of single repeats this wide says "
            "the two are level within what this machine can tell apart; ours sends a quarter of "
            "boto3's requests (32 MiB parts and ranges against 8 MiB), which is what an S3 "
            "bill counts.")


def _requests_text(sync: Dict, asyn: Dict) -> List[str]:
    last, middle = str(SAVES[-1]), str(SAVES[1])
    return [
        "Requests, counted for real: a botocore `before-send` hook on every client of each rank "
        "(installed by a sitecustomize.py on the ranks' PYTHONPATH) writes one line per HTTP "
        "request sent (a retry would count again). The synchronous run's "
        f"save at step {middle} (a save that deletes nothing):",
        "",
        *_requests_table(sync, middle),
        "",
        f"The save at step {last}, which also deletes iteration {SAVES[0]} (`--keep-last 2`):",
        "",
        *_requests_table(sync, last),
        "",
        "Start-up (each rank, before the first step): "
        + ", ".join(f"{n} {k}" for k, (n, _) in sync["requests"]["start-up"]["rank 0"].items())
        + ". The asynchronous run sends the same requests "
        + ("(counted: equal per save)." if all(
            {k: v[0] for k, v in sync["requests"][str(i)][r].items()}
            == {k: v[0] for k, v in asyn["requests"][str(i)][r].items()}
            for i in SAVES for r in ("rank 0", "rank 1")) else "but for the differences in "
           "results.json.") + " A load by rank r (stage_for_load): rank 0 HEADs the tracker, "
        "meta.json and every object the run reads; each rank then sends a HEAD and one GET per "
        "32 MiB of each file it reads (the table above: ours, load).",
        "",
    ]


def report(data: Dict) -> str:
    speed, runs = data["speed"], data["runs"]
    sync, asyn = runs["sync"], runs["async"]
    mib = speed["bytes"] / MIB
    rows = _speed_rows(speed, ("save", "load"), "") + \
        _speed_rows(data["hashing"], ("save",), " (rclone's MD5 ETags)")
    before = dict(speed, seconds={"ours load": speed["seconds"]["before load"],
                                  "boto3 load": speed["seconds"]["boto3 load"]},
                  cpu={"ours load": speed["cpu"]["before load"],
                       "boto3 load": speed["cpu"]["boto3 load"]},
                  counts={"ours load": speed["counts"]["before load"],
                          "boto3 load": speed["counts"]["boto3 load"]})
    rows += _speed_rows(before, ("load",), ", before the fix")
    saves = []
    for name, r in (("synchronous", sync), ("--async-save", asyn)):
        for i in SAVES:
            s = r["saves"][str(i)]
            saves.append([name, i, f"{s['mib']:.0f}", f"{s['held_s']:.2f}", f"{s['waited_s']:.2f}",
                          f"{s['written_s']:.2f}"])
    files = ", ".join(f"{rel} {n / MIB:.2f} MiB" if n >= MIB else f"{rel} {n / 1024:.0f} KiB"
                      for rel, n in speed["files"])
    last = str(SAVES[-1])
    return "\n".join([
        "## S3 checkpoints (`--save s3://`, `--load s3://`: ours against boto3, --async-save, "
        "requests per save)",
        "",
        f"Command: `python bench/bench_s3_checkpoint.py --repeats {data['repeats']}` "
        f"({data['wall_s'] / 60:.1f} min)",
        f"Machine: {machine_line()}; the S3 server ({speed['rclone']} `serve s3`, "
        "tests/objectstore/s3_server.py, `--etag-hash \"\" --dir-cache-time 1h`, its files on "
        "the local disk) "
        "pinned to core 0 (`taskset -a -p -c 0`); the transfers' process pinned to core 1; the "
        "trainer's two ranks not pinned (they share core 0 with the server). Six other "
        "sessions ran on the same 2 cores: single repeats vary widely, hence medians.",
        "",
        f"The checkpoint: the files of iteration {last} of the synchronous trainer run below, "
        f"as the trainer wrote them ({len(speed['files'])} files, {mib:.1f} MiB: {files}). "
        "Model: 21 M parameters (d_model 512, d_ff 1024 gated-gelu, 2 + 2 layers, vocabulary "
        "8100 padded to 8192), fp32, ZeRO-1, `torchrun --nproc_per_node 2` (gloo, CPU). "
        "Ours: RemoteFolder.upload_files (one s3transfer manager for all files, 32 MiB parts, "
        "16 requests at once: the trainer's defaults) then confirm (a listing of the folder), and "
        "RemoteFolder.download_files (what stage_for_load calls). boto3: `upload_file` / "
        "`download_file` of the same files one after another, default TransferConfig (8 MiB "
        f"parts, 10 threads), a client from the environment. {data['repeats']} repeats of the "
        "uploads, then of the downloads, the two alternating in order; medians; speed = boto3's seconds / ours; CPU: seconds of "
        "this process (all its threads) and of the server during the transfer.",
        "",
        *markdown_table(["", "ours (s)", "ours MiB/s", "CPU s: client / server", "boto3 (s)",
                         "boto3 MiB/s", "CPU s: client / server", "speed", "each repeat",
                         "ours: requests", "boto3: requests"], rows),
        "",
        _verdict(speed),
        "",
        "The third row: the upload again on a server with rclone's default "
        "`--etag-hash MD5`, which hashes a new object's whole file at the first HEAD or "
        "listing that shows it (0.18 s of the server's core for 120 MiB, then cached): our "
        "confirm (the listing that makes sure every object is there, whole, before the "
        "tracker moves) pays an MD5 of the whole checkpoint on the server's one core, boto3's "
        "upload_file sends no request after the upload. S3, Ceph RGW and MinIO store the ETag "
        "at the write and answer from metadata, so the first two rows, on a server without ETags, are "
        "the ones that stand for them. The row \"load, before the fix\": "
        "RemoteFolder.download_files as it was (each file on a thread through the data's "
        "ObjectStorage.download: 64 MiB ranged GETs one after another, then an fsync), "
        "measured in the same repeats (always after ours and boto3's); it now goes through the same transfer manager as the "
        "upload (32 MiB ranged GETs of every file at once, no fsync of the staging copy).",
        "",
        f"`--async-save` to s3:// (the same trainer, 12 steps, saves at "
        f"{', '.join(map(str, SAVES))}, `--keep-last 2`, `--save s3://t5bench/RUN`): held = how "
        "long the save held the training loop (synchronously: the writing and the upload of "
        "this rank's files), waited = the part of it spent waiting for the previous "
        "asynchronous save, from the trainer's log lines.",
        "",
        *markdown_table(["saves", "step", "MiB", "held (s)", "waited (s)",
                         "written + uploaded (s per rank)"], saves),
        "",
        f"Held per save (mean of the saves at {SAVES[0]} and {SAVES[1]}, waits included): "
        f"synchronous {_held(sync):.2f} s, asynchronous {_held(asyn):.2f} s: "
        f"**{_held(asyn) / _held(sync):.1%}** of synchronous (goal: at most 10%). Whole runs: "
        f"{sync['wall_s']:.1f} s synchronous, {asyn['wall_s']:.1f} s asynchronous.",
        "",
        *_requests_text(sync, asyn),
        _estimate(data),
    ])


if __name__ == "__main__":
    raise SystemExit(main())
