"""Train a Hugging Face causal LM or encoder-decoder with Lightning Fabric (FSDP, FSDP2, DDP or one device):
`python train.py --help`."""

import signal
import sys

from app.tasks import (end_by_signals_as_a_containers_first_process, end_quietly_when_srun_ends_the_task,
                       end_with_the_launcher, refuse_unreadable_variables, remember_a_time_limit_warning)
from arguments import option_sources, parse_config

if __name__ == "__main__":
    # Until training starts, Ctrl-C ends the process at once by SIGINT's default action: quietly (no KeyboardInterrupt
    # traceback) and even while it waits in C code (the rendezvous); a shell reports 130. app/reliability/signals.py
    # takes over. A rank started by Lightning's launcher inherits SIGINT blocked (app/training/run.py): a pending Ctrl-C
    # ends it here.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    end_quietly_when_srun_ends_the_task()  # so that srun's exit code is the failed task's: app/tasks.py
    end_by_signals_as_a_containers_first_process()  # PID 1 ignores signals left to their default action
    remember_a_time_limit_warning()  # SIGUSR1 while starting: acted on once the options are known
    refuse_unreadable_variables()
    end_with_the_launcher()  # a rank Lightning's launcher started, until training begins
    config = parse_config()
    from app.training.run import run

    run(config, option_sources(sys.argv[1:]))
