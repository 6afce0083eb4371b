"""Fill the Hugging Face cache on a machine with internet so compute nodes can train with HF_HUB_OFFLINE=1.

Everything goes through `huggingface_hub.snapshot_download`, so the files land in the standard cache layout that
`from_pretrained(name)` and `snapshot_download(name)` find offline. Only what training needs is fetched: config,
tokenizer (its chat template and any remote code too) and the one copy of the weights `from_pretrained` loads
(safetensors when the repo has them; never Meta's `original/` checkpoint nor Mistral's `consolidated.safetensors`).
The token comes from HF_TOKEN or a cached `hf auth login`; it is never printed.
"""

import errno
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from huggingface_hub import DatasetCard, HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

try:  # huggingface_hub 2 speaks HTTP through httpx2, 1.x (which transformers 5.17-5.22 require) through httpx
    from httpx2 import TransportError
except ImportError:
    from httpx import TransportError

from app import cli, stopping
from app.cli import UsageError
from app.folders import NO_ROOM
from app.hub import dataset_card_configs, quiet_hub, shown_endpoint

# Config, generation config, weight index, tokenizer.json / tokenizer_config.json, SentencePiece and tiktoken
# models, BPE merges and vocabularies, the chat template (transformers 5 saves it as chat_template.jinja) and the
# code of --trust_remote_code models (configuration_*.py, modeling_*.py, tokenization_*.py).
CONFIG_AND_TOKENIZER_PATTERNS = ["*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py"]
WEIGHT_FILES = (("model.safetensors.index.json", "model.safetensors"), ("pytorch_model.bin.index.json",
                                                                        "pytorch_model.bin"))
"""What `from_pretrained` loads, in its order of preference: a sharded checkpoint's index, or the single file."""
# Meta's own consolidated .pth checkpoint and tokenizer duplicate the Hugging Face files and double the download.
IGNORED_PATTERNS = ["original/*"]


@dataclass
class PrefetchArgs:
    """Repositories"""

    model: str
    """Hub id of the model to cache, e.g. meta-llama/Meta-Llama-3-8B (config, tokenizer and weights)."""
    tokenizer: Optional[str] = None
    """Hub id of a tokenizer kept in another repository (default: the model's own)."""
    dataset: Optional[str] = None
    """Hub id of a dataset repository to cache as well."""
    dataset_config: Optional[str] = None
    """Only the data files of this dataset config (as declared in the dataset card), instead of the whole repo."""
    revision: Optional[str] = None
    """Branch, tag or commit of --model (default: main). A model named on the Hub is loaded from main: train on this
    revision by giving its folder (the line printed for it) as --model_name."""
    cache_dir: Optional[str] = None
    """Hub cache folder (default: $HF_HUB_CACHE, i.e. $HF_HOME/hub). Compute nodes must read the same folder."""


class PrefetchError(UsageError):
    """A problem the user can fix, reported as one line."""


def model_file_patterns(repo_files: list[str], read_index: Callable[[str], dict]) -> list[str]:
    """Files to fetch from a model repo: the weights `from_pretrained` loads (the shards its index names, read with
    `read_index`, or the single file), safetensors when present. Mistral's repos hold a second copy of the weights
    (`consolidated.safetensors`, 14.5 GB for 7B) that `*.safetensors` fetched too."""
    for index, single in WEIGHT_FILES:
        if index in repo_files:
            return CONFIG_AND_TOKENIZER_PATTERNS + sorted(set(read_index(index)["weight_map"].values()))
        if single in repo_files:
            return CONFIG_AND_TOKENIZER_PATTERNS + [single]
    has_safetensors = any(name.endswith(".safetensors") for name in repo_files)  # a repo of its own naming
    return CONFIG_AND_TOKENIZER_PATTERNS + (["*.safetensors"] if has_safetensors else ["*.bin"])


def dataset_config_patterns(card_data: dict, dataset: str, config_name: str) -> list[str]:
    """The README plus the data files a dataset card declares for `config_name`."""
    configs = dataset_card_configs(card_data)
    if config_name not in configs:
        known = ", ".join(sorted(configs)) or "none declared in its dataset card"
        raise PrefetchError(f"--dataset_config {config_name}: {dataset} has no such config (configs: {known})")
    return ["README.md", *configs[config_name]]


@dataclass(frozen=True)
class Download:
    """One repo to fetch, decided before anything is downloaded."""

    flag: str
    name: str
    repo_type: str
    revision: Optional[str]
    allow_patterns: Optional[list[str]]


HUB_ERRORS = (HfHubHTTPError, HFValidationError, LocalEntryNotFoundError, TransportError)


def describe_hub_error(flag: str, name: str, error: Exception, upload: bool = False) -> str:
    """One line naming the flag and what to do; never includes the exception's text, which may hold URLs. prefetch.py
    fills the cache for downloads: an upload (`upload`) has nothing to gain from it."""
    if isinstance(error, GatedRepoError):
        return f"{flag} {name}: gated repository: accept its licence on the Hub, then export HF_TOKEN"
    if isinstance(error, RepositoryNotFoundError):
        return f"{flag} {name}: no such repository (or it is private and HF_TOKEN is missing or lacks access)"
    if isinstance(error, RevisionNotFoundError):
        return f"--revision: no such branch, tag or commit in {name}"
    if isinstance(error, HFValidationError):
        return f"{flag} {name}: not a Hub id; expected owner/name"
    if isinstance(error, HfHubHTTPError) and error.response.status_code in (401, 403):
        rights = "a write token (HF_TOKEN) with rights to that namespace" if upload else "a token with access"
        return f"{flag} {name}: the Hub refused the token (HTTP {error.response.status_code}): this needs {rights}"
    if isinstance(error, HfHubHTTPError):
        return f"{flag} {name}: the Hub answered HTTP {error.response.status_code}; try again later"
    unreachable = f"{flag} {name}: cannot reach {shown_endpoint()}"
    return unreachable if upload else f"{unreachable}; run prefetch.py on a machine with internet access"


