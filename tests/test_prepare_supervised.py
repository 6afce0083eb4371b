"""prepare_data.py for supervised fine-tuning (prompt/response pairs, chats) and source→target data, on the standard
library's own code→summary task: labels and masks, packing, padding, truncation, templates, and refusals."""

from __future__ import annotations

import io
import json
import logging
import logging.handlers
from pathlib import Path
from typing import NamedTuple

import datasets
import pyarrow
import pyarrow.parquet
import pytest
import sentencepiece
import torch
from datasets import Dataset, DatasetDict
from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM, MarianTokenizer, MBartTokenizer,
                          PreTrainedTokenizerBase)
from transformers.models.mbart.modeling_mbart import shift_tokens_right

from app.data import DataFormat
from app.prepare import PrepareArgs, prepare
from app.prepare.pipeline import summary
from app.prepare.args import UsageError
from app.prepare.chat_template import (DEFAULT_CHAT_TEMPLATE, ChatEncoder, ChatTemplate, check_template,
                                       end_of_turn_id)
from app.prepare.cli import main
from app.prepare.mask_audit import audit, check_audit
from app.prepare.pack_examples import best_fit_decreasing
from app.prepare.stdlib_tasks import code_summary_pairs
from app.prepare.tokenizer import train_tokenizer
from tests.test_prepare_data import (REPO, assert_earlier_output, isolated_datasets_cache,  # noqa: F401 (autouse)
                                     make_earlier_output, run_cli)

SPECIAL_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]
"""Llama-3's and ChatML's, added to a tokenizer trained here (nothing is downloaded)."""
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML writes a newline after each end-of-turn: it must stay untrained, the end-of-turn itself trained."""
SYSTEM = "You summarise Python code in one sentence."
FOLLOW_UP = "Shorter, please. A literal <|eot_id|> or </s> here is text."


@pytest.fixture(scope="module")
def pairs() -> list[dict[str, str]]:
    """About 120 real code→summary pairs from the stdlib's json and http packages."""
    return code_summary_pairs(("json", "http"))


@pytest.fixture(scope="module")
def work(tmp_path_factory, pairs) -> Path:
    """pairs.jsonl, chats.jsonl (two assistant turns each), a tokenizer without a chat template (`plain`) and the
    same with special tokens and a Llama-3-style template (`llama3`)."""
    work = tmp_path_factory.mktemp("sft")
    write_jsonl(work / "pairs.jsonl", pairs)
    chats = [{"messages": chat(pair), "id": i} for i, pair in enumerate(pairs)]
    write_jsonl(work / "chats.jsonl", chats)
    plain = train_tokenizer((text for pair in pairs for text in pair.values()), 600, seed=0)
    plain.save_pretrained(work / "plain")
    llama3 = AutoTokenizer.from_pretrained(work / "plain")
    llama3.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    llama3.chat_template = LLAMA3_TEMPLATE
    llama3.save_pretrained(work / "llama3")
    return work


def chat(pair: dict[str, str]) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": pair["code"]},
        {"role": "assistant", "content": pair["summary"]},
        {"role": "user", "content": FOLLOW_UP},
        {"role": "assistant", "content": pair["summary"].split()[0] + "."},
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


class Prepared(NamedTuple):
    rows: DatasetDict
    stats: dict
    tokenizer: PreTrainedTokenizerBase


def load_prepared(folder: Path) -> Prepared:
    stats = json.loads((folder / "stats.json").read_text())
    return Prepared(datasets.load_from_disk(str(folder)), stats, AutoTokenizer.from_pretrained(folder / "tokenizer"))


def prepared_by_the_cli(work: Path, command: str, output: str) -> Prepared:
    result = run_cli([*command.split(), "--output_dir", output], cwd=work)
    assert result.returncode == 0, result.stderr
    (work / f"{output}.stdout").write_text(result.stdout)
    (work / f"{output}.stderr").write_text(result.stderr)
    return load_prepared(work / output)


def sft(work: Path, name: str, **options) -> Prepared:
    """prepare() in process, by default on the pairs with the plain tokenizer."""
    options = {
        "input": [str(work / "pairs.jsonl")],
        "prompt_field": "code",
        "response_field": "summary",
        "tokenizer": str(work / "plain"),
        "block_size": 256,
        "val_fraction": 0.1,
        **options,
    }
    prepare(PrepareArgs(**options, output_dir=str(work / name)))
    return load_prepared(work / name)


def segments(row: dict) -> list[tuple[list[int], list[int]]]:
    """A packed row cut where position_ids restart at 0: each example's (input_ids, labels), then the padding run."""
    starts = [i for i, position in enumerate(row["position_ids"]) if position == 0] + [len(row["position_ids"])]
    for start, end in zip(starts, starts[1:]):
        assert row["position_ids"][start:end] == list(range(end - start)), "position_ids must count up per example"
    return [(row["input_ids"][s:e], row["labels"][s:e]) for s, e in zip(starts, starts[1:])]


def trained_runs(ids: list[int], labels: list[int]) -> list[list[int]]:
    """The maximal runs of trained positions, as token ids; a trained label must equal its input token."""
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label == -100:
            if current:
                runs.append(current)
            current = []
        else:
            assert label == token, "a trained label differs from its input token"
            current.append(token)
    return runs + ([current] if current else [])


@pytest.fixture(scope="module")
def packed_run(work) -> Prepared:
    """The issue's command for supervised data, through the real command line."""
    command = "--input pairs.jsonl --prompt_field code --response_field summary --tokenizer plain --block_size 256"
    return prepared_by_the_cli(work, f"{command} --val_fraction 0.1", "packed")


def test_packed_rows_hold_whole_examples_with_only_the_response_and_eos_trained(packed_run, pairs):
    rows, stats, tokenizer = packed_run
    assert stats["format"] == "supervised_packed" and stats["chat_template"] == "the default chat template"
    assert tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE, "the template used is saved with the tokenizer"
    expected = {
        f"<s>### User:\n{pair['code']}\n\n### Assistant:\n": pair["summary"] for pair in pairs
    }  # what the default template renders
    seen = []
    for split, counts in stats["splits"].items():
        table = rows[split]
        assert table.column_names == ["input_ids", "labels", "position_ids", "response_spans"]
        assert all(table.features[c].feature.dtype == "int32" for c in table.column_names)
        examples = truncated = 0
        for row in table:
            assert len(row["input_ids"]) == 256
            *members, tail = segments(row)
            if any(label != -100 for label in tail[1]):  # the row is full: its last segment is an example
                members.append(tail)
            else:  # the padding run: pad (EOS here) with label -100
                assert set(tail[0]) == {stats["pad_token_id"]}
            spans = row["response_spans"]
            assert len(spans) == 2 * len(members), "every example's response is recorded, the padding's is not"
            for (ids, labels), start, end in zip(members, spans[::2], spans[1::2]):
                assert labels[0] == -100, "the first token of a packed example must never be a target"
                (response,) = trained_runs(ids, labels)
                assert row["input_ids"][start:end] == response, "the recorded response is the trained one"
                prompt = tokenizer.decode(ids[: len(ids) - len(response)])
                assert prompt in expected, "an example was split across rows or its prompt is not masked"
                full = tokenizer(expected[prompt], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                if len(ids) == 256 and response != full:  # --too_long truncate (the default) cut its end
                    assert response == full[: len(response)]
                    truncated += 1
                else:  # EOS is trained, so that the model learns to stop
                    assert response == full and tokenizer.decode(response) == expected[prompt] + "</s>"
                seen.append(prompt)
                examples += 1
        assert examples == counts["kept"] == counts["examples"] - sum(counts["dropped"].values())
        assert truncated == counts["truncated"]
        assert counts["rows"] == len(table) and counts["tokens"] + counts["padding_tokens"] == 256 * len(table)
        assert counts["trained_tokens"] == sum(label != -100 for row in table["labels"] for label in row)
        roles = counts["loss_mask"]["roles"]
        assert counts["loss_mask"]["audited_examples"] == examples and set(roles) == {"user", "template", "assistant"}
        assert roles["user"]["trained"] == 0 and roles["assistant"]["trained_share"] == 1.0
        assert roles["template"]["trained"] == examples - truncated, "each EOS that ends a response, unless cut off"
    assert len(seen) == len(set(seen)), "an example was written twice"


def test_the_cli_says_what_it_kept_and_which_roles_it_trains(work, packed_run):
    train = packed_run.stats["splits"]["train"]
    progress, lines = [], (work / "packed.stdout").read_text().splitlines()
    while lines[0].startswith("prepare_data.py: "):
        progress.append(lines.pop(0))
    assert train["dropped"] == {"prompt_fills_block": 22}
    assert lines[0] == (f"train: {train['kept']:,} of {train['examples']:,} examples kept ({train['truncated']:,} "
                        f"truncated; dropped: prompt_fills_block 22), {train['rows']:,} rows, {train['tokens']:,} "
                        f"tokens, {train['trained_tokens']:,} trained, {train['padding_fraction']:.1%} padding")
    assert lines[1].startswith(f"  trained tokens by role ({train['kept']} examples audited): user 0% of ")
    assert lines[2] == (f"  22 examples ({22 / train['examples']:.0%}) dropped as prompt_fills_block: the prompt alone "
                        "fills --block_size, so no response token is kept: raise it"), "a fifth dropped, unexplained"
    assert lines[3].startswith("validation: ") and len(lines) == 7
    assert lines[5] == f"rendered with {packed_run.stats['chat_template']}", "a template that fell back is seen"
    assert lines[6] == "wrote packed (supervised_packed rows, tokenizer/, stats.json)"
    assert (work / "packed.stderr").read_text() == ""
    assert progress == [f"prepare_data.py: read pairs.jsonl (1 file): {train['examples']} training examples, 12 "
                        "validation examples",
                        "prepare_data.py: tokenizing and packing", "prepare_data.py: writing packed"], \
        "outside a terminal, a few lines of progress and no bars"


def test_packed_attention_and_loss_never_cross_examples(packed_run):
    """A Llama given a packed row with its position_ids computes the same summed loss as on each example alone."""
    row = packed_run.rows["train"].with_format("torch")[0]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=600, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()

    def summed_loss(ids: torch.Tensor, labels: torch.Tensor, **extra) -> torch.Tensor:
        trained = (labels[1:] != -100).sum()
        return model(input_ids=ids[None], labels=labels[None], **extra).loss * trained if trained else 0.0

    with torch.no_grad():
        packed = summed_loss(row["input_ids"], row["labels"], position_ids=row["position_ids"][None])
        starts = [*torch.nonzero(row["position_ids"] == 0).flatten().tolist(), 256]
        alone = sum(summed_loss(row["input_ids"][s:e], row["labels"][s:e]) for s, e in zip(starts, starts[1:]))
    assert len(starts) > 2, "the row must pack several examples"
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-4)


