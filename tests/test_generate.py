"""generate.py --prompts: a held-out file of prompts answered in batches, written in the file's order and scored.

What a user relies on: an answer does not depend on the prompts batched with it (the padding a batch needs changes
nothing), the answers line up with the file's lines, and every problem of the file is one line before the model loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer, GPT2Config,
                          MixtralConfig, PreTrainedTokenizerBase, T5Config)

from app.huggingface.generate import GenerateArgs, generate, model_input
from app.huggingface.generate_cli import main as generate_main
from app.prepare.chat import pair_messages
from app.prepare.corpus import Row
from tests.conftest import ROOT
from tests.test_preflight import incomplete_rope
from tests.test_seq2seq import t5_with_decoder_start

PROMPTS = ["def parse(", "import json\nclass Encoder:\n    def default(self, o):", "x = ", "    return",
           "def loads(s, *, cls=None, object_hook=None, parse_float=None):\n    \"\"\""]
NEW_TOKENS = 10


def model_folder(tiny, folder: Path, kind: str) -> Path:
    """A tiny decoder-only (Llama) or encoder-decoder (T5) model with the tiny tokenizer, in a folder. The T5's
    weights are drawn 3 times wider than T5's own initialisation, whose untrained model repeats one token."""
    torch.manual_seed(0)
    if kind == "llama":
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny.model_config))
    elif kind == "mixtral":  # trained with its router's loss, which generate() computed on a padded batch and raised
        vocab = len(AutoTokenizer.from_pretrained(tiny.tokenizer))
        model = AutoModelForCausalLM.from_config(MixtralConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
            max_position_embeddings=64, bos_token_id=1, eos_token_id=2))
    elif kind == "gpt2":  # learned positions: a left-padded prompt must still start at position 0
        vocab = len(AutoTokenizer.from_pretrained(tiny.tokenizer))
        model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4,
                                                            n_positions=64, bos_token_id=1, eos_token_id=2))
    else:
        t5 = t5_with_decoder_start(tiny, 2)
        t5.initializer_factor = 3.0
        model = AutoModelForSeq2SeqLM.from_config(T5Config.from_dict(t5.to_dict()))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny.tokenizer).save_pretrained(folder)
    return folder


def alone(folder: Path, prompt: str) -> tuple[str, str]:
    """generate.py's answer to one prompt, generated alone (no padding), split into its text and its last line."""
    written = generate(GenerateArgs(str(folder), prompt=prompt, temperature=0, max_new_tokens=NEW_TOKENS))
    text, ending = written.rsplit("\n", 1)
    return text.split("\n--> ", 1)[1] if "\n--> " in text else text[len(prompt):], ending


def make_one_answer_stop_early(folder: Path, prompt: str) -> int:
    """Makes a token that the greedy answer to `prompt` writes half-way the stop token of the model's generation config
    (instead of EOS, which the untrained T5 writes first), so that this answer ends before the others of its batch
    (which generate() then pads)."""
    from transformers import GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(folder)
    seq2seq = AutoConfig.from_pretrained(folder).is_encoder_decoder
    model = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(folder)
    inputs = model_input(tokenizer, prompt, False, model.config)  # as generate.py encodes it
    output = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                            pad_token_id=tokenizer.eos_token_id)[0].tolist()
    new = output[1:] if model.config.is_encoder_decoder else output[inputs["input_ids"].shape[1]:]
    stop = new[NEW_TOKENS // 2]
    config = GenerationConfig.from_model_config(model.config)
    config.eos_token_id = [stop]
    config.save_pretrained(folder)
    return stop


@pytest.mark.parametrize("kind", ["llama", "gpt2", "t5", "mixtral"])
def test_answers_in_batches_equal_answers_generated_alone_in_the_files_order(tiny, tmp_path, kind, capsys) -> None:
    """Prompts of 2 to 30 tokens in batches of 3 (left-padded for Llama and GPT-2, right-padded sources for T5), one
    answer ending at a stop token half-way while the rest of its batch goes on: each line of --output is the answer
    that prompt gets alone, and the scores count the one reference that equals its answer."""
    folder = model_folder(tiny, tmp_path / "model", kind)
    make_one_answer_stop_early(folder, PROMPTS[1])
    expected = [alone(folder, prompt) for prompt in PROMPTS]
    assert "stopped at" in expected[1][1] and f"({NEW_TOKENS} new tokens" in expected[0][1], expected
    references = [expected[0][0]] + ["not the answer"] * (len(PROMPTS) - 1)
    prompts = tmp_path / "test.jsonl"
    prompts.write_text("".join(json.dumps({"code": p, "summary": r}) + "\n" for p, r in zip(PROMPTS, references)))

    capsys.readouterr()
    generate_main([str(folder), "--prompts", str(prompts), "--prompt_field", "code", "--reference_field", "summary",
                   "--output", str(tmp_path / "answers.jsonl"), "--batch_size", "3", "--temperature", "0",
                   "--max_new_tokens", str(NEW_TOKENS)])
    records = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert [record["prompt"] for record in records] == PROMPTS
    assert [record["reference"] for record in records] == references
    assert [(record["generated"], f"({record['new_tokens']} new tokens, {record['stopped']})")
            for record in records] == expected
    out = capsys.readouterr().out
    assert f"wrote {len(PROMPTS)} answers to {tmp_path / 'answers.jsonl'}" in out
    assert f"{len(PROMPTS)} answers scored against 'summary': exact match {1 / len(PROMPTS):.4f} | ROUGE-1 " in out


def test_references_are_scored_as_their_tokens_decode_as_train_py_scores_its_samples(tiny, tmp_path, capsys) -> None:
    """A tokenizer that normalises (T5's NFKC) cannot write a full-width reference: the answer equal to it as far as
    the model can tell scored exact match 0 here and 1 in train.py, which decodes its references from their tokens.
    Special-token text in a reference is text, as in train.py's: decoded away, an answer without it scored 1."""
    folder = model_folder(tiny, tmp_path / "model", "llama")
    tokenizer_file = json.loads((folder / "tokenizer.json").read_text())
    tokenizer_file["normalizer"] = {"type": "NFKC"}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_file))
    settings = json.loads((folder / "tokenizer_config.json").read_text())  # a class of its own would build its own
    (folder / "tokenizer_config.json").write_text(json.dumps(settings | {"tokenizer_class": "PreTrainedTokenizerFast"}))
    answer, _ = alone(folder, PROMPTS[0])
    full_width = "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in answer)
    assert full_width != answer and any(c.isalnum() for c in answer), answer
    prompts = tmp_path / "test.jsonl"
    prompts.write_text(json.dumps({"code": PROMPTS[0], "summary": full_width}) + "\n")
    generate_main([str(folder), "--prompts", str(prompts), "--prompt_field", "code", "--reference_field", "summary",
                   "--temperature", "0", "--max_new_tokens", str(NEW_TOKENS)])
    assert "1 answers scored against 'summary': exact match 1.0000 | ROUGE-1 1.0000" in capsys.readouterr().out
    prompts.write_text(json.dumps({"code": PROMPTS[0], "summary": full_width + "</s>"}) + "\n")
    generate_main([str(folder), "--prompts", str(prompts), "--prompt_field", "code", "--reference_field", "summary",
                   "--temperature", "0", "--max_new_tokens", str(NEW_TOKENS)])
    assert "1 answers scored against 'summary': exact match 0.0000" in capsys.readouterr().out


