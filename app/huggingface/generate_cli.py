"""The `generate.py` command line: its options, and `main`, which parses them before it imports the generation
(app/huggingface/generate.py: torch and transformers, 5 s), so that a mistyped flag is refused at once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from app import cli, stopping
from app.choices import MAX_SEED
from app.folders import unusable_folder

PROG = "generate.py"
MIN_TEMPERATURE = 1e-4
"""Below it the likeliest token's probability rounds to 1 (greedy decoding), and at 1e-39 the logits divided by it
overflow to inf: torch.multinomial raised on NaN probabilities."""
DESCRIPTION = ("Print what a Hugging Face model folder writes: the last step of the demos, and a quick check of a "
               "conversion.")


@dataclass
class GenerateArgs:
    """Generation"""

    model: str
    """Folder written by convert_to_hf.py (or any Hugging Face causal LM or encoder-decoder)."""
    prompt: Optional[str] = None
    """Text to continue (default: "def "); with --chat, the user's message; for an encoder-decoder, the source."""
    prompts: Optional[str] = None
    """A JSON lines file of prompts to answer instead of --prompt, one object a line (a held-out test set): the
    answers are generated in batches, printed or written to --output, and scored with --reference_field."""
    prompt_field: str = "prompt"
    """With --prompts: the field of each line holding the prompt (with --chat, the user's message; for an
    encoder-decoder, the source)."""
    input_field: Optional[str] = None
    """With --prompts --chat: the field holding an input (Alpaca's) that follows each prompt after a blank line in
    the user's message, as prepare_data.py --input_field puts it; a missing or null one is left out."""
    system_field: Optional[str] = None
    """With --prompts --chat: the field holding a system message before each prompt, as prepare_data.py
    --system_field puts it; a missing, null or empty one is left out."""
    reference_field: Optional[str] = None
    """With --prompts: the field holding each expected answer; the answers are then scored as train.py scores its
    samples (exact match, ROUGE-1/2/L/Lsum, mean length)."""
    messages_field: Optional[str] = None
    """With --prompts, instead of --prompt_field: the field holding a chat ({role, content} messages, as
    prepare_data.py --messages_field reads them); the model answers its last message, an assistant's, from the
    messages before it through the chat template (with the chat's `tools`), and is scored against it (a tool call
    as the template writes it)."""
    tools_field: Optional[str] = None
    """With --messages_field: the field of each line holding the tools its chat offers (as prepare_data.py
    --tools_field); default: `tools`."""
    output: Optional[str] = None
    """With --prompts: a new JSON lines file for the answers, one line per prompt in the file's order (prompt,
    reference, generated, new_tokens, stopped); an existing file is refused, not overwritten."""
    batch_size: int = 8
    """With --prompts: prompts generated at once (left-padded for a decoder-only model)."""
    chat: bool = False
    """Wrap the prompt in the tokenizer's chat template, as a user message followed by the assistant's turn."""
    tools: Optional[str] = None
    """With --chat: a JSON file of the tools offered with each prompt (a list of OpenAI tool schemas, as a chat's
    `tools` that prepare_data.py trains), which the chat template writes; a chat of --messages_field offers its
    own."""
    max_new_tokens: int = 80
    """Tokens to generate."""
    max_source_length: Optional[int] = None
    """For an encoder-decoder: sources longer than this many tokens are cut before their end, keeping their EOS, as
    prepare_data.py --max_source_length cut the training sources (and train.py's samples read them); default: the
    length convert_to_hf.py recorded in the folder's trained_lengths.json, else whole sources."""
    temperature: Optional[float] = None
    """Sampling temperature; 0 for greedy decoding; default: the sampling of the model's generation_config.json,
    or 0.8 with top-k 50 when it does not sample. A temperature given replaces only the temperature of a model that
    samples (its top-p and top-k stay); the rest of its generation config (repetition penalty, beams) is left out."""
    seed: int = 0
    """Sampling seed."""
    device: str = "auto"
    """Where the model generates: auto (the first GPU when there is one, else the CPU), cpu, cuda, cuda:1, ..."""
    trust_remote_code: bool = False
    """Run the Python code MODEL's folder or Hub repository ships (its tokenizer or model classes); off by default:
    that code runs on this machine."""


