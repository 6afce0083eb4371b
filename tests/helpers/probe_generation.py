"""Generate the first validation samples as an evaluation does, with the model set up by train.py's code.

    python tests/helpers/probe_generation.py REPORT.json STOP_ID COUNT MAX_NEW_TOKENS TOKEN_BUDGET <train.py options>

Each rank generates its prompts together within TOKEN_BUDGET tokens where the preflight found that padding leaves
the model's logits as they are (else one at a time, as a run would). Rank 0 writes the generated tokens of every
sample to REPORT.json, and the budget used.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.data import load_data  # noqa: E402
from app.distributed.strategy import build_fabric  # noqa: E402
from app.evaluation.samples import decoding_for, generate_samples  # noqa: E402
from app.exit_codes import EXIT_FINISHED  # noqa: E402
from app.model.build import deferred_init, setup_model  # noqa: E402
from app.reliability.signals import run_and_exit  # noqa: E402
from app.training.preflight import preflight  # noqa: E402
from arguments import parse_config  # noqa: E402


def probe(fabric, cfg, inputs, deferred, report: str, stop_id: int, count: int, max_new_tokens: int,
          token_budget: int) -> int:
    model, _, _ = setup_model(fabric, cfg, inputs.model_config, deferred)
    data = load_data(cfg.train_data_dir)
    samples = data.format.samples(data.validation, count)
    decoding = decoding_for(inputs.model_config, cfg.trust_remote_code)
    budget = token_budget if inputs.samples_pad_apart else 0
    generated = generate_samples(fabric, model, samples, decoding=decoding, max_new_tokens=max_new_tokens,
                                 stop_ids={stop_id}, token_budget=budget)
    if fabric.is_global_zero:
        Path(report).write_text(json.dumps({"generated": generated, "token_budget": budget}))
    return EXIT_FINISHED


def main() -> None:
    report, stop_id, count, max_new_tokens, token_budget = sys.argv[1], *map(int, sys.argv[2:6])
    cfg = parse_config(sys.argv[6:])
    inputs = preflight(cfg)
    deferred = deferred_init(cfg, inputs.model_config)
    fabric = build_fabric(cfg, inputs.plan.world_size, inputs.wrap_classes, [],
                          deferred.param_init_fn if deferred else None)
    fabric.launch(run_and_exit, probe, cfg, inputs, deferred, report, stop_id, count, max_new_tokens, token_budget)


if __name__ == "__main__":
    main()