def test_answers_for_a_folder_that_cannot_be_written_are_refused_before_any_is_generated(tiny, tmp_path, capsys,
                                                                                          read_only_folder) -> None:
    """Every prompt was answered (hours of a test set), then writing --output failed in a traceback: all lost."""
    prompts = tmp_path / "test.jsonl"
    prompts.write_text(json.dumps({"code": PROMPTS[0]}) + "\n")
    folder = model_folder(tiny, tmp_path / "model", "llama")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        generate_main([str(folder), "--prompts", str(prompts),
                       "--prompt_field", "code", "--output", str(read_only_folder / "answers.jsonl")])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.err == (
        f"generate.py: error: --output {read_only_folder / 'answers.jsonl'}: {read_only_folder} is not writable; "
        "give a file in a folder you can write to; see generate.py --help\n") and "answered" not in captured.err


def test_a_model_whose_config_transformers_finds_incomplete_is_one_line(tiny, tmp_path, capsys) -> None:
    folder = model_folder(tiny, tmp_path / "model", "llama")
    incomplete_rope(tiny, folder)
    with pytest.raises(SystemExit) as exit_info:
        generate_main([str(folder), "--prompt", "x"])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and (  # the keys are a set: in either order
        f"generate.py: error: MODEL {folder}: its config does not load (Missing required keys in `rope_parameters` for "
        "'rope_type'='llama3': {'") in error and "'}); fix its config.json; see generate.py --help\n" in error, error


def test_weights_that_do_not_fit_the_config_or_are_missing_and_a_count_of_0_are_one_line(tiny, tmp_path,
                                                                                         capsys) -> None:
    """Weights of other shapes than config.json's ended in transformers' RuntimeError; weights missing from the file
    were started at random, and the folder generated from them with exit 0; 0 attention heads divided by zero."""
    from safetensors.torch import load_file, save_file

    def refusal(folder: Path) -> str:
        with pytest.raises(SystemExit) as exit_info:
            generate_main([str(folder), "--prompt", "x", "--max_new_tokens", "2"])
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(lines) == 1, lines
        return lines[0]

    folder = model_folder(tiny, tmp_path / "model", "llama")
    capsys.readouterr()  # save_pretrained's progress
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"intermediate_size": config["intermediate_size"] * 2}))
    assert refusal(folder) == (f"generate.py: error: MODEL {folder}: its weights do not load (other shapes than its "
                               "config.json says); convert the checkpoint again (convert_to_hf.py) or copy the folder "
                               "again; see generate.py --help")
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(folder / "model.safetensors")
    save_file({name: tensor for name, tensor in weights.items() if "layers.1.mlp" not in name},
              folder / "model.safetensors", metadata={"format": "pt"})
    assert refusal(folder) == (f"generate.py: error: MODEL {folder}: its weights lack "
                               "model.layers.1.mlp.down_proj.weight and 2 more; convert the checkpoint again "
                               "(convert_to_hf.py) or copy the folder again; see generate.py --help")
    (folder / "config.json").write_text(json.dumps(config | {"num_attention_heads": 0}))
    assert refusal(folder).startswith(f"generate.py: error: MODEL {folder}: its config does not load (")


