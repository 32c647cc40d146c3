"""Shorthand for writing Kernel IR by hand in the backend tests."""

from kiln.codegen.kernel_ir import Op


def op(name, *args, dtype=None):
    """Op `name` of `args`, of the first argument's dtype unless given."""
    return Op(name, tuple(args), dtype or args[0].dtype)
