"""Subgroup variants, chosen at run time only when the device reports them.

- Reductions (`cl_khr_subgroups` or `cl_intel_subgroups`): each lane's partial value is
  combined across its subgroup with `sub_group_reduce_<op>` (no local memory, no
  barrier), and only one value per subgroup meets in local memory. Used for sums and for
  integer max/min (a float max/min must propagate NaN, which `sub_group_reduce_max`
  does not promise) on work-groups of one outer point.
- GEMM (`cl_intel_subgroups`, Intel GPUs): subgroups of 16 lanes, one output column per
  lane; rows of A and B are fetched with `intel_sub_group_block_read` (one coalesced
  16-float read per row) and A's values shared with `sub_group_broadcast`. Used for
  float32 row-major operands whose N and K are static multiples of 16.

PoCL reports neither extension, so here these kernels are generated and compile-checked
with clang for `spir64` (kiln/codegen/opencl/clang_check.py), not run.
"""

from __future__ import annotations

from kiln.codegen.opencl.scalar import cl_type, combine

_REDUCE_FN = {"sum": "add", "max": "max", "min": "min"}
SG = 16  # the Intel GEMM's subgroup size (intel_reqd_sub_group_size)
SG_ROWS = 4  # rows of C per subgroup
SG_GROUPS = 8  # subgroups per work-group


def pragma(limits) -> str:
    """The extension pragma of the subgroup functions on this device."""
    name = "cl_intel_subgroups" if limits.intel_subgroups else "cl_khr_subgroups"
    return f"#pragma OPENCL EXTENSION {name} : enable\n"


def reduce_eligible(op: str, d) -> bool:
    if op == "sum":
        return d.short in ("i32", "u32", "i64", "f32", "f64")
    return op in ("max", "min") and d.short in ("i32", "u32", "i64")


def subgroup_tree(op: str, d, acc: str, name: str, pad: str) -> list[str]:
    """Lines combining every lane's `acc` into `const T r_<name>`: a subgroup reduction,
    then one partial per subgroup folded from local memory (red_sg_T)."""
    t = cl_type(d)
    red = f"red_sg_{t}"
    return [
        f"{pad}{acc} = sub_group_reduce_{_REDUCE_FN[op]}({acc});",
        f"{pad}if (get_sub_group_local_id() == 0) {red}[get_sub_group_id()] = {acc};",
        f"{pad}barrier(CLK_LOCAL_MEM_FENCE);",
        f"{pad}{t} r_{name} = {red}[0];",
        f"{pad}for (uint s = 1; s < get_num_sub_groups(); ++s) r_{name} = {combine(op, d, f'r_{name}', f'{red}[s]')};",
        f"{pad}barrier(CLK_LOCAL_MEM_FENCE);  /* the scratch is reused */",
    ]


def gemm_eligible(k, in_dtype, limits) -> bool:
    from kiln.codegen.opencl.emit import static_int

    n, kk = static_int(k.n), static_int(k.k)
    return (limits.intel_subgroups and in_dtype.short == "f32" and (k.acc_dtype is None or k.acc_dtype.short == "f32")
            and n is not None and kk is not None and n % SG == 0 and kk % SG == 0
            and str(k.a_strides[2]) == "1" and str(k.b_strides[2]) == "1"
            and SG * SG_GROUPS <= limits.max_work_group_size)


def gemm_main_loop(a: str, b: str, sa: list[str], sb: list[str], p: str) -> list[str]:
    """The block-read main loop: `acc[SG_ROWS]` of rows bm0.. for column bn0 + lane."""
    return [
        f"{p}const int lane = get_sub_group_local_id();",
        f"{p}const long gb = get_group_id(2);",
        f"{p}const long bn0 = (long)get_group_id(0) * {SG};",
        f"{p}const long bm0 = ((long)get_group_id(1) * {SG_GROUPS} + get_local_id(1)) * {SG_ROWS};",
        f"{p}float acc[{SG_ROWS}];",
        f"{p}for (int i = 0; i < {SG_ROWS}; ++i) acc[i] = 0.0f;",
        f"{p}for (long k0 = 0; k0 < K; k0 += {SG}) {{",
        f"{p * 2}float bcol[{SG}];",
        f"{p * 2}for (int kk = 0; kk < {SG}; ++kk)",
        f"{p * 3}bcol[kk] = as_float(intel_sub_group_block_read((const __global uint *)"
        f"({b} + gb * {sb[0]} + (k0 + kk) * {sb[1]} + bn0)));",
        f"{p * 2}for (int i = 0; i < {SG_ROWS}; ++i) {{",
        f"{p * 3}const long row = min(bm0 + i, M - 1);  /* rows past M read a valid row, never stored */",
        f"{p * 3}const float arow = as_float(intel_sub_group_block_read((const __global uint *)"
        f"({a} + gb * {sa[0]} + row * {sa[1]} + k0)));",
        f"{p * 3}for (int kk = 0; kk < {SG}; ++kk) acc[i] = acc[i] + sub_group_broadcast(arow, kk) * bcol[kk];",
        f"{p * 2}}}",
        f"{p}}}",
        f"{p}for (int i = 0; i < {SG_ROWS}; ++i) {{",
        f"{p * 2}const long gi = bm0 + i;",
        f"{p * 2}if (gi >= M) break;",
        f"{p * 2}{{",
        f"{p * 3}const long gj = bn0 + lane;",
        f"{p * 3}const float accv = acc[i];",
    ]