def parse_args(argv: Optional[list[str]] = None) -> GenerateArgs:
    parser = cli.command_parser(PROG, DESCRIPTION, [GenerateArgs], config=False, skip={"model"})
    parser.add_argument("model", metavar="MODEL", help="Folder written by convert_to_hf.py (or any Hugging Face "
                                                       "causal LM or encoder-decoder).")
    args = GenerateArgs(**cli.parse(parser, argv).as_dict())
    check_prompt_options(args)
    for name in ("max_new_tokens", "max_source_length"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise cli.UsageError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.temperature is not None and not (args.temperature == 0 or args.temperature >= MIN_TEMPERATURE):
        raise cli.UsageError(f"--temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {args.temperature}"
                             + (" (below it sampling is greedy decoding, and rounds to inf at 1e-39)"
                                if args.temperature > 0 else ""))
    if not 0 <= args.seed <= MAX_SEED:
        raise cli.UsageError(f"--seed {args.seed} must be between 0 and {MAX_SEED}")
    try:
        (args.prompt or "").encode("utf-8")
    except UnicodeEncodeError as error:  # bytes the shell passed that are not UTF-8 (surrogate-escaped by Python)
        raise cli.UsageError(f"--prompt is not UTF-8 text (byte {error.object[error.start:error.end]!r} at character "
                             f"{error.start}); give it in UTF-8") from None
    return args


def check_prompt_options(args: GenerateArgs) -> None:
    """One prompt or a file of them, never both (one would be ignored); the file's options only with the file; an
    --output that exists is refused before the model loads (a finished test set's answers are never overwritten)."""
    if args.tools_field is not None and args.messages_field is None:
        raise cli.UsageError("--tools_field names the tools of each chat of --messages_field: give --prompts FILE "
                             "--messages_field FIELD")
    if args.tools is not None and args.messages_field is not None:
        raise cli.UsageError("--tools: a chat of --messages_field offers its own (its 'tools' field); drop --tools")
    offered_tools(args)
    if args.prompts is None:
        given = [name for name in ("reference_field", "messages_field", "input_field", "system_field", "output")
                 if getattr(args, name) is not None]
        given += ["prompt_field"] * (args.prompt_field != "prompt") + ["batch_size"] * (args.batch_size != 8)
        if given:
            raise cli.UsageError(f"--{given[0]} applies to a file of prompts: give --prompts FILE")
        return
    if args.prompt is not None:
        raise cli.UsageError("--prompt and --prompts: give one prompt or a file of them, not both")
    if not Path(args.prompts).is_file():
        raise cli.UsageError(f"--prompts {args.prompts}: no such file; give a JSON lines file, one object a line")
    if args.batch_size < 1:
        raise cli.UsageError(f"--batch_size must be at least 1, got {args.batch_size}")
    pair_fields = [f"--{name}" for name in ("input_field", "system_field") if getattr(args, name) is not None]
    if pair_fields and not args.chat and args.messages_field is None:
        raise cli.UsageError(f"{pair_fields[0]} builds the chat prepare_data.py made of each prompt/response row: "
                             "add --chat true")
    if args.messages_field is not None:
        given = [f"--{name}" for name, default in (("prompt_field", "prompt"), ("reference_field", None),
                                                   ("input_field", None), ("system_field", None))
                 if getattr(args, name) != default] + ["--chat"] * args.chat
        if given:
            raise cli.UsageError(f"--messages_field: a chat is its own prompt (through the chat template) and its "
                                 f"last message the reference; drop {', '.join(given)}")
    if args.output is not None and Path(args.output).exists():
        raise cli.UsageError(f"--output {args.output} exists; give a new file name (answers are never overwritten)")
    if args.output is not None and not Path(args.output).parent.is_dir():
        raise cli.UsageError(f"--output {args.output}: its folder does not exist; create it first")
    unusable = unusable_folder(Path(args.output).absolute().parent) if args.output is not None else None
    if unusable:  # found after every prompt was answered (hours of a test set), the answers were lost
        raise cli.UsageError(f"--output {args.output}: {unusable}; give a file in a folder you can write to")


def offered_tools(args: GenerateArgs) -> Optional[list]:
    """The tools of --tools FILE, read as prepare_data.py reads a chat's; None without it. Refused in one line: a file
    that is not a list of tool schemas, or --tools without --chat (a plain prompt has no template to write them)."""
    from app.prepare.chat import read_tools, tools_problem  # (datasets: only when tools are given)

    if args.tools is None:
        return None
    if not args.chat:
        raise cli.UsageError("--tools offers tools to the chat of each prompt: add --chat true")
    try:
        text = Path(args.tools).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as error:
        raise cli.UsageError(f"--tools {args.tools}: not readable as UTF-8 text ({error})") from None
    if tools_problem(text):
        raise cli.UsageError(f"--tools {args.tools}: not a JSON list of tool schemas (objects, as OpenAI's tools)")
    if read_tools(text) is None:
        raise cli.UsageError(f"--tools {args.tools} offers no tools; drop --tools")
    return read_tools(text)


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: one line on stderr and exit 2 for bad input; else what the model writes."""
    cli.any_text_printable()
    args = cli.run_command(PROG, lambda: parse_args(argv))
    from app.huggingface.generate import answer_file, generate

    unwritten = ("nothing was written (--output is written whole once every prompt is answered and scored)"
                 if args.output else "nothing was printed" if args.prompts is None
                 else "the answers are printed once every prompt is answered")
    with cli.bars_only_on_a_terminal(), stopping.stopped_in_one_line(PROG, unwritten, lambda: None):
        if args.prompts is None:
            print(cli.run_command(PROG, lambda: generate(args)))
        else:
            cli.run_command(PROG, lambda: answer_file(args))