def test_an_mbart_decoder_starts_from_its_target_language_as_in_training(tiny, tmp_path) -> None:
    """mBART's labels end with the target language's code, which its shift puts first: train.py's samples start
    there, and generate.py started from the config's decoder_start_token_id (EOS), in no language it was trained
    for. A tokenizer whose targets end `</s> ro_RO`, as mBART-cc25's do."""
    from transformers import MBartConfig, PreTrainedTokenizerFast

    folder = tmp_path / "mbart"
    tokenizer = AutoTokenizer.from_pretrained(tiny.tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["ro_RO"]})
    language = tokenizer.convert_tokens_to_ids("ro_RO")
    tokenizer.save_pretrained(folder)
    tokenizer_file = json.loads((folder / "tokenizer.json").read_text())
    tokenizer_file["post_processor"] = {"type": "TemplateProcessing", "single": [
        {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "</s>", "type_id": 0}},
        {"SpecialToken": {"id": "ro_RO", "type_id": 0}}], "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
        "special_tokens": {name: {"id": name, "ids": [tokenizer.convert_tokens_to_ids(name)], "tokens": [name]}
                           for name in ("</s>", "ro_RO")}}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_file))
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(settings | {"tokenizer_class": "PreTrainedTokenizerFast"}))
    assert PreTrainedTokenizerFast.from_pretrained(folder)(text_target="x")["input_ids"][-2:] == [2, language]
    torch.manual_seed(0)
    config = MBartConfig(vocab_size=len(tokenizer), d_model=64, encoder_layers=1, decoder_layers=1,
                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                         max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         decoder_start_token_id=2, init_std=0.2)
    model = AutoModelForSeq2SeqLM.from_config(config).eval()
    model.save_pretrained(folder)
    source = model_input(AutoTokenizer.from_pretrained(folder), PROMPTS[0], False, config)
    started = {start: model.generate(**source, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                     decoder_start_token_id=start)[0, 1:].tolist() for start in (language, 2)}
    assert started[language] != started[2]
    written = generate(GenerateArgs(str(folder), prompt=PROMPTS[0], temperature=0, max_new_tokens=NEW_TOKENS))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert written.split("\n--> ", 1)[1].startswith(tokenizer.decode(
        up_to_stop(started[language]), skip_special_tokens=True)), (written, started)


def up_to_stop(tokens: list[int]) -> list[int]:
    return tokens[:tokens.index(2) + 1] if 2 in tokens else tokens


def test_an_answer_prints_under_a_locale_that_cannot_encode_it(tiny, tmp_path) -> None:
    """The U+FFFD of a byte-level token cut at --max_new_tokens (or any script the locale lacks) was a
    UnicodeEncodeError traceback under a GBK or Latin-1 locale."""
    folder = model_folder(tiny, tmp_path / "model", "llama")
    answer, _ = alone(folder, PROMPTS[0])
    assert "\ufffd" in answer, answer
    result = subprocess.run([sys.executable, "generate.py", str(folder), "--prompt", PROMPTS[0], "--temperature", "0",
                             "--max_new_tokens", str(NEW_TOKENS)], cwd=ROOT, capture_output=True, timeout=120,
                            env={**os.environ, "PYTHONIOENCODING": "latin-1"})
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    escaped = answer.encode("latin-1", "backslashreplace").decode()
    assert result.stdout.decode("latin-1").startswith(PROMPTS[0] + escaped)


def test_temperature_0_is_plain_greedy_whatever_the_base_models_generation_config_says(tiny, tmp_path) -> None:
    """A converted model keeps its base model's generation_config.json: its repetition_penalty (Qwen's 1.05) made 4 of
    6 greedy answers differ from the run's samples of the same checkpoint (argmax), which --reference_field's scores
    are compared with; beams, no-repeat n-grams and a minimum length would do the same."""
    from transformers import GenerationConfig

    plain = model_folder(tiny, tmp_path / "plain", "llama")
    inherited = model_folder(tiny, tmp_path / "inherited", "llama")
    GenerationConfig(bos_token_id=1, eos_token_id=2, repetition_penalty=2.0, no_repeat_ngram_size=2,
                     min_new_tokens=NEW_TOKENS).save_pretrained(inherited)
    assert [alone(inherited, prompt) for prompt in PROMPTS[:2]] == [alone(plain, prompt) for prompt in PROMPTS[:2]]


def test_the_answers_are_scored_before_the_output_is_written(tiny, tmp_path, monkeypatch) -> None:
    """Scoring a large test set takes seconds: a Ctrl-C there said "nothing was written" with --output written whole,
    and the rerun was refused for the file that exists. Here a stop during the scoring."""
    import app.huggingface.generate as generation

    folder = model_folder(tiny, tmp_path / "model", "llama")
    (tmp_path / "test.jsonl").write_text(json.dumps({"prompt": "def f(", "answer": "x"}) + "\n")

    def stopped(*args: object) -> str:
        raise SystemExit(130)

    monkeypatch.setattr(generation, "scores_line", stopped)
    with pytest.raises(SystemExit):
        generate_main([str(folder), "--prompts", str(tmp_path / "test.jsonl"), "--reference_field", "answer",
                       "--output", str(tmp_path / "answers.jsonl"), "--max_new_tokens", "2"])
    assert not (tmp_path / "answers.jsonl").exists()


def test_a_temperature_given_keeps_the_models_own_top_p_and_top_k() -> None:
    """Llama-3-Instruct samples at 0.6 among the top 0.9 of the probability: --temperature 1.0 sampled among the 50
    likeliest tokens instead, without a word."""
    from transformers import GenerationConfig

    from app.huggingface.generate import decoding

    instruct = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, top_k=None, eos_token_id=[1, 2],
                                repetition_penalty=1.05)
    chosen = decoding(GenerateArgs("m", temperature=1.0), instruct)
    assert (chosen.do_sample, chosen.temperature, chosen.top_p, chosen.top_k, chosen.eos_token_id) == (
        True, 1.0, 0.9, None, [1, 2])
    assert chosen.repetition_penalty is None, "the rest of a base model's config is left out"
    base = decoding(GenerateArgs("m", temperature=0.5), GenerationConfig(eos_token_id=2))
    assert (base.temperature, base.top_p, base.top_k) == (0.5, None, 50)
    assert decoding(GenerateArgs("m"), instruct) is instruct


