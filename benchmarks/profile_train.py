"""GPU profile of `deltafuse train`: what compiles at which step, and the Trainer step against a plain loop.

One process, one model:
1. `deltafuse train ARGS...` runs in-process. Every Triton compilation is recorded with the step it happened
   in and its wall time (Triton's JIT hooks), and so are, per step, the seconds spent building kernel launchers
   and loading binaries (both outside those hooks), and what `--compile-ahead` did; every step is timed (CUDA synchronised from one step's begin
   to its end, i.e. the whole optimizer step), the batches of the run are kept, and the last
   ``--profile-steps`` steps run under ``torch.profiler``.
2. The same packed rows then run again in a plain PyTorch loop (forward, backward, clip, AdamW step, zero
   grad) on the trained model, with deltafuse applied again (``deltafuse train`` reverts it when it ends),
   timed and profiled the same way: the difference is what the Trainer adds.

    python benchmarks/profile_train.py OUT.json -- --model dense8 --seq-len 4096 --max-steps 30 --no-progress \
        --output-dir /tmp/prof --overwrite
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402


class CompileLog:
    """Triton compilations (kernel, step, seconds, specialisation) from the JIT cache hooks (Triton >= 3.4
    knobs). Each hook call gets a new ``fn`` info object, so a compilation's start is keyed by the kernel and
    its specialisation key. ``repr`` names every argument's type with Triton's specialisation marks (``D``:
    divisible by 16), so two compilations of one kernel show which argument made the second."""

    def __init__(self):
        self.events: list[dict] = []
        self.step = 0
        self._start: dict = {}

    def install(self) -> bool:
        try:
            from triton import knobs
        except ImportError:
            return False

        def ident(fn, key):
            return id(getattr(fn, "jit_function", fn)), str(key)

        def before(*, fn, key, **kw):
            self._start[ident(fn, key)] = time.perf_counter()
            return False  # never skip the compilation

        def after(*, fn, key, repr=None, compile=None, **kw):
            t0 = self._start.pop(ident(fn, key), None)
            compile = compile or {}
            configs = compile.get("configs") or [{}]
            self.events.append({"step": self.step, "kernel": getattr(fn, "name", None) or str(fn),
                                "seconds": None if t0 is None else time.perf_counter() - t0,
                                "repr": None if repr is None else str(repr)[:2000],
                                "attrs": str(configs[0])[:2000],
                                "constants": str(compile.get("constants"))[:1000]})

        knobs.runtime.jit_cache_hook = before
        knobs.runtime.jit_post_compile_hook = after
        self._time_launchers()
        return True

    def _time_launchers(self) -> None:
        """Triton (up to 3.8 at least) builds a C launcher per kernel signature with the system compiler, and
        loads each binary, at a kernel's first run, outside the compile hooks: both are timed here (wall
        seconds per step; in compile-ahead's threads they overlap)."""
        import threading

        from triton.compiler import compiler
        from triton.runtime import build

        self.launcher_s: dict = {}
        self.load_s: dict = {}
        lock = threading.Lock()

        def timed(fn, into):
            def wrapper(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    with lock:
                        into[self.step] = into.get(self.step, 0.0) + time.perf_counter() - t0
            return wrapper

        build._build = timed(build._build, self.launcher_s)
        init = compiler.CompiledKernel._init_handles

        def init_handles(kernel):
            if kernel.module is not None:
                return init(kernel)
            return timed(init, self.load_s)(kernel)

        compiler.CompiledKernel._init_handles = init_handles


def _ahead_report(trainer) -> dict | None:
    """What `deltafuse train --compile-ahead` did before the first step (inside step 1's time)."""
    report = getattr(trainer, "_deltafuse_ahead", None)
    return None if report is None else dict(report.__dict__)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _top(prof, key: str, n: int = 25) -> str:
    return prof.key_averages().table(sort_by=key, row_limit=n, max_name_column_width=100)


# --by-shape: the profiles record every op's input shapes (set in main)
RECORD_SHAPES = False


def _profiler():
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                   record_shapes=RECORD_SHAPES)


def _by_shape(prof, steps: int, n: int = 60) -> list[dict]:
    """The torch ops with the most device time of their own kernels (their children's not counted, so no kernel
    is counted twice; the op's own CPU time on a machine without CUDA), per op name and input shapes: what each
    elementwise or copy kernel of the step belongs to."""
    from torch.autograd import DeviceType

    cuda = torch.cuda.is_available()
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        own = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) if cuda \
            else e.self_cpu_time_total
        if e.device_type == DeviceType.CPU and own > 0:
            rows.append({"op": e.key, "shapes": str(e.input_shapes), "calls_per_step": e.count / steps,
                         "ms_per_step": round(own / 1000 / steps, 3)})
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:n]


