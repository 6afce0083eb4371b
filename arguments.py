"""Every option of train.py: command line and YAML config files (`--config run.yaml`), parsed into one `Config`.

The groups and names follow the original FSDP training script (seed 001). Each dataclass is one help group; the
attribute docstrings are the help text. Parsing needs no torch import, so `--help` is instant; how the command line
meets a shell (the command line wins over --config, bare boolean flags, one-line refusals) is app/cli.py's.
"""

from __future__ import annotations

import math
import sys
import typing
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, replace
from functools import cache
from pathlib import Path
from typing import Callable, Literal, Optional, Union

import jsonargparse
import yaml
from jsonargparse import ArgumentParser

from app.choices import CHECKPOINTING_OPTIONS, FSDP1_ONLY_OPTIONS, MAX_SEED, SHARDED_STRATEGIES
from app.cli import (UsageError, command_parser, config_file_lines, config_files_first, naming_config_files, parse,
                     refuse)
from app.metrics.profiling import profile_window
from app.tasks import exit_refused, launching_process

Precision = Literal["bf16-true", "bf16-mixed", "16-mixed", "32-true"]
ShardingStrategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]


@dataclass
class DeviceArgs:
    """Devices"""

    accelerator: Literal["auto", "gpu", "cuda", "cpu", "tpu"] = "auto"
    """Hardware to run on; auto picks the GPUs when there are any, else the CPU."""
    devices: Union[int, Literal["auto"]] = "auto"
    """Processes (GPUs) per node; auto uses every visible GPU, or one CPU process."""
    num_nodes: int = 1
    """Number of machines; the world size is devices x num_nodes."""
    strategy: Literal["fsdp", "fsdp2", "ddp", "single_device"] = "fsdp"
    """fsdp shards parameters, gradients and optimizer state (FSDP1); fsdp2 does the same per parameter with torch's
    fully_shard (DTensors); ddp replicates the model (what the original script's --no_fsdp did)."""
    precision: Precision = "bf16-true"
    """bf16-true keeps weights and optimizer state in bf16 (least memory; steps much smaller than a weight, as at a
    fine-tune's lr of 2e-5, are rounded away, unless --stochastic_rounding); bf16-mixed keeps fp32 master weights
    (for pre-training, long runs); 16-mixed (fp16 with loss scaling) is for GPUs without bf16 (V100, T4). (No
    16-true: AdamW's state in fp16 loses the squared gradients of most weights, and the run diverges.)"""
    stochastic_rounding: bool = False
    """Under bf16-true, round each AdamW step of the bf16 weights stochastically instead of to nearest: a step
    smaller than half a bf16 spacing (a fine-tune's lr of 2e-5 on a weight above 0.01) then moves the weight by the
    step on average instead of not at all, for no memory (docs/training.md#precision); AdamW's second moment too,
    so --beta2 0.999 is taken. An AdamW of this project's own, not torch's fused one; the same state, so checkpoints
    move between the two."""
    tf32: bool = True
    """With 32-true on Ampere or newer GPUs, run fp32 matmuls on TF32 tensor cores (10-bit mantissa, several times
    faster); false keeps full fp32."""
    tpu: bool = False
    """Alias of --accelerator tpu with Lightning's XLA FSDP strategy (untested here: no TPU on our machines)."""


@dataclass
class DataArgs:
    """Data"""

    train_data_dir: Optional[str] = None
    """Folder written by prepare_data.py (datasets save_to_disk): splits train and validation, column input_ids. A
    weighted mixture of such folders (one format, one tokenizer): `wiki-es:0.7,wiki-en:0.3`, each `[name=]folder:weight`;
    every step holds each folder's share of rows (docs/training.md#data-mixtures)."""
    num_workers: int = 2
    """Data loader worker processes per rank."""
    record_rows: bool = False
    """Write out_dir/rows.jsonl: the train rows of every step by folder, `{"step": 5, "rows": {"wiki-es": [...]}}`,
    to audit what the model saw (a mixture's shares, a spike's data)."""


@dataclass
class ModelArgs:
    """Model"""

    model_name: Optional[str] = None
    """Hugging Face hub id or local folder of a pretrained model to fine-tune: a causal LM, or an encoder-decoder
    (T5, BART) for seq2seq data."""
    model_config: Optional[str] = None
    """A config.json file, or a folder holding one: the model is initialised from scratch (pretraining, tests)."""
    init_from: Optional[str] = None
    """A train.py checkpoint (a file, a sharded folder, or a run folder: its newest) whose architecture and weights
    start a new run: step 0, a fresh optimizer and schedule, in another --out_dir (a new phase of training, another
    mixture; torchtitan's initial_load_model_only). Instead of --model_name and --model_config."""
    freeze: Optional[list[str]] = None
    """Regular expressions of parameter names (the Hugging Face model's, searched in each: `embed_tokens`,
    `model.layers.([0-9]|1[0-5])\\.`) whose parameters do not train: no gradient, no optimizer state, never
    updated; every other parameter trains (axolotl's unfrozen_parameters, the other way round)."""
    model_overrides: Optional[dict[str, typing.Any]] = None
    """Fields of the model's config to change before it is built, as JSON (or a mapping in a config file): a longer
    context (`{"max_position_embeddings": 32768, "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
    "rope_theta": 500000.0, "original_max_position_embeddings": 8192}}`), a dropout. Checkpoints and the converted
    config.json hold the changed config; a field that reshapes pretrained weights is refused."""
    tokenizer: Optional[str] = None
    """Tokenizer recorded with the run for conversion; default: the data folder's tokenizer/, else the model's."""
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] = "sdpa"
    """Attention kernel: PyTorch SDPA (flash/memory-efficient on GPUs), flash_attention_2 (needs flash-attn), or
    eager (transformers' own matmuls; the models without an SDPA path, e.g. Gemma-2)."""
    trust_remote_code: bool = False
    """Allow model code from the hub repository to run; off unless you trust its authors."""
    compile: bool = False
    """torch.compile the model after FSDP wrapping: faster GPU steps after a compilation warm-up at the start."""
    chunked_loss: Optional[bool] = None
    """Compute the loss chunk by chunk from the last hidden states, never holding the full-vocabulary logits (the
    largest activation at 128K-token vocabularies); models that change the logits after the output layer (BART)
    keep their own loss, with a note. false: the model's own loss. Default: chunked, except with --compile on GPUs,
    where the model's own loss is compiled into its graph: 14% faster, for 2.1 GB more at 8K tokens of a 128K
    vocabulary (docs/performance.md, on an H200)."""
    loss_kernel: Literal["torch", "cut_cross_entropy"] = "torch"
    """What computes the chunked loss: this project's own (torch; every device), or Apple's Cut Cross-Entropy
    (`pip install cut-cross-entropy`; a Triton kernel, CUDA GPUs only). On an H200 its loss head took 33 ms against
    42 in a fraction of the memory, its default gradient filter leaving the hidden states' gradient within 2e-2 of
    the exact one (docs/performance.md); opt-in, and not yet measured inside a training run."""