@contextmanager
def reported_as(flag: str, name: str, upload: bool = False) -> Iterator[None]:
    """Turn a Hub or network failure while handling `flag` into a one-line PrefetchError (huggingface_hub's retries
    unlogged: the line says it all)."""
    try:
        with quiet_hub():
            yield
    except HUB_ERRORS as error:
        raise PrefetchError(describe_hub_error(flag, name, error, upload)) from None


def repo_files(name: str, repo_type: str, revision: Optional[str] = None) -> list[str]:
    """The file names of a repo; also proves it exists and is readable with the current token."""
    info = HfApi().repo_info(name, repo_type=repo_type, revision=revision)
    return [sibling.rfilename for sibling in info.siblings or []]


def dataset_download(args: PrefetchArgs) -> Download:
    patterns = None
    repo_files(args.dataset, "dataset")
    if args.dataset_config is not None:
        card_file = hf_hub_download(args.dataset, "README.md", repo_type="dataset", cache_dir=args.cache_dir)
        card = DatasetCard.load(card_file)
        patterns = dataset_config_patterns(card.data.to_dict(), args.dataset, args.dataset_config)
    return Download("--dataset", args.dataset, "dataset", None, patterns)


def plan(args: PrefetchArgs) -> list[Download]:
    """Check every requested repo before downloading any, so a typo in the last flag wastes no download."""
    def read_index(filename: str) -> dict:
        index = hf_hub_download(args.model, filename, revision=args.revision, cache_dir=args.cache_dir)
        return json.loads(Path(index).read_text())

    with reported_as("--model", args.model):
        model_patterns = model_file_patterns(repo_files(args.model, "model", args.revision), read_index)
    downloads = [Download("--model", args.model, "model", args.revision, model_patterns)]
    if args.tokenizer not in (None, args.model):
        with reported_as("--tokenizer", args.tokenizer):
            repo_files(args.tokenizer, "model")
        downloads.append(Download("--tokenizer", args.tokenizer, "model", None, CONFIG_AND_TOKENIZER_PATTERNS))
    if args.dataset is not None:
        with reported_as("--dataset", args.dataset):
            downloads.append(dataset_download(args))
    return downloads


def fetch(download: Download, cache_dir: Optional[str]) -> str:
    """Download the matching files of one repo into the cache and return its snapshot folder. A cache that cannot
    take the files (a full disk, a quota, a read-only mount) is one line naming it, not a traceback; what was fetched
    stays, and running prefetch.py again completes it."""
    try:
        with reported_as(download.flag, download.name):
            return snapshot_download(
                download.name,
                repo_type=download.repo_type,
                revision=download.revision,
                cache_dir=cache_dir,
                allow_patterns=download.allow_patterns,
                ignore_patterns=IGNORED_PATTERNS,
            )
    except OSError as error:
        if error.errno not in NO_ROOM | {errno.EROFS}:
            raise
        raise PrefetchError(f"{download.flag} {download.name}: the cache {cache_dir or constants.HF_HUB_CACHE} cannot "
                            f"take its files ({os.strerror(error.errno)}): make room there, or give --cache_dir on "
                            "a larger disk, then run prefetch.py again (it completes the download)") from None


def run(args: PrefetchArgs) -> list[str]:
    """Fetch every requested repo; return one '<flag> <name> -> <folder>' line per repo. A --revision other than main
    is kept in the cache under its own name, which `from_pretrained(name)` never reads: the line says to use its
    folder (offline, a name found only under refs/v1 was reported missing, with the advice to prefetch it)."""
    lines = []
    for download in plan(args):
        folder = fetch(download, args.cache_dir)
        lines.append(f"{download.flag.lstrip('-')} {download.name} -> {folder}")
        if download.revision not in (None, "main"):
            lines.append(f"  revision {download.revision}: a Hub name loads main; train it with --model_name {folder}")
    return lines


def parse_args(argv: Optional[list[str]]) -> PrefetchArgs:
    config = cli.parse(cli.command_parser("prefetch.py", __doc__.splitlines()[0], [PrefetchArgs]), argv)
    config.pop("config", None)
    args = PrefetchArgs(**config.as_dict())
    if constants.HF_HUB_OFFLINE:
        raise PrefetchError("HF_HUB_OFFLINE is set: prefetch.py downloads, run it with HF_HUB_OFFLINE=0 or unset")
    if args.dataset_config is not None and args.dataset is None:
        raise PrefetchError("--dataset_config needs --dataset: name the dataset repository it belongs to")
    return args


def offline_settings(args: PrefetchArgs) -> str:
    """What the compute nodes must export to read this cache without network."""
    cache = f"HF_HUB_CACHE={args.cache_dir} " if args.cache_dir else ""
    return f"{cache}HF_HUB_OFFLINE=1"


def main(argv: Optional[list[str]] = None) -> int:
    args = cli.run_command("prefetch.py", lambda: parse_args(argv))
    # a download in progress held Ctrl-C until its file was whole (minutes for a 5 GB shard), then a traceback
    with stopping.stopped_in_one_line("prefetch.py", "run it again: the files cached so far are kept, and an "
                                      "unfinished one resumes where it stopped", lambda: None):
        lines = cli.run_command("prefetch.py", lambda: run(args))
    print("\n".join(lines))
    print(f"cached; on the compute nodes set {offline_settings(args)}")
    return 0
