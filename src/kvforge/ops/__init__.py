"""The CPU math below `models/`: the linear every projection runs (`linear`), RMSNorm (`norms`),
RoPE (`rope`), the compiled kernels' Python side (`kernels`) and torch's private ops behind one
checked shim (`torch_private`). Nothing here imports `models/`."""
