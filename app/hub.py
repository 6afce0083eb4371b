"""Whether a name given as a model or tokenizer can be loaded from here, found out once and quickly.

transformers asks the Hub for a name that is no local folder, and without network huggingface_hub retries each file
for over a minute, logging every retry, before an error that blames the name ("check the name"). The commands ask
here first: a local folder or a repository in the Hugging Face cache needs no network; otherwise one request with a
short timeout tells whether the Hub answers, and when it does not, the refusal is one line naming the prefetch.py
command (docs/deployment.md, offline clusters).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Optional

from huggingface_hub import constants, get_session, try_to_load_from_cache
from huggingface_hub.errors import StrictDataclassError
from huggingface_hub.utils import HFValidationError, validate_repo_id

from app.cli import first_line, without_credentials
from app.tasks import launching_process

PROBE_TIMEOUT_S = 3.0
"""How long the one request that tells whether the Hub answers may take (huggingface_hub's own is 10 s a try)."""
CACHED_FILES = ("config.json", "tokenizer_config.json")
"""A model repository in the cache holds the first; a tokenizer-only repository the second."""
WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                "pytorch_model.bin")
"""The weights transformers loads, in the order it looks for them (an index names the shards)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")
TOKENIZER_ADVICE = "give a folder with tokenizer files (a prepared data folder's tokenizer/) or a hub id"


def prefetch_advice(name: str) -> str:
    """How a machine without the Hub gets `name`: docs/deployment.md, offline clusters."""
    return (f"run `python prefetch.py --model {name}` on a machine with internet access using the same HF_HOME, "
            "then set HF_HUB_OFFLINE=1")


def dataset_card_configs(card_data: dict) -> dict[str, list[str]]:
    """The data file patterns of each config a dataset card's YAML declares (`configs:`; each `data_files` a pattern,
    a list of them, or splits each with a pattern or a list): what prefetch.py --dataset_config fetches, and what
    prepare_data.py looks for in the cache."""
    configs = {}
    for config in card_data.get("configs", []):
        data_files = config.get("data_files", [])
        patterns = []
        for entry in data_files if isinstance(data_files, list) else [data_files]:
            entry_paths = entry["path"] if isinstance(entry, dict) else entry
            patterns += entry_paths if isinstance(entry_paths, list) else [entry_paths]
        configs[config["config_name"]] = patterns
    return configs


def is_hub_id(name: str) -> bool:
    """Whether transformers would ask the Hub for `name`: no local path of that name, and an owner/name id."""
    if Path(name).exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def in_cache(name: str) -> bool:
    """Whether the Hugging Face cache holds the repository's config or tokenizer (as prefetch.py leaves it)."""
    return any(isinstance(try_to_load_from_cache(name, filename), str) for filename in CACHED_FILES)


def weights_in_cache(name: str) -> bool:
    """Whether the cache holds the repository's weights whole: a file, or an index and every shard it names.
    `prepare_data.py --tokenizer X` caches X's config and tokenizer only, and a prefetch cut short its first files."""
    for filename in WEIGHT_FILES:
        path = try_to_load_from_cache(name, filename)
        if isinstance(path, str):
            if not filename.endswith(".index.json"):
                return True
            shards = set(json.loads(Path(path).read_text())["weight_map"].values())
            return all(isinstance(try_to_load_from_cache(name, shard), str) for shard in shards)
    return False


def hub_commit(name: Optional[str]) -> Optional[str]:
    """The commit of a Hub model's files as the cache holds them (what `from_pretrained(name)` reads); None for a
    folder, or a model not in the cache."""
    path = try_to_load_from_cache(name, "config.json") if name and is_hub_id(name) else None
    return Path(path).parent.name if isinstance(path, str) else None


def has_tokenizer_files(name: str) -> bool:
    """Whether a model folder, or a Hub model in the cache, holds tokenizer files."""
    if Path(name).is_dir():
        return any((Path(name) / file).exists() for file in TOKENIZER_FILES)
    return is_hub_id(name) and any(isinstance(try_to_load_from_cache(name, file), str) for file in TOKENIZER_FILES)


def ask_hub() -> None:
    """One request to the Hub's endpoint through huggingface_hub's own client (its proxies and headers); raises unless
    it answers as the Hub does (a proxy answering 404, 407 or 5xx in its place is no Hub)."""
    response = get_session().head(constants.ENDPOINT, timeout=PROBE_TIMEOUT_S)
    if response.status_code >= 400:
        raise ConnectionError(f"{constants.ENDPOINT} answered {response.status_code}")


@lru_cache(maxsize=1)
def hub_reachable() -> bool:
    """Asked once per process. In a thread with a deadline: a name lookup that hangs has no timeout of its own."""
    if constants.HF_HUB_OFFLINE:
        return False
    answered: list[bool] = []

    def probe() -> None:
        try:
            ask_hub()
            answered.append(True)
        except Exception:  # noqa: BLE001 (whatever the failure, the Hub did not answer)
            pass

    thread = threading.Thread(target=probe, name="hub-probe", daemon=True)
    thread.start()
    thread.join(PROBE_TIMEOUT_S + 1)
    return bool(answered)


def why_unreachable() -> str:
    return "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"{shown_endpoint()} cannot be reached"


def shown_endpoint() -> str:
    """HF_ENDPOINT without the user and password a mirror's URL may carry."""
    return without_credentials(constants.ENDPOINT)


