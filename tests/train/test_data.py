"""Data side of `deltafuse train`: generator, tokenizer, JSONL rules, loss masks, packing. No model needed."""

from __future__ import annotations

import json
import re

import pytest
import torch

from deltafuse.train import data, gsm, packing
from deltafuse.train.errors import TrainInputError
from deltafuse.train.tokenizer import build_byte_tokenizer

IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def write_lines(path, lines):
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    return str(path)


def test_generator_is_deterministic_and_its_arithmetic_is_right():
    a, b = gsm.generate(300, seed=3), gsm.generate(300, seed=3)
    assert a == b and a != gsm.generate(300, seed=4)
    assert len({r["prompt"] for r in a}) > 250  # varied, not one template repeated
    for row in a:
        steps = re.findall(r"<<([0-9+\-*/]+)=(\d+)>>", row["completion"])
        assert steps, row
        for expr, result in steps:
            assert eval(expr) == int(result), (expr, result)  # noqa: S307 (digits and + - * / only)
        final = int(row["completion"].rsplit("#### ", 1)[1])
        assert final == int(steps[-1][1])


def test_byte_tokenizer_round_trips_any_text(tok):
    text = "Zoë pays $12.50 → 3 * 4 = <<3*4=12>>12\n#### 12 \t日本"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert max(ids) < 256 and tok.decode(ids) == text
    assert len(tok) == 260 and tok.eos_token == IM_END and tok.pad_token_id not in ids


def test_prompt_completion_row_trains_on_completion_only(tok):
    row = {"prompt": "What is 2+3?", "completion": "2 + 3 = <<2+3=5>>5\n#### 5"}
    ids, labels, truncated = data.encode_row(tok, row, 4096)
    assert not truncated and len(ids) == len(labels)
    trained = tok.decode([i for i, l in zip(ids, labels) if l != data.IGNORE_INDEX])
    assert trained == row["completion"] + IM_END + "\n"
    assert "<|im_start|>user\nWhat is 2+3?" in tok.decode(ids)  # the chat template was used


def test_messages_row_trains_on_every_assistant_turn_only(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": "2"}, {"role": "user", "content": "and 2+2?"},
            {"role": "assistant", "content": "4"}]
    ids, labels, _ = data.encode_row(tok, {"messages": msgs}, 4096)
    spans, current = [], []
    for i, l in zip(ids, labels):
        if l != data.IGNORE_INDEX:
            current.append(i)
        elif current:
            spans.append(tok.decode(current))
            current = []
    spans += [tok.decode(current)] if current else []
    assert spans == ["2" + IM_END + "\n", "4" + IM_END + "\n"]


def test_without_chat_template_prompt_and_completion_are_joined(tok):
    tok2 = build_byte_tokenizer()
    tok2.chat_template = None
    ids, labels, _ = data.encode_row(tok2, {"prompt": "Q: 1+1? A: ", "completion": "2"}, 4096)
    assert tok2.decode(ids) == "Q: 1+1? A: 2" + IM_END
    assert tok2.decode([i for i, l in zip(ids, labels) if l != data.IGNORE_INDEX]) == "2" + IM_END


def test_long_rows_are_truncated_and_counted_and_rows_without_completion_dropped(tok):
    rows = [{"prompt": "p" * 10, "completion": "c" * 100}, {"prompt": "p" * 200, "completion": "c"},
            {"prompt": "p", "completion": "c"}]
    stats = data.DataStats()
    examples = data.encode_rows(tok, rows, 64, stats)
    assert stats.truncated == 2 and stats.dropped_no_completion == 1 and stats.examples == 2
    assert all(len(e["input_ids"]) <= 64 for e in examples)
    assert "truncated 2 row(s)" in "\n".join(stats.summary_lines(64))
    with pytest.raises(TrainInputError, match="no row keeps a completion token within --seq-len 8"):
        data.encode_rows(tok, rows[1:2], 8, data.DataStats())


@pytest.mark.parametrize("seq_len", [160, 700, 10**9])
def test_rows_encoded_in_batches_are_encoded_as_each_row_alone(tok, monkeypatch, seq_len):
    """Batches of several rows (some tokenised whole, some from a cut prefix; both row kinds) give every row the
    ids, labels and truncation it gets by itself, in order."""
    long = "".join(f"step {i}: 12 * {i} = <<12*{i}={12 * i}>>{12 * i} — ünïcode 日本\n" for i in range(200))
    rows = gsm.generate(9, seed=2) + [{"prompt": long, "completion": long[::-1]},
                                      {"messages": [{"role": "user", "content": "1+1?"},
                                                    {"role": "assistant", "content": long}]}]
    rows = rows[5:] + rows[:5]
    alone = [data.encode_row(tok, r, seq_len) for r in rows]
    monkeypatch.setattr(data, "ENCODE_BATCH_ROWS", 4)
    stats = data.DataStats()
    got = data.encode_rows(tok, rows, seq_len, stats)
    kept = [(ids, labels) for ids, labels, _ in alone if any(x != data.IGNORE_INDEX for x in labels[1:])]
    assert [(e["input_ids"], e["labels"]) for e in got] == kept
    assert stats.truncated == sum(t for *_, t in alone) and stats.examples == len(kept)