def _tables(prof, steps: int) -> dict:
    """The profile's top tables, and the device time per step (the sum of every kernel's own time)."""
    cuda = torch.cuda.is_available()
    from torch.autograd import DeviceType

    # kernels only: an op row's self device time repeats its kernels' (the table's "Self CUDA time total" also
    # counts device events only)
    averages = prof.key_averages()
    events = [e for e in averages if e.device_type != DeviceType.CPU]
    own = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events)
    # host: the self CPU time of every recorded op (what the host spent inside torch ops and their Python
    # callers' recorded functions, the profiler's own overhead included)
    host = sum(e.self_cpu_time_total for e in averages if e.device_type == DeviceType.CPU)
    return {"by_cuda_time": _top(prof, "cuda_time_total") if cuda else None,
            "by_self_cuda_time": _top(prof, "self_cuda_time_total", 40) if cuda else None,
            "device_ms_per_step": own / 1000 / steps if cuda else None,
            "host_ms_per_step": host / 1000 / steps,
            "by_cpu_time": _top(prof, "cpu_time_total"),
            "by_op_and_shape": _by_shape(prof, steps) if RECORD_SHAPES else None}


def _profile(run_step, steps: int) -> dict:
    with _profiler() as prof:
        for _ in range(steps):
            run_step()
        _sync()
    return _tables(prof, steps)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, train_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--profile-steps", type=int, default=3, help="steady steps under torch.profiler (default 3)")
    p.add_argument("--by-shape", action="store_true",
                   help="record input shapes: a table of the ops with the most device time of their own kernels, per "
                        "op and input shapes (eager steps: graph replays show no ops)")
    p.add_argument("--fla-lift-hopper-guard", action="store_true",
                   help="with FLA installed and --no-deltafuse: set fla.ops.common.chunk_o.IS_NVIDIA_HOPPER=False "
                        "where FLA refuses its GDN backward (Hopper, Triton < 3.7.1), for timing only: its "
                        "gradients are known to be wrong there")
    p.add_argument("--force-backend", action="append", default=[], metavar="OP=NAME",
                   help="serve op OP by its candidate NAME wherever a call leaves the choice to the registry, as "
                        "a per-call backend=NAME would (e.g. moe_experts=torch, for an A/B of one op's "
                        "candidates inside the step); repeatable")
    p.add_argument("--moe-matmuls", choices=["auto", "torch"], default="auto",
                   help="torch: the Triton experts candidate keeps torch's grouped matmuls on every device (an A/B "
                        "of its Triton grouped matmuls inside the step; default: auto, the candidate's own choice)")
    p.add_argument("--gdn-options", default="", metavar="FIELD=VALUE,...",
                   help="ChunkOptions overrides for every chunked GDN call of the run (as tune_gdn.py --variants "
                        "takes them, e.g. bv_hfwd=64,warps_hfwd=8), for an A/B of GDN kernel options inside the step")
    args = p.parse_args(ours)
    from deltafuse.ops.gated_delta import chunk_options

    gdn_options = None  # the defaults in effect
    if args.gdn_options:  # (tune_gdn's parser imports the GDN benchmark and Triton: only when asked for)
        sys.path.insert(0, str(REPO / "benchmarks"))
        from tune_gdn import parse_variant

        try:
            gdn_options = parse_variant(args.gdn_options)
        except ValueError as e:
            p.error(f"--gdn-options {args.gdn_options!r}: {e}")
    if args.moe_matmuls == "torch":
        from deltafuse.ops.moe import kernel as moe_kernel

        moe_kernel.TRITON_MM_CAPABILITIES = ()
    if args.fla_lift_hopper_guard and "--no-deltafuse" not in train_argv:
        p.error("--fla-lift-hopper-guard times FLA's route: add --no-deltafuse after --")
    forced = _forced_backends(p, args.force_backend)
    global RECORD_SHAPES
    RECORD_SHAPES = args.by_shape
    from deltafuse.bench.impls import lifted_fla_hopper_guard

    with lifted_fla_hopper_guard(args.fla_lift_hopper_guard), _forcing(forced), \
            chunk_options.configured(gdn_options):
        return _run(args, train_argv)


def _forced_backends(p, items: list[str]) -> dict[str, str]:
    from deltafuse.backends import REGISTRY

    forced = {}
    for item in items:
        op, sep, name = item.partition("=")
        if not sep or op not in REGISTRY.ops:
            p.error(f"--force-backend {item!r}: expected OP=NAME with OP one of {', '.join(REGISTRY.ops)}")
        names = [c.name for c in REGISTRY.candidates(op)]
        if name not in names:
            p.error(f"--force-backend {item!r}: {op} has no candidate {name!r}; allowed: {', '.join(names)}")
        forced[op] = name
    return forced


class _forcing:
    """Inside: ``deltafuse.ops._library.select`` (how every op asks the registry) passes ``forced[op]`` as the
    backend of a call that names none."""

    def __init__(self, forced: dict[str, str]):
        self.forced = forced

    def __enter__(self):
        from deltafuse.ops import _library

        self.lib, self.original = _library, _library.select
        forced, original = self.forced, self.original

        def select(op, backend, mask, *tensors):
            return original(op, forced.get(op, backend) if backend is None else backend, mask, *tensors)

        if forced:
            _library.select = select
        return self

    def __exit__(self, *exc):
        self.lib.select = self.original