def test_without_output_the_answers_are_printed_as_for_one_prompt(tiny, tmp_path, capsys) -> None:
    folder = model_folder(tiny, tmp_path / "model", "llama")
    (tmp_path / "test.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n\n" for p in PROMPTS[:2]))
    singles = [generate(GenerateArgs(str(folder), prompt=p, temperature=0, max_new_tokens=4)) for p in PROMPTS[:2]]
    capsys.readouterr()
    generate_main([str(folder), "--prompts", str(tmp_path / "test.jsonl"), "--temperature", "0",
                   "--max_new_tokens", "4"])
    captured = capsys.readouterr()
    assert captured.out == "\n\n".join(singles) + "\n"
    assert "answered 2 of 2 prompts" in captured.err


def test_a_tokenizer_without_pad_or_eos_still_generates(tiny, tmp_path) -> None:
    """The batch's padding fell back to the tokenizer's EOS only: without one, a single --prompt ended in a
    TypeError traceback (it generated before --prompts came)."""
    folder = model_folder(tiny, tmp_path / "model", "llama")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.eos_token = None
    tokenizer.save_pretrained(folder)
    assert AutoTokenizer.from_pretrained(folder).eos_token_id is None
    written = generate(GenerateArgs(str(folder), prompt="def f(", temperature=0, max_new_tokens=3))
    assert written.startswith("def f(") and written.endswith("(3 new tokens, --max_new_tokens reached)")


TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")
CHATS = [[{"role": "user", "content": "def f(x): return x"}, {"role": "assistant", "content": "Return x."}],
         [{"role": "system", "content": "Sum."}, {"role": "user", "content": "def g"},
          {"role": "assistant", "content": "No."}, {"role": "user", "content": "a + b"},
          {"role": "assistant", "content": "Add."}]]


def chat_model(tiny, folder: Path) -> Path:
    """The tiny Llama with TEMPLATE as its chat template."""
    model_folder(tiny, folder, "llama")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def answers_alone(folder: Path, prompts: list[list[dict[str, str]]]) -> list[str]:
    """Each chat's greedy answer of 4 tokens, generated alone with transformers."""
    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder).eval()
    answers = []
    for messages in prompts:
        inputs = model_input(tokenizer, messages, False, model.config)
        output = model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        answers.append(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    return answers


def test_held_out_chats_are_answered_from_the_messages_before_their_last_and_scored_against_it(tiny, tmp_path,
                                                                                                capsys) -> None:
    """A chat test set (prepare_data.py --messages_field's format): the model answers the last assistant message
    from everything before it, system message and earlier turns included, through the chat template."""
    folder = chat_model(tiny, tmp_path / "model")
    expected = answers_alone(folder, [chat[:-1] for chat in CHATS])
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))
    capsys.readouterr()
    generate_main([str(folder), "--prompts", str(tmp_path / "chats.jsonl"), "--messages_field", "messages",
                   "--output", str(tmp_path / "answers.jsonl"), "--temperature", "0", "--max_new_tokens", "4"])
    records = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["reference"], r["generated"]) for r in records] == [
        (chat[:-1], chat[-1]["content"], text) for chat, text in zip(CHATS, expected)]
    assert "2 answers scored against the last assistant message of 'messages': exact match 0.0000" in \
        capsys.readouterr().out

    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": CHATS[0][:1]}) + "\n")
    assert refusal([str(folder), "--prompts", str(tmp_path / "bad.jsonl"), "--messages_field", "messages"],
                   capsys) == (f"--prompts {tmp_path / 'bad.jsonl'}: line 1: 'messages' does not end with an "
                               "assistant message after a system or user one; the last assistant message is the "
                               "answer to score")
    # refused by prepare_data.py, it was answered: a template that skips the "human" role left the question out
    (tmp_path / "wild.jsonl").write_text(json.dumps({"messages": [{"role": "human", "content": "Weather?"},
                                                                  {"role": "assistant", "content": "Sunny."}]}) + "\n")
    assert refusal([str(folder), "--prompts", str(tmp_path / "wild.jsonl"), "--messages_field", "messages"],
                   capsys).startswith(f"--prompts {tmp_path / 'wild.jsonl'}: line 1: 'messages' has a message of role "
                                      "'human', not one of system, user, assistant")
    assert refusal([str(folder), "--prompts", str(tmp_path / "chats.jsonl"), "--messages_field", "messages",
                    "--reference_field", "x", "--chat"], capsys) == (
        "--messages_field: a chat is its own prompt (through the chat template) and its last message the reference; "
        "drop --reference_field, --chat")


