"""kiln's runtime: Programs of steps over buffers, their executor and the allocator."""

from kiln.runtime.allocator import memory_stats, set_memory_fraction  # noqa: F401
