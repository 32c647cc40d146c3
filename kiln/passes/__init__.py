"""Graph passes: `Graph -> Graph` rewrites between tracing and code generation.

`manager` runs named stages (`Pipeline`), `rewrite` holds the copy/rebuild tools
every pass is built from, `pipeline` lists the default CPU stages (decompose,
canonicalize, fold_constants, cse, dce, then the stages later modules append), and
each pass is one module with one public function. See docs/passes.md.
"""
