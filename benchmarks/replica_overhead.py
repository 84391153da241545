"""Host cost of replication per step, on CPU: one code version against another (``--old-tree``).

Four measurements, on virtual CPU devices (``["cpu"] * N``), one intra-op thread (parts 1, 2, 4, 5; part 3 timed the
per-step parameter node that lasting replicas no longer use, and went with it):

1. **Step overhead on a deep, thin model** (300 × Linear(8, 8) / BatchNorm1d(8) / Tanh: 900 modules, negligible
   compute), in sequential mode and, next to it, in threads mode (the path distinct GPUs take): a
   ``DataParallelModel`` + ``DataParallelCriterion`` training step (zero_grad, forward, loss, backward, SGD
   step) divided by the replicas' own work, the same model run plainly on the N shards one after another (forward,
   loss, backward each) plus one optimizer step. Rounds alternate the variants in a rotating order; each round gives
   one paired ratio, and the figure is the median over rounds.
2. **Replication per step** for the seed PyramidNet and PyramidNet-272 (bottleneck, α=200): the old per-step
   ``replicate(model, devices)`` against ``ReplicaSet(model, devices).prepare(N)`` (after the first build), with
   gradients enabled and under ``torch.no_grad()``, and the time of the first build.
4. **Per-step growth** (lasting replicas only): live objects (``gc.get_objects()``), ``tracemalloc`` current memory
   and RSS over 200 steps of (1).
5. **Sync + gradient reduction host time** for the two PyramidNets on the meta device (no data: host work only):
   ``execution_mode``, ``prepare(N)`` and ``watch`` in threads mode plus the reduction of the replicas' gradients onto
   the originals.

Steps and replications are timed in wall-clock and in process CPU time (on a shared machine CPU time is the less
load-sensitive of the two); the garbage collector stays on, and the full collections it runs are counted. Each code
version runs in a worker process of its own (``PYTHONPATH`` = its tree, ``OMP_NUM_THREADS=1``). With
``--old-tree`` a second worker runs an older tree (the per-step ``replicate()`` of commit a03ef68) and every round
times both workers back to back in a rotating order, so before/after pairs come from the same minutes of machine
load::

    python benchmarks/replica_overhead.py
    python benchmarks/replica_overhead.py --old-tree /work/main      # any tree of an older version

The worker adapts to either API (``ReplicaSet`` or per-step ``replicate``; ``execution_mode=`` or ``mode=``), so
``PYTHONPATH=/tmp/mgpu_old python benchmarks/replica_overhead.py --worker`` is the old code under the same protocol.
Results go to ``benchmarks/results/replica_overhead_cpu.{json,md}``; hand-written notes below the marker line of the
markdown file are kept when it is rewritten.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NOTES_MARKER = "<!-- Hand-written notes below this line are kept when the script rewrites this file. -->"
# The issue's "before" figures (replicate() per step, grad enabled, this 2-core CPU), shown as context only.
ISSUE_BEFORE_MS = {
    "seed": {2: 6.9, 4: 15.5, 8: 33.7},
    "pyramidnet272_bottleneck_a200": {2: 20.0, 4: 43.0, 8: 103.0},
}
TARGET = 1.15


# ---------------------------------------------------------------------------------------------------------------------
# Worker: runs in its own process, imports whichever lightning_mgpu its PYTHONPATH holds, answers JSON-line commands.
# ---------------------------------------------------------------------------------------------------------------------
class Worker:
    def __init__(self) -> None:
        import inspect

        import torch

        torch.set_num_threads(1)
        import lightning_mgpu
        import lightning_mgpu.parallel as parallel

        self.torch = torch
        self.parallel = parallel
        self.lasting = hasattr(parallel, "ReplicaSet")
        params = inspect.signature(parallel.DataParallelModel).parameters
        self.mode_kw = "execution_mode" if "execution_mode" in params else "mode"
        self.package = str(Path(lightning_mgpu.__file__).parent)
        self.thin: dict[int, dict[str, Any]] = {}
        self.thin_modules = 0
        self.models: dict[str, Any] = {}
        self.sets: dict[tuple[str, int], Any] = {}

    # --- info ----------------------------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        torch = self.torch
        return {
            "package": self.package,
            "api": "lasting replicas: ReplicaSet(module, devices).prepare(n) per step"
            if self.lasting
            else "per-step replicate(module, devices)",
            "mode_keyword": self.mode_kw,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        }

    # --- (1) deep, thin model ------------------------------------------------------------------------------------
    def thin_model(self, depth: int, norm: str) -> Any:
        nn = self.torch.nn
        self.torch.manual_seed(0)
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(8, 8), nn.BatchNorm1d(8) if norm == "batchnorm" else nn.LayerNorm(8), nn.Tanh()]
        return nn.Sequential(*layers)

    def thin_setup(self, depth: int, norm: str, shard: int, replicas: list[int], modes: list[str], warmup: int) -> dict:
        import copy

        torch = self.torch
        nn = torch.nn
        base = self.thin_model(depth, norm)
        self.thin_modules = sum(1 for _ in base.modules()) - 1  # without the Sequential root
        criterion = nn.CrossEntropyLoss()
        for n in replicas:
            g = torch.Generator().manual_seed(n)
            x = torch.randn(shard * n, 8, generator=g)
            y = torch.randint(0, 8, (shard * n,), generator=g)
            steps = {"plain": self._plain_step(copy.deepcopy(base), criterion, x, y, n)}
            for mode in modes:
                steps[mode] = self._dp_step(copy.deepcopy(base), criterion, x, y, n, mode)
            for step in steps.values():
                for _ in range(warmup):
                    step()
            self.thin[n] = steps
        return {"modules": self.thin_modules, "module_count_with_root": self.thin_modules + 1}

    def _plain_step(self, model: Any, criterion: Any, x: Any, y: Any, n: int) -> Any:
        """The replicas' own work: forward + loss + backward on each of the N shards, one after another, then one
        optimizer step (per-phase times are summed over the shards)."""
        optimizer = self.torch.optim.SGD(model.parameters(), lr=0.01)
        shards = list(zip(x.chunk(n), y.chunk(n), strict=True))
        clock, cpu = time.perf_counter, time.process_time

        def step() -> dict[str, float]:
            c0 = cpu()
            t0 = clock()
            optimizer.zero_grad(set_to_none=True)
            t1 = clock()
            forward = loss_time = backward = 0.0
            for xs, ys in shards:
                a = clock()
                out = model(xs)
                b = clock()
                loss = criterion(out, ys)
                c = clock()
                loss.backward()
                d = clock()
                forward, loss_time, backward = forward + b - a, loss_time + c - b, backward + d - c
            t2 = clock()
            optimizer.step()
            t3 = clock()
            return {
                "zero_grad": t1 - t0,
                "forward": forward,
                "loss": loss_time,
                "backward": backward,
                "optimizer": t3 - t2,
                "total": t3 - t0,
                "cpu_total": cpu() - c0,
            }

        return step

    def _dp_step(self, model: Any, criterion: Any, x: Any, y: Any, n: int, mode: str) -> Any:
        devices = ["cpu"] * n
        dp_model = self.parallel.DataParallelModel(model, devices, **{self.mode_kw: mode})
        dp_criterion = self.parallel.DataParallelCriterion(criterion, devices, **{self.mode_kw: mode})
        optimizer = self.torch.optim.SGD(model.parameters(), lr=0.01)
        clock, cpu = time.perf_counter, time.process_time

        def step() -> dict[str, float]:
            c0 = cpu()
            t0 = clock()
            optimizer.zero_grad(set_to_none=True)
            t1 = clock()
            outputs = dp_model(x)
            t2 = clock()
            loss = dp_criterion(outputs, y)
            t3 = clock()
            loss.backward()
            t4 = clock()
            optimizer.step()
            t5 = clock()
            return {
                "zero_grad": t1 - t0,
                "forward": t2 - t1,
                "loss": t3 - t2,
                "backward": t4 - t3,
                "optimizer": t5 - t4,
                "total": t5 - t0,
                "cpu_total": cpu() - c0,
            }

        return step

    def thin_block(self, n: int, variant: str, steps: int) -> dict[str, float]:
        """Mean per-step times (seconds) of ``steps`` steps of one variant, per phase and in total."""
        import gc

        step = self.thin[n][variant]
        sums: dict[str, float] = {}
        gen0, gen2 = gc.get_stats()[0]["collections"], gc.get_stats()[2]["collections"]
        for _ in range(steps):
            for key, value in step().items():
                sums[key] = sums.get(key, 0.0) + value
        sums["gc_gen0"] = gc.get_stats()[0]["collections"] - gen0
        sums["gc_gen2"] = gc.get_stats()[2]["collections"] - gen2
        return {key: value / steps for key, value in sums.items()}

    # --- (2) replication per step --------------------------------------------------------------------------------
    def rep_setup(self, model: str, replicas: list[int], build_repeats: int) -> dict[str, Any]:
        from recipes.pyramidnet import model as pyramidnet

        torch = self.torch
        torch.manual_seed(0)
        net = pyramidnet.build_pyramidnet(model)
        net.train()
        self.models[model] = net
        result: dict[str, Any] = {
            "modules": sum(1 for _ in net.modules()),
            "parameters": sum(p.numel() for p in net.parameters()),
            "parameter_tensors": sum(1 for _ in net.parameters()),
            "buffer_tensors": sum(1 for _ in net.buffers()),
            "model_file": pyramidnet.__file__,
        }
        if not self.lasting:
            return result
        builds: dict[int, dict[str, float]] = {}
        for n in replicas:
            build, first = [], []
            for _ in range(build_repeats):
                self.sets.pop((model, n), None)
                t0 = time.perf_counter()
                replica_set = self.parallel.ReplicaSet(net, ["cpu"] * n)
                t1 = time.perf_counter()
                replica_set.prepare(n)
                t2 = time.perf_counter()
                build.append(t1 - t0)
                first.append(t2 - t1)
                self.sets[(model, n)] = replica_set
            builds[n] = {"build_ms": statistics.median(build) * 1e3, "first_prepare_ms": statistics.median(first) * 1e3}
        result["first_build"] = builds
        return result

    def rep_block(self, model: str, n: int, grad: bool, calls: int) -> dict[str, float]:
        """Mean wall-clock and process CPU seconds of one step's replication over ``calls`` calls, and how many full
        (generation 2) garbage collections ran meanwhile (the collector stays on: its cost is part of the work)."""
        torch = self.torch
        net = self.models[model]
        if self.lasting:
            replica_set = self.sets[(model, n)]

            def replicate_once() -> Any:
                return replica_set.prepare(n)
        else:
            devices = ["cpu"] * n
            replicate = self.parallel.replicate

            def replicate_once() -> Any:  # what the old DataParallelModel did every step
                return replicate(net, devices, detach=not torch.is_grad_enabled())

        import gc

        gen2 = gc.get_stats()[2]["collections"]
        with torch.set_grad_enabled(grad):
            cpu = time.process_time()
            start = time.perf_counter()
            for _ in range(calls):
                replicate_once()
            seconds = (time.perf_counter() - start) / calls
            cpu_seconds = (time.process_time() - cpu) / calls
        return {"seconds": seconds, "cpu_seconds": cpu_seconds, "gc_gen2": gc.get_stats()[2]["collections"] - gen2}

    # --- (5) per-step sync + gradient reduction, host time only (meta device) -------------------------------------
    def sync_reduce(self, model: str, n: int, calls: int) -> dict[str, Any]:
        """Median µs of one step's sync (``execution_mode`` + ``prepare(n)`` + ``watch``, threads) and gradient
        reduction, on meta.

        Meta tensors carry no data: every operation costs its host work only (dispatch, Python), which is what a
        GPU's launching thread pays. The replicas' accumulation and the optimizer's ``zero_grad(set_to_none=True)``
        happen outside the timed region. The old code's reduction is the backward of its per-step parameter node.
        """
        import copy

        from recipes.pyramidnet import model as pyramidnet

        torch = self.torch
        net = copy.deepcopy(self.models.get(model) or pyramidnet.build_pyramidnet(model)).to("meta")
        params = list(net.parameters())
        replica_set = self.parallel.ReplicaSet(net, ["meta"] * n)
        flat_api = hasattr(replica_set, "reduce_gradients")
        sync, reduce = [], []
        for _ in range(calls + 2):
            for p in params:
                p.grad = None
            if flat_api:
                t0 = time.perf_counter()
                mode, _ = replica_set.execution_mode("threads", n)  # what every caller asks first, each step
                replica_set.prepare(n, mode)
                replica_set.watch([])  # after the forward: the in-place check's second half
                t1 = time.perf_counter()
                with torch.no_grad():
                    for leaves in replica_set._flat.leaves[:n]:
                        for leaf in leaves:
                            leaf.grad.add_(0)  # what autograd's in-place accumulation does
                t2 = time.perf_counter()
                replica_set._after_backward()  # the callback the backward pass queues
                t3 = time.perf_counter()
            else:
                from lightning_mgpu.parallel import replicas as internals

                t0 = time.perf_counter()
                replica_set.prepare(n, "threads")
                t1 = time.perf_counter()
                layout = internals._Layout([torch.device("meta")] * n, torch.device("meta"))
                ctx = type("Ctx", (), {"layout": layout, "count": len(params)})()
                grads = [torch.empty_like(p) for p in params] * n
                t2 = time.perf_counter()
                reduced = internals._ReplicaParameters.backward(ctx, *grads)
                for p, g in zip(params, reduced[1:], strict=True):  # what autograd's AccumulateGrad does
                    p.grad = g
                t3 = time.perf_counter()
            sync.append(t1 - t0)
            reduce.append(t3 - t2)
        sync, reduce = sync[2:], reduce[2:]
        total = [a + b for a, b in zip(sync, reduce, strict=True)]
        # The same sync back to back, with nothing in between to evict the caches: the floor of the checks' cost.
        warm = []
        for _ in range(calls + 2):
            t0 = time.perf_counter()
            if flat_api:
                mode, _ = replica_set.execution_mode("threads", n)
                replica_set.prepare(n, mode)
            else:
                replica_set.prepare(n, "threads")
            warm.append(time.perf_counter() - t0)
        # The unit of the checks' cost: one Python pass reading an attribute of every parameter tensor, on this CPU.
        version = operator.attrgetter("_version")
        passes = []
        for _ in range(calls + 2):
            t0 = time.perf_counter()
            list(map(version, params))
            passes.append(time.perf_counter() - t0)
        # What any reduction must do after zero_grad(set_to_none=True), Lightning's default: give every parameter
        # its .grad again (AccumulateGrad does it in C++ on one device).
        fresh = [torch.empty_like(p) for p in params]
        assign = []
        for _ in range(calls + 2):
            for p in params:
                p.grad = None
            t0 = time.perf_counter()
            for p, g in zip(params, fresh, strict=True):
                p.grad = g
            assign.append(time.perf_counter() - t0)
        return {
            "grad_assign_us": statistics.median(assign[2:]) * 1e6,
            "pass_us": statistics.median(passes[2:]) * 1e6,
            "sync_us": statistics.median(sync) * 1e6,
            "warm_sync_us": statistics.median(warm[2:]) * 1e6,
            "reduce_us": statistics.median(reduce) * 1e6,
            "total_us": statistics.median(total) * 1e6,
            "parameter_tensors": len(params),
            "api": "flat buffers" if flat_api else "per-step node",
        }

    # --- (4) per-step growth -------------------------------------------------------------------------------------
    def growth(self, n: int, steps: int, every: int, warmup: int) -> dict[str, Any]:
        import gc
        import tracemalloc

        step = self.thin[n]["sequential"]
        for _ in range(warmup):
            step()
        page = os.sysconf("SC_PAGE_SIZE")

        def rss() -> int:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * page

        automatic = [0, 0, 0]
        manual = [False]

        def count(phase: str, info: dict[str, Any]) -> None:
            if phase == "start" and not manual[0]:
                automatic[info["generation"]] += 1

        def collect() -> None:
            manual[0] = True
            gc.collect()
            manual[0] = False

        collect()
        tracemalloc.start()
        gc.callbacks.append(count)
        samples = []
        start = time.perf_counter()
        for k in range(steps + 1):
            if k % every == 0:
                collect()
                samples.append(
                    {
                        "step": k,
                        "objects": len(gc.get_objects()),
                        "traced_current_kib": tracemalloc.get_traced_memory()[0] / 1024,
                        "rss_mib": rss() / 2**20,
                    }
                )
            if k < steps:
                step()
        elapsed = time.perf_counter() - start
        gc.callbacks.remove(count)
        tracemalloc.stop()
        return {
            "replicas": n,
            "steps": steps,
            "warmup": warmup,
            "samples": samples,
            "automatic_collections_per_generation": automatic,
            "seconds": elapsed,
        }

    def gc_cost(self) -> dict[str, Any]:
        """How many objects the collector tracks in this process, and what one full collection costs."""
        import gc

        times = []
        for _ in range(3):
            start = time.perf_counter()
            gc.collect()
            times.append(time.perf_counter() - start)
        return {"objects": len(gc.get_objects()), "full_collection_ms": statistics.median(times) * 1e3}


def worker_main() -> None:
    worker = Worker()
    out = sys.stdout
    sys.stdout = sys.stderr  # anything printed by the code under test must not corrupt the protocol
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"ok": True, "result": getattr(worker, request["cmd"])(**request.get("args", {}))}
        except Exception:
            import traceback

            reply = {"ok": False, "error": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")
        out.flush()


# ---------------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------------
class WorkerProcess:
    def __init__(self, label: str, tree: Path) -> None:
        self.label = label
        self.tree = tree
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(tree),
        )

    def call(self, cmd: str, **args: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, "args": args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.label} ({self.tree}) exited")
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(f"worker {self.label} ({self.tree}) failed on {cmd}:\n{reply['error']}")
        return reply["result"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def git_rev(tree: Path) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def git_dirty(tree: Path, paths: list[str]) -> list[str]:
    """Files under ``paths`` that differ from the tree's commit (read when the workers start)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(tree), "status", "--porcelain", "--", *paths], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [line[3:] for line in out.splitlines() if line.strip()]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def rotated(items: list[Any], r: int) -> list[Any]:
    k = r % len(items)
    return items[k:] + items[:k]


