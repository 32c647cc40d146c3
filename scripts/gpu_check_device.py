"""The device-runtime part of kiln's GPU check (issue 13), run by scripts/gpu_check.py
(`--device` runs only it; it is part of the default run too).

On the `cuda:0` device (CUDA managed memory through cuda-bindings, Triton kernels):

1. a compiled multi-kernel program on device tensors: host copies counted
   (kiln/runtime/transfers.py: zero expected between kernels), numerics against torch,
   per-call time against the same program called with host arrays (copies per kernel);
2. CUDA-graph replay (`kn.capture`) against the normal launch, per call: the
   4096-element gelu·sigmoid chain of the issue and the two-kernel MLP;
3. a captured `while_loop` (Newton, at most 20 steps, over 2^20): replay vs normal call vs torch
   eager, the flags read per replay, and whether the driver has conditional nodes;
4. the caching allocator's statistics against `cuMemGetInfo` (reserved segments seen by
   the driver; `empty_cache` giving them back);
5. DLPack with torch CUDA tensors: a kiln tensor read by torch without a copy (same
   address); a torch CUDA tensor in `kn.from_dlpack` (device memory: one device copy,
   values checked; copy=False refused, K382); a cupy array in managed memory shared
   (same address, a cupy write seen by kiln).

Every row is guarded: a failure prints its error in the table and the rest still runs.
Times are medians of wall-clock per call (each call ends with the device idle, as kiln's
calls do), so they include kiln's host-side cost, which is what replay removes.
"""

from __future__ import annotations

import time
import traceback


