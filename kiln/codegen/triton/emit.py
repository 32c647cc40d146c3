"""Kernel IR -> Triton source: one `@triton.jit` function per kernel.

A `Kernel`'s outer (parallel) loops are flattened into one index space split in
XBLOCK-wide blocks, one per program (`tl.program_id(0)`); the flat index is decomposed
back into the loop variables with `//` and `%`. A kernel whose stages have inner loops
(a reduction, and the stores over the reduced domain that follow it) works on
[XBLOCK, RBLOCK] tiles, the inner loops flattened the same way along axis 1:

- persistent, when every inner space has at most RBLOCK (static) elements: one block
  covers a whole row, so stages sharing an inner space share loads (a softmax reads
  its input once);
- looped otherwise: each group of stages runs `for roffset in range(0, rnumel, RBLOCK)`,
  reductions accumulating per lane and combining across lanes after the loop.

Consecutive reductions over one inner space that do not read each other share a loop
(mean and mean of squares in one pass). Tails are masked (`xmask`, `rmask`); a mask
is left out where a static size is a multiple of its block. Sizes (shape variables)
are int64 kernel arguments, so one compiled kernel serves every size; index math is
int32 when every extent is static and small, int64 otherwise.

A `GemmKernel` becomes a tiled `tl.dot` loop over BLOCK_K (grouped program order for
L2 reuse, a batch folded into the program id) with its epilogue applied to the
accumulator tile before the one store.

Block sizes come from `tiling._tiles`; the source depends on them only through the
constexpr values and the persistent/looped choice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import sympy

from kiln.codegen.kernel_ir import AnyKernel, GemmKernel, Kernel, Load, Reduce, ReduceRef, Store, walk
from kiln.codegen.triton import scalar
from kiln.codegen.triton.emit_expr import Names, paren, static_int, subst_expr, Tile, index_text, pointer
from kiln.codegen.triton.scalar import pointer_type, reg_dtype
from kiln.codegen.triton.tiling import Tiles, _tiles
from kiln.errors import KilnArgumentError, KilnDTypeError
from kiln.ir import dtypes as dt
from kiln.ir.shapes import numel, symbol

HEADER = "import triton\nimport triton.language as tl\nfrom triton.language.extra import libdevice\n"
_I32_LIMIT = 2 ** 31 - 2 ** 16  # a block past the end must still index in int32


@dataclass(frozen=True)
class EmitOptions:
    """What the source depends on besides the kernel and the target.

    fast_math: hardware approximations for division, sqrt, exp, log, sin, cos, rsqrt.
    f32_matmul: "ieee" (exact float32 products, FMA units), "tf32" or "tf32x3"."""

    fast_math: bool = False
    f32_matmul: str = "ieee"


@dataclass(frozen=True)
class EmittedKernel:
    """A kernel as Triton source plus what it takes to compile and launch it.

    signature: every argument in order: buffers ("*fp32", ...), sizes ("i64"), then the
    block sizes ("constexpr", values in `constexprs`). grid: the number of programs is
    the product of ceil(extent / block) over `grid` (extents in the size symbols)."""

    name: str
    source: str
    kind: str
    signature: dict = field(hash=False)
    constexprs: dict = field(hash=False)
    buffers: tuple
    sizes: tuple
    grid: tuple
    num_warps: int
    num_stages: int
    persistent: bool = False


# -- loop kernels -------------------------------------------------------------------------------

def kernel_name(name: str) -> str:
    return "kiln_" + re.sub(r"\W", "_", name)


def index_bits(kernel: AnyKernel) -> int:
    """32 when every buffer is static and far from 2**31 elements, else 64."""
    for b in kernel.buffers:
        n = static_int(numel(b.shape))
        if n is None or n >= _I32_LIMIT:
            return 64
    return 32


def _unit_subs(loops) -> dict:
    return {symbol(l.var): 0 for l in loops if static_int(l.extent) == 1}


def _decompose(var_names: list[str], extents: list, flat: str, symbols: dict) -> list[str]:
    """Statements binding each loop variable from a flat row-major index."""
    out = []
    strides = []
    stride = sympy.Integer(1)
    for ext in reversed(extents):
        strides.append(stride)
        stride = sympy.expand(stride * ext)
    strides.reverse()
    for j, (v, ext, st) in enumerate(zip(var_names, extents, strides)):
        text = flat if st == 1 else f"{flat} // {paren(index_text(st, symbols), st)}"
        if j > 0:
            text = f"({text}) % {paren(index_text(ext, symbols), ext)}" if st != 1 else \
                f"{flat} % {paren(index_text(ext, symbols), ext)}"
        out.append(f"{v} = {text}")
    return out


def _classify(kernel: Kernel) -> str:
    """inner / outer / full: which axis of the [XBLOCK, RBLOCK] tile is contiguous in memory."""
    if not kernel.outer:
        return "reduction_full"
    first = next((s for s in kernel.stages if s.loops), None)
    if first is None:
        return "reduction_inner"
    r_last, x_last = symbol(first.loops[-1].var), symbol(kernel.outer[-1].var)
    coeffs_r, coeffs_x = [], []
    for x in walk(first.value):
        if isinstance(x, Load):
            idx = sympy.expand(sympy.sympify(x.index))
            coeffs_r.append(idx.coeff(r_last))
            coeffs_x.append(idx.coeff(x_last))
    if any(c == 1 for c in coeffs_r):
        return "reduction_inner"
    if any(c == 1 for c in coeffs_x):
        return "reduction_outer"
    return "reduction_inner"


def emit_kernel(kernel: AnyKernel, target: str = "sm_90", options: EmitOptions = EmitOptions(),
                tiles: Tiles | None = None) -> EmittedKernel:
    """Triton source for one Kernel IR kernel, for `target` ("sm_90", "gfx942", ...).

        >>> emitted = emit_kernel(kernel, "sm_90")          # doctest: +SKIP
        >>> print(emitted.source)                           # doctest: +SKIP
    """
    _check_target(kernel, target)
    if isinstance(kernel, GemmKernel):
        from kiln.codegen.triton.emit_gemm import emit_gemm

        return emit_gemm(kernel, target, options, tiles)
    if not isinstance(kernel, Kernel):
        raise KilnArgumentError(f"triton backend: cannot compile {type(kernel).__name__}")
    return _LoopEmitter(kernel, target, options, tiles).emit()


def _check_target(kernel: AnyKernel, target: str) -> None:
    """What a target cannot compute, said in kiln's terms before Triton says it in its own."""
    if target != "sm_80":
        return
    values = [kernel.epilogue] if isinstance(kernel, GemmKernel) else [st.value for st in kernel.stages]
    dtypes = {b.dtype for b in kernel.buffers} | {x.dtype for v in values for x in walk(v)}
    if dt.float8_e4m3fn in dtypes:
        raise KilnDTypeError("triton backend: float8_e4m3fn needs sm_89 or newer on NVIDIA (sm_80 has "
                             "float8_e5m2 only)", hint="compile for cuda:sm_90, or use float8_e5m2")


