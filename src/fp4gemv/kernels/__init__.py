"""Private Triton kernels.  Import through ``fp4gemv.ops``; nothing here validates its inputs."""
