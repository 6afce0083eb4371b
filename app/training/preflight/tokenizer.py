"""The run's tokenizer: the one given, the data folder's or the model's; that it loads, fits the model, matches the
data and the copy the run keeps; what generation samples need of it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

from transformers import AutoTokenizer, PretrainedConfig

from app.checkpoint import CheckpointError, read_metadata, run_folder_of, run_tokenizer_dir
from app.cli import counted, first_line
from app.data.mixture import first_folder
from app.folders import prepared_tokenizer
from app.hub import (TOKENIZER_ADVICE, has_tokenizer_files, missing_model_problem, quiet_hub, tokenizer_difference,
                     unloadable_tokenizer)
from app.huggingface.convert import converted_tokenizer_problem, from_where_trained
from app.training.preflight.data import DataFacts
from app.training.preflight.notes import note

if TYPE_CHECKING:
    from arguments import Config


TOKEN_ID_PAST_VOCAB = "--train_data_dir holds token id"
"""How check_model's refusal of data whose ids the model's vocabulary does not hold begins: a tokenizer too large
for it is that refusal again, with the same advice (two lines said one thing)."""


def room_for_tokens(cfg: Config, tokens: int) -> str:
    """What to do about tokens beyond a model's vocabulary: a config file says its vocab_size; pretrained embeddings
    are not resized by train.py."""
    if cfg.model_config:
        return (f"raise vocab_size in --model_config to at least {tokens}, or prepare the data with a tokenizer "
                "that fits")
    return ("train.py does not resize the model's embeddings: save the model with room for them first "
            "(resize_token_embeddings, then save_pretrained), or prepare the data with a tokenizer that fits")


def resolve_tokenizer(cfg: Config, model_config: Optional[PretrainedConfig], problems: list[str]) -> Optional[str]:
    """--tokenizer, else the data folder's tokenizer/, else the pretrained model's; checked to load and to fit.

    Training reads token ids and needs no tokenizer: one that is only a default and does not load is left out
    (the converter then asks for --tokenizer); one given with --tokenizer must load.
    """
    bundled = prepared_tokenizer(first_folder(cfg.train_data_dir) if cfg.train_data_dir else "")
    own, model = models_tokenizer(cfg)
    name = cfg.tokenizer or (str(bundled) if bundled.is_dir() else own)
    if name is None:
        if cfg.train_data_dir and bundled.parent.is_dir() and not cfg.estimate_memory:  # (a missing folder: its line)
            note(f"no tokenizer recorded with this run: --train_data_dir {first_folder(cfg.train_data_dir)} holds no "
                 "tokenizer/ and no --tokenizer or --model_name names one; give --tokenizer for the run to keep it "
                 "(convert_to_hf.py will ask for it otherwise)")
        return None
    missing = missing_model_problem("--tokenizer" if cfg.tokenizer else "--model_name", name)
    if missing:
        if name != own:  # the model's own is check_model's line already
            problems.append(missing)
        return None
    try:
        with quiet_hub():
            tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as error:
        if cfg.tokenizer is None:
            note(f"no tokenizer recorded with this run: {unloadable_tokenizer(name, error)}")
            return None
        problems.append(f"--tokenizer {unloadable_tokenizer(name, error)}; {TOKENIZER_ADVICE}")
        return None
    if model_config is not None and len(tokenizer) > model_config.vocab_size and not any(
            problem.startswith(TOKEN_ID_PAST_VOCAB) for problem in problems):  # the same advice, said once
        problems.append(f"{'--tokenizer' if cfg.tokenizer else 'the tokenizer'} {name} has {len(tokenizer)} tokens, "
                        f"more than the model's vocab_size {model_config.vocab_size}; "
                        + ("use the tokenizer the data was prepared with" if cfg.tokenizer
                           else room_for_tokens(cfg, len(tokenizer))))
    converted = model_config is not None and converted_tokenizer_problem(tokenizer, model_config,
                                                                         cfg.trust_remote_code)
    if converted:
        note(f"convert_to_hf.py will refuse this run's checkpoints: the tokenizer of a converted folder, {converted}; "
             f"a {model_config.model_type} model converts with a tokenizer of the class that model type loads")
    difference = None
    if cfg.tokenizer and bundled.is_dir():
        difference = tokenizer_difference(tokenizer, AutoTokenizer.from_pretrained(
            bundled, trust_remote_code=cfg.trust_remote_code))
        if difference:
            problems.append(f"--tokenizer {name} is not the tokenizer --train_data_dir was prepared with ({bundled}): "
                            f"{difference}; drop --tokenizer (the run records the data's), or prepare the data with it")
    if not difference and bundled.is_dir() and own and has_tokenizer_files(own):
        # also when --tokenizer names the data's: given, it once skipped this, and another tokenizer's ids trained
        fits = model_config is None or len(tokenizer) <= model_config.vocab_size
        check_data_tokenized_for_the_model(cfg, tokenizer, name, problems, own, model, note_added=fits)
    return name


def models_tokenizer(cfg: Config) -> tuple[Optional[str], str]:
    """The tokenizer the model was trained with, and the model as the command line names it: --model_name's own;
    for --init_from, the copy its run keeps (`<run>/tokenizer`), which the data must also be tokenized with; none
    for --model_config."""
    if cfg.init_from and not Path(cfg.init_from).exists():  # a resumed run's start, gone: its own copy is checked
        return None, f"--init_from {cfg.init_from}"
    if cfg.init_from:
        run = run_folder_of(Path(cfg.init_from))
        kept = run_tokenizer_dir(run) if run else None
        if not (kept and kept.is_dir()):  # a checkpoint copied out of its run: the tokenizer it recorded
            try:
                metadata = read_metadata(Path(cfg.init_from))
            except CheckpointError:  # no checkpoint: refused by resolve_init_from already
                return None, f"--init_from {cfg.init_from}"
            kept = from_where_trained(metadata, metadata.get("tokenizer"))
            kept = Path(kept) if kept and Path(kept).is_dir() else None
        if kept is None:
            note(f"--init_from {cfg.init_from}: neither its run's copy of the tokenizer nor the one it recorded is "
                 "here, so --train_data_dir's tokenizer is not checked against it")
        return (str(kept) if kept else None), f"--init_from {cfg.init_from}"
    return cfg.model_name, f"--model_name {cfg.model_name}"


def check_data_tokenized_for_the_model(cfg: Config, tokenizer, name: str, problems: list[str], own: str, model: str,
                                       note_added: bool = True) -> None:
    """The data folder's tokenizer must give the pretrained model's own tokens their ids: data tokenized for another
    model (Llama-2's ids trained into Mistral, or a tokenizer trained by prepare_data.py --vocab_size) has ids within
    the vocabulary, trained without an error, and converted with the data's tokenizer beside the model's weights.
    Tokens added to the model's (chat tokens in its padded vocabulary) are a note: their embeddings start untrained
    (unless `note_added` is False: tokens beyond its vocabulary have no embedding, which is refused elsewhere).
    A model without tokenizer files has nothing to compare (transformers makes a default one up for some, T5's)."""
    try:
        with quiet_hub():
            trained = AutoTokenizer.from_pretrained(own, trust_remote_code=cfg.trust_remote_code)
    except Exception:  # noqa: BLE001 (no tokenizer with the weights, or none that loads here: nothing to compare)
        return
    data_ids, model_ids = tokenizer.get_vocab(), trained.get_vocab()
    if model_ids.items() <= data_ids.items():
        added = sorted(set(data_ids) - set(model_ids), key=data_ids.get)
        if added and note_added:
            note(f"--train_data_dir's tokenizer ({name}) adds {counted(len(added), 'token')} to {model}'s "
                 f"({listed(added)}): their embeddings start as the model has them, untrained")
        return
    if data_ids.items() <= model_ids.items():  # the model's own added tokens (chat markers) unused by the data
        lacking = sorted(set(model_ids) - set(data_ids), key=model_ids.get)
        note(f"--train_data_dir's tokenizer ({name}) lacks {counted(len(lacking), 'token')} of {model}'s "
             f"({listed(lacking)}): the run keeps the data's tokenizer, so the converted model will not have them")
        return
    moved = min((token for token, i in model_ids.items() if data_ids.get(token) != i), key=model_ids.get)
    problems.append(f"--train_data_dir was tokenized with {name}, not with {model}'s tokenizer: {moved!r} is id "
                    f"{model_ids[moved]} for the model and {data_ids.get(moved, 'missing')} in the data; prepare the "
                    f"data with --tokenizer {own}")


def listed(tokens: list[str]) -> str:
    return ", ".join(tokens[:3]) + (", ..." if len(tokens) > 3 else "")


def check_run_tokenizer(cfg: Config, tokenizer: Optional[str], problems: list[str]) -> None:
    """The run keeps a copy of its tokenizer in out_dir/tokenizer/ (run.py keep_tokenizer_with_run); one already
    there (a resumed run's, or an earlier attempt's) must be the same tokenizer: it is never replaced."""
    kept = run_tokenizer_dir(cfg.out_dir)
    if tokenizer is None or not kept.exists():
        return
    try:
        difference = tokenizer_difference(AutoTokenizer.from_pretrained(str(kept),
                                                                        trust_remote_code=cfg.trust_remote_code),
                                          AutoTokenizer.from_pretrained(tokenizer,
                                                                        trust_remote_code=cfg.trust_remote_code))
    except Exception as error:  # noqa: BLE001 (a tokenizer.json of `{}` raised KeyError: whatever fails, it is broken)
        difference = f"it does not load ({type(error).__name__}: {first_line(error)})"
    if difference:
        problems.append(f"--out_dir {cfg.out_dir}: {kept} is not the run's tokenizer {tokenizer} ({difference}); "
                        "move it away (it is never replaced), or choose another --out_dir")


def check_samples(cfg: Config, data: DataFacts, tokenizer: Optional[str], problems: list[str],
                  model_config: Optional[PretrainedConfig] = None) -> None:
    if cfg.eval_samples and not data.format.supervised:  # the cause: what else it would say of samples follows from it
        problems.append(f"--eval_samples {cfg.eval_samples} needs prompts and references (supervised or seq2seq data), "
                        f"but --train_data_dir {cfg.train_data_dir} holds raw text; drop it or prepare pairs")
        return
    positions = getattr(model_config, "max_position_embeddings", None) if model_config is not None else None
    if cfg.eval_samples and positions and cfg.eval_max_new_tokens >= positions:
        room = ("passes the decoder's" if model_config.is_encoder_decoder  # its source has the encoder's own
                else "leaves no room for a prompt in the model's")
        problems.append(f"--eval_max_new_tokens {cfg.eval_max_new_tokens} {room} {positions} positions "
                        "(max_position_embeddings); lower it")
    if cfg.eval_only and not data.validation_rows and not cfg.eval_data_dir:
        problems.append(f"--eval_only true evaluates on the validation split, and --train_data_dir "
                        f"{cfg.train_data_dir} has none; prepare it with --val_fraction > 0, or give --eval_data_dir")
    if cfg.eval_samples and not data.validation_rows:
        problems.append(f"--eval_samples {cfg.eval_samples} takes its prompts from the validation split, but "
                        f"--train_data_dir {cfg.train_data_dir} has none; drop it or prepare with --val_fraction > 0")
    if cfg.eval_samples and tokenizer is None:
        problems.append(f"--eval_samples {cfg.eval_samples} decodes the samples with the run's tokenizer: give "
                        "--tokenizer")