TOOLS_TEMPLATE = ("{% if tools %}<tools>\n{{ tools | tojson }}\n{% endif %}{% for m in messages %}<{{ m['role'] }}>\n"
                  "{{ m['content'] }}{% for c in m.tool_calls or [] %}<call> {{ c.function.name }} "
                  "{{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]}


def tools_model(tiny, folder: Path) -> tuple[Path, PreTrainedTokenizerBase]:
    """The tiny Llama with TOOLS_TEMPLATE, and room for the tools' JSON (rotary: more than its 64 positions)."""
    model_folder(tiny, folder, "llama")
    config = AutoConfig.from_pretrained(folder)
    config.max_position_embeddings = 512
    config.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder, tokenizer


def test_a_chat_prompt_is_offered_the_tools_of_a_file(tiny, tmp_path, capsys) -> None:
    """generate.py --chat --tools FILE: a quick check of a tool-calling model asks with tools, as it was trained."""
    folder, tokenizer = tools_model(tiny, tmp_path / "model")
    (tmp_path / "tools.json").write_text(json.dumps([WEATHER]))
    written = generate(GenerateArgs(str(folder), prompt="Weather?", chat=True, tools=str(tmp_path / "tools.json"),
                                    temperature=0, max_new_tokens=4))
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    inputs = model_input(tokenizer, [{"role": "user", "content": "Weather?"}], False, model.config, [WEATHER])
    assert tokenizer.decode(inputs["input_ids"][0]).startswith("<tools>\n[{")
    output = model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert written.startswith("Weather?\n--> " + tokenizer.decode(output[0, inputs["input_ids"].shape[1]:],
                                                                   skip_special_tokens=True) + "\n(")
    for argv, message in [
        (["--tools", "{tools}"], "--tools offers tools to the chat of each prompt: add --chat true"),
        (["--chat", "true", "--tools", "{folder}/none.json"], "--tools {folder}/none.json: not readable as UTF-8 text"),
        (["--chat", "true", "--tools", "{bad}"], "--tools {bad}: not a JSON list of tool schemas (objects, as "
                                                 "OpenAI's tools)"),
        (["--chat", "true", "--tools", "{empty}"], "--tools {empty} offers no tools; drop --tools"),
        (["--prompts", "{tools}", "--messages_field", "m", "--tools", "{tools}"],
         "--tools: a chat of --messages_field offers its own (its 'tools' field); drop --tools")]:
        (tmp_path / "bad.json").write_text('{"name": "weather"}')
        (tmp_path / "empty.json").write_text("[]")
        fill = {"tools": tmp_path / "tools.json", "folder": tmp_path, "bad": tmp_path / "bad.json",
                "empty": tmp_path / "empty.json"}
        assert refusal([str(folder), *(item.format(**fill) for item in argv)], capsys).startswith(
            message.format(**fill))


def test_chats_with_tools_are_asked_with_them_and_a_call_is_scored_as_the_template_writes_it(tiny, tmp_path,
                                                                                              capsys) -> None:
    """A chat test set of prepare_data.py's tool calls: the prompt holds the tools the chat offers (and its earlier
    calls), and a last message that calls a tool is scored as the chat template writes the call, which is what the
    model learnt to write."""
    folder, tokenizer = tools_model(tiny, tmp_path / "model")
    user = {"role": "user", "content": "Weather in Paris?"}
    chats = [{"tools": [WEATHER], "messages": [user, CALL]},
             {"tools": json.dumps([WEATHER]), "messages": [user, CALL, {"role": "tool", "content": "18 C"},
                                                           {"role": "assistant", "content": "18 C."}]}]
    (tmp_path / "tools.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    capsys.readouterr()
    generate_main([str(folder), "--prompts", str(tmp_path / "tools.jsonl"), "--messages_field", "messages",
                   "--output", str(tmp_path / "answers.jsonl"), "--temperature", "0", "--max_new_tokens", "4"])
    records = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    prompts = [[user], [user, {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "content": "18 C"}]]
    assert [(r["prompt"], r["reference"]) for r in records] == [
        (prompts[0], '<call> weather {"city": "Paris"}'), (prompts[1], "18 C.")]
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    for prompt, record in zip(prompts, records):
        inputs = model_input(tokenizer, prompt, False, model.config, [WEATHER])
        asked = tokenizer.decode(inputs["input_ids"][0])
        assert asked.startswith('<tools>\n[{"type": "function", "function": {"name": "weather", "parameters"')
        assert asked.count('<call> weather {"city": "Paris"}') == (len(prompt) > 1)
        output = model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        assert record["generated"] == tokenizer.decode(output[0, inputs["input_ids"].shape[1]:],
                                                       skip_special_tokens=True)
    assert "2 answers scored against the last assistant message of 'messages'" in capsys.readouterr().out


def test_a_call_turn_that_starts_with_a_special_token_is_its_reference_and_a_template_without_tools_is_refused(
        tiny, tmp_path, capsys) -> None:
    """Mistral's call turn starts with its special [TOOL_CALLS]: the reference was cut there, empty. A template that
    writes no tools, or no calls, would ask without them and score against nothing: refused as prepare_data.py
    refuses such a row."""
    from app.cli import UsageError
    from app.huggingface.generate import with_reference
    from app.huggingface.prompts_file import read_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny.tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[AVAILABLE_TOOLS]"]})
    tokenizer.chat_template = (
        "{% if tools %}{{ '[AVAILABLE_TOOLS]' + tools | tojson }}{% endif %}{% for m in messages %}"
        "{% if m.tool_calls %}"
        "{{ '[TOOL_CALLS]' + m.tool_calls | map(attribute='function') | list | tojson + eos_token }}"
        "{% elif m.role == 'assistant' %}{{ m.content + eos_token }}{% else %}{{ '[INST]' + m.content + '[/INST]' }}"
        "{% endif %}{% endfor %}")
    prompts = tmp_path / "calls.jsonl"
    prompts.write_text(json.dumps({"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"}, CALL]}) + "\n")
    row, = read_prompts(prompts, "prompt", None, messages_field="messages")
    assert with_reference(tokenizer, row, "line 1").reference.strip() == (
        '[{"name": "weather", "arguments": {"city": "Paris"}}]')
    tokenizer.chat_template = TEMPLATE  # role and content only
    with pytest.raises(UsageError, match="line 1: its chat has a message \\(2\\) whose tool calls the chat template "
                                         "does not write whole"):
        with_reference(tokenizer, row, "line 1")
    folder = chat_model(tiny, tmp_path / "model")
    (tmp_path / "tools.json").write_text(json.dumps([WEATHER]))
    assert refusal([str(folder), "--chat", "true", "--tools", str(tmp_path / "tools.json"), "--prompt", "Hi"],
                   capsys) == (f"--tools {tmp_path / 'tools.json'}: the model's chat template does not write tools, so "
                               "it would be asked without them")
    # An earlier answer is context, rendered as inference renders it (Qwen3's leaves out its reasoning): not refused.
    tokenizer.chat_template = ("{% for m in messages %}{{ m.role + ': ' }}{% if loop.last and m.reasoning_content %}"
                               "{{ '<think>' + m.reasoning_content + '</think>' }}{% endif %}"
                               "{{ m.content + eos_token }}{% endfor %}"
                               "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    prompts.write_text(json.dumps({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "Sun."},
        {"role": "user", "content": "Paris?"}, {"role": "assistant", "content": "Rainy."}]}) + "\n")
    row, = read_prompts(prompts, "prompt", None, messages_field="messages")
    assert with_reference(tokenizer, row, "line 1").reference == "Rainy."
    prompts.write_text(json.dumps({"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Sunny."}]}) + "\n")
    row, = read_prompts(prompts, "prompt", None, messages_field="messages")
    with pytest.raises(UsageError, match="line 1: its chat offers tools \\(its 'tools' field\\) that the chat "
                                         "template does not write"):
        with_reference(tokenizer, row, "line 1")


