"""Does a busy host slow the step loop's Python? A Python workload like the loop's (dicts, lists,
attribute access, small numpy over 64 requests) timed alone and beside: N threads hashing (no GIL), and
llguidance filling 64 masks of the `structured` GPU stage's schema on its executor (a recorded random
walk, replayed as the engine's helper does), continuously or with a 2 ms gap between fills. Prints the
host's lscpu, then wall and thread-CPU microseconds per workload call for each condition. With
--siblings: the workload pinned to CPU 0, timed with one hashing thread pinned to each other CPU in turn
(an SMT sibling the hypervisor hides from the guest would stand out as the one that slows it most).

    python benchmarks/host_contention.py TOKENIZER_DIR [OUT.json]
    python benchmarks/host_contention.py --siblings OUT.json
"""

import hashlib
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from grammar_masks import SCHEMA  # noqa: E402

from tokenmill.sampling_params import StructuredOutputsParams  # noqa: E402
from tokenmill.structured_outputs import StructuredOutputs  # noqa: E402


class Req:
    def __init__(self, i):
        self.request_id = f"r{i}"
        self.num_computed_tokens = 300 + i
        self.num_tokens = 301 + i
        self.output = []
        self.grammar = None


def workload(reqs, arr):
    d = {r.request_id: r for r in reqs}
    out = []
    for r in reqs:
        if r.num_computed_tokens + 1 >= r.num_tokens:
            out.append((r.request_id, r.num_tokens - r.num_computed_tokens))
        r.output.append(len(out))
        if len(r.output) > 64:
            r.output.clear()
    ids = [d[k].num_tokens for k, _ in out]
    a = np.asarray(ids, np.int64)
    b = arr[: len(a)] + a
    return int(b.sum())


def measure(seconds=2.0):
    reqs = [Req(i) for i in range(64)]
    arr = np.zeros(64, np.int64)
    n = 0
    t0, c0 = time.perf_counter(), time.thread_time()
    while time.perf_counter() - t0 < seconds:
        for _ in range(100):
            workload(reqs, arr)
        n += 100
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return {"us_wall": round(wall / n * 1e6, 2), "us_cpu": round(cpu / n * 1e6, 2)}


def hashers(count, stop, cpu=None):
    """count threads hashing (sha256 lets the GIL go) until stop is set, on CPU `cpu` if given."""
    buf = os.urandom(1 << 20)

    def burn():
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        while not stop.is_set():
            hashlib.sha256(buf).digest()

    threads = [threading.Thread(target=burn, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    return threads


def llg_filler(mask_threads, gap_s, stop, stats):
    from transformers import AutoTokenizer

    tok_dir = sys.argv[1]
    vocab = 49152
    structured = StructuredOutputs(
        lambda: AutoTokenizer.from_pretrained(tok_dir), vocab, mask_threads=mask_threads, max_families=64
    )
    constraint = StructuredOutputsParams(json=SCHEMA)
    handed = [structured.matcher(constraint) for _ in range(64)]
    matchers, fam = [m for m, _ in handed], [f for _, f in handed]
    # a random walk recorded first: then the loop below calls llguidance alone (as the helper does)
    rng = np.random.default_rng(0)
    walk = []
    for _ in range(128):
        mask = structured.fill_bitmask(matchers, fam)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little").reshape(64, -1)[:, :vocab]
        step = []
        for row, m in enumerate(matchers):
            allowed = np.flatnonzero(bits[row])
            if not m.is_stopped() and len(allowed):
                t = int(rng.choice(allowed))
                m.consume_token(t)
                step.append((m, t))
        walk.append(step)
    executor = structured._executor
    out = np.zeros((64, structured.words), np.int32)
    work = list(zip(matchers, range(64)))
    ready = threading.Event()

    def run():
        fills = 0
        busy = 0.0
        ready.set()
        while not stop.is_set():
            for m in matchers:
                m.reset()
            for step in walk:
                if stop.is_set():
                    break
                t0 = time.perf_counter()
                executor.consume_token_par(step)
                executor.unsafe_compute_mask_ptr(work, out.ctypes.data, structured.words * 4, 64)
                busy += time.perf_counter() - t0
                fills += 1
                if gap_s:
                    time.sleep(gap_s)
        stats["fills"] = fills
        stats["fill_ms"] = round(busy / max(fills, 1) * 1e3, 3)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    ready.wait()
    return [t]


def siblings(out: str) -> None:
    """CPU-seconds a workload call pinned to CPU 0 takes, alone and beside a busy thread on each CPU."""
    os.sched_setaffinity(0, {0})

    def speed() -> float:
        return measure(0.25)["us_cpu"]

    result: dict = {"alone": min(speed() for _ in range(3))}
    for cpu in range(1, os.cpu_count() or 1):
        stop = threading.Event()
        threads = hashers(1, stop, cpu)
        time.sleep(0.05)
        result[cpu] = min(speed(), speed())
        stop.set()
        for thread in threads:
            thread.join()
    print(json.dumps(result))
    with open(out, "w") as f:
        json.dump({"us_cpu": result}, f, indent=2)


def main():
    if sys.argv[1] == "--siblings":
        siblings(sys.argv[2])
        return
    info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print(info)
    for cpu in (0, 1):
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        if os.path.exists(path):
            with open(path) as f:
                print(path, f.read().strip())
    results = {}
    sys.setswitchinterval(0.0001)
    conditions = [("alone", None)] + [(f"hash x{n}", n) for n in (2, 4, 8, 12, 14)]
    conditions += [
        ("llg 12 thr continuous", (12, 0.0)),
        ("llg 12 thr gap 2ms", (12, 0.002)),
        ("llg 4 thr gap 2ms", (4, 0.002)),
        ("alone again", None),
    ]
    for name, arg in conditions:
        stop = threading.Event()
        stats = {}
        threads = []
        if isinstance(arg, int):
            threads = hashers(arg, stop)
        elif isinstance(arg, tuple):
            threads = llg_filler(arg[0], arg[1], stop, stats)
        time.sleep(0.2)
        r = measure()
        stop.set()
        for t in threads:
            t.join()
        r.update(stats)
        results[name] = r
        print(name, json.dumps(r), flush=True)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump({"lscpu": info, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
