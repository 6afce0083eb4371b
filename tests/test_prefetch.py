"""prefetch.py against a Hub served from 127.0.0.1, then the cache it filled read with HF_HUB_OFFLINE=1.

The server answers the four requests huggingface_hub's real `snapshot_download` makes (repo info, recursive
tree listing, HEAD and GET of a file), from folders the test writes; nothing leaves the machine.
"""

import hashlib
import importlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import huggingface_hub.constants
import pytest

from app.huggingface.prefetch import CONFIG_AND_TOKENIZER_PATTERNS, dataset_config_patterns, model_file_patterns

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-org/tiny-llama"
TOKENIZER = "tiny-org/tiny-tokenizer"
DATASET = "tiny-org/tiny-text"
TOKEN = "hf_testtoken0123456789abcdefghij"
DATASET_CARD = """---
configs:
- config_name: en
  data_files:
  - split: train
    path: en/train-*.jsonl
- config_name: fr
  data_files: fr/*.jsonl
---
# tiny-text
"""


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"


class LocalHub(BaseHTTPRequestHandler):
    """The Hub API subset snapshot_download uses, over folders `<root>/<models|datasets>/<owner>/<name>/`."""

    root: Path
    requests: list

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.answer(send_body=False)

    def do_GET(self):
        self.answer(send_body=True)

    def answer(self, send_body: bool):
        path = unquote(urlparse(self.path).path)
        self.requests.append((self.command, path, self.headers.get("Authorization")))
        parts = path.strip("/").split("/")
        if parts[0] == "api":
            kind, repo, rest = parts[1], "/".join(parts[2:4]), parts[4:]
            return self.api(kind, repo, rest)
        kind = "datasets" if parts[0] == "datasets" else "models"
        parts = parts[1:] if kind == "datasets" else parts
        repo, filename = "/".join(parts[:2]), "/".join(parts[4:])
        self.file(kind, repo, filename, send_body)

    def repo_folder(self, kind: str, repo: str) -> Path | None:
        folder = self.root / kind / repo
        return folder if folder.is_dir() else None

    def api(self, kind: str, repo: str, rest: list[str]):
        folder = self.repo_folder(kind, repo)
        if folder is None:
            return self.send(404, b"{}", {"X-Error-Code": "RepoNotFound"})
        files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        if not rest or rest[0] == "revision":
            body = {"id": repo, "sha": commit_of(repo), "siblings": [{"rfilename": name} for name in files]}
        else:
            body = [
                {"type": "file", "path": name, "size": (folder / name).stat().st_size, "oid": blob_id(folder / name)}
                for name in files
            ]
        self.send(200, json.dumps(body).encode())

    def file(self, kind: str, repo: str, filename: str, send_body: bool):
        folder = self.repo_folder(kind, repo)
        if folder is None or not (folder / filename).is_file():
            return self.send(404, b"", {"X-Error-Code": "EntryNotFound"})
        content = (folder / filename).read_bytes()
        headers = {"X-Repo-Commit": commit_of(repo), "ETag": f'"{blob_id(folder / filename)}"'}
        self.send(200, content, headers, send_body)

    def send(self, status: int, body: bytes, headers: dict | None = None, send_body: bool = True):
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        if send_body:
            self.wfile.write(body)


def commit_of(repo: str) -> str:
    return hashlib.sha1(repo.encode()).hexdigest()