def test_the_trained_spans_may_touch_or_overlap():
    assert data._union([(5, 9), (0, 3), (3, 4), (8, 12), (20, 20)]) == [(0, 4), (5, 12)]


def test_ids_beyond_the_model_vocabulary_are_refused(tok):
    with pytest.raises(TrainInputError, match="vocabulary has only 100 entries"):
        data.encode_rows(tok, [{"prompt": "a", "completion": "b"}], 64, data.DataStats(), vocab_size=100)


# --- JSONL bad input ---------------------------------------------------------------------------------
def test_jsonl_loads_both_row_kinds_and_skips_blank_lines(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "a", "completion": "b"}), "",
                                              json.dumps({"messages": [{"role": "user", "content": "x"},
                                                                       {"role": "assistant", "content": "y"}]})])
    rows = data.load_jsonl(path)
    assert len(rows) == 2
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "a", "completion": "b"}).encode() + b"\r\n")
    assert data.load_jsonl(str(bom)) == [{"prompt": "a", "completion": "b"}]  # BOM and CRLF are fine


@pytest.mark.parametrize("line, problem", [
    ('{"prompt": "a", "completion": ', "not valid JSON"),
    ('["a", "b"]', "expected a JSON object, got list"),
    ('{"text": "a"}', "needs 'prompt' and 'completion', or 'messages'; it has keys: text"),
    ('{"prompt": "a", "completion": 3}', "'completion' must be a string, got int"),
    ('{"prompt": "a", "completion": ""}', "'completion' is empty"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
    ('{"messages": [{"role": "user"}]}', "messages[0] must be an object with string 'role' and 'content'"),
    (b'{"prompt": "\xff", "completion": "b"}', "not valid UTF-8"),
])
def test_a_bad_line_is_reported_with_its_number(tmp_path, line, problem):
    good = json.dumps({"prompt": "a", "completion": "b"})
    path = write_lines(tmp_path / "d.jsonl", [good, good, line, good])
    with pytest.raises(TrainInputError) as err:
        data.load_jsonl(path)
    msg = str(err.value)
    assert "line 3:" in msg and problem in msg and "--skip-bad-rows" in msg
    stats = data.DataStats()
    assert len(data.load_jsonl(path, skip_bad_rows=True, stats=stats)) == 3
    assert stats.bad_rows_skipped == 1 and stats.bad_row_lines == [3]


def test_missing_unreadable_and_empty_files(tmp_path):
    with pytest.raises(TrainInputError, match=r"--data '.*nope.jsonl': no such file"):
        data.load_jsonl(str(tmp_path / "nope.jsonl"))
    with pytest.raises(TrainInputError, match="is a directory; expected a JSONL file"):
        data.load_jsonl(str(tmp_path))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(TrainInputError, match="is empty: no JSONL rows"):
        data.load_jsonl(str(empty))
    allbad = write_lines(tmp_path / "bad.jsonl", ["{", "[]"])
    with pytest.raises(TrainInputError, match="all 2 rows are bad"):
        data.load_jsonl(allbad, skip_bad_rows=True)


def test_unreadable_file(tmp_path, monkeypatch):
    """A file that exists but cannot be opened (as root, permissions do not stop reads: simulate the error)."""
    import builtins

    path = write_lines(tmp_path / "locked.jsonl", [json.dumps({"prompt": "a", "completion": "b"})])
    real_open = builtins.open

    def deny(file, *args, **kwargs):
        if str(file) == path:
            raise PermissionError(13, "Permission denied", path)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", deny)
    with pytest.raises(TrainInputError, match=r"--data '.*locked.jsonl' cannot be read: Permission denied"):
        data.load_jsonl(path)


# --- packing -----------------------------------------------------------------------------------------
def test_pack_keeps_every_example_once_within_seq_len():
    lengths = [5, 17, 3, 30, 12, 9, 31, 1, 16, 16]
    examples = [{"input_ids": list(range(n)), "labels": list(range(n)), "id": i} for i, n in enumerate(lengths)]
    bins = packing.pack(examples, 32)
    assert sorted(e["id"] for b in bins for e in b) == list(range(len(lengths)))
    assert all(sum(len(e["input_ids"]) for e in b) <= 32 for b in bins)
    assert len(bins) == -(-sum(lengths) // 32)  # best-fit decreasing reaches the volume bound here
    assert packing.pack(examples, 32) == bins


def test_packed_collator_restarts_positions_and_masks_boundaries():
    bins = [[{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}],
            [{"input_ids": [6, 7, 8, 9], "labels": [-100, -100, 8, 9]}]]
    batch = packing.PackedCollator()(bins)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, 5, -100, -100, 8, 9]]
    assert "attention_mask" not in batch


