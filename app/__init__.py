"""The training application. Where things are (tests/test_layout.py checks this map against the tree and every
import against its order):

| where | what it holds |
| --- | --- |
| exit_codes.py, choices.py, cli.py, stopping.py, tasks.py, hub.py, folders.py, versions.py | what every part shares: exit statuses, option sets, how a command line meets a shell, how a command ends when stopped or out of resources, which process of a run this is, whether a Hub name loads from here, folders and files written whole, the libraries' versions |
| distributed/ | strategy.py, fsdp2.py, cpu_collectives.py, precision.py, host_memory.py, device_memory.py, ports.py: devices, and the port ranks meet at |
| optimization/ | optimizer.py, muon.py, schedule.py, stochastic_rounding.py: AdamW's groups (or Muon's and AdamW's) and clipping, batch arithmetic and lr(step), bf16 weights rounded stochastically |
| reliability/ | signals.py, watchdog.py, workers.py, torchrun.py, spikes.py: keeping a run alive, ending it well, loss spikes |
| prepare/ | prepare_data.py's pipeline: records, chat templates, masks, packing, the folder it writes |
| data/ | formats.py, order.py, mixture.py, identity.py, loader.py: the prepared folder (or a weighted mixture of folders) read as steps and batches |
| model/ | build.py, pieces.py, isolation.py, loss.py, noise.py: the Hugging Face model on every rank; the piece of each parameter an FSDP1 rank holds; packed examples kept apart; the loss without full logits; NEFTune |
| checkpoint/ | saving, loading and reading checkpoints in either format, now or in the background |
| metrics/ | observe.py, peaks.py, loggers.py, console.py, plot.py, profiling.py, memory_plan.py, activations.py: measuring a run, tracing its steps and planning its memory |
| evaluation/ | validation.py, samples.py, show.py: validation loss and generation samples, and show_samples.py |
| huggingface/ | convert_cli.py, convert.py, upload.py, generate_cli.py, generate.py, prompts_file.py, prefetch.py: to and from Hugging Face (each command line parsed before torch is imported) |
| training/ | preflight/, print_config.py, run.py, loop.py, progress.py: one run, top to bottom |

Imports run one way: a part may import the parts above it in this table (within the first row: tasks.py imports
exit_codes.py; cli.py imports tasks.py; stopping.py imports exit_codes.py, cli.py, tasks.py and folders.py; hub.py
imports cli.py and tasks.py; the others import nothing of app/), never one below it, and nothing in app/ imports the
top-level scripts (arguments.py's Config only as a type name, under TYPE_CHECKING). The scripts (train.py,
prepare_data.py, convert_to_hf.py, prefetch.py, plot_metrics.py, generate.py, show_samples.py) are a few lines each.
"""

LAYERS: tuple[tuple[str, ...], ...] = (
    ("exit_codes", "choices", "cli", "stopping", "tasks", "hub", "folders", "versions"),
    ("distributed",),
    ("optimization",),
    ("reliability",),
    ("prepare",),
    ("data",),
    ("model",),
    ("checkpoint",),
    ("metrics",),
    ("evaluation",),
    ("huggingface",),
    ("training",),
)
"""The parts of app/ in the order of the map above: each may import only parts of its own row or of rows before."""