def _median_us(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e6


def _error(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def _mlp(kn):
    def mlp(x, w):
        h = kn.relu(x @ w)
        return kn.softmax(h, -1) * 2 + 1, h.sum(-1)
    return mlp


def resident(torch, kn, np, table, calls: int, dev: str = "cuda", tdev: str = "cuda",
             rows_n: int = 4096, k: int = 1024) -> str:
    from kiln.runtime import transfers
    from kiln.runtime.device import backend_for

    rng = np.random.default_rng(0)
    xs = rng.standard_normal((rows_n, k)).astype(np.float32)
    ws = (rng.standard_normal((k, k)) / np.sqrt(k)).astype(np.float32)
    rows = []
    try:
        x, w = kn.tensor(xs).to(dev), kn.tensor(ws).to(dev)
        f = kn.compile(_mlp(kn))
        a, b = f(x, w)
        graph = f.compiled_graphs()[0]
        kernels = sum(type(s).__name__ == "Launch" for s in graph.program.steps)
        with transfers.counting() as seen:
            a, b = f(x, w)
        tx, tw = torch.from_numpy(xs).double().to(tdev), torch.from_numpy(ws).double().to(tdev)
        h = torch.relu(tx @ tw)
        err = max(float(np.abs(a.numpy() - (torch.softmax(h, -1) * 2 + 1).cpu().numpy()).max()),
                  float(np.abs(b.numpy() - h.sum(-1).cpu().numpy()).max() / 100))
        device_us = _median_us(lambda: f(x, w), calls)
        host = kn.compile(_mlp(kn), backend=backend_for(kn.device(dev)))
        host_us = _median_us(lambda: host(xs, ws), calls)
        with transfers.counting() as host_seen:
            host(xs, ws)
        rows.append([f"MLP {rows_n}x{k} @ {k}x{k} ({kernels} kernels)", str(a.device),
                     f"{seen['host_to_device']} / {seen['device_to_host']} / {seen['host_operands']}",
                     f"{'ok' if err < 1e-2 else '**FAIL**'} ({err:.1e})", f"{device_us:.0f}",
                     f"{host_us:.0f} ({host_seen['host_to_device'] + host_seen['device_to_host']} copies, "
                     f"{host_seen['host_operands']} host operands)"])
    except Exception as exc:
        rows.append(["MLP", f"not run: {_error(exc)}", "", "", "", ""])
    return table(["program", "results on", "h2d / d2h / host operands per call", "numerics vs torch f64",
                  "device tensors us/call", "host arrays us/call"], rows)


def replay(torch, kn, np, table, calls: int, dev: str = "cuda") -> str:
    rng = np.random.default_rng(1)
    rows = []
    chain = (lambda x, a, b: kn.gelu(x * a + b) * kn.sigmoid(x))
    cases = [("gelu·sigmoid chain, 4096", chain,
              [rng.standard_normal(4096).astype(np.float32), np.float32(1.5), np.float32(0.25)]),
             ("MLP 256x256 (2 kernels)", _mlp(kn),
              [rng.standard_normal((256, 256)).astype(np.float32),
               rng.standard_normal((256, 256)).astype(np.float32) / 16])]
    for name, fn, arrays in cases:
        try:
            args = [kn.tensor(a).to(dev) for a in arrays]
            compiled = kn.compile(fn)
            want = compiled(*args)
            g = kn.capture(fn, *args)
            got = g(*args)
            want, got = (want if isinstance(want, tuple) else (want,)), (got if isinstance(got, tuple) else (got,))
            err = max(float(np.abs(p.numpy() - q.numpy()).max()) for p, q in zip(got, want))
            normal_us = _median_us(lambda: compiled(*args), calls)
            replay_us = _median_us(lambda: g(*args), calls)
            parts = getattr(g.plan.launcher, "parts", None)  # a CudaGraphLauncher's graphs
            graphs = "no CUDA graphs" if parts is None else \
                f"{len(parts)} graph(s), {sum(p.recorded for p in parts)} recorded"
            rows.append([name, f"{'ok' if err <= 1e-6 else '**FAIL**'} ({err:.1e})", f"{normal_us:.1f}",
                         f"{replay_us:.1f}", f"{normal_us / replay_us:.2f}x", graphs])
        except Exception as exc:
            rows.append([name, f"not run: {_error(exc)}", "", "", "", ""])
    return table(["program", "replay vs normal", "normal us/call", "replay us/call", "speedup",
                  "graphs"], rows)


def captured_loop(torch, kn, np, table, calls: int, dev: str = "cuda", tdev: str = "cuda",
                  n: int = 1 << 20) -> str:
    from kiln.runtime import transfers
    from kiln.runtime.cuda_graphs import conditional_nodes_supported

    xs = np.linspace(1.0, 100.0, n, dtype=np.float32)

    def newton(a):  # 20 steps, or fewer once converged: a loop no pass unrolls
        def cond(i, y):
            return ((y * y - a).abs().max() > 1e-4) & (i < 20)
        return kn.while_loop(cond, lambda i, y: (i + 1, 0.5 * (y + a / y)), (kn.tensor(0), a))[1]

    rows = []
    try:
        a = kn.tensor(xs).to(dev)
        compiled = kn.compile(newton)
        g = kn.capture(newton, a)
        got = g(a).numpy()
        err = float(np.abs(got - np.sqrt(xs)).max() / np.sqrt(xs).max())
        normal_us = _median_us(lambda: compiled(a), calls)
        with transfers.counting() as seen:
            replay_us = _median_us(lambda: g(a), calls)
        reads = seen["device_to_host"] // (calls + 1)
        ta = torch.from_numpy(xs).to(tdev)

        def torch_loop():  # the same loop, its test read on the host as torch does
            y, i = ta, 0
            while bool(((y * y - ta).abs().max() > 1e-4).item()) and i < 20:
                y, i = 0.5 * (y + ta / y), i + 1
            if tdev == "cuda":
                torch.cuda.synchronize()
            return y
        torch_us = _median_us(torch_loop, calls)
        loops = sum(type(s).__name__ == "Control" for s in compiled.compiled_graphs()[0].program.steps)
        rows.append([f"Newton (at most 20 steps), {n} float32", f"{'ok' if err < 1e-5 else '**FAIL**'} ({err:.1e})",
                     f"{loops} loop(s)", f"{normal_us:.0f}", f"{replay_us:.0f}", f"{torch_us:.0f}",
                     str(reads), (("yes" if conditional_nodes_supported() else "no") + "; loops: "
                                  + str(getattr(g.plan.launcher, "loop_mode", None)))
                     if dev.startswith("cuda") else "n/a"])
    except Exception as exc:
        rows.append(["Newton while_loop", f"not run: {_error(exc)}", "", "", "", "", "", ""])
    return table(["loop", "numerics vs sqrt", "in the program", "normal us", "replay us", "torch eager us",
                  "host reads per replay", "driver has conditional nodes"], rows)


def allocator(torch, kn, np, table) -> str:
    from kiln.runtime.gpu_devices import _check, _cuda_current

    rows = []
    try:
        driver, _ = _cuda_current(0)

        def free_bytes() -> int:
            free, _total = _check(driver, driver.cuMemGetInfo(), "cuMemGetInfo")
            return int(free)

        kn.memory.empty_cache("cuda")
        free0, reserved0 = free_bytes(), kn.memory.memory_reserved("cuda")
        held = [kn.empty(64 << 20, dtype=kn.float32, device="cuda") for _ in range(4)]  # 4 x 256 MiB
        free1, reserved1 = free_bytes(), kn.memory.memory_reserved("cuda")
        allocated = kn.memory.memory_allocated("cuda")
        del held
        after_drop = kn.memory.memory_reserved("cuda")
        released = kn.memory.empty_cache("cuda")
        free2 = free_bytes()
        mib = 1 << 20
        rows.append(["4 x 256 MiB tensors", f"{(reserved1 - reserved0) / mib:.0f}",
                     f"{(free0 - free1) / mib:.0f}", f"{allocated / mib:.0f}",
                     f"{after_drop / mib:.0f} (cached)", f"{released / mib:.0f}",
                     f"{(free2 - free1) / mib:.0f}"])
    except Exception as exc:
        rows.append([f"not run: {_error(exc)}", "", "", "", "", "", ""])
    return table(["allocation", "memory_reserved grew MiB", "cuMemGetInfo free fell MiB",
                  "memory_allocated MiB", "reserved after del", "empty_cache freed MiB",
                  "free came back MiB"], rows)


def dlpack(torch, kn, np, table) -> str:
    rows = []
    try:
        k = kn.tensor(np.arange(1 << 20, dtype=np.float32)).to("cuda")
        t = torch.from_dlpack(k)
        same = t.data_ptr() == k.numpy().ctypes.data
        t.mul_(2)  # written by torch on the GPU, seen by kiln
        torch.cuda.synchronize()
        seen = float(k.numpy()[3])
        rows.append(["kiln cuda tensor -> torch.from_dlpack", str(t.device),
                     "yes" if same else "**no (copied)**", f"{'ok' if seen == 6.0 else '**FAIL**'} ({seen})"])
    except Exception as exc:
        rows.append(["kiln -> torch", f"not run: {_error(exc)}", "", ""])
    try:  # cudaMalloc memory: not host-visible, so copied once on the device
        t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        k = kn.from_dlpack(t)
        ok = np.array_equal(k.numpy(), t.cpu().numpy())
        rows.append(["torch cuda tensor -> kn.from_dlpack", str(k.device),
                     "yes" if k.numpy().ctypes.data == t.data_ptr() else "no: one device copy "
                     "(expected)", "values ok" if ok else "**WRONG values**"])
        try:
            kn.from_dlpack(t, copy=False)
            rows.append(["torch cuda tensor -> kn.from_dlpack(copy=False)", "**not refused**", "", ""])
        except Exception as exc:  # K382 expected
            rows.append(["torch cuda tensor -> kn.from_dlpack(copy=False)", "refused", "",
                         _error(exc)])
    except Exception as exc:
        rows.append(["torch cuda tensor -> kn.from_dlpack", "**FAILED**", "", _error(exc)])
    try:  # managed memory (cupy's managed allocator): shared, no copy
        import cupy as cp

        with cp.cuda.using_allocator(cp.cuda.malloc_managed):
            a = cp.arange(1 << 20, dtype=cp.float32)
        k = kn.from_dlpack(a)
        a *= 3  # written by cupy on the GPU, seen by kiln
        cp.cuda.Device().synchronize()
        seen = float(k.numpy()[2])
        rows.append(["cupy managed array -> kn.from_dlpack", str(k.device),
                     "yes" if k.numpy().ctypes.data == a.data.ptr else "**no (copied)**",
                     f"{'ok' if seen == 6.0 else '**FAIL**'} ({seen})"])
    except Exception as exc:
        rows.append(["cupy managed array -> kn.from_dlpack", f"not run: {_error(exc)}", "", ""])
    return table(["direction", "device", "zero-copy (same address)", "write-through / error"], rows)


def run(torch, report, table, quick: bool) -> None:
    import numpy as np

    import kiln as kn

    calls = 50 if quick else 200
    for title, part in [
        ("Device runtime: a compiled program on device tensors",
         lambda: resident(torch, kn, np, table, calls)),
        ("Device runtime: CUDA-graph replay vs normal launch (per call, wall clock)",
         lambda: replay(torch, kn, np, table, calls)),
        ("Device runtime: captured while_loop", lambda: captured_loop(torch, kn, np, table, calls // 5)),
        ("Device runtime: caching allocator vs cuMemGetInfo", lambda: allocator(torch, kn, np, table)),
        ("Device runtime: DLPack with torch CUDA", lambda: dlpack(torch, kn, np, table)),
    ]:
        try:
            report.add(title, part())
        except Exception as exc:  # one part failing must not hide the others
            report.failed(title, exc)
