"""Reading and writing model data in other frameworks' formats (safetensors)."""

from kiln.io.safetensors_io import load_state_dict, read_metadata, save_state_dict  # noqa: F401
