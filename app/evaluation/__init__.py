"""Evaluating a run: the validation loss over trained tokens (validation.py), and generation samples under FSDP scored
with ROUGE and exact match (samples.py, and show_samples.py's command line).
"""