def test_alpaca_style_prompts_are_asked_as_prepare_data_made_them(tiny, tmp_path, capsys) -> None:
    """A prompt/response test set with an input and a system field (Alpaca's): the model was trained on the chat
    prepare_data.py makes of a row (system message; prompt, blank line, input); generate.py asked the prompt alone,
    without a word, and scored those answers."""
    folder = chat_model(tiny, tmp_path / "model")
    rows = [{"instruction": "Summarise:", "input": "def f(): pass", "sys": "Be brief.", "output": "Nothing."},
            {"instruction": "Name it:", "input": None, "sys": "", "output": "f"}, {"instruction": "x", "output": "y"}]
    fields = {"prompt_field": "instruction", "response_field": "output", "input_field": "input", "system_field": "sys"}
    trained = [pair_messages({option: row.get(field) for option, field in fields.items()}, Row(fields, k, "x"))
               for k, row in enumerate(rows)]
    expected = answers_alone(folder, [chat[:-1] for chat in trained])
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    options = ["--prompts", str(tmp_path / "pairs.jsonl"), "--prompt_field", "instruction", "--input_field", "input",
               "--system_field", "sys"]
    generate_main([str(folder), *options, "--chat", "--reference_field", "output", "--output",
                   str(tmp_path / "answers.jsonl"), "--temperature", "0", "--max_new_tokens", "4"])
    records = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["generated"]) for r in records] == [(chat[:-1], text) for chat, text in zip(trained,
                                                                                                      expected)]
    assert trained[0][:-1] == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Summarise:\n\ndef f(): pass"}]
    assert refusal([str(folder), *options], capsys) == ("--input_field builds the chat prepare_data.py made of each "
                                                        "prompt/response row: add --chat true")