def test_packing_false_writes_one_unpadded_example_per_row(work):
    rows, stats, _ = sft(work, "padded", packing=False)
    assert stats["format"] == "supervised_padded"
    lengths = set()
    for split, counts in stats["splits"].items():
        assert rows[split].column_names == ["input_ids", "labels", "response_spans"]
        assert all(rows[split].features[c].feature.dtype == "int32" for c in rows[split].column_names)  # spans: int64
        assert len(rows[split]) == counts["kept"] == counts["rows"] and counts["padding_tokens"] == 0
        cut = 0
        for ids, labels in zip(rows[split]["input_ids"], rows[split]["labels"]):
            lengths.add(len(ids))
            assert len(ids) == len(labels) <= 256 and labels[0] == -100 and ids[0] == 1
            if ids[-1] != 2:  # cut by --too_long truncate; every other row ends with its trained EOS, unpadded
                assert len(ids) == 256 and labels[-1] == ids[-1]
                cut += 1
            assert labels[-1] == ids[-1]
        assert cut == counts["truncated"]
    assert len(lengths) > 10, "rows keep their own lengths"


def test_too_long_examples_are_truncated_or_dropped_and_counted(work):
    truncated_rows, truncated, _ = sft(work, "truncate", block_size=96, packing=False)
    dropped = sft(work, "drop", block_size=96, packing=False, too_long="drop").stats
    for split in ("train", "validation"):
        cut, left_out = truncated["splits"][split], dropped["splits"][split]
        assert cut["truncated"] > 0 and left_out["truncated"] == 0
        assert cut["truncated"] + cut["dropped"].get("prompt_fills_block", 0) == left_out["dropped"]["too_long"]
        assert left_out["kept"] + left_out["dropped"]["too_long"] == left_out["examples"] == cut["examples"]
    long_rows = [row for row in truncated_rows["train"] if len(row["input_ids"]) == 96 and row["input_ids"][-1] != 2]
    assert len(long_rows) >= truncated["splits"]["train"]["truncated"] > 0
    assert all(any(label != -100 for label in row["labels"]) for row in long_rows), "a cut keeps part of a response"


def test_a_chat_cut_inside_a_later_prompt_ends_with_the_last_trained_token(work):
    """--too_long truncate cut chats at --block_size, also inside the follow-up question: its first tokens were kept
    at the end of the example, untrained. The cut now ends with the answer before it, EOS included."""
    rows, stats, tokenizer = sft(work, "cut-chats", input=[str(work / "chats.jsonl")], prompt_field=None,
                                 response_field=None, messages_field="messages", packing=False, block_size=128)
    ends_at_first_answer = 0
    for ids, labels in zip(rows["train"]["input_ids"], rows["train"]["labels"]):
        assert labels[-1] == ids[-1], "an example ends with a trained token"
        if len(ids) < 128 and ids.count(tokenizer.eos_token_id) == 1:  # cut in the follow-up, or shorter than 128
            assert FOLLOW_UP[:7] not in tokenizer.decode(ids), "no untrained start of the follow-up"
            ends_at_first_answer += ids[-1] == tokenizer.eos_token_id
    assert ends_at_first_answer > 0 and stats["splits"]["train"]["truncated"] >= ends_at_first_answer


def test_what_a_chat_carries_beside_its_messages_is_refused_only_where_it_would_train_wrongly() -> None:
    """Tools written as JSON text offer none when they are "[]", and text that is not JSON is no tools; OpenAI reads
    "weight" on assistant messages only, as 0 or 1."""
    from app.prepare.chat import read_tools, tools_problem, untrained, weight_problem

    offered = (None, "", "[]", "null", [], '[{"type": "function"}]', [{"type": "function"}], "some tool")
    assert [read_tools(tools) for tools in offered] == [None] * 5 + [[{"type": "function"}]] * 2 + ["some tool"]
    assert [tools_problem(tools) is None for tools in offered] == [True] * 7 + [False]
    asked = [{"role": "user", "content": "q", "weight": 0}, {"role": "assistant", "content": "a", "weight": 1}]
    assert weight_problem(asked) is None and not any(map(untrained, asked))
    assert untrained({"role": "assistant", "content": "b", "weight": 0})
    assert [weight_problem([{"role": "assistant", "content": "b", "weight": weight}]) is None
            for weight in (0, 1, 0.0, None, 0.5, "0", 2)] == [True] * 4 + [False] * 3


def test_an_answer_with_weight_0_stays_in_the_chat_untrained_also_with_train_on_prompt(work, pairs, tmp_path):
    """OpenAI's `"weight": 0` marks an answer as context: it was refused (and before that, trained as any other)."""
    from app.prepare.mask_audit import UNTRAINED

    def weighted_chat(pair: dict[str, str]) -> list[dict]:  # a follow-up the loss-mask audit can read (no "</s>")
        system, user, first, _, second = chat(pair)
        return [system, user, {**first, "weight": 0}, {"role": "user", "content": "Shorter, please."}, second]

    chats = [{"messages": weighted_chat(pair)} for pair in pairs]
    weighted = write_jsonl(tmp_path / "weighted.jsonl", chats)
    summaries = {pair["summary"] for pair in pairs}
    seconds = {chat(pair)[-1]["content"] + "</s>" for pair in pairs}
    for train_on_prompt in (False, True):
        rows, stats, tokenizer = sft(work, f"weight-0-{train_on_prompt}", input=[str(weighted)], prompt_field=None,
                                     response_field=None, messages_field="messages", block_size=1024, packing=False,
                                     val_fraction=0.0, train_on_prompt=train_on_prompt)
        assert len(rows["train"]) == len(pairs)
        for row in rows["train"]:
            masked = tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label == -100])
            assert any(f"{summary}</s>" in masked for summary in summaries), "the first answer, untrained"
            if not train_on_prompt:
                (answer,) = trained_runs(row["input_ids"], row["labels"])
                assert tokenizer.decode(answer) in seconds, "the second answer alone"
        roles = stats["splits"]["train"]["loss_mask"]["roles"]
        assert roles[UNTRAINED]["tokens"] > 0 and roles[UNTRAINED]["trained"] == 0
        assert roles["assistant"]["trained_share"] == 1.0

    qwen3 = AutoTokenizer.from_pretrained(work / "llama3")  # renders an earlier answer otherwise once a chat goes on:
    qwen3.add_tokens(["<think>", "</think>"])  # two trained answers are refused, one trained after one untrained
    qwen3.chat_template = QWEN3_TEMPLATE  # is masked as at inference
    qwen3.save_pretrained(tmp_path / "qwen3")
    rows, _, _ = sft(work, "weight-0-qwen3", input=[str(weighted)], prompt_field=None, response_field=None,
                     messages_field="messages", tokenizer=str(tmp_path / "qwen3"), block_size=1024, packing=False,
                     val_fraction=0.0)
    at_inference = {qwen3.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in c["messages"]],
                                              tokenize=False) for c in chats}
    assert all(qwen3.decode(row["input_ids"]) in at_inference for row in rows["train"])
    # the untrained answer's turn must be found (masked under --train_on_prompt), or it comes after the trained one:
    # the template renders a turn found before another otherwise; every example was dropped, said as a generic refusal
    after = write_jsonl(tmp_path / "after.jsonl", [{"messages": [system, user, {**first, "weight": None}, follow_up,
                                                                 {**second, "weight": 0}]}
                                                   for system, user, first, follow_up, second in
                                                   (weighted_chat(pair) for pair in pairs)])
    for data, train_on_prompt in ((weighted, True), (after, False)):
        with pytest.raises(UsageError, match=f"it masks chats of one assistant turn only, .* and {len(pairs):,} chats "
                                             "have more than one; leave those out"):
            sft(work, f"weight-0-qwen3-{train_on_prompt}", input=[str(data)], prompt_field=None, response_field=None,
                messages_field="messages", tokenizer=str(tmp_path / "qwen3"), block_size=1024, packing=False,
                val_fraction=0.0, train_on_prompt=train_on_prompt)


def test_a_chat_file_whose_other_keys_look_like_an_agents_trace_is_read(work, tmp_path):
    """datasets 5 took rows with "source", "model" and "system_prompt" beside the messages for an agent's trace, which
    it reads with a package of its own: the file was refused, "An error occurred while generating the dataset"."""
    chat = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi, how can I help?"}]
    chats = write_jsonl(tmp_path / "traces.jsonl", [{"id": str(k), "source": "s", "model": "gpt-4o",
                                                     "system_prompt": "Be brief.", "messages": chat} for k in range(4)])
    _, stats, _ = sft(work, "traces", input=[str(chats)], prompt_field=None, response_field=None,
                      messages_field="messages", val_fraction=0.0)
    assert stats["splits"]["train"]["examples"] == 4


def test_train_on_prompt_trains_every_token_but_the_first_of_each_example(work, packed_run):
    rows, stats, _ = sft(work, "on_prompt", train_on_prompt=True)
    assert stats["train_on_prompt"] is True
    for row in rows["train"]:
        for ids, labels in segments(row):
            if set(labels) == {-100}:
                continue  # the padding run
            assert labels[0] == -100 and labels[1:] == ids[1:]
    roles = stats["splits"]["train"]["loss_mask"]["roles"]
    assert roles["user"]["trained_share"] == 1.0 == roles["assistant"]["trained_share"]
    on_prompt = DataFormat.of(work / "on_prompt").samples(rows["validation"], 100)
    only_responses = DataFormat.of(work / "packed").samples(packed_run.rows["validation"], 100)
    assert sorted(map(repr, on_prompt)) == sorted(map(repr, only_responses)) and len(on_prompt) > 5, \
        "generation samples prompt with the chat up to the response, not with the BOS alone"
    assert all(packed_run.tokenizer.decode(s.prompt).endswith("### Assistant:\n") for s in on_prompt)


def test_train_on_prompt_drops_the_examples_whose_cut_left_no_response_token(work):
    """--train_on_prompt trains the prompt too, so a cut that left only the prompt still had trained tokens and the
    example was kept: 81 of 118 examples trained their code as if it were the answer, with no answer."""
    counts = {on: sft(work, f"cut_on_prompt_{on}", block_size=96, packing=False, val_fraction=0.0,
                      train_on_prompt=on).stats["splits"]["train"] for on in (False, True)}
    assert counts[True]["dropped"] == counts[False]["dropped"] and counts[True]["dropped"]["prompt_fills_block"] > 0
    assert counts[True]["kept"] == counts[False]["kept"]


def test_multi_turn_chats_with_a_llama3_template_train_every_assistant_turn_through_eot(work, pairs):
    rows, stats, tokenizer = sft(
        work, "chats", input=[str(work / "chats.jsonl")], prompt_field=None, response_field=None,
        messages_field="messages", tokenizer=str(work / "llama3"), block_size=512, too_long="drop",
    )
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert tokenizer.chat_template == LLAMA3_TEMPLATE, "the tokenizer's own template is used and kept"
    assert stats["end_of_turn_token_id"] == eot == end_of_turn_id(tokenizer) != tokenizer.eos_token_id
    assert stats["fields"] == {"messages_field": "messages"} and stats["chat_template"].endswith("llama3")
    summaries = {pair["summary"] for pair in pairs}
    checked = 0
    for row in rows["train"]:
        for ids, labels in segments(row):
            if set(labels) == {-100}:
                continue
            first, second = trained_runs(ids, labels)
            assert first[-1] == second[-1] == eot
            assert tokenizer.decode(first[:-1]) in summaries
            assert tokenizer.decode(second[:-1]) == tokenizer.decode(first[:-1]).split()[0] + "."
            masked = tokenizer.decode([t for t, label in zip(ids, labels) if label == -100])
            assert SYSTEM in masked and FOLLOW_UP in masked and masked.count("assistant<|end_header_id|>") == 2
            assert ids.count(eot) == 5, "a literal <|eot_id|> in a message must stay text"
            checked += 1
    assert checked == stats["splits"]["train"]["kept"] > 50
    audit = stats["splits"]["train"]["loss_mask"]
    assert (audit["audited_examples"], audit["unaudited_examples"]) == (0, checked), \
        "a message holding special-token text is encoded piece by piece, which character offsets cannot follow"


