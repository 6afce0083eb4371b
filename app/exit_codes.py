"""The exit status of train.py, for users, wrapper scripts and schedulers (imports nothing, so arguments.py can use it).

Each node's launching process (local rank 0) exits with it; the other ranks exit 0, so that Lightning's launcher
does not kill the launching process for a child's non-zero status while it is still shutting down. The exceptions
end every process at once, each with the code: a stall, a rendezvous timeout, and Ctrl-C outside the save path.
"""

EXIT_FINISHED = 0
"""Training reached max_step; the last checkpoint is saved."""
EXIT_CRASHED = 1
"""An exception on a rank (its traceback printed): that rank's node ends every process it started at once; the
Slurm scripts end the whole job (srun --kill-on-bad-exit) and do not requeue it, as a requeued run would meet the
same error."""
EXIT_ENDED_BY_SRUN = 1
"""An srun task that SIGTERM ended before training (srun ending the step because another task failed, or a scancel):
the lowest failure code, as srun exits with the highest code of its tasks, so that the job's code is the failed
task's own (2, 4, 5, 7) rather than 143 (app/tasks.py)."""
EXIT_BAD_INPUT = 2
"""An option, file or folder was wrong: refused before any work, one line per problem, nothing written. Also
--estimate_memory's answer when the run as configured does not fit its devices."""
EXIT_NON_FINITE = 3
"""A non-finite loss or gradient norm stopped the run; that step was not applied and nothing was saved from it."""
EXIT_STALLED = 4
"""No optimizer step, evaluation or save finished within --stall_timeout_min: every rank printed its Python stacks
and the run ended without saving. Requeue and resume (--resume true) from the latest checkpoint; the Slurm scripts
do that."""
EXIT_RENDEZVOUS_TIMEOUT = 5
"""The ranks did not all meet within --rendezvous_timeout_min at start-up (a node that never started, or wrong
MASTER_ADDR/MASTER_PORT/NODE_RANK), or their port was another process's; nothing was trained. The Slurm scripts
requeue, as a node may have failed (and a requeued job picks another port)."""
EXIT_SPIKES = 6
"""Loss spikes kept coming (--spike_guard): spikes without rows to blame repeated under skip, or after the last
rollback, or with no checkpoint to roll back to; the step was not applied and nothing was saved from it. Not
requeued: resume from the last checkpoint with a lower --lr (out_dir/quarantine.jsonl lists the rows set aside)."""
EXIT_SAVE_FAILED = 7
"""The storage refused a checkpoint (a full disk, a quota, a read-only or vanished mount): every rank stopped at that
save, one line naming the rank, the error and the file; what the save wrote is removed, the checkpoints before it are
kept, the steps since the last one are lost. Not requeued (the storage stays full): make room, then resume."""
EXIT_CORRUPT_CHECKPOINT = 8
"""The checkpoint --resume true chose (the newest that read whole in the preflight) was found corrupt while loading (a
piece whose checksum differs): it was moved to checkpoints/rolled-back/ and nothing was trained. Run again to resume
from the checkpoint before it; the Slurm scripts requeue. A --checkpoint named by the user is exit 2 instead."""
EXIT_PREEMPTED = 75
"""SIGTERM/SIGUSR1 stopped the run after a checkpoint of the current step (EX_TEMPFAIL): rerun with --resume true."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (SIGINT, 128 + 2): the first one during training stops after a checkpoint of the current step; a second
one, or one before the first step, quits at once without saving. Not requeued: the user stopped the run."""