@dataclass
class FSDPArgs:
    """FSDP"""

    auto_wrap_policy: Optional[list[str]] = None
    """Layer class names that become FSDP units, e.g. [LlamaDecoderLayer]; default: the model's _no_split_modules.
    Another policy draws a model built from a config in another order: other initial weights for the same --seed."""
    sharding_strategy: ShardingStrategy = "FULL_SHARD"
    """FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), HYBRID_SHARD (shard in a node, replicate across), NO_SHARD
    (which torch deprecates under --strategy fsdp: ddp, or fsdp2 with NO_SHARD, trains the same)."""
    limit_all_gathers: bool = True
    """Throttle parameter all-gathers so that memory stays bounded; recommended when memory is tight."""
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST", "none"] = "BACKWARD_PRE"
    """When backward all-gathers the next layer: PRE (most overlap, one more layer in memory), POST, none (least)."""
    forward_prefetch: bool = False
    """All-gather the next layer while the current one runs forward; helps when the CPU lags behind the GPU."""
    cpu_offload: bool = False
    """Keep sharded parameters and gradients in CPU memory; several times slower, for models that do not fit."""
    gradient_checkpointing: bool = False
    """Recompute the activations of each wrapped layer in backward: much less memory, about 30% more compute."""
    gradient_checkpointing_every: int = 1
    """With --gradient_checkpointing: recompute one layer in every N, from the first (2: layers 0, 2, 4, ...), the
    others keeping their activations: less recomputation for more memory (torchtitan's selective layer
    checkpointing); --estimate_memory plans it."""
    fsdp_no_sync: bool = False
    """With gradient accumulation, keep gradients unsharded until the last micro-batch (FSDP's no_sync): one
    reduce-scatter per step instead of one per micro-batch, but every rank holds the whole model's gradient, summed
    over the micro-batches: under fsdp in the compute dtype (bf16 under bf16-mixed, +16 GB per GPU for Llama-3-8B)
    rather than reduced in fp32 after each, under fsdp2 in --reduce_dtype (fp32: +32 GB). Default: reduce-scatter
    after every micro-batch."""
    reduce_dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    """dtype FSDP reduce-scatters gradients in; default float32 under *-mixed precision (as torchtitan), the
    weights' dtype under *-true. bfloat16 halves the gradient traffic of bf16-mixed at some accuracy; float16 only
    under 16-mixed (its loss scaling keeps small gradients within float16's range)."""


@dataclass
class CheckpointArgs:
    """Checkpoint"""

    out_dir: str = "out"
    """Run folder: checkpoints/, metrics.csv, config.yaml."""
    state_dict_type: Literal["full", "sharded"] = "full"
    """full: one file under Hugging Face names, every rank writing its own shards into it (ranks on other machines
    through rank 0); sharded: a folder of torch.distributed.checkpoint files, one per rank (no traffic between machines on multi-node
    runs). Either one resumes under any strategy and number of ranks."""
    async_save: bool = False
    """Write checkpoints in a background thread while the next step computes: a sharded checkpoint's blocks in host
    memory from the training state itself (the weight update then first copies what is not yet written), the rest
    (a full file's pieces, a GPU's) from a copy made at once (the weight update waits for the copy); the next save
    and the end of the run wait for the write. A crash during the write leaves the previous checkpoints."""
    resume: bool = False
    """Continue from --checkpoint, or from the latest checkpoint in out_dir."""
    checkpoint: Optional[str] = None
    """Checkpoint file (or sharded folder) to resume from; needs --resume true."""
    keep_last_n: Optional[int] = None
    """Keep only the newest N checkpoints (plus the best one in checkpoints/best.json and the one resumed from)."""
    requeue_on_signal: bool = False
    """Under Slurm, after the checkpoint that SIGUSR1 (the warning before a time limit) asks for, run `scontrol requeue
    $SLURM_JOB_ID` so the job restarts; SIGTERM (scancel, preemption) is left to Slurm."""