def refusal(argv: list[str], capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        generate_main(argv)
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("generate.py: error: ") and line.endswith("; see generate.py --help"), line
    return line[len("generate.py: error: "):-len("; see generate.py --help")]


def test_a_file_of_prompts_that_cannot_be_answered_is_one_line_before_the_model_loads(tiny, tmp_path,
                                                                                        capsys) -> None:
    folder = tmp_path / "model"  # a tokenizer and a config, no weights: each refusal comes before they would load
    folder.mkdir()
    AutoTokenizer.from_pretrained(tiny.tokenizer).save_pretrained(folder)
    AutoConfig.from_pretrained(tiny.model_config).save_pretrained(folder)
    prompts = tmp_path / "test.jsonl"

    def refused_file(text: str, *options: str) -> str:
        prompts.write_text(text)
        return refusal([str(folder), "--prompts", str(prompts), *options], capsys)

    good = json.dumps({"prompt": "def f(", "answer": "x"}) + "\n"
    not_an_object = f"--prompts {prompts}: line 2 is not a JSON object; give one object a line"
    assert refused_file(good + "{not json\n") == not_an_object
    assert refused_file(good + "[1]\n") == not_an_object
    assert refused_file(good + json.dumps({"text": "x"}) + "\n") == (
        f"--prompts {prompts}: line 2 has no field 'prompt' (--prompt_field); its fields: text")
    assert refused_file(good, "--reference_field", "summary") == (
        f"--prompts {prompts}: line 1 has no field 'summary' (--reference_field); its fields: prompt, answer")
    assert refused_file(json.dumps({"prompt": 3}) + "\n") == (
        f"--prompts {prompts}: line 1 has a int, not text, in 'prompt' (--prompt_field); its fields: prompt")
    assert refused_file(json.dumps({"prompt": "def f(", "answer": None}) + "\n", "--reference_field", "answer") == (
        f"--prompts {prompts}: line 1 has null in 'answer' (--reference_field); its fields: prompt, answer")
    assert refused_file("\n \n") == f"--prompts {prompts}: holds no prompts"
    too_long = refused_file(good + json.dumps({"prompt": "def f(x): return x " * 2}) + "\n" + good,
                            "--max_new_tokens", "40")  # checked on the longest prompt: its limit fits every line
    assert too_long.startswith("--max_new_tokens 40 passes a prompt of ") and too_long.endswith(
        f" tokens (line 2 of --prompts {prompts}, the longest) and the model's 64 positions (max_position_embeddings); "
        f"give at most {64 - int(too_long.split(' tokens (')[0].rsplit(' ', 1)[1])}"), too_long
    fills = refused_file(good + json.dumps({"prompt": "def f(x): return x " * 10}) + "\n")
    assert fills.startswith(f"line 2 of --prompts {prompts}, the longest is ") and fills.endswith(  # it named
        "as many as the model's 64 positions or more (max_position_embeddings), leaving none to answer in; shorten it"
    ), fills  # --max_new_tokens first, which is not what to change
    prompts.write_bytes(b'{"prompt": "caf\xe9"}\n')
    assert refusal([str(folder), "--prompts", str(prompts)], capsys).startswith(
        f"--prompts {prompts}: not readable as UTF-8 text (")


@pytest.mark.parametrize("argv, message", [
    (["--output", "a.jsonl"], "--output applies to a file of prompts: give --prompts FILE"),
    (["--reference_field", "summary"], "--reference_field applies to a file of prompts: give --prompts FILE"),
    (["--batch_size", "4"], "--batch_size applies to a file of prompts: give --prompts FILE"),
    (["--messages_field", "messages"], "--messages_field applies to a file of prompts: give --prompts FILE"),
    (["--prompts", "{file}", "--prompt", "def "],
     "--prompt and --prompts: give one prompt or a file of them, not both"),
    (["--prompts", "{folder}/missing.jsonl"], "--prompts {folder}/missing.jsonl: no such file; give a JSON lines file, "
                                              "one object a line"),
    (["--prompts", "{file}", "--batch_size", "0"], "--batch_size must be at least 1, got 0"),
    (["--temperature", "1e-39"], "--temperature must be 0 (greedy) or at least 0.0001, got 1e-39 (below it sampling "
                                 "is greedy decoding, and rounds to inf at 1e-39)"),  # a traceback from multinomial
    (["--temperature", "-1"], "--temperature must be 0 (greedy) or at least 0.0001, got -1.0"),
    (["--system_field", "s"], "--system_field applies to a file of prompts: give --prompts FILE"),
    (["--prompts", "{file}", "--messages_field", "m", "--input_field", "i"], "--messages_field: a chat is its own "
     "prompt (through the chat template) and its last message the reference; drop --input_field"),
    # it read the file as a config, and named the model folder as the option it did not know:
    (["--config", "{file}"], "unrecognized arguments: --config {file}"),
    (["--prompts", "{file}", "--output", "{file}"], "--output {file} exists; give a new file name (answers are never "
                                                    "overwritten)"),
    (["--prompts", "{file}", "--output", "{folder}/no/a.jsonl"], "--output {folder}/no/a.jsonl: its folder does not "
                                                                 "exist; create it first"),
])
def test_file_options_that_cannot_apply_are_refused_at_once(tmp_path, capsys, argv, message) -> None:
    """Before anything loads; an --output that exists is never written over (a finished test set's answers)."""
    file = tmp_path / "test.jsonl"
    file.write_text(json.dumps({"prompt": "x"}) + "\n")
    fill = {"file": str(file), "folder": str(tmp_path)}
    assert refusal([str(tmp_path), *(item.format(**fill) for item in argv)], capsys) == message.format(**fill)
    assert file.read_text() == json.dumps({"prompt": "x"}) + "\n"


def test_a_prompts_file_with_unicode_line_separators_inside_its_strings_is_read(tmp_path) -> None:
    """U+2028 (and U+0085, U+2029) are valid inside a JSON string, and generate.py's own --output writes them as
    they are: the file was cut there and refused as "line 1 is not a JSON object"."""
    from app.huggingface.prompts_file import read_prompts

    prompts = tmp_path / "prompts.jsonl"
    texts = ["a\u2028b", "c\u0085d\u2029e"]
    prompts.write_text("".join(json.dumps({"prompt": text}, ensure_ascii=False) + "\r\n" for text in texts),
                       encoding="utf-8")
    assert [row.prompt for row in read_prompts(prompts, "prompt", None)] == texts
    prompts.write_bytes(b'\xef\xbb\xbf{"prompt": "x"}\n')  # a byte-order mark, as Windows editors write: not line 1's
    assert [row.prompt for row in read_prompts(prompts, "prompt", None)] == ["x"]


def test_sharegpt_prompts_are_the_chats_of_role_and_content_prepare_data_trains(tmp_path) -> None:
    from app.huggingface.prompts_file import read_prompts

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"conversations": [{"from": "system", "value": "Be brief."},
                                                     {"from": "human", "value": "Hi."},
                                                     {"from": "gpt", "value": "Hello."}]}) + "\n")
    row, = read_prompts(prompts, "prompt", None, messages_field="conversations")
    assert row.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    assert row.reference == "Hello."


