"""How the model is spread over devices and in which dtypes: Lightning Fabric's strategy for --strategy (FSDP1 with
its CPU adapter, FSDP2, DDP, one device; strategy.py, fsdp2.py), FSDP2's point-to-point collectives on CPU processes
(cpu_collectives.py), every decision --precision implies (precision.py), CUDA's allocator settings
(device_memory.py), and the heap tuning of CPU ranks (host_memory.py).

Imports no other package of app/: everything above builds on it.
"""