def blob_id(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


def write_repos(root: Path) -> None:
    """A tiny Llama with safetensors plus the duplicates real repos carry, a tokenizer repo and a dataset repo."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    model_dir = root / "models" / MODEL
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(model_dir, max_shard_size="10KB")  # shards and their index
    assert (model_dir / "model.safetensors.index.json").is_file()
    (model_dir / "pytorch_model.bin").write_bytes(b"duplicate weights")
    (model_dir / "consolidated.safetensors").write_bytes(b"duplicate weights, as Mistral's repos hold")
    (model_dir / "configuration_tiny.py").write_text("# the code of a --trust_remote_code model\n")
    (model_dir / "original").mkdir()
    (model_dir / "original" / "consolidated.00.pth").write_bytes(b"meta checkpoint")
    (model_dir / "original" / "params.json").write_text("{}")

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(ord("a") + i): i + 3 for i in range(26)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(root / "models" / TOKENIZER)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model_dir)  # the model's own tokenizer, its chat template in chat_template.jinja
    assert (model_dir / "chat_template.jinja").is_file()
    config.save_pretrained(root / "models" / TOKENIZER)  # AutoTokenizer reads the model type from config.json

    dataset_dir = root / "datasets" / DATASET
    for config_name in ("en", "fr"):
        (dataset_dir / config_name).mkdir(parents=True)
        lines = [json.dumps({"text": f"{config_name} document {i}"}) for i in range(3)]
        (dataset_dir / config_name / "train-0.jsonl").write_text("\n".join(lines) + "\n")
    (dataset_dir / "README.md").write_text(DATASET_CARD)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    write_repos(root)
    handler = type("Handler", (LocalHub,), {"root": root, "requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler.requests
    server.shutdown()
    server.server_close()


def clean_env(hf_home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


def run_prefetch(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "prefetch.py"), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


OFFLINE_PROBE = textwrap.dedent(
    f"""
    import json, sys
    from datasets import load_dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained({MODEL!r})
    model = AutoModelForCausalLM.from_pretrained({MODEL!r})
    tokenizer = AutoTokenizer.from_pretrained({TOKENIZER!r})
    dataset = load_dataset(sys.argv[1], "en", split="train")
    print(json.dumps([config.hidden_size, sum(p.numel() for p in model.parameters()), tokenizer("abc").input_ids,
                      list(dataset["text"]), AutoTokenizer.from_pretrained({MODEL!r}).chat_template]))
    """
)


def test_prefetched_model_tokenizer_and_dataset_load_offline(hub, tmp_path):
    endpoint, requests = hub
    requests.clear()
    hf_home = tmp_path / "hf"
    result = run_prefetch(
        ["--model", MODEL, "--tokenizer", TOKENIZER, "--dataset", DATASET, "--dataset_config", "en"],
        clean_env(hf_home, HF_ENDPOINT=endpoint, HF_TOKEN=TOKEN),
    )
    assert result.returncode == 0, result.stderr
    assert TOKEN not in result.stdout + result.stderr
    assert "HF_HUB_OFFLINE=1" in result.stdout.splitlines()[-1]
    folders = dict(line.split(" -> ") for line in result.stdout.splitlines()[:-1])
    dataset_folder = folders[f"dataset {DATASET}"]

    downloaded = {path for method, path, _ in requests if method == "GET" and "/resolve/" in path}
    assert not [p for p in downloaded if p.endswith((".bin", ".pth")) or "/original/" in p]
    assert not [p for p in downloaded if p.endswith("consolidated.safetensors")], "the second copy of the weights"
    assert len([p for p in downloaded if p.endswith("-of-00002.safetensors")]) == 2, "the shards the index names"
    assert [p for p in downloaded if p.endswith("chat_template.jinja")], "trained offline with another template"
    assert [p for p in downloaded if p.endswith("configuration_tiny.py")], "a remote-code model's code"
    assert not [p for p in downloaded if "/fr/" in p]
    assert {auth for _, _, auth in requests} == {f"Bearer {TOKEN}"}

    probe = subprocess.run(
        [sys.executable, "-c", OFFLINE_PROBE, dataset_folder],
        env=clean_env(hf_home, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9"),
        capture_output=True, text=True, timeout=180,
    )
    assert probe.returncode == 0, probe.stderr
    hidden_size, n_params, ids, texts, chat_template = json.loads(probe.stdout.strip().splitlines()[-1])
    assert hidden_size == 16 and n_params > 0 and chat_template == CHAT_TEMPLATE
    assert ids == [3, 4, 5]
    assert texts == [f"en document {i}" for i in range(3)]


def test_prefetch_runs_again_from_the_cache_without_downloading(hub, tmp_path):
    endpoint, requests = hub
    env = clean_env(tmp_path / "hf", HF_ENDPOINT=endpoint)
    assert run_prefetch(["--model", MODEL], env).returncode == 0
    requests.clear()
    again = run_prefetch(["--model", MODEL], env)
    assert again.returncode == 0, again.stderr
    assert not [path for method, path, _ in requests if method == "GET" and "/resolve/" in path]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model", "tiny-org/missing"], "--model tiny-org/missing: no such repository"),
        (["--model", MODEL, "--tokenizer", "tiny-org/nope"], "--tokenizer tiny-org/nope: no such repository"),
        (["--model", MODEL, "--dataset", DATASET, "--dataset_config", "de"], "--dataset_config de:"),
        (["--model", MODEL, "--dataset_config", "en"], "--dataset_config needs --dataset"),
        (["--model", "not a repo id"], "--model not a repo id: not a Hub id"),
        (["--tokenizer", TOKENIZER], "model"),
    ],
    ids=["unknown-model", "unknown-tokenizer", "unknown-config", "config-without-dataset", "bad-id", "no-model"],
)
def test_bad_input_is_one_line_and_exit_2(hub, tmp_path, args, expected):
    endpoint, _ = hub
    result = run_prefetch(args, clean_env(tmp_path / "hf", HF_ENDPOINT=endpoint))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and expected in result.stderr
    assert "Traceback" not in result.stderr


def test_no_network_is_one_line_and_exit_2(tmp_path):
    result = run_prefetch(["--model", MODEL], clean_env(tmp_path / "hf", HF_ENDPOINT="http://127.0.0.1:9"))
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("prefetch.py: error: --model tiny-org/tiny-llama: cannot reach"), last


def test_prefetch_refuses_to_run_offline(tmp_path):
    result = run_prefetch(["--model", MODEL], clean_env(tmp_path / "hf", HF_HUB_OFFLINE="1"))
    assert result.returncode == 2 and "HF_HUB_OFFLINE" in result.stderr


def test_one_copy_of_the_weights_is_fetched_preferring_safetensors():
    mistral = ["config.json", "consolidated.safetensors", "model-00001-of-00002.safetensors",
               "model-00002-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin.index.json",
               "pytorch_model-00001-of-00002.bin", "tokenizer.json"]
    shards = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    weights = [p for p in model_file_patterns(mistral, lambda name: shards) if p not in CONFIG_AND_TOKENIZER_PATTERNS]
    assert weights == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    single = model_file_patterns(["config.json", "model.safetensors", "pytorch_model.bin"], dict)
    assert single[-1] == "model.safetensors"
    assert model_file_patterns(["config.json", "pytorch_model.bin", "tokenizer.model"], dict)[-1] == "pytorch_model.bin"
    assert model_file_patterns(["config.json", "weights.safetensors"], dict)[-1] == "*.safetensors"


def test_a_revision_is_fetched_with_the_folder_to_train_it_from(hub, tmp_path):
    """A Hub name loads main: offline, a revision cached only under its own ref was reported missing."""
    endpoint, _ = hub
    result = run_prefetch(["--model", MODEL, "--revision", "v1"], clean_env(tmp_path / "hf", HF_ENDPOINT=endpoint))
    assert result.returncode == 0, result.stderr
    folder = result.stdout.splitlines()[0].split(" -> ")[1]
    assert f"revision v1: a Hub name loads main; train it with --model_name {folder}" in result.stdout
    assert (Path(folder) / "config.json").is_file()


def test_dataset_config_patterns_accept_every_data_files_form():
    card = {"configs": [
        {"config_name": "a", "data_files": "a/*.parquet"},
        {"config_name": "b", "data_files": ["b/1.jsonl", "b/2.jsonl"]},
        {"config_name": "c", "data_files": [{"split": "train", "path": ["c/t-*"]}, {"split": "test", "path": "c/v"}]},
    ]}
    assert dataset_config_patterns(card, "x/y", "a") == ["README.md", "a/*.parquet"]
    assert dataset_config_patterns(card, "x/y", "b") == ["README.md", "b/1.jsonl", "b/2.jsonl"]
    assert dataset_config_patterns(card, "x/y", "c") == ["README.md", "c/t-*", "c/v"]


def test_train_tells_how_to_prefetch_a_model_missing_offline(tiny, tmp_path):
    from tests.conftest import run_train, train_args

    args = train_args(tiny, tmp_path / "run", model_config=None, model_name="nobody/missing-model")
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = run_train(args, env=env, fresh=True)  # huggingface_hub reads HF_HUB_OFFLINE on import
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "python prefetch.py --model nobody/missing-model" in result.stderr
    assert not (tmp_path / "run").exists()


def test_huggingface_hub_1_http_errors_are_caught_too(monkeypatch):
    """The GPU image's transformers 5.17 requires huggingface_hub < 2, which speaks HTTP through httpx, not httpx2:
    train.py (whose preflight imports prefetch.py) failed there with `No module named 'httpx2'`."""
    httpx = types.ModuleType("httpx")
    httpx.TransportError = type("TransportError", (Exception,), {})
    monkeypatch.setitem(sys.modules, "httpx", httpx)
    monkeypatch.setitem(sys.modules, "httpx2", None)  # importing it raises ImportError, as where it is not installed
    monkeypatch.delitem(sys.modules, "app.huggingface.prefetch")
    prefetch = importlib.import_module("app.huggingface.prefetch")
    assert httpx.TransportError in prefetch.HUB_ERRORS


@pytest.fixture
def hub_asked_afresh(monkeypatch):
    """app.hub asks the Hub once per process: each test asks anew, with the Hub and the cache it sets."""
    from app import hub

    hub.hub_reachable.cache_clear()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    yield hub
    hub.hub_reachable.cache_clear()


def test_a_hub_that_does_not_answer_is_given_up_on_after_the_short_timeout(hub_asked_afresh, monkeypatch):
    """A name lookup can hang past any socket timeout: the probe runs in a thread with a deadline."""
    monkeypatch.setattr(hub_asked_afresh, "PROBE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(hub_asked_afresh, "ask_hub", lambda: time.sleep(30))
    start = time.monotonic()
    assert hub_asked_afresh.hub_reachable() is False
    assert time.monotonic() - start < 5


def test_train_without_the_hub_refuses_an_uncached_model_at_once_naming_prefetch(tiny, tmp_path, capsys, monkeypatch,
                                                                                 hub_asked_afresh):
    """No network and no HF_HUB_OFFLINE: huggingface_hub retried each file for over a minute, logging each retry; then
    "check the name" without the prefetch.py command, and a false note that the model has no tokenizer. A missing
    local folder (demo/hf-model before `make demo`) was looked up on the Hub the same way: the line says both."""
    from app.training.preflight import preflight
    from arguments import parse_config
    from tests.conftest import train_args

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    args = train_args(tiny, tmp_path / "out", model_config=None, model_name="demo/hf-model", tokenizer=None,
                      train_data_dir=None, estimate_memory=True, block_size=32)
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        preflight(parse_config(args))
    output = capsys.readouterr()
    assert exit_info.value.code == 2 and time.monotonic() - start < 20
    assert output.err.strip().splitlines() == [
        f"error: --model_name demo/hf-model: no folder demo/hf-model in {tmp_path}, and no Hub model of that name in "
        "the Hugging Face cache, while http://127.0.0.1:9 cannot be reached: for a Hub model, run `python prefetch.py "
        "--model demo/hf-model` on a machine with internet access using the same HF_HOME, then set HF_HUB_OFFLINE=1"]
    assert "tokenizer" not in output.out


def test_a_missing_folder_path_is_said_to_be_missing_not_an_invalid_repo_id(tiny, tmp_path, capsys) -> None:
    """A path that cannot be a Hub id (/models/llama, ./out) was handed to the Hub and came back as huggingface_hub's
    "Repo id must use alphanumeric chars ..." rule, in train.py, generate.py and prepare_data.py alike."""
    from app.huggingface.generate_cli import main as generate_main
    from app.prepare.cli import main as prepare_main
    from app.training.preflight import preflight
    from arguments import parse_config
    from tests.conftest import train_args

    missing = tmp_path / "llama"
    attempts = [lambda: preflight(parse_config(train_args(tiny, tmp_path / "out", model_config=None,
                                                          model_name=str(missing)))),
                lambda: generate_main([str(missing)]),
                lambda: prepare_main(["--input", str(ROOT / "README.md"), "--tokenizer", str(missing),
                                      "--output_dir", str(tmp_path / "data")])]
    for attempt in attempts:
        with pytest.raises(SystemExit) as exit_info:
            attempt()
        err = capsys.readouterr().err
        assert exit_info.value.code == 2
        assert f"{missing}: no such folder (nor a Hub id of the form owner/name)" in err, err
        assert "Repo id" not in err and "Traceback" not in err


def test_preflight_says_a_model_folder_without_a_tokenizer_has_none_and_a_broken_one_does_not_load(tiny, tmp_path,
                                                                                                   capsys):
    """"has none" only where it is true: a tokenizer that is there but does not load says why."""
    from types import SimpleNamespace

    from app.training.preflight.tokenizer import resolve_tokenizer

    folder = tmp_path / "model"
    folder.mkdir()
    cfg = SimpleNamespace(tokenizer=None, train_data_dir=None, model_name=str(folder), trust_remote_code=False,
                          init_from=None)
    assert resolve_tokenizer(cfg, None, []) is None
    assert capsys.readouterr().out.strip().startswith(f"no tokenizer recorded with this run: {folder} has none (no "
                                                      "tokenizer.json, tokenizer_config.json,")
    problems: list[str] = []
    assert resolve_tokenizer(SimpleNamespace(**vars(cfg) | {"tokenizer": str(folder)}), None, problems) is None
    assert problems == [f"--tokenizer {folder} has none (no tokenizer.json, tokenizer_config.json, tokenizer.model, "
                        "vocab.json, tiktoken.model); give a folder with tokenizer files (a prepared data folder's "
                        "tokenizer/) or a hub id"]
    (folder / "tokenizer_config.json").write_text("{not json")
    assert resolve_tokenizer(cfg, None, []) is None
    note = capsys.readouterr().out.strip()
    assert note.startswith(f"no tokenizer recorded with this run: {folder}'s tokenizer does not load ("), note
    data = tmp_path / "data"  # trained on to the end without a word; only the conversion asked for a tokenizer
    data.mkdir()
    assert resolve_tokenizer(SimpleNamespace(**vars(cfg) | {"model_name": None, "train_data_dir": str(data),
                                                            "estimate_memory": False}), None, []) is None
    assert capsys.readouterr().out.strip() == (
        f"no tokenizer recorded with this run: --train_data_dir {data} holds no tokenizer/ and no --tokenizer or "
        "--model_name names one; give --tokenizer for the run to keep it (convert_to_hf.py will ask for it otherwise)")


def cached(hub_cache: Path, repo: str, folder: Path, only: tuple[str, ...] = ()) -> None:
    """`folder`'s files (those named in `only`, else all) as the Hugging Face cache holds a download of `repo`."""
    snapshot = hub_cache / f"models--{repo.replace('/', '--')}" / "snapshots" / commit_of(repo)
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        if not only or file.name in only:
            (snapshot / file.name).write_bytes(file.read_bytes())
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(commit_of(repo))


@pytest.fixture
def without_the_hub(tiny, tmp_path, monkeypatch, hub_asked_afresh):
    """No network and no HF_HUB_OFFLINE, a cache of our own; the variable a run sets is restored afterwards."""
    from transformers import AutoConfig, AutoModelForCausalLM

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://user:secret@127.0.0.1:9")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny.model_config)).save_pretrained(tmp_path / "model")
    return tmp_path / "hub", tmp_path / "model"


def test_a_cached_model_without_the_hub_is_read_offline_at_once_and_said(tiny, tmp_path, capsys, without_the_hub):
    """transformers asked the Hub for the latest revision of a cached model with no timeout: 4 min 40 s of silence
    behind a firewall that drops packets, for ever behind a proxy that never answers, on every rank. The run goes
    offline after the probe's few seconds, and says so (without the password in HF_ENDPOINT)."""
    from app.training.preflight import preflight
    from arguments import parse_config
    from tests.conftest import train_args

    hub_cache, model = without_the_hub
    cached(hub_cache, MODEL, model)
    start = time.monotonic()
    preflight(parse_config(train_args(tiny, tmp_path / "out", model_config=None, model_name=MODEL)))
    assert time.monotonic() - start < 30
    assert huggingface_hub.constants.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1", "the ranks inherit it"
    out = capsys.readouterr().out
    assert f"note: http://127.0.0.1:9 cannot be reached: {MODEL} and the rest are read from the Hugging Face cache " \
           "(HF_HUB_OFFLINE=1 from here on)" in out and "secret" not in out


@pytest.mark.parametrize("kept", [("config.json",), ("config.json", "model.safetensors.index.json")],
                         ids=["config-only", "index-without-shards"])
def test_a_model_cached_without_its_weights_is_refused_before_any_rank_starts(tiny, tmp_path, capsys, without_the_hub,
                                                                              kept):
    """`prepare_data.py --tokenizer X` caches X's config; a prefetch cut short leaves its first files: every rank
    ended in transformers' traceback ("does not appear to have a file named ... model.safetensors")."""
    from app.training.preflight import preflight
    from arguments import parse_config
    from tests.conftest import train_args

    hub_cache, model = without_the_hub
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "shard-1.bin"}}))
    cached(hub_cache, MODEL, model, only=kept)
    with pytest.raises(SystemExit) as exit_info:
        preflight(parse_config(train_args(tiny, tmp_path / "out", model_config=None, model_name=MODEL)))
    assert exit_info.value.code == 2
    assert f"error: --model_name {MODEL}: the Hugging Face cache holds its config but not all its weights " \
           "(prepare_data.py --tokenizer caches only a tokenizer and its config; a prefetch may have been cut " \
           "short), " \
           "while HF_HUB_OFFLINE is set: run `python prefetch.py --model tiny-org/tiny-llama` on a machine with " \
           "internet access using the same HF_HOME, then set HF_HUB_OFFLINE=1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    preflight(parse_config(train_args(tiny, tmp_path / "out", model_config=None, model_name=MODEL,
                                      estimate_memory=True)))  # a plan reads the config alone