def test_sharegpt_chats_are_prepared_as_the_same_chats_of_role_and_content(work, tmp_path):
    """ShareGPT's {from, value} messages (human, gpt, system), as many Hub datasets hold them, are the chats of
    {role, content} they stand for, byte for byte; a "weight" beside them is read as OpenAI's."""
    chats = [json.loads(line)["messages"] for line in (work / "chats.jsonl").read_text().splitlines()]
    renamed = {"user": "human", "assistant": "gpt", "system": "system"}
    as_sharegpt = [[{"from": renamed[m["role"]], "value": m["content"], **({"weight": 0} if k == 2 else {})}
                    for k, m in enumerate(chat)] for chat in chats]
    write_jsonl(tmp_path / "sharegpt.jsonl", [{"conversations": chat} for chat in as_sharegpt])
    write_jsonl(tmp_path / "openai.jsonl", [{"messages": [m | ({"weight": 0} if k == 2 else {})
                                                          for k, m in enumerate(chat)]} for chat in chats])
    prepared = [sft(work, name, input=[str(tmp_path / f"{name}.jsonl")], prompt_field=None, response_field=None,
                    messages_field=field, tokenizer=str(work / "llama3"), block_size=512)
                for name, field in (("sharegpt", "conversations"), ("openai", "messages"))]
    for split in ("train", "validation"):
        assert prepared[0].rows[split].to_dict() == prepared[1].rows[split].to_dict()
    assert prepared[0].stats["splits"]["train"]["kept"] > 50
    examples = [segment for row in prepared[0].rows["train"] for segment in segments(row) if set(segment[1]) != {-100}]
    assert {len(trained_runs(*example)) for example in examples} == {1}, "the first answer, weight 0, is not trained"


MISTRAL_TOOLS_TEMPLATE = (  # Mistral v0.3's way with tools: written before the last user message
    "{%- set ns = namespace(last=-1) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}"
    "{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}{%- for m in messages -%}"
    "{%- if loop.index0 == ns.last and tools -%}{{- '[TOOLS]' + tools | tojson -}}{%- endif -%}"
    "{%- if m.role == 'assistant' -%}{{- m.content -}}{%- for c in m.tool_calls or [] -%}"
    "{{- c.function.name + (c.function.arguments | tojson) -}}{%- endfor -%}{{- eos_token -}}"
    "{%- else -%}{{- '[INST]' + m.content + '[/INST]' -}}{%- endif -%}{%- endfor -%}")


def test_chats_a_template_renders_otherwise_once_they_go_on_are_dropped_and_said(work, pairs, tmp_path):
    """Mistral's template moves the tools to the last user message: a chat of two user messages cannot be masked,
    and is dropped; a split that loses 5% or more so says why (it was counted in stats.json alone)."""
    tokenizer = AutoTokenizer.from_pretrained(work / "llama3")
    tokenizer.chat_template = MISTRAL_TOOLS_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "mistral")
    tools = [{"type": "function", "function": {"name": "count_lines"}}]
    chats = [{"tools": tools, "messages": [{"role": "user", "content": pair["code"][:80]},
                                           {"role": "assistant", "content": pair["summary"]}]} for pair in pairs[:16]]
    chats += [{"tools": tools, "messages": [*chat["messages"], {"role": "user", "content": "Shorter?"},
                                            {"role": "assistant", "content": "Yes."}]} for chat in chats[:4]]
    write_jsonl(tmp_path / "mistral.jsonl", chats)
    stats = sft(work, "mistral-tools", input=[str(tmp_path / "mistral.jsonl")], prompt_field=None,
                response_field=None, messages_field="messages", tokenizer=str(tmp_path / "mistral"), block_size=1024,
                packing=False, val_fraction=0.0).stats
    assert stats["splits"]["train"]["kept"] == 16
    assert stats["splits"]["train"]["dropped"] == {"template_prefix_mismatch": 4}
    assert ("  4 examples (20%) dropped as template_prefix_mismatch: the chat template renders an earlier turn "
            "otherwise once the chat goes on") in summary(stats, "out")


def test_json_files_read_as_one_struct_give_no_tool_the_keys_of_another(work, pairs, tmp_path):
    """Two JSON-lines files in a folder are read with the first one's struct: the second file's tool (without a
    description, or `required`) came back with them as null, and was trained so."""
    tokenizer = AutoTokenizer.from_pretrained(work / "llama3")
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "tools-tokenizer")
    described = {"type": "function", "function": {"name": "count_lines", "description": "Lines of code.",
                                                   "parameters": {"type": "object", "properties": {
                                                       "code": {"type": "string"}}, "required": ["code"]}}}
    bare = {"type": "function", "function": {"name": "count_lines", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}}}}}
    chats = [{"tools": [tool], "messages": [
        {"role": "user", "content": pair["summary"]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "count_lines", "arguments": {"code": pair["code"][:20]}}}]}]}
        for tool, pair in zip([described] * 6 + [bare] * 6, pairs)]
    (tmp_path / "parts").mkdir()
    write_jsonl(tmp_path / "parts" / "part-0.jsonl", chats[:6])
    write_jsonl(tmp_path / "parts" / "part-1.jsonl", chats[6:])
    rows = sft(work, "two-files", input=[str(tmp_path / "parts")], prompt_field=None, response_field=None,
               messages_field="messages", tokenizer=str(tmp_path / "tools-tokenizer"), block_size=1024,
               packing=False, val_fraction=0.0).rows["train"]
    at_inference = [tokenizer.apply_chat_template(chat["messages"], tools=chat["tools"], tokenize=True,
                                                  return_dict=True)["input_ids"] for chat in chats]
    assert sorted(rows["input_ids"]) == sorted(at_inference)