def test_packed_collator_fills_rows_to_a_constant_width_with_a_sequence_of_its_own():
    bins = [[{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}],
            [{"input_ids": [6, 7, 8, 9], "labels": [-100, -100, 8, 9]}]]
    batch = packing.PackedCollator(pad_token_id=0, row_tokens=6)(bins)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, 5, -100, -100, 8, 9, -100, -100, -100]]
    full = packing.PackedCollator(pad_token_id=0, row_tokens=3)([[{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}]])
    assert full["input_ids"].tolist() == [[1, 2, 3]] and full["position_ids"].tolist() == [[0, 1, 2]]
    with pytest.raises(ValueError, match="more than row_tokens=2"):
        packing.PackedCollator(pad_token_id=0, row_tokens=2)(bins)
    with pytest.raises(ValueError, match="needs a pad_token_id"):
        packing.PackedCollator(row_tokens=6)


def test_padded_collator():
    batch = packing.PaddedCollator(pad_token_id=0)([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
                                                 {"input_ids": [4], "labels": [4]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 2, 3], [4, -100, -100]]
    assert batch["input_ids"].dtype == torch.long


def test_templates_that_rewrite_earlier_turns_still_mask_assistant_content():
    """A template that drops reasoning from earlier assistant turns (as Qwen3's does) is not prefix-stable."""
    tok = build_byte_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    msgs = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert data._assistant_spans_incremental(tok, msgs, text) is None
    ids, labels, _ = data.encode_row(tok, {"messages": msgs}, 4096)
    trained = tok.decode([i for i, l in zip(ids, labels) if l != data.IGNORE_INDEX])
    assert trained == "2" + IM_END + "4" + IM_END


def _bfd_reference(lengths: list[int], cap: int) -> list[list[int]]:
    """Best-fit decreasing, the plain O(n x bins) way: scan every bin for the least room that fits."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins, room = [], []
    for i in order:
        fits = [b for b in range(len(bins)) if room[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (room[b], b))
            bins[b].append(i)
            room[b] -= lengths[i]
        else:
            bins.append([i])
            room.append(cap - lengths[i])
    return [sorted(b) for b in bins]


def _optimal_bins(lengths: list[int], cap: int) -> int:
    """The fewest bins (exhaustive search; small inputs only)."""
    items = sorted(lengths, reverse=True)
    best = [len(items)]

    def place(k, rooms):
        if len(rooms) >= best[0]:
            return
        if k == len(items):
            best[0] = len(rooms)
            return
        seen = set()
        for b, r in enumerate(rooms):
            if r >= items[k] and r not in seen:
                seen.add(r)
                rooms[b] -= items[k]
                place(k + 1, rooms)
                rooms[b] += items[k]
        place(k + 1, rooms + [cap - items[k]])

    place(0, [])
    return best[0]


def _as_examples(lengths):
    return [{"input_ids": [7] * n, "labels": [7] * n, "id": i} for i, n in enumerate(lengths)]


@pytest.mark.parametrize("seed", range(40))
def test_pack_is_best_fit_decreasing_within_its_bound(seed):
    import random

    rng = random.Random(seed)
    cap = rng.choice([8, 13, 32, 100])
    lengths = [rng.randint(1, cap) for _ in range(rng.randint(1, 10))]
    bins = packing.pack(_as_examples(lengths), cap)
    ids = [[e["id"] for e in b] for b in bins]
    assert ids == _bfd_reference(lengths, cap)
    assert sorted(i for b in ids for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= cap for b in ids)
    assert len(bins) <= 11 / 9 * _optimal_bins(lengths, cap) + 6 / 9


def test_pack_80k_rows_is_valid_and_fast():
    import random
    import time

    rng = random.Random(0)
    cap = 4096
    lengths = [min(cap, int(rng.lognormvariate(5.5, 1.0)) + 2) for _ in range(80_000)]
    examples = _as_examples(lengths)
    t0 = time.perf_counter()
    bins = packing.pack(examples, cap)
    elapsed = time.perf_counter() - t0
    ids = [e["id"] for b in bins for e in b]
    assert sorted(ids) == list(range(len(lengths)))
    assert all(sum(len(e["input_ids"]) for e in b) <= cap for b in bins)
    lower = -(-sum(lengths) // cap)
    assert lower <= len(bins) <= lower + lower // 100 + 1  # short rows: within 1% of the volume bound
    assert elapsed < 10, f"packing 80,000 rows took {elapsed:.1f} s"