def test_a_chats_tools_are_read_from_the_field_tools_field_names(tmp_path, capsys) -> None:
    from app.cli import UsageError
    from app.huggingface.prompts_file import read_prompts

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"functions": [WEATHER], "messages": [{"role": "user", "content": "Paris?"},
                                                                        CALL]}) + "\n")
    row, = read_prompts(prompts, "prompt", None, messages_field="messages", tools_field="functions")
    assert row.tools == [WEATHER]
    with pytest.raises(UsageError, match="calls 'weather', which is not one of the tools it offers \\(count\\)"):
        prompts.write_text(json.dumps({"functions": [{"type": "function", "function": {"name": "count"}}],
                                       "messages": [{"role": "user", "content": "Paris?"}, CALL]}) + "\n")
        read_prompts(prompts, "prompt", None, messages_field="messages", tools_field="functions")
    assert refusal([str(tmp_path), "--prompt", "x", "--tools_field", "functions"], capsys) == (
        "--tools_field names the tools of each chat of --messages_field: give --prompts FILE --messages_field FIELD")


REASONING_CHAT_TEMPLATE = (  # Qwen3's way: the last answer's reasoning_content in a <think> block before its content
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and loop.last %}"
    "{{ '<think>\n' + (m.reasoning_content or '') + '\n</think>\n\n' }}{% endif %}{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def scripted_model(tiny, folder: Path, writes: list[str]) -> tuple[Path, PreTrainedTokenizerBase]:
    """The tiny Llama with REASONING_CHAT_TEMPLATE, made to write `writes` greedily after any chat prompt: its
    layers add nothing (zero output projections), so each position's hidden state is its token's embedding, one
    of orthogonal vectors for the prompt's last token and the tokens of `writes` (whole added tokens, each once),
    and lm_head maps each of those to the next (the last to EOS)."""
    model_folder(tiny, folder, "llama")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>", *writes])
    tokenizer.chat_template = REASONING_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    trigger = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                            return_dict=True)["input_ids"][-1]
    chain = [trigger, *tokenizer.convert_tokens_to_ids(writes), tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain) <= model.config.hidden_size, "each token of the chain names its next"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for dimension, (token, following) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token, dimension] = 1.0
            model.lm_head.weight[following, dimension] = 10.0
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    return folder, tokenizer


def test_a_reasoning_models_answers_are_scored_after_their_reasoning_block(tiny, tmp_path, capsys) -> None:
    """A reasoning model (Qwen3) writes `<think>...</think>` before its answer, and a test chat's reference is the
    answer: scored whole, the answer equal to the reference had exact match 0. The block is read from the chat
    template; --output keeps what the model wrote, its reasoning and its answer; one cut off while it reasoned has
    no answer."""
    folder, _ = scripted_model(tiny, tmp_path / "model", ["<think>", "Reasoning:sunny", "</think>", "Sunny."])
    chats = [[{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."}],
             [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "Sunny.", "reasoning_content": "It is."}]]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats))
    capsys.readouterr()
    generate_main([str(folder), "--prompts", str(tmp_path / "chats.jsonl"), "--messages_field", "messages",
                   "--output", str(tmp_path / "answers.jsonl"), "--temperature", "0", "--max_new_tokens", "8"])
    records = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    for record in records:
        assert (record["generated"], record["reasoning"], record["answer"]) == (
            "<think>Reasoning:sunny</think>Sunny.", "Reasoning:sunny", "Sunny.")
    assert ("2 answers scored against the last assistant message of 'messages' (the answers after their "
            "reasoning's </think>): exact match 1.0000 | ROUGE-1 1.0000") in capsys.readouterr().out
    generate_main([str(folder), "--prompts", str(tmp_path / "chats.jsonl"), "--messages_field", "messages",
                   "--output", str(tmp_path / "cut.jsonl"), "--temperature", "0", "--max_new_tokens", "3"])
    cut = [json.loads(line) for line in (tmp_path / "cut.jsonl").read_text().splitlines()]
    assert [(record["answer"], record["stopped"]) for record in cut] == [("", "--max_new_tokens reached")] * 2
    assert "exact match 0.0000 | ROUGE-1 0.0000" in capsys.readouterr().out


def test_the_reasoning_block_is_read_from_the_template_and_an_answer_without_one_is_scored_whole() -> None:
    from app.prepare.chat_template import DEFAULT_CHAT_TEMPLATE, ChatText, ReasoningBlock, reasoning_block
    from tests.test_prepare_supervised import QWEN3_AGENT_TEMPLATE

    assert reasoning_block(ChatText(QWEN3_AGENT_TEMPLATE, {})) == ReasoningBlock("<think>", "</think>")
    gpt_oss_like = ("{% for m in messages %}{{ m.role }}: {% if m.thinking %}[thinking] {{ m.thinking }} [/thinking]"
                    "{% endif %}{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    assert reasoning_block(ChatText(gpt_oss_like, {})) == ReasoningBlock("[thinking]", "[/thinking]")
    assert reasoning_block(ChatText(DEFAULT_CHAT_TEMPLATE, {"eos_token": "</s>"})) is None  # writes no reasoning
    after = "{% for m in messages %}{{ m.content }}{{ m.reasoning_content or '' }}|{% endfor %}"
    assert reasoning_block(ChatText(after, {})) is None  # after the answer: nothing to split off
    block = ReasoningBlock("<think>", "</think>")
    assert block.split("Paris.") == (None, "Paris.")  # no block: the whole answer
    assert block.split("<think>\nA map.\n</think>\n\nParis.") == ("A map.", "Paris.")
    assert block.split("A map.</think>Paris.") == ("A map.", "Paris.")  # opened by the prompt (DeepSeek-R1's)
    assert block.split("<think>\nA map and") == ("A map and", "")  # cut off while reasoning: no answer
