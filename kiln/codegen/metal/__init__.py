"""The Metal backend (Apple GPUs): Kernel IR -> Metal Shading Language (see backend.py)."""