def test_reasoning_beside_an_answer_is_trained_as_the_template_writes_it_and_refused_where_it_does_not(work, pairs,
                                                                                                        tmp_path):
    """Qwen3's template writes an assistant's `reasoning_content` before its answer: such chats are the same
    examples as those with the reasoning in the content, as at inference. A template that reads only the content
    (REASONING_TEMPLATE) would have trained the answer without it: refused."""
    tokenizer = AutoTokenizer.from_pretrained(work / "llama3")
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = REASONING_TEMPLATE.replace(  # Qwen3's: the field, else the content's <think> block
        "{%- if m.role == 'assistant' and '</think>' in m.content -%}"
        "{%- set reasoning = m.content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}",
        "{%- if m.role == 'assistant' and (m.reasoning_content is string or '</think>' in m.content) -%}"
        "{%- set reasoning = m.reasoning_content if m.reasoning_content is string else "
        "m.content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}")
    assert "reasoning_content" in tokenizer.chat_template
    tokenizer.save_pretrained(tmp_path / "qwen3")
    chats = {"field": [[{"role": "user", "content": pair["code"]},
                        {"role": "assistant", "content": pair["summary"], "reasoning_content": f"It reads {k}."}]
                       for k, pair in enumerate(pairs[:20])]}
    chats["content"] = [[user, {"role": "assistant", "content": f"<think>\n{answer['reasoning_content']}\n</think>"
                                                                f"\n\n{answer['content']}"}]
                        for user, answer in chats["field"]]
    rows = {}
    for name, messages in chats.items():
        write_jsonl(tmp_path / f"{name}.jsonl", [{"messages": chat} for chat in messages])
        rows[name] = sft(work, f"reasoning-{name}", input=[str(tmp_path / f"{name}.jsonl")], prompt_field=None,
                         response_field=None, messages_field="messages", tokenizer=str(tmp_path / "qwen3"),
                         block_size=1024, packing=False, val_fraction=0.0).rows["train"].to_dict()
    assert rows["field"] == rows["content"] and len(rows["field"]["input_ids"]) == 20
    at_inference = {tuple(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"])
                    for chat in chats["field"]}
    assert {tuple(ids) for ids in rows["field"]["input_ids"]} == at_inference
    assert all("It reads" in tokenizer.decode(trained_runs(ids, labels)[0])
               for ids, labels in zip(rows["field"]["input_ids"], rows["field"]["labels"]))
    tokenizer.chat_template = REASONING_TEMPLATE  # the content's <think> block only
    tokenizer.save_pretrained(tmp_path / "content-only")
    with pytest.raises(UsageError, match=r"row 1 of --input .*field.jsonl has a message \(2\) with reasoning in "
                                         "'reasoning_content' that the chat template does not write there"):
        sft(work, "reasoning-unwritten", input=[str(tmp_path / "field.jsonl")], prompt_field=None, response_field=None,
            messages_field="messages", tokenizer=str(tmp_path / "content-only"), val_fraction=0.0)
    context = [[*chat, {"role": "user", "content": "Shorter?"}, {"role": "assistant", "content": "Yes."}]
               for chat in chats["field"]]
    for chat in context:
        chat[1] = chat[1] | {"weight": 0}  # context, as inference renders it: its reasoning left out as there
    write_jsonl(tmp_path / "context.jsonl", [{"messages": chat} for chat in context])
    kept = sft(work, "reasoning-context", input=[str(tmp_path / "context.jsonl")], prompt_field=None,
               response_field=None, messages_field="messages", tokenizer=str(tmp_path / "content-only"),
               block_size=1024, val_fraction=0.0).stats["splits"]["train"]["kept"]
    assert kept == 20


TOOLS_TEMPLATE = (  # Qwen2.5's way with tools (Hermes' <tool_call>), reduced to it
    "{%- if tools -%}{{- '<|im_start|>system\n# Tools\n<tools>' -}}{%- for tool in tools -%}"
    "{{- '\n' + tool | tojson -}}{%- endfor -%}{{- '\n</tools><|im_end|>\n' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\n' + m.content -}}"
    "{%- for call in m.tool_calls or [] -%}{{- '<tool_call>\n{\"name\": \"' + call.function.name + '\", "
    "\"arguments\": ' + call.function.arguments | tojson + '}\n</tool_call>' -}}{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- elif m.role == 'tool' -%}{{- '<|im_start|>user\n<tool_response>\n' + m.content + "
    "'\n</tool_response><|im_end|>\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}")


def tool_chat(k: int, pair: dict[str, str], as_text: bool, own_nulls: bool = True) -> dict:
    """A chat that offers two tools and calls one, with its result, then answers: the two tools' schemas and
    arguments have other keys (a Parquet file gives every row the keys of all rows, as null); the arguments and the
    tools are objects, or `as_text` JSON text (OpenAI's arguments; and the calls). With `own_nulls`, a null
    argument and a schema's null default are the data's own. Keys are in the order a Parquet file keeps them (that of
    their first row), which templates write."""
    name, arguments = (("count_lines", {"code": pair["code"][:30]}) if k % 2
                       else ("find_name", {"pattern": "def", "limit": 3, **({"unit": None} if own_nulls else {})}))
    code = {"type": "string", **({"default": None} if own_nulls else {})}
    tools = [{"type": "function", "function": {"name": "count_lines", "parameters": {
                "type": "object", "properties": {"code": code}, "required": ["code"]}}},
             {"type": "function", "function": {"name": "find_name", "parameters": {"type": "object", "properties": {
                 "pattern": {"type": "string", "enum": ["def", "class"]}}}, "description": "Names in the code."}}]
    call = {"id": f"call{k}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments) if as_text else arguments}}
    return {"tools": json.dumps(tools) if as_text else tools, "messages": [
        {"role": "user", "content": pair["code"]},
        {"role": "assistant", "content": None, "tool_calls": json.dumps([call]) if as_text else [call]},
        {"role": "tool", "tool_call_id": f"call{k}", "content": f"result {k}: 7"},
        {"role": "assistant", "content": pair["summary"]}]}


def test_chats_that_call_tools_train_the_calls_and_answers_as_inference_renders_them(work, pairs, tmp_path):
    """Each example is the chat exactly as apply_chat_template renders it at inference, given its tools (the
    arguments and schemas of a Parquet file without the keys its structs added from other rows, the nulls of JSON
    text and of a JSON file's objects kept); the
    call and the answer are trained, through their end-of-turn; the tools, the question and the tool's result are
    not."""
    chats = [tool_chat(k, pair, as_text, own_nulls) for as_text, own_nulls in ((False, False), (True, True),
                                                                                (False, True))
             for k, pair in enumerate(pairs[:12])]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(chats[:12]), tmp_path / "objects.parquet")  # with nulls
    write_jsonl(tmp_path / "texts.jsonl", chats[12:24])
    write_jsonl(tmp_path / "objects.jsonl", chats[24:])
    tokenizer = AutoTokenizer.from_pretrained(work / "llama3")
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "tools-tokenizer")
    inputs = [str(tmp_path / name) for name in ("objects.parquet", "texts.jsonl", "objects.jsonl")]
    rows, stats, _ = sft(work, "tool-calls", input=inputs, prompt_field=None,
                         response_field=None, messages_field="messages", tokenizer=str(tmp_path / "tools-tokenizer"),
                         block_size=1024, packing=False, val_fraction=0.0)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for chat in chats:  # the calls as the chats hold them, for what follows
        chat["messages"][1]["tool_calls"] = json.loads(chat["messages"][1]["tool_calls"]) if isinstance(
            chat["messages"][1]["tool_calls"], str) else chat["messages"][1]["tool_calls"]
    expected, rendered = {}, []
    for chat in chats:
        tools = json.loads(chat["tools"]) if isinstance(chat["tools"], str) else chat["tools"]
        messages = [m | {"content": m["content"] or "", "tool_calls": [
            c | {"function": c["function"] | {"arguments": json.loads(c["function"]["arguments"])}}
            if isinstance(c["function"]["arguments"], str) else c for c in m["tool_calls"]]} if "tool_calls" in m
            else m for m in chat["messages"]]
        ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"]
        expected[tuple(ids)] = chat
        rendered.append(tuple(ids))
    assert stats["splits"]["train"]["kept"] == len(chats) == len(rows["train"])
    assert sorted(map(tuple, rows["train"]["input_ids"])) == sorted(rendered), "as inference renders each chat"
    for row in rows["train"]:
        chat = expected[tuple(row["input_ids"])]
        call, answer = trained_runs(row["input_ids"], row["labels"])
        arguments = chat["messages"][1]["tool_calls"][0]["function"]["arguments"]
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
        assert call[-1] == answer[-1] == im_end
        assert tokenizer.decode(call[:-1]) == (f'<tool_call>\n{{"name": "'
                                               f'{chat["messages"][1]["tool_calls"][0]["function"]["name"]}", '
                                               f'"arguments": {arguments}}}\n</tool_call>')
        assert tokenizer.decode(answer[:-1]) == chat["messages"][3]["content"]
        masked = tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label == -100])
        assert "<tools>" in masked and chat["messages"][2]["content"] in masked
    roles = stats["splits"]["train"]["loss_mask"]["roles"]
    assert roles["other"]["trained"] == roles["user"]["trained"] == 0 and roles["assistant"]["trained_share"] == 1
    renamed = [{"functions": chat["tools"], "messages": chat["messages"]} for chat in chats[12:24]]
    write_jsonl(tmp_path / "functions.jsonl", renamed)  # the tools under another field: --tools_field names it
    rows_named, stats, _ = sft(work, "tool-calls-named", input=[str(tmp_path / "functions.jsonl")], prompt_field=None,
                               response_field=None, messages_field="messages", tools_field="functions",
                               tokenizer=str(tmp_path / "tools-tokenizer"), block_size=1024, packing=False,
                               val_fraction=0.0)
    assert stats["fields"] == {"messages_field": "messages", "tools_field": "functions"}
    assert sorted(map(tuple, rows_named["train"]["input_ids"])) == sorted(rendered[12:24])


REASONING_TEMPLATE = (  # Qwen3's handling of an assistant's reasoning, reduced to it
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and '</think>' in m.content -%}"
    "{%- set reasoning = m.content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set answer = m.content.split('</think>')[-1].lstrip('\\n') -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + answer + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def test_reasoning_in_a_message_is_rendered_as_the_template_renders_it_at_inference(work, pairs):
    """Qwen3's <think> and </think> are ordinary added tokens its template names: transformers' sanitising marked
    them in the messages too, the template's split and strip missed them, and the trained chat (extra newlines around
    the reasoning) was not the one apply_chat_template gives at inference. Special-token text stays text."""
    tokenizer = AutoTokenizer.from_pretrained(work / "llama3")
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = REASONING_TEMPLATE
    tokenizer.save_pretrained(work / "reasoning")
    chats = [[{"role": "user", "content": pair["code"]},
              {"role": "assistant", "content": f"<think>\nIt reads {pair['code'].split()[1]}.\n</think>\n\n"
                                               f"{pair['summary']} A literal <|im_end|> stays text."}]
             for pair in pairs[:20]]
    write_jsonl(work / "reasoning.jsonl", [{"messages": messages} for messages in chats])
    rows, stats, _ = sft(work, "reasoning-data", input=[str(work / "reasoning.jsonl")], prompt_field=None,
                         response_field=None, messages_field="messages", tokenizer=str(work / "reasoning"),
                         block_size=1024, packing=False, val_fraction=0.0)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    at_inference = {tokenizer.apply_chat_template(messages, tokenize=False) for messages in chats}
    assert len(rows["train"]) == stats["splits"]["train"]["kept"] == 20
    for row in rows["train"]:
        assert tokenizer.decode(row["input_ids"]) in at_inference
        assert row["input_ids"].count(im_end) == 2, "the <|im_end|> inside the answer is text"
        assert tokenizer.convert_tokens_to_ids("</think>") in row["input_ids"]


QWEN3_TEMPLATE = (  # Qwen3's stock template, reduced to how it renders an answer after the last user message
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last_query and loop.last -%}"
    "{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + m.content + '<|im_end|>\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}")


def test_a_template_that_renders_a_turn_otherwise_once_the_chat_goes_on_masks_single_turn_chats(work, pairs):
    """Qwen3's stock template writes an empty reasoning block in the last answer only: a chat of one assistant turn
    is masked as at inference (it was refused, as the two-turn probe failed), a longer one is refused in one line."""
    tokenizer = AutoTokenizer.from_pretrained(work / "llama3")
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_TEMPLATE
    tokenizer.save_pretrained(work / "qwen3")
    rows, stats, _ = sft(work, "qwen3-pairs", tokenizer=str(work / "qwen3"), block_size=1024, packing=False,
                         val_fraction=0.0)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    answers = {tokenizer.decode(tokenizer(f"<think>\n\n</think>\n\n{pair['summary']}<|im_end|>",
                                          add_special_tokens=False)["input_ids"]) for pair in pairs}
    at_inference = {tokenizer.apply_chat_template([{"role": "user", "content": pair["code"]},
                                                   {"role": "assistant", "content": pair["summary"]}], tokenize=False)
                    for pair in pairs}
    assert len(rows["train"]) == stats["splits"]["train"]["kept"] == len(pairs)
    for row in rows["train"]:
        (answer,) = trained_runs(row["input_ids"], row["labels"])
        assert answer[-1] == end and tokenizer.decode(answer) in answers
        assert tokenizer.decode(row["input_ids"]) in at_inference
    with pytest.raises(UsageError) as refusal:
        sft(work, "qwen3-chats", input=[str(work / "chats.jsonl")], prompt_field=None, response_field=None,
            messages_field="messages", tokenizer=str(work / "qwen3"))
    assert str(refusal.value).startswith(
        f"the chat template of --tokenizer {work / 'qwen3'}: it masks chats of one assistant turn only, as it renders "
        "an earlier turn otherwise once the chat goes on (in a test chat of 4 messages, not your data's, at assistant "
        "message 2: ") and \
        f"and {len(pairs):,} chats have more than one; leave those out" in str(refusal.value)  # at once
    assert not (work / "qwen3-chats").exists()


QWEN3_AGENT_TEMPLATE = (  # Qwen3's stock template, reduced to the turns after the last user message, with reasoning
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}{%- for m in messages -%}{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\n' -}}"
    "{%- if loop.index0 > ns.last_query and (loop.last or m.reasoning_content) -%}"
    "{{- '<think>\n' + (m.reasoning_content or '') + '\n</think>\n\n' -}}{%- endif -%}{{- m.content -}}"
    "{%- for c in m.tool_calls or [] -%}{{- '<tool_call>' + c.function | tojson + '</tool_call>' -}}{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}")