def _sequences(batch) -> int:
    """The sequences of a packed batch's row: where its position_ids do not grow by 1 (transformers' rule)."""
    pos = batch.get("position_ids")
    if pos is None:
        return 1
    pos = pos.reshape(-1)
    return int(((pos[1:] - pos[:-1]) != 1).sum()) + 1


def _run(args, train_argv) -> int:
    import transformers

    from deltafuse.train.cli import main as train_main

    log = CompileLog()
    hooks = log.install()
    captured = {"batches": [], "times": [], "trainer": None, "profile": None}
    original_step = transformers.Trainer.training_step
    original_train = transformers.Trainer.train

    def training_step(self, model, inputs, *a, **kw):
        captured["trainer"] = self
        if len(captured["batches"]) < 64:
            captured["batches"].append({k: v.detach().clone() if torch.is_tensor(v) else v
                                        for k, v in inputs.items()})
        return original_step(self, model, inputs, *a, **kw)

    # the whole optimizer step: from one step's begin to the next (callbacks see both)
    class StepClock(transformers.TrainerCallback):
        prof = None

        def on_step_begin(self, a, state, control, **kw):
            _sync()
            log.step = state.global_step + 1
            if log.step == state.max_steps - args.profile_steps + 1:
                self.prof = _profiler()
                self.prof.__enter__()
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            _sync()
            captured["times"].append(time.perf_counter() - self.t0)
            if self.prof is not None and state.global_step == state.max_steps:
                self.prof.__exit__(None, None, None)
                captured["profile"] = _tables(self.prof, args.profile_steps)
                self.prof = None

    def train(self, *a, **kw):
        self.add_callback(StepClock())
        return original_train(self, *a, **kw)

    transformers.Trainer.training_step = training_step
    transformers.Trainer.train = train
    try:
        rc = train_main(train_argv)
    finally:
        transformers.Trainer.training_step = original_step
        transformers.Trainer.train = original_train
    trainer = captured["trainer"]
    result = {"train_argv": train_argv, "train_rc": rc, "compile_hooks": hooks, "torch": torch.__version__,
              "transformers": transformers.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
              "trainer_step_s": captured["times"], "compiles": log.events,
              "compile_ahead": None if trainer is None else _ahead_report(trainer),
              "launcher_build_s": getattr(log, "launcher_s", None),
              "binary_load_s": getattr(log, "load_s", None)}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    if trainer is None or not captured["batches"]:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print("no training step ran", file=sys.stderr)
        return 1

    result["trainer_profile"] = captured["profile"]
    model = trainer.model
    model.train()
    batches = captured["batches"]
    if "--no-deltafuse" not in train_argv:
        import deltafuse

        deltafuse.apply(model)
    graphs = None
    if "--cuda-graphs" in train_argv:  # the loop graphs the layers as the run did (the run removed its graphs)
        from deltafuse.integrations.transformers.graphed_layers import graph_layers

        graphs = graph_layers(model, warmup=2, max_sequences=max(_sequences(b) for b in batches))

    # plain loop on the same rows
    params = [p for p in model.parameters() if p.requires_grad]
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")
    log.step = -1  # compilations from here on belong to the plain loop
    amp = trainer.args.bf16 or trainer.args.fp16

    def loop_step(batch):
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bool(amp and trainer.args.bf16)):
            out = model(**batch)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, trainer.args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = []
    for batch in batches:
        _sync()
        t0 = time.perf_counter()
        loop_step(batch)
        _sync()
        times.append(time.perf_counter() - t0)
    result["loop_step_s"] = times
    j = iter(range(10 ** 9))
    result["loop_profile"] = _profile(lambda: loop_step(batches[next(j) % len(batches)]), args.profile_steps)
    if graphs is not None:
        result["loop_cuda_graphs"] = graphs.summary()
        graphs.remove()
    if "--no-deltafuse" not in train_argv:
        deltafuse.revert()

    def med(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else None

    steady = captured["times"][3:len(captured["times"]) - args.profile_steps]  # profiled steps excluded
    result["summary"] = {
        "trainer_median_s_after_step3": med(steady), "loop_median_s": med(times[3:] or times),
        "trainer_max_after_step3": max(steady) if steady else None,
        "loop_device_ms_per_step": result["loop_profile"]["device_ms_per_step"],
        "loop_host_ms_per_step": result["loop_profile"]["host_ms_per_step"],
        "trainer_device_ms_per_step": (result["trainer_profile"] or {}).get("device_ms_per_step"),
        "trainer_host_ms_per_step": (result["trainer_profile"] or {}).get("host_ms_per_step"),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 2) if torch.cuda.is_available() else None,
        "loop_cuda_graphs": result.get("loop_cuda_graphs"),
        "compiles_per_step": {s: sum(1 for e in log.events if e["step"] == s)
                              for s in sorted({e["step"] for e in log.events})},
        "compile_seconds_per_step": {s: round(sum(e["seconds"] or 0 for e in log.events if e["step"] == s), 3)
                                     for s in sorted({e["step"] for e in log.events})},
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    print((result["trainer_profile"] or {}).get("by_cpu_time"))
    print(result["loop_profile"]["by_cpu_time"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
