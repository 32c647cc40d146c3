"""A process that splits a kernel over OpenMP threads (`kiln_parallel_for`) and runs
prepared calls (the `kiln_launches` trampoline), with kiln's glue modules from the
artifact cache in KILN_CACHE_DIR when it holds them. Prints one JSON line: the largest
relative error against numpy, how many launches the native split ran, whether a
prepared call held a split launch, and the glue cache's STATS.

    python tests/codegen/glue_worker.py
"""

import json

import numpy as np


def main() -> dict:
    import kiln as kn
    from kiln.codegen.cpu import compiled as cc
    from kiln.codegen.cpu import glue_cache
    from kiln.runtime import threads

    kn.set_num_threads(2)
    threads.set_split_policy("always")
    native = {"calls": 0}
    real = cc.parallel_for

    def counted():
        fn = real()
        if fn is None:
            return None

        def call(*args):
            native["calls"] += 1
            return fn(*args)

        return call

    cc.parallel_for = counted
    f = kn.compile(lambda x: kn.exp(x) * 2.0 + 1.0)
    worst = 0.0
    for seed in range(4):  # the general path twice (the second prepares), then prepared calls
        x = np.random.default_rng(seed).standard_normal((1 << 20) + 37).astype(np.float32)
        got = f(kn.tensor(x)).numpy().astype(np.float64)
        want = np.exp(x.astype(np.float64)) * 2.0 + 1.0
        worst = max(worst, float(np.max(np.abs(got - want) / np.abs(want))))
    split_prepared = [part[3][6] for call in f._fast.values() if call
                      for part in call.plan._parts if part[0] == "launches" and part[3] is not None]
    return {"worst": worst, "native": native["calls"], "split_prepared": split_prepared,
            "glue": dict(glue_cache.STATS)}


if __name__ == "__main__":
    print(json.dumps(main()))
