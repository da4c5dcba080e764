"""The small shared base: stdlib-level helpers any part of gpuwatch may import."""
