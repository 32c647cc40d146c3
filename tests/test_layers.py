"""The layers of ARCHITECTURE.md hold: each package imports only the layers below it.

Two kinds of check. Fresh subprocesses import a layer with the package face
(`kiln/__init__.py`, which imports every layer) replaced by a bare package, so what ends
up in `sys.modules` is what that layer itself pulls in, lazily imported helpers included
once they run. A static scan (ast) finds the imports no run reaches: inside functions, on
error paths, behind optional packages.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import kiln as kn

ROOT = Path(kn.__file__).resolve().parent  # the kiln package directory

# What a subprocess runs first: `kiln` becomes a bare package over the same directory.
_BARE = """
import importlib, importlib.util, json, pkgutil, sys, types
spec = importlib.util.find_spec("kiln")
bare = types.ModuleType("kiln")
bare.__path__ = list(spec.submodule_search_locations)
bare.__spec__ = spec
sys.modules["kiln"] = bare

def import_all(package):
    # every module under `package`; one whose optional third-party package is absent here
    # is reported, not fatal (kiln's own modules must always import)
    base = importlib.import_module(package)
    missing = []
    for info in pkgutil.walk_packages(base.__path__, package + "."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] == "kiln":
                raise
            missing.append(info.name)
    return missing

def loaded(*layers):
    return sorted(n for n in sys.modules if any(n == l or n.startswith(l + ".") for l in layers))
"""


def _run(body: str) -> dict:
    path = str(ROOT.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", _BARE + textwrap.dedent(body)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bare_package_trick_sees_what_a_layer_loads():
    """The oracle for the checks below: importing the frontend through the bare package
    does load the passes (compile reaches them), so an empty list below means something."""
    out = _run("""
        import kiln.frontend.autodiff
        print(json.dumps({"face": "kiln.frontend.functional" in sys.modules and
                                  hasattr(sys.modules["kiln"], "tensor"),
                          "passes": loaded("kiln.passes")}))
    """)
    assert out["face"] is False  # kiln/__init__.py did not run
    assert "kiln.passes.autodiff" in out["passes"]


def test_ir_loads_no_higher_layer():
    """Every module of kiln/ir, the op registry filled, and a control-flow gradient built
    (the vjp rules of cond and while_loop run the tape of kiln/ir/ad.py): nothing from the
    passes, codegen, frontend or runtime is loaded."""
    out = _run("""
        missing = import_all("kiln.ir")
        from kiln.ir import ad, registry
        from kiln.ir import dtypes as dt
        from kiln.ir.emitter import GraphBuilder
        from kiln.ir.regions import emit_cond
        from kiln.ir.types import TensorType
        ops = registry.all_ops()
        b = GraphBuilder()
        t = TensorType(dt.float32, (4,))
        p = b.add_input(TensorType(dt.bool_, ()))
        x = b.add_input(t)
        (y,) = emit_cond(b, p, [x], [lambda v: [b.sin(v)], lambda v: [b.mul(v, v)]])
        node = b.region.nodes[-1]
        ct = b.full(1.0, dt.float32, (4,))
        grads = registry.get("cond").vjp(b, [ct], node.operands, node.results,
                                         regions=node.regions)
        print(json.dumps({"ops": len(ops), "missing": missing,
                          "grad_op": grads[1].producer.op,
                          "higher": loaded("kiln.passes", "kiln.codegen", "kiln.frontend",
                                           "kiln.runtime", "kiln.nn", "kiln.distributed")}))
    """)
    assert out["ops"] > 100 and out["missing"] == []
    assert out["grad_op"] == "cond"  # the backward of a cond is a cond over the branches' vjps
    assert out["higher"] == []


def test_codegen_loads_no_frontend():
    out = _run("""
        missing = import_all("kiln.codegen")
        from kiln.codegen.backend import get_backend
        get_backend("cpu")
        print(json.dumps({"missing": missing, "codegen": len(loaded("kiln.codegen")),
                          "higher": loaded("kiln.frontend", "kiln.nn", "kiln.optim")}))
    """)
    assert out["codegen"] > 20
    assert out["higher"] == []


# -- the static scan ------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _modules() -> tuple:
    """(dotted name, path, syntax tree) of every module of the package, parsed once."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent)
        name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        out.append((name, path, ast.parse(path.read_text(), str(path))))
    return tuple(out)


