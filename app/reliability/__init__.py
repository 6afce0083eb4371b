"""Keeping a run alive and ending it well: stop signals at a step boundary and the one guard all-reduce per step
(signals.py), the stall watchdog and the rendezvous deadline (watchdog.py), loss spikes judged and answered
(spikes.py), data loader workers that are safe to start from a rank (workers.py), torchrun passing on a worker's own
exit code (torchrun.py).
"""
