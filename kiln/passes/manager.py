"""The pass manager: a `Pipeline` is an ordered list of named `Graph -> Graph` stages.

A pass is a module with one public function taking a graph and returning a new graph,
or the same object when it changed nothing; it never mutates its input in a way the
caller can see (it copies first, see `kiln.passes.rewrite`). The pipeline runs the
stages in order and, with `debug=True` or `KILN_VERIFY_PASSES=1` in the environment,
verifies the graph after every stage and checks that no stage changed its input, so a
broken pass is named at once instead of surfacing as a wrong kernel much later.

Every stage's output can be kept (`run_stages`, or `run(..., dump=...)`): that is what
`kiln dump --stage NAME` prints (Triton's and tinygrad's named stages, STYLE §2).

    >>> p = Pipeline([("canonicalize", canonicalize), ("dce", dce)])
    >>> optimized = p.run(graph)
    >>> p.run_stages(graph)["canonicalize"]   # the graph after that stage
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, MutableMapping, Union

from kiln.errors import KilnArgumentError, KilnError, KilnVerifierError
from kiln.ir.graph import Graph
from kiln.ir.verifier import verify

PassFn = Callable[[Graph], Graph]
Dump = Union[MutableMapping[str, Graph], Callable[[str, Graph], None], None]

VERIFY_ENV = "KILN_VERIFY_PASSES"


def verify_enabled(debug: bool = False) -> bool:
    """Whether pipelines verify after each stage: `debug`, or KILN_VERIFY_PASSES=1."""
    return debug or os.environ.get(VERIFY_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class StageRecord:
    """What one stage did in the last run: its name, wall time and whether it changed
    the graph (returned a new object)."""

    name: str
    seconds: float
    changed: bool


@dataclass
class Pipeline:
    """Named graph passes run in order.

    >>> p = Pipeline([("cse", cse), ("dce", dce)], debug=True)
    >>> p.names()          # ['cse', 'dce']
    >>> p.run(graph, until="cse")
    """

    stages: list[tuple[str, PassFn]] = field(default_factory=list)
    debug: bool = False
    records: list[StageRecord] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self):
        self.stages = [self._checked(stage) for stage in self.stages]
        self._check_unique()

    # -- building ----------------------------------------------------------------------

    @staticmethod
    def _checked(stage) -> tuple[str, PassFn]:
        if not (isinstance(stage, tuple) and len(stage) == 2 and isinstance(stage[0], str)
                and callable(stage[1])):
            raise KilnArgumentError(f"Pipeline: a stage is a (name, function) pair, got {stage!r}")
        return stage

    def _check_unique(self) -> None:
        names = self.names()
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise KilnArgumentError(f"Pipeline: stage name(s) {', '.join(repeated)} appear twice; "
                                    "every stage needs its own name for `kiln dump --stage`")

    def names(self) -> list[str]:
        """The stage names, in order."""
        return [name for name, _ in self.stages]

    def append(self, name: str, fn: PassFn) -> "Pipeline":
        """Add a stage at the end (returns self, so calls chain)."""
        self.stages.append(self._checked((name, fn)))
        self._check_unique()
        return self

    def extend(self, stages: Iterable[tuple[str, PassFn]]) -> "Pipeline":
        """Add stages at the end, in order."""
        for name, fn in stages:
            self.append(name, fn)
        return self

    def insert_after(self, after: str, name: str, fn: PassFn) -> "Pipeline":
        """Add a stage right after the stage named `after`."""
        index = self._index(after)
        self.stages.insert(index + 1, self._checked((name, fn)))
        self._check_unique()
        return self

    def _index(self, name: str) -> int:
        names = self.names()
        if name not in names:
            raise KilnArgumentError(f"pipeline has no stage named {name!r}; its stages are "
                                    f"{', '.join(names) or '(none)'}")
        return names.index(name)

    # -- running -----------------------------------------------------------------------

    def run(self, graph: Graph, until: str | None = None, dump: Dump = None) -> Graph:
        """Run the stages in order (stopping after `until` when given).

        `dump` receives each stage's output: a dict is filled name -> graph, a callable
        is called as `dump(name, graph)`.
        """
        last = self._index(until) if until is not None else len(self.stages) - 1
        checking = verify_enabled(self.debug)
        if checking:  # a broken input must not be blamed on the first stage
            try:
                verify(graph)
            except KilnVerifierError as exc:
                raise KilnVerifierError(f"pipeline input: {exc.message}") from None
        self.records = []
        for name, fn in self.stages[:last + 1]:
            before = str(graph) if checking else None
            start = time.perf_counter()
            result = fn(graph)
            elapsed = time.perf_counter() - start
            if not isinstance(result, Graph):
                raise KilnError(f"internal: pass '{name}' returned {type(result).__name__}, "
                                "not a Graph")
            if checking:
                self._check_stage(name, graph, before, result)
            self.records.append(StageRecord(name, elapsed, result is not graph))
            if dump is not None:
                if callable(dump):
                    dump(name, result)
                else:
                    dump[name] = result
            graph = result
        return graph

    def run_stages(self, graph: Graph) -> dict[str, Graph]:
        """Every stage's output, by stage name, in pipeline order."""
        outputs: dict[str, Graph] = {}
        self.run(graph, dump=outputs)
        return outputs

    def __call__(self, graph: Graph) -> Graph:
        return self.run(graph)

    @staticmethod
    def _check_stage(name: str, graph: Graph, before: str, result: Graph) -> None:
        if str(graph) != before:
            raise KilnError(f"internal: pass '{name}' modified the graph it was given; a pass "
                            "must copy before it rewrites (kiln.passes.rewrite)")
        try:
            verify(result)
        except KilnVerifierError as exc:
            raise KilnVerifierError(f"after pass '{name}': {exc.message}") from None


def run_pass(fn: PassFn, graph: Graph, *, debug: bool = True) -> Graph:
    """Run one pass as a one-stage pipeline (verified by default): handy in tests.

    >>> run_pass(cse, graph)
    """
    name = getattr(fn, "__name__", "pass")
    return Pipeline([(name, fn)], debug=debug).run(graph)
