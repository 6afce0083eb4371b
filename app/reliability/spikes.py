"""Loss spikes: every step's loss and gradient norm judged against their recent values, and what to do about one.

A corrupt document, a run of repeated tokens or a stretch of data the learning rate is too high for makes a finite
spike that today's checks (non-finite values only) apply to the weights. Written here because no library does it:
torchtitan, TRL and LitGPT do nothing, llm-foundry's KillLossSpike and axolotl's watchdog stop the run, Megatron's
re-run machinery attributes the fault; none skips the batch, sets its rows aside, rolls back and goes on.

Detection. A step is a spike when its loss lies more than `z` standard deviations of its noise above the median of the
last few accepted steps; the noise is estimated robustly from the step-to-step changes over the last `window`
accepted steps (`upper_limit`), and is at least `floor` times the median (a plateau's tiny noise would make any
wobble a spike); the loss must also rise at least `min_rise` nats (a model memorising a small set sits near a loss
of 0, where a relative floor is no floor: a wobble from 0.008 to 0.16 set aside 9 of its 16 clean rows and stopped
the run). Under `detect`, a spike joins the statistics too (it is applied): the level a loss moves to for good
becomes its new normal, where every later step had been reported. The gradient norm is judged too when asked
(`grad_norm_z`), by its logarithm: it varies by factors.
It is not by default: on the test model's clean data (16 x 32 tokens a step) the norm jumps 3 to 5 times its median
from one ordinary step to the next, and a limit at 6 deviations set aside 18 of 60 clean steps. One-sided: a loss that falls fast is learning. Nothing
is judged until `warmup` steps were accepted, as the loss falls steeply at first. Both numbers come from the one
all_reduce every step makes anyway (signals.step_verdict), so every rank judges the same numbers the same way: the
decision needs no message and the guard no synchronisation of its own.

Response (--spike_guard): `detect` reports and applies the step; `skip` leaves the step's update out on every rank
and sets aside the rows whose losses explain the spike (`culprits`): from then on they train no token, on any device
count, after any resume (the quarantine is part of the checkpoint); `rollback` does the same and, when
`incident_spikes` spikes fall within `incident_steps` steps (a stretch of bad data, or a loss that stays above its
range), reloads the last good checkpoint in the running process, skips the stretch of data that led there and goes
on, at most `max_rollbacks` times; the rows of the incident's spikes, which no row of theirs explained, are set
aside then (a stretch of bad data is bad as a whole: in the next epoch they trained again, unnoticed). Spikes that
repeat without rows to blame (the model, not the data) stop a run
under `skip`, and one past its rollbacks, with their own exit code.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Literal, Optional

from app.folders import replace_file, written_or_warned

SpikeMode = Literal["off", "detect", "skip", "rollback"]
Action = Literal["apply", "skip", "rollback", "stop"]

QUARANTINE_FILE = "quarantine.jsonl"
RECENT = 10
"""The values whose median is the centre a new value is judged against: recent enough to follow a falling loss."""
TINY = 1e-12
"""Gradient norms are judged by their logarithm (they vary by factors, not by amounts); a zero norm counts as this."""
ROW_Z = 3.5
"""A row whose loss lies this many robust standard deviations above the step's other rows stands out (Iglewicz and
Hoaglin's cut for the modified z-score). Lower than the steps' z: rows of a step differ far more than steps do."""
MAD_TO_SIGMA = 1.4826
"""The median absolute deviation of normal values, times this, is their standard deviation."""
CHANGE_TO_SIGMA = 1 / (0.6745 * 2**0.5)
"""The median absolute change between consecutive independent normal values, times this, is their standard
deviation (the change's standard deviation is sqrt(2) sigma, its median absolute value 0.6745 times that)."""


@dataclass(frozen=True)
class SpikeRules:
    """The guard's options (arguments.py SpikeArgs)."""

    mode: SpikeMode = "skip"
    z: float = 6.0
    grad_norm_z: Optional[float] = None
    """None: the gradient norm is not judged."""
    window: int = 100
    warmup: int = 50
    floor: float = 0.01
    min_rise: float = 0.1
    incident_spikes: int = 3
    incident_steps: int = 50
    max_rollbacks: int = 3
    rewarm_steps: int = 0


def upper_limit(values: Sequence[float], z: float, floor: float, min_rise: float = 0.0) -> float:
    """The value above which the next one is a spike: the median of the last `RECENT` values plus z times the
    noise, at least `floor` times that median, and plus at least `min_rise`.

    The noise is estimated from the changes between consecutive values (the median absolute change, scaled to a
    standard deviation), not from their spread around the median: early in training the loss falls steadily, and
    its spread over the window measures that fall, not the noise, making real spikes look ordinary."""
    centre = statistics.median(values[-RECENT:])
    changes = [abs(after - before) for before, after in zip(values, values[1:])]
    noise = statistics.median(changes) * CHANGE_TO_SIGMA if changes else 0.0
    return centre + max(z * max(noise, floor * abs(centre)), min_rise)


def outlier_limit(values: Sequence[float], z: float, floor: float) -> float:
    """Above this a value stands out among `values` (in no particular order): their median plus z times their
    robust standard deviation (1.4826 times the median absolute deviation), at least `floor` times the median."""
    centre = statistics.median(values)
    spread = statistics.median(abs(value - centre) for value in values) * MAD_TO_SIGMA
    return centre + z * max(spread, floor * abs(centre))


@dataclass(frozen=True)
class Spike:
    step: int
    loss: float
    grad_norm: float
    loss_limit: float
    grad_norm_limit: float

    @property
    def by_loss(self) -> bool:
        return self.loss > self.loss_limit

    def describe(self) -> str:
        found = []
        if self.by_loss:
            found.append(f"loss {self.loss:.4f} above {self.loss_limit:.4f}")
        if self.grad_norm > self.grad_norm_limit:
            found.append(f"gradient norm {self.grad_norm:.4g} above {self.grad_norm_limit:.4g}")
        return " and ".join(found)


@dataclass
class SpikeHistory:
    """What the guard knows, as plain data in every checkpoint (state["spike_guard"]): a resume on any device count
    judges as the run would have, and skips the same rows."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    """The last `window` accepted steps' values."""
    recent_spikes: list[int] = field(default_factory=list)
    """Steps of the spikes within the last `incident_steps` steps."""
    spikes: int = 0
    skipped_steps: int = 0
    rollbacks: int = 0
    rewarm_from: Optional[int] = None
    """The step a rollback returned to, when the learning rate warms up again from there."""
    quarantine: list[dict] = field(default_factory=list)
    """{"row", "loss" (its mean token loss), "tokens", "step"} of every train row set aside."""
    incident_rows: list[dict] = field(default_factory=list)
    """The same of every row of the spikes in `recent_spikes` (under rollback): set aside if they make a rollback."""
    data: Optional[list] = None
    """The mixture the statistics were gathered on ([name, weight] per folder; [] for one folder): a resume that
    changes it starts them again (`judged_on`)."""

    @classmethod
    def from_dict(cls, saved: Optional[dict]) -> "SpikeHistory":
        return cls(**saved) if saved else cls()

    def to_dict(self) -> dict:
        return asdict(self)

    def quarantined_rows(self) -> set[int]:
        return {entry["row"] for entry in self.quarantine}


@dataclass
class SpikeGuard:
    rules: SpikeRules
    history: SpikeHistory = field(default_factory=SpikeHistory)

    @property
    def active(self) -> bool:
        return self.rules.mode != "off"

    @property
    def sets_aside(self) -> bool:
        """Whether rows in quarantine train nothing (detect only reports them)."""
        return self.rules.mode in ("skip", "rollback")

    def judged_on(self, data: list) -> bool:
        """Take `data` as the mixture the statistics describe; True when they were of another one and start again:
        a folder added at a resume (or another weight) moves the loss by its own rows, and judged against the old
        mixture's statistics the new folder's clean rows were set aside as spikes."""
        history, changed = self.history, self.history.data is not None and self.history.data != data
        if changed and history.losses:
            history.losses, history.grad_norms, history.recent_spikes, history.incident_rows = [], [], [], []
        history.data = data
        return changed

    def judge(self, step: int, loss: float, grad_norm: float) -> Optional[Spike]:
        """The spike this step is, or None (always None while warming up or switched off)."""
        history = self.history
        if not self.active or len(history.losses) < self.rules.warmup:
            return None
        if not math.isfinite(grad_norm):  # overflowed under a gradient scaler, which skips the step itself
            grad_norm = 0.0
        grad_norm_z = self.rules.grad_norm_z
        spike = Spike(step, loss, grad_norm, upper_limit(history.losses, self.rules.z, self.rules.floor,
                                                         self.rules.min_rise),
                      math.inf if grad_norm_z is None else
                      math.exp(upper_limit([math.log(max(norm, TINY)) for norm in history.grad_norms], grad_norm_z,
                                           floor=0.0)))
        return spike if spike.by_loss or grad_norm > spike.grad_norm_limit else None

    def accept(self, loss: float, grad_norm: float) -> None:
        """A step that was no spike joins the statistics."""
        if not self.active or not math.isfinite(grad_norm):
            return
        window = self.rules.window
        self.history.losses = (self.history.losses + [loss])[-window:]
        self.history.grad_norms = (self.history.grad_norms + [grad_norm])[-window:]

    def respond(self, spike: Spike, explained: bool, rows: Sequence[tuple[int, float, int]] = ()) -> Action:
        """What to do with this spike; counts it. A spike that rows explain (`culprits`) is bad data: skipped, the
        rows set aside. Unexplained spikes, in the loss or the gradient norm (the whole batch high: the model, not the
        data), escalate when they repeat: rollback under `rollback` while rollbacks are left, else stop. (Spikes in
        the gradient norm alone were skipped however many: a norm that moved up for good, which the statistics of
        accepted steps never learn, left every later step unapplied and the run "finished" without training.)
        `rows` ((row, summed loss, tokens) of the step's rows) are kept for a rollback to set aside."""
        rules, history = self.rules, self.history
        history.spikes += 1
        if rules.mode == "detect":
            self.accept(spike.loss, spike.grad_norm)
            return "apply"
        history.skipped_steps += 1
        if explained:
            return "skip"
        history.recent_spikes = [s for s in history.recent_spikes if s > spike.step - rules.incident_steps]
        history.recent_spikes.append(spike.step)
        if rules.mode == "rollback":
            history.incident_rows = [entry for entry in history.incident_rows
                                     if entry["step"] in history.recent_spikes] + [
                {"row": row, "loss": total / tokens, "tokens": tokens, "step": spike.step}
                for row, total, tokens in rows if tokens > 0]
        if len(history.recent_spikes) < rules.incident_spikes:
            return "skip"
        if rules.mode == "rollback" and history.rollbacks < rules.max_rollbacks:
            return "rollback"
        return "stop"

    def incident_began(self) -> int:
        """The step of the first spike of the current incident."""
        return min(self.history.recent_spikes)

    def open_incident(self, step: int) -> Optional[int]:
        """Under rollback, the step of the first spike within --spike_incident_steps of `step`, whose rollback
        would need a checkpoint from before it (which --keep_last_n must not delete); None when there is none."""
        recent = [s for s in self.history.recent_spikes if s > step - self.rules.incident_steps]
        return min(recent) if self.rules.mode == "rollback" and recent else None

    def rolled_back(self, to_step: int, saved: Optional[dict]) -> list[dict]:
        """After reloading the checkpoint of `to_step`: its statistics (from before the incident), this run's
        quarantine and counts, and the incident's rows set aside (returned)."""
        kept = self.history
        self.history = SpikeHistory.from_dict(saved)
        if self.history.data is not None and self.history.data != kept.data:  # of another mixture (judged_on)
            self.history.losses, self.history.grad_norms = [], []
        self.history.recent_spikes, self.history.incident_rows, self.history.data = [], [], kept.data
        known = kept.quarantined_rows()
        incident = list({entry["row"]: entry for entry in kept.incident_rows if entry["row"] not in known}.values())
        self.history.quarantine = kept.quarantine + incident
        self.history.spikes, self.history.skipped_steps = kept.spikes, kept.skipped_steps
        self.history.rollbacks = kept.rollbacks + 1
        self.history.rewarm_from = to_step if self.rules.rewarm_steps else None
        return incident

    def lr_factor(self, step: int) -> float:
        """The learning rate's share while it warms up again after a rollback (1 otherwise)."""
        start, steps = self.history.rewarm_from, self.rules.rewarm_steps
        if start is None or not steps or step >= start + steps:
            return 1.0
        return (step - start) / steps

    def set_aside(self, step: int, rows: list[tuple[int, float, int]]) -> list[dict]:
        """Quarantine `rows` ((row, mean loss, trained tokens)); returns their new entries."""
        entries = [{"row": row, "loss": loss, "tokens": tokens, "step": step} for row, loss, tokens in rows]
        self.history.quarantine += entries
        return entries

    def metrics(self) -> dict[str, float]:
        history = self.history
        return {"spikes": history.spikes, "skipped_steps": history.skipped_steps, "rollbacks": history.rollbacks,
                "quarantined_rows": len(history.quarantine)} if self.active else {}


def culprits(rows: Sequence[tuple[int, float, int]], spike: Spike, floor: float) -> list[tuple[int, float, int]]:
    """The rows that explain a spike: (row, summed loss, trained tokens) of each row of the step in, (row, mean
    loss, trained tokens) of the culprits out, highest loss first; none when the rows do not explain it.

    The culprits are the rows whose loss stands out among the step's rows (a modified z-score above `ROW_Z`, and
    above the step's loss limit themselves); for a spike in the loss, only if the step's loss without them is no
    spike. When the whole batch is high (the model, not the data), no row stands out."""
    scored = [(row, total / tokens, tokens, total) for row, total, tokens in rows if tokens > 0]
    if len(scored) < 3:
        return []
    row_limit = max(spike.loss_limit, outlier_limit([mean for _, mean, _, _ in scored], ROW_Z, floor))
    standing_out = [(row, mean, tokens) for row, mean, tokens, _ in sorted(scored, key=lambda r: -r[1])
                    if mean > row_limit]
    rest = [(total, tokens) for row, mean, tokens, total in scored if mean <= row_limit]
    if spike.by_loss and sum(total for total, _ in rest) / sum(tokens for _, tokens in rest) > spike.loss_limit:
        return []
    return standing_out


def write_quarantine(out_dir: Path, entries: list[dict], locate: Callable[[int], tuple[str, int]]) -> None:
    """`out_dir/quarantine.jsonl`: one line per row set aside, with the data folder, split and row to find it in
    (`locate`: the folder of a mixture holding the run's row), rewritten whole (atomically) from the run's state, so
    that it always says what the run skips; none: no file (a resume from before the rows were set aside, or under
    --spike_guard off, left the file of rows the run trained on again)."""
    path = out_dir / QUARANTINE_FILE
    if not entries:
        path.unlink(missing_ok=True)
        return
    lines = []
    for entry in entries:
        data_dir, row = locate(entry["row"])
        lines.append(json.dumps({"data_dir": data_dir, "split": "train"} | entry | {"row": row}) + "\n")
    written_or_warned(path, partial(replace_file, path, "".join(lines)))
