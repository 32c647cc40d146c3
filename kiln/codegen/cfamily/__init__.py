"""What the C-family source emitters share (Metal Shading Language, OpenCL C).

    index.py   sympy index expressions as `long` C, the floor-division helpers, flat index
               decomposition, kernel names
    expr.py    Kernel IR expression DAGs as `const` temporaries, parametrized by a
               `Dialect` (type names, cast syntax, the scalar table, the backend's name);
               the scalar table's construction from a dialect's primitive emitters, and
               how reductions fold (COMBINE)

Each backend keeps what really differs (literals, casts, integer wrapping, launch
geometry, barriers, simdgroup/subgroup reductions); its generated sources are byte-
identical to what it printed before the split (tests/codegen/test_cfamily_golden.py).
"""