def go_offline(name: str) -> None:
    """A cached Hub id while the Hub does not answer and HF_HUB_OFFLINE is not set (a compute node without internet):
    transformers would still ask the Hub for the latest revision, with no timeout of its own: minutes of silence
    behind a firewall that drops packets, for ever behind a proxy that accepts and never answers, on every rank.
    This process and those it starts work offline from the cache, and say so once."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:  # it copied the setting when it was imported
        sys.modules["datasets"].config.HF_HUB_OFFLINE = True
    if launching_process():
        print(f"note: {shown_endpoint()} cannot be reached: {name} and the rest are read from the Hugging Face cache "
              "(HF_HUB_OFFLINE=1 from here on)", flush=True)


def missing_folder_problem(flag: str, name: str) -> Optional[str]:
    """One line when `name` is no path here and cannot be a Hub id either (`/models/llama`, `./out`): without it,
    transformers hands such a path to the Hub, whose answer is a rule about repository names."""
    if Path(name).exists() or is_hub_id(name):
        return None
    return f"{flag} {name}: no such folder (nor a Hub id of the form owner/name)"


def missing_model_problem(flag: str, name: str) -> Optional[str]:
    """One line when `name` is neither a folder here nor a model that can be had (cached, or the Hub asked); else None.

    A missing local folder named like a Hub id (demo/hf-model before `make demo`) and an uncached Hub id look alike:
    the line says both."""
    missing_folder = missing_folder_problem(flag, name)
    if missing_folder:
        return missing_folder
    if not is_hub_id(name) or hub_reachable():
        return None
    if in_cache(name):
        if not constants.HF_HUB_OFFLINE:
            go_offline(name)
        return None
    return (f"{flag} {name}: no folder {name} in {Path.cwd()}, and no Hub model of that name in the Hugging Face "
            f"cache, while {why_unreachable()}: for a Hub model, {prefetch_advice(name)}")


def missing_weights_problem(flag: str, name: str) -> Optional[str]:
    """One line when a Hub model whose config is cached cannot have its weights: not in the cache, and the Hub out
    of reach. Without it every rank ended in transformers' traceback ("does not appear to have a file named
    pytorch_model.bin or model.safetensors") after the run had started."""
    if not is_hub_id(name) or hub_reachable() or not in_cache(name) or weights_in_cache(name):
        return None
    return (f"{flag} {name}: the Hugging Face cache holds its config but not all its weights (prepare_data.py "
            f"--tokenizer caches only a tokenizer and its config; a prefetch may have been cut short), while "
            f"{why_unreachable()}: {prefetch_advice(name)}")


@contextmanager
def quiet_hub() -> Iterator[None]:
    """huggingface_hub's warnings (a line per retry, each with its URL) kept out of the user's terminal while our code
    calls it: its failure reaches the user as our one line."""
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hub_logger.setLevel(level)


def unloadable_tokenizer(name: str, error: Exception) -> str:
    """Why tokenizer `name` did not load, as it is: a folder without tokenizer files has none; anything else (a Hub
    model, files that do not load) has one that did not load, and the reason is worth reading."""
    if Path(name).is_dir() and not has_tokenizer_files(name):
        return f"{name} has none (no {', '.join(TOKENIZER_FILES)})"
    return f"{name}'s tokenizer does not load ({load_problem(error)})"


CONFIG_ERRORS = (OSError, ValueError, KeyError, TypeError, StrictDataclassError, ArithmeticError)
"""What transformers raises for a config it cannot read: a file or name it cannot find (OSError), a model type it
does not know (ValueError), a rope_scaling it finds incomplete (KeyError: Llama-3's without low_freq_factor, an
older Phi-3's "su" without original_max_position_embeddings), a value of the wrong type (TypeError), values that
do not go together (huggingface_hub's StrictDataclassError: a hidden size no multiple of the attention heads), a
count of 0 that its checks divide by (ZeroDivisionError: 0 attention heads)."""


def load_problem(error: Exception) -> str:
    """The first line of transformers' reason, or, for code a folder or repository ships, what allows it: its own
    reason ends with `trust_remote_code=True`, a Python argument, on a line the one-line message leaves out."""
    if isinstance(error, KeyError) and error.args:  # str() of a KeyError is its message in quotes
        return first_line(ValueError(str(error.args[0])))
    if isinstance(error, StrictDataclassError):  # its first line names a validator; the next says what is wrong
        return first_line(ValueError(" ".join(line.strip() for line in str(error).splitlines()).rstrip(".")))
    return REMOTE_CODE if "contains custom code" in str(error) else first_line(error)


REMOTE_CODE = "it ships Python code of its own, which runs only with --trust_remote_code true: read it first"


CHAT_TEMPLATE_DIFFERS = "its chat template differs"
"""tokenizer_difference's answer when only the chat template differs, which its callers tell apart."""


def tokenizer_difference(given, other) -> Optional[str]:
    """What differs between two tokenizers in what a run records for conversion: the token ids, the special
    tokens, the chat template (a converted chat model would render prompts unlike its training)."""
    if given.get_vocab() != other.get_vocab():
        return "its vocabulary differs"
    if given.all_special_ids != other.all_special_ids:
        return "its special tokens differ"
    if (given.chat_template or None) != (other.chat_template or None):
        return CHAT_TEMPLATE_DIFFERS
    return None