def p10(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[0] if len(values) >= 2 else values[0]


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    load_before = load_average()
    workers = {"after": WorkerProcess("after", ROOT)}
    if args.old_tree is not None:
        workers["before"] = WorkerProcess("before", args.old_tree.resolve())
    labels = list(workers)
    report: dict[str, Any] = {
        "benchmark": "replica_overhead",
        "device": "cpu",
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "versions": {},
        "load_average_1_5_15min": {"before": load_before},
        "load_samples": [],
        "durations_s": {},
    }
    try:
        for label, worker in workers.items():
            info = worker.call("info")
            info["tree"] = str(worker.tree)
            info["commit"] = git_rev(worker.tree)
            info["uncommitted_library_changes"] = git_dirty(worker.tree, ["lightning_mgpu"])
            report["versions"][label] = info

        report["gc_cost"] = {}
        if 1 in args.parts:
            report["thin"] = thin_benchmark(args, workers, labels, report)
            report["gc_cost"]["after part 1"] = {label: w.call("gc_cost") for label, w in workers.items()}
        if 2 in args.parts:
            report["replicate"] = replicate_benchmark(args, workers, labels, report)
            report["gc_cost"]["after part 2"] = {label: w.call("gc_cost") for label, w in workers.items()}
        if 5 in args.parts:
            report["sync_reduce"] = sync_reduce_benchmark(args, workers, labels, report)
        if 4 in args.parts:
            t = time.perf_counter()
            if 1 not in args.parts:
                workers["after"].call(
                    "thin_setup",
                    depth=args.depth,
                    norm=args.norm,
                    shard=args.shard,
                    replicas=[args.growth_replicas],
                    modes=["sequential"],
                    warmup=1,
                )
            report["growth"] = workers["after"].call(
                "growth", n=args.growth_replicas, steps=args.growth_steps, every=args.growth_every, warmup=10
            )
            report["durations_s"]["growth"] = time.perf_counter() - t
    finally:
        for worker in workers.values():
            worker.close()
    report["load_average_1_5_15min"]["after"] = load_average()
    report["durations_s"]["total"] = time.perf_counter() - started
    return report


def thin_benchmark(
    args: argparse.Namespace, workers: dict[str, WorkerProcess], labels: list[str], report: dict[str, Any]
) -> dict[str, Any]:
    t = time.perf_counter()
    modes = ["sequential", "threads"] if args.threads else ["sequential"]
    variants = ["plain", *modes]
    setup = {}
    for label, worker in workers.items():
        setup[label] = worker.call(
            "thin_setup",
            depth=args.depth,
            norm=args.norm,
            shard=args.shard,
            replicas=args.replicas,
            modes=modes,
            warmup=args.warmup,
        )
    samples: dict[str, dict[int, dict[str, list[dict[str, float]]]]] = {
        label: {n: {v: [] for v in variants} for n in args.replicas} for label in labels
    }
    for r in range(args.rounds):
        report["load_samples"].append(load_average())
        for n in args.replicas:
            for label in rotated(labels, r):
                for variant in rotated(variants, r):
                    samples[label][n][variant].append(
                        workers[label].call("thin_block", n=n, variant=variant, steps=args.steps)
                    )
    results: dict[str, Any] = {}
    for label in labels:
        per_n = {}
        for n in args.replicas:
            plain = [s["total"] for s in samples[label][n]["plain"]]
            entry: dict[str, Any] = {
                "plain_median_ms": statistics.median(plain) * 1e3,
                "plain_min_ms": min(plain) * 1e3,
            }
            phases = {}
            plain_blocks = samples[label][n]["plain"]
            entry["plain_cpu_median_ms"] = statistics.median(b["cpu_total"] for b in plain_blocks) * 1e3
            for variant in variants:
                blocks = samples[label][n][variant]
                phases[variant] = {
                    key: statistics.median(b[key] for b in blocks) * 1e3
                    for key in blocks[0]
                    if not key.startswith("gc_")
                }
                if variant == "plain":
                    continue
                totals = [b["total"] for b in blocks]
                ratios = [a / p for a, p in zip(totals, plain, strict=True)]
                cpu_ratios = [a["cpu_total"] / p["cpu_total"] for a, p in zip(blocks, plain_blocks, strict=True)]
                quartiles = statistics.quantiles(ratios, n=4, method="inclusive")
                cpu_quartiles = statistics.quantiles(cpu_ratios, n=4, method="inclusive")
                entry[variant] = {
                    "median_ms": statistics.median(totals) * 1e3,
                    "min_ms": min(totals) * 1e3,
                    "median_paired_ratio": statistics.median(ratios),
                    "paired_ratio_quartiles": [quartiles[0], quartiles[2]],
                    "ratio_of_medians": statistics.median(totals) / statistics.median(plain),
                    "ratio_of_means": statistics.mean(totals) / statistics.mean(plain),
                    "ratio_of_minima": min(totals) / min(plain),
                    "p10_ratio": p10(totals) / p10(plain),
                    "cpu_median_ms": statistics.median(b["cpu_total"] for b in blocks) * 1e3,
                    "cpu_median_paired_ratio": statistics.median(cpu_ratios),
                    "cpu_paired_ratio_quartiles": [cpu_quartiles[0], cpu_quartiles[2]],
                    "ratios": ratios,
                    "cpu_ratios": cpu_ratios,
                }
            entry["phases_median_ms"] = phases
            entry["paired_phase_overhead_ms"] = {
                variant: {
                    key: statistics.median(
                        b[key] - p[key] for b, p in zip(samples[label][n][variant], plain_blocks, strict=True)
                    )
                    * 1e3
                    for key in plain_blocks[0]
                    if not key.startswith("gc_")
                }
                for variant in modes
            }
            entry["gc_gen0_per_step"] = {
                v: sum(b["gc_gen0"] for b in samples[label][n][v]) / len(samples[label][n][v]) for v in variants
            }
            entry["gc_gen2_per_step"] = {
                v: sum(b["gc_gen2"] for b in samples[label][n][v]) / len(samples[label][n][v]) for v in variants
            }
            entry["samples_ms"] = {v: [b["total"] * 1e3 for b in samples[label][n][v]] for v in variants}
            per_n[n] = entry
        results[label] = per_n
    report["durations_s"]["thin"] = time.perf_counter() - t
    return {
        "config": {
            "model": f"{args.depth} x (Linear(8, 8), {'BatchNorm1d(8)' if args.norm == 'batchnorm' else 'LayerNorm(8)'}"
            ", Tanh) in an nn.Sequential",
            "modules": setup[labels[0]]["modules"],
            "samples_per_replica": args.shard,
            "loss": "CrossEntropyLoss over 8 classes",
            "optimizer": "SGD lr 0.01",
            "rounds": args.rounds,
            "steps_per_block": args.steps,
            "warmup_steps": args.warmup,
            "order": "every round, for each N: the code versions in rotating order, and within each the variants "
            "(plain, sequential, threads) in rotating order",
        },
        "results": results,
    }


def sync_reduce_benchmark(
    args: argparse.Namespace, workers: dict[str, WorkerProcess], labels: list[str], report: dict[str, Any]
) -> list[dict[str, Any]]:
    """(5): per-step sync + reduction host time, each code version in its own worker, rounds alternating."""
    t = time.perf_counter()
    rows = []
    for model in args.models:
        for n in args.replicas:
            samples: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
            for r in range(args.rep_rounds):
                for label in rotated(labels, r):
                    samples[label].append(workers[label].call("sync_reduce", model=model, n=n, calls=5))
            row: dict[str, Any] = {"model": model, "replicas": n}
            for label in labels:
                blocks = samples[label]
                row[label] = {
                    key: statistics.median(b[key] for b in blocks)
                    for key in ("sync_us", "reduce_us", "total_us", "warm_sync_us", "pass_us", "grad_assign_us")
                    if key in blocks[0]
                }
                row[label]["api"] = blocks[0]["api"]
                row[label]["parameter_tensors"] = blocks[0]["parameter_tensors"]
            rows.append(row)
    report["durations_s"]["sync_reduce"] = time.perf_counter() - t
    return rows


def sync_reduce_markdown(rows: list[dict[str, Any]]) -> list[str]:
    labels = [label for label in ("before", "after") if label in rows[0]]
    apis = {
        "per-step node": "the per-step node (`_ReplicaParameters` forward in `prepare`, its backward plus "
        "AccumulateGrad's `.grad` stores)",
        "flat buffers": "flat buffers (`prepare`'s checks, the backward callback's reduction)",
    }
    lines = [
        "",
        "## Per-step sync + gradient reduction, host time (meta device)",
        "",
        "`execution_mode('threads', N)`, `prepare(N)` and `watch` (what `DataParallelModel` and the strategies call "
        "every step; `watch` after the forward ends the check for parameters changed in place) "
        "plus the reduction of the replicas' gradients onto the originals, on the meta "
        "device (no data: host work only, what a GPU's launching thread pays). "
        + "; ".join(f"**{label}**: {apis[rows[0][label]['api']]}" for label in labels)
        + ". Medians over rounds, µs; the optimizer's `zero_grad(set_to_none=True)` precedes each step, so the "
        "root's `.grad` views are reassigned. sync, reduce and total are timed within a step: the sync after the "
        "previous step's reduction, the reduction after the replicas' accumulation (one meta `add_` per replica and "
        "parameter, Python code that evicts the caches, as a backward pass does). **warm sync**: the same sync "
        "repeated back to back, the floor of its checks' cost. **one pass**: `list(map(attrgetter('_version'), "
        "params))` over the model's parameter tensors, the unit of the checks' cost on this CPU (**total in passes** "
        "= total / one pass). **assigning .grad**: `p.grad = g` for every parameter, which any reduction does after "
        "`zero_grad(set_to_none=True)` (Lightning's default; AccumulateGrad does it in C++ on one device). "
        "Target: < 1000 µs for PyramidNet-272 at N = 8.",
        "",
        "| model | N | parameter tensors | one pass | assigning .grad | "
        + " | ".join(
            f"{label} sync | {label} reduce | {label} total | {label} warm sync | {label} total in passes"
            for label in labels
        )
        + " |",
        "|---|---|---|---|---|" + "---|---|---|---|---|" * len(labels),
    ]
    for row in rows:
        last = row[labels[-1]]
        cells = [row["model"], str(row["replicas"]), str(last["parameter_tensors"])]
        cells += [f"{last.get(key, 0):.0f}" for key in ("pass_us", "grad_assign_us")]
        for label in labels:
            v = row[label]
            cells += [f"{v[key]:.0f}" for key in ("sync_us", "reduce_us", "total_us", "warm_sync_us")]
            cells.append(f"{v['total_us'] / v['pass_us']:.1f}" if v.get("pass_us") else "")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def replicate_benchmark(
    args: argparse.Namespace, workers: dict[str, WorkerProcess], labels: list[str], report: dict[str, Any]
) -> dict[str, Any]:
    t = time.perf_counter()
    setup: dict[str, dict[str, Any]] = {label: {} for label in labels}
    for model in args.models:
        for label, worker in workers.items():
            setup[label][model] = worker.call("rep_setup", model=model, replicas=args.replicas, build_repeats=3)
    if 2 not in args.parts:
        return {"setup": setup}
    keys = [(model, n, grad) for model in args.models for n in args.replicas for grad in (True, False)]
    samples: dict[str, dict[tuple, list[dict[str, float]]]] = {label: {k: [] for k in keys} for label in labels}
    for r in range(args.rep_rounds):
        report["load_samples"].append(load_average())
        for model, n, grad in keys:
            for label in rotated(labels, r):
                samples[label][(model, n, grad)].append(
                    workers[label].call("rep_block", model=model, n=n, grad=grad, calls=args.rep_calls)
                )
    rows = []
    for model, n, grad in keys:
        row: dict[str, Any] = {"model": model, "replicas": n, "grad": grad}
        for label in labels:
            blocks = samples[label][(model, n, grad)]
            values = [b["seconds"] for b in blocks]
            row[label] = {
                "median_ms": statistics.median(values) * 1e3,
                "min_ms": min(values) * 1e3,
                "cpu_median_ms": statistics.median(b["cpu_seconds"] for b in blocks) * 1e3,
                "gc_gen2_per_call": sum(b["gc_gen2"] for b in blocks) / (len(blocks) * args.rep_calls),
                "samples_ms": [v * 1e3 for v in values],
            }
        if "before" in labels:
            pairs = zip(samples["before"][(model, n, grad)], samples["after"][(model, n, grad)], strict=True)
            row["median_paired_speedup"] = statistics.median(b["seconds"] / a["seconds"] for b, a in pairs)
            pairs = zip(samples["before"][(model, n, grad)], samples["after"][(model, n, grad)], strict=True)
            row["cpu_median_paired_speedup"] = statistics.median(b["cpu_seconds"] / a["cpu_seconds"] for b, a in pairs)
        if grad:
            row["issue_before_ms"] = ISSUE_BEFORE_MS.get(model, {}).get(n)
        rows.append(row)
    report["durations_s"]["replicate"] = time.perf_counter() - t
    return {
        "config": {
            "models": args.models,
            "rounds": args.rep_rounds,
            "calls_per_block": args.rep_calls,
            **{
                label: "ReplicaSet(model, ['cpu'] * N) built once, prepare(N) per step"
                if report["versions"][label]["api"].startswith("lasting")
                else "replicate(model, ['cpu'] * N, detach=not torch.is_grad_enabled()) per step (a03ef68's "
                "DataParallelModel)"
                for label in labels
            },
        },
        "setup": setup,
        "rows": rows,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------------------------------
def markdown(report: dict[str, Any]) -> str:
    versions = report["versions"]
    after = versions["after"]
    lines = [
        "# Replica overhead per step (issue 13 §3), CPU",
        "",
        f"- machine: {report['cpu_model']}, {report['cpu_count']} CPUs, shared with other agents' test runs; load "
        f"average (1/5/15 min) before {report['load_average_1_5_15min']['before']}, after "
        f"{report['load_average_1_5_15min']['after']}",
        f"- torch {after['torch']}, Python {after['python']}, {after['torch_threads']} torch thread, "
        f"OMP_NUM_THREADS={after['omp_num_threads']}",
        f"- command: `{report['command']}` ({report['durations_s']['total']:.0f} s)",
    ]
    for label, info in versions.items():
        changed = info["uncommitted_library_changes"]
        dirty = f" + uncommitted changes in {', '.join(f'`{c}`' for c in changed)}" if changed else ""
        lines.append(f"- {label}: `{info['tree']}` at {info['commit']}{dirty}: {info['api']}")
    lines += ["", "Virtual devices: every replica runs on the one CPU, so the figures are host overhead, not speed-up."]

    thin = report.get("thin")
    if thin:
        cfg = thin["config"]
        lines += [
            "",
            "## 1. Step overhead on a deep, thin model",
            "",
            f"Model: {cfg['model']} ({cfg['modules']} modules), {cfg['samples_per_replica']} samples per replica, "
            f"{cfg['loss']}, {cfg['optimizer']}. **plain** = the replicas' own work: forward + loss + backward on "
            "each of the N shards one after another, then one optimizer step (one zero_grad). **sequential** / "
            "**threads** = `DataParallelModel` + `DataParallelCriterion` with that execution mode: zero_grad, "
            f"forward, loss, backward, SGD step. {cfg['rounds']} rounds x {cfg['steps_per_block']} step per block, "
            f"after {cfg['warmup_steps']} warm-up steps; {cfg['order']}. Ratio = step / plain of the same round, "
            "on wall-clock time and on the process's CPU time (`time.process_time()`: sequential mode runs on one "
            "thread, so CPU time is the work done, much less sensitive to other processes taking the cores than "
            "wall-clock time; GC pauses count in both). Figures: median over rounds of the paired ratios, "
            f"[interquartile range]; ratio of means keeps the outliers (GC pauses, load bursts). "
            f"Target: sequential <= {TARGET}.",
            "",
            "| N | code | plain (ms) | sequential (ms) | **wall ratio** [IQR] | ratio of means | **CPU-time ratio** "
            "[IQR] | threads ratio (wall) | GCs per step, young / full: sequential (plain) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        results = thin["results"]
        ns = sorted({int(n) for label in results for n in results[label]})
        for n in ns:
            for label in results:
                e = results[label][n] if n in results[label] else results[label][str(n)]
                seq = e["sequential"]
                thr = e.get("threads")
                q, cq = seq["paired_ratio_quartiles"], seq["cpu_paired_ratio_quartiles"]
                young, full = e["gc_gen0_per_step"], e["gc_gen2_per_step"]
                thr_cell = f"{thr['median_paired_ratio']:.3f}" if thr is not None else "-"
                lines.append(
                    f"| {n} | {label} | {e['plain_median_ms']:.1f} | {seq['median_ms']:.1f} | "
                    f"**{seq['median_paired_ratio']:.3f}** [{q[0]:.2f}-{q[1]:.2f}] | {seq['ratio_of_means']:.3f} | "
                    f"**{seq['cpu_median_paired_ratio']:.3f}** [{cq[0]:.2f}-{cq[1]:.2f}] | {thr_cell} | "
                    f"{young['sequential']:.1f} / {full['sequential']:.2f} "
                    f"({young['plain']:.1f} / {full['plain']:.2f}) |"
                )
        for key, what in (("median_paired_ratio", "wall-clock"), ("cpu_median_paired_ratio", "CPU time")):
            verdict = []
            for n in ns:
                e = results["after"][n] if n in results["after"] else results["after"][str(n)]
                ratio = e["sequential"][key]
                verdict.append(f"N={n} {ratio:.3f} ({'met' if ratio <= TARGET else f'missed by {ratio - TARGET:.3f}'})")
            lines += ["", f"**Target <= {TARGET} (after, sequential, {what}):** " + "; ".join(verdict) + "."]
        lines += [
            "",
            "Where the step's time goes (medians per phase, ms; plain sums its N shards; forward includes scatter "
            "and replica sync, loss the target split and the weighted reduction, backward the replicas' gradient "
            "sum):",
            "",
            "| N | code | variant | zero_grad | forward | loss | backward | optimizer | total |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for n in ns:
            for label in results:
                e = results[label][n] if n in results[label] else results[label][str(n)]
                for variant, p in e["phases_median_ms"].items():
                    if variant == "threads":
                        continue
                    lines.append(
                        f"| {n} | {label} | {variant} | {p['zero_grad']:.2f} | {p['forward']:.2f} | {p['loss']:.2f} | "
                        f"{p['backward']:.2f} | {p['optimizer']:.2f} | {p['total']:.2f} |"
                    )
        lines += [
            "",
            "The same as paired differences: sequential minus plain of the same round, per phase, median over "
            "rounds (ms; negative = cheaper than the N plain calls):",
            "",
            "| N | code | zero_grad | forward | loss | backward | optimizer | total |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for n in ns:
            for label in results:
                e = results[label][n] if n in results[label] else results[label][str(n)]
                d = e["paired_phase_overhead_ms"]["sequential"]
                lines.append(
                    f"| {n} | {label} | {d['zero_grad']:+.2f} | {d['forward']:+.2f} | {d['loss']:+.2f} | "
                    f"{d['backward']:+.2f} | {d['optimizer']:+.2f} | {d['total']:+.2f} |"
                )
    gc_cost = report.get("gc_cost") or {}
    if gc_cost:
        cells = [
            f"{label} worker {when}: {c['objects']:,} objects, {c['full_collection_ms']:.0f} ms"
            for when, per_label in gc_cost.items()
            for label, c in per_label.items()
        ]
        lines += [
            "",
            "Cost of one full (generation 2) garbage collection in the worker processes (objects tracked by the "
            "collector, time of `gc.collect()`): "
            + "; ".join(cells)
            + ". The collector stays enabled in every measurement: a full collection landing in a timed step "
            "is part of that step's cost.",
        ]

    rep = report.get("replicate")
    if rep and "rows" in rep:
        cfg = rep["config"]
        has_before = "before" in versions
        lines += [
            "",
            "## 2. Replication per step: PyramidNets",
            "",
            (
                f"before = `{cfg['before']}`; after = `{cfg['after']}`. Median over {cfg['rounds']} rounds of the "
                f"mean of {cfg['calls_per_block']} calls (wall-clock; CPU time = process CPU time over the same "
                "calls); each round times before and after back to back (rotating order), speed-up = median of the "
                "per-round before/after ratios. The issue's figures (measured on another day, grad enabled) are "
                "context only."
                if has_before
                else f"after = `{cfg['after']}`. Median over {cfg['rounds']} rounds of the mean of "
                f"{cfg['calls_per_block']} calls (wall-clock; CPU time = process CPU time over the same calls). "
                "No before figures: run with --old-tree for them."
            ),
            "",
        ]
        for model, s in rep["setup"]["after"].items():
            lines.append(
                f"- {model}: {s['modules']} modules, {s['parameters']:,} parameters in {s['parameter_tensors']} "
                f"tensors, {s['buffer_tensors']} buffers"
            )
        lines += [
            "",
            "| model | N | grad | before (ms) | after (ms) | **speed-up** (wall) | after, CPU time (ms) | speed-up "
            "(CPU time) | issue's before (ms) | full GCs per call (before) |"
            if has_before
            else "| model | N | grad | after (ms) | after, CPU time (ms) |",
            "|---|---|---|---|---|---|---|---|---|---|" if has_before else "|---|---|---|---|---|",
        ]
        for row in rep["rows"]:
            grad = "enabled" if row["grad"] else "no_grad"
            after = row["after"]
            if has_before:
                issue = row.get("issue_before_ms")
                lines.append(
                    f"| {row['model']} | {row['replicas']} | {grad} | {row['before']['median_ms']:.2f} | "
                    f"{after['median_ms']:.2f} | **{row['median_paired_speedup']:.1f}x** | "
                    f"{after['cpu_median_ms']:.2f} | {row['cpu_median_paired_speedup']:.1f}x | "
                    f"{issue if issue is not None else '-'} | "
                    f"{row['before']['gc_gen2_per_call']:.2f} |"
                )
            else:
                lines.append(
                    f"| {row['model']} | {row['replicas']} | {grad} | {after['median_ms']:.2f} | "
                    f"{after['cpu_median_ms']:.2f} |"
                )
        lines += [
            "",
            "First build (after): `ReplicaSet(model, ['cpu'] * N)` and the first `prepare(N)` (grad enabled), "
            "median of 3 builds:",
            "",
            "| model | N | build (ms) | first prepare (ms) |",
            "|---|---|---|---|",
        ]
        for model, s in rep["setup"]["after"].items():
            for n, b in s.get("first_build", {}).items():
                lines.append(f"| {model} | {n} | {b['build_ms']:.1f} | {b['first_prepare_ms']:.2f} |")

    if report.get("sync_reduce"):
        lines += sync_reduce_markdown(report["sync_reduce"])
    growth = report.get("growth")
    if growth:
        first, last = growth["samples"][0], growth["samples"][-1]
        lines += [
            "",
            "## 4. Per-step growth (after)",
            "",
            f"{growth['steps']} training steps of (1), N={growth['replicas']}, sequential, after {growth['warmup']} "
            "warm-up steps; `gc.collect()` before each sample; tracemalloc started after the warm-up (it sees "
            "Python allocations, not tensor storage, hence RSS too).",
            "",
            "| step | live objects | tracemalloc current (KiB) | RSS (MiB) |",
            "|---|---|---|---|",
        ]
        for s in growth["samples"]:
            lines.append(f"| {s['step']} | {s['objects']} | {s['traced_current_kib']:.1f} | {s['rss_mib']:.1f} |")
        second = growth["samples"][1] if len(growth["samples"]) > 2 else first
        auto = growth.get("automatic_collections_per_generation")
        lines += [
            "",
            f"Change from step {first['step']} to step {last['step']}: {last['objects'] - first['objects']:+d} "
            f"objects, {last['traced_current_kib'] - first['traced_current_kib']:+.1f} KiB traced, "
            f"{last['rss_mib'] - first['rss_mib']:+.1f} MiB RSS; from step {second['step']} (the first step's "
            f"tensors and graph already counted) to step {last['step']}: "
            f"{last['traced_current_kib'] - second['traced_current_kib']:+.1f} KiB traced."
            + (
                f" Automatic collections during the {growth['steps']} steps (generations 0/1/2): "
                f"{auto[0]}/{auto[1]}/{auto[2]}."
                if auto
                else ""
            ),
        ]
    loads = [s for s in report["load_samples"] if s]
    if loads:
        one_min = [s[0] for s in loads]
        lines += [
            "",
            f"1-minute load average sampled at each round: min {min(one_min)}, median "
            f"{statistics.median(one_min):.2f}, max {max(one_min)} (2 CPUs; this benchmark itself keeps about 1 busy).",
        ]
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, text: str) -> None:
    notes = ""
    if path.exists():
        old = path.read_text()
        if NOTES_MARKER in old:
            notes = old.split(NOTES_MARKER, 1)[1]
    path.write_text(text + "\n" + NOTES_MARKER + (notes or "\n"))


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--old-tree", type=Path, default=None, help="a tree of the old code, timed in a second worker")
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 2, 4, 5], choices=[1, 2, 4, 5])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--depth", type=int, default=300, help="(Linear, norm, Tanh) blocks of the thin model")
    parser.add_argument("--norm", choices=["batchnorm", "layernorm"], default="batchnorm")
    parser.add_argument("--shard", type=int, default=16, help="samples per replica in (1)")
    parser.add_argument("--rounds", type=int, default=9, help="rounds of (1)")
    parser.add_argument("--steps", type=int, default=1, help="steps per timed block in (1)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-threads", dest="threads", action="store_false", help="skip the threads mode in (1)")
    parser.add_argument("--models", nargs="+", default=["seed", "pyramidnet272_bottleneck_a200"])
    parser.add_argument("--rep-rounds", type=int, default=9, help="rounds of (2)")
    parser.add_argument("--rep-calls", type=int, default=2, help="replications per timed block in (2)")
    parser.add_argument("--growth-replicas", type=int, default=2)
    parser.add_argument("--growth-steps", type=int, default=200)
    parser.add_argument("--growth-every", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None, help="JSON path; the markdown goes next to it")
    args = parser.parse_args(argv)
    if args.worker:
        worker_main()
        return None
    if any(n < 2 for n in args.replicas):
        parser.error("--replicas must be >= 2 (one device is a plain call, no replica)")
    report = run(args)
    out = args.out or ROOT / "benchmarks" / "results" / "replica_overhead_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    write_markdown(out.with_suffix(".md"), text)
    print(text)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return report


if __name__ == "__main__":
    main()