class _LoopEmitter:
    def __init__(self, kernel: Kernel, target: str, options: EmitOptions, tiles: Tiles | None):
        self.k, self.target, self.options = kernel, target, options
        subs = _unit_subs(kernel.outer) | {s: 0 for st in kernel.stages for s in _unit_subs(st.loops)}
        memo: dict = {}
        self.stages = [self._subst_stage(st, subs, memo) for st in kernel.stages]
        self.two_d = any(st.loops for st in self.stages)
        self.xnumel = numel([l.extent for l in kernel.outer]) if kernel.outer else 1
        self.spaces: list[tuple] = []
        for st in self.stages:
            if st.loops and _space_key(st.loops) not in [_space_key(s) for s in self.spaces]:
                self.spaces.append(st.loops)
        rnumels = [static_int(numel([l.extent for l in s])) for s in self.spaces]
        rmax = None if any(r is None for r in rnumels) else max(rnumels, default=1)
        self.kind = _classify(kernel) if self.two_d else "pointwise"
        self.tiles = tiles or _tiles(self.kind, static_int(self.xnumel), None, rmax,
                                     self._first_dtype(), target)
        rblock = self.tiles.blocks.get("RBLOCK", 1)
        self.persistent = self.two_d and rmax is not None and rmax <= rblock
        self.bits = index_bits(kernel)

    @staticmethod
    def _subst_stage(st, subs, memo):
        if not subs:
            return st
        if isinstance(st, Reduce):
            return Reduce(st.name, st.op, st.loops, subst_expr(st.value, subs, memo), st.dtype)
        return Store(st.buffer, sympy.sympify(st.index).subs(subs), subst_expr(st.value, subs, memo), st.loops)

    def _first_dtype(self):
        for st in self.stages:
            if isinstance(st, Reduce):
                return st.dtype
        return self.k.buffers[-1].dtype

    def emit(self) -> EmittedKernel:
        k, names = self.k, Names()
        fixed = ["xnumel", "xoffset", "xindex", "xmask", "rnumel", "roffset", "rindex", "rmask",
                 "XBLOCK", "RBLOCK"]
        for n in fixed:
            names.get(n)
        buffers = {b.name: b.dtype for b in k.buffers}
        buffer_names = {b.name: names.get(b.name) for b in k.buffers}
        symbols = {s: names.get(f"size_{s}") for s in k.sizes}
        var_dim = {}
        for l in k.outer:
            symbols[l.var] = names.get(l.var)
            var_dim[l.var] = 0
        for space in self.spaces:
            for l in space:
                if l.var not in symbols:
                    symbols[l.var] = names.get(l.var)
                var_dim[l.var] = 1
        blocks = self.tiles.blocks
        xblock = blocks["XBLOCK"]
        xstatic = static_int(self.xnumel)
        has_xmask = not (xstatic is not None and xstatic % xblock == 0)
        if self.two_d:
            shapes = {frozenset({0, 1}): "[XBLOCK, RBLOCK]", frozenset({0}): "[XBLOCK, 1]",
                      frozenset({1}): "[1, RBLOCK]"}
        else:
            shapes = {frozenset({0}): "[XBLOCK]"}
        tile = Tile(names, buffers, symbols, var_dim, shapes, {0: "xmask" if has_xmask else None},
                     self.options.fast_math, buffer_names)
        self.tile, self.names, self.symbols = tile, names, symbols
        top = tile.top
        top.append(f"xnumel = {index_text(self.xnumel, symbols)}")
        pid = "tl.program_id(0)" + (".to(tl.int64)" if self.bits == 64 else "")
        top.append(f"xoffset = {pid} * XBLOCK")
        top.append(f"xindex = xoffset + tl.arange(0, XBLOCK)" + ("[:, None]" if self.two_d else ""))
        if has_xmask:
            top.append("xmask = xindex < xnumel")
        top += _decompose([symbols[l.var] for l in k.outer], [l.extent for l in k.outer], "xindex", symbols)
        self.space_ids = {_space_key(s): i for i, s in enumerate(self.spaces)}
        self.active_space = None
        self.rnumel_defined: set = set()
        self.space_memos: dict = {}
        for group in _groups(self.stages):
            self._group(group)
        return self._finish(tile)

    # -- inner spaces -----------------------------------------------------------------------
    def _suffix(self, loops) -> str:
        return "" if len(self.spaces) == 1 else str(self.space_ids[_space_key(loops)])

    def _space_setup(self, loops, lines: list[str], offset: str | None) -> None:
        """Bind rindex/rmask and the loop variables of one inner space into `lines`."""
        sfx = self._suffix(loops)
        rnumel = numel([l.extent for l in loops])
        rstatic = static_int(rnumel)
        rblock = self.tiles.blocks["RBLOCK"]
        has_rmask = not (rstatic is not None and rstatic % rblock == 0)
        rindex = f"rindex{sfx}"
        start = f"{offset} + " if offset else ""
        lines.append(f"{rindex} = {start}tl.arange(0, RBLOCK)[None, :]")
        if has_rmask:
            lines.append(f"rmask{sfx} = {rindex} < rnumel{sfx}")
        lines += _decompose([self.symbols[l.var] for l in loops], [l.extent for l in loops], rindex, self.symbols)
        self.tile.masks[1] = f"rmask{sfx}" if has_rmask else None

    def _group(self, group: list) -> None:
        tile = self.tile
        loops = group[0].loops
        if not loops:
            for st in group:
                self._store(st)
            return
        sfx = self._suffix(loops)
        rnumel = numel([l.extent for l in loops])
        rstatic = static_int(rnumel)
        used = not self.persistent or rstatic is None or rstatic % self.tiles.blocks["RBLOCK"] != 0
        if used and sfx not in self.rnumel_defined:  # the loop bound, or the mask's
            self.rnumel_defined.add(sfx)
            tile.top.append(f"rnumel{sfx} = {index_text(rnumel, self.symbols)}")
        if self.persistent:
            if self.active_space != _space_key(loops):
                self._space_setup(loops, tile.top, None)
                self.active_space = _space_key(loops)
                tile.memo_inner = self.space_memos.setdefault(_space_key(loops), {})
            for st in group:
                self._reduce_persistent(st) if isinstance(st, Reduce) else self._store(st)
            return
        # looped: accumulators before the loop, per-lane combine inside, across lanes after
        accs = {}
        for st in group:
            if isinstance(st, Reduce):
                acc = self.names.get(f"_{st.name}")
                accs[st.name] = acc
                init = scalar.reduce_init(st.op, st.dtype)
                tile.top.append(f"{acc} = tl.full([XBLOCK, RBLOCK], {init}, {reg_dtype(st.dtype)})")
        body: list[str] = []
        tile.inner, tile.memo_inner = body, {}
        self._space_setup(loops, body, "roffset")
        for st in group:
            if isinstance(st, Reduce):
                text, deps = self._reduce_value(st)
                step = scalar.reduce_combine(st.op, st.dtype, accs[st.name], text)
                mask = tile.masks.get(1)
                body.append(f"{accs[st.name]} = " + (f"tl.where({mask}, {step}, {accs[st.name]})" if mask else step))
            else:
                self._store(st)
        tile.top.append(f"for roffset in range(0, rnumel{sfx}, RBLOCK):")
        tile.top += ["    " + line for line in body]
        tile.inner = None
        self.active_space = None
        for st in group:
            if isinstance(st, Reduce):
                self._finish_reduce(st, accs[st.name])

    def _reduce_value(self, st: Reduce) -> tuple[str, frozenset]:
        tile = self.tile
        text, deps = tile.value(st.value)
        return tile.convert(text, st.value.dtype, st.dtype, deps), deps

    def _reduce_persistent(self, st: Reduce) -> None:
        tile = self.tile
        text, deps = self._reduce_value(st)
        full = tile.broadcast(text, deps, {0, 1}, reg_dtype(st.dtype))
        mask = tile.masks.get(1)
        if mask:
            full = f"tl.where({mask}, {full}, {scalar.reduce_init(st.op, st.dtype)})"
        self._finish_reduce(st, full)

    def _finish_reduce(self, st: Reduce, tile_text: str) -> None:
        across, helper = scalar.reduce_across(st.op, st.dtype, tile_text, 1)
        if helper:
            self.tile.helpers.add(helper)
        name = self.names.get(st.name)
        self.tile.top.append(f"{name} = {across}[:, None]")
        self.tile.refs[st.name] = (name, st.dtype)

    def _store(self, st: Store) -> None:
        tile = self.tile
        d = tile.buffers[st.buffer]
        text, deps = tile.value(st.value)
        text = tile.convert(text, st.value.dtype, d, deps)
        mask_deps = {0} | ({1} if st.loops else set())
        mask = tile.mask(mask_deps)
        idx_deps = tile.deps_of_index(st.index)
        target = set(deps) | set(idx_deps) | {m for m in mask_deps if tile.masks.get(m)}
        index = tile.broadcast(tile.index(st.index), idx_deps, target, "tl.int32")
        line = f"tl.store({pointer(tile.buffer_names[st.buffer], index)}, {text}" + (f", mask={mask})" if mask else ")")
        tile.lines(deps | idx_deps | (frozenset({1}) if st.loops else frozenset())).append(line)

    def _finish(self, tile: Tile) -> EmittedKernel:
        k = self.k
        fname = kernel_name(k.name)
        signature = {self.tile.buffer_names[b.name]: pointer_type(b.dtype) for b in k.buffers}
        signature.update({self.symbols[s]: "i64" for s in k.sizes})
        blocks = dict(self.tiles.blocks)
        if not self.two_d:
            blocks = {"XBLOCK": blocks["XBLOCK"]}
        signature.update({b: "constexpr" for b in blocks})
        params = [f"{n}: tl.constexpr" if t == "constexpr" else n for n, t in signature.items()]
        head = f"def {fname}({', '.join(params)}):"
        doc = _describe(self)
        body = [f"    {line}" for line in [doc] + tile.top]
        source = module_source(tile.helpers, ["@triton.jit", head] + body)
        return EmittedKernel(fname, source, self.kind, signature, blocks, tuple(b.name for b in k.buffers),
                             tuple(k.sizes), ((self.xnumel, blocks["XBLOCK"]),), self.tiles.num_warps,
                             self.tiles.num_stages, self.persistent)


