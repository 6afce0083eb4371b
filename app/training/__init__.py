"""One training run, top to bottom: every input checked before any worker starts (preflight/, one module per
concern) or printed as the resolved run (print_config.py), the launch and each rank's set-up (run.py), the loop
of optimizer steps with its evaluation, logging and checkpoints (loop.py), and where training stands as a checkpoint
keeps it (progress.py).

Nothing imports it but the top-level scripts (the map in app/__init__.py says what each part may import).
"""