def test_a_full_cache_is_one_line_naming_it(tmp_path, monkeypatch):
    """A full disk under HF_HOME ended prefetch.py in a 62-line traceback."""
    import errno

    from app.huggingface import prefetch

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(prefetch, "snapshot_download", full_disk)
    download = prefetch.Download("--model", MODEL, "model", None, None)
    with pytest.raises(prefetch.PrefetchError) as refused:
        prefetch.fetch(download, str(tmp_path / "cache"))
    assert str(refused.value) == (f"--model {MODEL}: the cache {tmp_path / 'cache'} cannot take its files (No space "
                                  "left on device): make room there, or give --cache_dir on a larger disk, then run "
                                  "prefetch.py again (it completes the download)")


@pytest.mark.parametrize("offline", ["1", None], ids=["HF_HUB_OFFLINE", "unreachable"])
def test_a_prefetched_dataset_is_prepared_by_its_name_without_the_hub(hub, tmp_path, offline):
    """docs/prepare-data.md said a Hub name honours the cache and HF_HUB_OFFLINE=1; load_dataset by name looked only
    in its own cache and refused the files prefetch.py had cached (OfflineModeIsEnabled). Without HF_HUB_OFFLINE, it
    retried for minutes first."""
    endpoint, _ = hub
    hf_home = tmp_path / "hf"
    fetched = run_prefetch(["--tokenizer", TOKENIZER, "--model", MODEL, "--dataset", DATASET, "--dataset_config", "en"],
                           clean_env(hf_home, HF_ENDPOINT=endpoint))
    assert fetched.returncode == 0, fetched.stderr
    env = clean_env(hf_home, HF_ENDPOINT="http://127.0.0.1:9", **({"HF_HUB_OFFLINE": offline} if offline else {}))
    start = time.monotonic()
    result = subprocess.run([sys.executable, str(ROOT / "prepare_data.py"), "--input", DATASET, "--dataset_config",
                             "en", "--tokenizer", TOKENIZER, "--block_size", "8", "--val_fraction", "0",
                             "--output_dir", str(tmp_path / "data")], env=env, cwd=ROOT, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert time.monotonic() - start < 60
    stats = json.loads((tmp_path / "data" / "stats.json").read_text())
    assert stats["splits"]["train"]["documents"] == 3 and stats["inputs"] == [f"{DATASET} (train: 3 rows)"], stats


def test_a_config_or_split_the_cache_lacks_is_one_line_naming_the_flag(hub, tmp_path):
    """Offline, a config prefetch.py did not fetch failed as a bare `StopIteration`; no --dataset_config as "Config
    name is missing."; an unknown config or split in `load_dataset`'s own words, which say what to call in Python."""
    endpoint, _ = hub
    hf_home = tmp_path / "hf"
    fetched = run_prefetch(["--tokenizer", TOKENIZER, "--model", MODEL, "--dataset", DATASET, "--dataset_config", "en"],
                           clean_env(hf_home, HF_ENDPOINT=endpoint))
    assert fetched.returncode == 0, fetched.stderr
    failed = f"error: --input {DATASET}: not a local path, and loading it as a Hugging Face dataset failed: "
    for options, expected in (
        (["--dataset_config", "fr"], f"error: --dataset_config fr: the Hugging Face cache holds none of its files of "
                                     f"{DATASET} (fr/*.jsonl); run `python prefetch.py --dataset {DATASET} "
                                     "--dataset_config fr` on a machine with internet access using the same HF_HOME"),
        ([], f"{failed}it has several configs (en, fr): choose one with --dataset_config"),
        (["--dataset_config", "de"], f"{failed}--dataset_config de: no such config (configs: en, fr)"),
        (["--dataset_config", "en", "--split", "test"], f"{failed}--split test: no such split (splits: train)"),
    ):
        result = subprocess.run([sys.executable, str(ROOT / "prepare_data.py"), "--input", DATASET, *options,
                                 "--tokenizer", TOKENIZER, "--output_dir", str(tmp_path / "data")],
                                env=clean_env(hf_home, HF_HUB_OFFLINE="1"), cwd=ROOT, capture_output=True, text=True,
                                timeout=180)
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [
            f"prepare_data.py: {expected}; see prepare_data.py --help"], (options, result.stderr)
        assert not (tmp_path / "data").exists()


def test_ctrl_c_ends_prefetch_at_once_in_one_line(tmp_path) -> None:
    """A download in progress held Ctrl-C until its file was whole (minutes for a 5 GB shard), then printed a
    KeyboardInterrupt traceback (78 lines against a Hub that never answers). Here a Hub that accepts and never
    answers: the signal comes while prefetch.py waits for it."""
    import signal
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections complete in the kernel; nothing ever answers
    endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
    started = subprocess.Popen([sys.executable, str(ROOT / "prefetch.py"), "--model", MODEL], cwd=ROOT,
                               env=clean_env(tmp_path / "hf", HF_ENDPOINT=endpoint), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    silent.settimeout(60)
    waiting, _ = silent.accept()  # prefetch.py asks the Hub: past its imports, into the wait
    started.send_signal(signal.SIGINT)
    _, err = started.communicate(timeout=30)
    waiting.close()
    silent.close()
    assert started.returncode == 130, err
    assert err.strip() == ("prefetch.py: stopped by SIGINT; run it again: the files cached so far are kept, and an "
                           "unfinished one resumes where it stopped"), err


def test_a_cached_dataset_card_that_does_not_parse_is_left_to_load_dataset(tmp_path) -> None:
    """Checking which config's files the cache holds read the card's YAML: a malformed card was a traceback."""
    from app.prepare.corpus import refuse_config_not_cached

    for card in ("---\nconfigs: [a\n---\n", "---\nconfigs:\n- data_files: a/*.jsonl\n---\n"):
        (tmp_path / "README.md").write_text(card)
        refuse_config_not_cached("org/data", tmp_path, "a")  # nothing raised: load_dataset says what is wrong
