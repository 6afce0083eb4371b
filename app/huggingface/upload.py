"""Upload a converted model folder to the Hugging Face Hub with huggingface_hub's own client.

The token is never handled here: `HfApi` finds it in HF_TOKEN or the cached `hf auth login` by itself, so it
cannot end up in our output, logs or files. We only ask whether one exists, to refuse early instead of after
a long conversion.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Optional

from huggingface_hub import HfApi, constants, get_token
from huggingface_hub.utils import HFValidationError, validate_repo_id


REPLACED_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "chat_template.*")
"""What an upload deletes from the repository's top level unless the folder holds it again: weights left by an earlier
push in another sharding (`model.safetensors` beside a new `model-00001-of-00003.safetensors`) were what
`from_pretrained` loaded, and a chat template left by an earlier run was what the new model's prompts were rendered
with. Subfolders are the user's (step folders, an adapter, ONNX weights): stale_model_files."""


@dataclass
class HubArgs:
    """Hugging Face Hub"""

    push_to_hub: Optional[str] = None
    """Repository id (user/name or org/name) to upload the converted folder to; created if it does not exist."""
    private: bool = False
    """Create the repository as private (only when it does not exist yet)."""
    revision: Optional[str] = None
    """Branch to upload to (created from main when missing); default: main."""
    commit_message: Optional[str] = None
    """Commit message of the upload; default: 'Upload <folder> (step N)'."""
    dry_run: bool = False
    """List the files that would be uploaded and their sizes, without contacting the Hub."""


def login_problem(args: HubArgs) -> Optional[str]:
    """Why an upload cannot start, checked before the conversion; None when it can (or nothing is pushed). The
    upload's options without --push_to_hub would be ignored: a --dry_run meant to list files converted in full."""
    if not args.push_to_hub:
        given = [f"--{name}" for name, unset in (("private", False), ("revision", None), ("commit_message", None),
                                                 ("dry_run", False)) if getattr(args, name) != unset]
        return (f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to an upload: add --push_to_hub "
                "REPO_ID, or drop them") if given else None
    try:  # its syntax: huggingface_hub refused it only when uploading, after the conversion
        validate_repo_id(args.push_to_hub)
    except HFValidationError:
        return f"--push_to_hub {args.push_to_hub}: not a Hub id; expected owner/name (or a name of your own account)"
    if args.dry_run:
        return None
    if constants.HF_HUB_OFFLINE:  # as compute nodes are told to set it: the upload failed after the conversion
        return (f"--push_to_hub {args.push_to_hub}: HF_HUB_OFFLINE is set, so nothing can be uploaded from here; "
                "unset it for this command, or convert without --push_to_hub and upload the folder from a machine "
                "with internet access (`hf upload`)")
    if get_token() is None:
        return (f"--push_to_hub {args.push_to_hub} needs a Hugging Face token: set HF_TOKEN or run `hf auth login`, "
                "or add --dry_run true")
    return None


def files_to_upload(folder: Path) -> list[tuple[str, int]]:
    """Every file of the folder as (path in the repository, size in bytes): what upload_folder sends."""
    return sorted((p.relative_to(folder).as_posix(), p.stat().st_size) for p in folder.rglob("*") if p.is_file())


def describe_upload(folder: Path, args: HubArgs) -> str:
    lines = [f"would upload to {args.push_to_hub} (branch {args.revision or 'main'}):"]
    lines += [f"  {name}  {size:,} bytes" for name, size in files_to_upload(folder)]
    return "\n".join(lines)


def stale_model_files(repo_files: list[str]) -> list[str]:
    """The repository's top-level model files (REPLACED_FILES), each as a pattern that matches it alone: given
    REPLACED_FILES itself, huggingface_hub's fnmatch, whose `*` spans `/`, also deleted every subfolder's weights."""
    return [re.sub(r"([*?[])", r"[\1]", name) for name in repo_files
            if "/" not in name and any(fnmatch(name, pattern) for pattern in REPLACED_FILES)]


def push_folder(folder: Path, args: HubArgs, default_message: str) -> str:
    """Create the repository (and branch) if needed and upload the folder in one commit that also deletes the
    top-level model files the folder no longer holds (`stale_model_files`); return the commit url."""
    api = HfApi()
    api.create_repo(args.push_to_hub, private=args.private, exist_ok=True)
    if args.revision:
        api.create_branch(args.push_to_hub, branch=args.revision, exist_ok=True)
    stale = stale_model_files(api.list_repo_files(args.push_to_hub, revision=args.revision))
    commit = api.upload_folder(repo_id=args.push_to_hub, folder_path=folder, revision=args.revision,
                               commit_message=args.commit_message or default_message, delete_patterns=stale or None)
    return str(commit)
