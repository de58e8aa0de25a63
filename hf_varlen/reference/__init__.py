"""Pure-PyTorch reference implementations (oracles) of every op, one module per op.

They run on CPU and GPU, support autograd, and favour clarity over speed. Tests and benchmarks
compare kernels against them; nothing under ``hf_varlen.ops`` imports them.
"""