def test_an_agents_turns_after_the_last_user_message_are_masked_under_qwen3s_template(work, pairs, tmp_path,
                                                                                      monkeypatch):
    """Qwen3's template writes an earlier turn otherwise once the chat goes on, so chats of more than one assistant
    turn were refused by their shape; an agent's turns after the last user message (a call with its reasoning, the
    tool's result, the answer with its own) it renders alike, and they are masked as at inference."""
    tokenizer = AutoTokenizer.from_pretrained(work / "llama3")
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_AGENT_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "qwen3-agent")
    call = {"type": "function", "function": {"name": "count_lines", "arguments": {"n": 1}}}
    chats = [[{"role": "user", "content": pair["code"]},
              {"role": "assistant", "content": "", "reasoning_content": "I count.", "tool_calls": [call]},
              {"role": "tool", "content": "7"},
              {"role": "assistant", "content": pair["summary"], "reasoning_content": "Seven lines."}]
             for pair in pairs[:20]]
    write_jsonl(tmp_path / "agent.jsonl", [{"messages": chat} for chat in chats])
    rows = sft(work, "qwen3-agent", input=[str(tmp_path / "agent.jsonl")], prompt_field=None, response_field=None,
               messages_field="messages", tokenizer=str(tmp_path / "qwen3-agent"), block_size=1024, packing=False,
               val_fraction=0.0).rows["train"]
    at_inference = [tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
                    for chat in chats]
    assert sorted(rows["input_ids"]) == sorted(at_inference)
    for ids, labels in zip(rows["input_ids"], rows["labels"]):
        calling, answering = trained_runs(ids, labels)
        assert tokenizer.decode(calling).startswith("<think>\nI count.\n</think>")
        assert tokenizer.decode(answering).startswith("<think>\nSeven lines.\n</think>")
    # A longer chat it renders otherwise, after the chats probed before encoding: refused once encoded, not dropped.
    monkeypatch.setattr("app.prepare.chat_template.PROBED_CHATS", 1)
    follow_up = [chats[0][0], {"role": "assistant", "content": "7."}, {"role": "user", "content": "Why?"},
                 {"role": "assistant", "content": "It counts."}]
    write_jsonl(tmp_path / "mixed.jsonl", [{"messages": chat} for chat in [*chats, follow_up]])
    with pytest.raises(UsageError, match="it masks chats of one assistant turn only, .* and 1 chat has an earlier turn "
                                         "it renders so; leave those out"):
        sft(work, "qwen3-mixed", input=[str(tmp_path / "mixed.jsonl")], prompt_field=None, response_field=None,
            messages_field="messages", tokenizer=str(tmp_path / "qwen3-agent"), block_size=1024, packing=False,
            val_fraction=0.0)
    assert not (work / "qwen3-mixed").exists()


def test_chat_template_file_overrides_the_tokenizers_and_is_saved(work):
    (work / "chatml.jinja").write_text(CHATML_TEMPLATE)
    template = str(work / "chatml.jinja")
    rows, stats, tokenizer = sft(work, "chatml", tokenizer=str(work / "llama3"), chat_template=template)
    assert tokenizer.chat_template == CHATML_TEMPLATE and stats["chat_template"].startswith("--chat_template")
    end, newline = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer("\n", add_special_tokens=False)
    for ids, labels in segments(rows["train"][0])[:-1]:
        (response,) = trained_runs(ids, labels)
        assert response[-1] == end, "the end-of-turn token is trained"
        assert ids[len(ids) - len(newline["input_ids"]) :] == newline["input_ids"] and labels[-1] == -100
    (work / "latin1.jinja").write_bytes(CHATML_TEMPLATE.replace("im_end", "fin_réglée").encode("latin-1"))
    with pytest.raises(UsageError) as refusal:  # it was said of --input
        sft(work, "latin1", chat_template=str(work / "latin1.jinja"))
    assert str(refusal.value) == f"--chat_template {work / 'latin1.jinja'}: not UTF-8 text; save it as UTF-8"
    assert not (work / "latin1").exists()


def test_an_example_the_template_cannot_mask_is_dropped_and_counted(work, pairs):
    """The template renders the whole chat differently when the response holds "Return": the prompt's tokens are
    then no prefix of the chat's, so those examples are left out, and counted."""
    condition = "messages[-1]['role'] == 'assistant' and 'Return' in messages[-1]['content']"
    (work / "moody.jinja").write_text(f"{{% if {condition} %}}! {{% endif %}}{DEFAULT_CHAT_TEMPLATE}")
    _, stats, _ = sft(work, "moody", chat_template=str(work / "moody.jinja"), block_size=1024, val_fraction=0)
    moody = sum("Return" in pair["summary"] for pair in pairs)
    assert 0 < moody < len(pairs)
    assert stats["splits"]["train"]["dropped"] == {"template_prefix_mismatch": moody}


def test_num_proc_2_writes_the_same_rows(work, packed_run):
    rows = sft(work, "two_processes", num_proc=2).rows
    assert rows["train"][:] == packed_run.rows["train"][:]
    assert rows["validation"][:] == packed_run.rows["validation"][:]


def test_input_and_system_fields_make_alpaca_style_chats(work, pairs):
    rows = [{"instruction": "Summarise:", "input": p["code"], "output": p["summary"], "sys": ""} for p in pairs]
    rows[0]["sys"] = "Be brief."
    write_jsonl(work / "alpaca.jsonl", rows)
    out, stats, tokenizer = sft(
        work, "alpaca", input=[str(work / "alpaca.jsonl")], prompt_field="instruction", response_field="output",
        input_field="input", system_field="sys", packing=False, val_fraction=0, block_size=1024,
    )
    texts = [tokenizer.decode(ids) for ids in out["train"]["input_ids"]]
    assert f"<s>### User:\nSummarise:\n\n{pairs[1]['code']}\n\n### Assistant:\n{pairs[1]['summary']}</s>" in texts
    assert sum(text.startswith("<s>### System:\nBe brief.\n\n### User:\n") for text in texts) == 1
    assert stats["fields"] == {
        "prompt_field": "instruction", "response_field": "output", "system_field": "sys", "input_field": "input"
    }
    audit = stats["splits"]["train"]["loss_mask"]
    roles = {role: (count["trained"], count["trained_share"]) for role, count in audit["roles"].items()}
    assert audit["audited_examples"] == len(out["train"]) and set(roles) == {"system", "user", "assistant", "template"}
    assert roles["system"] == roles["user"] == (0, 0.0) and roles["assistant"][1] == 1.0, roles
    assert roles["template"][0] == len(out["train"]), "the EOS that ends each response"


def test_own_validation_split_and_a_trained_tokenizer(work, pairs):
    own = DatasetDict(
        train=Dataset.from_dict({"q": [p["code"] for p in pairs[:-5]], "a": [p["summary"] for p in pairs[:-5]]}),
        validation=Dataset.from_dict({"q": [p["code"] for p in pairs[-5:]], "a": [p["summary"] for p in pairs[-5:]]}),
    )
    own.save_to_disk(str(work / "own"))
    rows, stats, tokenizer = sft(
        work, "own_out", input=[str(work / "own")], prompt_field="q", response_field="a", tokenizer=None,
        vocab_size=500, packing=False, too_long="drop",
    )
    assert stats["splits"]["validation"]["examples"] == 5 and stats["vocab_size"] == 500
    validation = {tokenizer.decode(ids) for ids in rows["validation"]["input_ids"]}
    endings = tuple(f"### Assistant:\n{pair['summary']}</s>" for pair in pairs[-5:])
    assert all(text.endswith(endings) for text in validation)
    assert len(validation) == stats["splits"]["validation"]["kept"] > 0


@pytest.fixture(scope="module")
def seq2seq_run(work) -> Prepared:
    """The issue's command for encoder-decoder data, through the real command line."""
    command = "--input pairs.jsonl --source_field code --target_field summary --tokenizer plain"
    limits = "--max_source_length 96 --max_target_length 12 --val_fraction 0.1"
    return prepared_by_the_cli(work, f"{command} {limits}", "seq2seq")


def test_seq2seq_rows_are_unpadded_sources_and_targets_ending_with_eos(seq2seq_run, pairs, work):
    rows, stats, tokenizer = seq2seq_run
    by_source = {tuple(encode(tokenizer, p["code"])): encode(tokenizer, p["summary"]) for p in pairs}
    assert stats["format"] == "seq2seq" and (stats["max_source_length"], stats["max_target_length"]) == (96, 12)
    truncated = targets_cut = 0
    for split, counts in stats["splits"].items():
        assert rows[split].column_names == ["input_ids", "labels"] and counts["rows"] == len(rows[split])
        for source, target in zip(rows[split]["input_ids"], rows[split]["labels"]):
            assert source[-1] == target[-1] == tokenizer.eos_token_id, "EOS is kept, also when truncated"
            assert len(source) <= 96 and len(target) <= 12
            full_source = next(s for s in by_source if list(s[: len(source) - 1]) == source[:-1])
            full_target = by_source[full_source]
            assert target[:-1] == full_target[: len(target) - 1]
            was_cut = len(full_source) > 96 or len(full_target) > 12
            assert was_cut == (list(full_source) != source or full_target != target)
            truncated += was_cut
            targets_cut += len(full_target) > 12
        assert counts["trained_tokens"] == sum(map(len, rows[split]["labels"]))
    assert truncated == sum(counts["truncated"] for counts in stats["splits"].values()) > 0
    assert targets_cut == sum(counts["target_truncated"] for counts in stats["splits"].values()) > 0, (
        "the references ROUGE scores against are cut: the summary says how many")
    train = stats["splits"]["train"]
    assert f"({train['truncated']:,} truncated, {train['target_truncated']:,} of them in the target; " in (
        work / "seq2seq.stdout").read_text()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, split_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]


def test_seq2seq_drop_and_trained_tokenizer(work):
    args = {"prompt_field": None, "response_field": None, "source_field": "code", "target_field": "summary"}
    limits = {"max_source_length": 160, "max_target_length": 24, "block_size": None}
    _, stats, tokenizer = sft(work, "s2s_drop", **args, **limits, too_long="drop", tokenizer=None, vocab_size=400)
    assert len(tokenizer) == stats["vocab_size"] == 400 and stats["format"] == "seq2seq"
    train = stats["splits"]["train"]
    assert set(train["dropped"]) <= {"source_too_long", "target_too_long"} and train["truncated"] == 0
    assert train["kept"] + sum(train["dropped"].values()) == train["examples"] and train["kept"] > 0


def marian_tokenizer(folder: Path, pairs: list[dict[str, str]]) -> Path:
    """A Marian tokenizer with a SentencePiece model of its own for each side (code → English), as opus-mt has."""
    folder.mkdir()
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    sides = (("source.spm", [p["code"] for p in pairs], 300), ("target.spm", [p["summary"] for p in pairs], 200))
    for name, texts, size in sides:
        model = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(text.replace("\n", " ") for text in texts), model_writer=model, vocab_size=size,
            minloglevel=2, pad_id=-1, bos_id=-1, eos_id=1, unk_id=0)
        (folder / name).write_bytes(model.getvalue())
        pieces = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
        for index in range(pieces.get_piece_size()):
            vocab.setdefault(pieces.id_to_piece(index), len(vocab))
    (folder / "vocab.json").write_text(json.dumps(vocab))
    files = [str(folder / name) for name in ("source.spm", "target.spm", "vocab.json")]
    MarianTokenizer(*files).save_pretrained(folder)
    return folder


@pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")
def test_seq2seq_targets_are_encoded_as_targets(work, pairs):
    """Marian encodes targets with the target language's SentencePiece model: labels are what it generates."""
    tokenizer_folder = marian_tokenizer(work / "marian", pairs)
    args = {"prompt_field": None, "response_field": None, "source_field": "code", "target_field": "summary"}
    limits = {"max_source_length": 4096, "max_target_length": 512, "block_size": None, "val_fraction": 0.0}
    rows, _, tokenizer = sft(work, "s2s_marian", **args, **limits, tokenizer=str(tokenizer_folder))
    assert rows["train"]["input_ids"] == [tokenizer(p["code"])["input_ids"] for p in pairs]
    targets = [tokenizer(text_target=p["summary"])["input_ids"] for p in pairs]
    assert targets != [tokenizer(p["summary"])["input_ids"] for p in pairs], "the two sides must differ to test this"
    assert rows["train"]["labels"] == targets


