"""Bringing models in from other frameworks (PyTorch, through torch.export)."""

from kiln.interop.torch_import import TorchProgram, from_torch  # noqa: F401