def _describe(e: _LoopEmitter) -> str:
    outer = ", ".join(f"{l.var} < {l.extent}" for l in e.k.outer) or "one point"
    if not e.two_d:
        return f'"""pointwise over {outer}"""'
    spaces = "; ".join(", ".join(f"{l.var} < {l.extent}" for l in s) for s in e.spaces)
    how = "persistent: one block per row" if e.persistent else "looped over RBLOCK chunks"
    return f'"""{e.kind.replace("_", " ")}: parallel {outer}; inner {spaces} ({how})"""'


def _space_key(loops) -> tuple:
    return tuple((l.var, str(l.extent)) for l in loops)


def _groups(stages) -> list[list]:
    """Consecutive stages over one inner space that can share a loop: a stage joins the
    group unless it reads a reduction the group itself computes."""
    groups: list[list] = []
    for st in stages:
        if groups and _space_key(groups[-1][0].loops) == _space_key(st.loops) and st.loops:
            produced = {g.name for g in groups[-1] if isinstance(g, Reduce)}
            reads = {x.name for x in walk(st.value) if isinstance(x, ReduceRef)}
            if not (produced & reads):
                groups[-1].append(st)
                continue
        groups.append([st])
    return groups


def module_source(helpers: set, kernel_lines: list[str]) -> str:
    out = [HEADER]
    for name in sorted(h for h in helpers if h in scalar.COMBINE_HELPERS):
        out.append(f"\n@triton.jit\ndef {name}(a, b):\n    {scalar.COMBINE_HELPERS[name]}\n")
    out.append("\n" + "\n".join(kernel_lines) + "\n")
    return "\n".join(out)