@dataclass
class TrainingArgs:
    """Training"""

    number_epochs: int = 1
    """Passes over the training split, used when neither --max_step nor --max_tokens is given."""
    micro_batch_size: int = 1
    """Sequences per device in one forward/backward pass."""
    gradient_accumulation_steps: Optional[int] = None
    """Micro-batches per optimizer step; default 1, or derived from --global_batch_size."""
    global_batch_size: Optional[int] = None
    """Sequences per optimizer step over all devices; sets accumulation = global / (micro x devices x nodes)."""
    grad_clip: float = 1.0
    """Maximum global gradient norm; 0 disables clipping (the norm is still measured, logged and checked)."""
    max_step: Optional[int] = None
    """Optimizer steps to train; default: number_epochs x steps per epoch. Give it, --max_tokens or --number_epochs."""
    max_tokens: Optional[int] = None
    """Tokens to train on (`2e9`), counted as LitGPT and Megatron count them: every position of a step's sequences,
    global batch x block size (for one example per row, its mean lengths in stats.json). The run trains the steps that
    reach it, its schedule spanning them, over as many passes as the data needs. Give it, --max_step or
    --number_epochs."""
    lr: float = 2e-5
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 2e-6
    """Learning rate at max_step, the end of the decay."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """Move --lr and --min_lr from --reference_batch_size to the run's global batch: linear (x G/B) or sqrt
    (x sqrt(G/B), steadier); the resolved values are printed and written to config.yaml."""
    reference_batch_size: Optional[int] = None
    """The global batch size --lr was tuned at; needed by --lr_scaling linear/sqrt."""
    lr_decay: bool = True
    """Decay from lr to min_lr after warmup (cosine, or --lr_decay_type); false keeps lr constant after warmup."""
    lr_decay_type: Literal["cosine", "linear", "sqrt"] = "cosine"
    """The decay's shape: cosine, linear, or sqrt (1 - sqrt of the decay's progress: the cooldown of
    warmup-stable-decay runs)."""
    lr_decay_ratio: float = 1.0
    """Share of the run's steps that the decay takes, at its end: 1 decays from the end of warmup on; 0.2 holds lr
    until the last 20% of the steps, then decays (warmup-stable-decay, as torchtitan's decay_ratio and the Hugging
    Face Trainer's warmup_stable_decay; a resume with a larger --max_step moves the decay to the new end)."""
    warmup_steps: Union[int, float] = 0
    """Optimizer steps of linear warmup from 0 to lr; below 1, that share of the run's steps (0.03: the Hugging Face
    Trainer's warmup_ratio 0.03)."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """adamw: AdamW for every parameter. muon: Muon (torch.optim.Muon: each weight matrix's momentum orthogonalised by
    Newton-Schulz) for the weight matrices of the model's layers, AdamW for the embeddings, the output layer, norms
    and biases, as Muon is used (Kimi K2 and GLM-4.5 were trained so); one --lr for both, Muon's update scaled to
    AdamW's size (match_rms_adamw). Muon needs whole matrices: --strategy fsdp2, ddp or single_device
    (docs/training.md#optimizers)."""
    muon_momentum: float = 0.95
    """Muon's (Nesterov) momentum; read with --optimizer muon."""
    weight_decay: float = 0.01
    """Weight decay, decoupled as AdamW's (not applied to norms and biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon, added to the root of the second moment (torch's default; the Hugging Face Trainer's
    adam_epsilon)."""
    seed: int = 42
    """Seed of model initialisation, data order and every random generator."""
    neftune_noise_alpha: float = 0.0
    """NEFTune: while training, uniform noise of alpha / sqrt(L x d) on the input embeddings, L the length of each
    example (packed or padded: its own, where the Hugging Face Trainer and TRL take the whole row's) and d their
    width; 5 is the paper's usual value for supervised fine-tuning. 0: off. Causal models only."""
    label_smoothing: float = 0.0
    """Share of each trained token's target spread evenly over the vocabulary (torch's label_smoothing, the Hugging
    Face Trainer's label_smoothing_factor; 0.1 in the usual summarisation and translation recipes of T5 and BART).
    train_loss includes it; val_loss, its perplexity and the best checkpoint stay the plain cross-entropy. 0: off."""
    z_loss: float = 0.0
    """Add this times the square of each trained token's log softmax normaliser (log-sum-exp of its logits) to its
    loss: PaLM's z-loss (1e-4 there, and in OLMo 2), which keeps the logits from drifting over long pre-training.
    train_loss includes it; val_loss stays the plain cross-entropy. 0: off."""


@dataclass
class EvalArgs:
    """Evaluation"""

    eval_batch_size: Optional[int] = None
    """Sequences per device in evaluation; default: --micro_batch_size."""
    eval_iters: int = 100
    """Maximum validation batches per evaluation (per device), of each folder evaluated."""
    eval_data_dir: Optional[str] = None
    """Folders evaluated at every evaluation besides --train_data_dir's validation split and never trained on, each
    logged as val_loss/<name>: `general=data/web,code=data/code-eval`, each `[name=]folder`, prepared by
    prepare_data.py with the training data's format and tokenizer (their validation split is read). val_loss, the
    best checkpoint and early stopping stay the training data's (docs/training.md#evaluation-folders)."""
    eval_step_interval: Union[int, float] = 500
    """Evaluate every this many optimizer steps (and at the end of each epoch and of training); below 1, that share
    of the run's steps (0.1: every tenth of the run, as the Hugging Face Trainer reads eval_steps); 0: never (no
    validation loss, no best checkpoint), as for data without a validation split."""
    initial_validation: bool = True
    """Evaluate once before the first step of a new run: the baseline every later validation loss compares with."""
    early_stopping_patience: Optional[int] = None
    """Stop once this many evaluations in a row have not lowered the best validation loss so far (by more than
    --early_stopping_threshold): the run saves and ends as finished, checkpoints/best.json naming its best
    checkpoint (the Hugging Face Trainer's EarlyStoppingCallback; save at the evaluation interval to keep each)."""
    early_stopping_threshold: float = 0.0
    """The least fall of the validation loss that counts as an improvement for --early_stopping_patience."""
    eval_only: bool = False
    """Evaluate and exit without training: the model (--model_name, or a checkpoint's weights with --init_from) on
    --train_data_dir's validation split, as a run evaluates (val_loss, per folder of a mixture, --eval_samples),
    written as metrics.csv's step-0 row and summary.json in --out_dir (the Hugging Face Trainer's do_eval alone)."""
    eval_samples: int = 0
    """At each evaluation, greedily generate the answers of this many fixed validation prompts (supervised or
    seq2seq data), write them to out_dir/samples/ and log exact match, ROUGE-1/2/L/Lsum and their length."""
    eval_max_new_tokens: int = 128
    """Most tokens generated per sample (fewer when every sample stops earlier)."""


@dataclass
class SaveArgs:
    """Save"""

    save_step_interval: Union[int, float] = 1000
    """Write a checkpoint every this many optimizer steps (and at the end of training); below 1, that share of the
    run's steps (0.05: every 5% of the run). 0: none, for benchmarks and smoke tests (a run stopped by a signal still
    saves, so that it can resume)."""


@dataclass
class LoggingArgs:
    """Logging"""

    log_interval: Union[int, float] = 10
    """Print and log training metrics every this many optimizer steps (and at the last; below 1, that share of the
    run's steps): the mean of their losses,
    the last step's LR and gradient norm, the throughput over them; a checkpoint keeps the losses of the steps not
    logged yet, so a resumed run logs what a run that was not stopped logs."""
    entity: Optional[str] = None
    """Weights & Biases entity (user or team); default: $WANDB_ENTITY, else your default entity."""
    project: Optional[str] = None
    """Weights & Biases project; default: $WANDB_PROJECT, else fsdp-trainer."""
    run_name: Optional[str] = None
    """Weights & Biases run name; default: $WANDB_NAME, else the out_dir folder name."""
    log_model: Union[bool, Literal["all"]] = False
    """Upload checkpoints to Weights & Biases as artifacts: true for the last one, all for every one."""
    wandb_mode: Optional[Literal["online", "offline", "disabled"]] = None
    """Weights & Biases: online needs WANDB_API_KEY or `wandb login`; offline writes to out_dir/wandb for a later
    `wandb sync`; default: $WANDB_MODE, else disabled (nothing written). WANDB_PROJECT, WANDB_ENTITY, WANDB_NAME and
    WANDB_DIR are honoured the same way."""
    tensorboard: bool = False
    """Also write every metrics.csv column, at the same steps, and the run's options as TensorBoard event files in
    out_dir/tensorboard (no network; a resume continues that TensorBoard run without the steps it abandons); needs
    the tensorboardX package (requirements.txt). View with `tensorboard --logdir out_dir/tensorboard`."""
    peak_tflops: Optional[float] = None
    """Dense peak TFLOP/s of one device in the run's compute dtype, for MFU; default: app/metrics/peaks.py's table of
    NVIDIA GPUs (a GPU it does not list has no MFU)."""
    profile_steps: Optional[str] = None
    """Trace these optimizer steps with torch.profiler, `FIRST:LAST` (`10:12`) or one step: each rank writes
    out_dir/profile/steps-FIRST-LAST-rank-R.json.gz (CPU operators and GPU kernels with their memory, for
    https://ui.perfetto.dev) and a .txt table of the operators that took the most time."""


@dataclass
class PlannerArgs:
    """Memory planner"""

    estimate_memory: bool = False
    """Print the expected memory per device and the largest micro batch that fits, then exit without training
    (exit 2 when the run does not fit)."""
    print_config: bool = False
    """Check every input, print the resolved run (each option with where its value came from: flag, config file,
    environment or default; then the values derived from them: world size, accumulation, global batch, tokens per
    step, learning rates, steps) as YAML that --config reads back, then exit without training."""
    device_memory_gb: Optional[float] = None
    """Memory of one device for --estimate_memory (e.g. 80 to plan for an H100 elsewhere); default: this machine's."""
    block_size: Optional[int] = None
    """Tokens per sequence for --estimate_memory (e.g. 8192), without a prepared data folder (--train_data_dir then
    optional); default: the data's longest row."""


@dataclass
class ReliabilityArgs:
    """Reliability"""

    stall_timeout_min: float = 20.0
    """End the run (exit 4, stacks printed) when no step, evaluation or save finishes for this long; 0 never does.
    Below --process_group_timeout_min, so that the watchdog acts before a collective times out. Also how long a
    finished run waits for its last W&B uploads (unless WANDB_FINISH_TIMEOUT says; `wandb sync` sends the rest)."""
    process_group_timeout_min: float = 30.0
    """Timeout of every collective of every process group the run creates (torch.distributed)."""
    rendezvous_timeout_min: float = 10.0
    """End the run (exit 5) when the ranks of all nodes have not joined the process group this long after launch."""


@dataclass
class SpikeArgs:
    """Loss spikes (docs/reliability.md)"""

    spike_guard: Literal["off", "detect", "skip", "rollback"] = "skip"
    """What a loss or gradient-norm spike does: detect reports it; skip also leaves the step's update out and sets
    aside the train rows that caused it (out_dir/quarantine.jsonl; they train nothing from then on, after resumes too);
    rollback also reloads the last good checkpoint in place when loss spikes without rows to blame repeat, and goes on
    after the data that led there; off judges nothing."""
    spike_z: float = 6.0
    """A loss spike lies this many standard deviations of the loss's step-to-step noise above the median of the last
    10 steps."""
    spike_grad_norm_z: Optional[float] = None
    """Also judge the gradient norm (by its logarithm), with this many standard deviations; off by default: on small
    batches the norm varies by factors from one ordinary step to the next."""
    spike_window: int = 100
    """Steps whose loss and gradient norm make the statistics a step is judged against."""
    spike_warmup: int = 50
    """Steps accepted before any is judged (the loss falls steeply at first); at most --spike_window."""
    spike_min_rise: float = 0.1
    """A loss spike also rises at least this many nats above that median: near a loss of 0 (a model memorising a small
    set) the noise is so small that any wobble would count."""
    spike_incident: int = 3
    """Spikes without rows to blame within --spike_incident_steps steps that make an incident: rollback (or stop,
    exit 6, under skip and once --spike_max_rollbacks are spent)."""
    spike_incident_steps: int = 50
    """The stretch of steps within which spikes count together."""
    spike_max_rollbacks: int = 3
    """Rollbacks a run makes at most; the next incident stops it (exit 6)."""
    spike_rewarm_steps: int = 0
    """After a rollback, warm the learning rate up again over this many steps (0: at once)."""


GROUPS = (DeviceArgs, DataArgs, ModelArgs, FSDPArgs, CheckpointArgs, TrainingArgs, EvalArgs, SaveArgs, LoggingArgs,
          PlannerArgs, ReliabilityArgs, SpikeArgs)


@dataclass
class Config(SpikeArgs, ReliabilityArgs, PlannerArgs, LoggingArgs, SaveArgs, EvalArgs, TrainingArgs, CheckpointArgs, FSDPArgs,
             ModelArgs, DataArgs, DeviceArgs):
    """All options of one run, flat as on the command line (`cfg.lr`, `cfg.devices`)."""

    def to_dict(self) -> dict:
        """Plain data, for checkpoints and config.yaml."""
        return asdict(self)

    def to_yaml(self) -> str:
        """config.yaml: what `--config` reads back (a method, so that app/ asks the Config it is given rather than
        importing this script)."""
        parser = build_parser()
        # dumped as they are: parse_object would read text again as YAML (`run_name: "#3 baseline"` as null)
        return parser.dump(jsonargparse.Namespace(**self.readable_back().to_dict()), skip_unset=False)

    def unread(self) -> set[str]:
        """The options another one turns off (readable_back puts them at their defaults)."""
        return {name for names, _, _ in unread_options(self) for name in names}

    def readable_back(self) -> "Config":
        """The options another one turns off (a flag's `--lr_decay false` over a file's `min_lr`) at their defaults:
        nothing reads them, and `--config` refuses a file that sets both (config.yaml, --print_config's output)."""
        defaults = {f.name: f.default for f in fields(Config)}
        return replace(self, **{name: defaults[name] for names, _, _ in unread_options(self) for name in names})


MINUTES_PER_YEAR = 525_600


@cache
def build_parser() -> ArgumentParser:
    """Built once per process (0.2 s of jsonargparse reading the groups' docstrings), then reused: every rank parses
    its command line, and rank 0 also writes config.yaml through it; the suite's fork server builds it before it
    forks its train.py processes."""
    return command_parser("train.py", "Fully fine-tune or pre-train a Hugging Face causal LM or encoder-decoder "
                                      "(T5, BART) with Lightning Fabric and FSDP.", GROUPS)


def read_config(argv: Optional[list[str]] = None) -> Config:
    """Parse argv (default: sys.argv) without checking values; raises UsageError (one line) on a bad command line."""
    namespace = parse(build_parser(), argv)
    cfg = Config(**{f.name: namespace[f.name] for f in fields(Config)})
    return replace(cfg, tpu=True) if cfg.accelerator == "tpu" else cfg  # one switch: --tpu is its alias


def parse_config(argv: Optional[list[str]] = None) -> Config:
    """Parse and validate; exit with status 2 and one line per problem when the command line or a value is bad."""
    arguments = sys.argv[1:] if argv is None else argv
    try:
        cfg = read_config(argv)
    except UsageError as error:
        try:  # a value of the wrong type in a config file is named with the file
            refuse("train.py", naming_config_files(str(error), option_sources(arguments)))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):  # a file that cannot be read: its error says which
            refuse("train.py", str(error))
    sources = option_sources(arguments)
    problems = validate_config(cfg, sources)
    if problems:
        exit_refused([f"error: {naming_config_files(p, sources)}" for p in problems])
    for unread, switch, _ in unread_options(cfg) if launching_process() else []:  # turned_off_by_a_flag: said
        files = sorted({sources[name].removeprefix("config ") for name in unread})
        print(f"note: {flags(unread)} ({', '.join(files)}) not read: --{switch} on the command line turns it off",
              file=sys.stderr)
    return cfg


def option_sources(argv: list[str]) -> dict[str, str]:
    """Where each option given on this command line or in its config files comes from: `flag`, or `config FILE`
    (the last file that sets it, a file another names included); options absent from both are defaults (or the
    environment, where one is read)."""
    sources: dict[str, str] = {}
    arguments = config_files_first(argv)
    for index, argument in enumerate(arguments):
        if argument == "--config" and index + 1 < len(arguments) or argument.startswith("--config="):
            sources |= config_sources(argument.split("=", 1)[1] if "=" in argument else arguments[index + 1])
        elif argument.startswith("--") and argument != "--config":
            sources[argument[2:].split("=", 1)[0]] = "flag"
    return sources


def config_sources(path: str) -> dict[str, str]:
    """The options config file `path` (or YAML text) sets, in the order they apply: a file it names where its line
    stands."""
    return {key: f"config {file}" for key, _, file in config_file_lines(path)}


OPTIONS_DOC = Path(__file__).resolve().parent / "docs" / "options.md"
OPTIONS_BEGIN = "<!-- generated by `python arguments.py` from the parser: do not edit by hand -->"
OPTIONS_END = "<!-- end of the generated options -->"


def options_markdown() -> str:
    """The option reference of docs/options.md, generated from the parser so that it cannot drift from it. Each help
    text is one line, so that every option is one table row."""
    help_of = {action.dest: " ".join(action.help.split()) for action in build_parser()._actions}
    lines = []
    for group in GROUPS:
        hints = typing.get_type_hints(group)
        lines += [f"**{group.__doc__}**", "", "| option | default | meaning |", "| --- | --- | --- |"]
        lines += [f"| `--{f.name}` | `{f.default}` | {help_of[f.name]}{choices(hints[f.name])} |"
                  for f in fields(group)]
        lines.append("")
    return "\n".join(lines).strip()


def choices(hint: object) -> str:
    """` Choices: a, b.` for an option that takes one of some words (a Literal), else nothing."""
    members = typing.get_args(hint) if typing.get_origin(hint) is Union else (hint,)
    if any(typing.get_origin(member) is not Literal and member not in (bool, type(None)) for member in members):
        return ""  # --devices: a number, or auto
    words = [word for member in members if typing.get_origin(member) is Literal for word in typing.get_args(member)]
    words = (["true", "false"] if words and bool in members else []) + [str(word) for word in words]
    return f" Choices: {', '.join(words)}." if words else ""


def with_options(document: str) -> str:
    """The document with the generated reference between its markers (appended, with the markers, if it has none)."""
    generated = f"{OPTIONS_BEGIN}\n\n{options_markdown()}\n\n{OPTIONS_END}"
    start, end = document.find(OPTIONS_BEGIN), document.find(OPTIONS_END)
    if start < 0 or end < start:
        return document.rstrip("\n") + "\n\n" + generated + "\n"
    return document[:start] + generated + document[end + len(OPTIONS_END):]


def write_options_doc(path: Path = OPTIONS_DOC) -> bool:
    """Splice the generated reference into `path` (docs/options.md); True when the file changed."""
    before = path.read_text() if path.exists() else "# Options\n"
    after = with_options(before)
    if after != before:
        path.write_text(after)
    return after != before


def validate_config(cfg: Config, sources: Optional[dict[str, str]] = None) -> list[str]:
    """Every problem with the values themselves, one line each (files and models are checked by
    app/training/preflight). `sources` (option_sources) lets a flag turn off options a config file sets."""
    problems = []

    def require(condition: bool, message: str) -> None:
        if not condition:
            problems.append(message)

    for option in fields(cfg):  # a YAML .inf: the command line refuses inf, and --lr .inf trained until step 2
        value = getattr(cfg, option.name)
        require(not isinstance(value, float) or math.isfinite(value),
                f"--{option.name} must be a finite number, got {value}")
    if problems:
        return problems
    refused_unread = [(unread, message) for unread, switch, message in unread_options(cfg)
                      if not turned_off_by_a_flag(unread, switch, sources or {})]
    unread_flags = tuple(f"--{name} " for unread, _ in refused_unread for name in unread)

    def require_of_read(condition: bool, message: str) -> None:
        """An option refused as unread is not refused for its value as well: one line, saying to drop it."""
        if not message.startswith(unread_flags):
            require(condition, message)

    value_ranges(cfg, require_of_read)
    for rules in (option_combinations, strategy_rules):
        rules(cfg, require)
    return problems + [message for _, message in refused_unread]


def value_ranges(cfg: Config, require: Callable[[bool, str], None]) -> None:
    """Each option within its own range."""
    for name in ("num_nodes", "micro_batch_size", "number_epochs", "eval_iters", "eval_max_new_tokens"):
        require(getattr(cfg, name) >= 1, f"--{name} must be at least 1, got {getattr(cfg, name)}")
    for name, off in (("eval_step_interval", ", or 0 for no validation"), ("save_step_interval", ", or 0 for no "
                      "checkpoints"), ("log_interval", "")):
        value = getattr(cfg, name)
        require((value > 0 or off and value == 0) and (value < 1 or float(value).is_integer()),
                f"--{name} must be a whole number of steps, or a share of the run's steps between 0 and 1{off}, got "
                f"{value}")
    for name in ("devices", "gradient_accumulation_steps", "global_batch_size", "max_step", "max_tokens",
                 "eval_batch_size", "keep_last_n", "reference_batch_size", "early_stopping_patience"):
        value = getattr(cfg, name)
        require(value in (None, "auto") or value >= 1, f"--{name} must be at least 1, got {value}")
    require(cfg.gradient_checkpointing_every >= 1,
            f"--gradient_checkpointing_every must be at least 1, got {cfg.gradient_checkpointing_every}")
    for name in ("device_memory_gb", "peak_tflops"):
        value = getattr(cfg, name)
        require(value is None or value > 0, f"--{name} must be positive, got {value}")
    require(cfg.num_workers >= 0, f"--num_workers must be 0 or more, got {cfg.num_workers}")
    require(0 <= cfg.seed <= MAX_SEED, f"--seed must be between 0 and {MAX_SEED} (numpy's range, which every rank "
            f"seeds), got {cfg.seed}")
    require(cfg.eval_samples >= 0, f"--eval_samples must be 0 or more, got {cfg.eval_samples}")
    try:
        profile_window(cfg.profile_steps)
    except ValueError as error:
        require(False, str(error))
    require(cfg.stall_timeout_min >= 0, f"--stall_timeout_min must be 0 (off) or positive, got {cfg.stall_timeout_min}")
    for name in ("process_group_timeout_min", "rendezvous_timeout_min"):  # a timedelta overflows past a year or so
        require(0 < getattr(cfg, name) <= MINUTES_PER_YEAR,
                f"--{name} must be positive and at most a year ({MINUTES_PER_YEAR}), got {getattr(cfg, name)}")
    require(not 0 < cfg.process_group_timeout_min < 1, "--process_group_timeout_min must be at least 1 (a minute): it "
            f"also bounds the ranks' first connection to each other, got {cfg.process_group_timeout_min}")
    require(cfg.warmup_steps >= 0 and (cfg.warmup_steps < 1 or float(cfg.warmup_steps).is_integer()),
            f"--warmup_steps must be a whole number of steps, or a share of the run's steps between 0 and 1, got "
            f"{cfg.warmup_steps}")
    require(0 < cfg.lr_decay_ratio <= 1, f"--lr_decay_ratio must be above 0 and at most 1 (the whole run), got "
            f"{cfg.lr_decay_ratio}")
    require(cfg.spike_min_rise >= 0, f"--spike_min_rise must be 0 or more, got {cfg.spike_min_rise}")
    for name in ("spike_z", "spike_grad_norm_z"):
        value = getattr(cfg, name)
        require(value is None or value > 0, f"--{name} must be positive, got {value}")
    for name in ("spike_incident", "spike_incident_steps"):
        require(getattr(cfg, name) >= 1, f"--{name} must be at least 1, got {getattr(cfg, name)}")
    for name in ("spike_max_rollbacks", "spike_rewarm_steps"):
        require(getattr(cfg, name) >= 0, f"--{name} must be 0 or more, got {getattr(cfg, name)}")
    require(cfg.lr > 0, f"--lr must be positive, got {cfg.lr}")
    require(cfg.neftune_noise_alpha >= 0, f"--neftune_noise_alpha must be 0 (off) or more, got "
            f"{cfg.neftune_noise_alpha}")
    require(cfg.eps > 0, f"--eps must be positive, got {cfg.eps}")
    require(0 <= cfg.label_smoothing < 1, f"--label_smoothing must be at least 0 and below 1, got "
            f"{cfg.label_smoothing}")
    require(0 <= cfg.z_loss < math.inf, f"--z_loss must be 0 (off) or more, got {cfg.z_loss}")
    require(not cfg.stochastic_rounding or cfg.precision == "bf16-true", "--stochastic_rounding rounds bf16 weights, "
            f"which only --precision bf16-true trains (under {cfg.precision} they are fp32): drop it")
    require(cfg.early_stopping_threshold >= 0, f"--early_stopping_threshold must be 0 or more, got "
            f"{cfg.early_stopping_threshold}")
    require(cfg.weight_decay >= 0, f"--weight_decay must be 0 or more, got {cfg.weight_decay}")
    require(cfg.grad_clip >= 0, f"--grad_clip must be 0 (off) or positive, got {cfg.grad_clip}")
    for name in ("beta1", "beta2", "muon_momentum"):
        require(0 <= getattr(cfg, name) < 1, f"--{name} must be in [0, 1), got {getattr(cfg, name)}")


def option_combinations(cfg: Config, require: Callable[[bool, str], None]) -> None:
    """Options that must agree with each other."""
    require(not (cfg.eval_only and cfg.resume), "--eval_only true evaluates a model and trains no run to continue: "
            "drop --resume, and give the checkpoint to evaluate as --init_from CKPT")
    require(not (cfg.estimate_memory and cfg.print_config), "--estimate_memory true and --print_config true each "
            "print a report and exit without training (the printed config would plan, not train): give one of them")
    require(not cfg.eval_only or cfg.eval_step_interval != 0,
            "--eval_only true with --eval_step_interval 0 would evaluate nothing: drop one of them")
    require(cfg.save_step_interval > 0 or cfg.spike_guard != "rollback" and not cfg.log_model,
            "--save_step_interval 0 writes no checkpoint, which --spike_guard rollback and --log_model need")
    require(cfg.save_step_interval > 0 or cfg.keep_last_n is None,
            "--keep_last_n is only read when checkpoints are saved, which --save_step_interval 0 turns off: drop one")
    require(cfg.stall_timeout_min < cfg.process_group_timeout_min,
            f"--stall_timeout_min ({cfg.stall_timeout_min:g}) must be below --process_group_timeout_min "
            f"({cfg.process_group_timeout_min:g}): the watchdog prints every rank's stacks and exits with 4, which the "
            "Slurm scripts requeue; a collective that times out first ends the run without either")
    require(3 <= cfg.spike_warmup <= cfg.spike_window,
            f"--spike_warmup ({cfg.spike_warmup}) must be at least 3 and at most --spike_window ({cfg.spike_window}): "
            "the statistics hold the last --spike_window steps")
    require(not cfg.lr_decay or cfg.lr <= 0 or 0 <= cfg.min_lr <= cfg.lr,  # never read without the decay; --lr said
            f"--min_lr must be between 0 and --lr ({cfg.lr}), got {cfg.min_lr}"
            + (" (its default): give a lower --min_lr" if cfg.min_lr == TrainingArgs.min_lr else ""))
    require(cfg.max_step is None or cfg.max_tokens is None,
            f"--max_step {cfg.max_step} and --max_tokens {cfg.max_tokens} both set the run's length: give one "
            "(--max_step null or --max_tokens null drops a config file's)")
    require(cfg.max_step is None or cfg.max_step < 1 or cfg.warmup_steps <= cfg.max_step,  # else said above
            f"--warmup_steps ({cfg.warmup_steps}) exceeds --max_step ({cfg.max_step}): lower one of them")
    require(cfg.lr_scaling == "none" or cfg.reference_batch_size is not None,
            f"--lr_scaling {cfg.lr_scaling} needs --reference_batch_size: the global batch --lr was tuned at")
    require(cfg.train_data_dir is not None or (cfg.estimate_memory and cfg.block_size is not None),
            "--train_data_dir is required: a folder written by prepare_data.py (to plan memory without one: "
            "--estimate_memory true --block_size N)")
    require(cfg.block_size is None or cfg.estimate_memory and cfg.block_size > 0,
            f"--block_size {cfg.block_size}: only for --estimate_memory true, and positive; a run trains on the "
            "blocks prepare_data.py wrote")
    require([cfg.model_name, cfg.model_config, cfg.init_from].count(None) == 2,
            "give exactly one of --model_name (fine-tune a pretrained model), --model_config (train from scratch) and "
            "--init_from (start from a train.py checkpoint's weights)")
    require(cfg.checkpoint is None or cfg.resume,
            "--checkpoint is only read when resuming: add --resume true, or drop --checkpoint")


EVALUATION_READS = ("micro_batch_size", "seed")
"""What --eval_only reads of the training options: the micro batch (the evaluation's, unless --eval_batch_size)."""
TRAINING_CHECKPOINTS = ("keep_last_n", "async_save", "early_stopping_patience", "early_stopping_threshold")
"""Options of the checkpoint and evaluation groups that only a training run reads."""


def unread_options(cfg: Config) -> list[tuple[list[str], str, str]]:
    """The options that another one turns off, which would be ignored without a word: (their names, the option that
    turns them off, the refusal)."""
    found = []

    def unread(names: list[str], switch: str, message: str) -> None:
        if names:
            found.append((names, switch, message))

    if cfg.lr_scaling == "none" and cfg.reference_batch_size is not None:
        unread(["reference_batch_size"], "lr_scaling",
               "--reference_batch_size is only read with --lr_scaling linear or sqrt: add one, or drop it")
    if not cfg.gradient_checkpointing and cfg.gradient_checkpointing_every != FSDPArgs.gradient_checkpointing_every:
        unread(["gradient_checkpointing_every"], "gradient_checkpointing",
               "--gradient_checkpointing_every is only read with --gradient_checkpointing true: add it, or drop it")
    if cfg.optimizer != "muon" and cfg.muon_momentum != TrainingArgs.muon_momentum:
        unread(["muon_momentum"], "optimizer", "--muon_momentum is only read with --optimizer muon: add it, or drop "
                                               "--muon_momentum")
    if not cfg.estimate_memory and cfg.device_memory_gb is not None:
        unread(["device_memory_gb"], "estimate_memory",
               "--device_memory_gb is only read by --estimate_memory true: add it, or drop --device_memory_gb")
    evaluation = [f.name for f in fields(EvalArgs) if f.name != "eval_step_interval"
                  and getattr(cfg, f.name) != f.default]
    if not cfg.eval_step_interval:
        unread(evaluation, "eval_step_interval", f"{flags(evaluation)}: not read with --eval_step_interval 0, which "
                                                 "turns validation off: drop them, or give an interval")
    elif cfg.early_stopping_patience is None and cfg.early_stopping_threshold != EvalArgs.early_stopping_threshold:
        unread(["early_stopping_threshold"], "early_stopping_patience",
               "--early_stopping_threshold is only read with --early_stopping_patience N: add it, or drop it")
    elif not cfg.eval_samples and cfg.eval_max_new_tokens != EvalArgs.eval_max_new_tokens:
        unread(["eval_max_new_tokens"], "eval_samples",
               "--eval_max_new_tokens is only read with --eval_samples N: add it, or drop --eval_max_new_tokens")
    length = "max_step" if cfg.max_step is not None else "max_tokens" if cfg.max_tokens is not None else None
    if length and cfg.number_epochs != TrainingArgs.number_epochs:
        unread(["number_epochs"], length,
               f"--number_epochs {cfg.number_epochs} is not read when --{length} is given, which sets the run's "
               f"length and its schedule: drop --{length} (or give --{length} null over a config file's) to train "
               "that many epochs, the schedule then spanning them, or drop --number_epochs")
    decay_options = [name for name in ("min_lr", "lr_decay_type", "lr_decay_ratio")
                     if getattr(cfg, name) != getattr(TrainingArgs, name)]
    if not cfg.lr_decay and decay_options:
        unread(decay_options, "lr_decay", f"{flags(decay_options)}: only read by the decay, which --lr_decay false "
                                          "turns off: drop one of them")
    if cfg.eval_only:
        trained_only = [f.name for f in (*fields(TrainingArgs), *fields(SaveArgs), *fields(SpikeArgs))
                        if f.name not in EVALUATION_READS and getattr(cfg, f.name) != f.default]
        trained_only += [name for name in TRAINING_CHECKPOINTS if getattr(cfg, name) != getattr(Config, name)]
        unread(trained_only, "eval_only", f"{flags(trained_only)}: only read by training, which --eval_only true "
                                          "leaves out: drop them")
    changed = {f.name for f in fields(SpikeArgs) if f.name != "spike_guard" and getattr(cfg, f.name) != f.default}
    rollback_only = [name for name in ("spike_max_rollbacks", "spike_rewarm_steps") if name in changed]
    acting_only = [name for name in ("spike_incident", "spike_incident_steps") if name in changed]
    if cfg.spike_guard == "off":
        unread(sorted(changed), "spike_guard",
               f"{flags(changed)}: only read by the spike guard, which --spike_guard off turns off: choose detect, "
               "skip or rollback, or drop them")
    elif cfg.spike_guard != "rollback":
        unread(rollback_only, "spike_guard", f"{flags(rollback_only)}: only read by --spike_guard rollback, not "
                                             f"{cfg.spike_guard}: use rollback, or drop them")
    if cfg.spike_guard == "detect":
        unread(acting_only, "spike_guard", f"{flags(acting_only)}: not read by --spike_guard detect, which only "
                                           "reports spikes: use skip or rollback, or drop them")
    return found


def flags(names: Iterable[str]) -> str:
    order = [f.name for f in fields(Config)]
    return ", ".join(f"--{name}" for name in sorted(names, key=order.index))


def turned_off_by_a_flag(unread: list[str], switch: str, sources: dict[str, str]) -> bool:
    """Whether options set in config files are turned off by a flag (`--eval_samples 0` over a config that sets
    --eval_max_new_tokens): the command line wins, and the file's line is not one the user can drop there."""
    return sources.get(switch) == "flag" and all(sources.get(name, "").startswith("config ") for name in unread)


def strategy_rules(cfg: Config, require: Callable[[bool, str], None]) -> None:
    """What the strategy, the accelerator and the precision read, and the combinations they cannot train."""
    require(not cfg.tpu or cfg.accelerator in ("auto", "tpu"),
            f"--tpu true contradicts --accelerator {cfg.accelerator}: drop one of them")
    if cfg.tpu:  # Lightning's XLA FSDP, whatever --strategy says: what it does not read would be dropped silently
        require(cfg.strategy == "fsdp", f"--strategy {cfg.strategy}: TPUs train with Lightning's XLA FSDP only; "
                                        "drop --strategy")
        unread = [f"--{f.name}" for f in fields(FSDPArgs) if getattr(cfg, f.name) != f.default
                  and f.name not in ("auto_wrap_policy", "gradient_checkpointing")]  # XLA's checks every layer
        require(not unread, f"{', '.join(unread)}: not read by Lightning's XLA FSDP, which TPUs train with; drop them")
    require(cfg.strategy != "single_device" or cfg.devices in (1, "auto") and cfg.num_nodes == 1,
            "--strategy single_device runs one process: use --devices 1 --num_nodes 1, or --strategy fsdp/ddp")
    fsdp1_only = FSDP1_ONLY_OPTIONS if cfg.strategy == "fsdp2" else ()
    if cfg.strategy != "fsdp":
        changed = [f.name for f in fields(FSDPArgs) if getattr(cfg, f.name) != f.default
                   and f.name not in CHECKPOINTING_OPTIONS
                   and (cfg.strategy not in SHARDED_STRATEGIES or f.name in fsdp1_only)]
        fsdp1 = cfg.strategy == "fsdp2" or all(n in FSDP1_ONLY_OPTIONS for n in changed)
        allowed = "fsdp" if fsdp1 else "fsdp or fsdp2"
        require(not changed, f"{', '.join('--' + n for n in changed)} {'applies' if len(changed) == 1 else 'apply'} "
                             f"only to --strategy {allowed}, not {cfg.strategy}: drop "
                             f"{'it' if len(changed) == 1 else 'them'} or use --strategy {allowed.split()[0]}")
    require(cfg.optimizer != "muon" or cfg.strategy != "fsdp" or cfg.tpu,  # TPUs: said above
            "--optimizer muon orthogonalises each weight matrix whole, and --strategy fsdp (FSDP1) flattens the "
            "matrices into shards: use --strategy fsdp2 (or ddp)")
    require(cfg.optimizer != "muon" or not cfg.stochastic_rounding,
            "--stochastic_rounding rounds AdamW's steps of every weight, and --optimizer muon steps the weight "
            "matrices with Muon: drop one of them")
    require(cfg.strategy != "fsdp2" or cfg.precision != "16-mixed",
            "--precision 16-mixed needs FSDP1's sharded gradient scaler: use --strategy fsdp, or --precision bf16-mixed")
    require(cfg.reduce_dtype != "float16" or cfg.precision == "16-mixed",
            f"--reduce_dtype float16 only with --precision 16-mixed, whose loss scaling lifts small gradients into "
            f"float16's range; under {cfg.precision} gradients below 6e-8 would be summed as 0: use float32 or bfloat16")


if __name__ == "__main__":
    changed = write_options_doc()
    print(f"{OPTIONS_DOC.relative_to(OPTIONS_DOC.parents[1])}: {'updated' if changed else 'already up to date'}")
