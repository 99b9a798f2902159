import torch

# tests/gpu run the compiled kernels on a CUDA device (see gpu.sh); elsewhere they are not collected.
collect_ignore = [] if torch.cuda.is_available() else ["gpu"]
