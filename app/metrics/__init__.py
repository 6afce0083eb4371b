"""Measuring a run: throughput, FLOPs, MFU and memory (observe.py, with the GPUs' peak FLOP/s in peaks.py), where the
numbers go (loggers.py: metrics.csv, summary.json, Weights & Biases, TensorBoard), what rank 0 prints (console.py), the
pictures of plot_metrics.py (plot.py), torch.profiler's traces of --profile_steps (profiling.py), and the memory
planner of --estimate_memory (memory_plan.py, with the activations measured on the weightless model in activations.py).
"""
