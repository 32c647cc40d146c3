"""The OpenCL backend (Intel XPU and any OpenCL device; PoCL on the CPU): see backend.py."""