def _imports(tree: ast.AST, module: str):
    """(imported module, names) for every import statement, relative ones resolved."""
    package = module if _is_package(module) else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            yield base, tuple(a.name for a in node.names)


def _is_package(module: str) -> bool:
    return (ROOT.parent.joinpath(*module.split(".")) / "__init__.py").exists()


def _in(name: str, *layers: str) -> bool:
    return any(name == layer or name.startswith(layer + ".") for layer in layers)


def test_no_module_inside_kiln_imports_the_package_face():
    submodules = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir()
                                                         if (p / "__init__.py").exists()}
    bad = []
    for module, path, tree in _modules():
        if module == "kiln":
            continue  # the face itself
        for name, names in _imports(tree, module):
            if name == "kiln" and not names:
                bad.append(f"{module}: import kiln")
            elif name == "kiln":
                bad += [f"{module}: from kiln import {n}" for n in names if n not in submodules]
    assert bad == []


def test_ir_imports_only_the_ir_and_leaf_modules():
    allowed = ("kiln.ir", "kiln.errors", "kiln.memory_limits", "kiln._version")
    bad = [f"{module} imports {name}" for module, _, tree in _modules() if _in(module, "kiln.ir")
           for name, names in _imports(tree, module)
           if _in(name, "kiln") and not _in(name, *allowed)
           and not (name == "kiln" and set(names) <= {"memory_limits", "_version"})]
    assert bad == []


def test_codegen_and_frontend_use_only_public_names_of_the_passes():
    bad = []
    for module, _, tree in _modules():
        if not _in(module, "kiln.codegen", "kiln.frontend"):
            continue
        for name, names in _imports(tree, module):
            if _in(name, "kiln.passes"):
                bad += [f"{module}: from {name} import {n}" for n in names if n.startswith("_")]
        for node in ast.walk(tree):  # kiln.passes.fusion._cone spelled as an attribute
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and _in(ast.unparse(node.value), "kiln.passes"):
                bad.append(f"{module}: {ast.unparse(node)}")
    assert bad == []


def test_lower_layers_never_import_higher_ones():
    rules = {"kiln.codegen": ("kiln.frontend", "kiln.nn", "kiln.optim"),
             "kiln.passes": ("kiln.codegen", "kiln.runtime", "kiln.frontend", "kiln.nn"),
             "kiln.frontend": ("kiln.nn", "kiln.optim")}
    bad = [f"{module} imports {name}" for module, _, tree in _modules()
           for layer, banned in rules.items() if _in(module, layer)
           for name, _ in _imports(tree, module) if _in(name, *banned)]
    assert bad == []


def test_regions_are_entered_through_the_builder():
    """`with builder.entering(region):` is the one way to emit into a nested region: no
    module pops a builder's region stack by hand (a missed pop on an error path leaves
    every later node in the wrong region)."""
    bad = []
    for module, _, tree in _modules():
        if module == "kiln.ir.emitter":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "pop" and isinstance(node.func.value, ast.Attribute) \
                    and node.func.value.attr == "regions":
                bad.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    assert bad == []


# -- the kn face ----------------------------------------------------------------------------

INTERNAL = ("apply", "raw", "wrap", "dt", "binary", "emitter_for", "to", "to_array",
            "creation_emitter", "normalize_axis", "as_dim", "numel", "threefry2x32", "MaxMin",
            "np", "sympy", "threading", "annotations")


def test_the_face_exposes_no_internal_helper():
    assert [n for n in INTERNAL if hasattr(kn, n)] == []
    foreign = [n for n, v in vars(kn).items() if not n.startswith("_")
               and type(v).__name__ == "module" and not v.__name__.startswith("kiln.")]
    assert foreign == []
    # what it does expose still works: the public functions the star imports bring
    x = kn.tensor([1.0, 4.0, 9.0])
    assert kn.sqrt(x).numpy().tolist() == [1.0, 2.0, 3.0]
    assert kn.reshape(kn.arange(6), (2, 3)).shape == (2, 3)


def test_star_imported_modules_declare_all():
    from kiln.frontend import factories, functional, shape_ops

    for module in (factories, functional, shape_ops):
        names = module.__all__
        assert len(set(names)) == len(names)
        assert [n for n in names if not hasattr(module, n) or n.startswith("_")] == []
        assert [n for n in names if getattr(kn, n) is not getattr(module, n)] == []