def test_mbart_targets_end_with_the_language_code_its_decoder_starts_from_also_when_truncated(work, pairs):
    """mbart-large-cc25 encodes "X </s> ro_RO" and its decoder reads the labels' last token first. An EOS was
    appended after the language code ("X </s> ro_RO </s>"), so the decoder started from </s>, and truncation cut
    the code off."""
    folder = work / "mbart"
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(text.replace("\n", " ") for p in pairs for text in p.values()), model_writer=model,
        vocab_size=400, minloglevel=2)
    folder.mkdir()
    (folder / "sentencepiece.model").write_bytes(model.getvalue())
    MBartTokenizer(vocab_file=str(folder / "sentencepiece.model"), src_lang="en_XX", tgt_lang="ro_RO").save_pretrained(
        folder)
    args = {"prompt_field": None, "response_field": None, "source_field": "code", "target_field": "summary"}
    rows, _, tokenizer = sft(work, "s2s_mbart", **args, max_source_length=64, max_target_length=8, block_size=None,
                             val_fraction=0.0, tokenizer=str(folder))
    eos, source_code, target_code = (tokenizer.convert_tokens_to_ids(t) for t in ("</s>", "en_XX", "ro_RO"))
    targets = [tokenizer(text_target=p["summary"])["input_ids"] for p in pairs]
    assert targets[0][-2:] == [eos, target_code], "the tokenizer's own frame"
    for source, target, full in zip(rows["train"]["input_ids"], rows["train"]["labels"], targets):
        assert source[-2:] == [eos, source_code] and target[-2:] == [eos, target_code]
        assert target == (full if len(full) <= 8 else full[:6] + full[-2:])
    assert any(len(full) > 8 for full in targets), "some targets must be cut to test this"
    decoder_inputs = shift_tokens_right(torch.tensor(rows["train"]["labels"][:1]), tokenizer.pad_token_id)
    assert decoder_inputs[0, 0] == target_code, "the decoder starts from the language code, as mBART trains"


def test_best_fit_decreasing_is_deterministic_and_fills_rows():
    lengths = torch.randint(1, 60, (2000,), generator=torch.Generator().manual_seed(0)).numpy()
    rows = best_fit_decreasing(lengths, 64, seed=3)
    assert rows == best_fit_decreasing(lengths, 64, seed=3) and rows != best_fit_decreasing(lengths, 64, seed=4)
    assert sorted(i for row in rows for i in row) == list(range(2000))
    assert max(sum(lengths[row]) for row in rows) <= 64
    assert lengths.sum() / (64 * len(rows)) > 0.97


REFUSED_BY_THE_CLI = {
    "missing prompt field": (["--prompt_field", "question", "--response_field", "summary"], "--prompt_field question"),
    "empty response": (["--input", "{bad}", "--prompt_field", "code", "--response_field", "summary"], "row 2"),
    "template masks every token": (
        ["--prompt_field", "code", "--response_field", "summary", "--chat_template", "{masking}"],
        "--chat_template",
    ),
    "block too small": (
        ["--prompt_field", "code", "--response_field", "summary", "--block_size", "8"], "--block_size 8"
    ),
    "missing target field": (["--source_field", "code", "--target_field", "title"], "--target_field title"),
    "empty target": (["--input", "{bad}", "--source_field", "code", "--target_field", "summary"], "--target_field"),
}
"""The refusals the issues name: nothing written, the output folder of --overwrite left as it was (the real
`python prepare_data.py` process is in tests/test_prepare_data.py)."""


