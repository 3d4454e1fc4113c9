"""GPU tests (NCCL): run where CUDA is available, skipped elsewhere (see conftest.py)."""
