"""The exit status of train.py, for users, wrapper scripts and schedulers (imports nothing, so arguments.py can use it).

Each node's launching process (local rank 0) exits with it; the other ranks exit 0, so that Lightning's launcher
does not kill the launching process for a child's non-zero status while it is still shutting down.
"""

EXIT_FINISHED = 0
"""Training reached max_step; the last checkpoint is saved."""
EXIT_BAD_INPUT = 2
"""An option, file or folder was wrong: refused before any work, one line per problem, nothing written."""
EXIT_NON_FINITE = 3
"""A non-finite loss or gradient norm stopped the run; that step was not applied and nothing was saved from it."""
EXIT_PREEMPTED = 75
"""SIGTERM/SIGUSR1 stopped the run after a checkpoint of the current step (EX_TEMPFAIL): rerun with --resume true."""