@pytest.mark.parametrize("case", REFUSED_BY_THE_CLI)
def test_bad_supervised_input_is_refused_in_one_line_before_writing(case, work, pairs, tmp_path, capsys, monkeypatch):
    bad = write_jsonl(tmp_path / "bad.jsonl", [pairs[0], {**pairs[1], "summary": ""}])
    (tmp_path / "masking.jinja").write_text(
        "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    argv, expected = REFUSED_BY_THE_CLI[case]
    argv = [a.format(bad=bad, masking=tmp_path / "masking.jinja") for a in argv]
    if "--input" not in argv:
        argv += ["--input", str(work / "pairs.jsonl")]
    make_earlier_output(tmp_path / "out")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--tokenizer", str(work / "plain"), "--output_dir", "out", "--overwrite"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and expected in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "masking.jinja", "out"], "leftovers"
    assert_earlier_output(tmp_path / "out")


REFUSED = [
    (["--messages_field", "messages"], "--messages_field messages: no such field"),
    (["--source_field", "code", "--target_field", "summary", "--max_source_length", "8", "--too_long", "drop"],
     "--max_source_length 8 is too small for any example"),
    (["--prompt_field", "code"], "--response_field is missing"),
    (["--prompt_field", "code", "--response_field", "summary", "--messages_field", "m"], "one kind of record"),
    (["--source_field", "code", "--target_field", "summary", "--packing", "false"], "--packing applies only"),
    (["--packing", "false"], "--packing applies only"),
    (["--source_field", "code", "--target_field", "summary", "--block_size", "64"], "--block_size applies only"),
    # copied from a supervised command at the defaults' values, they were accepted without a word:
    (["--source_field", "code", "--target_field", "summary", "--block_size", "2048"], "--block_size applies only"),
    (["--source_field", "code", "--target_field", "summary", "--packing", "true"], "--packing applies only"),
    (["--prompt_field", "code", "--response_field", "summary", "--max_target_length", "128"], "--max_target_length"),
    (["--prompt_field", "code", "--response_field", "summary", "--max_source_length", "64"], "--max_source_length"),
    (["--system_field", "s"], "--system_field applies only"),
    (["--prompt_field", "code", "--response_field", "summary", "--chat_template", "no.jinja"], "--chat_template"),
    (["--prompt_field", "code", "--response_field", "summary", "--too_long", "cut"], "too_long"),
    (["--prompt_field", "code", "--response_field", "summary", "--input", "{folder}"], "plain-text files"),
    (["--prompt_field", "code", "--response_field", "n", "--input", "{numbers}"], "holds int 3"),
    (["--messages_field", "messages", "--input", "{no_assistant}"], "has no assistant message"),
    (["--messages_field", "messages", "--input", "{assistant_first}"], "starts with an assistant message"),
    (["--messages_field", "messages", "--input", "{not_chat}"], "is not a list of {role, content}"),
    (["--messages_field", "messages", "--input", "{null_result}"], "row 1 of --input {null_result} has a message (3) "
     "without a role and text content (null content only in an assistant's message that calls tools)"),
    # The default template writes role and content: the call would be trained without it, the tools not offered.
    (["--messages_field", "messages", "--input", "{tool_call}"], "row 1 of --input {tool_call} has a message (2) "
     "whose tool calls the chat template does not write whole (their names and arguments): the answer after them "
     "would be trained without them"),
    (["--messages_field", "messages", "--input", "{legacy_call}"], "row 1 of --input {legacy_call} has a message (2) "
     "with OpenAI's legacy function_call: write it as tool_calls"),
    (["--messages_field", "messages", "--input", "{bad_arguments}"], "row 1 of --input {bad_arguments} has a message "
     "(2) whose tool_calls are not a list of"),
    (["--messages_field", "messages", "--input", "{user_calls}"], "row 1 of --input {user_calls} has a message (1) "
     "with tool calls, which only an assistant message makes (role 'user')"),
    # A template that writes a call's name alone: the arguments would not be trained.
    (["--messages_field", "messages", "--input", "{tool_call}", "--chat_template", "{names_only}"], "row 1 of --input "
     "{tool_call} has a message (2) whose tool calls the chat template does not write whole (their names and "
     "arguments)"),
    # Llama-3.1's and Mistral's write only the calls of a message that makes some: its text would vanish.
    (["--messages_field", "messages", "--input", "{said_and_called}", "--chat_template", "{calls_only}"],
     "row 1 of --input {said_and_called} has a message (2) of role 'assistant' that the chat template does not render "
     "where it stands, beside its tool calls (a template that writes only the calls of such a message"),
    # Arguments written without tojson: a dict's repr, which no tool-call parser reads.
    (["--messages_field", "messages", "--input", "{tool_call}", "--chat_template", "{python_arguments}"], "row 1 of "
     "--input {tool_call} has a message (2) whose tool calls' arguments the chat template writes as Python"),
    (["--messages_field", "messages", "--input", "{unnamed_tool}"], "row 1 of --input {unnamed_tool} offers 'tools' "
     "that are not a list of tool schemas (JSON objects, or the JSON text of that list, each named by text)"),
    (["--messages_field", "messages", "--input", "{unoffered}"], "row 1 of --input {unoffered} has a message (2) that "
     "calls 'get_weather', which is not one of the tools it offers (count_lines): the call would be learnt for a tool "
     "the model is not shown"),
    # The template's own error, which it raises only when given the tools (a rendering without them said "it renders")
    (["--messages_field", "messages", "--input", "{flat_tools}", "--chat_template", "{calls_only}"],
     "row 1 of --input {flat_tools} is refused by the chat template (each tool needs a function); leave such chats "
     "out"),
    (["--prompt_field", "code", "--response_field", "summary", "--chat_template", "{mismatch}"],
     "are not a prefix of the whole chat's tokens, so the prompt cannot be masked (in a test chat of 4 "
     "messages, not your data's, at assistant message 2: "),
    # The default template writes no reasoning: the answer would be trained without the reasoning before it.
    (["--messages_field", "messages", "--input", "{reasoning}"], "row 1 of --input {reasoning} has a message (2) with "
     "reasoning in 'reasoning_content' that the chat template does not write there"),
    (["--messages_field", "messages", "--input", "{user_reasons}"], "row 1 of --input {user_reasons} has a message "
     "(1, role 'user') with 'thinking' that is not an assistant's reasoning as text"),
    # Gemma's template raises on a system message: the line named no row (and quoted the chat's first 40 characters)
    (["--messages_field", "messages", "--input", "{system}", "--chat_template", "{no_system}"],
     "--messages_field messages: row 2 of --input {system} is refused by the chat template (System role not "
     "supported); leave such chats out"),
    (["--messages_field", "messages", "--input", "{system}", "--chat_template", "{skips_system}"],
     "row 2 of --input {system} has a message (1) of role 'system' that the chat template does not render where it "
     "stands"),
    (["--prompt_field", "code", "--response_field", "summary", "--chat_template", "{no_eot}"], "never learn to stop"),
    (["--prompt_field", "code", "--response_field", "summary", "--chat_template", "{trains_users}"],
     "its masks train 15 of the 15 tokens of user messages in a two-turn chat"),
    (["--source_field", "code", "--target_field", "summary", "--max_target_length", "2"], "--max_target_length 2"),
    (["--messages_field", "messages", "--input", "{human}", "--chat_template", "{known_roles}"],
     "--messages_field messages: row 2 of --input {human} has a message (1) of role 'tool' that the chat template "
     "does not render"),
    # The dropped message's text is also elsewhere in the chat, as a question asked again or in its answer: a search
    # of the rendered chat for it found it there, and the answer was trained without its question.
    (["--messages_field", "messages", "--input", "{human_asks_again}", "--chat_template", "{known_roles}"],
     "row 1 of --input {human_asks_again} has a message (3) of role 'tool' that the chat template does not render"),
    (["--messages_field", "messages", "--input", "{human_quoted}", "--chat_template", "{known_roles}"],
     "row 1 of --input {human_quoted} has a message (1) of role 'tool' that the chat template does not render"),
    (["--prompt_field", "code", "--response_field", "summary", "--input", "{no_prompt}"],
     "--prompt_field code: row 2 of --input {no_prompt} is empty"),
    (["--prompt_field", "code", "--response_field", "summary", "--input", "{blank_prompt}"],
     "--prompt_field code: row 2 of --input {blank_prompt} is empty"),
    (["--messages_field", "messages", "--input", "{blank_user}"], "row 1 of --input {blank_user} has an empty user"),
    # Chats as they come: each was refused as "not a list of {role, content}" without saying why, or worse, trained:
    # a "gpt" answer never (a template wrote the role under its own name), an answer marked weight 0 as any other,
    # answers given tools without them.
    (["--messages_field", "conversations", "--input", "{sharegpt}"], "row 1 of --input {sharegpt} has a message of "
     "role 'observation', not one of system, user, assistant"),  # LLaMA-Factory's tool results, in ShareGPT's shape
    (["--messages_field", "messages", "--input", "{parts}"], "row 1 of --input {parts} has a message (1) whose content "
     "is a list of parts, not text: join its text parts into one string"),
    (["--messages_field", "messages", "--input", "{gpt}"], "row 1 of --input {gpt} has a message of role 'gpt', not "
     "one of system, user, assistant, tool, developer, ipython, function: only assistant messages are trained, and a "
     "template writes another role under its own name (write 'gpt' as 'assistant')"),
    (["--messages_field", "messages", "--input", "{weight_0}"], "row 1 of --input {weight_0} has no assistant message "
     "to train on: each has \"weight\": 0"),
    (["--messages_field", "messages", "--input", "{weight_half}"], "row 1 of --input {weight_half} has an assistant "
     "message (2) with \"weight\": 0.5: write 1 to train it or 0 to keep it as context only"),
    (["--messages_field", "messages", "--input", "{tools}"], "row 1 of --input {tools} offers tools (its 'tools' "
     "field) that the chat template does not write: the answers would be trained without them"),
    (["--messages_field", "messages", "--input", "{tools}", "--tools_field", "functions"],
     "--tools_field functions: no such field in --input {tools}; it has: "),
    (["--prompt_field", "code", "--response_field", "summary", "--tools_field", "tools"], "--tools_field applies only "
     "to --messages_field data"),
    (["--messages_field", "messages", "--input", "{not_tools}"], "row 1 of --input {not_tools} offers 'tools' that "
     "are not a list of tool schemas"),
    (["--messages_field", "messages", "--input", "{calls_as_text}"], "row 1 of --input {calls_as_text} has a message "
     "(2) whose tool_calls are not a list of"),  # read as JSON text, as OpenAI's arguments are: this one is not JSON
    (["--prompt_field", "code", "--response_field", "summary", "--input", "{bad_line}"],
     "could not read it as json: {bad_line} line 3, column 25: Expecting value"),
    (["--prompt_field", "code", "--response_field", "summary", "--input", "{bad_document}"],
     "could not read it as json: {bad_document} line 2, column 15: Expecting ',' delimiter"),
    (["--prompt_field", "code", "--response_field", "summary", "--input", "{not_objects}"],
     "{not_objects} line 2 is a JSON list, not an object"),
]


@pytest.mark.parametrize("argv, expected", REFUSED)
def test_bad_options_and_records_are_refused_in_one_line(argv, expected, work, tmp_path, capsys):
    files = {
        "folder": tmp_path / "texts",
        "no_assistant": write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}]),
        "assistant_first": write_jsonl(
            tmp_path / "b.jsonl",
            [{"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]}],
        ),
        "not_chat": write_jsonl(tmp_path / "c.jsonl", [{"messages": "hello"}]),
        "tool_call": write_jsonl(tmp_path / "t.jsonl", [{"messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "content": "18 C"}, {"role": "assistant", "content": "18 C in Paris."}]}]),
        "said_and_called": write_jsonl(tmp_path / "t6.jsonl", [{"messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "18 C"}, {"role": "assistant", "content": "18 C in Paris."}]}]),
        "unoffered": write_jsonl(tmp_path / "t7.jsonl", [{"tools": [{"type": "function", "function": {
            "name": "count_lines"}}], "messages": [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": {}}}]}]}]),
        "unnamed_tool": write_jsonl(tmp_path / "t11.jsonl", [{"tools": [{"type": "function", "function": {
            "name": {"x": 1}}}], "messages": [{"role": "user", "content": "Hi."},
                                              {"role": "assistant", "content": "Hi."}]}]),
        "python_arguments": tmp_path / "python_arguments.jinja",
        "flat_tools": write_jsonl(tmp_path / "t8.jsonl", [{"tools": [{"name": "get_weather"}], "messages": [
            {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Sunny."}]}]),
        "names_only": tmp_path / "names_only.jinja",
        "calls_only": tmp_path / "calls_only.jinja",
        "legacy_call": write_jsonl(tmp_path / "t2.jsonl", [{"messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": "{}"}},
            {"role": "assistant", "content": "18 C in Paris."}]}]),
        "bad_arguments": write_jsonl(tmp_path / "t3.jsonl", [{"messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": "{city: Paris}"}}]},
            {"role": "assistant", "content": "18 C in Paris."}]}]),
        "user_calls": write_jsonl(tmp_path / "t4.jsonl", [{"messages": [
            {"role": "user", "content": "Weather?", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
            {"role": "assistant", "content": "18 C in Paris."}]}]),
        "null_result": write_jsonl(tmp_path / "t10.jsonl", [{"messages": [
            {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": {}}}]},
            {"role": "tool", "content": None}, {"role": "assistant", "content": "Sunny."}]}]),
        "calls_as_text": write_jsonl(tmp_path / "t9.jsonl", [{"messages": [
            {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": "weather("},
            {"role": "assistant", "content": "Sunny."}]}]),
        "not_tools": write_jsonl(tmp_path / "t5.jsonl", [{"tools": "get_weather(city)", "messages": [
            {"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."}]}]),
        "numbers": write_jsonl(tmp_path / "n.jsonl", [{"code": "x = 1", "summary": "Set x.", "n": 3}]),
        "mismatch": tmp_path / "mismatch.jinja",
        "no_eot": tmp_path / "no_eot.jinja",
        "trains_users": tmp_path / "trains_users.jinja",
        "human": write_jsonl(tmp_path / "h.jsonl", [{"messages": [{"role": role, "content": "x = 1"},
                                                                  {"role": "assistant", "content": "Set x."}]}
                                                    for role in ("user", "tool")]),
        "known_roles": tmp_path / "known_roles.jinja",
        "human_asks_again": write_jsonl(tmp_path / "h2.jsonl", [{"messages": [
            {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because."},
            {"role": "tool", "content": "Why?"}, {"role": "assistant", "content": "I said: because."}]}]),
        "human_quoted": write_jsonl(tmp_path / "h3.jsonl", [{"messages": [
            {"role": "tool", "content": "Name"}, {"role": "assistant", "content": "Name: Bob"}]}]),
        "no_prompt": write_jsonl(tmp_path / "p.jsonl", [{"code": "x = 1", "summary": "Set x."}, {"summary": "Set y."}]),
        "blank_prompt": write_jsonl(tmp_path / "q.jsonl", [{"code": "x = 1", "summary": "Set x."},
                                                           {"code": " \n ", "summary": "Set y."}]),
        "bad_line": tmp_path / "line.jsonl",  # the reader of `datasets` names only a byte position in a block
        "bad_document": tmp_path / "document.json",
        "not_objects": tmp_path / "lists.jsonl",
        "blank_user": write_jsonl(tmp_path / "u.jsonl", [{"messages": [{"role": "user", "content": "  "},
                                                                       {"role": "assistant", "content": "Hi."}]}]),
        "sharegpt": write_jsonl(tmp_path / "sg.jsonl", [{"conversations": [
            {"from": "human", "value": "Hello."}, {"from": "observation", "value": "Hi."},
            {"from": "gpt", "value": "Hi."}]}]),
        "parts": write_jsonl(tmp_path / "pt.jsonl", [{"messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hello."}]},
            {"role": "assistant", "content": "Hi."}]}]),
        "gpt": write_jsonl(tmp_path / "g.jsonl", [{"messages": [
            {"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Weather?"}, {"role": "gpt", "content": "Sunny."}]}]),
        "weight_0": write_jsonl(tmp_path / "w.jsonl", [{"messages": [
            {"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Bad answer.", "weight": 0}]}]),
        "weight_half": write_jsonl(tmp_path / "wh.jsonl", [{"messages": [
            {"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Bad answer.", "weight": 0.5}]}]),
        "tools": write_jsonl(tmp_path / "tl.jsonl", [{"tools": [{"type": "function", "function": {"name": "f"}}],
                                                      "messages": [{"role": "user", "content": "Hello."},
                                                                   {"role": "assistant", "content": "Hi."}]}]),
        "reasoning": write_jsonl(tmp_path / "r.jsonl", [{"messages": [
            {"role": "user", "content": "Two plus two?"},
            {"role": "assistant", "content": "Four.", "reasoning_content": "Two and two make four."}]}]),
        "user_reasons": write_jsonl(tmp_path / "r2.jsonl", [{"messages": [
            {"role": "user", "content": "Two plus two?", "thinking": "Hm.", "reasoning_content": ""},
            {"role": "assistant", "content": "4"}]}]),
        "system": write_jsonl(tmp_path / "s.jsonl", [{"messages": [
            *([{"role": "system", "content": "Be brief."}] if with_system else []),
            {"role": "user", "content": "x = 1"}, {"role": "assistant", "content": "Set x."}]}
            for with_system in (False, True)]),
        "no_system": tmp_path / "no_system.jinja",
        "skips_system": tmp_path / "skips_system.jinja",
    }
    turns = ("{{ m['role'] + ':\n' + m['content'] + eos_token }}{% endfor %}"
             "{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}")
    (tmp_path / "no_system.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}" + turns)
    (tmp_path / "skips_system.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}" + turns)
    # Renders only the roles it knows, as Qwen's does with other roles: a "tool" message would vanish, its answer
    # trained alone.
    (tmp_path / "python_arguments.jinja").write_text(
        "{% for m in messages %}{{ m['role'] + ':\n' + m['content'] }}{% for c in m.tool_calls or [] %}"
        "{{ c.function.name }}{{ c.function.arguments }}{% endfor %}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}")
    (tmp_path / "names_only.jinja").write_text(
        "{% for m in messages %}{{ m['role'] + ':\n' + m['content'] }}{% for c in m.tool_calls or [] %}"
        "{{ 'call ' + c.function.name }}{% endfor %}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}")
    (tmp_path / "calls_only.jinja").write_text(
        "{% for t in tools or [] %}{% if t.function is not defined %}"
        "{{ raise_exception('each tool needs a function') }}{% endif %}{{ t.function.name + '\n' }}{% endfor %}"
        "{% for m in messages %}{{ m['role'] + ':\n' }}"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.name + (c.function.arguments | tojson) }}"
        "{% endfor %}{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}")
    (tmp_path / "known_roles.jinja").write_text(
        "{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}"
        "{{ m['role'] + ':\n' + m['content'] + eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}"
    )
    # Renders the last user message only when the assistant's answer follows: masked by prefixes, the user's message
    # falls inside the assistant's turn and is trained.
    (tmp_path / "trains_users.jinja").write_text(
        "{% for m in messages %}{% if not (loop.last and add_generation_prompt and m['role'] == 'user') %}"
        "{{ m['role'] + ': ' + m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
        "{{ '\n' }}{% endif %}{% endfor %}"
    )
    (tmp_path / "mismatch.jinja").write_text(
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}"
    )
    (tmp_path / "no_eot.jinja").write_text(
        "{% for m in messages %}{{ m['role'] + ':\n' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}"
    )
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "notes.txt").write_text("plain text")
    good = '{"code": "x = 1", "summary": "Set x."}'
    files["bad_line"].write_text(f'{good}\n{good}\n{{"code": "y", "summary":\n{good}\n')
    files["bad_document"].write_text(f'[{good},\n {{"code": "y" "summary": "Set y."}}]\n')
    files["not_objects"].write_text(f'{good}\n["y", "Set y."]\n')
    argv = [a.format(**files) for a in argv]
    for name, path in files.items():  # not format(): "{role, content}" is in a message
        expected = expected.replace(f"{{{name}}}", str(path))
    if "--input" not in argv:
        argv += ["--input", str(work / "pairs.jsonl")]
    logged = logging.handlers.BufferingHandler(capacity=100)  # datasets' loggers print to the terminal themselves
    logging.getLogger("datasets").addHandler(logged)
    try:
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--tokenizer", str(work / "plain"), "--output_dir", str(tmp_path / "out")])
    finally:
        logging.getLogger("datasets").removeHandler(logged)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and expected in lines[0], lines
    assert [record.getMessage() for record in logged.buffer] == [], "a second line: 'Failed to load JSON from file'"
    assert not (tmp_path / "out").exists()


NO_GENERATION_PROMPT = "{% for m in messages %}{{ m['role'] + ':\\n' + m['content'] + eos_token }}{% endfor %}"
"""Ignores add_generation_prompt: each assistant turn starts with its header, "assistant:"."""
LLAMA2_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)
"""Ignores add_generation_prompt too, but its prompt ends with the answer's cue, "[/INST]": nothing to train."""


def test_a_template_without_generation_prompt_is_refused_when_it_would_train_the_assistant_header(work):
    tokenizer = AutoTokenizer.from_pretrained(work / "plain")
    with pytest.raises(UsageError) as refusal:
        check_template(ChatEncoder(tokenizer, ChatTemplate(NO_GENERATION_PROMPT, "--chat_template t.jinja"), False))
    line = str(refusal.value)
    assert line.startswith("--chat_template t.jinja renders no generation prompt") and "'assistant:'" in line, line
    assert "add_generation_prompt branch" in line and "\n" not in line
    check_template(ChatEncoder(tokenizer, ChatTemplate(LLAMA2_TEMPLATE, "--chat_template llama2.jinja"), False))


def test_the_audit_finds_a_short_answer_in_its_turn_not_in_the_header(work):
    """"A" is also in "### Assistant:": the audit must find the answer after the header, and count it trained."""
    tokenizer = AutoTokenizer.from_pretrained(work / "plain")
    encoder = ChatEncoder(tokenizer, ChatTemplate(DEFAULT_CHAT_TEMPLATE, "the default chat template"), False)
    chats = [[{"role": "user", "content": "Which option? A, B, C or D"}, {"role": "assistant", "content": answer}]
             for answer in "ABCD"]
    examples = [{**vars(encoder.encode(chat)), "dropped": ""} for chat in chats]
    roles = audit(chats, examples, tokenizer, DEFAULT_CHAT_TEMPLATE)["roles"]
    assert roles["assistant"] == {"tokens": 4, "trained": 4, "trained_share": 1.0}, roles
    assert roles["template"]["trained"] == 4, "only the EOS that ends each answer"
    check_audit({"roles": roles}, "the default chat template", False, "four answers")


R1_TEMPLATE = (  # DeepSeek-R1's first published template (January 2025), its user and assistant branches
    "{{ bos_token }}{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{{ '<\uff5cUser\uff5c>' + message['content'] }}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}{% set content = message['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<\uff5cAssistant\uff5c>' + content + eos_token }}{%- endif %}{%- endfor -%}"
    "{% if add_generation_prompt %}{{ '<\uff5cAssistant\uff5c>' }}{% endif %}")
THINKING_TEMPLATE = (  # Qwen3-Thinking-2507's: the generation prompt opens the reasoning the answer goes on with
    "{%- for m in messages -%}{%- if m.role == 'assistant' and not m.content.startswith('<think>') -%}"
    "{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + m.content + '<|im_end|>\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n<think>\n' -}}{%- endif -%}")


def reasoning_chats(work: Path, pairs: list[dict[str, str]], template: str, name: str) -> tuple[Path, Path]:
    tokenizer = AutoTokenizer.from_pretrained(work / "llama3")
    tokenizer.add_tokens(["<think>", "</think>", "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"])
    tokenizer.chat_template = template
    tokenizer.save_pretrained(work / name)
    chats = [[{"role": "user", "content": pair["code"]},
              {"role": "assistant", "content": f"<think>\nIt reads {pair['code'].split()[1]}.\n</think>\n\n"
                                               f"{pair['summary']}"}] for pair in pairs[:20]]
    return write_jsonl(work / f"{name}.jsonl", [{"messages": messages} for messages in chats]), work / name


def test_a_template_that_drops_the_reasoning_of_an_answer_is_refused(work, pairs):
    """DeepSeek-R1's first template keeps what follows </think>: every check passed, the audit counted no
    assistant tokens at all, and the model learnt the answers without their reasoning (exit 0)."""
    data, tokenizer = reasoning_chats(work, pairs, R1_TEMPLATE, "r1")
    with pytest.raises(UsageError) as refusal:
        sft(work, "r1-data", input=[str(data)], prompt_field=None, response_field=None, messages_field="messages",
            tokenizer=str(tokenizer), block_size=1024, packing=False, val_fraction=0.0)
    assert str(refusal.value) == (
        f"--messages_field messages: row 1 of --input {data} has an assistant message (2) of which the chat template "
        "drops its reasoning (DeepSeek-R1's first template keeps only what follows </think>): the model would learn "
        "the answer without it; give a template that renders it whole with --chat_template FILE, or mark the message "
        "\"weight\": 0 to keep it as context only")
    assert not (work / "r1-data").exists()
    from app.prepare.chat import dropped_from_answer

    user, answer = {"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>r</think>A"}
    assert dropped_from_answer([user, answer], "<|user|>Q<|assistant|>A") == 1
    assert dropped_from_answer([user, answer | {"weight": 0}], "<|user|>Q<|assistant|>A") is None, "context only"
    trimmed = {"role": "assistant", "content": "  Answer.\n"}  # Llama-3's template trims each message
    assert dropped_from_answer([user, trimmed], "<|user|>Q<|assistant|>Answer.<|eot|>") is None


def test_the_audit_counts_an_answer_whose_start_the_generation_prompt_writes(work, pairs):
    """Qwen3-Thinking's generation prompt ends with <think>: the answer goes on from inside it, and the audit
    found no assistant message, counting every trained token as template text."""
    data, tokenizer = reasoning_chats(work, pairs, THINKING_TEMPLATE, "thinking")
    _, stats, _ = sft(work, "thinking-data", input=[str(data)], prompt_field=None, response_field=None,
                      messages_field="messages", tokenizer=str(tokenizer), block_size=1024, packing=False,
                      val_fraction=0.0)
    roles = stats["splits"]["train"]["loss_mask"]["roles"]
    assert roles["assistant"]["trained_share"] > 0.9 and roles["user"]["trained"] == 0, roles


def test_an_empty_answer_is_named_and_kept_as_context_with_weight_0(work, pairs, tmp_path):
    chat = [{"role": "user", "content": "Call the tool."}, {"role": "assistant", "content": "", "weight": 0},
            {"role": "user", "content": "Now answer."}, {"role": "assistant", "content": "Done."}]
    write_jsonl(tmp_path / "context.jsonl", [{"messages": chat}] * 10)
    _, stats, _ = sft(work, "empty-context", input=[str(tmp_path / "context.jsonl")], prompt_field=None,
                      response_field=None, messages_field="messages", tokenizer=str(work / "llama3"),
                      val_fraction=0.0)
    assert stats["splits"]["train"]["kept"] == 10
    write_jsonl(tmp_path / "empty.jsonl", [{"messages": [chat[0], {"role": "assistant", "content": " "}]}])
    with pytest.raises(UsageError) as refusal:
        sft(work, "empty-answer", input=[str(tmp_path / "empty.jsonl")], prompt_field=None, response_field=None,
            messages_field="messages", tokenizer=str(work / "llama3"), val_fraction=0.0)
    assert str(refusal.value).endswith(
        "has an empty assistant message (2); give it the answer to train, or \"weight\": 0 to keep it as context "
        "only, or leave the chat out")


def test_docs_show_the_default_template_verbatim():
    assert DEFAULT_CHAT_TEMPLATE.strip() in (REPO / "docs" / "prepare-data.md").read_text()


def test_empty_pairs_are_skipped_and_counted_when_asked(work, tmp_path, pairs):
    """WikiHow's CSV (seed 002's summarization data) has articles without text: one empty source refused the whole
    file, with no way to leave such rows out but editing it."""
    rows = [dict(pair) for pair in pairs[:40]]
    rows[3]["code"], rows[17]["summary"], rows[20]["code"] = "", "  ", None
    file = write_jsonl(tmp_path / "holes.jsonl", rows)
    for name, shape in (("pairs", {"prompt_field": "code", "response_field": "summary"}),
                        ("seq2seq", {"source_field": "code", "target_field": "summary", "prompt_field": None,
                                     "response_field": None, "block_size": None})):
        with pytest.raises(UsageError, match="row 4 of --input .* is empty; every example needs .*--empty_examples "
                                             "skip leaves such rows out, counted"):
            sft(work, f"refused-{name}", input=[str(file)], **shape)
        kept = sft(work, f"holes-{name}", input=[str(file)], empty_examples="skip", **shape).stats
        assert kept["empty_examples_skipped"] == 3 and kept["inputs"] == [f"{file} (1 file; 3 empty rows skipped)"]
        assert sum(split["examples"] for split in kept["splits"].values()) == 37
    assert "skipped 3 rows with an empty prompt, response, source or target (--empty_examples skip)" in summary(
        kept, "out")
    saved = tmp_path / "saved"  # a saved dataset's (or the Hub's) rows are counted as read too, not after the skip
    DatasetDict(train=Dataset.from_list(rows[:30]), validation=Dataset.from_list(rows[30:])).save_to_disk(str(saved))
    kept = sft(work, "holes-saved", input=[str(saved)], empty_examples="skip", prompt_field="code",
               response_field="summary").stats
    assert kept["inputs"] == [f"{saved} (train: 30 rows, own validation: 10 rows; 3 empty rows skipped)"]
